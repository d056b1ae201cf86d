"""Step 2: turn a raw record of any supported format into one canonical conversation.

Canonical form: a list of ``{"role", "content"}`` messages with roles ``system``, ``user``,
``assistant`` and ``tool`` (plus optional ``tools`` for templates that render them), or a plain
text for ``text`` records. Anything that cannot be normalised raises :class:`Rejected` with a
reason a person can act on; the JSON Schemas in ``schemas/`` explain structural problems.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

FORMATS = ("sharegpt", "openai", "alpaca", "text")

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
    "function": "tool",
}
OPENAI_ROLES = {role: role for role in ("system", "user", "assistant", "tool")}


class Rejected(Exception):
    """A record that cannot be trained on.

    ``str(exc)`` is the reason written to rejects.jsonl; ``code`` is the short category that the
    manifest counts (``rejected_by_reason``).
    """

    def __init__(self, reason: str, code: str = "invalid_record"):
        super().__init__(reason)
        self.code = code


@dataclass
class Conversation:
    messages: list[dict[str, str]] | None = None
    tools: list[Any] | None = None
    text: str | None = None


@dataclass(frozen=True)
class FieldNames:
    """Column names, overridable for data sets that use other keys."""

    messages: str | None = None  # default: "conversations" (sharegpt) or "messages" (openai)
    text: str = "text"


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


def normalize(record: Any, fmt: str, fields: FieldNames = FieldNames()) -> Conversation:
    """Return the canonical conversation of ``record`` or raise :class:`Rejected`."""
    if not isinstance(record, dict):
        raise Rejected(f"record is a JSON {_json_type(record)}, expected an object", "not_an_object")
    try:
        if fmt == "sharegpt":
            return _sharegpt(record, fields.messages or "conversations")
        if fmt == "openai":
            return _openai(record, fields.messages or "messages")
        if fmt == "alpaca":
            return _alpaca(record)
        if fmt == "text":
            return _text(record, fields.text)
    except Rejected as exc:
        detail = schema_problem(record, fmt, fields)
        reason = f"{exc} ({detail})" if detail and detail not in str(exc) else str(exc)
        raise Rejected(reason, exc.code) from None
    raise ValueError(f"unknown format {fmt!r}")


def _sharegpt(record: dict, key: str) -> Conversation:
    turns = _turn_list(record, key)
    messages = []
    system = record.get("system")
    if system:
        messages.append({"role": "system", "content": _string(system, "field 'system'")})
    for number, turn in enumerate(turns):
        role = _role(turn, number, "from", SHAREGPT_ROLES)
        content = _string(turn.get("value"), f"message {number} 'value'")
        messages.append({"role": role, "content": content})
    return Conversation(messages=messages, tools=_tools(record.get("tools")))


def _openai(record: dict, key: str) -> Conversation:
    turns = _turn_list(record, key)
    messages = []
    for number, turn in enumerate(turns):
        role = _role(turn, number, "role", OPENAI_ROLES)
        messages.append({"role": role, "content": _content(turn.get("content"), number)})
    return Conversation(messages=messages, tools=_tools(record.get("tools")))


def _role(turn, number: int, field: str, roles: dict[str, str]) -> str:
    """The canonical role of message ``number``, read from its ``field`` and mapped through ``roles``."""
    if not isinstance(turn, dict):
        raise Rejected(f"message {number} is a JSON {_json_type(turn)}, expected an object", "wrong_type")
    if field not in turn:
        raise Rejected(f"message {number} has no {field!r} field (keys: {sorted(turn)[:8]})", "missing_field")
    value = turn[field]
    if not isinstance(value, str) or value not in roles:
        raise Rejected(f"message {number} has unknown role {value!r}; known: {sorted(roles)}", "unknown_role")
    return roles[value]


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
            turns = json.loads(turns)
        except json.JSONDecodeError:
            raise Rejected(f"field {key!r} is a string that is not a JSON list", "wrong_type") from None
    if not isinstance(turns, list):
        raise Rejected(f"field {key!r} is a JSON {_json_type(turns)}, expected a list of messages", "wrong_type")
    if not turns:
        raise Rejected("empty conversation", "empty")
    return turns


def _content(value: Any, number: int) -> str:
    """OpenAI content: a string, or a list of text parts (other part types are rejected)."""
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise Rejected(f"message {number} has a content part that is not text: {str(part)[:60]}", "wrong_type")
        return "".join(texts)
    return _string(value, f"message {number} 'content'")


def _string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise Rejected(f"{what} is a JSON {_json_type(value)}, expected a string", "wrong_type")
    return value


def _tools(value: Any) -> list | None:
    if value in (None, "", []):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Rejected("field 'tools' is a string that is not valid JSON", "wrong_type") from None
    if not isinstance(value, list):
        raise Rejected(f"field 'tools' is a JSON {_json_type(value)}, expected a list", "wrong_type")
    return value


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


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    """A JSON Schema shipped in ``schemas/`` (``sharegpt``, ``openai``, ``packed_row``, ...)."""
    text = resources.files("packprep").joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


def schema_problem(record: Any, fmt: str, fields: FieldNames = FieldNames()) -> str | None:
    """The first violation of the format's JSON Schema, as one line; None if it validates.

    Only called for records already rejected, so validation costs nothing on the fast path.
    Custom field names are checked structurally by the normaliser alone.
    """
    if fields.messages or fields.text != "text":
        return None
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema(fmt))
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(record))
    except RecursionError:  # a record nested too deeply to describe; the normaliser's reason stands
        return None
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "record"
    return f"schema {fmt}: at {where}: {error.message[:160]}"
