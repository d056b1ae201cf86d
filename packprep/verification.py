"""Re-read an output folder and check every promise of the output contract, independently of the writer.

Checks (each failure names the shard, the row and the check):

* ``manifest``     packprep.json exists, parses and matches ``schemas/manifest.schema.json``
* ``layout``       the folder's layout can be read back as packed rows (``packprep`` and renaming
                   layouts such as ``trl``); a stack's own format (padded, ``.npy``) is refused here:
                   verify the folder it was exported from
* ``shard_file``   every shard the manifest lists exists, with its sha256 and row count
* ``schema``       shard columns and types match ``schemas/packed_row.schema.json``
* ``lengths``      input_ids, labels and position_ids have one length, equal to sum(seq_lens);
                   seq_lens and source_index have one length; every seq_len >= 1
* ``position_ids`` restart at 0 at every packed sequence and count up by one
* ``first_label``  the first label of every packed sequence is -100
* ``labels``       every label is -100 or equal to its input id
* ``max_len``      no row is longer than max_len (unless the strategy allows it)
* ``source_index`` every index is a record of the input
* ``coverage``     every input record is packed or listed in rejects.jsonl, never both
* ``counts``       the manifest's counts add up to the records read, and match rows, sequences, tokens and rejects;
                   the turns and supervised tokens --max-len cut are possible (turns_cut, supervised_cut)
* ``split``        (with a validation split) the validation shards hold exactly the records the manifest
                   lists as held out, and no record is in both splits
* ``retokenize``   (``retokenize=N``) N random sequences equal their input records rendered and tokenized
                   again with nothing the writer's fast paths use (see retokenize.py)

Shards are checked independently (:func:`check_part`, a stage of any engine: a shard, or a run of
its row groups, a task); the driver merges their results in manifest order and judges the totals,
so the report does not depend on the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from .errors import ConfigError, InputError
from .layout import (FILES, IGNORE_INDEX, ROW_SCHEMA, TREE_LAYOUT, LayoutError, ShardReader, UnreadableLayoutError, get_layout,
                     list_column, readable_layout)
from .record_schema import load_schema
from .read import file_sha256
from .settings import check_verify

CHECKS = (
    "manifest",
    "layout",
    "shard_file",
    "schema",
    "lengths",
    "position_ids",
    "first_label",
    "labels",
    "max_len",
    "source_index",
    "coverage",
    "counts",
    "split",
)  # and, when asked for (retokenize=N), "retokenize": tests/test_retokenize.py corrupts for it


@dataclass
class Failure:
    check: str
    message: str
    shard: str | None = None
    row: int | None = None

    def __str__(self) -> str:
        where = ", ".join(part for part in (self.shard, None if self.row is None else f"row {self.row}") if part)
        return f"[{self.check}] {where + ': ' if where else ''}{self.message}"


@dataclass
class Report:
    failures: list[Failure] = field(default_factory=list)
    rows: int = 0
    sequences: int = 0
    tokens: int = 0
    retokenized: int = 0  # sequences checked against their re-tokenized input records
    validation: dict | None = None  # the validation split's rows, sequences and tokens, where there is one

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class ShardContext:
    """What checking any shard needs: small and picklable, shipped once to each worker."""

    folder: Path
    layout: str | None
    max_len: int
    may_exceed: bool
    check_hashes: bool
    records: int


@dataclass
class ShardCheck:
    """One shard's failures and totals; ``sources``: the input records its rows hold (unique,
    in-range only), so that the driver judges coverage without the rows."""

    failures: list[Failure] = field(default_factory=list)
    complete: bool = True  # every row was read and checked: only then may the totals be judged
    rows: int = 0
    sequences: int = 0
    tokens: int = 0
    supervised: int = 0
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


Checker = Callable[["ShardContext", list[dict]], list[ShardCheck]]


def verify(folder: str | Path, check_hashes: bool = True, retokenize: int = 0, seed: int = 0,
           checked: list[ShardCheck] | None = None, checker: Checker | None = None,
           checked_validation: list[ShardCheck] | None = None) -> Report:
    """Check ``folder`` against the output contract; never raises on bad data, reports it.

    ``retokenize=N`` also rebuilds N randomly chosen sequences (``seed``) from the input records
    the manifest names and compares ids and labels, where the folder passed the other checks; the
    inputs and the tokenizer must be those packed and readable from here, else a ConfigError says so
    (a verdict on inputs, not on the output). A folder with neither a manifest nor ``data/`` is no
    packed folder: a ConfigError too.
    ``checker(context, shards)`` checks the shards (default: one by one in this process;
    ``packprep.pipeline.verify_folder`` runs it on an engine); the report is the same with any.
    ``checked``: the manifest's shards already checked, in its order (``pack`` checks the shards it
    wrote, reading them back); only the totals are left. With it, a layout whose rows cannot be read
    back is verified too (``pack`` checked its rows as it made them, before converting them): its
    listed files, the manifest and the totals. ``checked_validation``: the same for the validation split.
    """
    check_verify(retokenize, seed)
    folder = Path(folder)
    if not (folder / "packprep.json").exists() and not (folder / "data").exists():
        raise ConfigError(f"{folder} is not a packed output folder (no packprep.json, no data/): give the folder "
                          "pack wrote")
    report = Report()
    manifest = _load_manifest(folder, report, check_hashes if checked is not None else None)
    if manifest is None:
        return report
    context = ShardContext(folder, manifest.get("layout"), manifest["config"]["max_len"],
                           manifest.get("rows_may_exceed_max_len", False), check_hashes,
                           manifest["counts"]["records"])
    seen = np.zeros(context.records, dtype=bool)
    supervised = 0
    # Totals (coverage, row/token counts) are only judged when every shard could be read and its
    # rows checked: otherwise they would only repeat the failure above as a second, wrong one.
    complete = True
    if checked is None:
        checked = (checker or check_here)(context, manifest["shards"])
    for shard in checked:
        report.failures.extend(shard.failures)
        report.rows += shard.rows
        report.sequences += shard.sequences
        report.tokens += shard.tokens
        supervised += shard.supervised
        seen[shard.sources] = True
        complete = complete and shard.complete
    if manifest.get("validation"):
        given = None if checked_validation is None else (lambda _context, _shards: checked_validation)
        seen, complete = _check_validation(context, manifest, seen, report, given or checker or check_here, complete)
    indices_valid = not any(f.check == "source_index" for f in report.failures)
    _check_coverage(folder, manifest, seen, report, judge_packed=complete and indices_valid)
    _check_counts(manifest, report, supervised if complete else None)
    if retokenize > 0 and complete and report.ok:  # a folder that fails is not compared with its inputs
        from .retokenize import retokenize_check

        report.retokenized, failures = retokenize_check(folder, manifest, retokenize, seed)
        report.failures.extend(Failure("retokenize", message, shard, row) for shard, message, row in failures)
    return report


def check_tasks(context: ShardContext, shards: list[dict], per_shard: int) -> list[tuple[int, tuple]]:
    """The check stage's tasks ``(shard number, (shard, run of row groups))``: each shard whole
    (``per_shard`` 1), else cut into at most ``per_shard`` runs of its row groups."""
    return [(n, (shard, groups)) for n, shard in enumerate(shards) for groups in _group_runs(context, shard, per_shard)]


def join_checks(shards: list[dict], tasks: list[tuple[int, tuple]], results: Iterator[ShardCheck]) -> list[ShardCheck]:
    """Each shard's check, in order, from its tasks' results (:func:`check_part`, in task order)."""
    checked: list[list[ShardCheck]] = [[] for _ in shards]
    for (n, _), part in zip(tasks, results):
        checked[n].append(part)
    return [joined_check(parts, shard) for parts, shard in zip(checked, shards)]


def check_here(context: ShardContext, shards: list[dict]) -> list[ShardCheck]:
    """Each shard's check, one whole shard at a time, in this process."""
    tasks = check_tasks(context, shards, 1)
    return join_checks(shards, tasks, (check_part(context, part) for _, part in tasks))


