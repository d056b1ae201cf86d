"""Step 1, in parts: the inputs cut into parts (byte ranges, row groups, record batches) that
workers read on their own, and a part's records, named exactly as the whole-file readers name them.

A JSON array is cut between its items with the cuts :mod:`packprep.json_scan` finds.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import InputError
from .json_keys import repeated_key_reason
from .json_scan import (
    _array_items, _first_invalid_utf8, _json_arrays_chunks, json_cuts, JsonChunk, _json_position, scan_json_chunk, _TextRun,
)
from .read import (
    _bom_length, _check_text, _decode_error, _first_character, _invalid_json, _ipc_batches, _jsonl_records,
    _lone_surrogate, LONE_SURROGATE, _raw_preview, read_records, _read_table_batches, Record, _slices, Source,
)


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
    chunks: dict[int, list[JsonChunk]]  # their chunks to scan, by source number
    target: int  # the part size

    @property
    def scans(self) -> list[JsonChunk]:
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
            planned[number] = json_cuts(found, [next(scans) for _ in found], self.arrays[number][1], self.target)
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
    """The items of a range of a JSON array (``json_cuts``), numbered from the range's start.
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
