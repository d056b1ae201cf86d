"""Step 1: read raw records from files, folders and Hub ids.

Each record keeps where it came from (file, 0-based record index, 1-based line for JSONL), so
that every later rejection can name it. A line of JSONL that is not valid JSON is a *record*
error (the rest of the file is still usable); a file that cannot be parsed at all is an
``InputError`` naming the file and where parsing stopped.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import ConfigError, InputError

JSON_SUFFIXES = (".json", ".json.gz", ".json.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)


@dataclass
class Record:
    """One raw input record, or the reason it could not even be decoded."""

    file: str
    index: int  # 0-based record index within the file
    line: int | None  # 1-based line number (JSONL only)
    data: Any = None
    error: str | None = None


@dataclass
class Source:
    """An input as the manifest describes it."""

    path: str
    kind: str
    records: int = 0


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Check every input exists before work starts, and decide how to read it."""
    if not inputs:
        raise ConfigError("no input given: pass one or more files, folders or Hub dataset ids")
    sources = []
    for spec in inputs:
        path = Path(spec)
        if path.is_dir():
            if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
                sources.append(Source(str(path), "saved_dataset"))
            else:
                files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p.name))
                if not files:
                    raise ConfigError(f"{spec}: folder holds no .json/.jsonl/.parquet/.arrow file")
                sources.extend(Source(str(p), _kind(p.name)) for p in files)
        elif path.is_file():
            kind = _kind(path.name)
            if kind is None:
                raise ConfigError(
                    f"{spec}: unknown file type; use .json, .jsonl (optionally .gz/.zst), "
                    ".parquet or .arrow"
                )
            sources.append(Source(str(path), kind))
        elif _looks_like_hub_id(spec):
            sources.append(Source(spec, "hub"))
        else:
            raise ConfigError(f"{spec}: no such file or folder")
    return sources


def _kind(name: str) -> str | None:
    lower = name.lower()
    for kind, suffixes in (
        ("jsonl", JSONL_SUFFIXES),
        ("json", JSON_SUFFIXES),
        ("parquet", PARQUET_SUFFIXES),
        ("arrow", ARROW_SUFFIXES),
    ):
        if lower.endswith(suffixes):
            return kind
    return None


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not spec.startswith((".", "/"))


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_records(source: Source) -> Iterator[Record]:
    """Yield the records of one source in file order."""
    reader = {
        "jsonl": _read_jsonl,
        "json": _read_json,
        "parquet": _read_parquet,
        "arrow": _read_arrow,
        "saved_dataset": _read_saved_dataset,
        "hub": _read_hub,
    }[source.kind]
    count = 0
    for record in reader(source.path):
        count += 1
        yield record
    source.records = count


def _open_text(path: str) -> io.TextIOBase:
    """Open plain, gzip or zstd text; invalid UTF-8 is replaced so it surfaces as a record error."""
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="surrogateescape")
    if path.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
        return io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def _read_jsonl(path: str) -> Iterator[Record]:
    index = 0
    try:
        with _open_text(path) as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError:
                    yield Record(path, index, line_no, error="invalid UTF-8")
                    index += 1
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield Record(path, index, line_no, error=f"invalid JSON at column {exc.colno}: {exc.msg}")
                else:
                    yield Record(path, index, line_no, data=data)
                index += 1
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read after {index} records: {exc}") from exc


def _read_json(path: str) -> Iterator[Record]:
    try:
        with _open_text(path) as handle:
            text = handle.read()
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from exc
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{path}: invalid UTF-8 at character {exc.start}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        if exc.pos >= len(text.rstrip()):
            hint = " (the file ends early: was it cut off?)"
        elif text.lstrip().startswith("{") and "\n{" in text:
            hint = " (one JSON object per line? name the file .jsonl)"
        raise InputError(
            f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno} "
            f"(character {exc.pos}): {exc.msg}{hint}"
        ) from exc
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON array of records, found {type(data).__name__}")
    for index, item in enumerate(data):
        yield Record(path, index, None, data=item)


def _read_table_batches(path: str, batches: Iterator[Any]) -> Iterator[Record]:
    index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield Record(path, index, None, data=row)
            index += 1


def _read_parquet(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise InputError(f"{path}: not a readable Parquet file: {exc}") from exc
    yield from _read_table_batches(path, parquet.iter_batches(batch_size=1024))


def _read_arrow(path: str) -> Iterator[Record]:
    import pyarrow as pa

    try:
        with open(path, "rb") as handle:
            head = handle.read(6)
        if head == b"ARROW1":
            table = pa.ipc.open_file(pa.memory_map(path)).read_all()
        else:
            table = pa.ipc.open_stream(pa.memory_map(path)).read_all()
    except Exception as exc:
        raise InputError(f"{path}: not a readable Arrow IPC file: {exc}") from exc
    yield from _read_table_batches(path, table.to_batches(max_chunksize=1024))


def _read_saved_dataset(path: str) -> Iterator[Record]:
    import datasets

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise InputError(f"{path}: saved DatasetDict has no 'train' split (has {list(loaded)})")
        loaded = loaded["train"]
    yield from _read_table_batches(path, loaded.data.to_batches(max_chunksize=1024))


def _read_hub(repo_id: str) -> Iterator[Record]:
    import datasets

    try:
        loaded = datasets.load_dataset(repo_id, split="train")
    except Exception as exc:
        raise InputError(
            f"{repo_id}: not a local file and could not be loaded from the Hugging Face Hub: {exc}"
        ) from exc
    yield from _read_table_batches(repo_id, loaded.data.to_batches(max_chunksize=1024))
