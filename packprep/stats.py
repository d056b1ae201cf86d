"""See the data before spending GPU hours: length statistics and what-if packing plans.

Three layers, each usable alone:

* :func:`what_if` — pure: token lengths in, one row per (max_len, strategy) out. It runs the same
  packing engine as ``pack`` (:func:`packprep.packing.pack_lengths`) and applies the same
  ``--overlong`` rule, so rows, tokens, padding, lost tokens and optimizer steps are exactly what
  ``pack`` would produce.
* :func:`stats` — reads, normalizes and tokenizes inputs the way ``pack`` does (same readers, same
  chat template, same labels, same rejects), then reports per-conversation length distributions,
  a log-binned histogram, and the what-if table. :func:`stats_folder` does the same for a packed
  output folder, read from its manifest and shards.
* :func:`render_text` draws a report for a terminal (80 columns); :func:`plot` draws it with
  matplotlib (the ``plot`` extra).

Definitions used in reports:

``tokens``
    Tokens of the rendered conversation (chat template applied, special tokens included).
``supervised``
    Tokens with a label, not counting position 0 (a packed sequence's first label is always -100).
``turns``
    Messages in the normalized conversation (a plain-text record counts as 1).
``attention_vs_pad``
    ``sum(len**2)`` over the packed sequences, relative to the same sum for ``pad``: the cost of
    varlen attention, which packing never raises (it lowers it only when it cuts samples).
``optimizer_steps``
    ``ceil(rows / global_batch_size) * epochs``: packing changes this number, so learning rate,
    warm-up and schedule lengths set in steps must follow it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from .errors import ConfigError, InputError
from .normalize import CHANGES, FieldNames, Rejected, changes_text
from .packing import STRATEGY_TABLE, split_pieces
from .plan import TRUNCATED, check_overlong, check_strategy, overlong_fates, plan_bins
from .tokenize import IGNORE_INDEX, ChatEncoder, Encoded, load_tokenizer

DEFAULT_MAX_LENS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_STRATEGIES = ("pad", "random", "greedy")
WIDTH = 80

__all__ = [
    "DEFAULT_MAX_LENS",
    "DEFAULT_STRATEGIES",
    "distribution",
    "log_histogram",
    "plot",
    "render_text",
    "stats",
    "stats_folder",
    "what_if",
]


# ---------------------------------------------------------------------------------------------
# pure parts: distributions, histograms, what-if
# ---------------------------------------------------------------------------------------------


def distribution(values) -> dict:
    """count, mean, p50, p90, p99, min and max of ``values`` (percentiles are data values)."""
    arr = np.asarray(values, dtype=np.int64)
    if arr.size == 0:
        return {"count": 0, "mean": 0.0, "p50": 0, "p90": 0, "p99": 0, "min": 0, "max": 0, "sum": 0}
    p50, p90, p99 = (int(v) for v in np.percentile(arr, [50, 90, 99], method="inverted_cdf"))
    return {
        "count": int(arr.size),
        "mean": round(float(arr.mean()), 2),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "min": int(arr.min()),
        "max": int(arr.max()),
        "sum": int(arr.sum()),
    }


def log_histogram(values, bins_per_octave: int | None = None) -> list[dict]:
    """Counts of ``values`` (integers >= 1) in log-scaled bins ``[lo, hi)``.

    Bins are 1, 2 or 4 per doubling, chosen so the histogram has about 8–24 bins; edges are
    integers. Empty leading and trailing bins are omitted, inner empty bins are kept.
    """
    arr = np.asarray(values, dtype=np.int64)
    arr = arr[arr >= 1]
    if arr.size == 0:
        return []
    lo_exp = math.log2(int(arr.min()))
    hi_exp = math.log2(int(arr.max()) + 1)
    if bins_per_octave is None:
        octaves = max(hi_exp - lo_exp, 1.0)
        bins_per_octave = 1 if octaves > 12 else 2 if octaves > 5 else 4
    k0 = math.floor(lo_exp * bins_per_octave)
    k1 = math.ceil(hi_exp * bins_per_octave)
    edges = np.unique(np.round(2.0 ** (np.arange(k0, k1 + 1) / bins_per_octave)).astype(np.int64))
    if edges[-1] <= arr.max():
        edges = np.append(edges, int(arr.max()) + 1)
    counts = np.bincount(np.searchsorted(edges, arr, side="right") - 1, minlength=len(edges) - 1)
    nonzero = np.flatnonzero(counts)
    first, last = int(nonzero[0]), int(nonzero[-1])
    edges[last + 1] = min(int(edges[last + 1]), int(arr.max()) + 1)  # the last bin ends at the maximum
    return [
        {"lo": int(edges[i]), "hi": int(edges[i + 1]), "count": int(counts[i])} for i in range(first, last + 1)
    ]


def _check_plan(max_lens, strategies, global_batch_size, epochs, overlong, samples_per_row) -> tuple[list, list]:
    max_lens = sorted({int(m) for m in max_lens})
    if not max_lens:
        raise ConfigError("give at least one --max-len")
    if max_lens[0] < 2:
        raise ConfigError("--max-len must be at least 2")
    strategies = list(dict.fromkeys(strategies))
    if not strategies:
        raise ConfigError("give at least one strategy")
    for strategy in strategies:
        check_strategy(strategy, samples_per_row)
    if int(global_batch_size) < 1:
        raise ConfigError("--global-batch-size must be at least 1")
    if int(epochs) < 1:
        raise ConfigError("--epochs must be at least 1")
    check_overlong(overlong)
    return max_lens, strategies


def what_if(
    lengths,
    supervised=None,
    max_lens: Iterable[int] = DEFAULT_MAX_LENS,
    strategies: Iterable[str] = DEFAULT_STRATEGIES,
    *,
    supervised_within: Mapping[int, np.ndarray] | None = None,
    split_masked: Mapping[int, np.ndarray] | None = None,
    overlong: str = "truncate",
    seed: int = 0,
    samples_per_row: int | None = None,
    partition_size: int | None = None,
    global_batch_size: int = 64,
    epochs: int = 1,
) -> list[dict]:
    """What ``pack`` would produce for each ``max_len`` × ``strategy``, from lengths alone.

    Args:
        lengths: token count of each accepted sample (1-D, every value >= 1).
        supervised: supervised tokens of each sample (labels other than -100, position 0 not
            counted); optional, only feeds the ``supervised_tokens`` column.
        supervised_within: for a max_len ``L``, the supervised tokens of each sample within its
            first ``L`` tokens (what survives truncation). With it, truncation is exact: a sample
            left with no supervised token is rejected, as ``pack`` does. Without it, truncated
            samples are assumed to keep ``min(supervised, L - 1)`` and never to be rejected.
        split_masked: for a max_len ``L``, the supervised tokens of each sample at positions
            ``L, 2L, ...``: the first labels of its pieces under ``--overlong split``, which
            become -100. With it, ``supervised_tokens`` is exact under split.
        overlong: ``truncate``, ``drop`` or ``split``, as ``pack --overlong``.
        seed, samples_per_row, partition_size: as ``pack`` (``random`` and ``minibatch`` use the
            first two; ``partition_size`` packs each run of that many samples on its own).

    Returns one dict per (max_len, strategy), max_len ascending, strategies in the given order:
    ``rows``, ``tokens``, ``efficiency`` (tokens / (rows × max_len)), ``padding_tokens`` (if every
    row is padded to max_len), ``overlong_samples`` and ``overlong_tokens_lost`` (``rejected``: the
    truncated samples left with nothing to train on), ``sequences`` and ``samples_per_row`` (pieces
    count separately when samples are cut), ``supervised_tokens`` (``supervised_exact`` is False
    where ``random`` cuts samples, or under split without ``split_masked``: a piece's first label
    becomes -100, so the true count is lower by at most one per piece),
    ``optimizer_steps``, ``attention_cost`` (sum of len² over packed sequences) and
    ``attention_vs_pad``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths must be 1-D")
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError("every length must be >= 1")
    supervised = np.zeros_like(lengths) if supervised is None else np.asarray(supervised, dtype=np.int64)
    if supervised.shape != lengths.shape:
        raise ValueError("supervised must have one value per length")
    max_lens, strategies = _check_plan(max_lens, strategies, global_batch_size, epochs, overlong, samples_per_row)
    global_batch_size, epochs = int(global_batch_size), int(epochs)
    table = []
    for max_len in max_lens:
        over = lengths > max_len
        n_over = int(over.sum())
        if supervised_within is not None and max_len in supervised_within:
            within = np.asarray(supervised_within[max_len], dtype=np.int64)
        else:
            within = np.where(over, np.minimum(supervised, max_len - 1), supervised)
        fates = overlong_fates(lengths, max_len, overlong, within)
        keep = fates <= TRUNCATED
        cut = fates == TRUNCATED
        lens = np.where(cut, max_len, lengths)[keep]
        # truncated samples lose what is past max_len; rejected ones lose everything
        lost = int(lengths[~keep].sum()) + int(lengths[cut].sum()) - max_len * int(cut.sum())
        sup = int((within if overlong == "truncate" else supervised)[keep].sum())
        masked, split_exact = 0, not n_over
        if overlong == "split" and n_over and split_masked is not None and max_len in split_masked:
            masked, split_exact = int(np.asarray(split_masked[max_len], dtype=np.int64).sum()), True
        rejected = int((~keep).sum())
        tokens = int(lens.sum())
        pieces = None
        if overlong == "split" and n_over:
            _, _, pieces = split_pieces(lens, max_len)
        pad_attention = int(np.square(pieces if pieces is not None else lens).sum())
        for strategy in strategies:
            entry, row_lengths = _plan(lens, max_len, strategy, seed, samples_per_row, partition_size,
                                       split=overlong == "split")
            rows = len(row_lengths)
            width = max(max_len, int(row_lengths.max()) if rows else 0)
            sup_here, exact = sup, True
            if pieces is not None and not STRATEGY_TABLE[strategy].rows_may_exceed_max_len:
                sup_here, exact = sup - masked, split_exact  # first labels of pieces become -100
            if STRATEGY_TABLE[strategy].cuts_samples and len(entry) > (len(pieces) if pieces is not None else len(lens)):
                exact = False  # the strategy cut samples at places only the labels know
            attention = int(np.square(entry).sum())
            table.append(
                {
                    "max_len": max_len,
                    "strategy": strategy,
                    "rows": rows,
                    "tokens": tokens,
                    "efficiency": round(tokens / (rows * width), 6) if rows else 0.0,
                    "padding_tokens": rows * width - tokens,
                    "overlong_samples": n_over,
                    "overlong_tokens_lost": lost,
                    "rejected": rejected,
                    "sequences": int(len(entry)),
                    "samples_per_row": round(len(entry) / rows, 3) if rows else 0.0,
                    "supervised_tokens": sup_here,
                    "supervised_exact": exact,
                    "optimizer_steps": -(-rows // global_batch_size) * epochs,
                    "attention_cost": attention,
                    "attention_vs_pad": round(attention / pad_attention, 4) if pad_attention else 0.0,
                }
            )
    return table


def _plan(lens, max_len, strategy, seed, samples_per_row, partition_size, split) -> tuple[np.ndarray, np.ndarray]:
    """(length of every packed sequence or piece, length of every row), exactly as ``pack`` packs ``lens``."""
    if len(lens) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    bins = plan_bins(lens, max_len, strategy, seed=seed, samples_per_row=samples_per_row,
                     overlong="split" if split else "truncate", partition_size=partition_size)
    return bins.entry_lengths(lens), bins.bin_lengths(lens)


# ---------------------------------------------------------------------------------------------
# stats over inputs
# ---------------------------------------------------------------------------------------------


def stats(
    inputs: str | Sequence[str],
    tokenizer: str | None = None,
    max_lens: Iterable[int] | None = None,
    strategies: Iterable[str] | None = None,
    global_batch_size: int = 64,
    epochs: int = 1,
    *,
    num_proc: int | None = None,
    progress: bool = False,
    **settings,
) -> dict:
    """Length statistics and the what-if table for ``inputs``, tokenized as ``pack`` would.

    ``settings`` are the :class:`packprep.PackConfig` fields that shape reading and tokenizing
    (``format``, ``messages_field``, ``text_field``, ``train_on``, ``on_error``) and the what-if
    (``overlong``, ``seed``, ``samples_per_row``). ``max_lens`` and ``strategies`` default to
    :data:`DEFAULT_MAX_LENS` and :data:`DEFAULT_STRATEGIES`. Nothing is written. Returns a
    JSON-ready dict (``kind: "inputs"``) that :func:`render_text` and :func:`plot` draw; for a
    single packed output folder (holding ``packprep.json``), :func:`stats_folder`'s report.
    """
    from .pipeline import Ledger, PackConfig, _check_template, _formats_seen, _source_format, record_policy
    from .read import resolve_inputs

    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if len(paths) == 1 and is_packed_folder(paths[0]):
        return stats_folder(paths[0], global_batch_size=global_batch_size, epochs=epochs)
    if not tokenizer:
        raise ConfigError("--tokenizer is required for input files (only a packed folder, holding "
                          "packprep.json, needs none)")
    max_lens = DEFAULT_MAX_LENS if max_lens is None else max_lens
    strategies = DEFAULT_STRATEGIES if strategies is None else strategies
    max_lens, strategies = _check_plan(
        max_lens, strategies, global_batch_size, epochs,
        settings.get("overlong", "truncate"), settings.get("samples_per_row"),
    )
    config = PackConfig.from_settings({**settings, "max_len": max(max_lens)}, "stats")
    sources = resolve_inputs([str(path) for path in paths])
    tok = load_tokenizer(tokenizer)
    encoder = ChatEncoder(tok, config.train_on, config.tokenizer_backend)
    fields = FieldNames(config.messages_field, config.text_field)
    formats = [_source_format(source, config, fields) for source in sources]
    _check_template(encoder, formats, min(max_lens))
    num_proc = max(1, num_proc or os.cpu_count() or 1)

    tally = Ledger(config)
    policy = record_policy(encoder, config)
    collected = _encode_lengths(sources, formats, fields, encoder, tokenizer, config, tally, max_lens, num_proc, progress,
                                policy)
    lengths, supervised, turns, within, masked = collected
    table = what_if(
        lengths, supervised, max_lens, strategies,
        supervised_within=within, split_masked=masked, overlong=config.overlong, seed=config.seed,
        samples_per_row=config.samples_per_row, partition_size=config.partition_size,
        global_batch_size=global_batch_size, epochs=epochs,
    )
    rejected = sum(tally.reasons.values())
    return {
        "kind": "inputs",
        "inputs": [{"path": s.path, "format": _formats_seen(tally, number, f), "records": s.records}
                   for number, (s, f) in enumerate(zip(sources, formats))],
        "tokenizer": tokenizer,
        "train_on": config.train_on,
        "records": len(tally.status),
        "conversations": int(len(lengths)),
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(tally.reasons.items())),
        "turns_not_located": tally.turns_not_located,
        "normalized": {name: tally.changes.get(name, 0) for name in CHANGES},
        "tokens": {"total": int(lengths.sum()), "supervised": int(supervised.sum())},
        "distribution": {
            "tokens": distribution(lengths),
            "supervised": distribution(supervised),
            "turns": distribution(turns),
        },
        "histogram": {"of": "tokens", "bins": log_histogram(lengths)},
        "over_max_len": {str(m): int((lengths > m).sum()) for m in max_lens},
        "what_if": {
            "global_batch_size": int(global_batch_size),
            "epochs": int(epochs),
            "overlong": config.overlong,
            "seed": config.seed,
            "rows": table,
        },
    }


