"""A JSON array scanned in chunks, in parallel, for the commas between its items (where it may be cut
into parts), and the one-item-at-a-time parser of a range of it; errors keep their place in the file.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from .json_keys import repeated_key


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
        chunks[number] = json_chunks(path, [size * i // count for i in range(count + 1)], target)
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


def json_chunks(path: str, bounds: list[int], target: int) -> list[JsonChunk]:
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
    states it may start in; ``json_cuts`` picks one. A block at a time, numpy finds the quotes not
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


def json_cuts(chunks: list[JsonChunk], scans: list[JsonScan | None], size: int, target: int) -> list[tuple] | None:
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
