"""The token-exact turn definition, rebuilt on transformers' renderer alone (no packprep code).

For assistant turn k of messages M (the record's messages, changed only in shape: ShareGPT roles to
OpenAI ones, text parts joined, tools JSON decoded, reasoning under every field name a template may
read, tool-call arguments in the form the template takes):

- context = ``tok(render(M[:k], add_generation_prompt=True), add_special_tokens=False)``, the prompt
  tokenized on its own, as inference servers do;
- target = what the template writes for turn k after that context. Let H = render(M[:k]) (no
  generation prompt), C = the context text, R = render(M[:k+1]), G = C after H, T = R after H:

  1. R starts with C: the target is R after C (G is the start of T, or empty);
  2. else, when C and R both extend H, the part of G that T does not share is the generation prompt's own
     (T is T0 + T1, G is T0 + G1 with T0 their common start):
     a. G1 opens a reasoning block (``<think>`` and the like) that T1 does not: the template strips
        reasoning from finished turns (QwQ, DeepSeek-R1) while its prompt asks the model to reason,
        so the model writes the turn's reasoning, the closing tag and then T1: target =
        ``reasoning + "\\n" + closing + "\\n\\n" + T1`` (the layout Qwen3, QwQ and R1 write; empty
        reasoning gives ``"\\n</think>\\n\\n"``, as Qwen3 renders it), with a ``"\\n"`` first where
        the prompt's opening has none;
        where T1 starts with the closing tag itself, the template writes the reasoning block's end for the
        turn (GLM-4.7's ``"</think>"`` for a turn without reasoning): target = T1;
     b. otherwise G1 is a prompt-only marker (Gemma 4's empty thought channel, DeepSeek V3.2's
        ``<think></think>``): the model writes what the template writes for the turn after it, T1,
        less the longest end of G1 that T1 starts with (the context already holds it);

  (T0 never ends inside a control string: a common start that would cut ``<...>`` or ``[...]`` in
  two is backed up to its ``<``/``[``.)
  3. else (the rendering with turn k does not continue its context: Mistral Nemo moves the system prompt
     to the last user turn, so the turn's own rendering has none): the target is what R writes from
     where the turn's content begins (found by rendering M[:k+1] again with a sentinel for that
     content); where the content is not written, the turn has no target, reason
     ``rendering_does_not_extend_context``.

  The target is tokenized as the model emits it after the context: the tail of
  ``tok(context_text + target)`` where its first ``len(context)`` ids are the context's, else
  ``tok(target)`` alone (the joint tokenization crosses the boundary).

A template reads reasoning when a reasoning field shows in any of its probes: one answer, the second of
two answers (Kimi-K2-Thinking writes none in the first), a tool-calling turn (Gemma 4 and Command R7B
write it there only). Its turns then keep their reasoning in the fields and the target is what the
template writes, with or without it. It renders tool calls when a call's argument value shows in a
rendering (the argument's name alone may come from the tools list).

A template that raises on M[:k] or M[:k+1] gives the turn the reason it raised (``template_refuses``).
``--reasoning inline`` for a template that reads no reasoning field: the trained turn's reasoning is
written into its content as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``, in that turn only;
``--reasoning drop``: the trained turn's content is its answer alone (an inline block taken out), in that
turn only. Earlier turns stay as the user gave them under either policy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import date

from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

DAY = date(2024, 7, 26)  # the fixed date packprep gives templates that read the clock
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
OPENINGS = {"<think>": "</think>", "<seed:think>": "</seed:think>", "<mm:think>": "</mm:think>",
            "<|START_THINKING|>": "<|END_THINKING|>", "[THINK]": "[/THINK]", "<thinking>": "</thinking>",
            "<|channel>thought": "<channel|>"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "function_call": "assistant", "observation": "tool", "tool": "tool", "developer": "developer"}


def renderer(tok, template: str | None = None):
    """``render(messages, generation, tools)`` by transformers' ``render_jinja_template``."""
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    template = template or tok.chat_template
    # transformers 5 turns a callable template variable into an inert string, so the fixed date goes in as
    # the compiled template's own strftime_now (the compilation is cached per template text)
    _compile_jinja_template(template).globals["strftime_now"] = DAY.strftime

    def render(messages, generation=False, tools=None):
        texts, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                         add_generation_prompt=generation, **special,
                                         date_string=DAY.strftime("%d %b %Y"))
        return texts[0]
    return render


