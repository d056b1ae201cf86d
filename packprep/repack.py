"""``packprep repack DIR -o OUT``: pack the sequences a packed folder stores again, with another
``--max-len``, strategy, seed, row order or layout; no tokenizer, no input files.

The step's planners and the functions its workers run (``pipeline.repack`` runs them on an engine).
The folder's rows are read back into the token store ``pack`` would have made (each input record's
sequence once, in input order): pass 1 (:func:`read_lengths`, a run of row groups a task) reads
``seq_lens`` and ``source_index``, and the labels of the sequences longer than the new ``--max-len``
(whether truncation leaves any trained); the driver then decides each record's fate and place
(:class:`Placement`), and pass 2 (:func:`write_tokens`, a run of row groups a task) writes each kept
record's tokens, cut where the new length cuts them, at its place in the token files the driver
sized: disjoint byte ranges, so the tasks run side by side. The ledger is rebuilt from the manifest
and ``rejects.jsonl``; both go through ``pack``'s own last step (``pipeline.write_output``), so the
output is byte for byte what ``pack`` writes with those settings, wherever no sequence was cut.
What was cut is not stored: a sequence truncated, or a record dropped, at the old ``--max-len`` is
refused at a longer one (``accept_truncated`` packs them as stored, and says so), and pieces of
split sequences (whose first labels were masked) are refused. A mixture's selection (which records,
how many copies, which are held out) is read from the folder, as ``pack`` chose it.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError, InputError, spell
from .fates import DROPPED, EMPTIED, PACKED, REJECTED, TRUNCATED, UNSAMPLED
from .layout import IGNORE_INDEX, TREE_COLUMN, ShardReader, list_column
from .ledger import CUT_COUNTS, Ledger
from .materialize import Spilled, TokenStore, spill_path
from .mix import MixSource, Mixture, Selection
from .packing import STRATEGY_TABLE
from .plan import cut_cost, overlong_fates

TOKEN_COLUMNS = ("ids", "labels")  # the token store's two files (materialize.spill_path)


def repacked_from(folder: Path, manifest: dict, max_len: int) -> dict:
    """The manifest key that says what was taken as stored, no longer what pack would write: sequences cut
    at the old ``max_len`` (a longer one now), or a mixture's selection (records, copies, held-out ones)
    kept at a shorter one that cuts sequences the shares were drawn from."""
    counts, before = manifest["counts"], int(manifest["config"]["max_len"])
    longer = max_len > before
    return {"repacked_from": {"path": str(folder), "max_len": before,
                              "truncated_as_stored": counts["truncated"] if longer else 0,
                              "dropped_as_stored": counts["rejected_by_reason"].get("overlong", 0) if longer else 0,
                              "selection_as_stored": not longer}}


def stored_selection(stored: "Stored", fates: np.ndarray) -> Selection:
    """The folder's mixture selection, of the sequences that stay sequences at the new ``max_len``."""
    keep = kept(fates)
    return Selection.from_copies(stored.copies[keep], stored.held[keep])


def check_stored(folder: Path, manifest: dict, found: list[dict]) -> None:
    """Refuse a folder whose shards' sequences (pass 1's ``found``) are not those its manifest counts:
    a shard swapped for one of another folder, say, of the same size and rows."""
    validation = manifest.get("validation") or {}
    sequences = sum(len(f["lengths"]) for f in found)
    tokens = sum(int(f["lengths"].sum()) for f in found)
    records = max((int(f["records"].max()) for f in found if len(f["records"])), default=-1)
    said = (manifest["sequences"] + validation.get("sequences", 0),
            manifest["tokens"]["total"] + (validation.get("tokens") or {}).get("total", 0))
    low = min((int(f["records"].min()) for f in found if len(f["records"])), default=0)
    if (sequences, tokens) != said or records >= manifest["counts"]["records"] or low < 0:
        raise InputError(f"{folder} is damaged, so repack cannot rebuild its sequences: its shards hold {sequences:,} "
                         f"sequences of {tokens:,} tokens (input records up to {records:,}); the manifest says "
                         f"{said[0]:,} of {said[1]:,} from {manifest['counts']['records']:,} records. Run packprep "
                         f"verify {folder} for the full report, or pack again from the inputs")


