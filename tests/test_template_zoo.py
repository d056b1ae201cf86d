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
