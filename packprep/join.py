"""Join shard pieces written in parallel into one shard: byte for byte the file one writer makes.

A shard is written as pieces (runs of row groups) by as many workers as there are cores, then
joined, so that writing scales past one worker a shard. Row groups are independent in both
formats, so a piece's bytes are the bytes one writer would have made for those row groups:

* Parquet: ``PAR1``, the column chunks, the footer (Thrift compact ``FileMetaData``), its length,
  ``PAR1``. Chunks hold no absolute offsets; only the footer does. The joined file is the pieces'
  chunks one after another and one footer whose row groups are the pieces' row groups with their
  offsets moved by where their chunks now start and their ordinals renumbered.
* Arrow IPC stream: a schema message, record batches, an end-of-stream marker. The joined stream
  keeps the first schema message and one end marker.

``tests/test_join.py`` holds joined files to one writer's output, byte for byte. Anything in a
footer this module does not move (page indexes, bloom filters, encryption) is refused, not copied.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Iterator

from .read import file_sha256

MAGIC = b"PAR1"
IPC_CONTINUATION = b"\xff\xff\xff\xff"
IPC_END = IPC_CONTINUATION + b"\x00\x00\x00\x00"
COPY_BLOCK = 8 << 20

# Thrift compact protocol field types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# parquet.thrift ids of the fields a join changes, checks or refuses
FILE_NUM_ROWS, FILE_ROW_GROUPS = 3, 4
FILE_REFUSED = {8: "encryption", 9: "footer signing key"}
GROUP_COLUMNS, GROUP_FILE_OFFSET, GROUP_ORDINAL = 1, 5, 7
CHUNK_FILE_OFFSET, CHUNK_META = 2, 3
CHUNK_REFUSED = {1: "a file path", 4: "an offset index", 6: "a column index", 8: "column encryption",
                 9: "encrypted column metadata"}
META_OFFSETS = (9, 10, 11)  # data_page_offset, index_page_offset, dictionary_page_offset
META_REFUSED = {14: "a bloom filter"}


class JoinError(ValueError):
    """Pieces that cannot be joined: a packprep bug, as the pieces of a shard share one writer's settings."""


def join_pieces(pieces: list[Path], path: Path, shard_format: str) -> str:
    """Write ``pieces`` (files of one format and schema, in order) joined as ``path``, remove them
    and return the joined file's sha256. A single piece is renamed, not copied."""
    if len(pieces) == 1:
        os.replace(pieces[0], path)
        return file_sha256(path)
    if shard_format == "parquet":
        footers = [_parquet_footer(piece) for piece in pieces]
        spans = [(len(MAGIC), end) for end, _ in footers]
        footer = joined_footer([footer for _, footer in footers], [end - start for start, end in spans])
        head, tail = MAGIC, footer + struct.pack("<I", len(footer)) + MAGIC
    else:
        spans = [_ipc_span(piece, keep_schema=index == 0) for index, piece in enumerate(pieces)]
        head, tail = b"", IPC_END
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for block in (head, *(b for piece, (start, end) in zip(pieces, spans) for b in _read(piece, start, end)), tail):
            digest.update(block)
            out.write(block)
    for piece in pieces:
        os.remove(piece)
    return digest.hexdigest()