@dataclass
class StoredShards:
    """The folder's shards (train then validation, in manifest order) as the tasks of both passes
    read them: a task is ``(shard, first row group, end row group, unit of the first)``, a unit being
    a row group's number over all shards. ``max_len``: pass 1 counts the supervised tokens within it
    of the sequences longer, and what the cut costs them (``--overlong truncate``, or ``split``:
    ``pieces``; None: it does not)."""

    folder: Path
    layout: str | None
    paths: list[str]
    groups: list[int]  # row groups of each shard
    train: int  # the shards of the train split: the first ones
    max_len: int | None
    pieces: bool = False

    @classmethod
    def open(cls, folder: Path, manifest: dict, config) -> "StoredShards":
        validation = (manifest.get("validation") or {}).get("shards", [])
        paths = [s["path"] for s in manifest["shards"]] + [s["path"] for s in validation]
        groups = [ShardReader(folder / path, manifest.get("layout")).num_groups for path in paths]
        return cls(folder, manifest.get("layout"), paths, groups, len(manifest["shards"]),
                   config.max_len if config.overlong != "drop" else None, config.overlong == "split")

    def units(self, shard: int) -> int:
        """The unit of the shard's first row group."""
        return sum(self.groups[:shard])

    def tasks(self, runs: int, wanted: np.ndarray | None = None) -> list[tuple[int, int, int, int]]:
        """Each shard's row groups in at most ``runs`` runs of consecutive groups, a task each;
        ``wanted``: the sorted units a task must hold one of (None: every one)."""
        tasks = []
        for shard, groups in enumerate(self.groups):
            step, base = -(-groups // max(1, min(groups, runs))), self.units(shard)
            for first in range(0, groups, step):
                end = min(groups, first + step)
                if wanted is None or np.searchsorted(wanted, base + first) < np.searchsorted(wanted, base + end):
                    tasks.append((shard, first, end, base + first))
        return tasks

    def reader(self, shard: int) -> ShardReader:
        return ShardReader(self.folder / self.paths[shard], self.layout)

    def check_flat(self) -> None:
        """Refuse shards of shared-prefix rows, whatever the manifest says: each of their sequences is a
        record's prefix tree, which repacked as flat sequences would train every branch on its siblings.
        The column is looked for here; pass 2 also finds position ids that do not count 0, 1, 2, ...
        (:func:`flat_positions`), should the column be gone too."""
        for path in self.paths:
            if TREE_COLUMN.name in ShardReader(self.folder / path, self.layout).schema.names:
                raise InputError(f"{self.folder / path} holds shared-prefix rows ({TREE_COLUMN.name}), whatever "
                                 f"the manifest says: repack cannot repack prefix trees; pack again from the inputs")


def flat_positions(path: Path, positions: np.ndarray, start: int, length: int) -> None:
    """Refuse a stored sequence whose position ids are not 0..length-1 (a prefix tree's depths, say)."""
    if not np.array_equal(positions[start : start + length], np.arange(length)):
        raise InputError(f"{path}: a sequence's position_ids do not count 0, 1, 2, ... (a shared-prefix row, or a "
                         "damaged one), so repack cannot repack it as a flat sequence; run packprep verify on the folder")


STORED_COLUMNS = ("records", "lengths", "unit", "first", "within", "turns_cut", "supervised_cut")


def read_lengths(shards: StoredShards, task: tuple[int, int, int, int]) -> dict[str, np.ndarray]:
    """Pass 1, one task's row groups: each stored sequence's record, length, unit, first token within
    its unit's row group and, where longer than ``shards.max_len``, its supervised tokens within it
    (position 0 not counted; 1 elsewhere) and the turns and supervised tokens the cut costs it (plan.cut_cost)."""
    shard, first, end, unit = task
    reader, found = shards.reader(shard), {name: [] for name in STORED_COLUMNS}
    tables = reader.tables(["seq_lens", "source_index"], threads=False, groups=range(first, end))
    for number, table in enumerate(tables):
        lengths = list_column(table, "seq_lens")[0].astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        within = np.ones(len(lengths), np.int32)
        cut = np.zeros((2, len(lengths)), np.int64)
        over = np.flatnonzero(lengths > shards.max_len) if shards.max_len is not None else []
        if len(over):  # the labels of this row group, for the sequences truncation cuts
            group = first + number
            labels = list_column(next(reader.tables(["labels"], threads=False, groups=[group])), "labels")[0]
            for item in over.tolist():
                start = int(starts[item])
                within[item] = int((labels[start + 1 : start + shards.max_len] != IGNORE_INDEX).sum())
                cut[:, item] = cut_cost(labels[start : start + lengths[item]], shards.max_len, shards.pieces)
        found["records"].append(list_column(table, "source_index")[0].astype(np.int64))
        found["lengths"].append(lengths)
        found["unit"].append(np.full(len(lengths), unit + number, np.int64))
        found["first"].append(starts)
        found["within"].append(within)
        found["turns_cut"].append(cut[0])
        found["supervised_cut"].append(cut[1])
    return {name: np.concatenate(parts) if parts else np.zeros(0, np.int64) for name, parts in found.items()}


@dataclass
class Stored:
    """The folder's sequences, one entry an input record (ascending): where its first copy is (a unit,
    see :class:`StoredShards`, and its first token in that row group), its length, its supervised
    tokens within the new ``--max-len`` where longer (:func:`read_lengths`), its copies in train and
    whether it is held out."""

    records: np.ndarray  # int64, ascending
    lengths: np.ndarray  # int64
    unit: np.ndarray  # int64
    first_token: np.ndarray  # int64, within the unit's row group
    within: np.ndarray  # int32
    copies: np.ndarray  # int64
    held: np.ndarray  # bool
    cut: np.ndarray  # int64 (2, records): turns and supervised tokens cutting it to the new max_len costs

    @classmethod
    def join(cls, shards: StoredShards, found) -> "Stored":
        """The records of pass 1's results (``found``, in task order: the shards' order)."""
        found = list(found)
        flat = {name: np.concatenate([f[name] for f in found]) if found else np.zeros(0, np.int64)
                for name in STORED_COLUMNS}
        in_train = flat["unit"] < shards.units(shards.train)
        records, first = np.unique(flat["records"], return_index=True)
        copies = np.bincount(np.searchsorted(records, flat["records"][in_train]), minlength=len(records))
        held = np.isin(records, flat["records"][~in_train])
        return cls(records, flat["lengths"][first], flat["unit"][first], flat["first"][first],
                   flat["within"][first], copies, held, np.stack([flat["turns_cut"][first], flat["supervised_cut"][first]]))

    def fates(self, config) -> np.ndarray:
        """What ``--overlong`` does to each stored sequence at the new ``max_len`` (plan.overlong_fates)."""
        return overlong_fates(self.lengths, config.max_len, config.overlong,
                              self.within if config.overlong == "truncate" else None)


def kept(fates: np.ndarray) -> np.ndarray:
    """The records that stay sequences: not dropped, not emptied by truncation."""
    return (fates != DROPPED) & (fates != EMPTIED)


@dataclass
class Placement:
    """Where pass 2 writes the kept records' tokens: the token store's files under ``cache`` (created
    at their full size by :func:`place`); for each kept record, in (unit, first token) order, the
    order the shards hold them: its unit, its first token there, its length (cut to the new
    ``--max-len`` where truncated), and its part of the store and first token in that part's files
    (input order, as ``pack`` spills them)."""

    shards: StoredShards
    cache: Path
    unit: np.ndarray  # int64, ascending
    first: np.ndarray  # int64
    length: np.ndarray  # int64
    part: np.ndarray  # int64
    at: np.ndarray  # int64

    def tasks(self, runs: int) -> list[tuple[int, int, int, int]]:
        """Pass 2's tasks: runs of row groups, each holding a record placed here."""
        return self.shards.tasks(runs, self.unit)


def place(cache: Path, shards: StoredShards, stored: Stored, fates: np.ndarray, max_len: int, records: int,
          parts: int) -> tuple[Placement, TokenStore]:
    """The kept records' places, and the token store of ``records`` input records they make: the
    records in input order, cut into about ``parts`` parts of about equal tokens, each part's two
    files created at their full size (pass 2 fills them). Parts, as ``pack``'s encode workers spill
    them: the workers of pass 2 write into many files, not all into one (a file takes one write at
    a time)."""
    items = np.flatnonzero(kept(fates))
    lengths = np.where(fates[items] == TRUNCATED, max_len, stored.lengths[items])
    at = np.zeros(len(items), np.int64)
    np.cumsum(lengths[:-1], out=at[1:])
    part = np.unique(at * parts // max(1, int(lengths.sum())), return_inverse=True)[1].astype(np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(part)) + 1]).astype(np.int64)
    spills = []
    for number, (lo, hi) in enumerate(zip(starts.tolist(), [*starts[1:].tolist(), len(items)])):
        for column in TOKEN_COLUMNS:
            with open(spill_path(cache, number, column), "wb") as handle:
                handle.truncate(int(lengths[lo:hi].sum()) * 4)
        spills.append(Spilled(lengths[lo:hi].astype(np.int32)))
    absent = np.setdiff1d(np.arange(records, dtype=np.int64), stored.records[items])
    store = TokenStore.from_spills(cache, spills, absent)
    at -= at[starts][part]
    order = np.lexsort((stored.first_token[items], stored.unit[items]))
    placement = Placement(shards, cache, stored.unit[items[order]], stored.first_token[items[order]],
                          lengths[order], part[order], at[order])
    return placement, store


def write_tokens(placement: Placement, task: tuple[int, int, int, int]) -> int:
    """Pass 2, one task's row groups: the tokens and labels of the records placed there, each written
    at its place in its part's token files; returns the tokens written."""
    shard, first, end, unit = task
    task_lo, task_hi = np.searchsorted(placement.unit, [unit, unit + end - first])
    groups = (np.unique(placement.unit[task_lo:task_hi]) - unit + first).tolist()
    files: dict[tuple[int, str], int] = {}
    try:
        tables = placement.shards.reader(shard).tables(["input_ids", "labels", "position_ids"], threads=False,
                                                       groups=groups)
        for group, table in zip(groups, tables):
            *columns, positions = [np.ascontiguousarray(list_column(table, name)[0], np.int32)
                                   for name in ("input_ids", "labels", "position_ids")]
            lo, hi = np.searchsorted(placement.unit, [unit + group - first, unit + group - first + 1])
            places = (placement.first, placement.length, placement.part, placement.at)
            records = zip(*(a[lo:hi].tolist() for a in places))
            for start, length, part, at in records:
                flat_positions(placement.shards.folder / placement.shards.paths[shard], positions, start, length)
                for column, values in zip(TOKEN_COLUMNS, columns):
                    if (part, column) not in files:
                        files[part, column] = os.open(spill_path(placement.cache, part, column), os.O_WRONLY)
                    if os.pwrite(files[part, column], values[start : start + length], at * 4) != length * 4:
                        raise OSError(f"short write to the token cache {spill_path(placement.cache, part, column)}")
    finally:
        for fd in files.values():
            os.close(fd)
    return int(placement.length[task_lo:task_hi].sum())


def folder_mixture(manifest: dict) -> Mixture | None:
    """The folder's mixture, as its manifest records it (its selection is read from the shards)."""
    table = manifest.get("mixture")
    if not table:
        return None
    sources = [MixSource(s["path"], s["name"], s.get("weight"), s.get("share")) for s in table["sources"]]
    groups = [0] * len(manifest["inputs"])
    for number, source in enumerate(table["sources"]):
        for file in source["inputs"]:
            groups[file] = number
    return Mixture(sources, groups, (manifest.get("validation") or {}).get("size"),
                   accepted=[s["sequences"] for s in table["sources"]])


def check_cuts(folder: Path, old: dict, config, stored: Stored, mixture: Mixture | None, accept: bool) -> bool:
    """Refuse what would not be ``pack``'s output; return whether sequences cut at the old ``max_len``
    are repacked as stored (``accept``, where some were cut)."""
    counts, before = old["counts"], int(old["config"]["max_len"])
    if counts["split"]:
        raise ConfigError(f"{folder}: {counts['split']:,} records were split into pieces at --max-len {before} "
                          "(the first label of each piece is masked, so the labels at the cuts are not stored); "
                          "repack cannot rebuild them: pack again from the inputs")
    if counts.get("extra_sequences"):  # --turn-context exact: which sequence of a record came first is not stored
        raise ConfigError(f"{folder}: {counts['extra_sequences']:,} sequences train turns of a record in their own "
                          "inference context (--turn-context exact), beside the record's last sequence; the shards do "
                          "not store their order within the record, so repack cannot rebuild pack's output: pack "
                          "again from the inputs")
    dropped = counts["rejected_by_reason"].get("overlong", 0)
    cut = config.max_len > before and (counts["truncated"] or dropped)
    if cut and not accept:
        raise ConfigError(
            f"{folder}: {counts['truncated']:,} sequences were truncated and {dropped:,} records dropped at --max-len "
            f"{before}; their tokens past {before} are not stored, so at --max-len {config.max_len} they cannot be "
            "packed as pack would pack them. Pack again from the inputs, or pass --accept-truncated to repack "
            f"them as stored (cut at {before}; the dropped ones stay rejected)")
    if mixture is not None:
        if mixture.seed_dependent and config.seed != old["config"]["seed"]:
            raise ConfigError(f"{folder}: its mixture or validation split was drawn with --seed {old['config']['seed']}; "
                              "another seed draws other records: pack again from the inputs, or keep the seed")
        longest = int(stored.lengths.max(initial=0))
        cut_now = config.overlong != "split" and longest > config.max_len
        if cut_now and not accept:
            raise ConfigError(f"{folder}: a sequence of {longest:,} tokens would be cut at --max-len {config.max_len}, "
                              "changing the token counts its mixture and validation split were drawn from; pack "
                              "again from the inputs, pass --accept-truncated to keep its records, copies and "
                              "validation split as they are (the shares then hold of the tokens before the cut), "
                              "or choose --max-len of at least that")
        return bool(cut or cut_now)
    return bool(cut)


def rebuild_ledger(tmp: Path, folder: Path, old: dict, config, stored: Stored, fates: np.ndarray) -> Ledger:
    """The ledger ``pack`` would have at ``config.max_len``: each record's fate, the reasons and their first
    examples; rejects.jsonl written with the folder's entries and the records dropped here."""
    entries = _rejects(folder, old, config, stored, fates)
    ledger = Ledger(config.on_error)
    ledger.status = _status(old, stored, fates, kept(fates), config, entries)
    ledger.reasons = Counter(entry["code"] for entry in entries)
    for entry in entries:  # in input order, as pack meets them: each reason's first example
        entry["reason"] = spell(entry["reason"])  # the ones written here, in the caller's terms
        ledger.examples.setdefault(entry["code"], entry)
    ledger.changes = Counter(old["counts"].get("normalized") or {})
    ledger.turns_not_located = old["counts"].get("turns_not_located", 0)
    pieces = config.overlong == "split" and not STRATEGY_TABLE[config.strategy].rows_may_exceed_max_len
    cut = (fates == TRUNCATED) | (fates == EMPTIED) | ((fates == PACKED) & pieces)  # what this max_len cuts
    ledger.cut = Counter({name: old["counts"].get(name, 0) + int(stored.cut[n][cut].sum())
                          for n, name in enumerate(CUT_COUNTS)})
    if entries:
        with open(tmp / "rejects.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries)
    return ledger


def _status(old: dict, stored: Stored, fates: np.ndarray, keep: np.ndarray, config, rejects: list[dict]) -> bytearray:
    """Each input record's fate, as ``pack`` at the new ``max_len`` records it."""
    records, before = old["counts"]["records"], int(old["config"]["max_len"])
    status = np.full(records, UNSAMPLED if old["counts"].get("unsampled") else REJECTED, np.uint8)
    status[stored.records] = PACKED
    status[stored.records[~keep]] = REJECTED
    if config.max_len >= before:  # which were truncated is not stored, only how many: the first that long
        longest = np.flatnonzero(stored.lengths == before)[: old["counts"]["truncated"]]
        status[stored.records[longest]] = TRUNCATED
    elif config.overlong == "truncate":  # every one cut at the old length is cut at this one too
        status[stored.records[fates == TRUNCATED]] = TRUNCATED
    status[[entry["source_index"] for entry in rejects]] = REJECTED
    return bytearray(status.tobytes())


def _rejects(folder: Path, old: dict, config, stored: Stored, fates: np.ndarray) -> list[dict]:
    """rejects.jsonl's entries at the new ``max_len``, in input order: the folder's (an ``overlong`` one
    naming the new length), and the records dropped here (with no copy of the record: repack has none)."""
    path = folder / "rejects.jsonl"
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    before, after = int(old["config"]["max_len"]), config.max_len
    if after < before:
        for entry in entries:  # written by a CLI or a Python caller (ledger.py)
            if entry["code"] == "overlong":
                entry["reason"] = re.sub(rf"(--max-len|max_len) {before}\b", rf"\g<1> {after}", entry["reason"])
    starts = np.concatenate([[0], np.cumsum([i["records"] for i in old["inputs"]])])
    for item in np.flatnonzero((fates == DROPPED) | (fates == EMPTIED)).tolist():
        record, n = int(stored.records[item]), int(stored.lengths[item])
        source = int(np.searchsorted(starts, record, side="right") - 1)
        reason = (f"{n} tokens, longer than --max-len {after} (--overlong drop)" if fates[item] == DROPPED else
                  f"{n} tokens; no supervised token is left after truncation to --max-len {after}")
        entries.append({"file": old["inputs"][source]["path"], "index": record - int(starts[source]), "line": None,
                        "source_index": record, "reason": reason, "code": "overlong", "record": None})
    return sorted(entries, key=lambda entry: entry["source_index"])
