"""Workers read their own parts of the inputs: cut points, and output independent of the cut.

The inputs are cut into parts (parts.plan_parts) that workers read, normalize and encode on their
own; the driver numbers records across parts. These tests cut real files into many tiny parts and
check that nothing about the output depends on it: shards, rejects.jsonl (with its file-level
line and record numbers) and the manifest are the same bytes as reading each file whole.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packprep
from packprep.errors import InputError
from packprep.parts import plan_parts, read_part
from packprep.read import Source, read_records

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

TOKENIZER = str(EXAMPLE_TOKENIZER)
BAD = Path(__file__).parent / "bad_inputs"


@pytest.fixture
def tiny_parts(monkeypatch):
    """Parts of about 8 KB: the example (~1 MB) becomes a hundred of them."""
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 8_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 8_000)


@pytest.fixture(scope="module")
def messy_jsonl(tmp_path_factory) -> Path:
    """The example's records among the bad-input files' lines, with CRLF and blank lines mixed in."""
    lines = EXAMPLE_CHATS.read_bytes().splitlines()
    for name in ("broken_jsonl_lines.jsonl", "invalid_utf8.jsonl", "lone_surrogate.jsonl", "not_objects.jsonl",
                 "missing_from_value.jsonl", "empty_conversations.jsonl", "mixed_formats.jsonl"):
        lines += (BAD / name).read_bytes().replace(b"\r\n", b"\n").splitlines()
    random.Random(0).shuffle(lines)
    ends = [b"\r\n" if i % 7 == 0 else b"\n" for i in range(len(lines))]
    body = b"".join(line + end + (b"  \n" if i % 13 == 0 else b"") for i, (line, end) in enumerate(zip(lines, ends)))
    path = tmp_path_factory.mktemp("messy") / "messy.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + body)  # a byte order mark, which only the first part may drop
    return path


def _sharegpt_rows() -> list[dict]:
    """The example's plain ShareGPT records: ones that make a Parquet table of one schema."""
    rows = [json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()]
    return [r for r in rows if isinstance(r, dict) and set(r) == {"conversations"} and r["conversations"] and all(
        isinstance(t, dict) and set(t) == {"from", "value"} and isinstance(t["value"], str) for t in r["conversations"])]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_jsonl_parts_end_after_newlines_and_cover_the_file(messy_jsonl, tiny_parts):
    parts = plan_parts([Source(str(messy_jsonl), "jsonl")], workers=4)
    data = messy_jsonl.read_bytes()
    assert len(parts) > 20
    assert [p.number for p in parts] == list(range(len(parts)))
    assert parts[0].first == 0 and parts[-1].stop == len(data)
    for before, after in zip(parts, parts[1:]):
        assert before.stop == after.first and data[after.first - 1 : after.first] == b"\n"
    # read part by part, the records are the file's, numbered from each part's start
    whole = [(r.data, r.error) for r in read_records(Source(str(messy_jsonl), "jsonl"))]
    pieces = [(r.data, r.error) for p in parts for r in read_part(p)]
    assert pieces == whole


def test_inputs_that_cannot_be_cut_are_one_part(tmp_path, tiny_parts):
    records = [json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()]
    compressed = tmp_path / "chats.jsonl.gz"
    compressed.write_bytes(gzip.compress(EXAMPLE_CHATS.read_bytes()))
    compressed_array = tmp_path / "chats.json.gz"
    compressed_array.write_bytes(gzip.compress(json.dumps(records).encode()))
    array = tmp_path / "chats.json"
    array.write_text(json.dumps(records))
    sources = [Source(str(compressed), "jsonl"), Source(str(compressed_array), "json"), Source(str(array), "json")]
    parts = plan_parts(sources, workers=4)
    assert [(p.source, p.kind, p.stop) for p in parts[:2]] == [(0, "jsonl", None), (1, "json", None)]
    assert len(parts) > 20 and {p.kind for p in parts[2:]} == {"json-range"}  # the plain array is cut
    assert [r.data for r in read_part(parts[1])] == records


