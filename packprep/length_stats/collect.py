"""stats, collect: the numbers a report is made of.

For inputs, the lengths and label counts of every encoded conversation, encoded by pack's own
:class:`packprep.encode.Encoding` (same readers, template, labels and rejections). For a packed
folder, the shards' ``seq_lens``. Plus the two summaries both reports use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..encode import Encoding
from ..ledger import Ledger
from ..errors import ConfigError, InputError
from ..pipeline import plan_parts
from ..progress import Progress
from ..layout import IGNORE_INDEX
from ..plan import cut_cost
from ..prefix_tree import bound, build_tree

if TYPE_CHECKING:  # pragma: no cover
    from ..engines import Engine


@dataclass
class InputLengths:
    """Per sequence (per accepted conversation, but for those trained as several), in input order."""

    lengths: np.ndarray  # tokens
    supervised: np.ndarray  # trained labels, position 0 not counted
    turns: np.ndarray  # messages of each accepted conversation (a plain-text record counts as 1)
    within: dict[int, np.ndarray]  # per max_len L: supervised tokens within the first L tokens
    masked: dict[int, np.ndarray]  # per max_len L: trained labels at L, 2L, ... (first labels of pieces)
    sequences: np.ndarray  # sequences of each accepted conversation (turn_context exact: one a trained turn)
    shared: np.ndarray = field(default_factory=lambda: np.zeros(2, np.int64))  # (tokens, bound) as shared-prefix rows
    turns_cut: dict[int, np.ndarray] = field(default_factory=dict)  # per max_len L: turns --overlong leaves untrained


def collect_inputs(encoding: Encoding, ledger: Ledger, max_lens: list[int], engine: "Engine",
                   progress: bool = False, label: str = "read+tokenize") -> InputLengths:
    """Encode every record as ``pack`` does, on ``engine``; keep only lengths and label counts
    (``label``: the progress bar's, which says what this pass is for where there are several)."""
    parts: list[InputLengths] = []
    with Progress(progress, None, label, "conv") as bar:
        sink = partial(LengthSink, tuple(max_lens), encoding.config.overlong == "split")
        for result in encoding.run(engine, plan_parts(encoding.sources, engine), ledger, sink):
            parts.append(result.payload)
            bar.update(result.records, result.tokens)
    join = lambda arrays: np.concatenate([np.zeros(0, np.int64)] + arrays)  # noqa: E731
    return InputLengths(join([p.lengths for p in parts]), join([p.supervised for p in parts]),
                        join([p.turns for p in parts]), {m: join([p.within[m] for p in parts]) for m in max_lens},
                        {m: join([p.masked[m] for p in parts]) for m in max_lens}, join([p.sequences for p in parts]),
                        sum((p.shared for p in parts), np.zeros(2, np.int64)),
                        {m: join([p.turns_cut[m] for p in parts]) for m in max_lens})


class LengthSink:
    """stats' encode sink, run in the workers: a part's lengths and label counts, no tokens."""

    def __init__(self, max_lens: tuple[int, ...], pieces: bool = False, part=None):
        self.max_lens, self.pieces = max_lens, pieces  # pieces: --overlong split (plan.cut_cost)
        self.lengths: list[int] = []
        self.supervised: list[int] = []
        self.turns: list[int] = []
        self.sequences: list[int] = []
        self.within: dict[int, list[int]] = {m: [] for m in max_lens}
        self.masked: dict[int, list[int]] = {m: [] for m in max_lens}
        self.turns_cut: dict[int, list[int]] = {m: [] for m in max_lens}
        self.shared = np.zeros(2, np.int64)  # tokens and bound of these records as shared-prefix rows

    def take(self, batch, ledger: Ledger) -> int:
        probes = np.asarray(self.max_lens, dtype=np.int64)
        tokens = 0
        for number, record, conversation, item in batch:
            item = ledger.accept(record, number, item)
            if item is None:
                continue
            ledger.keep(conversation, item)
            self.turns.append(len(conversation.messages) if conversation.messages is not None else 1)
            self.sequences.append(len(item.sequences))
            sequences = item.sequences
            self.shared += (len(build_tree(sequences)), bound(sequences)) if len(sequences) > 1 else len(sequences[0][0])
            for ids, labels in item.sequences:  # a conversation may be several sequences (turn_context exact)
                trained = labels != IGNORE_INDEX
                trained[0] = False  # a packed sequence's first label is always -100
                cumulative = np.cumsum(trained, dtype=np.int64)
                n = len(ids)
                tokens += n
                self.lengths.append(n)
                self.supervised.append(int(cumulative[-1]))
                # supervised tokens that survive truncation to each max_len
                for m, value in zip(self.max_lens, cumulative[np.minimum(probes, n) - 1].tolist()):
                    self.within[m].append(value)
                    # trained labels at L, 2L, ...: the first labels of its pieces under split
                    self.masked[m].append(int(trained[m::m].sum()) if n > m else 0)
                    self.turns_cut[m].append(cut_cost(labels, m, self.pieces)[0])
        return tokens

    def finish(self) -> InputLengths:
        as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
        return InputLengths(as_array(self.lengths), as_array(self.supervised), as_array(self.turns),
                            {m: as_array(v) for m, v in self.within.items()},
                            {m: as_array(v) for m, v in self.masked.items()}, as_array(self.sequences), self.shared,
                            {m: as_array(v) for m, v in self.turns_cut.items()})


def turn_context_costs(encoding: Encoding, ledger: Ledger, collected: InputLengths, engine: "Engine",
                       progress: bool = False) -> dict[str, dict]:
    """What each ``--turn-context`` policy gives on these inputs: sequences, tokens, supervised
    tokens, turns left untrained or trained out of their inference context. Where the template's
    whole rendering holds every turn as at inference (``turns_rewritten`` 0), the policies agree
    and the inputs are encoded once; else once more for each other policy."""
    import copy
    from dataclasses import replace

    from ..render import TURN_CONTEXTS

    def row(lengths: InputLengths, tally: Ledger) -> dict:
        return {"conversations": len(lengths.turns), "sequences": len(lengths.lengths),
                "tokens": int(lengths.lengths.sum()), "supervised": int(lengths.supervised.sum()),
                "rejected": sum(tally.reasons.values()), "turns_not_located": tally.turns_not_located,
                **tally.context_counts(), "shared_prefix_tokens": int(lengths.shared[0]),
                "shared_prefix_bound": int(lengths.shared[1])}

    chosen = encoding.config.turn_context
    costs = {chosen: row(collected, ledger)}
    for policy in TURN_CONTEXTS:
        if policy == chosen:
            continue
        if not ledger.context.get("turns_rewritten"):
            costs[policy] = dict(costs[chosen])
            continue
        encoder = copy.copy(encoding.encoder)
        encoder.turn_context = policy
        other = replace(encoding, encoder=encoder, config=replace(encoding.config, turn_context=policy))
        tally = Ledger(encoding.config.on_error)
        costs[policy] = row(collect_inputs(other, tally, [encoding.config.max_len], engine, progress,
                                           f"read+tokenize again, as --turn-context {policy}"), tally)
    return {policy: costs[policy] for policy in TURN_CONTEXTS}


def collect_folder(folder: Path, manifest: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens per row, sequences per row, tokens per sequence) of a packed folder, from ``seq_lens``
    alone (token columns are not read)."""
    import pyarrow.compute as pc

    row_lengths, per_row, seq_lengths = [], [], []
    for shard in manifest["shards"]:
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
    return join(row_lengths), join(per_row), join(seq_lengths)


def _read_column(path: Path, column: str, layout: str | None = None):
    import pyarrow as pa

    from ..layout import LayoutError, ShardReader

    try:
        return ShardReader(path, layout).read([column])
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, pa.ArrowException, KeyError) as exc:
        raise InputError(f"{path}: cannot read column {column!r} ({exc}); run packprep verify") from exc


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
