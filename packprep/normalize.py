"""Step 2: turn a raw record of any supported format into one canonical conversation.

Canonical form: a list of messages with roles ``system``, ``user``, ``assistant`` and ``tool``,
each ``{"role", "content"}``; an assistant message may carry ``tool_calls`` (``[{"type":
"function", "function": {"name", "arguments": {...}}}]``) and a tool message a ``name`` or
``tool_call_id``, the shape chat templates render natively. ``tools`` go to the template as
``[{"type": "function", "function": {...}}]``. A ``text`` record is a plain text. Anything that
cannot be normalised raises :class:`Rejected` with a reason a person can act on; the JSON Schemas
in ``schemas/`` explain structural problems.

Real dumps are not shaped the way templates want, so a few small transforms (:class:`Policy`) fit
each conversation, and each counts what it changed (``Conversation.changes``; the manifest,
``pack``, ``stats`` and the dataset card show the totals):

``leading_turns_dropped``
    Turns before the first user turn (after an optional system turn): a chunk of a longer chat that
    starts mid-way. ``drop`` (default) removes them and trains the rest, as FastChat's trainer
    does; ``reject`` sets the record aside.
``turns_merged``
    A user or assistant turn that follows one of the same role. ``auto`` (default) gives both to
    the template, as the data has them (each reply trained after its own header), and merges only
    the role whose two turns in a row the template refuses (it raises); ``merge`` always appends
    the turn to the one before, separated by a blank line (an assistant's tool calls are kept, in
    order); ``keep`` never merges; ``reject`` sets the record aside. Tool results are never merged:
    each answers its own call.
``system_folded``
    ``--system auto`` (default) gives a system message to the template as it is, also where the
    template writes none (it drops it at inference too), and folds it only for a template that
    refuses one (raises): the system text is then put before the first user message, separated
    by a blank line. ``keep`` never folds, ``fold`` always does.
``tool_calls_as_text`` / ``tool_results_as_user``
    For a template that does not render ``tool_calls`` (plain Llama-3), ``--tool-calls text``
    (default) writes each call into the content of the turn being trained as the JSON
    ``{"name", "arguments"}``, so that it is still trained (earlier turns keep their calls out of
    the text, as the template renders them at inference); ``--tool-calls reject`` sets such a
    record aside. For a template that has no ``tool`` role (Llama-2, Mistral v0.1), tool results
    become user messages. Decided once per template by :func:`packprep.template_fit.fit_to_template`.
``roles_mapped``
    OpenAI's ``developer``, ``ipython`` and ``function`` roles go to the template as they are
    unless it refuses them (raises); where it does, as ``system`` (developer) or ``tool``, counted.
``tool_call_text_dropped`` / ``reasoning_trained`` / ``reasoning_inlined`` / ``reasoning_dropped`` /
``reasoning_spellings_dropped``
    An assistant's reasoning and tool calls in the shape the template reads them; what became of
    each turn's reasoning is counted once rendered (assistant_turns.py, render.py;
    ``--reasoning inline|drop|reject``).
``template_kwargs``
    Records that carry their own ``chat_template_kwargs`` (rendered with them on top of
    ``--template-arg``; template_inputs.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .assistant_turns import ARGUMENTS_TEXT, GIVEN, OTHERS, REASONING_FIELDS, place_reasoning, shape_calls, with_reasoning
from .errors import ConfigError, Rejected, listing
from .json_limits import JSONLimit, check_depth, loads
from .record_schema import schema_problem

FORMATS = ("sharegpt", "openai", "alpaca", "text")

# Every speaker name packprep accepts, in either format (``from`` or ``role``), and its role.
ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "function_call": "assistant",  # a ShareGPT turn whose value is the JSON of a tool call
    "observation": "tool",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy role for a function's result
    "ipython": "tool",  # Llama-3.1's role for a tool's result
    "developer": "system",  # OpenAI's name for system instructions to reasoning models
}
# OpenAI roles passed to a template as they are where it renders them (else as their ROLES entry, counted)
OWN_ROLES = ("developer", "ipython", "function")
ROLE = "_role"  # an OpenAI message's own role, while the policy's transforms run
TOOL_CALL_SPEAKERS = ("function_call",)

LEADING = ("drop", "reject")
CONSECUTIVE = ("auto", "merge", "keep", "reject")
SYSTEM = ("auto", "keep", "fold")
CHANGES = ("leading_turns_dropped", "turns_merged", "system_folded", "tool_calls_as_text", "tool_results_as_user",
           "control_text_in_content", "tool_call_text_dropped", "reasoning_inlined", "reasoning_dropped",
           "template_kwargs", "roles_mapped", "reasoning_trained", "reasoning_spellings_dropped")
TOOL_CALLS = ("text", "reject")  # tool calls for a template that renders none (--tool-calls)



@dataclass
class Conversation:
    messages: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    text: str | None = None
    changes: dict[str, int] = field(default_factory=dict)  # what the Policy's transforms did (CHANGES)
    template_kwargs: dict[str, Any] | None = None  # the record's own chat_template_kwargs
    trained: dict[int, dict] = field(default_factory=dict)  # message k as rendered when it is the turn trained
    reasoning: dict[int, str] = field(default_factory=dict)  # assistant message k's reasoning, wherever it is


@dataclass(frozen=True)
class FieldNames:
    """Column names, overridable for data sets that use other keys."""

    messages: str | None = None  # default: "conversations" (sharegpt) or "messages" (openai)
    text: str = "text"


@dataclass(frozen=True)
class Policy:
    """How conversations are fitted to training and to the chat template (module docstring).

    ``system``, ``tool_calls``, ``tool_results``, ``call_content``, ``call_arguments`` and
    ``reasoning_field`` are what :func:`~packprep.template_fit.fit_to_template` decides for one template:
    ``keep``/``fold``, ``native``/``text``, ``tool``/``user``, ``empty``/``null``/``none`` (the
    content of a message with tool calls: "" for none, None for none, None with text beside dropped), ``object``/``string``, the fields it reads reasoning from
    (none: ``reasoning`` says what is done with it) and the roles of :data:`OWN_ROLES` it renders.
    """

    leading_assistant: str = "drop"
    consecutive: str = "keep"
    system: str = "keep"
    tool_calls: str = "native"
    tool_results: str = "tool"
    reasoning: str = "inline"
    call_content: str = "empty"
    call_arguments: str = "object"
    reasoning_fields: tuple[str, ...] = ("reasoning_content",)
    roles: tuple[str, ...] = ()
    unrendered_calls: str = "text"  # --tool-calls: what is done where tool_calls == "text"
    merged_roles: tuple[str, ...] = ("user", "assistant")  # consecutive == "merge": the roles merged


def detect_format(record: Any, fields: FieldNames = FieldNames()) -> str | None:
    """Guess the format from one record's keys; None when it matches none."""
    if not isinstance(record, dict):
        return None
    if fields.messages and fields.messages in record:
        turns = record[fields.messages]
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]:
            return "sharegpt"
        return "openai"
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "openai"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if fields.text in record:
        return "text"
    return None


