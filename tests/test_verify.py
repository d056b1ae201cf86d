"""Every check of ``packprep verify`` catches its own corruption, and only that one.

One valid output is packed once (module fixture). For each name in ``verify.CHECKS`` a copy is
corrupted in exactly one way; a shard that is rewritten is then "re-sealed" (its sha256, size,
row, token and supervised counts written back into the manifest, as a buggy writer would), so
that the only promise broken is the one under test. The test asserts that ``verify`` reports
exactly that check (with the shard and row where it applies), and that ``packprep verify``
exits 4 naming it. Every report is also computed with shards checked in parallel
(``LocalEngine(2)``, more shards than workers) and must equal the inline one, failures in order.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.engines import LocalEngine
from packprep.errors import EXIT_VERIFY
from packprep.materialize import ROW_SCHEMA
from packprep.read import file_sha256
from packprep.pipeline import verify_folder
from packprep.verification import CHECKS, Report, check_part, verify

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER, FIXTURES, fixture_tokenizer

MAX_LEN = 512
TARGET = 1  # the shard that gets corrupted (not the first, so the report must name the right one)
WORKERS = 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A valid output of the bundled example: more shards than WORKERS, truncated and rejected records,
    and a validation split."""
    tokenizer = fixture_tokenizer("llama3") if FIXTURES.is_dir() else str(EXAMPLE_TOKENIZER)
    out = tmp_path_factory.mktemp("verify") / "packed"
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(out), tokenizer, num_proc=1, max_len=MAX_LEN,
                             shard_size="100KB", validation_size=20)
    assert len(manifest["shards"]) >= 2 * WORKERS and manifest["validation"]["sequences"] == 20
    assert manifest["counts"]["rejected"] > 0 and (out / "rejects.jsonl").is_file()
    return out


class RecordingEngine(LocalEngine):
    """``LocalEngine(WORKERS)`` that records the tasks it is handed, and pickles the context first
    as a Ray engine does (the local one forks instead, so it would not notice an unpicklable one)."""

    def __init__(self):
        super().__init__(WORKERS)
        self.tasks = []

    def map(self, fn, context, items, workers=None):
        items = list(items)
        self.tasks.extend((fn, shard["path"], groups) for shard, groups in items)
        return super().map(fn, pickle.loads(pickle.dumps(context)), items, workers)


# ---------------------------------------------------------------------------------------------
# helpers: read, rewrite and re-seal a shard
# ---------------------------------------------------------------------------------------------


def load_manifest(folder: Path) -> dict:
    return json.loads((folder / "packprep.json").read_text())