def _table_inputs(folder: Path, rows: list[dict]) -> list[Source]:
    """The rows as Parquet, an Arrow IPC file, an Arrow IPC stream (in batches of 45 rows), a folder saved by
    datasets in three files and a DatasetDict (whose 'train' split is read); datasets writes batches of 1,000."""
    import datasets

    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "chats.parquet", row_group_size=30)
    for name, new in (("chats.arrow", pa.ipc.new_file), ("stream.arrow", pa.ipc.new_stream)):
        with new(folder / name, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=45):
                writer.write_batch(batch)
    saved = datasets.Dataset(pa.Table.from_batches(table.to_batches(max_chunksize=45)))
    saved.save_to_disk(str(folder / "saved"), num_shards=3)
    datasets.DatasetDict({"test": saved.select(range(7)), "train": saved}).save_to_disk(str(folder / "saved_dict"))
    return [Source(str(folder / "chats.parquet"), "parquet"), Source(str(folder / "chats.arrow"), "arrow"),
            Source(str(folder / "stream.arrow"), "arrow"), Source(str(folder / "saved"), "saved_dataset"),
            Source(str(folder / "saved_dict"), "saved_dataset")]


def test_table_parts_follow_row_groups_and_record_batches(tmp_path, tiny_parts):
    rows = _sharegpt_rows() * 8
    for source in _table_inputs(tmp_path, rows):
        parts = plan_parts([source], workers=2)
        assert len(parts) > 3 and {p.kind for p in parts} == {"parquet-groups" if source.kind == "parquet"
                                                              else "arrow-batches"}, source
        counts = [sum(1 for _ in read_part(p)) for p in parts]
        assert [p.first_record for p in parts] == [sum(counts[:i]) for i in range(len(parts))]
        records = [r for p in parts for r in read_part(p)]
        assert [r.data for r in records] == rows == [r.data for r in read_records(source)]
        assert {r.file for r in records} == {source.path}  # a saved dataset's records name its folder
    saved_files = {p.data_file for p in plan_parts(_table_inputs(tmp_path, rows)[3:4], workers=2)}
    assert len(saved_files) == 3


def test_a_saved_dataset_it_cannot_vouch_for_is_read_whole(tmp_path, tiny_parts):
    """An indices file, or a state.json key this code does not know: read through datasets, as before."""
    rows = _sharegpt_rows() * 8
    saved = Path(_table_inputs(tmp_path, rows)[3].path)
    (saved / "indices-00000.arrow").write_bytes((saved / "data-00000-of-00003.arrow").read_bytes())
    assert [p.kind for p in plan_parts([Source(str(saved), "saved_dataset")], 2)] == ["saved_dataset"]
    (saved / "indices-00000.arrow").unlink()
    state = json.loads((saved / "state.json").read_text())
    (saved / "state.json").write_text(json.dumps({**state, "_indices_data_files": []}))
    assert [p.kind for p in plan_parts([Source(str(saved), "saved_dataset")], 2)] == ["saved_dataset"]
    (saved / "state.json").write_text(json.dumps(state))
    assert len(plan_parts([Source(str(saved), "saved_dataset")], 2)) > 3


@pytest.mark.parametrize("num_proc", [1, 2])
def test_output_does_not_depend_on_how_inputs_are_cut(tmp_path, messy_jsonl, monkeypatch, num_proc):
    rows = _sharegpt_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet", row_group_size=30)
    inputs = [str(messy_jsonl), str(tmp_path / "chats.parquet")]
    settings = {"max_len": 256, "seed": 1, "shard_size": "100KB"}
    whole = packprep.pack(inputs, tmp_path / "whole", TOKENIZER, num_proc=1, **settings)
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 8_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 8_000)
    assert len(plan_parts(packprep.read.resolve_inputs(inputs), num_proc)) > 20
    cut = packprep.pack(inputs, tmp_path / "cut", TOKENIZER, num_proc=num_proc, **settings)
    assert cut == whole
    assert _files(tmp_path / "cut") == _files(tmp_path / "whole")
    rejects = [json.loads(line) for line in (tmp_path / "cut" / "rejects.jsonl").read_text().splitlines()]
    assert {"unreadable", "not_an_object"} <= {entry["code"] for entry in rejects}
    # every unreadable line names the line it is on in the file, whatever part read it
    lines = messy_jsonl.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n")
    unreadable = [e for e in rejects if e["file"] == str(messy_jsonl) and e["code"] == "unreadable"]
    assert len(unreadable) >= 5
    for entry in unreadable:
        assert lines[entry["line"] - 1].rstrip(b"\r").decode("utf-8", "replace")[:40] == entry["record"][:40]