def _text(content):
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _split_inline(content):
    """(reasoning, answer) of content that opens with a ``<think>`` block, else (None, content)."""
    if isinstance(content, str) and content.lstrip().startswith("<think>") and "</think>" in content:
        head, _, answer = content.partition("</think>")
        return head.lstrip()[len("<think>"):].strip("\n"), answer.lstrip("\n")
    return None, content


def as_messages(record: dict) -> tuple[list[dict], list | None]:
    """The record's messages and tools in OpenAI shape, nothing else changed."""
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None  # an empty string is no tools; "[]" is []
    if isinstance(tools, list):
        tools = [t if "function" in t else {"type": "function", "function": t} for t in tools]
    if "messages" in record:
        messages = [dict(m, content=_text(m.get("content"))) for m in record["messages"]]
    else:
        messages = []
        for turn in record["conversations"]:
            role, value = ROLES[turn["from"]], turn["value"]
            if turn["from"] == "function_call":
                call = json.loads(value)
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            else:
                messages.append({"role": role, "content": value})
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    return messages, tools


@dataclass
class Probe:
    """What a template does with reasoning fields and tool calls, found by rendering it."""

    reads_reasoning: bool
    args: str  # "dict" | "string" | "none" (renders no tool calls)
    call_content: str | None  # the empty content of a tool-calling message that the template renders calls with
    tail: str  # text written once after the whole conversation (Phi-3.5's <|endoftext|>)


def probe(render) -> Probe:
    user, mark = {"role": "user", "content": "hi"}, "Zq7Reason"

    def attempt(messages, tools=None):
        try:
            return render(messages, False, tools)
        except Exception:
            return ""
    tool = [{"type": "function", "function": {"name": "fzq", "description": "d",
                                              "parameters": {"type": "object", "properties": {"kzq": {"type": "string"}}}}}]

    def call(arguments, content, **extra):
        return [user, {"role": "assistant", "content": content, **extra, "tool_calls": [
            {"id": "abc123def", "type": "function", "function": {"name": "fzq", "arguments": arguments}}]}]
    args, content, form_args = "none", "", None
    for form, arguments in (("dict", {"kzq": "vzq"}), ("string", '{"kzq": "vzq"}')):
        for empty in ("", None):  # "" where the template renders calls with it (None may print as "None")
            text = attempt(call(arguments, empty), tool)
            # the argument's value, not its name: the name is in the tools list too (LFM2, Granite 3.3 print
            # the tools and drop the calls)
            if args == "none" and "vzq" in text and "{'kzq'" not in text:
                args, content, form_args = form, empty, arguments
    if args == "none":
        content = None
    reasoned = dict.fromkeys(REASONING_FIELDS, mark)
    # a template may write reasoning only in some turns: after the first answer (Kimi-K2-Thinking), or in
    # a tool-calling turn (Gemma 4, Command R7B); it reads a field when any of them writes it
    answer = {"role": "assistant", "content": "ok", **reasoned}
    tries = [([user, answer], None), ([user, answer, user, answer], None)]
    if form_args is not None:
        tries.append((call(form_args, content, **reasoned), tool))
    reads = any(mark in attempt(messages, tools) for messages, tools in tries)
    two = attempt([user, {"role": "assistant", "content": "Xa1"}, user, {"role": "assistant", "content": "Xb2"}])
    tail = ""
    if "Xa1" in two and "Xb2" in two:
        after_hist, after_last = two.split("Xa1", 1)[1], two.rsplit("Xb2", 1)[1]
        tail = after_last[_common_prefix(after_last, after_hist):]
    return Probe(reads, args, content, tail)


