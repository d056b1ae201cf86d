"""Every trained turn's context is the prompt's own ids: ``tokenizer(prompt, add_special_tokens=False)``.

A sequence is tokenized whole once, and the ids before a trained turn are taken as its context where
no token straddles the turn's start. That is not enough where a pre-tokenizer looks ahead: GPT-2's
``\\s+(?!\\S)`` (and Llama-3's and Qwen2.5's, which share it) splits ``"\\n\\n"`` into two tokens
before a letter but keeps it one token at the end of the prompt. Here every fixture tokenizer and every
zoo template is given prompts that end in runs of whitespace (newlines, spaces, tabs) and replies that
start with a space, a newline, a tab, a letter, a digit or punctuation; each trained turn of each
sequence must start after exactly the ids the tokenizer gives its prompt on its own, on both backends.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from packprep.normalize import FieldNames, detect_format, normalize
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import fixture_tokenizer, needs_fixtures
from .template_folders import ZOO_NAMES, build_zoo_folder, zoo_template
from .zoo_reference import as_messages, fit, probe, reference_turns, renderer

pytestmark = needs_fixtures

FIXTURES = ("gpt2", "llama2", "llama3", "mistral-7b-v0.1", "qwen2.5")
# the prompt is the conversation so far, as the data has it: its end is the user's text
RAW = ("{% for m in messages %}{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}"
       "{% endfor %}")
ENDS = ["\n\n", "x\n\n\n", "  ", "a   ", "\t\t", " \n", "\n  ", "q\n \n", "ok."]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d",
                                          "parameters": {"type": "object", "properties": {}}}}]
STARTS = ["Hello", " Hello", "\nHello", "\n\nHi", "\tx", "!", "4 apples", "  two", "-", "'s"]


def records() -> list[dict]:
    """Chats whose user texts end in a run of whitespace and whose replies start each their own way: one
    turn, and two turns (the first reply ending in whitespace too, or not)."""
    out = []
    for i, end in enumerate(ENDS):
        for j, start in enumerate(STARTS):
            second = STARTS[(j + i + 1) % len(STARTS)]
            tail = ENDS[(i + j) % len(ENDS)] if j % 2 else "."
            out.append({"messages": [{"role": "user", "content": f"Say{end}"},
                                     {"role": "assistant", "content": f"{start} one."}]})
            if (i + j) % 3:
                continue
            out.append({"messages": [{"role": "user", "content": f"Say{end}"},
                                     {"role": "assistant", "content": f"{start} one{tail}"},
                                     {"role": "user", "content": f"Again{ENDS[(i + 2 * j) % len(ENDS)]}"},
                                     {"role": "assistant", "content": f"{second}."}]})
    return out


def packed_contexts(encoded) -> list[tuple]:
    """The ids before each trained run of each of the record's sequences."""
    out = []
    for ids, labels in encoded.sequences:
        trained = labels != -100
        starts = np.flatnonzero(trained & ~np.concatenate([[False], trained[:-1]]))
        out += [tuple(ids[:s].tolist()) for s in starts]
    return out


class Theirs:
    """The reference's tokenizer: the Hugging Face ``tokenizers.Tokenizer`` itself, nothing of packprep."""

    def __init__(self, tok):
        self.hf = tok.backend_tokenizer
        self.chat_template, self.special_tokens_map = tok.chat_template, tok.special_tokens_map

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.hf.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids):
        return self.hf.decode(ids, skip_special_tokens=False)


def check(folder: str, template: str | None, backend: str, data: list[dict]) -> int:
    """Pack ``data`` with packprep's encoder and compare each trained turn's context with the prompt
    (rendered by transformers) tokenized alone; the number of turns compared."""
    tok = load_tokenizer(folder)
    if template is not None:
        tok.chat_template = template
    theirs = Theirs(tok)
    encoder = ChatEncoder(tok, backend=backend)
    policy = fit_to_template(encoder.template.render)
    render = renderer(theirs)
    shape = probe(render)
    conversations = [normalize(json.loads(json.dumps(r)), detect_format(r), FieldNames(), policy) for r in data]
    compared = 0
    for record, encoded in zip(data, encoder.encode(conversations)):
        messages, tools = as_messages(record)
        expected = [tuple(t.context) for t in reference_turns(theirs, render, fit(messages, shape), tools, shape)
                    if t.reason is None]
        got = packed_contexts(encoded) if isinstance(encoded, Encoded) else []
        wrong = Counter(got) - Counter(expected)
        assert not wrong, (f"{folder} {backend}: a turn trained after ids that are not its prompt's "
                           f"own: {theirs.decode(list(next(iter(wrong))))[-40:]!r} in {record}")
        assert Counter(got) == Counter(expected), f"{folder} {backend}: turns not trained in {record}: {encoded}"
        compared += len(got)
    return compared


@pytest.mark.parametrize("backend", ["auto", "hf"])
@pytest.mark.parametrize("name", FIXTURES)
def test_a_prompt_ending_in_whitespace_is_the_prompts_own_ids(name, backend):
    data = records()
    assert check(fixture_tokenizer(name), RAW, backend, data) == sum(len(r["messages"]) // 2 for r in data)


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_foreign_templates_on_every_fixture_tokenizer(name):
    """Llama-3's prompt ends in ``"\\n\\n"``, which GPT-2 cuts in two before a letter; ChatML's in one newline."""
    data = records()[:40]
    for template in ("llama-3.1", "qwen3"):
        assert check(fixture_tokenizer(name), zoo_template(template), "auto", data) == 50


@pytest.mark.slow
@pytest.mark.parametrize("template", ZOO_NAMES)
def test_every_zoo_template_trains_after_the_prompts_own_ids(template, tmp_path):
    folder = str(build_zoo_folder(template, tmp_path / "tok"))
    data = records()[::6]
    # a tool-use template (Hermes 3, Command R+) refuses a chat without tools; FireFunction v2 (which needs a
    # `functions` variable) and MiroThinker train none of these turns, as the reference finds too
    if not check(folder, None, "hf", data):
        check(folder, None, "hf", [dict(r, tools=TOOLS) for r in data])