def test_output_of_arrays_streams_and_saved_datasets_does_not_depend_on_the_cut(tmp_path, monkeypatch):
    """A JSON array with records that are rejected (not objects, an unpaired surrogate, no assistant turn),
    an Arrow stream and a saved dataset: cut small, read by two workers, the same bytes as read whole."""
    records = [json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()]
    records[10:10] = [1, "text", None, [], {"conversations": [{"from": "human", "value": "lone \ud800"},
                                                             {"from": "gpt", "value": "x"}]}]
    records[200:200] = [{"conversations": [{"from": "human", "value": "no reply"}]}] * 3
    array = tmp_path / "chats.json"
    array.write_text("\ufeff" + json.dumps(records, indent=1))
    rows = _sharegpt_rows()
    rows[40:40] = [{"conversations": []}, {"conversations": [{"from": "human", "value": "no reply"}]}]
    inputs = [str(array)] + [s.path for s in _table_inputs(tmp_path, rows)[2:4]]
    settings = {"max_len": 256, "seed": 1, "shard_size": "100KB"}
    whole = packprep.pack(inputs, tmp_path / "whole", TOKENIZER, num_proc=1, **settings)
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 8_000)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 8_000)
    parts = plan_parts(packprep.read.resolve_inputs(inputs), 2)
    assert len(parts) > 40 and {p.kind for p in parts} == {"json-range", "arrow-batches"}
    cut = packprep.pack(inputs, tmp_path / "cut", TOKENIZER, num_proc=2, **settings)
    assert cut == whole
    assert _files(tmp_path / "cut") == _files(tmp_path / "whole")
    rejects = [json.loads(line) for line in (tmp_path / "cut" / "rejects.jsonl").read_text().splitlines()]
    in_array = [(r["index"], r["code"]) for r in rejects if r["file"] == str(array)]
    assert in_array[:5] == [(10, "not_an_object"), (11, "not_an_object"), (12, "not_an_object"),
                            (13, "not_an_object"), (14, "unreadable")]
    assert {(200, "no_assistant_turn"), (201, "no_assistant_turn"), (202, "no_assistant_turn")} <= set(in_array)
    assert {(r["file"], r["index"]) for r in rejects if r["file"] != str(array)} >= {
        (inputs[1], 40), (inputs[1], 41), (inputs[2], 40), (inputs[2], 41)}


def test_on_error_fail_names_the_line_in_the_file_not_in_the_part(tmp_path, tiny_parts):
    good = [json.dumps({"conversations": [{"from": "human", "value": f"What is {n} plus one?"},
                                          {"from": "gpt", "value": f"It is {n + 1}."}]}) for n in range(600)]
    lines = good[:300] + ["{not json"] + good[300:]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert len(plan_parts([Source(str(path), "jsonl")], 2)) > 5  # the bad line is in a later part
    with pytest.raises(InputError, match=r"chats.jsonl, line 301: invalid JSON"):
        packprep.pack(str(path), tmp_path / "out", TOKENIZER, num_proc=2, max_len=512, on_error="fail")
    assert not (tmp_path / "out").exists()


def test_blank_lines_at_the_end_of_a_part_still_count_for_the_next_parts_line_numbers(tmp_path, monkeypatch):
    """Line numbers go on across parts even where a part ends in blank lines (read, not yielded)."""
    monkeypatch.setattr("packprep.parts.MIN_PART_BYTES", 300)
    monkeypatch.setattr("packprep.parts.PART_BYTES", 300)
    good = json.dumps({"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]})
    lines = []
    for block in range(40):
        lines += [good] * 3 + [" " * 80] * 4  # runs of blank lines: many parts end inside one
    lines[250] = "{not json"
    path = tmp_path / "blanks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    parts = plan_parts([Source(str(path), "jsonl")], 1)
    data = path.read_bytes()
    ends_blank = [not data[: p.stop - 1].rsplit(b"\n", 1)[-1].strip() for p in parts[:-1]]
    assert sum(ends_blank) > 5  # parts whose last line is blank
    packprep.pack(str(path), tmp_path / "out", TOKENIZER, num_proc=2, max_len=256)
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["index"], r["code"]) for r in rejects] == [(251, lines[:250].count(good), "unreadable")]