def normalize(record: Any, fmt: str, fields: FieldNames = FieldNames(), policy: Policy = Policy()) -> Conversation:
    """Return the canonical conversation of ``record``, fitted by ``policy``, or raise :class:`Rejected`."""
    if not isinstance(record, dict):
        raise Rejected(f"record is a JSON {_json_type(record)}, expected an object", "not_an_object")
    try:
        check_depth(record, "the record")
        if fmt in ("sharegpt", "openai"):
            key = fields.messages or ("conversations" if fmt == "sharegpt" else "messages")
            conversation = _chat(record, key)
        elif fmt == "alpaca":
            conversation = _alpaca(record)
        elif fmt == "text":
            return _text(record, fields.text)
        else:
            raise ValueError(f"unknown format {fmt!r}")
    except JSONLimit as exc:  # the record's own nesting, or a JSON text inside one of its strings
        raise Rejected(str(exc), exc.code) from None
    except Rejected as exc:
        # an unknown role's reason lists the known roles already, as the schema's complaint would
        custom = fields.messages or fields.text != "text"  # checked structurally by the normaliser alone
        detail = None if exc.code == "unknown_role" or custom else schema_problem(record, fmt)
        reason = f"{exc} ({detail})" if detail and detail not in str(exc) else str(exc)
        raise Rejected(reason, exc.code) from None
    return fit(conversation, policy)