def fit(messages: list[dict], pr: Probe) -> list[dict]:
    """Shape changes only: reasoning under every field name (moved out of inline ``<think>`` where the
    template reads a field), arguments in the form the template takes, a tool-calling message's empty
    content as None or "" as the template renders calls with (DeepSeek-R1 only with None)."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            reasoning = next((m[f] for f in REASONING_FIELDS if m.get(f)), None)
            if reasoning is None and pr.reads_reasoning:
                reasoning, m["content"] = _split_inline(m.get("content"))
            if reasoning:
                m.update(dict.fromkeys(REASONING_FIELDS, reasoning))
            if m.get("tool_calls") and pr.args != "none":
                m["tool_calls"] = [_args(c, pr.args) for c in m["tool_calls"]]
                if not m.get("content"):  # null or "": OpenAI's two spellings of no text beside the calls
                    m["content"] = pr.call_content
        out.append(m)
    return out


def _args(call, form):
    function = dict(call["function"])
    arguments = function["arguments"]
    if form == "dict" and isinstance(arguments, str):
        function["arguments"] = json.loads(arguments)
    elif form == "string" and not isinstance(arguments, str):
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": function}


def reasoning_of(message) -> str | None:
    found = next((message[f] for f in REASONING_FIELDS if message.get(f)), None)
    return found if found is not None else _split_inline(message.get("content"))[0]


@dataclass
class Turn:
    index: int  # message index of the assistant turn
    context: list[int] = field(default_factory=list)
    target: list[int] = field(default_factory=list)
    bare: list[int] | None = None  # the target less the conversation's tail, for a turn that is not the last
    reason: str | None = None  # why the turn has no target (template_refuses: ..., rendering_does_not_extend_context)
    target_text: str = ""


def _target_text(context, history, rendered, message):
    if rendered.startswith(context):
        return rendered[len(context):]
    if not (context.startswith(history) and rendered.startswith(history)):
        return None
    g, t = context[len(history):], rendered[len(history):]
    common = _common_prefix(g, t)
    g1, t1 = g[common:], t[common:]
    opening = next((o for o in OPENINGS if o in g1 and OPENINGS[o] not in g1[g1.index(o):]), None)
    if opening and opening not in t1 and t1.lstrip("\n").startswith(OPENINGS[opening]):
        return t1  # the template writes the closing itself (GLM-4.7's "</think>" for a turn without reasoning)
    if opening and opening not in t1:
        reasoning = (reasoning_of(message) or "").strip("\n")
        lead = "" if g1.endswith("\n") else "\n"
        return lead + reasoning + "\n" + OPENINGS[opening] + "\n\n" + t1.lstrip("\n")
    overlap = next((len(g1) - j for j in range(len(g1)) if t1.startswith(g1[j:])), 0)
    return t1[overlap:]  # the context already ends with what T1 starts with (DeepSeek V3.2's "</think>")


def _common_prefix(a: str, b: str) -> int:
    """Length of the common start of ``a`` and ``b``, backed up to the start of a control string
    (``<...>``, ``[...]``) it would cut in two."""
    n = len(os.path.commonprefix([a, b]))
    for opening, closing in (("<", ">"), ("[", "]")):
        cut = a.rfind(opening, 0, n)
        if cut >= 0 and a.find(closing, cut, n) < 0 and (a.find(closing, cut) >= 0 or b.find(closing, cut) >= 0):
            n = min(n, cut)
    return n


def reference_turns(tok, render, messages, tools, pr: Probe, reasoning_policy="inline") -> list[Turn]:
    """The definition's (context, target) of every assistant turn of ``messages`` (already :func:`fit`)."""
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = []
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn = Turn(k)
        trained = dict(message)
        reasoning = reasoning_of(message)
        inline = _split_inline(message.get("content"))[0] is not None
        if reasoning and not pr.reads_reasoning and reasoning_policy == "inline" and not inline:
            trained["content"] = f"<think>\n{reasoning}\n</think>\n\n{message.get('content') or ''}"
        elif reasoning and not pr.reads_reasoning and reasoning_policy == "drop" and inline:
            trained["content"] = _split_inline(message.get("content"))[1]
        try:
            context = render(messages[:k], True, tools)
            history = render(messages[:k], False, tools)
            rendered = render(messages[:k] + [trained], False, tools)
        except Exception as exc:
            turn.reason = f"template_refuses: {type(exc).__name__}: {str(exc)[:120]}"
            turns.append(turn)
            continue
        text = _target_text(context, history, rendered, trained)
        if text is None:
            text = _moved_target(render, messages[:k], trained, rendered, tools)
        if text is None:
            turn.reason = "rendering_does_not_extend_context"
            turns.append(turn)
            continue
        turn.context, turn.target_text = encode(context), text
        turn.target = _tail(encode, context, turn.context, text)
        if k != last and pr.tail and text.endswith(pr.tail) and text != pr.tail:
            turn.bare = _tail(encode, context, turn.context, text[: -len(pr.tail)])
        turns.append(turn)
    return turns


def _moved_target(render, before, message, rendered, tools):
    """Rule 3: the turn as the template writes it from where its content begins, found by rendering the
    same messages with a sentinel for the turn's content (None where the content is not written)."""
    if not isinstance(message.get("content"), str) or not message["content"]:
        return None
    sentinel = render(before + [dict(message, content="Zq9Sentinel")], False, tools)
    start = len(os.path.commonprefix([rendered, sentinel]))
    return rendered[start:] if "Zq9Sentinel" in sentinel[start:] else None


def _tail(encode, context_text, context, text):
    joint = encode(context_text + text)
    return joint[len(context):] if joint[: len(context)] == context else encode(text)
