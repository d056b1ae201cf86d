"""``packprep repack DIR -o OUT``: pack the sequences a packed folder stores again, with another
``--max-len``, strategy, seed, row order or layout; no tokenizer, no input files.

The folder's rows are read back into the token store ``pack`` would have made (each input record's
sequence once, in input order: pass 1 reads ``seq_lens`` and ``source_index`` only, pass 2 writes
each record's tokens into place, a row group at a time), its ledger is rebuilt from the manifest and
``rejects.jsonl``, and both go through ``pack``'s own last step (``pipeline.write_output``): so the
output is byte for byte what ``pack`` writes with those settings, wherever no sequence was cut.
What was cut is not stored: a sequence truncated, or a record dropped, at the old ``--max-len`` is
refused at a longer one (``accept_truncated`` packs them as stored, and says so), and pieces of
split sequences (whose first labels were masked) are refused. A mixture's selection (which records,
how many copies, which are held out) is read from the folder, as ``pack`` chose it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .encode import PACKED, REJECTED, TRUNCATED
from .ledger import Ledger
from .engines import make_engine
from .errors import ConfigError
from .layout import DEFAULT_LAYOUT, ShardReader, get_layout, list_column, readable_layout
from .materialize import Spilled, TokenStore, spill_path
from .mix import UNSAMPLED, MixSource, Mixture, Selection
from .plan import DROPPED, EMPTIED, TRUNCATED as CUT, overlong_fates
from .tokenization import IGNORE_INDEX
from .write import OutputFolder

REPACK_SETTINGS = ("max_len", "strategy", "seed", "row_order", "samples_per_row")


def repack(folder: str | os.PathLike, output: str | os.PathLike, *, overwrite: bool = False,
           num_proc: int | None = None, progress: bool = False, layout: str | None = None,
           accept_truncated: bool = False, **settings) -> dict:
    """Pack the sequences stored in ``folder`` into ``output`` with ``settings`` changed (``max_len``,
    ``strategy``, ``seed``, ``row_order``, ``samples_per_row``; None keeps the folder's); return the
    new manifest. ``layout``: None keeps the folder's. ``accept_truncated``: pack sequences cut at the old
    ``max_len`` as they are stored."""
    from .pipeline import PackConfig, write_output
    from .verification import read_manifest

    source = Path(folder).absolute()
    old = read_manifest(source)
    readable_layout(old.get("layout"), where=f"{source}: ")
    unknown = sorted(set(settings) - set(REPACK_SETTINGS))
    if unknown:
        raise ConfigError(f"repack cannot change {', '.join(unknown)} (only {', '.join(REPACK_SETTINGS)}): "
                          "pack again from the inputs")
    config = PackConfig.from_settings({**old["config"], **{k: v for k, v in settings.items() if v is not None}},
                                      "repack")
    layout = get_layout(layout or old.get("layout") or DEFAULT_LAYOUT)
    target = OutputFolder(output, overwrite)
    if target.final == source or source in target.final.parents:
        raise ConfigError(f"{output} is {folder} or inside it; choose another output folder")
    target.check()
    stored = Stored.read(source, old)
    mixture = _mixture(old)
    accepted = _check_cuts(source, old, config, stored, mixture, accept_truncated)
    engine = make_engine("local", num_proc)
    try:
        with target.staging() as tmp, ThreadPoolExecutor(1) as background:
            store, ledger = _rebuild(tmp, source, old, config, stored)
            if mixture is not None:
                mixture.selection = Selection.from_copies(stored.copies, stored.held)
            described = {"inputs": old["inputs"], "tokenizer": old["tokenizer"]}
            # cut sequences taken as stored are no longer what pack would write: the manifest says so
            said = {"repacked_from": {"path": str(source), "max_len": old["config"]["max_len"],
                                      "truncated_as_stored": old["counts"]["truncated"],
                                      "dropped_as_stored": old["counts"]["rejected_by_reason"].get("overlong", 0)}}
            manifest = write_output(tmp, store, ledger, config, engine, progress, background, lambda: described,
                                    mixture, said if accepted else None, layout)
            target.commit()
            return manifest
    finally:
        engine.close()


@dataclass
class Stored:
    """The folder's sequences, one entry an input record (ascending): where its first copy is (shard
    and first token, over the folder's shards in manifest order, train then validation), its length,
    its copies in train and whether it is held out."""

    records: np.ndarray  # int64, ascending
    lengths: np.ndarray  # int64
    shard: np.ndarray  # int64
    first_token: np.ndarray  # int64, within the shard
    copies: np.ndarray  # int64
    held: np.ndarray  # bool
    shards: list[str]

    @classmethod
    def read(cls, folder: Path, manifest: dict) -> "Stored":
        """Pass 1: ``seq_lens`` and ``source_index`` of every shard, a row group at a time."""
        validation = (manifest.get("validation") or {}).get("shards", [])
        shards = [s["path"] for s in manifest["shards"]] + [s["path"] for s in validation]
        columns = {name: [] for name in ("records", "lengths", "shard", "first_token")}
        for number, name in enumerate(shards):
            at = 0
            for table in ShardReader(folder / name, manifest.get("layout")).tables(["seq_lens", "source_index"]):
                lengths = list_column(table, "seq_lens")[0].astype(np.int64)
                columns["records"].append(list_column(table, "source_index")[0].astype(np.int64))
                columns["lengths"].append(lengths)
                columns["shard"].append(np.full(len(lengths), number, np.int64))
                columns["first_token"].append(at + np.cumsum(lengths) - lengths)
                at += int(lengths.sum())
        flat = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in columns.items()}
        in_train = np.isin(flat["shard"], np.arange(len(manifest["shards"])))
        records, first = np.unique(flat["records"], return_index=True)
        copies = np.bincount(np.searchsorted(records, flat["records"][in_train]), minlength=len(records))
        held = np.isin(records, flat["records"][~in_train])
        return cls(records, flat["lengths"][first], flat["shard"][first], flat["first_token"][first], copies, held,
                   shards)


def _mixture(manifest: dict) -> Mixture | None:
    """The folder's mixture, as its manifest records it (its selection is read from the shards)."""
    table = manifest.get("mixture")
    if not table:
        return None
    sources = [MixSource(s["path"], s["name"], s.get("weight"), s.get("share")) for s in table["sources"]]
    groups = [0] * len(manifest["inputs"])
    for number, source in enumerate(table["sources"]):
        for file in source["inputs"]:
            groups[file] = number
    return Mixture(sources, groups, (manifest.get("validation") or {}).get("size"))


def _check_cuts(folder: Path, old: dict, config, stored: Stored, mixture: Mixture | None, accept: bool) -> bool:
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
        if config.overlong != "split" and longest > config.max_len:
            raise ConfigError(f"{folder}: a sequence of {longest:,} tokens would be cut at --max-len {config.max_len}, "
                              "changing the token counts its mixture and validation split were drawn from; pack "
                              "again from the inputs, or choose --max-len of at least that")
    return bool(cut)


def _rebuild(tmp: Path, folder: Path, old: dict, config, stored: Stored) -> tuple[TokenStore, Ledger]:
    """The token store and ledger ``pack`` would have at ``config.max_len``: the stored sequences (pass 2),
    under its ``--overlong`` rule; rejects.jsonl with the records it drops."""
    cache = tmp / "token-cache"
    cache.mkdir()
    offsets = np.concatenate([[0], np.cumsum(stored.lengths)]).astype(np.int64)
    _write_tokens(folder, old, stored, offsets, cache)
    full = TokenStore(offsets, np.zeros(0, np.int64), cache, np.array([0, offsets[-1]], np.int64),
                      np.zeros(0, np.int64))  # one sequence a record: _check_cuts refuses more
    fates = _fates(full, stored.lengths, config)
    keep = (fates != DROPPED) & (fates != EMPTIED)
    lengths = np.where(fates == CUT, config.max_len, stored.lengths)
    if (fates != 0).any():  # some are cut or dropped here: write the kept tokens anew
        _compact(full, np.flatnonzero(keep), lengths, cache)
    entries = _rejects(folder, old, config, stored, fates)
    status = _status(old, stored, fates, keep, config, entries)
    absent = np.setdiff1d(np.arange(len(status), dtype=np.int64), stored.records[keep])
    store = TokenStore.from_spills(cache, [Spilled(lengths[keep].astype(np.int32))], absent)
    ledger = Ledger(config.on_error)
    ledger.status = status
    ledger.reasons = Counter(entry["code"] for entry in entries)
    for entry in entries:  # in input order, as pack meets them: each reason's first example
        ledger.examples.setdefault(entry["code"], entry)
    ledger.changes = Counter(old["counts"].get("normalized") or {})
    ledger.turns_not_located = old["counts"].get("turns_not_located", 0)
    if entries:
        with open(tmp / "rejects.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries)
    return store, ledger


def _write_tokens(folder: Path, old: dict, stored: Stored, offsets: np.ndarray, cache: Path) -> None:
    """Pass 2: each record's tokens and labels, from the row group that holds its first copy, written at
    its place in input order (``offsets``), a row group at a time through a map of the token files that
    is dropped after each (its written pages are the page cache's, not this process's)."""
    order = np.lexsort((stored.first_token, stored.shard))
    shard_of, first_of = stored.shard[order], stored.first_token[order]
    paths = [spill_path(cache, 0, column) for column in ("ids", "labels")]
    for path in paths:
        with open(path, "wb") as handle:
            handle.truncate(int(offsets[-1]) * 4)
    for number, name in enumerate(stored.shards):
        base = 0
        for table in ShardReader(folder / name, old.get("layout")).tables(["input_ids", "labels"]):
            columns = [list_column(table, column)[0] for column in ("input_ids", "labels")]
            lo, hi = np.searchsorted(shard_of, [number, number + 1])
            lo, hi = lo + np.searchsorted(first_of[lo:hi], [base, base + len(columns[0])])
            here = order[lo:hi]
            lengths = stored.lengths[here]
            within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            source = np.repeat(stored.first_token[here] - base, lengths) + within
            target = np.repeat(offsets[here], lengths) + within
            for path, values in zip(paths, columns):
                if len(target):
                    np.memmap(path, np.int32, "r+", shape=(int(offsets[-1]),))[target] = values[source]
            base += len(columns[0])


def _fates(store: TokenStore, lengths: np.ndarray, config) -> np.ndarray:
    """What ``--overlong`` does to each stored sequence at the new ``max_len`` (plan.overlong_fates)."""
    over = np.flatnonzero(lengths > config.max_len)
    if not len(over) or config.overlong == "split":
        return np.zeros(len(lengths), np.int8)
    within = np.ones(len(lengths), np.int64)
    if config.overlong == "truncate":
        for item in over.tolist():  # supervised tokens within the first max_len, position 0 not counted
            labels = store.gather(store.offsets[item : item + 1], np.array([config.max_len]))[1]
            within[item] = int((labels[1:] != IGNORE_INDEX).sum())
    return overlong_fates(lengths, config.max_len, config.overlong, within)


def _compact(store: TokenStore, keep: np.ndarray, lengths: np.ndarray, cache: Path, block: int = 4096) -> None:
    """Rewrite the token files with only the kept sequences, each at its new (cut) length."""
    columns = ("ids", "labels")
    new = [Path(f"{spill_path(cache, 0, column)}.new") for column in columns]
    with open(new[0], "wb") as ids_out, open(new[1], "wb") as labels_out:
        for lo in range(0, len(keep), block):
            items = keep[lo : lo + block]
            ids, labels = store.gather(store.offsets[items], lengths[items])
            ids_out.write(ids.tobytes())
            labels_out.write(labels.tobytes())
    for column, path in zip(columns, new):
        os.replace(path, spill_path(cache, 0, column))


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
        status[stored.records[fates == CUT]] = TRUNCATED
    status[[entry["source_index"] for entry in rejects]] = REJECTED
    return bytearray(status.tobytes())


def _rejects(folder: Path, old: dict, config, stored: Stored, fates: np.ndarray) -> list[dict]:
    """rejects.jsonl's entries at the new ``max_len``, in input order: the folder's (an ``overlong`` one
    naming the new length), and the records dropped here (with no copy of the record: repack has none)."""
    path = folder / "rejects.jsonl"
    entries = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    before, after = int(old["config"]["max_len"]), config.max_len
    if after < before:
        for entry in entries:
            if entry["code"] == "overlong":
                entry["reason"] = entry["reason"].replace(f"--max-len {before}", f"--max-len {after}")
    starts = np.concatenate([[0], np.cumsum([i["records"] for i in old["inputs"]])])
    for item in np.flatnonzero((fates == DROPPED) | (fates == EMPTIED)).tolist():
        record, n = int(stored.records[item]), int(stored.lengths[item])
        source = int(np.searchsorted(starts, record, side="right") - 1)
        reason = (f"{n} tokens, longer than --max-len {after} (--overlong drop)" if fates[item] == DROPPED else
                  f"{n} tokens; no supervised token is left after truncation to --max-len {after}")
        entries.append({"file": old["inputs"][source]["path"], "index": record - int(starts[source]), "line": None,
                        "source_index": record, "reason": reason, "code": "overlong", "record": None})
    return sorted(entries, key=lambda entry: entry["source_index"])
