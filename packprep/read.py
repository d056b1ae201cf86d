"""Step 1: read raw records from files, folders and Hub ids.

Each record keeps where it came from (file, 0-based record index, 1-based line for JSONL), so
that every later rejection can name it. A line of JSONL that is not valid JSON is a *record*
error (the rest of the file is still usable); a file that cannot be parsed at all is an
``InputError`` naming the file and where parsing stopped.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .errors import ConfigError, InputError
from .json_keys import repeated_key, repeated_key_reason, repeated_keys

JSON_SUFFIXES = (".json", ".json.gz", ".json.zst")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)


@dataclass
class Record:
    """One raw input record, or the reason it could not even be decoded.

    ``data`` is the decoded JSON value; for a record with an ``error`` it is the raw text (invalid
    bytes replaced by U+FFFD), so that rejects.jsonl can show what the line held.
    """

    file: str
    index: int  # 0-based record index within the file
    line: int | None  # 1-based line number (JSONL only)
    data: Any = None
    error: str | None = None
    code: str = "unreadable"  # the rejection's code, where there is an error


@dataclass
class Source:
    """An input as the manifest describes it: ``named`` is what the user typed (a file, folder,
    pattern or Hub id), ``path`` the file read."""

    path: str
    kind: str
    records: int = 0
    named: str | None = None
    format: str | None = None  # a mixture source's own --format / --messages-field (mix.py); None: the run's
    messages_field: str | None = None


GLOB_CHARACTERS = "*?["
HUB_TIMEOUT = 5.0  # seconds for the one request that checks a Hub id before any work


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Check every input exists before work starts, and decide how to read it.

    A pattern (``'data/*.jsonl'``, quoted so that the shell left it alone) is expanded here.
    """
    if not inputs:
        raise ConfigError("no input given: pass one or more files, folders or Hub dataset ids")
    sources = []
    for spec in inputs:
        if spec in STDIN:
            found = [Source(_spool_stdin(), "jsonl")]
        elif not Path(spec).exists() and any(c in spec for c in GLOB_CHARACTERS):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise ConfigError(f"{spec}: no file matches this pattern")
            found = resolve_inputs(matches)
        else:
            found = _resolve(spec)
        sources.extend(Source(s.path, s.kind, named=spec) for s in found)
    return sources


STDIN = ("-", "/dev/stdin")