IMAGE_FIELDS = ("images", "image")  # ShareGPT/LLaVA and datasets: a record's images beside its turns
NO_PROCESSOR = ("the tokenizer has no image processor, and an image is never trained as if it were not there: "
                "pass the model's folder with its processor files (preprocessor_config.json) as --tokenizer")


def record_images(record: Any) -> list:
    """The record-level image list (``images``, or one ``image``); [] when it has none."""
    if not isinstance(record, dict):
        return []
    for key in IMAGE_FIELDS:
        value = record.get(key)
        if value is not None and value != [] and value != "":
            return list(value) if isinstance(value, list) else [value]
    return []


def _chat(record: dict, key: str) -> Conversation:
    """ShareGPT or OpenAI messages, told apart per message (``from``/``value`` or ``role``/``content``)."""
    images = record_images(record)
    if images:
        raise Rejected(f"the record carries {len(images)} image(s); {NO_PROCESSOR}", "images_without_processor")
    turns = _turn_list(record, key)
    messages = []
    system = record.get("system")
    if system:
        messages.append({"role": "system", "content": _string(system, "field 'system'")})
    sharegpt = key == "conversations"
    for number, turn in enumerate(turns):
        if isinstance(turn, dict) and ("from" in turn or "value" in turn or ("role" not in turn and sharegpt)):
            messages.append(_sharegpt_turn(turn, number))
        else:
            messages.append(_openai_turn(turn, number))
    return Conversation(messages=messages, tools=_tools(record.get("tools")),
                        template_kwargs=_template_kwargs(record.get("chat_template_kwargs")))


def _template_kwargs(value: Any) -> dict | None:
    """A record's ``chat_template_kwargs`` (as OpenAI-style data sets carry them), or None."""
    if value in (None, {}):
        return None
    from .template_inputs import check_template_args

    try:
        return check_template_args(value, "field 'chat_template_kwargs'")
    except ConfigError as exc:
        raise Rejected(str(exc), "wrong_type") from None


def _sharegpt_turn(turn: dict, number: int) -> dict:
    speaker = _speaker(turn, number, "from")
    content = _string(turn.get("value"), "message {} 'value'", number)
    if speaker in TOOL_CALL_SPEAKERS:
        return {"role": "assistant", "content": None, "tool_calls": _calls_from_text(content, number)}
    message = {"role": ROLES[speaker], "content": content}
    return with_reasoning(message, turn, number) if message["role"] == "assistant" else message


def _openai_turn(turn, number: int) -> dict:
    given = _speaker(turn, number, "role")
    role = ROLES[given]
    calls = turn.get("tool_calls") if role == "assistant" else None
    if calls:
        if not isinstance(calls, list):
            raise Rejected(f"message {number} 'tool_calls' is a JSON {_json_type(calls)}, expected a list", "bad_tool_call")
        content = turn.get("content")  # None stays None: fit_to_template decides what the template needs
        message = {"role": role, "content": None if content is None else _content(content, number),
                   "tool_calls": [_call(call, number) for call in calls]}
    else:
        message = {"role": role, "content": _content(turn.get("content"), number)}
    if role == "assistant":
        return with_reasoning(message, turn, number)
    if role == "tool":
        message.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
    if given in OWN_ROLES:
        message[ROLE] = given
    return message


def _speaker(turn, number: int, field_name: str) -> str:
    """The speaker name of message ``number``, read from ``field_name``; one of :data:`ROLES`."""
    if not isinstance(turn, dict):
        raise Rejected(f"message {number} is a JSON {_json_type(turn)}, expected an object", "wrong_type")
    if field_name not in turn:
        raise Rejected(f"message {number} has no {field_name!r} field (keys: {listing(map(repr, sorted(turn)))})",
                       "missing_field")
    value = turn[field_name]
    if not isinstance(value, str) or value not in ROLES:
        raise Rejected(f"message {number} has unknown role {value!r}; known: {listing(map(repr, sorted(ROLES)), 20)}",
                       "unknown_role")
    return value


