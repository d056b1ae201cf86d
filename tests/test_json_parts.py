"""A JSON array is cut between its items and each range parsed on its own (json_scan.json_cuts,
parts.read_part): the records, and every error with its place in the file, are the whole-file
reader's, wherever the cuts fall and wherever the planner's and the workers' blocks end. The planner scans
the array in chunks, in parallel (json_scan.scan_json_chunk): the cuts are the commas between items that json
finds, whatever the chunks and blocks.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packprep
from packprep import json_scan, pipeline, read
from packprep.engines import LocalEngine
from packprep.errors import InputError
from packprep.parts import first_records, plan_parts, read_part
from packprep.read import Source, read_records

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

BAD = Path(__file__).parent / "bad_inputs"


def read_both(path: Path, part_bytes: int, scan_bytes: int = 7, read_bytes: int = 5, chunks: int = 1):
    """The file read whole, and read range by range with parts of ``part_bytes`` (the planner scanning it
    in ``chunks`` chunks, and the planner's and workers' blocks this small): each as its records' (data,
    error), or the error message; and the parts."""
    def outcome(records):
        try:
            return [(r.data, r.error, r.code) for r in records()]
        except InputError as exc:
            return str(exc)

    kind = "jsonl" if path.suffix == ".jsonl" else "json"
    whole = outcome(lambda: read_records(Source(str(path), kind)))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("MIN_PART_BYTES", part_bytes), ("PART_BYTES", part_bytes),
                            ("JSON_SCAN_BYTES", scan_bytes), ("JSON_READ_BYTES", read_bytes),
                            ("JSON_CHUNK_BYTES", 1)):
            patch.setattr(f"packprep.{'json_scan' if name.startswith('JSON') else 'parts'}.{name}", value)
        parts = plan_parts([Source(str(path), kind)], workers=chunks)  # the part size stays part_bytes
        cut = outcome(lambda: (r for part in parts for r in read_part(part)))
    return whole, cut, parts


# strings made of what the scan must get right: quotes, runs of backslashes (some longer than the scan's
# blocks), brackets, commas, non-ASCII
TRICKY = st.lists(st.sampled_from(['"', "\\", "\\" * 9, "[", "]", "{", "}", ",", ":", " ", "\n", "a", "é", "😀",
                                   "\u2028"]), max_size=12).map("".join)
SCALARS = st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False) | TRICKY
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                      max_leaves=12)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(VALUES, min_size=1, max_size=25), ensure_ascii=st.booleans(),
       indent=st.sampled_from([None, 0, 2]), lone=st.booleans(), bom=st.booleans(),
       space=st.sampled_from(["", " \n", "\r\n\t "]), part_bytes=st.integers(1, 200),
       scan_bytes=st.integers(1, 50), read_bytes=st.integers(1, 50), chunks=st.integers(1, 6))
def test_ranges_parse_to_what_json_loads_gives(tmp_path_factory, items, ensure_ascii, indent, lone, bom, space,
                                               part_bytes, scan_bytes, read_bytes, chunks):
    lone = lone and ensure_ascii  # an unpaired surrogate escape: that record is rejected, not the file
    if lone:
        items.insert(0, {"text": "\ud800 and \\ud800"})
    text = space + json.dumps(items, ensure_ascii=ensure_ascii, indent=indent) + space
    path = tmp_path_factory.mktemp("array") / "items.json"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    whole, cut, parts = read_both(path, part_bytes, scan_bytes, read_bytes, chunks)
    assert cut == whole
    assert [data for data, _, _ in cut[lone:]] == json.loads(text)[lone:]
    assert [error for _, error, _ in cut] == [read.LONE_SURROGATE] * lone + [None] * (len(items) - lone)
    assert {p.kind for p in parts} == ({"json-range"} if len(parts) > 1 else {"json"})
    counts = [sum(1 for _ in read_part(p)) for p in parts]
    assert [p.first_record for p in parts] == [sum(counts[:i]) for i in range(len(parts))]


GOOD = json.dumps({"conversations": [{"from": "human", "value": 'Say "[1, 2]" \\ {ok},'},
                                     {"from": "gpt", "value": "[1, 2] \\\\\" {ok},"}]})


def array(*items: str, between: str = ", ") -> str:
    return "[" + between.join(items) + "]"


# (name, file text, whether it must be cut): each read in ranges of 40 bytes gives the whole-file reader's
# records, or its error, naming the same line, column, character and byte
CASES = [
    ("items with whitespace and newlines between", "\n\n  " + array(*[GOOD] * 6, between=" ,\n\n\t") + "\n\n", True),
    ("a byte order mark", "\ufeff" + array(*[GOOD] * 6), True),
    ("nested arrays, escaped quotes and backslash runs", array(*[json.dumps(
        [["\\", '"', '\\"', "\\\\", "]", "[{", "},", "\\" * 20 + '"', '"' + "\\" * 17], {"a\\": {'"': [[], {}]}}])
        for _ in range(8)]), True),
    ("not JSON in a later item", array(*[GOOD] * 5, '{"conversations": tru}', *[GOOD] * 5), True),
    ("a missing comma", array(*[GOOD] * 5)[:-1] + " " + GOOD + "]", True),
    ("a raw newline in a string", array(*[GOOD] * 5, '"a\nb"', *[GOOD] * 5), True),
    ("a bad escape", array(*[GOOD] * 5, '"a\\qb"', *[GOOD] * 5), True),
    ("two stray quotes, so the cuts between them fall in strings", array(*[GOOD] * 3, '"x', *[GOOD] * 4, 'y"',
                                                                          *[GOOD] * 3), True),
    ("a trailing comma", array(*[GOOD] * 6)[:-1] + ",\n]", True),
    ("a number of more than 4300 digits", array(*[GOOD] * 5, "1" * 5000, *[GOOD] * 5), True),
    ("an unpaired surrogate escape", array(*[GOOD] * 5, '{"text": "\\udc00"}', *[GOOD] * 5), True),
    ("a key repeated in an item", array(*[GOOD] * 5, '{"conversations": [], "conversations": [{"a": 1}]}',
                                        *[GOOD] * 5), True),
    ("a key repeated deep in an item, beside colons in strings", array(
        *[GOOD] * 5, '{"messages": [{"role": "user", "content": "a\\": b", "content" : "c:"}]}', *[GOOD] * 5), True),
    ("items that are not records", array(*[GOOD] * 5, "1", '"text"', "null", "[[]]", *[GOOD] * 5), True),
    ("cut off mid-item", array(*[GOOD] * 6)[:-30], False),
    ("another value after the array", array(*[GOOD] * 6) + " " + array(GOOD, GOOD), False),
    ("one record object", GOOD * 1, False),
    ("a string", json.dumps("x" * 200), False),
    ("whitespace only", " \n" * 100, False),
    ("an empty array in whitespace", " \n" * 50 + "[]" + " \n" * 50, False),
    ("JSON Lines named .json", "\n".join([GOOD] * 6), False),
    ("a NUL byte", array(*[GOOD] * 6).replace(", ", ", \x00", 1), True),
]


@pytest.mark.parametrize("chunks", [1, 5])
@pytest.mark.parametrize("name, text, cut", CASES, ids=[c[0] for c in CASES])
def test_a_range_reads_or_fails_as_the_whole_file_does(tmp_path, name, text, cut, chunks):
    path = tmp_path / "case.json"
    path.write_text(text, encoding="utf-8")
    whole, pieces, parts = read_both(path, 40, chunks=chunks)
    assert (len(parts) > 3) == cut and pieces == whole


def test_invalid_utf8_anywhere_is_reported_before_an_earlier_json_error(tmp_path):
    """The whole-file reader checks the encoding first; a range that fails looks for the file's first bad byte."""
    path = tmp_path / "case.json"
    data = array(*[GOOD] * 3, "tru", *[GOOD] * 6).encode()
    error = data.index(b"tru")
    path.write_bytes(data[:error] + data[error:].replace(b'gpt"', b'g\xffpt"', 1))
    whole, cut, parts = read_both(path, 40)
    assert len(parts) > 3 and cut == whole and "invalid UTF-8 at byte" in whole


