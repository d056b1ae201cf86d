"""An assistant message's reasoning and tool calls, in the shape its chat template reads them.

Reasoning comes in many shapes: ``reasoning_content`` (OpenAI-style data, Qwen, DeepSeek),
``reasoning``, ``thinking`` (gpt-oss), or a ``<think>...</think>`` block opening the content. All
become one field, ``reasoning_content`` (:func:`with_reasoning`), and the template gets it under
every name it reads (probed by normalize.fit_to_template). A template that reads none (Llama-3.x,
Qwen2.5, Phi-3.5, DeepSeek-R1, QwQ) gets it as ``--reasoning`` says (:func:`place_reasoning`):

* ``inline`` (default): in the trained turn only, ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``,
  what reasoning models write and what the model then learns to write; earlier turns (the
  context) are left as the record gave them, as a client sends them back at inference;
* ``drop``: the answer alone, as a non-reasoning model would be trained;
* ``reject``: the record is set aside.

A turn that gives reasoning under several of these names with different texts keeps the first
(:data:`REASONING_INPUTS` order) and counts the others as dropped (``reasoning_spellings_dropped``).
What became of each turn's reasoning is counted where it is known, once rendered (render.py):
``reasoning_trained`` (the template wrote it into trained tokens), ``reasoning_inlined`` (the
inline policy did), ``reasoning_dropped`` (in no trained token: the template strips it, or
``--reasoning drop``).

Tool calls: a template that renders calls only when ``content`` is None (DeepSeek-R1) gets None
there, and text beside the calls, which it would render *instead of* the calls, is dropped and
counted (``tool_call_text_dropped``); any other gets ``""`` for None. ``arguments`` go as an
object (decoded from OpenAI's JSON string), or, to a template that joins them to text, as the
record's own JSON string byte for byte (an object given as such is written as JSON).
"""

from __future__ import annotations

import json
from collections import Counter

from .errors import Rejected

REASONING = ("inline", "drop", "reject")
REASONING_INPUTS = ("reasoning_content", "reasoning", "thinking")  # fields an assistant's reasoning comes in
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # fields a template may read it from, probed in turn
THINK, UNTHINK = "<think>", "</think>"
GIVEN = "_given_content"  # the content as the record gave it, where a <think> block was taken out of it
OTHERS = "_other_reasoning"  # a turn's reasoning spellings that hold other texts than the one kept (counted)
ARGUMENTS_TEXT = "_arguments_text"  # a tool call's arguments as the record's own JSON string


def with_reasoning(message: dict, turn: dict, number: int) -> dict:
    """``message`` with the turn's reasoning, if any, as ``reasoning_content``: from the first of
    :data:`REASONING_INPUTS` that holds text, else from a ``<think>...</think>`` block that opens the
    content (taken out of it; the content as given is kept aside for a template that reads no
    reasoning). Blank reasoning is none; content without such a block is left as it is. Later
    spellings that hold another text are dropped, and counted (``reasoning_spellings_dropped``): one
    rule for every template, so a record trains the same reasoning whichever model it is packed for."""
    given = []
    for name in REASONING_INPUTS:
        value = turn.get(name)
        if value is not None and not isinstance(value, str):
            raise Rejected(f"message {number} '{name}' is not a string", "wrong_type")
        if value is not None and value.strip():
            given.append(value)
    if given:
        others = len(set(given[1:]) - {given[0]})
        return {**message, "reasoning_content": given[0], **({OTHERS: others} if others else {})}
    content = message["content"]
    if content and UNTHINK in content and content.lstrip().startswith(THINK):
        head, _, answer = content.partition(UNTHINK)
        reasoning = head.lstrip()[len(THINK):].strip("\n")
        if reasoning.strip():
            return {**message, "content": answer.lstrip("\n"), "reasoning_content": reasoning, GIVEN: content}
    return message


def place_reasoning(messages: list[dict], fields: tuple[str, ...], policy: str, counts: Counter,
                    trained: dict[int, dict], found: dict[int, str]) -> list[dict]:
    """Reasoning under every field name (``reasoning_content``, ``thinking``, ``reasoning``, as
    transformers passes it), an inline block moved there where the template reads one of
    ``fields``; where it reads none, ``policy`` (``--reasoning``): ``inline`` writes reasoning given
    apart into ``trained[k]``, message *k* as rendered when it is the turn trained, never into the
    history (a block the record wrote into the content stays there); ``drop`` leaves it out;
    ``reject`` refuses. ``found[k]``: message k's reasoning, for the label definition and counts."""
    out = []
    for number, message in enumerate(messages):
        reasoning = message.get("reasoning_content")
        given = message.get(GIVEN)
        if reasoning is None:
            out.append(message)
            continue
        if message.get(OTHERS):
            counts["reasoning_spellings_dropped"] += 1
        message = {k: v for k, v in message.items() if k not in ("reasoning_content", GIVEN, OTHERS)}
        if fields:
            message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
        elif policy == "inline":
            if given is not None:  # the record's own block, where it wrote it
                message["content"] = given
            else:  # given apart: under its names as the record gave it, and inline where the turn is trained
                answer = (message["content"] or "").lstrip("\n")
                message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
                trained[number] = {**message, "content": f"{THINK}\n{reasoning.strip(chr(10))}\n{UNTHINK}\n\n{answer}"}
        elif policy == "drop":
            counts["reasoning_dropped"] += 1
            out.append(message)
            continue
        else:
            raise Rejected(f"assistant message {number} has reasoning, and the chat template has no place for it; "
                           "--reasoning inline writes it as <think>...</think> before the answer, --reasoning drop "
                           "leaves it out", "reasoning_not_rendered")
        found[number] = reasoning
        out.append(message)
    return out


def shape_calls(messages: list[dict], content: str, arguments: str, counts: Counter) -> list[dict]:
    """Tool-calling messages as the template reads them: ``content`` "empty" ("" for None), "null"
    (None for no text) or "none" (None, text beside the calls dropped), ``arguments`` "object" or "string" (the record's own
    JSON text, byte for byte; an object given as such is written with ``json.dumps``)."""
    out = []
    for message in messages:
        if message.get("tool_calls") is not None or message.get("content") is None:
            message = dict(message)
            if content == "none" and message.get("tool_calls"):
                if message["content"]:
                    counts["tool_call_text_dropped"] += 1
                message["content"] = None
            elif content == "null" and message.get("tool_calls") and not message["content"]:
                message["content"] = None  # as OpenAI writes it, where the template renders calls with it
            elif message["content"] is None:
                message["content"] = ""
            if message.get("tool_calls"):
                message["tool_calls"] = [_shaped_call(call, arguments) for call in message["tool_calls"]]
        out.append(message)
    return out


def _shaped_call(call: dict, arguments: str) -> dict:
    function = {k: v for k, v in call["function"].items() if k != ARGUMENTS_TEXT}
    if arguments == "string" and not isinstance(function["arguments"], str):
        text = call["function"].get(ARGUMENTS_TEXT)
        function["arguments"] = text if text is not None else json.dumps(function["arguments"], ensure_ascii=False)
    return {**call, "function": function}
