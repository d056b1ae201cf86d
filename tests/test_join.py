"""Shards written as pieces by many workers and joined (packprep.join) are byte for byte the file
one writer makes: checked against pyarrow's own writer, for random cuts, in both shard formats."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import packprep
from packprep import pipeline, write as write_module
from packprep.pipeline import verify_folder
from packprep.join import JoinError, join_pieces
from packprep.layout import ROW_SCHEMA
from packprep.write import shard_writer

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER
from .test_verify import RecordingEngine

GROUPS = 20


def row_group(rng: np.random.Generator, rows: int) -> pa.Table:
    out = []
    for _ in range(rows):
        lengths = rng.integers(1, 40, size=int(rng.integers(1, 4))).tolist()
        ids = rng.integers(0, 128_000, size=sum(lengths)).tolist()
        positions = [p for n in lengths for p in range(n)]
        out.append({"input_ids": ids, "labels": [-100 if p == 0 or i % 3 == 0 else t
                                                 for i, (p, t) in enumerate(zip(positions, ids))],
                    "position_ids": positions, "seq_lens": lengths,
                    "source_index": rng.integers(0, 10**9, size=len(lengths)).tolist()})
    return pa.Table.from_pylist(out, schema=ROW_SCHEMA)


@pytest.fixture(scope="module")
def groups() -> list[pa.Table]:
    rng = np.random.default_rng(7)
    return [row_group(rng, int(rng.integers(1, 25))) for _ in range(GROUPS)]


def write(path, tables, shard_format, **options):
    if options:
        writer = pq.ParquetWriter(path, ROW_SCHEMA, compression="zstd", use_dictionary=False, **options)
        for table in tables:
            writer.write_table(table, row_group_size=table.num_rows)
        writer.close()
        return path
    with shard_writer(path, shard_format) as put:
        for table in tables:
            put(table)
    return path


@pytest.mark.parametrize("shard_format", ["parquet", "arrow"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.sets(st.integers(1, GROUPS - 1), max_size=GROUPS - 1))
def test_joined_pieces_are_one_writers_bytes(tmp_path_factory, groups, shard_format, cuts):
    folder = tmp_path_factory.mktemp("join")
    whole = write(folder / f"whole.{shard_format}", groups, shard_format).read_bytes()
    bounds = [0, *sorted(cuts), GROUPS]
    pieces = [write(folder / f"piece{n}.{shard_format}", groups[a:b], shard_format)
              for n, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    sha256 = join_pieces(pieces, folder / f"joined.{shard_format}", shard_format)
    joined = (folder / f"joined.{shard_format}").read_bytes()
    assert joined == whole
    assert sha256 == hashlib.sha256(whole).hexdigest()
    assert not any(piece.exists() for piece in pieces)


def test_a_joined_parquet_file_reads_back_row_group_by_row_group(tmp_path, groups):
    pieces = [write(tmp_path / f"p{n}.parquet", groups[n * 5:(n + 1) * 5], "parquet") for n in range(4)]
    join_pieces(pieces, tmp_path / "joined.parquet", "parquet")
    shard = pq.ParquetFile(tmp_path / "joined.parquet")
    assert shard.metadata.num_row_groups == GROUPS
    assert shard.metadata.num_rows == sum(g.num_rows for g in groups)
    for n, table in enumerate(groups):
        assert shard.read_row_group(n).equals(table)


def test_pieces_a_join_cannot_move_or_of_other_schemas_are_refused(tmp_path, groups):
    """A page index lies after the row groups, at absolute offsets a join does not move; pieces of
    two schemas would make a file whose footer describes only one of them."""
    indexed = [write(tmp_path / f"i{n}.parquet", groups[n:n + 2], "parquet", write_page_index=True) for n in (0, 2)]
    with pytest.raises(JoinError, match="offset index"):
        join_pieces(indexed, tmp_path / "joined.parquet", "parquet")
    first = write(tmp_path / "a.parquet", groups[:3], "parquet")
    other = tmp_path / "b.parquet"
    pq.write_table(pa.concat_tables(groups[3:6]).drop_columns(["source_index"]), other,
                   compression="zstd", use_dictionary=False)
    with pytest.raises(JoinError, match="differ in schema"):
        join_pieces([first, other], tmp_path / "joined.parquet", "parquet")
    assert first.exists() and other.exists(), "nothing is removed when a join fails"


def test_pack_writes_shards_in_pieces_with_one_writers_bytes(tmp_path, monkeypatch):
    """Shards too few for the workers are written in pieces: with 3 workers every shard is, with 1
    none is, and both give the same bytes, each shard equal to its own row groups written again by
    one writer. verify then checks them a run of row groups a task, every group once."""
    monkeypatch.setattr(write_module, "ROW_GROUP_TOKENS", 1024)  # 2 rows a group at --max-len 512
    planned = []
    shard_pieces = write_module.shard_pieces
    monkeypatch.setattr(pipeline, "shard_pieces", lambda *a: planned.append(shard_pieces(*a)) or planned[-1])
    manifests = [packprep.pack(str(EXAMPLE_CHATS), tmp_path / f"out{n}", str(EXAMPLE_TOKENIZER), max_len=512,
                               shard_size="200KB", num_proc=n) for n in (1, 3)]
    shards = len(manifests[0]["shards"])
    assert manifests[0]["shards"] == manifests[1]["shards"] and 1 < shards < 3 * 4
    assert len(planned[0]) == shards and len(planned[1]) > shards, "1 worker: whole shards; 3: pieces"
    groups = []
    for shard in manifests[1]["shards"]:
        path = tmp_path / "out3" / shard["path"]
        parquet = pq.ParquetFile(path)
        groups.append(parquet.num_row_groups)
        again = write(tmp_path / "again.parquet", [parquet.read_row_group(n) for n in range(parquet.num_row_groups)],
                      "parquet")
        assert again.read_bytes() == path.read_bytes()
    assert not (tmp_path / "out3" / ".pieces").exists()
    engine = RecordingEngine()
    assert verify_folder(tmp_path / "out3", engine=engine).ok
    for shard, count in zip(manifests[1]["shards"], groups):
        runs = [run for _, path, run in engine.tasks if path == shard["path"]]
        assert len(runs) == min(count, -(-2 * 4 // shards))  # engines.runs_per_item for verify's 2 workers
        assert runs[0][0] == 0 and runs[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:])), "contiguous runs, every group once"


def test_a_shard_checked_in_parts_fails_like_one_checked_whole(tmp_path, groups):
    """pack checks each piece's row groups beside the others: the parts, joined, report what a
    whole-shard check reports, at the same rows, and judge the shard's row count."""
    from packprep.verification import ShardContext, check_part, joined_check

    bad = [table for table in groups]
    labels = bad[13].column("labels").to_pylist()
    labels[2][0] = bad[13].column("input_ids")[2][0].as_py()  # row 2 of group 13: a first label trained
    bad[13] = bad[13].set_column(1, "labels", pa.array(labels, ROW_SCHEMA.field("labels").type))
    write(tmp_path / "data.parquet", bad, "parquet")
    rows = sum(table.num_rows for table in bad)
    entry = {"path": "data.parquet", "rows": rows}
    context = ShardContext(tmp_path, None, 10**6, False, False, 10**9)
    whole = joined_check([check_part(context, (entry, None))], entry)  # the whole shard, one task
    parts = joined_check([check_part(context, (entry, (a, min(a + 3, GROUPS)))) for a in range(0, GROUPS, 3)], entry)
    expected_row = sum(table.num_rows for table in bad[:13]) + 2
    assert [(f.check, f.row) for f in whole.failures] == [("first_label", expected_row)]
    assert [(f.check, f.row) for f in parts.failures] == [("first_label", expected_row)]
    assert (parts.rows, parts.sequences, parts.tokens, parts.supervised) == (
        whole.rows, whole.sequences, whole.tokens, whole.supervised)
    assert parts.sources.tolist() == whole.sources.tolist()
    missing = joined_check([check_part(context, (entry, (0, GROUPS - 1)))], entry)  # a part left out
    assert [f.check for f in missing.failures] == ["first_label", "shard_file"]