def test_bad_inputs_read_the_same_in_ranges():
    """Every JSON file of the bad-input corpus: cut where it can be, read the same."""
    for path in sorted(BAD.glob("*.json")) + [BAD / "bom.jsonl"]:
        whole, cut, _ = read_both(path, 1, 3, 1)
        assert cut == whole, path.name


def test_a_json_array_named_jsonl_is_cut_between_items(tmp_path):
    path = tmp_path / "array.jsonl"
    path.write_text(array(*[GOOD] * 30))
    whole, cut, parts = read_both(path, 200)
    assert len(parts) > 5 and {p.kind for p in parts} == {"json-range"} and cut == whole and len(cut) == 30


def test_pack_fails_on_the_first_error_in_the_file_whatever_the_workers_finish_first(tmp_path, monkeypatch):
    """Two stray quotes throw the cuts between them into strings: those ranges fail too, with other errors."""
    records = [json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()[:120]]
    text = json.dumps(records, indent=1)
    at, to = text.index("},\n {", len(text) // 4) + 3, text.index("},\n {", len(text) // 2) + 3  # between items
    path = tmp_path / "chats.json"
    path.write_text(text[:at] + '"' + text[at:to] + '"' + text[to:])
    with pytest.raises(InputError) as whole:
        list(read_records(Source(str(path), "json")))
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 2_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 2_000)
    parts = plan_parts([Source(str(path), "json")], 2)
    failing = []
    for part in parts:
        try:
            list(read_part(part))
        except InputError as exc:
            failing.append(str(exc))
    assert len(parts) > 10 and failing[0] == str(whole.value) and len(set(failing)) > 1
    with pytest.raises(InputError) as packed:
        packprep.pack(str(path), tmp_path / "out", str(EXAMPLE_TOKENIZER), num_proc=2, max_len=512)
    assert str(packed.value) == str(whole.value) and "line " in str(whole.value)


