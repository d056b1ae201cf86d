"""What a chat template needs of a conversation, decided once per template from how it renders small
probe conversations (:func:`fit_to_template`: the :class:`~packprep.normalize.Policy` of
normalize.py's transforms), and why it refused one, in the record's terms (:func:`template_refusal`).
"""

from __future__ import annotations

from typing import Callable

from .assistant_turns import REASONING_FIELDS
from .errors import Rejected
from .normalize import OWN_ROLES, Policy

_PROBE = "\u2063packprep-probe\u2063"  # a text no template writes by itself


def fit_to_template(render: Callable[[list, list | None, bool], str], leading_assistant: str = "drop",
                    consecutive: str = "auto", system: str = "auto", reasoning: str = "inline",
                    tool_calls: str = "text") -> Policy:
    """The :class:`Policy` for a chat template, decided from what ``render(messages, tools,
    add_generation_prompt)`` does with small probe conversations: whether it refuses a system
    message or two turns of a role in a row (``auto``: :func:`_refused`), whether it renders an
    assistant's ``tool_calls`` (and with which content and arguments), a ``tool`` message, OpenAI's
    developer/ipython/function roles, and reasoning (under which fields); each: renders without
    error and shows the probe text. Tool probes are given a tools list: a template may render calls
    only when tools are declared."""
    def shows(messages, tools=None, generation=False) -> bool:
        try:
            return _PROBE in render(messages, tools, generation)
        except Rejected:
            return False

    user, reply = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    tools = [{"type": "function", "function": {"name": "probe", "description": "probe",  # not the probe text:
                                               "parameters": {"type": "object", "properties": {}}}}]  # it shows
    system, consecutive, merged = _refused(render, system, consecutive, tools)
    calls, content, arguments, call = "text", "empty", "object", reply
    for arguments_value in ({}, "{}"):
        probes = {empty: {"role": "assistant", "content": empty,  # an id as Mistral's templates require: 9 characters
                          "tool_calls": [{"id": "probe0001", "type": "function",
                                          "function": {"name": _PROBE, "arguments": arguments_value}}]}
                  for empty in (None, "")}
        shown = [empty for empty, probe in probes.items() if shows([user, probe], tools) or shows([user, probe])]
        if shown:  # None, OpenAI's spelling of no text beside the calls, where the template takes it
            calls, call = "native", probes[shown[-1]]
            content = "empty" if shown == [""] else "null" if len(shown) == 2 else "none"
            arguments = "object" if arguments_value == {} else "string"
            if content == "null" and not shows([user, probes[None], {"role": "tool", "tool_call_id": "probe0001",
                                                                      "content": "r"}, {**reply, "content": _PROBE}], tools):
                content = "empty"  # None only where the template also renders what follows the call
            if content == "null" and _prints_none(render, [user, probes[None]], [user, probes[""]], tools):
                content = "empty"  # a template that writes None as the text "None" would train the model to write it
            break

    if calls == "native":  # the call of the results' probe, without the probe text
        call = {**call, "tool_calls": [{**call["tool_calls"][0], "function": {"name": "probe", "arguments":
                                                                            call["tool_calls"][0]["function"]["arguments"]}}]}

    def result(role: str) -> list:
        return [user, call, {"role": role, "tool_call_id": "probe0001", "name": "probe", "content": _PROBE}, reply]

    results = "tool" if shows(result("tool"), tools) or shows(result("tool")) else "user"
    def renders(messages, tools=None) -> bool:
        try:
            render(messages, tools, False)
            return True
        except Rejected:
            return False

    # passed as they are unless the template refuses them: what it does with them at inference
    roles = tuple(role for role in OWN_ROLES if renders([{"role": role, "content": _PROBE}, user, reply]
                                                        if role == "developer" else result(role), tools))
    # a template may write reasoning only in some turns: beside tool calls (gpt-oss keeps a call's
    # analysis), or in replies after the first; it reads a field if it writes it in any
    def reads(name: str) -> bool:
        thought = {**reply, name: _PROBE}
        return (shows([user, thought]) or shows([user, reply, user, thought]) or shows([user, thought, user, reply])
                or (calls == "native" and shows([user, {**call, name: _PROBE}], tools)))

    fields = tuple(name for name in REASONING_FIELDS if reads(name))
    return Policy(leading_assistant=leading_assistant, consecutive=consecutive, system=system, tool_calls=calls,
                  tool_results=results, reasoning=reasoning, call_content=content, call_arguments=arguments,
                  reasoning_fields=fields, roles=roles, unrendered_calls=tool_calls, merged_roles=merged)


def _refused(render, system: str, consecutive: str, tools: list) -> tuple[str, str, tuple[str, ...]]:
    """``--system`` and ``--consecutive`` for this template, and the roles merged: ``auto`` gives the
    template the record as the data has it, the template being the authority on what it renders (a
    system message it writes nowhere is dropped at inference too), and folds or merges only what it
    refuses (raises on) where it renders the same conversation without it."""
    def renders(messages) -> bool:
        for given in (None, tools):  # a tool-use template may refuse a conversation without tools
            try:
                render(messages, given, False)
                return True
            except Rejected:
                pass
        return False

    user, reply = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    plain = renders([user, reply])
    if system == "auto":
        system = "fold" if plain and not renders([{"role": "system", "content": "be brief"}, user, reply]) else "keep"
    merged: tuple[str, ...] = ("user", "assistant")
    if consecutive == "auto":
        twice = {"user": [user, {"role": "user", "content": "more"}, reply],
                 "assistant": [user, reply, {"role": "assistant", "content": "again"}]}
        merged = tuple(role for role, messages in twice.items() if plain and not renders(messages))
        consecutive = "merge" if merged else "keep"
    return system, consecutive, merged


def _prints_none(render, with_none: list, with_empty: list, tools) -> bool:
    """Whether the template writes a tool-calling message's None content as the text "None"."""
    try:
        return "None" in render(with_none, tools, False) and "None" not in render(with_empty, tools, False)
    except Rejected:
        return False


def template_refusal(messages: list[dict], error: Exception) -> str:
    """Why a template refused a conversation, in the record's terms, with the option that helps.

    The template's own words are quoted only when its author wrote them (``raise_exception``);
    an error from inside the template's code ("list object has no element 0") is not.
    """
    own = str(error).strip().splitlines()[0] if type(error).__name__ == "TemplateError" and str(error).strip() else None
    roles = [m["role"] for m in messages]
    head = 1 if roles[:1] == ["system"] else 0
    if not roles[head:]:
        what = "a conversation with no user or assistant message"
    elif roles[head] != "user":
        what = (f"a conversation that starts with a {roles[head]!r} turn "
                "(--leading-assistant drop removes turns before the first user turn)")
    elif any(a == b and a in ("user", "assistant") for a, b in zip(roles, roles[1:])):
        i = next(i for i, (a, b) in enumerate(zip(roles, roles[1:])) if a == b and a in ("user", "assistant"))
        what = f"two {roles[i]!r} turns in a row, messages {i} and {i + 1} (--consecutive merge joins them)"
    elif "system" in roles[1:]:
        what = f"a system message at position {roles.index('system', 1)}, after the first turn"
    elif "tool" in roles or any(m.get("tool_calls") for m in messages):
        what = "tool calls or tool results, which this template may not support (use a tokenizer whose template does)"
    elif head:
        what = "a system message (--system fold puts it into the first user message)"
    else:
        what = f"the roles {', '.join(roles[:12])}{'...' if len(roles) > 12 else ''}"
    return f"the chat template cannot render {what}" + (f"; the template says: {own}" if own else "")
