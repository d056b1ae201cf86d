"""Repeated keys in a JSON object: json keeps the last value silently, so such a record would be read
one way without a word. Checking every object with ``object_pairs_hook`` is slow; instead a text is
searched only where it holds more key-like ``"`` + ``:`` than its decoded value has keys (a repeat
makes the value lose a key; colons inside strings only send a text down the slow path)."""

from __future__ import annotations

import json
import re
from typing import Any

_KEY_END = re.compile(r'"\s*:')  # every key ends so (and some string contents do)


class _Repeated(dict):
    """An object whose text repeats ``key`` (built only on the slow path)."""

    key = ""


def _pairs(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set = set()
    repeated = _Repeated(obj)
    repeated.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return repeated


def _keys(value: Any) -> int:
    """How many keys the objects in a decoded value hold (json decodes to plain dicts and lists):
    recursive, as that is the fastest walk; -1 for a value too deep for it (the slow path decides)."""
    try:
        return _count(value)
    except RecursionError:
        return -1


def _count(value: Any) -> int:
    count = 0
    if type(value) is dict:
        count = len(value)
        value = value.values()
    elif type(value) is not list:
        return 0
    for item in value:
        if type(item) is dict or type(item) is list:
            count += _count(item)
    return count


def _repeated_key(value: Any) -> str | None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Repeated):
            return item.key
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def repeated_key(text: str, value: Any) -> str | None:
    """The first key that an object in the JSON ``text`` (which decodes to ``value``) repeats, or None."""
    keys = _keys(value)
    if text.count(":") <= keys or len(_KEY_END.findall(text)) <= keys:  # the first: 4x cheaper, and often enough
        return None
    return _repeated_key(json.loads(text, object_pairs_hook=_pairs))


def repeated_keys(text: str, items: list) -> list[str | None] | None:
    """For the text of a whole JSON array (or one object) that decodes to ``items``, the key each item
    repeats (None where none does); None if no item can repeat one."""
    keys = [_keys(item) for item in items]
    if -1 not in keys and len(_KEY_END.findall(text)) <= sum(keys):
        return None
    decoded = json.loads(text, object_pairs_hook=_pairs)
    return [_repeated_key(item) for item in (decoded if isinstance(decoded, list) else [decoded])]


def repeated_key_reason(key: str) -> str:
    return (f"the key {key!r} appears twice in one JSON object (JSON readers keep one value silently); "
            "remove or rename one")
