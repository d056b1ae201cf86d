"""What a chat template is given besides the messages: a fixed date, template arguments, a named template.

A template that reads the clock (Llama-3.2's ``strftime_now("%d %b %Y")``) would write the day of the
run into every sequence, so the same inputs would give other bytes tomorrow. Every rendering gets
one fixed date instead (``--date``, default :data:`DEFAULT_DATE`, recorded in the manifest): the
``strftime_now`` it calls formats that date, and ``date_string`` (Llama-3.1/3.3) is that date as
Meta's templates write it. The default is the date Llama-3.1's own template falls back to, so a
template that takes ``date_string`` renders as it does when given none.

``--template-arg KEY=VALUE`` (``enable_thinking=false``) is passed to every rendering, and a record's
own ``chat_template_kwargs`` on top (normalize.py). A tokenizer with several named templates (the
list form of ``chat_template``) uses ``default`` unless ``--chat-template NAME`` picks another.
"""

from __future__ import annotations

import json
import math
import re
from datetime import date, datetime

from .errors import ConfigError
from .json_limits import JSONLimit, check_depth, loads

DEFAULT_DATE = "2024-07-26"
# names a template argument cannot take: packprep passes these itself
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                      "unk_token", "pad_token", "additional_special_tokens", "strftime_now", "raise_exception"})


def check_date(text: str) -> date:
    """``--date``: a calendar date written YYYY-MM-DD."""
    try:
        if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):  # fromisoformat also takes 2024-W01-1
            raise ValueError
        return date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ConfigError(f"--date must be a date written YYYY-MM-DD, not {text!r}") from None


def parse_template_args(pairs) -> dict:
    """``--template-arg`` values ``KEY=VALUE`` as a dict; VALUE is read as JSON (``false``, ``3``,
    ``{"a": 1}``), else taken as a string."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"--template-arg {pair!r}: expected KEY=VALUE, KEY a template variable name "
                              "(e.g. enable_thinking=false)")
        try:
            out[key] = loads(value, f"--template-arg {key}")
        except json.JSONDecodeError:
            out[key] = value
        except JSONLimit as exc:
            raise ConfigError(str(exc)) from None
    return out


def check_template_args(args, what: str = "--template-arg") -> dict:
    """``args`` if it is a dict of template variables packprep does not set itself, else ConfigError."""
    if not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier() for k in args):
        raise ConfigError(f"{what} must map template variable names to values, not {str(args)[:80]}")
    taken = sorted(RESERVED & set(args))
    if taken:
        raise ConfigError(f"{what} cannot set {', '.join(taken)}: packprep passes these to the template itself")
    for key, value in args.items():
        try:
            check_depth(value, f"{what} {key}")
        except JSONLimit as exc:
            raise ConfigError(str(exc)) from None
        if not _finite(value):  # NaN and Infinity are not JSON: the manifest records these values
            raise ConfigError(f"{what} {key}: NaN and Infinity are not JSON numbers; give a finite number or text")
    return args


def _finite(value) -> bool:
    """No NaN or Infinity in ``value`` (nested at most json_limits.MAX_DEPTH deep: checked first)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    if isinstance(value, list):
        return all(map(_finite, value))
    return True


class FixedClock:
    """``strftime_now`` for templates: formats the run's fixed date (at midnight), never the clock."""

    def __init__(self, day: date):
        self.day = datetime(day.year, day.month, day.day)

    def __call__(self, format: str) -> str:
        return self.day.strftime(format)


def template_variables(day: str = DEFAULT_DATE, args: dict | None = None) -> dict:
    """The variables every rendering of a run gets: the fixed date's ``strftime_now`` and
    ``date_string``, then the template arguments (which may set ``date_string`` themselves)."""
    fixed = check_date(day)
    return {"strftime_now": FixedClock(fixed), "date_string": fixed.strftime("%d %b %Y"), **(args or {})}


def named_templates(value, where: str = "the tokenizer"):
    """A ``chat_template`` as transformers holds it: a string, or ``{name: template}`` for the list form
    ``[{"name": ..., "template": ...}]`` of tokenizer_config.json."""
    if isinstance(value, list):
        named = {}
        for number, entry in enumerate(value, start=1):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ConfigError(f"{where}: chat_template entry {number} has no 'name': each entry of the "
                                  "list form is {\"name\": ..., \"template\": ...}")
            if not isinstance(entry.get("template"), str):
                raise ConfigError(f"{where}: chat template {entry['name']!r} has no 'template' text; fix its "
                                  "entry in tokenizer_config.json (or chat_template.json)")
            named[entry["name"]] = entry["template"]
        return named
    return value


def select_template(tokenizer, name: str | None) -> None:
    """Make the named template (``--chat-template``; default ``default``) the tokenizer's only one."""
    where = f"tokenizer {getattr(tokenizer, 'name_or_path', None) or 'given'}"
    templates = named_templates(getattr(tokenizer, "chat_template", None), where)
    if not isinstance(templates, dict):
        if name not in (None, "default"):
            raise ConfigError(f"--chat-template {name}: the tokenizer has a single chat template, not named ones")
        return
    chosen = name or "default"
    if chosen not in templates:
        names = ", ".join(sorted(templates)) or "none"
        advice = "pick one with --chat-template NAME" if name is None else "pick one of them"
        raise ConfigError(f"the tokenizer has named chat templates ({names}) and no {chosen!r} one; {advice}")
    if not isinstance(templates[chosen], str):
        raise ConfigError(f"{where}: chat template {chosen!r} is not text; fix its entry in tokenizer_config.json")
    tokenizer.chat_template = templates[chosen]


def prepare_template(tokenizer, chat_template: str | None = None, day: str = DEFAULT_DATE,
                     template_args: dict | None = None) -> dict:
    """Pick the run's named template on ``tokenizer`` and return the variables its renderings get
    (pack, stats and ``verify --retokenize`` call this with the run's settings)."""
    select_template(tokenizer, chat_template)
    return template_variables(day, template_args)
