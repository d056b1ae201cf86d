"""The JSON Schemas packprep ships (``schemas/``): the input formats, the manifest, a packed row; and a
rejected record's first violation of its format's schema, said whole in one line."""

from __future__ import annotations

import json
import reprlib
from functools import lru_cache
from importlib import resources
from typing import Any

from .errors import listing


@lru_cache(maxsize=None)
def load_schema(name: str) -> dict:
    """A JSON Schema shipped in ``schemas/`` (``sharegpt``, ``openai``, ``packed_row``, ...)."""
    text = resources.files("packprep").joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


def schema_problem(record: Any, fmt: str) -> str | None:
    """The first violation of the format's JSON Schema, as one line; None if it validates.

    Only called for records already rejected, so validation costs nothing on the fast path; records
    read under custom field names are checked structurally by the normaliser alone.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema(fmt))
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(record))
    except RecursionError:  # a record nested too deeply to describe; the normaliser's reason stands
        return None
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "record"
    return f"schema {fmt}: at {where}: {_schema_message(error)}"


def _schema_message(error) -> str:
    """jsonschema's message, whole: its lists and the value it quotes shortened, not the sentence cut."""
    value = reprlib.repr(error.instance)
    if error.validator == "enum":
        return f"{value} is not one of {listing(map(repr, error.validator_value))}"
    if len(error.message) <= 160:
        return error.message
    if error.validator == "type":
        return f"{value} is not of type {error.validator_value!r}"
    return f"{value} breaks the schema's {error.validator!r} rule"
