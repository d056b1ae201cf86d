"""Look inside one packed row: its text, its sequence boundaries and which tokens are trained.

``inspect_row(folder, row)`` decodes row ``row`` (counted over all shards, in shard order) with
the manifest's tokenizer. Each packed sequence gets a header line (its number, the input record
it came from, its tokens and trained tokens); within it, trained tokens (label != -100) are shown
in green on a terminal, or between ``[[`` and ``]]`` when the output is piped or ``color=False``.

A trained token's label equals its input id (``verify`` checks that), so what is highlighted is
exactly what the loss sees, after the model's one-token shift.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .errors import ConfigError, InputError
from .layout import IGNORE_INDEX, LayoutError, ShardReader, readable_layout
from .tokenization import load_tokenizer
from .verification import read_manifest

OPEN, CLOSE = "[[", "]]"
_GREEN, _DIM, _HEAD, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[1;36m", "\x1b[0m"


def inspect_row(
    folder: str | os.PathLike,
    row: int = 0,
    color: bool | None = None,
    tokenizer: str | None = None,
) -> str:
    """Return row ``row`` of the packed output ``folder`` as annotated text.

    ``color``: True for ANSI colour, False for ``[[trained]]`` brackets, None to choose colour
    only when stdout is a terminal (and ``NO_COLOR`` is unset). ``tokenizer`` overrides the
    manifest's ``tokenizer.name_or_path`` (for a folder packed on another machine).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("layout"):
        readable_layout(manifest["layout"], where=f"{folder}: ")  # a stack's own files hold no rows to show
    row, shard, local, total = _locate(manifest, row)
    record = _read_row(folder / shard["path"], local, manifest.get("layout"))
    name = tokenizer or manifest.get("tokenizer", {}).get("name_or_path")
    if not name:
        raise ConfigError("the manifest names no tokenizer; pass --tokenizer")
    try:
        tok = load_tokenizer(name)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the tokenizer the folder was packed with; pass --tokenizer to use another)") from None
    if color is None:
        color = sys.stdout is not None and sys.stdout.isatty() and not os.environ.get("NO_COLOR")

    ids = np.asarray(record["input_ids"], dtype=np.int64)
    labels = np.asarray(record["labels"], dtype=np.int64)
    seq_lens = [int(n) for n in record["seq_lens"]]
    sources = [int(s) for s in record["source_index"]]
    trained = labels != IGNORE_INDEX
    max_len = manifest.get("config", {}).get("max_len")
    head = (
        f"row {row} of {total} ({shard['path']}, row {local}): {len(ids):,} tokens"
        + (f" of {max_len:,}" if max_len else "")
        + f", {len(seq_lens)} sequence{'s' if len(seq_lens) != 1 else ''}, {int(trained.sum()):,} trained"
    )
    legend = (
        f"trained tokens in {_GREEN}green{_RESET}, the rest {_DIM}dim{_RESET}"
        if color
        else f"trained tokens between {OPEN} and {CLOSE}"
    )
    out = [head, legend]
    start = 0
    for number, (length, source) in enumerate(zip(seq_lens, sources), start=1):
        stop = start + length
        label = (
            f"── sequence {number}/{len(seq_lens)} · record {source} · {length:,} tokens, "
            f"{int(trained[start:stop].sum()):,} trained "
        )
        label = label.ljust(78, "─")
        out.append(f"{_HEAD}{label}{_RESET}" if color else label)
        out.append(_render_sequence(tok, ids[start:stop], trained[start:stop], color))
        start = stop
    return "\n".join(out) + "\n"


def _locate(manifest: dict, row: int) -> tuple[int, dict, int, int]:
    """(global row, shard entry, row within the shard, total rows) of ``row`` (negative: from the end)."""
    total = sum(int(shard["rows"]) for shard in manifest["shards"])
    wanted = row + total if row < 0 else row
    if not 0 <= wanted < total:
        raise ConfigError(f"--row {row}: the folder has {total:,} rows (0 to {total - 1:,}, or -1 to -{total:,})")
    local = wanted
    for shard in manifest["shards"]:
        if local < int(shard["rows"]):
            return wanted, shard, local, total
        local -= int(shard["rows"])
    raise AssertionError("unreachable")


def _read_row(path: Path, row: int, layout: str | None = None) -> dict:
    """One row of a shard (canonical names), reading only the row group / batch holding it."""
    import pyarrow as pa

    try:
        return ShardReader(path, layout).row(row)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read ({exc}); run packprep verify") from None
    except IndexError:
        raise InputError(f"{path}: holds fewer rows than the manifest says; run packprep verify") from None
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None


def _render_sequence(tok, ids: np.ndarray, trained: np.ndarray, color: bool) -> str:
    """Decode ``ids`` as one text, split into runs of trained / untrained tokens."""
    if len(ids) == 0:
        return ""
    change = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    bounds = [0, *change.tolist(), len(ids)]
    # Decode growing prefixes, so a run boundary never breaks a character or a leading space
    # (SentencePiece drops the space of a text's first token; byte-level BPE may split a
    # character over two tokens).
    prefix = [""]
    for stop in bounds[1:]:
        prefix.append(tok.decode(ids[:stop].tolist(), skip_special_tokens=False))
    parts = []
    for k in range(len(bounds) - 1):
        before, after = prefix[k], prefix[k + 1]
        if after.startswith(before):
            text = after[len(before):]
        else:
            text = tok.decode(ids[bounds[k] : bounds[k + 1]].tolist(), skip_special_tokens=False)
        if trained[bounds[k]]:
            parts.append(f"{_GREEN}{text}{_RESET}" if color else f"{OPEN}{text}{CLOSE}")
        else:
            parts.append(f"{_DIM}{text}{_RESET}" if color else text)
    return "".join(parts)
