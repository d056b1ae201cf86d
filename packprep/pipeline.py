"""The whole job, as one library call: read → normalize → tokenize → pack → materialize → write.

``packprep.pack(...)`` is what the CLI runs and what a notebook calls. It returns the manifest
(the dict written to ``packprep.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields
from itertools import islice
from typing import Iterable, Iterator

import multiprocessing
import numpy as np

from . import __version__
from .card import length_histograms, render_card
from .errors import ConfigError, InputError
from .layout import DEFAULT_LAYOUT, get_layout
from .materialize import Segments, TokenStore, TokenStoreBuilder
from .normalize import (CHANGES, CONSECUTIVE, FORMATS, LEADING, SYSTEM, Conversation, FieldNames, Policy, Rejected,
                        detect_format, fit_to_template, normalize)
from .packing import ROW_ORDERS, STRATEGY_TABLE, Bins, lower_bound, order_bins
from .plan import DROPPED, EMPTIED, OVERLONG, TRUNCATED as CUT, check_overlong, check_strategy, overlong_fates, plan_bins
from .read import Record, Source, file_sha256, read_records, resolve_inputs
from .tokenize import BACKENDS, IGNORE_INDEX, TRAIN_ON, ChatEncoder, Encoded, load_tokenizer, tokenizer_fingerprint
from .write import SHARD_FORMATS, OutputFolder, parse_size, write_shards

ENGINES = ("local", "ray")
ON_ERROR = ("skip", "fail")
# What became of each input record (the manifest counts these; verify checks they add up).
FATES = ("packed", "truncated", "split", "rejected")
PACKED, TRUNCATED, SPLIT, REJECTED = range(len(FATES))


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
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}")
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(FORMATS)}")
        if self.max_len < 2:
            raise ConfigError("--max-len must be at least 2")
        parse_size(self.shard_size)
        if self.partition_size is not None and self.partition_size < 1:
            raise ConfigError("--partition-size must be at least 1")


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
    Output is identical for any ``num_proc`` (default: all cores). ``engine="ray"`` tokenizes on a
    Ray cluster (``ray_address``, or a local instance) and gives the same bytes as ``"local"``.
    """
    if engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}")
    config = PackConfig.from_settings(settings)
    layout = get_layout(layout)
    sources = resolve_inputs([inputs] if isinstance(inputs, str) else list(inputs))
    folder = OutputFolder(output, overwrite)
    folder.check()
    tok = load_tokenizer(tokenizer)
    encoder = ChatEncoder(tok, config.train_on, config.tokenizer_backend)
    fields = FieldNames(config.messages_field, config.text_field)
    formats = [_source_format(source, config, fields) for source in sources]
    _check_template(encoder, formats, config.max_len)
    policy = record_policy(encoder, config)
    num_proc = max(1, num_proc or os.cpu_count() or 1)

    with folder.staging() as tmp:
        if layout.name != DEFAULT_LAYOUT:  # canonical rows first, verified, then exported into tmp
            tmp = tmp / ".canonical"
            (tmp / "data").mkdir(parents=True)
        ledger = Ledger(config, tmp / "rejects.jsonl")
        with ledger:
            store = _tokenize_all(
                sources, formats, fields, encoder, tokenizer, config, ledger, num_proc, progress, tmp / "token-cache",
                engine, ray_address, policy,
            )
        if len(store) == 0:
            raise InputError(_nothing_to_pack(ledger, sources))
        with _Progress(progress, len(store), "pack", "seq") as bar:
            bins = _pack(store, config, ledger)
            bar.update(len(store))
        segments = _segments(bins, store)
        with _Progress(progress, segments.offsets.size - 1, "write", "rows") as bar:
            shards = write_shards(
                tmp, store, segments, config.max_len, config.shard_format, parse_size(config.shard_size), bar,
                num_proc,
            )
        shutil.rmtree(store.cache_dir)
        manifest = _manifest(config, sources, formats, tok, tokenizer, ledger, store, segments, shards,
                             encoder.backends_summary)
        manifest["layout"] = DEFAULT_LAYOUT
        (tmp / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(render_card(manifest))
        from .verify import verify

        report = verify(tmp, check_hashes=False)
        if not report.ok:  # a packprep bug, never a data problem: refuse to publish it
            raise RuntimeError(f"packed output failed verification: {report.failures[:3]}")
        if layout.name != DEFAULT_LAYOUT:
            from .export import export_into

            manifest = export_into(tmp, manifest, tmp.parent, layout)
            shutil.rmtree(tmp)
        folder.commit()
    return manifest


class Ledger:
    """Where each record ended up; rejected records are written to rejects.jsonl as they happen."""

    def __init__(self, config: PackConfig, rejects_path=None):
        self.config = config
        self.rejects_path = rejects_path  # None: count only (stats)
        self.status = bytearray()  # the FATES index of each record: one byte a record
        self.reasons: Counter = Counter()
        self.turns_not_located = 0
        self.changes: Counter = Counter()  # what normalize.py's transforms changed in the kept records
        self.formats: dict[int, Counter] = {}  # source number -> records of each format
        self._handle = None

    def __enter__(self):
        if self.rejects_path is not None:
            self._handle = open(self.rejects_path, "w", encoding="utf-8")
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.close()
            if not self.reasons:
                os.remove(self.rejects_path)

    def add(self) -> int:
        """Count a new record (packed until said otherwise); return its source index."""
        self.status.append(PACKED)
        return len(self.status) - 1

    def reject(self, record: Record, source_index: int, reason: str, code: str) -> None:
        if self.config.on_error == "fail":
            where = f"line {record.line}" if record.line else f"record {record.index}"
            raise InputError(f"{record.file}, {where}: {reason} (use --on-error skip to set such records aside)")
        self.status[source_index] = REJECTED
        self.reasons[code] += 1
        entry = {
            "file": record.file,
            "index": record.index,
            "line": record.line,
            "source_index": source_index,
            "reason": reason,
            "code": code,
            "record": _preview(record),
        }
        if self._handle is not None:
            self._handle.write(json.dumps(entry, ensure_ascii=False) + "\n")


def _nothing_to_pack(ledger: Ledger, sources: list[Source]) -> str:
    """The message for a run in which no record survived: nothing is written."""
    where = ", ".join(source.path for source in sources[:3]) + (", ..." if len(sources) > 3 else "")
    if not ledger.status:
        return f"{where}: the inputs hold no records; nothing was written"
    reasons = ", ".join(f"{code} {count:,}" for code, count in ledger.reasons.most_common(3))
    return (
        f"{where}: all {len(ledger.status):,} records were rejected ({reasons}); nothing was written. "
        "Check --format, --messages-field and the tokenizer's chat template, or run packprep stats to see why"
    )


def _preview(record: Record) -> str:
    """The first 200 characters of the record as it was: raw text if it did not decode, else JSON."""
    if record.error is not None:
        return (record.data or "")[:200]
    return json.dumps(record.data, ensure_ascii=False, default=str)[:200]


def _source_format(source: Source, config: PackConfig, fields: FieldNames) -> str:
    """The format of one input: forced by --format, else detected from its first decodable record."""
    if config.format:
        return config.format
    for record in islice(read_records(source), 100):
        if record.data is not None:
            fmt = detect_format(record.data, fields)
            if fmt:
                return fmt
    raise InputError(
        f"{source.path}: cannot tell the record format from its first records; expected "
        "'conversations' (ShareGPT), 'messages' (OpenAI), 'instruction'+'output' (Alpaca) or 'text' "
        "keys. Pass --format, or --messages-field for other column names."
    )


def _check_template(encoder: ChatEncoder, formats: list[str], max_len: int) -> None:
    if any(fmt != "text" for fmt in formats):
        if not encoder.has_template:
            raise ConfigError(
                "the tokenizer has no chat template, so conversations cannot be rendered; use a "
                "tokenizer with one (tokenizer_config.json 'chat_template'), or --format text"
            )
        probe = Conversation(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}])
        encoded = encoder.encode([probe])[0]
        if isinstance(encoded, Encoded) and len(encoded.input_ids) >= max_len:
            raise ConfigError(
                f"--max-len {max_len} is not more than the chat template's own overhead "
                f"({len(encoded.input_ids)} tokens for a one-word exchange); raise --max-len"
            )