def _spool_stdin() -> str:
    """Standard input copied to a temporary file (removed at exit): a run reads its inputs more than
    once (the format, the parts, the manifest's sha256). JSON Lines, or one JSON array."""
    import atexit
    import sys
    import tempfile

    folder = tempfile.mkdtemp(prefix="packprep-stdin-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "stdin.jsonl")
    with open(path, "wb") as handle:
        shutil.copyfileobj(sys.stdin.buffer, handle, 1 << 20)
    return path


def _resolve(spec: str) -> list[Source]:
    sources = []
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
    elif looks_like_hub_id(spec) and _kind(path.name) is None:
        check_hub(spec, "dataset")
        sources.append(Source(spec, "hub"))
    else:
        raise ConfigError(f"{spec}: no such file or folder")
    return sources


def check_hub(repo_id: str, repo_type: str) -> None:
    """Fail at once, in one line, when ``repo_id`` (not a local path) cannot come from the Hub.

    One request with a short timeout and no retries; with ``HF_HUB_OFFLINE`` set, only the local
    cache is asked. (The loaders' own retries take 30-50 s and print every attempt.)
    """
    from huggingface_hub import HfApi, constants, errors

    what = "dataset" if repo_type == "dataset" else "tokenizer"
    if constants.HF_HUB_OFFLINE:
        cached = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"
        if not cached.is_dir():
            raise InputError(f"{repo_id}: no such local file or folder, and HF_HUB_OFFLINE is set, so the Hub "
                             f"{what} of that name cannot be downloaded (it is not in the local cache)")
        return
    api = HfApi()
    try:
        (api.dataset_info if repo_type == "dataset" else api.model_info)(repo_id, timeout=HUB_TIMEOUT)
    except errors.RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such local file or folder, nor a Hub {what} repo of that name") from None
    except (errors.GatedRepoError, errors.HfHubHTTPError) as exc:
        raise InputError(f"{repo_id}: no such local file or folder; the Hub refused it: "
                         f"{str(exc).strip().splitlines()[0]}") from None
    except Exception as exc:  # no network, DNS failure, timeout: whatever the HTTP client raises
        raise InputError(f"{repo_id}: no such local file or folder, and the Hub ({constants.ENDPOINT}) cannot be "
                         f"reached ({type(exc).__name__}). Pass a local path, or set HF_HUB_OFFLINE=1 to use a "
                         "copy in the local cache") from None


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


def looks_like_hub_id(spec: str) -> bool:
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


def first_records(source: Source, count: int) -> list[Record]:
    """The first ``count`` records of ``source`` without reading the rest (format detection)."""
    return list(itertools.islice(stream_records(source), count))


def stream_records(source: Source) -> Iterator[Record]:
    """The records of ``source`` in file order, like :func:`read_records`, but a large JSON array
    an item at a time rather than loaded whole (13 s and 4 GiB for 1.5 GB). Where that reader
    fails, the whole-file reader's own message is what the user sees."""
    if not (source.kind in ("json", "jsonl") and not source.path.endswith(COMPRESSED_SUFFIXES)
            and _first_character(source.path) == "["):
        yield from read_records(source)
        return
    done = 0
    try:
        for record in _json_range_records(Part(0, 0, source.path, "json-range", 0, os.path.getsize(source.path))):
            yield record
            done += 1
    except InputError:  # the whole-file reader says what is wrong, or reads what the item reader cannot
        yield from itertools.islice(read_records(source), done, None)


def _open_binary(path: str) -> io.RawIOBase:
    """The decompressed bytes of a plain, gzip or zstd file."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), 1 << 16)
    return open(path, "rb")


def _open_text(path: str) -> io.TextIOBase:
    """Open plain, gzip or zstd text; invalid UTF-8 is kept (surrogateescape) so it surfaces as a
    record error. A UTF-8 byte order mark is dropped; line ends are left as they are."""
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8-sig", errors="surrogateescape", newline="")


class _ZstdReader(io.RawIOBase):
    """Decompress zstd frames one after another; a file cut off mid-frame raises EOFError.

    (``zstandard``'s own stream reader returns a silent short read on a truncated file.)
    """

    def __init__(self, path: str):
        import zstandard

        self._file = open(path, "rb")
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._dobj = self._new()
        self._pending = memoryview(b"")
        self._started = False  # inside a frame: input must not end here

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = b""
            if self._dobj.eof:  # a frame ended; what follows starts the next one
                chunk = self._dobj.unused_data
                self._dobj = self._new()
                self._started = False
            chunk = chunk or self._file.read(1 << 20)
            if not chunk:
                if self._started:
                    raise EOFError("the zstd stream ends early (was the file cut off?)")
                return 0
            self._started = True
            try:
                self._pending = memoryview(self._dobj.decompress(chunk))
            except self._error as exc:
                raise EOFError(f"corrupt zstd data: {exc}") from exc
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        self._file.close()
        super().close()


# Binary formats someone may have given a text suffix, by their first bytes.
_MAGIC = {
    b"\x1f\x8b": "it looks like gzip data: name the file .gz",
    b"\x28\xb5\x2f\xfd": "it looks like zstd data: name the file .zst",
    b"PAR1": "it looks like Parquet: name the file .parquet",
    b"ARROW1": "it looks like Arrow: name the file .arrow",
    b"\xff\xfe": "it looks like UTF-16 text: convert it to UTF-8",
    b"\xfe\xff": "it looks like UTF-16 text: convert it to UTF-8",
}


def _check_text(path: str) -> None:
    """Refuse binary data up front: a NUL byte never occurs in JSON text."""
    try:
        with _open_binary(path) as handle:
            head = handle.read(4096)
    except (OSError, EOFError):
        return  # the reader itself reports it, with the line where it stopped
    offset = head.find(b"\x00")
    if offset < 0:
        return
    hint = next((f" ({hint})" for magic, hint in _MAGIC.items() if head.startswith(magic)), "")
    raise InputError(f"{path}: binary data, not JSON text (a NUL byte at byte {offset}){hint}")


def _raw_preview(text: str) -> str:
    """Raw text for rejects.jsonl: invalid bytes as U+FFFD, at most a few hundred characters."""
    return text[:400].encode("utf-8", "surrogateescape").decode("utf-8", "replace").rstrip("\r\n")


def _decode_error(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON at column {exc.colno}: {exc.msg}"
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply to decode"
    return f"invalid JSON: {str(exc)[:120]}"  # e.g. an integer of more than 4300 digits


def _lone_surrogate(data: Any) -> bool:
    """True if a decoded string holds half of a UTF-16 pair (from an escape such as \\ud800)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


LONE_SURROGATE = "a string holds an unpaired UTF-16 surrogate escape (such as \\ud800), which is not text"


def _read_jsonl(path: str) -> Iterator[Record]:
    _check_text(path)
    if _first_character(path) == "[" and _array_not_lines(path):  # a JSON array saved as .jsonl
        yield from _read_json(path)
        return
    yield from _jsonl_records(path, _open_text(path), _bom_length(path))


def _jsonl_records(path: str, handle: io.TextIOBase, first_byte: int, from_start: bool = True):
    """The records of JSONL text that starts ``first_byte`` bytes into the (decompressed) file
    (``from_start``: at the file's first line); index and line count from this text's start.
    Returns the number of lines read."""
    index = 0
    line_no = 0
    offset = first_byte  # bytes of (decompressed) text read so far
    try:
        with handle:
            for line_no, line in enumerate(handle, start=1):
                start = offset
                try:
                    offset += len(line.encode("utf-8"))
                except UnicodeEncodeError as exc:
                    offset += len(line.encode("utf-8", "surrogateescape"))
                    byte = start + len(line[: exc.start].encode("utf-8", "surrogateescape"))
                    yield Record(path, index, line_no, _raw_preview(line), f"invalid UTF-8 at byte {byte}")
                    index += 1
                    continue
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    yield Record(path, index, line_no, _raw_preview(line), _decode_error(exc))
                else:
                    if "\\u" in line and _lone_surrogate(data):
                        yield Record(path, index, line_no, _raw_preview(line), LONE_SURROGATE)
                    elif (key := repeated_key(line, data)) is not None:
                        yield Record(path, index, line_no, _raw_preview(line), repeated_key_reason(key), "duplicate_key")
                    else:
                        yield Record(path, index, line_no, data=data)
                index += 1
    except (OSError, EOFError) as exc:
        if not from_start:  # a later part of a file: its line numbers are not known here
            raise InputError(f"{path}: cannot read past byte {offset} of the decompressed text: {exc}") from exc
        raise InputError(
            f"{path}: cannot read past line {line_no} (byte {offset} of the decompressed text, "
            f"after {index} records): {exc}"
            if line_no
            else f"{path}: cannot read from the start (byte 0): {exc}"
        ) from exc
    return line_no


def _bom_length(path: str) -> int:
    """3 if the (decompressed) text starts with a UTF-8 byte order mark, which decoding drops: byte
    offsets in messages count it, as they are offsets in the file."""
    try:
        with _open_binary(path) as handle:
            return 3 if handle.read(3) == b"\xef\xbb\xbf" else 0
    except (OSError, EOFError):
        return 0


def _array_not_lines(path: str) -> bool:
    """Whether a .jsonl file that starts with "[" is one JSON array (pretty-printed, or on one line),
    not lines of which the first holds an array (or is too deeply nested to decode: rejected on its own)."""
    try:
        with _open_text(path) as handle:
            first = handle.readline()
            more = any(line.strip() for line in handle)
    except (OSError, EOFError, UnicodeDecodeError):
        return True  # the array reader reports it
    try:
        json.loads(first)
    except RecursionError:
        return False
    except ValueError:
        return True  # the array goes on past the first line
    return not more


def _first_character(path: str) -> str:
    try:
        with _open_text(path) as handle:
            return handle.read(4096).lstrip()[:1]
    except (OSError, EOFError, UnicodeDecodeError):
        return ""  # the reader reports it, with the line where it stopped


def _read_json(path: str) -> Iterator[Record]:
    _check_text(path)
    try:
        with _open_text(path) as handle:
            text = handle.read()
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read: {exc}") from exc
    if not text.strip():
        raise InputError(f"{path}: the file is empty; a .json input holds a JSON array of records")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = len(text[: exc.start].encode("utf-8", "surrogateescape"))
        line = text.count("\n", 0, exc.start) + 1
        raise InputError(f"{path}: invalid UTF-8 at byte {byte} (line {line})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        size = len(text.encode("utf-8", "surrogateescape"))
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):  # both: EOF reached
            hint = f" (the file ends early, at byte {size:,}: was it cut off? The records before it are complete)"
        elif text.lstrip().startswith("{") and "\n{" in text:
            hint = " (one JSON object per line? name the file .jsonl)"
        byte = len(text[: exc.pos].encode("utf-8", "surrogateescape"))
        raise _invalid_json(path, exc.msg, (exc.lineno, exc.colno, exc.pos, byte), hint) from exc
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: cannot decode: {_decode_error(exc)}") from exc
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON array of records, found a JSON {_json_type(data)}")
    check, repeated = "\\u" in text, repeated_keys(text, data) or ()
    for index, item in enumerate(data):
        if check and _lone_surrogate(item):
            yield Record(path, index, None, _raw_preview(json.dumps(item)), LONE_SURROGATE)
        elif index < len(repeated) and repeated[index] is not None:
            yield Record(path, index, None, _raw_preview(json.dumps(item)), repeated_key_reason(repeated[index]),
                         "duplicate_key")
        else:
            yield Record(path, index, None, data=item)


def _invalid_json(path: str, message: str, where: tuple[int, int, int, int], hint: str = "") -> InputError:
    """Invalid JSON at ``where``: line, column, character and byte, as json counts them in the whole text."""
    if message.startswith("Unterminated string"):  # json says "... starting at" and leaves the place out
        message = "a string that starts here is never closed"
    line, column, char, byte = where
    return InputError(f"{path}: not valid JSON at line {line}, column {column} (character {char}, byte {byte:,}): "
                      f"{message}{hint}")


def _json_type(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string"}.get(type(value), type(value).__name__)


def _read_table_batches(path: str, batches: Iterator[Any], first_record: int = 0) -> Iterator[Record]:
    """Records of record batches, numbered from 0; ``first_record``: records of the file before them."""
    index = 0
    batches = iter(batches)
    while True:
        try:  # a corrupt page surfaces here, mid-file
            batch = next(batches, None)
            rows = None if batch is None else batch.to_pylist()
        except Exception as exc:  # pyarrow raises OSError, ArrowInvalid, ...
            raise InputError(f"{path}: cannot read past record {first_record + index}: {str(exc).strip()}") from exc
        if rows is None:
            return
        for row in rows:
            yield Record(path, index, None, data=row)
            index += 1


def _read_parquet(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise InputError(f"{path}: not a readable Parquet file: {exc}") from exc
    yield from _read_table_batches(path, parquet.iter_batches(batch_size=1024))


def _ipc_batches(path: str, first: int = 0) -> Iterator[Any]:
    """The record batches of an Arrow IPC file or stream from batch ``first`` on. Memory-mapped, so that
    a stream's batches before ``first``, which can only be reached in order, are skipped without a copy."""
    import pyarrow as pa

    with open(path, "rb") as handle:
        head = handle.read(6)
    if head == b"ARROW1":
        reader = pa.ipc.open_file(pa.memory_map(path))
        return (reader.get_batch(i) for i in range(first, reader.num_record_batches))
    return itertools.islice(pa.ipc.open_stream(pa.memory_map(path)), first, None)


def _read_arrow(path: str) -> Iterator[Record]:
    try:
        batches = _ipc_batches(path)
    except Exception as exc:
        raise InputError(f"{path}: not a readable Arrow IPC file: {exc}") from exc
    # one record batch at a time, cut to 1,024 rows: memory stays bounded by a batch
    yield from _read_table_batches(path, (part for batch in batches for part in _slices(batch, 1024)))


def _slices(batch, size: int):
    for start in range(0, batch.num_rows, size):
        yield batch.slice(start, size)


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


# ---------------------------------------------------------------------------- parts

PART_BYTES = 64 << 20  # the largest part; smaller ones spread a small input over every worker
MIN_PART_BYTES = 1 << 20
COMPRESSED_SUFFIXES = (".gz", ".zst")


@dataclass(frozen=True)
class Part:
    """A piece of one input that a worker reads on its own: a byte range of a JSONL file (both
    ends just after a newline) or of a JSON array (whole items: from the '[' or a comma between
    items to the next such comma or the end), a range of Parquet row groups or of Arrow record
    batches (of an IPC file or stream, or of one file of a saved dataset), or a whole input.
    ``first`` and ``stop`` are bytes, row groups or record batches, by ``kind``; stop None is the
    end. Records read from a part are numbered from the part's start."""

    number: int  # position among the run's parts: results are merged in this order
    source: int  # position of the input among the run's sources
    path: str  # the input, which records name
    kind: str  # a Source kind, or "jsonl-range", "json-range", "parquet-groups", "arrow-batches"
    first: int = 0
    stop: int | None = None
    first_record: int = 0  # records of the input before this part, where known before reading (not JSONL)
    data_file: str = ""  # the Arrow file of a saved dataset (at ``path``) that the batches are in


def plan_parts(sources: list[Source], workers: int) -> list[Part]:
    """The parts of the inputs (:class:`PartPlan`), its JSON arrays scanned here, one chunk after another."""
    plan = PartPlan.start(sources, workers)
    return plan.parts([scan_json_chunk(None, chunk) for chunk in plan.scans])


@dataclass
class PartPlan:
    """Cut the inputs into parts: about sixteen a worker (so that workers finish together), none over
    ``PART_BYTES``. Uncompressed JSONL is cut at newlines, an uncompressed JSON array (even one named
    .jsonl) between items, Parquet at row groups, Arrow IPC files and streams at record batches, a
    saved dataset at the record batches of its files. Compressed JSON and JSONL (read from the start
    only) and a Hub id are one part each, as is an input whose plain case the planner cannot vouch for
    (its one part's reader reports what is wrong with it). The JSON arrays, which must be scanned
    through, are cut into chunks (``scans``, about one a worker in all) that a stage scans
    (:func:`scan_json_chunk`; ``packprep.pipeline.plan_parts`` runs it on an engine) before
    :meth:`parts` places the cuts."""

    sources: list[Source]
    planned: list[list[tuple] | None]  # each input's pieces, None: one part (or a JSON array, below)
    arrays: dict[int, tuple[str, int]]  # the JSON arrays, by source number: (path, size)
    chunks: dict[int, list["JsonChunk"]]  # their chunks to scan, by source number
    target: int  # the part size

    @property
    def scans(self) -> list["JsonChunk"]:
        return [chunk for found in self.chunks.values() for chunk in found]

    @classmethod
    def start(cls, sources: list[Source], workers: int) -> "PartPlan":
        """Plan the parts of ``sources`` for ``workers``; the JSON arrays' cuts wait for their scans."""
        sizes = [os.path.getsize(s.path) if os.path.isfile(s.path) else 0 for s in sources]
        target = min(PART_BYTES, max(MIN_PART_BYTES, sum(sizes) // max(1, workers * 16)))
        planned: list[list[tuple] | None] = []
        arrays: dict[int, tuple[str, int]] = {}  # the JSON arrays to scan, by source number
        for number, (source, size) in enumerate(zip(sources, sizes)):
            pieces = None
            try:
                if source.kind in ("json", "jsonl") and not source.path.endswith(COMPRESSED_SUFFIXES) and size > target:
                    if source.kind == "json" or _first_character(source.path) == "[":
                        arrays[number] = (source.path, size)
                    else:
                        pieces = [("jsonl-range", a, b, 0, "") for a, b in _newline_cuts(source.path, size, target)]
                elif source.kind == "parquet":
                    pieces = _parquet_pieces(source.path, target)
                elif source.kind == "arrow":
                    pieces = _grouped("arrow-batches", _batch_sizes(source.path), target)
                elif source.kind == "saved_dataset":
                    pieces = _saved_dataset_pieces(source.path, target)
            except Exception:  # an unreadable file: its one part's reader reports it, naming the file
                pieces = None
            planned.append(pieces)
        return cls(sources, planned, arrays, _json_arrays_chunks(arrays, target, workers), target)

    def parts(self, scanned: list) -> list[Part]:
        """The parts, given what :func:`scan_json_chunk` found in each of :attr:`scans`, in order."""
        scans = iter(scanned)
        planned = list(self.planned)
        for number, found in self.chunks.items():
            planned[number] = _json_cuts(found, [next(scans) for _ in found], self.arrays[number][1], self.target)
        parts: list[Part] = []
        for number, (source, pieces) in enumerate(zip(self.sources, planned)):
            for kind, first, stop, first_record, data_file in pieces or [(source.kind, 0, None, 0, "")]:
                parts.append(Part(len(parts), number, source.path, kind, first, stop, first_record, data_file))
        return parts


def _newline_cuts(path: str, size: int, target: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``target`` bytes, each ending just after a newline (or at the end)."""
    cuts = [0]
    with open(path, "rb") as handle:
        for guess in range(target, size, target):
            if guess <= cuts[-1]:
                continue
            handle.seek(guess - 1)
            while True:
                block = handle.read(1 << 16)
                if not block:
                    break
                newline = block.find(b"\n")
                if newline >= 0:
                    cut = handle.tell() - len(block) + newline + 1
                    if cut < size:
                        cuts.append(cut)
                    break
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


JSON_SCAN_BYTES = 4 << 20  # a scan task reads a JSON array this much at a time (its memory: ~10x this)
JSON_CHUNK_BYTES = 16 << 20  # the least of a JSON array one scan task takes: a task costs a few ms to start
JSON_READ_BYTES = 1 << 20  # a worker reads its range of a JSON array this much at a time
JSON_WHITESPACE = b" \t\n\r"
BOM = b"\xef\xbb\xbf"
_WHITESPACE = json.decoder.WHITESPACE.match


def _json_arrays_chunks(arrays: dict[int, tuple[str, int]], target: int, workers: int) -> dict[int, list["JsonChunk"]]:
    """The chunks of each JSON array to scan, by source number: about one a worker in all."""
    total = sum(size for _, size in arrays.values())
    chunk_bytes = max(JSON_CHUNK_BYTES, -(-total // max(1, workers)))
    chunks = {}
    for number, (path, size) in arrays.items():
        count = -(-size // chunk_bytes)
        chunks[number] = _json_chunks(path, [size * i // count for i in range(count + 1)], target)
    return chunks


@dataclass(frozen=True)
class JsonChunk:
    """Bytes ``first`` to ``stop`` of a JSON array that one task scans, and the cut targets among them:
    the multiples of the part size (of the file size and part size alone, so that the cuts do not depend
    on how the file is chunked)."""

    path: str
    first: int
    stop: int
    targets: tuple[int, ...]


def _json_chunks(path: str, bounds: list[int], target: int) -> list[JsonChunk]:
    """The chunks between consecutive ``bounds`` (from 0 to the file's size)."""
    return [JsonChunk(path, a, b, tuple(range(-(-max(a, 1) // target) * target, b, target)))
            for a, b in zip(bounds, bounds[1:])]


@dataclass
class JsonSide:
    """A chunk scanned as if it started outside a string (``JsonScan.sides[0]``) or inside one ([1]).
    Depths count from the chunk's start; "events" are brackets and commas outside strings."""

    depth: int = 0  # at the chunk's end
    low: int | None = None  # the lowest depth at an event (after a bracket)
    low_at: int = -1  # the byte of the first event at ``low``
    comma_depth: int | None = None  # the lowest depth at a comma: the array's own commas are there, if any
    commas: int = 0  # commas at ``comma_depth``
    first: int | None = None  # the byte of the first of them
    # each target's first comma at ``comma_depth`` at or after it, as (byte, commas before it), or None
    cuts: list = field(default_factory=list)


@dataclass
class JsonScan:
    """What ``scan_json_chunk`` finds in a chunk, whatever came before it."""

    quotes: int  # parity of its quotes not escaped (as if no backslash ended the chunk before)
    flip: bool  # its first byte after its leading backslashes is a quote: an odd run before it swaps the sides
    slashes: int  # the backslashes it ends with
    head: tuple[int, int] | None  # its first byte that is neither whitespace nor the file's BOM, and that byte
    tail: int | None  # its last byte that is not whitespace
    sides: tuple[JsonSide, JsonSide]


def scan_json_chunk(context: Any, chunk: JsonChunk) -> JsonScan | None:
    """Scan a chunk of a JSON array without parsing it (a stage: ``context`` is unused), for both string
    states it may start in; ``_json_cuts`` picks one. A block at a time, numpy finds the quotes not
    escaped by an odd run of backslashes (a run may go on from the block before); their running parity
    marks what is inside strings; outside strings, brackets give the depth. None if the file cannot be
    read (its one part's reader reports it)."""
    import numpy as np

    kinds_of = np.zeros(256, np.uint8)  # 1 opens, 2 closes, 3 comma, 4 quote, 5 backslash (6: an escaped quote)
    for character, kind in zip(b'[{]},"\\', (1, 1, 2, 2, 3, 4, 5)):
        kinds_of[character] = kind
    marked = (kinds_of != 0).tobytes()
    sides = (JsonSide(cuts=[None] * len(chunk.targets)), JsonSide(cuts=[None] * len(chunk.targets)))
    targets = np.asarray(chunk.targets, np.int64)
    quotes = run = 0  # run: the backslashes the bytes so far end with
    flip, leading, head, tail = False, True, None, None  # leading: all bytes so far are backslashes
    try:
        with open(chunk.path, "rb") as handle:
            bom = len(BOM) if chunk.first < len(BOM) and handle.read(len(BOM)) == BOM else 0
            offset = chunk.first
            handle.seek(offset)
            while offset < chunk.stop and (data := handle.read(min(JSON_SCAN_BYTES, chunk.stop - offset))):
                if head is None and (rest := data[max(0, bom - offset):].lstrip(JSON_WHITESPACE)):
                    head = (offset + len(data) - len(rest), rest[0])
                if stripped := len(data.rstrip(JSON_WHITESPACE)):
                    tail = offset + stripped - 1
                block = np.frombuffer(data, np.uint8)
                where = np.flatnonzero(np.frombuffer(data.translate(marked), np.bool_))
                kinds = kinds_of[block[where]]
                slashes = where[kinds == 5]
                gap = slashes - np.arange(len(slashes))  # the same along a run of backslashes
                carry = run % 2
                if leading:  # the bytes before this block are all backslashes
                    lead = int(np.searchsorted(gap, 1))  # this block's leading backslashes
                    leading = lead == len(data)
                    flip = not leading and data[lead] == 34
                quoted = np.flatnonzero(kinds == 4)
                after_slash = quoted[(where[quoted] > 0) & (block[where[quoted] - 1] == 92)]
                if len(after_slash):
                    last = np.searchsorted(slashes, where[after_slash] - 1)
                    first = np.searchsorted(gap, gap[last])  # where each quote's run of backslashes starts
                    length = last - first + 1 + np.where(slashes[first] == 0, carry, 0)
                    kinds[after_slash[length % 2 == 1]] = 6
                if carry and len(quoted) and where[quoted[0]] == 0:  # escaped by the run that ended the last block
                    kinds[quoted[0]] = 6
                if len(slashes) and slashes[-1] == len(data) - 1:
                    first = int(np.searchsorted(gap, gap[-1]))
                    run = len(slashes) - first + (run if slashes[first] == 0 else 0)
                else:
                    run = 0
                inside = (np.cumsum(kinds == 4) + quotes) & 1
                quotes = int(inside[-1]) if len(inside) else quotes
                events = np.flatnonzero(kinds < 4)  # brackets and commas
                at, kind, state = where[events] + offset, kinds[events], inside[events]
                for side, mine in zip(sides, (state == 0, state == 1)):
                    _scan_side(side, at[mine], kind[mine], targets)
                offset += len(data)
    except OSError:
        return None
    return JsonScan(quotes, flip, run, head, tail, sides)


def _scan_side(side: JsonSide, at, kind, targets) -> None:
    """Add a block's events (their bytes, ``at``, and kinds) to one side of a chunk's scan."""
    import numpy as np

    if not len(at):
        return
    level = side.depth + np.cumsum((kind == 1).astype(np.int64) - (kind == 2))
    low = int(np.argmin(level))
    if side.low is None or level[low] < side.low:
        side.low, side.low_at = int(level[low]), int(at[low])
    side.depth = int(level[-1])
    commas = kind == 3
    if not commas.any():
        return
    at, level = at[commas], level[commas]
    lowest = int(level.min())
    if side.comma_depth is None or lowest < side.comma_depth:  # the commas seen so far are nested deeper
        side.comma_depth, side.commas, side.first, side.cuts = lowest, 0, None, [None] * len(targets)
    if lowest > side.comma_depth:
        return
    at = at[level == lowest]
    if side.first is None:
        side.first = int(at[0])
    found = np.searchsorted(at, targets)
    for i, k in enumerate(found.tolist()):
        if side.cuts[i] is None and k < len(at):
            side.cuts[i] = (int(at[k]), side.commas + k)
    side.commas += len(at)


def _json_cuts(chunks: list[JsonChunk], scans: list[JsonScan | None], size: int, target: int) -> list[tuple] | None:
    """Byte ranges of a JSON array, each from a top-level comma (the first from the file's start) to the
    next range's, with the number of items before it: for each multiple of ``target``, the first comma
    between items at or after it. From the chunks' scans, in order: each chunk's string state, escape
    and depth at its start follow from the chunks before it; its commas at depth 1 are the array's own.

    That is exact for valid JSON. After an error the cuts may fall anywhere, but the range holding the
    first error starts at a true comma, and it reports that error as json does (``_json_range_records``).
    None, so that the whole-file reader reports it as it always has, where the scan cannot vouch for the
    file: not whitespace then '[', an array not closed by the file's last bracket, anything but
    whitespace after it; or where there would be one range anyway.
    """
    if any(scan is None for scan in scans):
        return None
    heads = [scan.head for scan in scans if scan.head is not None]
    if not heads or heads[0][1] != ord("["):
        return None
    end = max(scan.tail for scan in scans if scan.tail is not None)  # the array must close here
    depth = string = carry = items = 0  # items: commas between items so far
    cuts: list[tuple[int, int]] = []  # (byte of a top-level comma, items before it)
    waiting = closed = False  # waiting: a target before this chunk has no cut yet

    def cut(at: int, before: int) -> None:
        if not cuts or cuts[-1][0] != at:
            cuts.append((at, before + 1))

    for chunk, scan in zip(chunks, scans):
        state = string ^ (carry & scan.flip)  # an odd backslash run before a leading quote escapes it
        side = scan.sides[state]
        if side.low is not None and depth + side.low <= 0:  # the array closes in this chunk
            if depth + side.low < 0 or side.low_at != end:
                return None
            closed = True
        if side.comma_depth == 1 - depth:
            if waiting:
                cut(side.first, items)
            for found in side.cuts:
                if found is not None:
                    cut(found[0], items + found[1])
            waiting = side.cuts[-1:] == [None]
            items += side.commas
        else:
            waiting = waiting or bool(chunk.targets)
        if closed:
            break
        depth += side.depth
        string = state ^ scan.quotes
        carry = (carry + scan.slashes) % 2 if scan.slashes == chunk.stop - chunk.first else scan.slashes % 2
    if not closed or not cuts:
        return None
    bounds = [0] + [at for at, _ in cuts] + [size]
    return [("json-range", a, b, n, "") for a, b, n in zip(bounds, bounds[1:], [0] + [n for _, n in cuts])]


def _parquet_pieces(path: str, target: int) -> list[tuple]:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    groups = [metadata.row_group(i) for i in range(metadata.num_row_groups)]
    return _grouped("parquet-groups", [(g.total_byte_size, g.num_rows) for g in groups], target)


def _batch_sizes(path: str) -> list[tuple[int, int]]:
    """Bytes and rows of each record batch of an Arrow IPC file or stream: one walk through the batches'
    metadata (memory-mapped: no copy)."""
    return [(batch.nbytes, batch.num_rows) for batch in _ipc_batches(path)]


def _grouped(kind: str, units: list[tuple[int, int]], target: int, before: int = 0,
             data_file: str = "") -> list[tuple]:
    """Runs of consecutive units (row groups, batches: their bytes and rows) of about ``target`` bytes
    together; ``before``: records of the input before the first unit."""
    pieces, first, acc, first_record = [], 0, 0, before
    for unit, (size, rows) in enumerate(units):
        if acc and acc + size > target:
            pieces.append((kind, first, unit, first_record, data_file))
            first, acc, first_record = unit, 0, before
        acc += size
        before += rows
    pieces.append((kind, first, len(units), first_record, data_file))
    return pieces


SAVED_STATE_KEYS = {"_data_files", "_fingerprint", "_format_columns", "_format_kwargs", "_format_type",
                    "_output_all_columns", "_split"}


def _saved_dataset_pieces(path: str, target: int) -> list[tuple] | None:
    """A folder saved by ``datasets``: its Arrow files in the order ``load_from_disk`` concatenates them
    (the records ``_read_saved_dataset`` reads, in its order), each cut at record batches. None, to read
    it whole through ``datasets``, for anything but that plain case: a DatasetDict without a 'train'
    split, an indices mapping, a state this code does not know."""
    folder = Path(path)
    if not ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()):
        if "train" not in json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]:
            return None
        folder = folder / "train"  # a DatasetDict: the split ``load_from_disk(path)["train"]`` reads
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    if set(state) - SAVED_STATE_KEYS or any(folder.glob("indices*")) or not state["_data_files"]:
        return None
    pieces: list[tuple] = []
    before = 0
    for entry in state["_data_files"]:
        data_file = str(folder / entry["filename"])
        batches = _batch_sizes(data_file)
        pieces += _grouped("arrow-batches", batches, target, before, data_file)
        before += sum(rows for _, rows in batches)
    return pieces


class PartRecords:
    """The records of one part, numbered from the part's start; once iterated, ``lines`` is the
    number of lines the part spans (JSONL; blank lines count), where the next part's numbering goes on."""

    def __init__(self, part: Part):
        self.part, self.lines = part, 0

    def __iter__(self) -> Iterator[Record]:
        self.lines = yield from _part_records(self.part)


def read_part(part: Part) -> PartRecords:
    return PartRecords(part)


def _part_records(part: Part):
    if part.kind == "jsonl-range":
        if part.first == 0:
            _check_text(part.path)
        raw = open(part.path, "rb")
        raw.seek(part.first)
        limited = io.BufferedReader(_Range(raw, part.stop - part.first), 1 << 20)
        encoding = "utf-8-sig" if part.first == 0 else "utf-8"
        text = io.TextIOWrapper(limited, encoding=encoding, errors="surrogateescape", newline="")
        return (yield from _jsonl_records(part.path, text, part.first or _bom_length(part.path), part.first == 0))
    if part.kind == "parquet-groups":
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(part.path).iter_batches(batch_size=1024, row_groups=range(part.first, part.stop))
        yield from _read_table_batches(part.path, batches, part.first_record)
    elif part.kind == "arrow-batches":
        batches = itertools.islice(_ipc_batches(part.data_file or part.path, part.first), part.stop - part.first)
        yield from _read_table_batches(part.path, (p for batch in batches for p in _slices(batch, 1024)),
                                       part.first_record)
    elif part.kind == "json-range":
        yield from _json_range_records(part)
    else:
        yield from read_records(Source(part.path, part.kind))
    return 0


def _json_range_records(part: Part) -> Iterator[Record]:
    """The items of a range of a JSON array (``_json_cuts``), numbered from the range's start.
    Where it fails, it says what the whole-file reader says of the file: its first byte that is not
    UTF-8, or else the JSON error, at its line, column, character and byte in the file."""
    if part.first == 0:
        _check_text(part.path)
    with open(part.path, "rb") as handle:
        handle.seek(part.first)
        run = _TextRun(handle, part.stop - part.first, "utf-8-sig" if part.first == 0 else "utf-8")
        try:
            for index, (item, escapes, key) in enumerate(_array_items(run, part.first == 0)):
                if escapes and _lone_surrogate(item):
                    yield Record(part.path, index, None, _raw_preview(json.dumps(item)), LONE_SURROGATE)
                elif key is not None:
                    yield Record(part.path, index, None, _raw_preview(json.dumps(item)), repeated_key_reason(key),
                                 "duplicate_key")
                else:
                    yield Record(part.path, index, None, data=item)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
            invalid = _first_invalid_utf8(part.path)
            if invalid:
                raise InputError(f"{part.path}: invalid UTF-8 at byte {invalid[0]} (line {invalid[1]})") from exc
            if isinstance(exc, json.JSONDecodeError):
                # no hint: the planner cut only an array that starts with '[' and ends at its last bracket
                where = _json_position(part.path, part.first, run.base + exc.pos)
                raise _invalid_json(part.path, exc.msg, where) from exc
            raise InputError(f"{part.path}: cannot decode: {_decode_error(exc)}") from exc


class _TextRun:
    """A byte range of a file as text, decoded as it is needed: ``text`` holds what is read and not yet
    dropped, ``base`` counts the characters dropped before it."""

    def __init__(self, handle, size: int, encoding: str):
        self.handle, self.left = handle, size
        self.decoder = codecs.getincrementaldecoder(encoding)()
        self.text, self.base = "", 0

    def more(self) -> bool:
        """Read on, as much as is held (so that a step taken again after each read costs linear time in
        all); False at the range's end."""
        block = self.handle.read(min(self.left, max(JSON_READ_BYTES, len(self.text))))
        if not block:
            return False
        self.left -= len(block)
        self.text += self.decoder.decode(block, final=not self.left)
        return True

    def drop(self, pos: int) -> int:
        """Drop the text before ``pos``, if that is most of it (copying less than it drops); pos's new place."""
        if pos <= len(self.text) // 2:
            return pos
        self.text, self.base = self.text[pos:], self.base + pos
        return 0


def _array_items(run: _TextRun, opening: bool) -> Iterator[tuple[Any, bool, str | None]]:
    """The items of a range of a JSON array, whether each one's text holds a \\u escape and the key it
    repeats (or None): json's own
    array loop (the same errors at the same places), an item at a time. The range starts at the array's
    '[' (``opening``) or at the comma before its first item, and ends before the comma after its last
    item or after the array's ']'. A step that reaches the end of the text held is taken again with
    more, so it sees what it would in the whole text (a number looks two characters past its end)."""
    scan = json.JSONDecoder().scan_once

    def skip(pos: int) -> int:  # past whitespace
        while True:
            pos = _WHITESPACE(run.text, pos).end()
            if pos < len(run.text) or not run.more():
                return pos

    def value(pos: int) -> tuple[Any, int]:
        while True:
            try:
                item, end = scan(run.text, pos)
            except StopIteration as exc:
                if not run.more():
                    raise json.JSONDecodeError("Expecting value", run.text, exc.value) from None
            except (ValueError, RecursionError):
                if not run.more():
                    raise
            else:
                if end + 2 < len(run.text) or not run.more():
                    return item, end

    pos = skip(0)
    while pos < len(run.text):  # the text held ends only with the range
        pos = run.drop(pos)
        char = run.text[pos]
        if not opening and char == "]":
            return  # the array's end: the planner found only whitespace after it
        if not opening and char != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", run.text, pos)
        comma, pos = pos, skip(pos + 1)
        if not opening and run.text[pos:pos + 1] == "]":
            raise _trailing_comma(run.text, comma, pos)
        item, end = value(pos)
        yield item, run.text.find("\\u", pos, end) >= 0, repeated_key(run.text[pos:end], item)
        pos, opening = skip(end), False


def _trailing_comma(text: str, comma: int, bracket: int) -> json.JSONDecodeError:
    """json's error for a comma before an array's ']' (Python 3.13 names the comma, older ones the bracket)."""
    try:
        json.loads("[0" + text[comma : bracket + 1])
    except json.JSONDecodeError as exc:
        return json.JSONDecodeError(exc.msg, text, comma + exc.pos - 2)
    raise AssertionError("json accepted a trailing comma")


def _first_invalid_utf8(path: str) -> tuple[int, int] | None:
    """Byte (after any byte order mark) and line of the first byte of ``path`` that is not UTF-8; streamed."""
    with open(path, "rb") as handle:
        data, byte, line = handle.read(3).removeprefix(BOM), 0, 1
        while True:
            block = handle.read(JSON_READ_BYTES)
            data += block
            try:
                used = codecs.utf_8_decode(data, "strict", not block)[1]
            except UnicodeDecodeError as exc:
                return byte + exc.start, line + data.count(b"\n", 0, exc.start)
            if not block:
                return None
            byte, line, data = byte + used, line + data.count(b"\n", 0, used), data[used:]


def _json_position(path: str, first: int, chars: int) -> tuple[int, int, int, int]:
    """Line, column, character and byte of the character ``chars`` characters past byte ``first``, as
    json and ``_read_json`` count them in the whole text (after any byte order mark); streamed."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    line, line_start, char, byte = 1, 0, 0, 0

    def count(text: str) -> None:
        nonlocal line, line_start, char, byte
        if (newline := text.rfind("\n")) >= 0:
            line, line_start = line + text.count("\n"), char + newline + 1
        char, byte = char + len(text), byte + len(text.encode("utf-8"))

    with open(path, "rb") as handle:
        while first > 0 and (block := handle.read(min(first, JSON_READ_BYTES))):
            first -= len(block)
            count(decoder.decode(block))
        while chars > 0 and (block := handle.read(JSON_READ_BYTES)):
            text = decoder.decode(block)[:chars]
            count(text)
            chars -= len(text)
    return line, char - line_start + 1, char, byte


class _Range(io.RawIOBase):
    """The next ``size`` bytes of an open file, then end of file."""

    def __init__(self, raw, size: int):
        self._raw, self._left = raw, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        got = self._raw.readinto(view)
        self._left -= got or 0
        return got or 0

    def close(self) -> None:
        self._raw.close()
        super().close()