def item_commas(data: bytes) -> list[int]:
    """The bytes of the commas between the items of a JSON array, as json's own scanner finds them."""
    bom = len(json_scan.BOM) if data.startswith(json_scan.BOM) else 0
    text = data[bom:].decode()
    scan, skip = json.JSONDecoder().scan_once, json.decoder.WHITESPACE.match
    commas, pos = [], skip(text, skip(text, 0).end() + 1).end()
    while text[pos] != "]":
        pos = skip(text, scan(text, pos)[1]).end()
        if text[pos] == ",":
            commas.append(bom + len(text[:pos].encode()))
            pos = skip(text, pos + 1).end()
    return commas


def expected_pieces(data: bytes, target: int) -> list[tuple] | None:
    """For each multiple of ``target``, the first comma between items at or after it: the ranges between."""
    commas, cuts = item_commas(data), []
    for at in range(target, len(data), target):
        k = bisect_left(commas, at)
        if k < len(commas) and cuts[-1:] != [k]:
            cuts.append(k)
    if not cuts:
        return None  # one range: the whole-file reader reads it
    bounds = [0] + [commas[k] for k in cuts] + [len(data)]
    return [("json-range", a, b, n, "") for a, b, n in zip(bounds, bounds[1:], [0] + [k + 1 for k in cuts])]


def scanned(path: Path, bounds: list[int], target: int) -> list[tuple] | None:
    """The planner's ranges of the array at ``path``, its chunks between ``bounds`` scanned one by one."""
    chunks = json_scan.json_chunks(str(path), bounds, target)
    return json_scan.json_cuts(chunks, [json_scan.scan_json_chunk(None, c) for c in chunks], bounds[-1], target)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(VALUES, max_size=25), ensure_ascii=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       bom=st.booleans(), space=st.sampled_from(["", " \n", "\r\n\t "]), target=st.integers(1, 200),
       scan_bytes=st.integers(1, 50), data=st.data())
def test_chunks_scanned_apart_cut_at_the_commas_json_finds(tmp_path_factory, items, ensure_ascii, indent, bom, space,
                                                           target, scan_bytes, data):
    """Chunks and blocks ending anywhere (in strings, in backslash runs, in nested values, or holding
    no comma at all) give the cuts between the items json finds, for each multiple of the part size."""
    raw = (json_scan.BOM if bom else b"") + (space + json.dumps(items, ensure_ascii=ensure_ascii, indent=indent)
                                        + space).encode()
    path = tmp_path_factory.mktemp("array") / "items.json"
    path.write_bytes(raw)
    inner = data.draw(st.lists(st.integers(0, len(raw)), max_size=8), label="chunk bounds")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("packprep.json_scan.JSON_SCAN_BYTES", scan_bytes)
        assert scanned(path, sorted({0, len(raw), *inner}), target) == expected_pieces(raw, target)