def record_policy(encoder: ChatEncoder, config: PackConfig) -> Policy:
    """How records are fitted to training and to this tokenizer's chat template (normalize.py)."""
    if not encoder.has_template:
        return Policy(config.leading_assistant, config.consecutive)
    return fit_to_template(encoder.template.render, config.leading_assistant, config.consecutive, config.system)


def _normalized(sources, formats, fields, ledger, policy: Policy = Policy()) -> Iterator[tuple[int, Record, Conversation | Rejected]]:
    """Yield (source_index, record, conversation), or a Rejected in its place, in input order.

    Without --format the format is told per record (a file may mix ShareGPT and OpenAI records);
    a record that shows none is read as its file's format, so that its reason names what is missing.
    """
    for number, (source, fmt) in enumerate(zip(sources, formats)):
        seen = ledger.formats.setdefault(number, Counter())
        for record in read_records(source):
            source_index = ledger.add()
            if record.error is not None:
                yield source_index, record, Rejected(record.error, "unreadable")
                continue
            own = fmt if ledger.config.format else detect_format(record.data, fields) or fmt
            seen[own] += 1
            try:
                yield source_index, record, normalize(record.data, own, fields, policy)
            except Rejected as exc:
                yield source_index, record, exc


def _batches(iterable: Iterable, size: int) -> Iterator[list]:
    iterator = iter(iterable)
    while batch := list(islice(iterator, size)):
        yield batch


