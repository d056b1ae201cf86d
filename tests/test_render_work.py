"""How rendering a conversation's labels grows with its turns: linear where the one-pass renderer
cuts every prefix out of one rendering, and pinned where it cannot.

The work is counted, not timed (``ChatTemplate.work``: template renderings and the characters they
output), for a system prompt and N exchanges of plain chat, rendered as ``pack`` renders it, and the
result is the per-prefix reference's.

Why some templates stay quadratic. The label definition needs ``render(messages[:k], True)`` and
``render(messages[:k+1])`` for every assistant turn *k*. The one-pass renderer takes them from the
conversation's one rendering only where it has *proved* they are a prefix of it plus the template's
constant tail: the template had read no message at or after *k*, nor their number, when its message
loop stepped to *k*, so the same code had run on the same data (render_onepass.py). Qwen3, QwQ and
Qwen3.5 find the last user message by scanning the messages backwards before the loop and test
``loop.last`` in it; DeepSeek-R1-Distill scans every message for the system prompt before the loop
and ends with text chosen by its loop's state; Mistral v3 loops over a list it builds from the
messages. Each of these reads the conversation's end before writing its first message, so what it
writes for an early message may depend on how the conversation ends (it does, for Qwen3's reasoning
blocks), and no cut can be vouched for. Splicing a prefix's text out of the one rendering anyway, or
out of a shorter rendering of its last exchanges, is right for the conversations one checks and
wrong for a template that keeps state the check does not see; so these render every prefix on its
own, and the test pins that growth: a change that makes them linear must move them to ``LINEAR``
with its proof.
"""

from __future__ import annotations

import pytest

from packprep.normalize import Conversation, Rejected
from packprep.render import ChatTemplate, render_conversation
from packprep.render_onepass import OnePassTemplate
from packprep.tokenization import ChatEncoder, load_tokenizer

from .conftest import needs_fixtures, slow_but
from .zoo_shapes import exchanges

TURNS = (2, 8, 32, 64)
LINEAR = ["phi-3.5-mini", "llama-3.1", "llama-3.2"]  # one rendering a conversation
# renderings a conversation of N exchanges costs, N >= 2: every prefix the definition needs, on its own
# (QwQ and DeepSeek-R1 also render the history before each turn: their rendering of a turn does not
# extend its context, render.inference_turn)
QUADRATIC = {"qwen3": 2, "qwq": 3, "deepseek-r1-distill-qwen": 3, "mistral-v3": 2}


def _outcome(render):
    try:
        rendered = render()
    except Rejected as exc:
        return exc.code
    return ([(r.text, r.spans) for r in (*rendered.earlier, rendered)], rendered.turns_not_located,
            rendered.turns_out_of_context, rendered.turns_rewritten)


def _work(name: str, template_folder, compare_up_to: int = 8) -> tuple[list[int], list[int]]:
    """(renderings, characters rendered) for a conversation of each of :data:`TURNS` exchanges, each
    up to ``compare_up_to`` exchanges checked against the reference."""
    tokenizer = load_tokenizer(template_folder(name))
    encoder, reference = ChatEncoder(tokenizer, backend="hf"), ChatTemplate(tokenizer)
    assert isinstance(encoder.template, OnePassTemplate) or name not in LINEAR, name
    work, renders, chars = encoder.template.work, [], []
    for turns in TURNS:
        conversation = Conversation(messages=exchanges(turns))
        encoder.render(conversation)  # the first rendering also probes the template's shape, once
        before = work.renders, work.chars
        got = _outcome(lambda: encoder.render(conversation))
        renders.append(work.renders - before[0])
        chars.append(work.chars - before[1])
        if turns <= compare_up_to:
            assert got == _outcome(lambda: render_conversation(reference, conversation, "assistant")), (name, turns)
    return renders, chars


@needs_fixtures
@pytest.mark.parametrize("name", slow_but({"phi-3.5-mini"}, LINEAR))
def test_rendering_work_is_linear_in_the_turns(name, template_folder):
    renders, chars = _work(name, template_folder)
    assert renders == [1] * len(TURNS), renders  # one rendering a conversation: every prefix cut from it
    per_turn = [c / t for c, t in zip(chars, TURNS)]
    assert max(per_turn[1:]) <= 1.2 * min(per_turn[1:]), chars  # from 8 exchanges on: a constant a turn


@needs_fixtures
@pytest.mark.parametrize("name", slow_but({"qwen3"}, list(QUADRATIC)))
def test_templates_that_read_the_end_first_render_every_prefix(name, template_folder):
    renders, chars = _work(name, template_folder)
    assert renders == [QUADRATIC[name] * turns for turns in TURNS], renders
    assert 3.5 < chars[3] / chars[2] < 4.5, chars  # twice the turns, four times the characters