def _encode_lengths(sources, formats, fields, encoder, tokenizer, config, tally, max_lens, num_proc, progress,
                    policy):
    """Run the pipeline's read → normalize → tokenize stages; keep only lengths and label counts."""
    from .pipeline import _batches, _normalized, _Progress, encoded_batches

    lengths: list[int] = []
    supervised: list[int] = []
    turns: list[int] = []
    within: dict[int, list[int]] = {m: [] for m in max_lens}
    masked: dict[int, list[int]] = {m: [] for m in max_lens}
    probes = np.asarray(max_lens, dtype=np.int64)

    def collect(results, bar):
        for batch, encoded in results:
            for (source_index, record, conversation), item in zip(batch, encoded):
                if isinstance(item, Rejected):
                    tally.reject(record, source_index, str(item), item.code)
                    continue
                assert isinstance(item, Encoded)
                tally.turns_not_located += item.turns_not_located
                tally.changes.update(conversation.changes)
                trained = item.labels != IGNORE_INDEX
                trained[0] = False  # a packed sequence's first label is always -100
                cumulative = np.cumsum(trained, dtype=np.int64)
                n = len(item.input_ids)
                lengths.append(n)
                supervised.append(int(cumulative[-1]))
                turns.append(len(conversation.messages) if conversation.messages is not None else 1)
                # supervised tokens that survive truncation to each max_len
                for m, value in zip(max_lens, cumulative[np.minimum(probes, n) - 1].tolist()):
                    within[m].append(value)
                    # trained labels at L, 2L, ...: the first labels of its pieces under split
                    masked[m].append(int(trained[m::m].sum()) if n > m else 0)
            bar.update(len(batch), sum(len(item.input_ids) for item in encoded if isinstance(item, Encoded)))

    batches = _batches(_normalized(sources, formats, fields, tally, policy), 256)
    with _Progress(progress, None, "read+tokenize", "conv") as bar:
        collect(encoded_batches(batches, encoder, tokenizer, config, num_proc), bar)
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return (
        as_array(lengths),
        as_array(supervised),
        as_array(turns),
        {m: as_array(v) for m, v in within.items()},
        {m: as_array(v) for m, v in masked.items()},
    )