def _calls_from_text(text: str, number: int) -> list[dict]:
    """A ShareGPT ``function_call`` value: the JSON of one call ``{"name", "arguments"}``, or a list of them."""
    try:
        value = loads(text, f"message {number} (a function_call)")
    except json.JSONDecodeError:
        value = None
    calls = value if isinstance(value, list) else [value]
    return [_call(call, number) for call in calls]


def _call(call: Any, number: int) -> dict:
    """One tool call as templates read it: ``{"type": "function", "function": {"name", "arguments": {...}}}``
    (OpenAI's ``arguments`` JSON string is decoded: templates write it out with ``tojson``)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise Rejected(f"message {number} holds a tool call that is not a JSON object with a 'name' and "
                       f"'arguments': {str(call)[:80]}", "bad_tool_call")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = loads(arguments, f"message {number}: the arguments of tool call {function['name'][:40]!r}")
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            # kept byte for byte for a template that joins the arguments to text (assistant_turns.shape_calls)
            arguments, text = decoded, arguments
        else:
            text = None
    else:
        text = None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if text is not None:
        out["function"][ARGUMENTS_TEXT] = text
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# ---------------------------------------------------------------------------------------------
# fitting a conversation to training and to the template: small transforms, each counted
# ---------------------------------------------------------------------------------------------


def fit(conversation: Conversation, policy: Policy) -> Conversation:
    """Apply the policy's transforms in order; each adds what it changed to ``conversation.changes``."""
    counts: Counter = Counter()
    messages = conversation.messages
    for transform in (_tool_results_as_user, _drop_leading, _merge_consecutive, _own_roles, _fold_system):
        messages = transform(messages, policy, counts)
    # the shape the template reads; what changes only in the turn being trained goes to ``trained``
    messages = shape_calls(messages, policy.call_content, policy.call_arguments, counts)
    trained: dict[int, dict] = {}
    reasoning: dict[int, str] = {}
    messages = place_reasoning(messages, policy.reasoning_fields, policy.reasoning, counts, trained, reasoning)
    messages = _tool_calls_as_text(messages, policy, counts, trained)
    if conversation.template_kwargs:
        counts["template_kwargs"] += 1
    if counts.get("leading_turns_dropped") and not any(m["role"] == "assistant" for m in messages):
        raise Rejected(f"no assistant turn to train on after the first user turn ({counts['leading_turns_dropped']} "
                       "turn(s) before it were dropped: --leading-assistant drop)", "no_assistant_turn")
    return Conversation(messages=messages, tools=conversation.tools, text=conversation.text,
                        changes={k: v for k, v in counts.items() if v}, template_kwargs=conversation.template_kwargs,
                        trained=trained, reasoning=reasoning)


def _tool_calls_as_text(messages: list[dict], policy: Policy, counts: Counter, trained: dict[int, dict]) -> list[dict]:
    """For a template that renders no tool calls: the calls as JSON text in the trained turn only
    (``--tool-calls text``), or the record set aside (``reject``)."""
    if policy.tool_calls != "text":
        return messages
    out = []
    for number, message in enumerate(messages):
        if message.get("tool_calls"):
            if policy.unrendered_calls == "reject":
                raise Rejected(f"assistant message {number} makes tool calls, and the chat template renders none; "
                               "--tool-calls text writes them into the reply as JSON", "tool_calls_not_rendered")
            calls = "\n".join(json.dumps(call["function"], ensure_ascii=False) for call in message["tool_calls"])
            history = {k: v for k, v in message.items() if k != "tool_calls"}
            own = trained.get(number, history)
            trained[number] = {**own, "content": "\n\n".join(p for p in (own.get("content"), calls) if p)}
            message = {**history, "content": history.get("content") or ""}
            counts["tool_calls_as_text"] += 1
        out.append(message)
    return out


