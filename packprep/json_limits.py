"""How deep a record's or an option's JSON may nest, and how long its numbers may be: one bound for
every reader and walker.

Python decodes, copies, walks and writes JSON recursively (``json``, Jinja's ``tojson``, the control-text
mask, the manifest's indented JSON), each with its own stack budget, so a value nested a few thousand
deep fails in whichever of them it meets first, as an internal error. It is checked once where it comes
in instead: a record as it is read (:func:`check_depth` in ``normalize``), a JSON text inside one of
its strings (tool-call arguments, a ShareGPT ``function_call``) and a ``--template-arg`` as they are
decoded (:func:`loads`). Past :data:`MAX_DEPTH` the record is rejected (``nested_too_deep``) and the
option refused; a number past Python's integer-string limit (4,300 digits) likewise
(``number_too_long``). Real data nests a dozen deep; the bound leaves every walker far within its stack.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MAX_DEPTH = 100  # arrays and objects inside one another
_CONTAINERS = (dict, list, tuple)


class JSONLimit(ValueError):
    """A value past a bound; ``code`` is the rejection's code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep in ``value`` (walked level by level,
    without recursion)."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    for _ in range(limit):
        below = []
        for item in level:
            for child in (item.values() if isinstance(item, dict) else item):
                if isinstance(child, _CONTAINERS):
                    below.append(child)
        if not below:
            return False
        level = below
    return bool(level)


def check_depth(value: Any, what: str) -> Any:
    """``value``, if it nests at most :data:`MAX_DEPTH` deep; else :class:`JSONLimit` naming ``what``."""
    if too_deep(value):
        raise JSONLimit(f"{what} nests arrays and objects more than {MAX_DEPTH} deep", "nested_too_deep")
    return value


def loads(text: str, what: str) -> Any:
    """``json.loads(text)`` within the bounds: json.JSONDecodeError where it is no JSON, :class:`JSONLimit`
    where it nests too deep or holds a number too long for Python."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise JSONLimit(f"{what} nests arrays and objects more than {MAX_DEPTH} deep", "nested_too_deep") from None
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        digits = sys.get_int_max_str_digits()
        raise JSONLimit(f"{what} holds a number of more than {digits:,} digits, more than Python reads "
                        "(write it as a string)", "number_too_long") from None
    return check_depth(value, what)