# ---------------------------------------------------------------------------------------------
# stats over a packed output folder
# ---------------------------------------------------------------------------------------------


def is_packed_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / "packprep.json").is_file()


def stats_folder(folder: str | os.PathLike, global_batch_size: int = 64, epochs: int = 1) -> dict:
    """Rows, sequences per row, efficiency and fill of a packed output folder (``kind: "packed"``).

    Read from ``packprep.json`` and the shards' ``seq_lens`` column (token columns are not read).
    """
    import pyarrow.compute as pc

    from .verify import read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    max_len = int(manifest["config"]["max_len"])
    shards = manifest["shards"]
    if int(global_batch_size) < 1 or int(epochs) < 1:
        raise ConfigError("--global-batch-size and --epochs must be at least 1")
    row_lengths, per_row, seq_lengths = [], [], []
    for shard in shards:
        table = _read_column(folder / shard["path"], "seq_lens", manifest.get("layout"))
        column = table.column("seq_lens")
        flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)
        counts = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        sums = np.concatenate([[0], np.cumsum(flat)])
        row_lengths.append(sums[offsets[1:]] - sums[offsets[:-1]])
        per_row.append(counts)
        seq_lengths.append(flat)
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    row_lengths, per_row, seq_lengths = join(row_lengths), join(per_row), join(seq_lengths)
    rows = int(len(row_lengths))
    tokens = int(row_lengths.sum())
    fill = np.minimum(row_lengths * 10 // max(1, max_len), 10) if rows else np.zeros(0, np.int64)
    fill_counts = np.bincount(fill, minlength=11)
    fill_bins = [{"lo": k / 10, "hi": (k + 1) / 10, "count": int(fill_counts[k])} for k in range(10)]
    fill_bins[-1]["count"] += int(fill_counts[10:].sum())  # exactly full rows (and over-long ones)
    return {
        "kind": "packed",
        "folder": str(folder),
        "tokenizer": manifest.get("tokenizer", {}).get("name_or_path"),
        "config": manifest["config"],
        "records": manifest.get("counts", {}).get("records"),
        "counts": manifest.get("counts", {}),
        "rows": rows,
        "sequences": int(len(seq_lengths)),
        "tokens": {"total": tokens, "supervised": manifest.get("tokens", {}).get("supervised")},
        "efficiency": round(tokens / (rows * max_len), 6) if rows else 0.0,
        "padding_tokens": rows * max_len - tokens,
        "optimizer_steps": -(-rows // int(global_batch_size)) * int(epochs),
        "global_batch_size": int(global_batch_size),
        "epochs": int(epochs),
        "distribution": {
            "row_tokens": distribution(row_lengths),
            "sequences_per_row": distribution(per_row),
            "sequence_tokens": distribution(seq_lengths),
        },
        "histogram": {"of": "sequence tokens", "bins": log_histogram(seq_lengths)},
        "fill_histogram": fill_bins,
    }


def _read_column(path: Path, column: str, layout: str | None = None):
    import pyarrow as pa

    from .layout import LayoutError, ShardReader

    try:
        return ShardReader(path, layout).read([column])
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, pa.ArrowException, KeyError) as exc:
        raise InputError(f"{path}: cannot read column {column!r} ({exc}); run packprep verify") from exc


# ---------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------

_BLOCKS = " ▏▎▍▌▋▊▉█"


def _n(value) -> str:
    """A count, with thousands separators; compact (k, M, G) when longer than 7 characters."""
    value = int(value)
    text = f"{value:,}"
    if len(text) <= 7:
        return text
    for unit, scale in (("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
        short = value / scale
        if abs(short) < 999.5:
            return f"{short:.3g}{unit}"
    return f"{value:.2e}"


def _bar(count: int, peak: int, width: int) -> str:
    if peak <= 0 or count <= 0:
        return " " * width
    eighths = max(1, round(count / peak * width * 8))
    full, part = divmod(eighths, 8)
    text = "█" * full + (_BLOCKS[part] if part else "")
    return text.ljust(width)


def _histogram_lines(bins: list[dict], total: int, *, fraction: bool = False) -> list[str]:
    if not bins:
        return ["  (no data)"]
    if fraction:
        labels = [f"{b['lo']:>4.0%}–{b['hi']:<4.0%}" for b in bins]
    else:
        labels = [f"{_n(b['lo'])}–{_n(b['hi'] - 1)}" if b["hi"] - 1 > b["lo"] else _n(b["lo"]) for b in bins]
    label_width = max(len(label) for label in labels)
    count_width = max(len(_n(b["count"])) for b in bins)
    # label │bar│ count  pct%
    bar_width = WIDTH - 2 - label_width - 3 - count_width - 8
    peak = max(b["count"] for b in bins)
    lines = []
    for label, b in zip(labels, bins):
        share = b["count"] / total if total else 0.0
        lines.append(
            f"  {label:>{label_width}} │{_bar(b['count'], peak, bar_width)}│ {_n(b['count']):>{count_width}} {share:>6.1%}"
        )
    return lines


def _distribution_table(rows: list[tuple[str, dict]]) -> list[str]:
    head = f"  {'':<18}{'count':>8}{'mean':>9}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>9}"
    lines = [head]
    for name, d in rows:
        mean = _n(round(d["mean"])) if d["mean"] >= 100 else f"{d['mean']:.1f}"
        lines.append(
            f"  {name:<18}{_n(d['count']):>8}{mean:>9}{_n(d['p50']):>8}{_n(d['p90']):>8}"
            f"{_n(d['p99']):>8}{_n(d['max']):>9}"
        )
    return lines


def _what_if_lines(plan: dict) -> list[str]:
    rows = plan["rows"]
    epochs = plan["epochs"]
    lines = [
        f"what if (global batch {plan['global_batch_size']}, {epochs} epoch{'s' if epochs != 1 else ''}, "
        f"--overlong {plan['overlong']}):",
        f"  {'max_len':>7} {'strategy':<9}{'rows':>8}{'effic':>7}{'padding':>9}{'over':>6}"
        f"{'lost tok':>9}{'seq/row':>8}{'steps':>7}{'attn':>6}",
    ]
    previous = None
    for r in rows:
        max_len = _n(r["max_len"]) if r["max_len"] != previous else ""
        previous = r["max_len"]
        over = _n(r["overlong_samples"])
        lines.append(
            f"  {max_len:>7} {r['strategy']:<9}{_n(r['rows']):>8}{r['efficiency']:>7.1%}{_n(r['padding_tokens']):>9}"
            f"{over:>6}{_n(r['overlong_tokens_lost']):>9}{r['samples_per_row']:>8.2f}"
            f"{_n(r['optimizer_steps']):>7}{r['attention_vs_pad']:>6.2f}"
        )
    rejected = {r["max_len"]: r["rejected"] for r in rows if r["rejected"]}
    notes = [
        "  effic: tokens / (rows × max_len)    padding: pad tokens if padded to max_len",
        "  over: samples longer than max_len   lost tok: the tokens they lose",
        "  steps: ceil(rows / batch) × epochs  attn: sum(len²) of packed sequences vs pad",
    ]
    by_key = {(r["max_len"], r["strategy"]): r for r in rows}
    # the packing strategies whose rows fit max_len, in the table's order: greedy first
    preference = [s.name for s in STRATEGY_TABLE.values() if not (s.baseline or s.rows_may_exceed_max_len)]
    baseline = next(s.name for s in STRATEGY_TABLE.values() if s.baseline)
    packed = sorted(
        (r for r in rows if r["strategy"] in preference and (r["max_len"], baseline) in by_key),
        key=lambda r: (r["max_len"], preference.index(r["strategy"])),
    )
    if packed:
        r = packed[0]
        pad_steps = by_key[(r["max_len"], baseline)]["optimizer_steps"]
        if pad_steps != r["optimizer_steps"]:
            notes.extend(_wrap(
                f"  packing changes the step count ({_n(pad_steps)} → {_n(r['optimizer_steps'])} at "
                f"{_n(r['max_len'])}, {r['strategy']}): set warm-up and schedule in steps after "
                "choosing, and revisit the learning rate", indent="    "
            ))
    if rejected:
        notes.append(
            "  left with no trained token after truncation (rejected): "
            + ", ".join(f"{_n(n)} at {_n(m)}" for m, n in rejected.items())
        )
    return lines + notes


def render_text(report: dict) -> str:
    """Draw a :func:`stats` or :func:`stats_folder` report for a terminal; every line fits 80 columns."""
    if report.get("kind") == "packed":
        return _render_folder(report)
    lines = []
    names = ", ".join(Path(i["path"]).name for i in report["inputs"])
    if len(names) > WIDTH - 8:
        names = names[: WIDTH - 11] + "..."
    lines.append(f"inputs: {names}")
    tok = str(report["tokenizer"])
    if len(tok) > WIDTH - 30:
        tok = "..." + tok[-(WIDTH - 33):]
    lines.append(f"tokenizer: {tok}, train on {report['train_on']}")
    line = f"{_n(report['records'])} records: {_n(report['conversations'])} conversations, {_n(report['rejected'])} rejected"
    if report["rejected_by_reason"]:
        line += " (" + ", ".join(f"{k} {_n(v)}" for k, v in report["rejected_by_reason"].items()) + ")"
    lines.extend(_wrap(line))
    lines.extend(_wrap(changes_text(report.get("normalized") or {}, report.get("turns_not_located", 0))))
    lines.append(
        f"{report['tokens']['total']:,} tokens, {report['tokens']['supervised']:,} supervised "
        f"({report['tokens']['supervised'] / max(1, report['tokens']['total']):.1%})"
    )
    lines.append("")
    d = report["distribution"]
    lines.append("per conversation:")
    lines += _distribution_table([("tokens", d["tokens"]), ("supervised tokens", d["supervised"]), ("turns", d["turns"])])
    lines.append("")
    over = " · ".join(f"{_n(int(k))}: {_n(v)}" for k, v in report["over_max_len"].items())
    lines.append("tokens per conversation (log-scaled bins):")
    lines += _histogram_lines(report["histogram"]["bins"], report["conversations"])
    lines.extend(_wrap(f"  conversations longer than {over}"))
    lines.append("")
    lines += _what_if_lines(report["what_if"])
    return "\n".join(lines) + "\n"


def _render_folder(report: dict) -> str:
    config = report["config"]
    lines = [f"packed folder: {report['folder']}"[:WIDTH]]
    lines.append(
        f"strategy {config.get('strategy')}, max_len {_n(config['max_len'])}, overlong {config.get('overlong')}, "
        f"train on {config.get('train_on')}"
    )
    counts = report.get("counts") or {}
    if counts:
        lines.extend(_wrap(
            f"{_n(counts.get('records', 0))} records: packed {_n(counts.get('packed', 0))}, "
            f"truncated {_n(counts.get('truncated', 0))}, split {_n(counts.get('split', 0))}, "
            f"rejected {_n(counts.get('rejected', 0))}"
        ))
        lines.extend(_wrap(changes_text(counts.get("normalized") or {}, counts.get("turns_not_located", 0))))
    supervised = report["tokens"]["supervised"]
    lines.append(
        f"{_n(report['rows'])} rows, {_n(report['sequences'])} sequences, {_n(report['tokens']['total'])} tokens"
        + (f" ({_n(supervised)} supervised)" if supervised is not None else "")
    )
    lines.append(
        f"efficiency {report['efficiency']:.2%}, padding {_n(report['padding_tokens'])} tokens, "
        f"{_n(report['optimizer_steps'])} optimizer step{'s' if report['optimizer_steps'] != 1 else ''} "
        f"(batch {report['global_batch_size']}, "
        f"{report['epochs']} epoch{'s' if report['epochs'] != 1 else ''})"
    )
    lines.append("")
    d = report["distribution"]
    lines.append("per row:")
    lines += _distribution_table(
        [("row tokens", d["row_tokens"]), ("sequences per row", d["sequences_per_row"]),
         ("sequence tokens", d["sequence_tokens"])]
    )
    lines.append("")
    lines.append("row fill (tokens / max_len):")
    lines += _histogram_lines(report["fill_histogram"], report["rows"], fraction=True)
    lines.append("")
    lines.append("tokens per packed sequence (log-scaled bins):")
    lines += _histogram_lines(report["histogram"]["bins"], report["sequences"])
    return "\n".join(lines) + "\n"


def _wrap(line: str, indent: str = "  ") -> list[str]:
    import textwrap

    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [""]


# ---------------------------------------------------------------------------------------------
# plotting (the ``plot`` extra)
# ---------------------------------------------------------------------------------------------


def plot(report: dict, path: str | os.PathLike) -> None:
    """Draw the histograms (and, for inputs, the what-if curves) of ``report`` into a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'packprep[plot]'") from None

    def bars(ax, bins, title, xlabel, log=True):
        if bins:
            lo = np.array([b["lo"] for b in bins], dtype=float)
            hi = np.array([b["hi"] for b in bins], dtype=float)
            width = np.maximum(hi - lo, lo * 0.15) if log else hi - lo  # a one-value bin stays visible
            ax.bar(lo, [b["count"] for b in bins], width=width, align="edge", edgecolor="white", color="#4C72B0")
            if log:
                from matplotlib.ticker import FuncFormatter

                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("count")

    if report.get("kind") == "packed":
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        bars(axes[0], report["histogram"]["bins"], "tokens per packed sequence", "tokens (log scale)")
        bars(axes[1], report["fill_histogram"], "row fill", "tokens / max_len", log=False)
        fig.suptitle(f"{report['folder']}: {report['rows']:,} rows, efficiency {report['efficiency']:.1%}")
    else:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        bars(axes[0], report["histogram"]["bins"], "tokens per conversation", "tokens (log scale)")
        plan = report["what_if"]["rows"]
        for max_len in sorted({r["max_len"] for r in plan}):
            axes[0].axvline(max_len, color="#C44E52", linestyle=":", linewidth=1)
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        styles = ["-o", "--s", ":^", "-.D", "-v"]
        for k, strategy in enumerate(dict.fromkeys(r["strategy"] for r in plan)):
            mine = [r for r in plan if r["strategy"] == strategy]
            xs = [r["max_len"] for r in mine]
            style = styles[k % len(styles)]
            axes[1].plot(xs, [r["efficiency"] for r in mine], style, label=strategy, alpha=0.85)
            axes[2].plot(xs, [r["optimizer_steps"] for r in mine], style, label=strategy, alpha=0.85)
        plain = FuncFormatter(lambda value, _: f"{value:,.0f}")
        for ax, title, ylabel in ((axes[1], "packing efficiency", "tokens / (rows × max_len)"),
                                  (axes[2], "optimizer steps", "steps")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["max_len"] for r in plan}))
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(title)
            ax.set_xlabel("max_len")
            ax.set_ylabel(ylabel)
            ax.legend()
        axes[1].set_ylim(0, 1.05)
        axes[2].set_yscale("log")
        axes[2].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axes[2].yaxis.set_major_formatter(plain)
        axes[2].yaxis.set_minor_formatter(NullFormatter())
        what = report["what_if"]
        fig.suptitle(
            f"{', '.join(Path(i['path']).name for i in report['inputs'])} · {report['conversations']:,} conversations · "
            f"global batch {what['global_batch_size']}, {what['epochs']} epoch(s)"
        )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        from .errors import OutputError

        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


def require_matplotlib() -> None:
    """Fail early (before a long run) when ``--plot`` cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'packprep[plot]'") from None
