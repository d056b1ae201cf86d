"""The whole job, as one library call: read → normalize → tokenize → pack → materialize → write.

``packprep.pack(...)`` is what the CLI runs and what a notebook calls. It returns the manifest
(the dict written to ``packprep.json``).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import partial

import numpy as np

from . import __version__, plan
from .card import length_histograms, render_card
from .encode import FATES, PACKED, REJECTED, SPLIT, TRUNCATED, Encoding, Ledger, top_reasons
from .engines import Engine, make_engine
from .errors import ConfigError, InputError, check_range
from .layout import DEFAULT_LAYOUT, get_layout
from .materialize import Segments, TokenSpill, TokenStore
from .control_text import MODES as CONTENT_SPECIAL
from .normalize import CHANGES, CONSECUTIVE, FORMATS, LEADING, SYSTEM, Rejected
from .packing import ROW_ORDERS, STRATEGY_TABLE, Bins, lower_bound, order_bins
from .plan import check_overlong, check_strategy, overlong_fates, plan_bins
from .progress import Progress
from .read import Part, Source, file_sha256, resolve_inputs
from .tokenize import BACKENDS, IGNORE_INDEX, TRAIN_ON, tokenizer_fingerprint
from .verify import ShardContext, verify
from .write import SHARD_FORMATS, OutputFolder, parse_size, write_shards

ON_ERROR = ("skip", "fail")


# the allowed range of each number setting: checked before any work, the message names it
PREFERENCE = ("refuse", "chosen")
RANGES = {
    "max_len": (2, 2**31 - 1),  # rows and their positions are int32
    "seed": (0, 2**32 - 1),  # numpy's seeds
    "samples_per_row": (1, 2**31 - 1),
    "partition_size": (1, 2**62),
    "render_timeout": (0.001, 86_400),
}


@dataclass
class PackConfig:
    """Every setting that shapes the output; recorded in full in the manifest."""

    max_len: int = 4096
    strategy: str = "greedy"
    seed: int = 0
    train_on: str = "assistant"
    format: str | None = None  # None: detected per record
    messages_field: str | None = None
    text_field: str = "text"
    overlong: str = "truncate"
    row_order: str = "shuffle"
    samples_per_row: int | None = None
    shard_format: str = "parquet"
    shard_size: str = "500MB"
    on_error: str = "skip"
    tokenizer_backend: str = "auto"  # auto | hf | tiktoken; the output is the same with each
    partition_size: int | None = None  # pack each run of this many sequences on its own; None: globally
    leading_assistant: str = "drop"  # turns before the first user turn: drop | reject (normalize.py)
    consecutive: str = "merge"  # two user or two assistant turns in a row: merge | keep | reject
    system: str = "auto"  # auto: fold into the first user turn where the template renders no system message
    render_timeout: float = 60.0  # seconds one record's rendering may take; a record over it is rejected
    preference: str = "refuse"  # preference data (chosen/rejected): refuse | chosen (train on the chosen reply)
    content_special_tokens: str = "text"  # text in records that spells a control token: text | special (control_text.py)

    @classmethod
    def from_settings(cls, settings: dict, command: str = "pack") -> "PackConfig":
        """The validated config of these settings; an unknown one is a ConfigError naming the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting(s) for {command}: {', '.join(unknown)} (known: {', '.join(known)})")
        config = cls(**settings)
        config.validate()
        return config

    def validate(self) -> None:
        check_strategy(self.strategy, self.samples_per_row)
        check_overlong(self.overlong)
        choices = {
            "train_on": TRAIN_ON,
            "row_order": ROW_ORDERS,
            "shard_format": SHARD_FORMATS,
            "on_error": ON_ERROR,
            "tokenizer_backend": BACKENDS,
            "leading_assistant": LEADING,
            "consecutive": CONSECUTIVE,
            "system": SYSTEM,
            "content_special_tokens": CONTENT_SPECIAL,
            "preference": PREFERENCE,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}")
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(FORMATS)}")
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if value is not None:
                check_range(f"--{name.replace('_', '-')}", value, low, high)
        parse_size(self.shard_size)


def pack(
    inputs: str | list[str],
    output: str,
    tokenizer: str,
    *,
    overwrite: bool = False,
    num_proc: int | None = None,
    progress: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
    layout: str = DEFAULT_LAYOUT,
    **settings,
) -> dict:
    """Pack conversations from ``inputs`` into shards at ``output``; return the manifest.

    ``settings`` are the fields of :class:`PackConfig` (``max_len``, ``strategy``, ``seed``, ...).
    ``layout``: the training stack the shards are laid out for (``packprep.layout``); rows are
    packed and verified in the canonical layout, then exported to it.
    Output is identical for any ``num_proc`` (default: all cores). ``engine="ray"`` runs the
    stages on a Ray cluster (``ray_address``, or a local instance; inputs and ``output`` on a file
    system every node sees) and gives the same bytes as ``"local"``.
    """
    config = PackConfig.from_settings(settings)
    layout = get_layout(layout)
    sources = resolve_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    folder = OutputFolder(output, overwrite)
    folder.check()
    runner = make_engine(engine, num_proc, ray_address)
    try:
        encoding = Encoding.open(sources, tokenizer, config)
        return _pack_into(folder, encoding, config, layout, runner, progress)
    finally:
        runner.close()


