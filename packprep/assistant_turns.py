"""An assistant message's reasoning and tool calls, in the shape its chat template reads them.

Reasoning comes in many shapes: ``reasoning_content`` (OpenAI-style data, Qwen, DeepSeek),
``reasoning``, ``thinking`` (gpt-oss), or a ``<think>...</think>`` block opening the content. All
become one field, ``reasoning_content`` (:func:`with_reasoning`), and the template gets it under
the name it reads (probed by normalize.fit_to_template). A template that reads none (Llama-3.x,
Qwen2.5, Phi-3.5, DeepSeek-R1, QwQ) gets it as ``--reasoning`` says (:func:`place_reasoning`):

* ``inline`` (default): ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, what reasoning models
  write and what the model then learns to write; the data's reasoning is kept, not lost silently;
* ``drop``: the answer alone, as a non-reasoning model would be trained;
* ``reject``: the record is set aside.

Every turn so changed is counted (``reasoning_inlined``, ``reasoning_dropped``).

Tool calls: a template that renders calls only when ``content`` is None (DeepSeek-R1) gets None
there, and text beside the calls, which it would render *instead of* the calls, is dropped and
counted (``tool_call_text_dropped``); any other gets ``""`` for None. ``arguments`` go as an
object (decoded from OpenAI's JSON string), or as JSON text to a template that joins them to text.
"""

from __future__ import annotations

import json
from collections import Counter

from .errors import Rejected

REASONING = ("inline", "drop", "reject")
REASONING_INPUTS = ("reasoning_content", "reasoning", "thinking")  # fields an assistant's reasoning comes in
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # fields a template may read it from, probed in turn
THINK, UNTHINK = "<think>", "</think>"


def with_reasoning(message: dict, turn: dict, number: int) -> dict:
    """``message`` with the turn's reasoning, if any, as ``reasoning_content``: from the first of
    :data:`REASONING_INPUTS` that holds text, else from a ``<think>...</think>`` block that opens the
    content (taken out of it). Blank reasoning is none; content without such a block is left as it is."""
    for name in REASONING_INPUTS:
        value = turn.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise Rejected(f"message {number} '{name}' is not a string", "wrong_type")
            if value.strip():
                return {**message, "reasoning_content": value}
    content = message["content"]
    if content and UNTHINK in content and content.lstrip().startswith(THINK):
        head, _, answer = content.partition(UNTHINK)
        reasoning = head.lstrip()[len(THINK):].strip("\n")
        if reasoning.strip():
            return {**message, "content": answer.lstrip("\n"), "reasoning_content": reasoning}
    return message


def place_reasoning(messages: list[dict], field_name: str | None, policy: str, counts: Counter) -> list[dict]:
    """Reasoning under ``field_name``, the field the template reads; where it reads none, inlined,
    dropped or rejected by ``policy`` (``--reasoning``)."""
    if field_name == "reasoning_content" or not any("reasoning_content" in m for m in messages):
        return messages
    out = []
    for number, message in enumerate(messages):
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            out.append(message)
            continue
        message = {k: v for k, v in message.items() if k != "reasoning_content"}
        if field_name:
            message[field_name] = reasoning
        elif policy == "inline":
            answer = (message["content"] or "").lstrip("\n")
            message["content"] = f"{THINK}\n{reasoning.strip(chr(10))}\n{UNTHINK}\n\n{answer}"
            counts["reasoning_inlined"] += 1
        elif policy == "drop":
            counts["reasoning_dropped"] += 1
        else:
            raise Rejected(f"assistant message {number} has reasoning, and the chat template has no place for it; "
                           "--reasoning inline writes it as <think>...</think> before the answer, --reasoning drop "
                           "leaves it out", "reasoning_not_rendered")
        out.append(message)
    return out


def shape_calls(messages: list[dict], content: str, arguments: str, counts: Counter) -> list[dict]:
    """Tool-calling messages as the template reads them: ``content`` "empty" ("" for None) or "none"
    (None, text beside the calls dropped), ``arguments`` "object" or "string" (JSON text)."""
    out = []
    for message in messages:
        if message.get("tool_calls") is not None or message.get("content") is None:
            message = dict(message)
            if content == "none" and message.get("tool_calls"):
                if message["content"]:
                    counts["tool_call_text_dropped"] += 1
                message["content"] = None
            elif message["content"] is None:
                message["content"] = ""
            if arguments == "string" and message.get("tool_calls"):
                message["tool_calls"] = [
                    call if isinstance(call["function"]["arguments"], str) else
                    {**call, "function": {**call["function"],
                                          "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False)}}
                    for call in message["tool_calls"]]
        out.append(message)
    return out
