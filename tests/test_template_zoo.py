"""A sample of the template zoo's conformance (benchmarks/template_conformance.py runs all of it).

Each case packs a template's records of one data shape with ``packprep.pack`` and checks every
assistant turn against the token-exact reference built on transformers' renderer alone
(tests/zoo_reference.py): trained in its inference context, no record rejected that the template
renders, no reasoning trace in no trained token. Each case once failed for a cause of its own (the
developer role, reasoning inlined into the history, a context tokenized with its target, a prompt the
finished turn does not write, a system prompt the template moves).
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from .conftest import needs_fixtures
from .template_folders import ZOO_NAMES, build_zoo_folder, zoo_template
from .zoo_conformance import check_template
from .zoo_reference import as_messages, fit, probe, reference_turns, renderer

pytestmark = [pytest.mark.slow, needs_fixtures]

CASES = [
    ("qwen3", "chat", ()), ("qwen3", "reasoning_content", ()), ("qwen3", "tools_str", ()),
    ("qwen3", "developer", ()),
    ("llama-3.1", "chat", ()), ("llama-3.1", "tools_dict", ()),
    ("llama-3.1", "reasoning_content", ()),
    ("deepseek-r1-distill-qwen", "chat", ()), ("deepseek-r1-distill-qwen", "think_inline", ()),
    ("gemma-4", "chat", ()),
    ("mistral-nemo", "chat", ()), ("mistral-nemo", "system", ()),
    ("hermes-3", "tools_dict", ()), ("gpt-oss", "thinking", ()),
]
SHAPES_OF = {}
for _template, _shape, _ in CASES:
    SHAPES_OF.setdefault(_template, []).append(_shape)


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")

    @lru_cache(maxsize=None)
    def run(template):
        return check_template(template, str(build_zoo_folder(template, root / template)), SHAPES_OF[template], 1)
    return run


@pytest.mark.parametrize("template,shape", [pytest.param(t, s, marks=m, id=f"{t}-{s}") for t, s, m in CASES])
def test_every_turn_is_trained_in_its_inference_context(conformance, template, shape):
    tally = conformance(template)["shapes"][shape]
    assert tally.get("turns", 0) > 0, "the template renders turns of this shape"
    assert tally.get("rejected_renderable", 0) == 0, f"records rejected that the template renders: {tally}"
    assert tally.get("trained", 0) == tally["turns"], f"turns not trained in their context: {tally}"
    assert tally.get("reasoning_lost", 0) == 0, f"reasoning in no trained token: {tally}"


def test_the_zoo_has_at_least_forty_templates():
    assert len(ZOO_NAMES) >= 40 and len(set(map(zoo_template, ZOO_NAMES))) == len(ZOO_NAMES)


def _turns(template, record, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_zoo_folder(template, tmp_path / template)))
    render = renderer(tok)
    pr = probe(render)
    messages, tools = as_messages(record)
    return tok, reference_turns(tok, render, fit(messages, pr), tools, pr)


CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def test_reference_target_after_a_reasoning_prompt_the_template_does_not_write(tmp_path):
    """DeepSeek-R1's prompt ends with '<think>\\n' and its finished turns strip reasoning: the model
    writes the (empty) reasoning, '\\n</think>\\n\\n' and the answer, tokenized on its own where the
    joint tokenization would merge the two newlines across the boundary."""
    tok, turns = _turns("deepseek-r1-distill-qwen", CHAT, tmp_path)
    assert [t.target_text for t in turns] == ["\n</think>\n\nHello.<｜end▁of▁sentence｜>",
                                              "\n</think>\n\n4<｜end▁of▁sentence｜>"]
    assert tok.decode(turns[1].context).endswith("2+2?<｜Assistant｜><think>\n")
    assert turns[0].target == tok("\n</think>\n\nHello.<｜end▁of▁sentence｜>", add_special_tokens=False)["input_ids"]


def test_reference_target_extends_the_context_where_the_rendering_does(tmp_path):
    tok, turns = _turns("llama-3.1", CHAT, tmp_path)
    assert [t.target_text for t in turns] == ["Hello.<|eot_id|>", "4<|eot_id|>"]
    assert tok.decode(turns[0].context).endswith("Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_reference_names_what_the_template_refuses(tmp_path):
    parallel = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{n:05d}", "type": "function", "function": {"name": "f", "arguments": {}}} for n in (1, 2)]}]}
    _, turns = _turns("llama-3.1", parallel, tmp_path)
    assert turns[0].reason.startswith("template_refuses") and "single tool-calls" in turns[0].reason


class Chars:
    """A stand-in tokenizer for the reference's text rules (no folder to build): one id a character."""

    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    def __init__(self, template):
        self.chat_template = template

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _text_turns(template, record):
    tok = Chars(zoo_template(template))
    render = renderer(tok)
    pr = probe(render)
    messages, tools = as_messages(record)
    return pr, [t.target_text for t in reference_turns(tok, render, fit(messages, pr), tools, pr)]


def test_reference_keeps_a_closing_tag_the_template_writes_itself():
    """GLM-4.7 prompts with '<think>' and writes a reply without reasoning as '</think>answer': the model
    closes the block once, not a second time after it."""
    assert _text_turns("glm-4.7-flash", CHAT)[1] == ["</think>Hello.", "</think>4"]


def test_reference_finds_reasoning_a_template_writes_in_some_turns_only():
    """Kimi-K2-Thinking writes reasoning only after the first answer, Gemma 4 and Command R7B only beside a
    tool call: each reads the field, so nothing is inlined; a turn the template writes none in has none."""
    reasoned = {"messages": [dict(m, reasoning_content=f"R{i}") if m["role"] == "assistant" else m
                             for i, m in enumerate(CHAT["messages"])]}
    pr, targets = _text_turns("kimi-k2-thinking", reasoned)
    assert pr.reads_reasoning and targets == ["<think></think>Hello.<|im_end|>", "<think>R3</think>4<|im_end|>"]
    for template in ("gemma-4", "command-r7b"):
        pr, targets = _text_turns(template, reasoned)
        assert pr.reads_reasoning and not any("R1" in t or "R3" in t for t in targets), (template, targets)


def test_reference_judges_tool_calls_by_the_call_not_the_tools_list():
    """LFM2, LFM2.5-Instruct and Granite 3.3 print the tools list (argument names included) and drop the
    calls: they render no tool calls. Qwen2.5 renders them."""
    for template in ("lfm2", "lfm2.5-instruct", "granite-3.3"):
        assert _text_turns(template, CHAT)[0].args == "none", template
    assert _text_turns("qwen2.5", CHAT)[0].args == "dict"