_WORKER_ENCODER: ChatEncoder | None = None  # set before forking: workers inherit the loaded encoder


def _worker_encode(conversations: list[Conversation]) -> tuple[list, str]:
    """Encode a batch in a worker process; also say which backend did (the guard may have switched)."""
    encoded = _WORKER_ENCODER.encode(conversations)
    return encoded, _WORKER_ENCODER.backend_name


def _tokenize_all(
    sources, formats, fields, encoder, tokenizer, config, ledger, num_proc, progress, cache_dir, engine, ray_address,
    policy,
) -> TokenStore:
    """Tokenize every record, spilling tokens to ``cache_dir`` so memory does not grow with the data."""
    builder = TokenStoreBuilder(cache_dir)
    batches = _batches(_normalized(sources, formats, fields, ledger, policy), 256)
    with _Progress(progress, None, "read+tokenize", "conv") as bar:
        results = encoded_batches(batches, encoder, tokenizer, config, num_proc, engine, ray_address)
        _collect(results, builder, config, ledger, bar)
    return builder.build()


def encoded_batches(batches, encoder, tokenizer, config, num_proc=1, engine="local", ray_address=None):
    """Yield ``(batch, encoded)`` in input order, encoded in-process, by worker processes or on Ray.

    Records already rejected while normalizing keep their place, so rejections (and
    ``--on-error fail``) follow input order whatever the engine.
    """
    waiting: deque = deque()

    def to_encode():
        for batch in batches:
            waiting.append(batch)
            yield [item for item in batch if not isinstance(item[2], Rejected)]

    for _, encoded in _encode(to_encode(), encoder, tokenizer, config, num_proc, engine, ray_address):
        batch = waiting.popleft()
        done = iter(encoded)
        yield batch, [c if isinstance(c, Rejected) else next(done) for _, _, c in batch]


def _encode(batches, encoder, tokenizer, config, num_proc, engine, ray_address):
    if engine == "ray":
        from .engines.ray import ray_encode_batches

        for batch, (encoded, backend) in ray_encode_batches(batches, tokenizer, config, ray_address, num_proc):
            _note_backend(encoder, backend)
            yield batch, encoded
    elif num_proc == 1:
        for batch in batches:
            encoded = encoder.encode([c for _, _, c in batch])
            _note_backend(encoder, encoder.backend_name)
            yield batch, encoded
    else:
        # Forked workers inherit the parent's encoder: no second tokenizer load or tiktoken build.
        # Each worker tokenizes on one thread; the processes are the parallelism.
        global _WORKER_ENCODER
        _WORKER_ENCODER = encoder
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with encoder.one_thread(), ProcessPoolExecutor(num_proc, multiprocessing.get_context("fork")) as pool:
                for batch, (encoded, backend) in _ordered_map(pool, batches, num_proc * 4):
                    _note_backend(encoder, backend)
                    yield batch, encoded
        finally:
            _WORKER_ENCODER = None
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved


def _note_backend(encoder: ChatEncoder, backend: str) -> None:
    """Record the backend that encoded a batch; when a worker fell back, say so here (its own
    warning stays in the worker)."""
    if backend != encoder.backend_name and backend not in encoder.backends_used:
        warnings.warn(f"a worker tokenized with {backend}, not {encoder.backend_name}: its runtime check found "
                      "a text tiktoken tokenizes differently from HF (the output is HF's either way)", stacklevel=2)
    encoder.backends_used.add(backend)


def _ordered_map(pool, batches, in_flight: int):
    """Like pool.map, but reads its input lazily so memory stays bounded."""
    pending = []
    for batch in batches:
        pending.append((batch, pool.submit(_worker_encode, [c for _, _, c in batch])))
        if len(pending) >= in_flight:
            batch, future = pending.pop(0)
            yield batch, future.result()
    for batch, future in pending:
        yield batch, future.result()