def _own_roles(messages: list[dict], policy: Policy, counts: Counter) -> list[dict]:
    """OpenAI's own roles (developer, ipython, function) as they are where the template renders them,
    else as their canonical role (counted)."""
    if not any(ROLE in m for m in messages):
        return messages
    out = []
    for message in messages:
        if ROLE in message:
            given, message = message[ROLE], {k: v for k, v in message.items() if k != ROLE}
            if given in policy.roles:
                message["role"] = given
            else:
                counts["roles_mapped"] += 1
        out.append(message)
    return out


def _tool_results_as_user(messages: list[dict], policy: Policy, counts: Counter) -> list[dict]:
    if policy.tool_results != "user":
        return messages
    counts["tool_results_as_user"] += sum(m["role"] == "tool" for m in messages)
    return [{"role": "user", "content": m["content"]} if m["role"] == "tool" else m for m in messages]


def _drop_leading(messages: list[dict], policy: Policy, counts: Counter) -> list[dict]:
    """Turns between the leading system turn(s) and the first user turn."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    if head < len(messages) and messages[head]["role"] == "user":  # the common case, without the search
        return messages
    first_user = next((i for i in range(head, len(messages)) if messages[i]["role"] == "user"), len(messages))
    if first_user == head:
        return messages
    if policy.leading_assistant == "reject":
        roles = ", ".join(repr(m["role"]) for m in messages[head:first_user])
        raise Rejected(f"the conversation starts with {first_user - head} turn(s) before the first user turn "
                       f"({roles}); --leading-assistant drop removes them and trains the rest", "leading_assistant")
    counts["leading_turns_dropped"] += first_user - head
    return messages[:head] + messages[first_user:]


def _merge_consecutive(messages: list[dict], policy: Policy, counts: Counter) -> list[dict]:
    if policy.consecutive in ("keep", "auto"):  # auto, not decided by a template (none to refuse them): kept
        return messages
    roles = policy.merged_roles if policy.consecutive == "merge" else ("user", "assistant")
    out: list[dict] = []
    for number, message in enumerate(messages):
        before = out[-1] if out else None
        if before is None or before["role"] != message["role"] or message["role"] not in roles:
            out.append(message)
            continue
        if policy.consecutive == "reject":
            raise Rejected(f"messages {number - 1} and {number} are both {message['role']!r} turns; "
                           "--consecutive merge joins them, --consecutive keep leaves them to the template",
                           "consecutive_turns")
        merged = {**{k: v for k, v in before.items() if k != GIVEN},
                  "content": "\n\n".join(p for p in (before["content"], message["content"]) if p)}
        for name in REASONING_FIELDS:  # both turns' reasoning, under the field the template reads
            if before.get(name) or message.get(name):
                merged[name] = "\n\n".join(p for p in (before.get(name), message.get(name)) if p)
        if before.get(OTHERS) or message.get(OTHERS):  # either turn's dropped spellings, counted once it is placed
            merged[OTHERS] = 1
        if before.get("tool_calls") or message.get("tool_calls"):
            merged["tool_calls"] = list(before.get("tool_calls") or []) + list(message.get("tool_calls") or [])
        out[-1] = merged
        counts["turns_merged"] += 1
    return out


def _fold_system(messages: list[dict], policy: Policy, counts: Counter) -> list[dict]:
    if policy.system != "fold" or not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) > 1 and messages[1]["role"] == "user":
        first = messages[1]
        text = "\n\n".join(p for p in (messages[0]["content"], first["content"]) if p)
        counts["system_folded"] += 1
        return [{**first, "content": text}] + messages[2:]
    return messages


_CHANGE_TEXT = {
    "leading_turns_dropped": "{n} turns before the first user turn dropped (--leading-assistant drop)",
    "turns_merged": "{n} turns merged into the turn before (the template refuses two in a row, or --consecutive "
                    "merge)",
    "system_folded": "{n} system messages folded into the first user turn (the template refuses one, or --system "
                     "fold)",
    "tool_calls_as_text": "{n} tool-calling turns written as text (the template renders no tool_calls)",
    "tool_results_as_user": "{n} tool results given as user turns (the template has no tool role)",
    "control_text_in_content": "{n} records whose own text spells a control token, encoded as plain text "
                               "(--content-special-tokens)",
    "tool_call_text_dropped": "{n} texts beside tool calls dropped (the template renders calls only without content)",
    "reasoning_inlined": "{n} trained turns' reasoning written inline as <think>...</think> (--reasoning inline)",
    "reasoning_dropped": "{n} assistant turns' reasoning in no trained token (the template strips it, or --reasoning "
                         "drop)",
    "template_kwargs": "{n} records rendered with their own chat_template_kwargs",
    "roles_mapped": "{n} developer/ipython/function messages given as system or tool (the template renders no such "
                    "role)",
    "reasoning_trained": "{n} assistant turns' reasoning trained as the template writes it",
    "reasoning_spellings_dropped": "{n} assistant turns gave reasoning under several names with other texts: the "
                                   "first of reasoning_content, reasoning, thinking kept, the others dropped",
}


def changes_text(changes: dict[str, int], turns_not_located: int) -> str:
    """One line for people (pack, stats, the dataset card): what normalizing changed, and the
    assistant turns left untrained because they could not be located (render.py)."""
    done = [_CHANGE_TEXT[name].format(n=f"{changes[name]:,}") for name in CHANGES if changes.get(name)]
    return (f"turns: {'; '.join(done) or 'as the data has them, none dropped, merged or converted'}; "
            f"{turns_not_located:,} assistant turns left untrained (turns_not_located)")


def _alpaca(record: dict) -> Conversation:
    instruction = _string(record.get("instruction"), "field 'instruction'")
    extra = record.get("input")
    if extra:
        instruction = f"{instruction}\n\n{_string(extra, 'field input')}"
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _string(record["system"], "field 'system'")})
    messages.append({"role": "user", "content": instruction})
    messages.append({"role": "assistant", "content": _string(record.get("output"), "field 'output'")})
    return Conversation(messages=messages)


def _text(record: dict, key: str) -> Conversation:
    text = _string(record.get(key), f"field {key!r}")
    if not text.strip():
        raise Rejected(f"field {key!r} is empty", "empty")
    return Conversation(text=text)


def _turn_list(record: dict, key: str) -> list:
    if key not in record:
        raise Rejected(f"missing field {key!r}", "missing_field")
    turns = record[key]
    if isinstance(turns, str):  # some exports store the list as a JSON string
        try:
            turns = loads(turns, f"field {key!r}")
        except json.JSONDecodeError:
            raise Rejected(f"field {key!r} is a string that is not a JSON list", "wrong_type") from None
    if not isinstance(turns, list):
        raise Rejected(f"field {key!r} is a JSON {_json_type(turns)}, expected a list of messages", "wrong_type")
    if not turns:
        raise Rejected("empty conversation", "empty")
    return turns


def _content(value: Any, number: int) -> str:
    """OpenAI content: a string, or a list of text parts (an image part, or any other, is rejected)."""
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                raise Rejected(f"message {number} has an image part; {NO_PROCESSOR}", "images_without_processor")
            else:
                raise Rejected(f"message {number} has a content part that is not text: {str(part)[:60]}", "wrong_type")
        return "".join(texts)
    return _string(value, "message {} 'content'", number)


def _string(value: Any, what: str, *args) -> str:
    """``value``, a string; else Rejected, naming it ``what`` (``what.format(*args)``: formatted only
    then, as this runs for every message)."""
    if not isinstance(value, str):
        raise Rejected(f"{what.format(*args) if args else what} is a JSON {_json_type(value)}, expected a string",
                       "wrong_type")
    return value


def _tools(value: Any) -> list | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = loads(value, "field 'tools'")
        except json.JSONDecodeError:
            raise Rejected("field 'tools' is a string that is not valid JSON", "wrong_type") from None
    if not isinstance(value, list):
        raise Rejected(f"field 'tools' is a JSON {_json_type(value)}, expected a list", "wrong_type")
    # a bare function schema {"name", "description", "parameters"} (glaive, LLaMA-Factory) gets the
    # OpenAI wrapper that templates and transformers' own tool schemas use
    return [{"type": "function", "function": tool} if isinstance(tool, dict) and "name" in tool
            and "function" not in tool else tool for tool in value]


def _json_type(value: Any) -> str:
    return {
        type(None): "null",
        bool: "boolean",
        int: "number",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)
