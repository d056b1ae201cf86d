"""Step 1: read raw records from files, folders and Hub ids (the inputs resolved, each format decoded).

Each record keeps where it came from (file, 0-based record index, 1-based line for JSONL), so
that every later rejection can name it. A line of JSONL that is not valid JSON is a *record*
error (the rest of the file is still usable); a file that cannot be parsed at all is an
``InputError`` naming the file and where parsing stopped. Cutting the inputs into parts that
workers read on their own is :mod:`packprep.parts`; a JSON array's scanner is :mod:`packprep.json_scan`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import NAMED, ConfigError, InputError, check_utf8
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
    if sum(spec in STDIN for spec in inputs) > 1:
        raise ConfigError("standard input ('-') is given twice; it can be read once: give it once")
    sources = []
    for spec in inputs:
        if spec in STDIN:
            found = [Source(spool_stdin(), "jsonl")]
        elif not Path(spec).exists() and any(c in spec for c in GLOB_CHARACTERS):
            matches = sorted(glob.glob(os.path.expanduser(spec), recursive=True))
            if not matches:
                raise ConfigError(f"{spec}: no file matches this pattern")
            found = resolve_inputs(matches)
        else:
            found = _resolve(spec)
        for source in found:
            check_utf8(source.path, "the input")
        sources.extend(Source(s.path, s.kind, named=spec) for s in found)
    return sources


STDIN = ("-", "/dev/stdin")


def spool_stdin() -> str:
    """Standard input copied to a temporary file (removed at exit): a run reads its inputs more than
    once (the format, the parts, the manifest's sha256). JSON Lines, or one JSON array."""
    import atexit
    import sys
    import tempfile

    if sys.stdin is None:  # closed (`<&-`): nothing can be read from it
        raise ConfigError("standard input ('-') is closed: pipe the data into it (cat chats.jsonl | packprep pack - ...)"
                          ", or give the file itself")
    folder = tempfile.mkdtemp(prefix="packprep-stdin-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, "stdin.jsonl")
    NAMED[path] = "standard input ('-')"
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
        return f"invalid JSON at column {exc.colno}: {json_message(exc.msg)}"
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
    line, column, char, byte = where
    return InputError(f"{path}: not valid JSON at line {line}, column {column} (character {char}, byte {byte:,}): "
                      f"{json_message(message)}{hint}")


def json_message(message: str) -> str:
    """json's message as a whole sentence: it ends some with "at" and leaves the place to its caller."""
    if message.startswith("Unterminated string"):
        return "a string that starts here is never closed"
    if message.startswith("Invalid control character"):
        return ("a control character (a raw tab, line break or other character below U+0020) inside a string; "
                "JSON needs it escaped (\\t, \\n, \\u0001)")
    return message.removesuffix(" at")


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