def _collect(results, builder: TokenStoreBuilder, config: PackConfig, ledger: Ledger, bar) -> None:
    """Apply the ``--overlong`` rule to every encoded record, in input order, and keep what stays."""
    max_len = config.max_len
    for batch, encoded in results:
        lengths = np.array([0 if isinstance(item, Rejected) else len(item.input_ids) for item in encoded], np.int64)
        within = None
        if config.overlong == "truncate" and (lengths > max_len).any():
            within = [int((item.labels[1:max_len] != IGNORE_INDEX).sum()) if n > max_len else 1
                      for item, n in zip(encoded, lengths.tolist())]
        fates = overlong_fates(lengths, max_len, config.overlong, within).tolist()
        tokens = 0
        for (source_index, record, conversation), item, fate in zip(batch, encoded, fates):
            if isinstance(item, Rejected):
                ledger.reject(record, source_index, str(item), item.code)
                continue
            ids, labels = item.input_ids, item.labels
            if fate == DROPPED:
                reason = f"{len(ids)} tokens, longer than --max-len {max_len} (--overlong drop)"
                ledger.reject(record, source_index, reason, "overlong")
                continue
            if fate == EMPTIED:
                reason = f"{len(ids)} tokens; no supervised token is left after truncation to --max-len {max_len}"
                ledger.reject(record, source_index, reason, "overlong")
                continue
            if fate == CUT:
                ids, labels = ids[:max_len], labels[:max_len]
                ledger.status[source_index] = TRUNCATED
            ledger.changes.update(conversation.changes)
            ledger.turns_not_located += item.turns_not_located
            builder.append(ids, labels, source_index)
            tokens += len(ids)
        bar.update(len(batch), tokens)


def _pack(store: TokenStore, config: PackConfig, ledger: Ledger) -> Bins:
    lengths = store.lengths
    bins = plan_bins(lengths, config.max_len, config.strategy, seed=config.seed, samples_per_row=config.samples_per_row,
                     overlong=config.overlong, partition_size=config.partition_size)
    if bins.lengths is not None:  # pieces exist: mark the records that were cut
        cut = bins.lengths < lengths[bins.items]
        for source_index in np.unique(store.source_index[bins.items[cut]]).tolist():
            if ledger.status[source_index] == PACKED:  # a truncated record that is also cut stays truncated
                ledger.status[source_index] = SPLIT
    return order_bins(bins, config.row_order, config.seed)


def _segments(bins: Bins, store: TokenStore) -> Segments:
    lengths = store.lengths
    starts = bins.starts if bins.starts is not None else np.zeros(len(bins.items), dtype=np.int64)
    return Segments(bins.items, starts, bins.entry_lengths(lengths), bins.offsets)


def _manifest(config, sources, formats, tok, tokenizer, ledger, store, segments, shards, backend="hf") -> dict:
    status = np.bincount(np.frombuffer(bytes(ledger.status), dtype=np.uint8), minlength=len(FATES))
    fates = {fate: int(status[code]) for code, fate in enumerate(FATES)}
    row_lengths = segments.row_lengths()
    tokens = int(row_lengths.sum())
    rows = int(len(row_lengths))
    supervised = sum(shard["supervised_tokens"] for shard in shards)
    bound = lower_bound(segments.length, config.max_len) if tokens else 0
    return {
        "packprep_version": __version__,
        "config": asdict(config),
        "inputs": [
            {"path": s.path, "named": s.named or s.path, "name": os.path.basename(s.path.rstrip("/\\")) or s.path,
             "kind": s.kind, "format": _formats_seen(ledger, number, f), "records": s.records,
             "bytes": os.path.getsize(s.path) if os.path.isfile(s.path) else None,
             "sha256": file_sha256(s.path) if os.path.isfile(s.path) else None}
            for number, (s, f) in enumerate(zip(sources, formats))
        ],
        "tokenizer": {**tokenizer_fingerprint(tok, tokenizer), "backend": backend},
        "counts": {
            "records": len(ledger.status),
            **fates,
            "rejected_by_reason": dict(sorted(ledger.reasons.items())),
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
        "partitions": -(-len(store) // config.partition_size) if config.partition_size and len(store) else 1,
        "length_histograms": length_histograms(row_lengths, segments.length, config.max_len),
        "shards": shards,
    }


def _formats_seen(ledger: Ledger, number: int, fallback: str) -> str:
    """The format of an input's records, "sharegpt+openai" for a file that mixes them."""
    seen = ledger.formats.get(number)
    return "+".join(fmt for fmt, _ in seen.most_common()) if seen else fallback


class _Progress:
    """A tqdm bar on stderr (or nothing, when disabled) that also shows tokens and tokens/s."""

    def __init__(self, enabled: bool, total, desc: str, unit: str):
        self._bar = None
        self._tokens = 0
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)

    def update(self, n: int, tokens: int = 0) -> None:
        if self._bar is None:
            return
        self._tokens += tokens
        if self._tokens:
            rate = self._tokens / max(self._bar.format_dict["elapsed"], 1e-9)
            size = self._bar.format_sizeof
            self._bar.set_postfix_str(f"{size(self._tokens)} tokens, {size(rate)} tok/s", refresh=False)
        self._bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