def _read(path: Path, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            block = f.read(min(COPY_BLOCK, end - start))
            if not block:
                raise JoinError(f"{path} ended at byte {start}, before {end}")
            start += len(block)
            yield block


def _parquet_footer(path: Path) -> tuple[int, bytes]:
    """Where a Parquet file's footer starts, and the footer."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise JoinError(f"{path} is not a Parquet file")
        f.seek(size - 8)
        length, magic = struct.unpack("<I4s", f.read(8))
        if magic != MAGIC or length > size - 12:
            raise JoinError(f"{path} has no Parquet footer")
        start = size - 8 - length
        f.seek(start)
        return start, f.read(length)


def _ipc_span(path: Path, keep_schema: bool) -> tuple[int, int]:
    """The bytes of an Arrow IPC stream to keep: from its start (or after its schema message) to
    before its end marker."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:4] != IPC_CONTINUATION:
            raise JoinError(f"{path} is not an Arrow IPC stream")
        f.seek(size - 8)
        if f.read(8) != IPC_END:
            raise JoinError(f"{path} does not end with an Arrow end-of-stream marker")
    schema_end = 8 + struct.unpack("<i", head[4:])[0]  # a schema message has no body
    return (0 if keep_schema else schema_end), size - 8


# ------------------------------------------------------------------ Thrift compact, just enough

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _int(buf: bytes, pos: int) -> int:
    """A zigzag varint (i16, i32, i64)."""
    raw = _varint(buf, pos)[0]
    return (raw >> 1) ^ -(raw & 1)


def _encode_int(value: int) -> bytes:
    return _varint_bytes(((value << 1) ^ (value >> 63)) & 0xFFFF_FFFF_FFFF_FFFF)


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _skip(buf: bytes, pos: int, kind: int, in_container: bool = False) -> int:
    """The end of a value of type ``kind`` at ``pos``."""
    if kind in (_TRUE, _FALSE):
        return pos + 1 if in_container else pos  # a struct field's bool is in its header
    if kind == _BYTE:
        return pos + 1
    if kind in (_I16, _I32, _I64):
        return _varint(buf, pos)[1]
    if kind == _DOUBLE:
        return pos + 8
    if kind == _BINARY:
        length, pos = _varint(buf, pos)
        return pos + length
    if kind in (_LIST, _SET):
        size, element, pos = _list_header(buf, pos)
        for _ in range(size):
            pos = _skip(buf, pos, element, True)
        return pos
    if kind == _MAP:
        size, pos = _varint(buf, pos)
        if size:
            types, pos = buf[pos], pos + 1
            for _ in range(size):
                pos = _skip(buf, _skip(buf, pos, types >> 4, True), types & 0x0F, True)
        return pos
    if kind == _STRUCT:
        return _struct(buf, pos)[1]
    raise JoinError(f"unknown Thrift type {kind} in a Parquet footer")


def _list_header(buf: bytes, pos: int) -> tuple[int, int, int]:
    size, element = buf[pos] >> 4, buf[pos] & 0x0F
    pos += 1
    if size == 15:
        size, pos = _varint(buf, pos)
    return size, element, pos


def _struct(buf: bytes, pos: int) -> tuple[dict[int, tuple[int, int, int, int]], int]:
    """A struct's fields ``{id: (type, header start, value start, value end)}`` and its end."""
    fields, last = {}, 0
    while True:
        header = buf[pos]
        if header == 0:
            return fields, pos + 1
        start, kind, delta = pos, header & 0x0F, header >> 4
        if delta:
            last, pos = last + delta, pos + 1
        else:
            last, pos = _int(buf, pos + 1), _varint(buf, pos + 1)[1]
        end = _skip(buf, pos, kind)
        fields[last] = (kind, start, pos, end)
        pos = end


def _rebuilt(buf: bytes, start: int, fields: dict, end: int, values: dict[int, bytes]) -> bytes:
    """The struct at ``start`` with the values of the fields in ``values`` replaced (headers kept)."""
    out, pos = [], start
    for fid, (_, _, value_start, value_end) in fields.items():
        if fid in values:
            out += [buf[pos:value_start], values[fid]]
            pos = value_end
    out.append(buf[pos:end])
    return b"".join(out)


def _refuse(fields: dict, refused: dict[int, str], what: str) -> None:
    for fid, name in refused.items():
        if fid in fields:
            raise JoinError(f"a Parquet piece's {what} has {name}, which a join cannot move")


def _moved(buf: bytes, pos: int, fields: dict, end: int, ids, shift: int, extra: dict | None = None) -> bytes:
    values = {fid: _encode_int(_int(buf, fields[fid][2]) + shift) for fid in ids if fid in fields}
    return _rebuilt(buf, pos, fields, end, {**values, **(extra or {})})


def _moved_row_group(buf: bytes, pos: int, shift: int, ordinal: int) -> tuple[bytes, int]:
    """The RowGroup at ``pos`` with its offsets moved by ``shift`` and ordinal ``ordinal``; its end."""
    fields, end = _struct(buf, pos)
    size, element, chunk = _list_header(buf, fields[GROUP_COLUMNS][2])
    columns = [buf[fields[GROUP_COLUMNS][2]:chunk]]  # the list header, kept
    for _ in range(size):
        chunk_fields, chunk_end = _struct(buf, chunk)
        _refuse(chunk_fields, CHUNK_REFUSED, "column chunk")
        meta = chunk_fields[CHUNK_META][2]
        meta_fields, meta_end = _struct(buf, meta)
        _refuse(meta_fields, META_REFUSED, "column metadata")
        moved_meta = _moved(buf, meta, meta_fields, meta_end, META_OFFSETS, shift)
        # the deprecated file_offset: 0 from Arrow's writer ("unset", kept), an offset from others
        offset = CHUNK_FILE_OFFSET in chunk_fields and _int(buf, chunk_fields[CHUNK_FILE_OFFSET][2]) != 0
        columns.append(_moved(buf, chunk, chunk_fields, chunk_end, (CHUNK_FILE_OFFSET,) if offset else (), shift,
                              {CHUNK_META: moved_meta}))
        chunk = chunk_end
    extra = {GROUP_COLUMNS: b"".join(columns)}
    if GROUP_ORDINAL in fields:
        extra[GROUP_ORDINAL] = _encode_int(ordinal)
    return _moved(buf, pos, fields, end, (GROUP_FILE_OFFSET,), shift, extra), end


def joined_footer(footers: list[bytes], chunk_bytes: list[int]) -> bytes:
    """The FileMetaData of pieces with these footers and these many bytes of column chunks each,
    joined in order. Everything but the row groups and the row count must be the same in all."""
    parsed = [_struct(footer, 0) for footer in footers]
    for fields, _ in parsed:
        _refuse(fields, FILE_REFUSED, "footer")
    same = [_rebuilt(footer, 0, fields, end, {FILE_NUM_ROWS: b"", FILE_ROW_GROUPS: b""})
            for footer, (fields, end) in zip(footers, parsed)]
    if any(rest != same[0] for rest in same):
        raise JoinError("Parquet pieces differ in schema, writer or metadata")
    groups, rows, shift = [], 0, 0
    for footer, (fields, _), size in zip(footers, parsed, chunk_bytes):
        rows += _int(footer, fields[FILE_NUM_ROWS][2])
        count, element, pos = _list_header(footer, fields[FILE_ROW_GROUPS][2])
        if count and element != _STRUCT:
            raise JoinError("a Parquet footer's row groups are not structs")
        for _ in range(count):
            group, pos = _moved_row_group(footer, pos, shift, len(groups))
            groups.append(group)
        shift += size
    header = bytes([len(groups) << 4 | _STRUCT]) if len(groups) < 15 else bytes([0xF0 | _STRUCT]) + _varint_bytes(len(groups))
    fields, end = parsed[0]
    return _rebuilt(footers[0], 0, fields, end, {FILE_NUM_ROWS: _encode_int(rows),
                                                  FILE_ROW_GROUPS: header + b"".join(groups)})