def test_a_chunk_may_start_at_any_byte(tmp_path):
    """Every byte of an array of nasty strings as a chunk's start, alone and followed by chunks of 1, 2 and
    5 bytes: a run of backslashes split over several chunks, a quote escaped from the chunk before."""
    nasty = [{"a\\": ['"', '\\"', "\\" * 9 + '"', {"b": [[], {"c,": "]},"}]}], "d": "x" * 30 + ",]}"},
             "\\" * 7, '"' * 3, [[1, 2.5e3], {"e": "f,g"}], "é😀\u2028", None, True]
    raw = json.dumps(nasty * 3, ensure_ascii=False).encode()
    path = tmp_path / "nasty.json"
    path.write_bytes(raw)
    expected = expected_pieces(raw, 25)
    assert len(expected) > 10
    for at in range(len(raw) + 1):
        assert scanned(path, sorted({0, at, len(raw)}), 25) == expected, at
        assert scanned(path, sorted({0, len(raw)} | {min(at + i, len(raw)) for i in (0, 1, 3, 8)}), 25) == expected, at


def test_the_cuts_are_the_same_for_any_chunks_and_engine_and_so_are_the_shards(tmp_path, monkeypatch):
    """Two arrays and a JSONL file between them, their scan's chunks run on 3 forked workers: the same
    parts as one chunk an array scanned here, and a pack on 3 workers writes one worker's bytes."""
    lines = EXAMPLE_CHATS.read_text().splitlines()
    inputs = [tmp_path / "a.json", EXAMPLE_CHATS, tmp_path / "b.json"]
    inputs[0].write_text(json.dumps([json.loads(line) for line in lines[:150]], indent=1))
    inputs[2].write_text(json.dumps([json.loads(line) for line in lines[150:]]))
    sources = read.resolve_inputs([str(p) for p in inputs])
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 20_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 20_000)
    one_chunk = plan_parts(sources, 3)
    monkeypatch.setattr("packprep.json_scan.JSON_CHUNK_BYTES", 1)  # about a chunk a worker in all
    assert pipeline.plan_parts(sources, LocalEngine(3)) == plan_parts(sources, 3) == one_chunk
    assert [p.kind for p in one_chunk].count("json-range") > 10
    settings = {"max_len": 512, "seed": 3, "shard_size": "100KB"}
    packed = {n: packprep.pack([str(p) for p in inputs], tmp_path / f"out{n}", str(EXAMPLE_TOKENIZER), num_proc=n,
                               **settings) for n in (1, 3)}
    assert packed[1] == packed[3] and len(packed[1]["shards"]) > 1
    files = lambda folder: {str(p.relative_to(folder)): p.read_bytes()  # noqa: E731
                            for p in sorted(folder.rglob("*")) if p.is_file()}
    assert files(tmp_path / "out1") == files(tmp_path / "out3")


def test_format_detection_reads_the_first_items_of_an_array_not_the_whole_file(tmp_path):
    """Detecting the format of a 1.5 GB array used to load it whole (13 s, 4 GiB): only the first
    records are read now, so a fault past them is left to the workers (which report it, see above)."""
    items = [json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]})
             for i in range(300)]
    broken = tmp_path / "chats.json"
    broken.write_text("[\n" + ",\n".join(items) + ",\n{oops}\n]\n")
    first = first_records(Source(str(broken), "json"), 100)
    assert [r.data for r in first] == [json.loads(item) for item in items[:100]]
    with pytest.raises(InputError, match="line 302"):
        list(read_records(Source(str(broken), "json")))

    early = tmp_path / "early.json"  # a fault among the first records: the whole-file reader's message
    early.write_text("[\n" + items[0] + ",\n{oops}\n]\n")
    with pytest.raises(InputError) as streamed:
        first_records(Source(str(early), "json"), 100)
    with pytest.raises(InputError) as whole:
        list(read_records(Source(str(early), "json")))
    assert str(streamed.value) == str(whole.value)