def _pack_into(folder: OutputFolder, encoding: Encoding, config: PackConfig, layout, engine: Engine,
               progress: bool) -> dict:
    with folder.staging() as tmp, ThreadPoolExecutor(1) as background:
        # the inputs' sha256 for the manifest, read beside the workers instead of after them
        hashes = background.submit(lambda: [file_sha256(s.path) if os.path.isfile(s.path) else None
                                        for s in encoding.sources])
        if layout.name != DEFAULT_LAYOUT:  # canonical rows first, verified, then exported into tmp
            tmp = tmp / ".canonical"
            (tmp / "data").mkdir(parents=True)
        ledger = Ledger(config.on_error, tmp / "rejects.jsonl")
        cache = tmp / "token-cache"  # tokens spill to disk, a file pair a part: memory does not grow with the data
        cache.mkdir()
        with ledger, Progress(progress, None, "read+tokenize", "conv") as bar:
            spills = []
            sink = partial(PackSink, cache, config.max_len, config.overlong)
            for result in encoding.run(engine, ledger, sink):
                spills.append(result.payload)
                bar.update(result.records, result.tokens)
            store = TokenStore.from_spills(cache, spills, _rejected(ledger))
            del spills
        if len(store) == 0:
            raise InputError(_nothing_to_pack(ledger, encoding.sources))
        with Progress(progress, len(store), "pack", "seq") as bar:
            segments = _segments(_pack(store, config, ledger), store)
            bar.update(len(store))
        with Progress(progress, segments.offsets.size - 1, "write", "rows") as bar:
            check = ShardContext(tmp, DEFAULT_LAYOUT, config.max_len,
                                 STRATEGY_TABLE[config.strategy].rows_may_exceed_max_len, False, len(ledger.status))
            # the token cache is removed beside the shards' joins and checks, once no piece needs it
            removal, cache_dir = [], store.cache_dir
            shards, checked = write_shards(
                tmp, store, segments, config.max_len, config.shard_format, parse_size(config.shard_size), bar,
                engine, check, lambda: removal.append(background.submit(shutil.rmtree, cache_dir)),
            )
        removal[0].result()
        sequences = len(store)
        del store  # the manifest and verify hold arrays of their own: free these first
        manifest = _manifest(config, encoding, ledger, sequences, segments, shards, hashes.result())
        del segments
        manifest["layout"] = DEFAULT_LAYOUT
        (tmp / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(render_card(manifest))
        report = verify(tmp, check_hashes=False, engine=engine, checked=checked)
        if not report.ok:  # a packprep bug, never a data problem: refuse to publish it
            raise RuntimeError(f"packed output failed verification: {report.failures[:3]}")
        if layout.name != DEFAULT_LAYOUT:
            from .export import export_into

            manifest = export_into(tmp, manifest, tmp.parent, layout)
            shutil.rmtree(tmp)
        folder.commit()
    return manifest


def _nothing_to_pack(ledger: Ledger, sources: list[Source]) -> str:
    """The message for a run in which no record survived: nothing is written."""
    where = ", ".join(source.path for source in sources[:3]) + (", ..." if len(sources) > 3 else "")
    if not ledger.status:
        return f"{where}: the inputs hold no records; nothing was written"
    reasons = "; ".join(top_reasons(ledger.reasons, ledger.examples))
    return (
        f"{where}: all {len(ledger.status):,} records were rejected ({reasons}); nothing was written. "
        "Check --format, --messages-field and the tokenizer's chat template"
    )


class PackSink:
    """pack's encode sink, run in the workers: apply the ``--overlong`` rule to each encoded record,
    in input order, and spill what stays to the part's token files."""

    def __init__(self, cache_dir, max_len: int, overlong: str, part: Part):
        self.max_len, self.overlong = max_len, overlong
        self.spill = TokenSpill(cache_dir, part.number)

    def take(self, batch, ledger: Ledger) -> int:
        max_len = self.max_len
        lengths = np.array([0 if isinstance(item, Rejected) else len(item.input_ids) for *_, item in batch], np.int64)
        within = None
        if self.overlong == "truncate" and (lengths > max_len).any():
            within = [int((item.labels[1:max_len] != IGNORE_INDEX).sum()) if n > max_len else 1
                      for (*_, item), n in zip(batch, lengths.tolist())]
        tokens = 0
        for (number, record, conversation, item), fate in zip(batch, overlong_fates(lengths, max_len, self.overlong,
                                                                                      within)):
            item = ledger.accept(record, number, item)
            if item is None:
                continue
            ids, labels = item.input_ids, item.labels
            if fate == plan.DROPPED:
                reason = f"{len(ids)} tokens, longer than --max-len {max_len} (--overlong drop)"
                ledger.reject(record, number, reason, "overlong")
                continue
            if fate == plan.EMPTIED:
                reason = f"{len(ids)} tokens; no supervised token is left after truncation to --max-len {max_len}"
                ledger.reject(record, number, reason, "overlong")
                continue
            if fate == plan.TRUNCATED:
                ids, labels = ids[:max_len], labels[:max_len]
                ledger.status[number] = TRUNCATED
            ledger.keep(conversation, item)
            self.spill.append(ids, labels)
            tokens += len(ids)
        return tokens

    def finish(self):
        return self.spill.finish()


def _rejected(ledger: Ledger) -> np.ndarray:
    """The numbers of the records that are not sequences (every other record is one, in order)."""
    return np.flatnonzero(np.frombuffer(ledger.status, dtype=np.uint8) == REJECTED)


def _pack(store: TokenStore, config: PackConfig, ledger: Ledger) -> Bins:
    lengths = store.lengths
    bins = plan_bins(lengths, config.max_len, config.strategy, seed=config.seed, samples_per_row=config.samples_per_row,
                     overlong=config.overlong, partition_size=config.partition_size)
    if bins.lengths is not None:  # pieces exist: mark the records that were cut
        cut = bins.lengths < lengths[bins.items]
        for source_index in np.unique(store.source_index(bins.items[cut])).tolist():
            if ledger.status[source_index] == PACKED:  # a truncated record that is also cut stays truncated
                ledger.status[source_index] = SPLIT
    del lengths  # the planner's arrays are the driver's peak: free what is done before the next
    return order_bins(bins, config.row_order, config.seed)


def _segments(bins: Bins, store: TokenStore) -> Segments:
    """The pieces of the ordered bins; a whole sequence's length is its length in the store."""
    lengths = bins.lengths if bins.lengths is not None else store.lengths[bins.items]
    return Segments(bins.items, bins.starts, lengths, bins.offsets)


def _manifest(config, encoding: Encoding, ledger, sequences: int, segments, shards, hashes: list) -> dict:
    status = np.bincount(np.frombuffer(ledger.status, dtype=np.uint8), minlength=len(FATES))
    fates = {fate: int(status[code]) for code, fate in enumerate(FATES)}
    row_lengths = segments.row_lengths()
    tokens = int(row_lengths.sum())
    rows = int(len(row_lengths))
    supervised = sum(shard["supervised_tokens"] for shard in shards)
    bound = lower_bound(row_lengths, config.max_len) if tokens else 0
    return {
        "packprep_version": __version__,
        "config": asdict(config),
        "inputs": [
            {"path": s.path, "named": s.named or s.path, "name": os.path.basename(s.path.rstrip("/\\")) or s.path,
             "kind": s.kind, "format": ledger.formats_seen(number, f), "records": s.records,
             "bytes": os.path.getsize(s.path) if os.path.isfile(s.path) else None,
             "sha256": sha256}
            for number, (s, f, sha256) in enumerate(zip(encoding.sources, encoding.formats, hashes))
        ],
        "tokenizer": {**tokenizer_fingerprint(encoding.tokenizer, encoding.tokenizer_name),
                      "backend": encoding.encoder.backends_summary, "rendering": encoding.encoder.template.name},
        "counts": {
            "records": len(ledger.status),
            **fates,
            "rejected_by_reason": dict(sorted(ledger.reasons.items())),
            "top_rejections": top_reasons(ledger.reasons, ledger.examples, names_only=True),
            "turns_not_located": ledger.turns_not_located,
            "normalized": {name: ledger.changes.get(name, 0) for name in CHANGES},
        },
        "tokens": {"total": tokens, "supervised": supervised},
        "rows": rows,
        "sequences": int(len(segments.item)),
        "max_row_len": int(row_lengths.max()) if rows else 0,
        "rows_may_exceed_max_len": STRATEGY_TABLE[config.strategy].rows_may_exceed_max_len,
        "efficiency": round(tokens / (rows * config.max_len), 6) if rows else 0.0,
        "lower_bound_rows": int(bound),
        "partitions": -(-sequences // config.partition_size) if config.partition_size and sequences else 1,
        "length_histograms": length_histograms(row_lengths, segments.length, config.max_len),
        "shards": shards,
    }