def save_manifest(folder: Path, manifest: dict) -> None:
    (folder / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")


def shard_path(folder: Path, index: int = TARGET) -> Path:
    return folder / load_manifest(folder)["shards"][index]["path"]


def read_rows(folder: Path, index: int = TARGET) -> list[dict]:
    return pq.read_table(shard_path(folder, index)).to_pylist()


def rewrite(folder: Path, rows: list[dict], index: int = TARGET, schema: pa.Schema = ROW_SCHEMA) -> None:
    """Write ``rows`` as shard ``index`` and re-seal the manifest so that it describes them."""
    path = shard_path(folder, index)
    old_sequences = sum(len(r) for r in pq.read_table(path).column("seq_lens").to_pylist())
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    manifest = load_manifest(folder)
    entry = manifest["shards"][index]
    old_rows, old_tokens, old_supervised = entry["rows"], entry["tokens"], entry["supervised_tokens"]
    entry["rows"] = len(rows)
    entry["tokens"] = sum(len(r["input_ids"]) for r in rows)
    entry["supervised_tokens"] = sum(sum(1 for label in r["labels"] if label != -100) for r in rows)
    entry["bytes"] = path.stat().st_size
    entry["sha256"] = file_sha256(path)
    manifest["rows"] += entry["rows"] - old_rows
    manifest["tokens"]["total"] += entry["tokens"] - old_tokens
    manifest["tokens"]["supervised"] += entry["supervised_tokens"] - old_supervised
    manifest["sequences"] += sum(len(r["seq_lens"]) for r in rows) - old_sequences
    save_manifest(folder, manifest)


def verify_both(folder: Path) -> Report:
    """The inline report, once the parallel one is found equal to it (failures in the same order)
    and every shard the manifest lists was handed to the engine as check tasks, in manifest order (train,
    then validation)."""
    engine = RecordingEngine()
    parallel = verify_folder(folder, engine=engine)
    inline = verify(folder)
    assert parallel == inline, ([str(f) for f in parallel.failures], [str(f) for f in inline.failures])
    if not {f.check for f in inline.failures} & {"manifest", "layout"}:  # (else no shard is read)
        assert {fn for fn, *_ in engine.tasks} == {check_part}
        manifest = load_manifest(folder)
        assert list(dict.fromkeys(path for _, path, _ in engine.tasks)) == [
            shard["path"] for shard in manifest["shards"] + manifest["validation"]["shards"]]
    return inline


def sequence_starts(row: dict) -> list[int]:
    return np.concatenate([[0], np.cumsum(row["seq_lens"])[:-1]]).astype(int).tolist()


def row_with(rows: list[dict], predicate) -> int:
    for k, row in enumerate(rows):
        if k > 0 and predicate(row):  # not row 0, so the reported row number means something
            return k
    raise AssertionError("no row fits the corruption")


# ---------------------------------------------------------------------------------------------
# one corruption per check; each returns (shard path or None, row or None) that must be named
# ---------------------------------------------------------------------------------------------


def corrupt_manifest(folder: Path):
    manifest = load_manifest(folder)
    del manifest["tokens"]
    save_manifest(folder, manifest)
    return None, None


def corrupt_shard_file(folder: Path):
    manifest = load_manifest(folder)
    manifest["shards"][TARGET]["sha256"] = "0" * 64
    save_manifest(folder, manifest)
    return manifest["shards"][TARGET]["path"], None


def corrupt_schema(folder: Path):
    rows = read_rows(folder)
    wide = pa.schema([f if f.name != "position_ids" else pa.field("position_ids", pa.list_(pa.int64())) for f in ROW_SCHEMA])
    rewrite(folder, rows, schema=wide)
    return load_manifest(folder)["shards"][TARGET]["path"], None


def corrupt_lengths(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: len(r["seq_lens"]) >= 2)
    rows[k]["seq_lens"][0] += 1  # seq_lens no longer sum to the row length
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_position_ids(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: len(r["seq_lens"]) >= 2)
    second = sequence_starts(rows[k])[1]
    length = rows[k]["seq_lens"][1]
    # the classic packing bug: positions run on across the boundary instead of restarting
    rows[k]["position_ids"][second : second + length] = list(range(second, second + length))
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_first_label(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: len(r["seq_lens"]) >= 2)
    second = sequence_starts(rows[k])[1]
    rows[k]["labels"][second] = rows[k]["input_ids"][second]  # trained, and equal to its id
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_labels(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: any(label != -100 for label in r["labels"]))
    position = next(i for i, label in enumerate(rows[k]["labels"]) if label != -100)
    rows[k]["labels"][position] = rows[k]["input_ids"][position] + 1  # trained, but not on its id
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_max_len(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: True)
    a, b = rows[k], rows.pop(k + 1)
    assert len(a["input_ids"]) + len(b["input_ids"]) > MAX_LEN
    for column in a:  # two valid rows glued together: every other promise still holds
        a[column] = a[column] + b[column]
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_source_index(folder: Path):
    rows = read_rows(folder)
    k = row_with(rows, lambda r: True)
    records = load_manifest(folder)["counts"]["records"]
    rows[k]["source_index"][0] = records + 7
    rewrite(folder, rows)
    return load_manifest(folder)["shards"][TARGET]["path"], k


def corrupt_coverage(folder: Path):
    rows = read_rows(folder)
    rows.pop(2)  # its records are now neither packed nor rejected
    rewrite(folder, rows)
    return None, None


def corrupt_layout(folder: Path):
    manifest = load_manifest(folder)
    manifest["layout"] = "no-such-layout"  # a layout this packprep cannot read back
    save_manifest(folder, manifest)
    return None, None


def corrupt_counts(folder: Path):
    manifest = load_manifest(folder)
    manifest["counts"]["packed"] += 1
    save_manifest(folder, manifest)
    return None, None


def corrupt_split(folder: Path):
    manifest = load_manifest(folder)
    trained = read_rows(folder)[0]["source_index"][0]
    # the manifest says a training record is held out (its input 0 starts at record 0)
    manifest["validation"]["members"][0]["indices"] = sorted(manifest["validation"]["members"][0]["indices"] + [trained])
    save_manifest(folder, manifest)
    return None, None


CORRUPTIONS = {
    "manifest": corrupt_manifest,
    "layout": corrupt_layout,
    "shard_file": corrupt_shard_file,
    "schema": corrupt_schema,
    "lengths": corrupt_lengths,
    "position_ids": corrupt_position_ids,
    "first_label": corrupt_first_label,
    "labels": corrupt_labels,
    "max_len": corrupt_max_len,
    "source_index": corrupt_source_index,
    "coverage": corrupt_coverage,
    "counts": corrupt_counts,
    "split": corrupt_split,
}


def test_every_check_has_a_corruption():
    assert set(CORRUPTIONS) == set(CHECKS)


def test_valid_output_passes(packed):
    report = verify_both(packed)
    assert report.ok, report.failures
    manifest = load_manifest(packed)
    assert (report.rows, report.sequences, report.tokens) == (
        manifest["rows"], manifest["sequences"], manifest["tokens"]["total"]
    )
    result = CliRunner().invoke(main, ["verify", str(packed)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok:")


def test_rewrite_without_corruption_still_passes(packed, tmp_path):
    """The helpers themselves break nothing: a re-sealed identical shard verifies."""
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    rewrite(folder, read_rows(folder))
    report = verify_both(folder)
    assert report.ok, report.failures


@pytest.mark.parametrize("change, why", [
    ({"turns_cut": 2, "supervised_cut": 1}, "each turn cut loses at least one supervised token"),
    ({"turns_cut": 1, "supervised_cut": 5, "truncated": 0}, "no record was truncated or split"),
])
def test_cut_counts_that_cannot_be_fail(packed, tmp_path, change, why):
    """The turns and supervised tokens --max-len cut are possible: a turn cut loses a token, and only
    records that were cut lose any."""
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    manifest = load_manifest(folder)
    counts = manifest["counts"]
    counts["packed"] += counts["truncated"] - change.get("truncated", counts["truncated"])  # the fates still add up
    counts.update(change)
    save_manifest(folder, manifest)
    report = verify(folder)
    assert [f.check for f in report.failures] == ["counts"] and why in report.failures[0].message, report.failures


@pytest.mark.parametrize("check", CHECKS)
def test_each_check_names_its_corruption(packed, tmp_path, check):
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    shard, row = CORRUPTIONS[check](folder)

    report = verify_both(folder)
    assert not report.ok
    assert {f.check for f in report.failures} == {check}, [str(f) for f in report.failures]
    failure = report.failures[0]
    if shard is not None:
        assert failure.shard == shard
    if row is not None:
        assert failure.row == row

    result = CliRunner().invoke(main, ["verify", str(folder), "--num-proc", str(WORKERS)])
    assert result.exit_code == EXIT_VERIFY
    assert f"[{check}]" in result.output
    if row is not None:
        assert f"row {row}" in result.output

    as_json = CliRunner().invoke(main, ["verify", str(folder), "--json"])
    assert as_json.exit_code == EXIT_VERIFY
    payload = json.loads(as_json.stdout)
    assert payload["ok"] is False and {f["check"] for f in payload["failures"]} == {check}


# more ways to break coverage, counts and shard files: each still names only its own check


def _extra_rejects_duplicate(folder: Path):
    path = folder / "rejects.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + lines[:1]) + "\n")  # the same record rejected twice


def _extra_rejects_packed_record(folder: Path):
    rows = read_rows(folder, 0)
    entry = {"source_index": rows[0]["source_index"][0], "reason": "x", "code": "x"}
    path = folder / "rejects.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[1:] + [json.dumps(entry)]) + "\n")  # packed and rejected


def _extra_supervised_count(folder: Path):
    manifest = load_manifest(folder)
    manifest["tokens"]["supervised"] += 1
    save_manifest(folder, manifest)


def _extra_missing_shard(folder: Path):
    shard_path(folder).unlink()


def _extra_shard_rows(folder: Path):
    manifest = load_manifest(folder)
    manifest["shards"][TARGET]["rows"] += 1
    save_manifest(folder, manifest)


def _extra_sequences_count(folder: Path):
    manifest = load_manifest(folder)
    manifest["sequences"] -= 1
    save_manifest(folder, manifest)


def _extra_rejects_negative_index(folder: Path):
    path = folder / "rejects.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    entries[0]["source_index"] = -1  # numpy would count it as the last record
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def _extra_trailing_empty_row(folder: Path):
    rows = read_rows(folder)
    rows.append({column: [] for column in rows[0]})  # a row holding no sequence, last in its shard
    rewrite(folder, rows)


def _extra_unreadable_manifest(folder: Path):
    (folder / "packprep.json").write_text("{not json")


@pytest.mark.parametrize(
    "corrupt, check",
    [
        (_extra_rejects_duplicate, "coverage"),
        (_extra_rejects_packed_record, "coverage"),
        (_extra_supervised_count, "counts"),
        (_extra_missing_shard, "shard_file"),
        (_extra_shard_rows, "shard_file"),
        (_extra_sequences_count, "counts"),
        (_extra_rejects_negative_index, "coverage"),
        (_extra_trailing_empty_row, "lengths"),
        (_extra_unreadable_manifest, "manifest"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_more_corruptions(packed, tmp_path, corrupt, check):
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    corrupt(folder)
    report = verify_both(folder)
    assert {f.check for f in report.failures} == {check}, [str(f) for f in report.failures]


def test_failures_of_several_shards_come_in_manifest_order(packed, tmp_path):
    """Shards checked by different workers still report in the manifest's order (here not the
    order of their file names), whichever finishes first."""
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    manifest = load_manifest(folder)
    manifest["shards"].reverse()
    for entry in manifest["shards"]:
        entry["sha256"] = "0" * 64
    save_manifest(folder, manifest)
    missing = manifest["shards"][1]["path"]
    (folder / missing).unlink()

    report = verify_both(folder)
    assert [(f.shard, f.message) for f in report.failures] == [
        (entry["path"], "listed in the manifest but missing" if entry["path"] == missing
         else "sha256 differs from the manifest") for entry in manifest["shards"]
    ]