def _group_runs(context: ShardContext, shard: dict, runs: int) -> list[tuple[int, int] | None]:
    """The runs of row groups a shard is checked in, at most ``runs``; [None] (the whole shard, one
    task) for one run, or where the footer cannot be read: that task reports why."""
    if runs == 1:
        return [None]
    try:
        groups = ShardReader(context.folder / shard["path"], context.layout).num_groups
    except Exception:
        return [None]
    step = -(-groups // max(1, min(groups, runs)))
    return [(first, min(groups, first + step)) for first in range(0, groups, step)] or [None]


def check_part(context: ShardContext, part: tuple[dict, tuple[int, int] | None]) -> ShardCheck:
    """The check stage: check row groups ``[first, last)`` of a shard (None: all of them), one at a
    time; :func:`joined_check` adds up a shard's parts and judges its row count."""
    shard, groups = part
    check = ShardCheck()
    path = context.folder / shard["path"]
    if not path.is_file():
        check.failures.append(Failure("shard_file", "listed in the manifest but missing", shard["path"]))
        check.complete = False
        return check
    if context.check_hashes and not (groups and groups[0]) and file_sha256(path) != shard["sha256"]:
        check.failures.append(Failure("shard_file", "sha256 differs from the manifest", shard["path"]))
    sources, first_row = [], 0
    for table in _shard_tables(path, check.failures, shard["path"], context.layout, groups):  # bounded memory
        if isinstance(table, int):
            first_row = table
            continue
        if table is None or not _check_rows(table, shard["path"], context, check, sources,
                                            first_row=first_row + check.rows):
            check.complete = False
            break
    if sources:  # the smallest integer type that holds every record index: less to send back
        check.sources = np.unique(np.concatenate(sources)).astype(np.min_scalar_type(context.records))
    return check


def check_rows(context: ShardContext, check: ShardCheck | None, table: pa.Table, shard: str,
               first_row: int) -> ShardCheck:
    """``check`` (None: a new one) with one more row group checked: rows as a writer made them, before
    it converts them to a layout that cannot be read back (``packprep.write.write_piece``)."""
    check = check or ShardCheck()
    sources = []
    if check.complete and not _check_rows(table.combine_chunks(), shard, context, check, sources, first_row):
        check.complete = False
    if sources:
        joined = np.union1d(check.sources, sources[0]) if len(check.sources) else np.unique(sources[0])
        check.sources = joined.astype(np.min_scalar_type(context.records))
    return check


def joined_check(parts: list[ShardCheck], shard: dict) -> ShardCheck:
    """One shard's check from the checks of its parts, in order; its row count judged against the manifest."""
    check = ShardCheck(complete=all(part.complete for part in parts))
    for part in parts:
        check.failures += part.failures
        check.rows += part.rows
        check.sequences += part.sequences
        check.tokens += part.tokens
        check.supervised += part.supervised
    sources = [part.sources for part in parts if len(part.sources)]
    if sources:
        check.sources = np.unique(np.concatenate(sources))
    if check.complete and check.rows != shard["rows"]:
        check.failures.append(Failure("shard_file", f"{check.rows} rows, manifest says {shard['rows']}", shard["path"]))
    return check


def check_footers(folder: str | Path) -> Report:
    """What :func:`verify` checks at the cost of reading the manifest, rejects.jsonl and the shards'
    footers (not their rows): the manifest against its schema, every listed shard there with its size
    and row count, the counts adding up, rejects.jsonl's entries. ``repack`` runs it before any work."""
    folder = Path(folder)
    if not (folder / "packprep.json").exists() and not (folder / "data").exists():
        raise ConfigError(f"{folder} is not a packed output folder (no packprep.json, no data/): give the folder "
                          "pack wrote")
    report = Report()
    manifest = _load_manifest(folder, report)
    if manifest is None:
        return report
    validation = manifest.get("validation") or {}
    for entry in [*manifest["shards"], *validation.get("shards", [])]:
        path = folder / entry["path"]
        if not path.is_file():
            report.failures.append(Failure("shard_file", "listed in the manifest but missing", entry["path"]))
            continue
        size = path.stat().st_size
        if entry.get("bytes") is not None and size != entry["bytes"]:
            report.failures.append(Failure("shard_file", f"{size:,} bytes, the manifest says {entry['bytes']:,}",
                                           entry["path"]))
            continue
        try:
            rows = ShardReader(path, manifest.get("layout")).num_rows
        except Exception as exc:  # a footer pyarrow cannot read: any of its errors
            report.failures.append(Failure("shard_file", f"unreadable: {str(exc)[:200]}", entry["path"]))
            continue
        if rows != entry["rows"]:
            report.failures.append(Failure("shard_file", f"{rows:,} rows, the manifest says {entry['rows']:,}",
                                           entry["path"]))
    _check_coverage(folder, manifest, np.zeros(manifest["counts"]["records"], bool), report, judge_packed=False)
    _check_counts(manifest, report, None)
    return report


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a packed output folder, or a clear error (for the commands that read one)."""
    path = Path(folder) / "packprep.json"
    if not path.is_file():
        raise ConfigError(f"{folder} is not a packed output folder (no packprep.json)")
    try:
        manifest = json.loads(path.read_text())
        manifest["config"]["max_len"], manifest["shards"]  # noqa: B018
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path} is not a valid manifest ({exc}); run packprep verify") from None
    return manifest


def _load_manifest(folder: Path, report: Report, rows_checked: bool | None = None) -> dict | None:
    """The manifest, if it is valid. A layout whose rows cannot be read back is refused, unless its
    rows were checked as they were made (``rows_checked``: whether to hash its files, else their sizes)."""
    import jsonschema

    path = folder / "packprep.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        report.failures.append(Failure("manifest", f"cannot read {path}: {exc}"))
        return None
    layout = manifest.get("layout") if isinstance(manifest, dict) else None
    shown = manifest  # what the schema sees
    if isinstance(layout, str):  # before the schema: a stack's own files need not look like shards
        try:
            readable_layout(layout)
        except LayoutError as exc:
            before = len(report.failures)
            _check_listed_files(folder, manifest, report, rows_checked is not False)
            unreadable = isinstance(exc, UnreadableLayoutError)
            if unreadable and rows_checked is None and len(report.failures) == before:  # whole, only unreadable here
                raise UnreadableLayoutError(f"{folder}: its files match the manifest, but {exc}") from None
            if not (unreadable and rows_checked is not None):
                report.failures.append(Failure("layout", str(exc)))
                return None
            if get_layout(layout).writes == FILES:  # files of its own: their paths are no shard names
                shown = {**manifest, "shards": []}
    errors = list(jsonschema.Draft202012Validator(load_schema("manifest")).iter_errors(shown))
    for error in errors[:5]:
        where = "/".join(str(p) for p in error.absolute_path) or "manifest"
        report.failures.append(Failure("manifest", f"at {where}: {error.message[:200]}"))
    return None if errors else manifest


def _check_listed_files(folder: Path, manifest: dict, report: Report, hashes: bool = True) -> None:
    """For a layout whose rows cannot be read back: at least every listed file is there, unchanged
    (its sha256; ``hashes`` False: its size, where the writer hashed the bytes it wrote)."""
    validation = manifest.get("validation")
    listed = list(manifest.get("shards") or []) + list(validation.get("shards") or [] if isinstance(validation, dict) else [])
    for entry in listed:
        name = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not (folder / name).is_file():
            report.failures.append(Failure("shard_file", "listed in the manifest but missing", str(name)))
        elif hashes and entry.get("sha256") != file_sha256(folder / name):
            report.failures.append(Failure("shard_file", "sha256 differs from the manifest", name))
        elif not hashes and entry.get("bytes") != (folder / name).stat().st_size:
            report.failures.append(Failure("shard_file", "size differs from the manifest", name))


def _shard_tables(path: Path, failures: list[Failure], name: str, layout=None,
                  groups: tuple[int, int] | None = None) -> Iterator[pa.Table | int | None]:
    """The shard's rows (canonical names), one row group (Parquet) or record batch (Arrow) at a
    time, after the number of rows before them; None (after recording why) where it cannot be read
    or has the wrong schema."""
    try:
        reader = ShardReader(path, layout)
        schema = reader.schema
        if not schema.equals(TREE_LAYOUT.schema(None) if layout == TREE_LAYOUT.name else ROW_SCHEMA):
            failures.append(
                Failure("schema", f"columns {schema.to_string(show_schema_metadata=False)!r} "
                        f"differ from packed_row.schema.json", name)
            )
            yield None
            return
        yield reader.rows_before(groups[0]) if groups else 0
        # a check is an engine task, one CPU: not a thread a core in each
        for table in reader.tables(threads=False, groups=range(*groups) if groups else None):
            yield table.combine_chunks()
    except Exception as exc:
        failures.append(Failure("shard_file", f"unreadable: {exc}", name))
        yield None


def _first_row(offsets: np.ndarray, bad_positions: np.ndarray) -> int:
    """The row holding the first of ``bad_positions`` (flat indices)."""
    return int(np.searchsorted(offsets, bad_positions[0], side="right") - 1)


def _check_rows(table, name, context: ShardContext, check: ShardCheck, sources: list, first_row: int = 0) -> bool:
    """Check the rows of one row group into ``check`` (its in-range source indices into ``sources``);
    False if they are malformed (nothing counted)."""
    ids, tok_off = list_column(table, "input_ids")
    labels, lab_off = list_column(table, "labels")
    pos, pos_off = list_column(table, "position_ids")
    seq_lens, seq_off = list_column(table, "seq_lens")
    source_index, src_off = list_column(table, "source_index")
    fail = lambda kind, row, message: check.failures.append(Failure(kind, message, name, first_row + row))  # noqa: E731

    row_len = np.diff(tok_off)
    seq_cumsum = np.concatenate([[0], np.cumsum(seq_lens, dtype=np.int64)])
    seq_sum = seq_cumsum[seq_off[1:]] - seq_cumsum[seq_off[:-1]]  # (reduceat fails on a trailing empty row)
    problems = [
        (np.diff(lab_off) != row_len, "labels and input_ids differ in length"),
        (np.diff(pos_off) != row_len, "position_ids and input_ids differ in length"),
        (seq_sum != row_len, "seq_lens do not sum to the row length"),
        (np.diff(src_off) != np.diff(seq_off), "seq_lens and source_index differ in length"),
        (np.diff(seq_off) == 0, "row holds no sequence"),
    ]
    for mask, message in problems:
        if mask.any():
            fail("lengths", int(np.argmax(mask)), message)
            return False
    if (seq_lens < 1).any():
        fail("lengths", _first_row(seq_off, np.flatnonzero(seq_lens < 1)), "a seq_len is below 1")
        return False

    # Expected position ids: 0..len-1 within every packed sequence (shared-prefix rows: the tree's invariants).
    seq_start = np.cumsum(seq_lens) - seq_lens
    if context.layout == TREE_LAYOUT.name:
        bad = tree_problem(table, labels, pos, seq_lens)
        if bad is not None:
            fail("tree", _first_row(tok_off, np.array([bad[0]])), bad[1])
    else:
        expected = np.arange(len(ids), dtype=np.int64) - np.repeat(seq_start, seq_lens)
        bad = np.flatnonzero(pos != expected)
        if len(bad):
            fail("position_ids", _first_row(tok_off, bad), f"position_ids do not restart at 0 at each sequence (token {int(bad[0] - tok_off[_first_row(tok_off, bad)])})")
    firsts = seq_start[seq_lens > 0]
    bad = firsts[labels[firsts] != IGNORE_INDEX]
    if len(bad):
        fail("first_label", _first_row(tok_off, bad), "first label of a packed sequence is not -100")
    bad = np.flatnonzero((labels != IGNORE_INDEX) & (labels != ids))
    if len(bad):
        fail("labels", _first_row(tok_off, bad), "a label is neither -100 nor its input id")
    if not context.may_exceed and (row_len > context.max_len).any():
        row = int(np.argmax(row_len > context.max_len))
        fail("max_len", row, f"row of {int(row_len[row])} tokens exceeds max_len {context.max_len}")
    out_of_range = (source_index < 0) | (source_index >= context.records)
    if out_of_range.any():
        fail("source_index", _first_row(src_off, np.flatnonzero(out_of_range)), "source_index is not an input record")
    else:
        sources.append(source_index)
    check.rows += table.num_rows
    check.sequences += len(seq_lens)
    check.tokens += len(ids)
    check.supervised += int((labels != IGNORE_INDEX).sum())
    return True


def tree_problem(table, labels: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray) -> tuple[int, str] | None:
    """The first token of a shared-prefix row group that breaks a tree invariant, and how
    (prefix_tree.check_tree on each packed sequence: one record's tree); None if none does."""
    from .layout import TREE_COLUMN
    from .prefix_tree import TreeRow, check_tree

    ids, _ = list_column(table, "input_ids")
    descendants, _ = list_column(table, TREE_COLUMN.name)
    start = 0
    for length in seq_lens.tolist():
        part = slice(start, start + length)
        problem = check_tree(TreeRow(ids[part], labels[part], positions[part], descendants[part]))
        if problem is not None:
            return start, f"shared-prefix row: {problem}"
        start += length
    return None


def _check_validation(context: ShardContext, manifest: dict, seen: np.ndarray, report: Report, checker: Checker,
                      complete: bool) -> tuple[np.ndarray, bool]:
    """Check the validation split's shards and totals, and that its records are the held-out ones and
    in no training row; return the records either split holds, and whether every shard was read."""
    from .mix import input_starts
    from .split import members_to_records

    validation = manifest["validation"]
    held = np.zeros(len(seen), dtype=bool)
    totals = np.zeros(4, np.int64)  # rows, sequences, tokens, supervised
    for shard in checker(context, validation["shards"]):
        report.failures.extend(shard.failures)
        held[shard.sources] = True
        totals += (shard.rows, shard.sequences, shard.tokens, shard.supervised)
        complete = complete and shard.complete
    report.validation = dict(zip(("rows", "sequences", "tokens"), map(int, totals[:3])))
    if not complete:
        return seen | held, complete
    said = (validation["rows"], validation["sequences"], validation["tokens"]["total"], validation["tokens"]["supervised"])
    for name, found, manifest_says in zip(("rows", "sequences", "tokens", "supervised tokens"), totals, said):
        if found != manifest_says:
            report.failures.append(Failure("counts", f"validation shards hold {found} {name}, manifest says {manifest_says}"))
    both = np.flatnonzero(seen & held)
    if len(both):
        report.failures.append(Failure("split", f"{len(both)} input records are in both train and validation "
                                       f"(first: {int(both[0])})"))
    listed = members_to_records(validation["members"], input_starts([i["records"] for i in manifest["inputs"]]))
    if not np.array_equal(listed, np.flatnonzero(held)):
        report.failures.append(Failure("split", f"the validation shards hold {int(held.sum())} records; the manifest "
                                       f"lists {len(listed)} held out, and they differ"))
    return seen | held, complete


def _check_coverage(folder: Path, manifest: dict, seen: np.ndarray, report: Report, judge_packed: bool = True) -> None:
    """Every record packed (``seen``) or rejected, never both; ``judge_packed`` False: rejects.jsonl alone."""
    rejected = np.zeros(len(seen), dtype=np.int64)
    path = folder / "rejects.jsonl"
    if path.exists():
        for number, line in enumerate(path.read_text(encoding="utf-8").removesuffix("\n").split("\n"), start=1):
            try:
                index = json.loads(line)["source_index"]
                if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(seen):
                    raise IndexError(index)  # (a negative index would silently count another record)
                rejected[index] += 1
            except (ValueError, KeyError, IndexError, TypeError):
                report.failures.append(Failure("coverage", f"rejects.jsonl line {number} is not a valid reject entry"))
                return
    if int((rejected > 0).sum()) != manifest["counts"]["rejected"]:
        report.failures.append(
            Failure("counts", f"rejects.jsonl lists {int((rejected > 0).sum())} records, manifest says {manifest['counts']['rejected']}")
        )
    twice = np.flatnonzero(rejected > 1)
    if len(twice):
        report.failures.append(Failure("coverage", f"record {int(twice[0])} is rejected more than once"))
    if not judge_packed:
        return
    missing = np.flatnonzero(~seen & (rejected == 0))
    unsampled = manifest["counts"].get("unsampled", 0)  # a mixture's records left out of both splits
    if len(missing) != unsampled:
        report.failures.append(
            Failure("coverage", f"{len(missing)} input records are neither packed nor rejected"
                    + (f" (first: {int(missing[0])})" if len(missing) else "")
                    + (f"; the mixture left {unsampled} out" if unsampled else ""))
        )
    both = np.flatnonzero(seen & (rejected > 0))
    if len(both):
        report.failures.append(Failure("coverage", f"record {int(both[0])} is both packed and rejected"))


def _check_cuts(manifest: dict, report: Report) -> None:
    """What --max-len cut (turns_cut, supervised_cut) is possible: a turn cut loses at least one
    supervised token, and only records truncated, split or rejected as overlong lose any."""
    counts = manifest["counts"]
    turns, supervised = counts.get("turns_cut", 0), counts.get("supervised_cut", 0)
    if turns > supervised:
        report.failures.append(Failure("counts", f"turns_cut {turns} is more than supervised_cut {supervised}: "
                                       "each turn cut loses at least one supervised token"))
    cut_records = counts["truncated"] + counts["split"] + counts["rejected_by_reason"].get("overlong", 0)
    if supervised and (not cut_records or manifest["config"].get("overlong") == "drop"):
        report.failures.append(Failure("counts", f"supervised_cut is {supervised}, but no record was truncated or "
                                       f"split (--overlong {manifest['config'].get('overlong')})"))


def _check_counts(manifest: dict, report: Report, supervised: int | None) -> None:
    """The manifest's counts add up; ``supervised`` None: a shard was unreadable, skip shard totals."""
    counts = manifest["counts"]
    fates = counts["packed"] + counts["truncated"] + counts["split"] + counts["rejected"] + counts.get("unsampled", 0)
    if fates != counts["records"]:
        report.failures.append(Failure("counts", f"packed+truncated+split+rejected+unsampled = {fates}, "
                                       f"records = {counts['records']}"))
    if sum(counts["rejected_by_reason"].values()) != counts["rejected"]:
        report.failures.append(Failure("counts", "rejected_by_reason does not add up to rejected"))
    _check_cuts(manifest, report)
    if supervised is None:
        return
    if report.rows != manifest["rows"]:
        report.failures.append(Failure("counts", f"shards hold {report.rows} rows, manifest says {manifest['rows']}"))
    if supervised != manifest["tokens"]["supervised"]:
        report.failures.append(Failure("counts", f"shards hold {supervised} supervised tokens, manifest says {manifest['tokens']['supervised']}"))
    if report.tokens != manifest["tokens"]["total"]:
        report.failures.append(Failure("counts", f"shards hold {report.tokens} tokens, manifest says {manifest['tokens']['total']}"))
    if report.sequences != manifest["sequences"]:
        report.failures.append(Failure("counts", f"shards hold {report.sequences} sequences, manifest says {manifest['sequences']}"))
