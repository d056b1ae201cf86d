"""Rows balanced by compute across data-parallel ranks: packed bins in, the same bins reordered and
re-packed so that every step's ranks carry equal cost (pure: lengths in, bins out).

The order targeted (``sampler``) is the one that deals row ``i`` of the shards to a rank:

``distributed``  ``DistributedSampler(shuffle=False)`` then batches of ``rows_per_step``: row ``i`` goes
                 to rank ``i % dp_size`` (torchtune, a plain loop). Step ``s`` is rows
                 ``s*N*R .. (s+1)*N*R - 1``; rank ``r`` holds the rows ``r, r+N, ...`` of it.
``accelerate``   a sequential sampler batched by ``rows_per_step``, batch ``b`` to rank ``b % dp_size``
                 (accelerate's ``BatchSamplerShard``: Trainer/TRL with ``train_sampling_strategy=
                 "sequential"``). Rank ``r`` holds rows ``r*R .. r*R + R - 1`` of a step.

With ``rows_per_step`` 1 both orders are the same. How (docs/balanced-packing.md): the rows are
sorted by cost and cut into *tuples* of ``dp_size`` rows of near-equal cost; within a tuple,
sequences move between rows (one moved, or two swapped, never past ``max_len``) until the rows'
costs are within ``tolerance`` of their mean; tuples are shuffled (seeded) and each step takes
``rows_per_step`` of them, its ranks given one row of each, heaviest row to the lightest rank so far.
Rows are the packer's: the same count, the same multiset of sequences. Steps are in random order
(no length curriculum); a step's ranks hold rows of one tuple, so with ``rows_per_step`` 1 a step's
sequences are of a kind (all long, or all short), while the steps are shuffled.
The rows that do not fill whole tuples (fewer than ``dp_size``, chosen at random) end the order.
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel
from .packing import Bins

SAMPLERS = ("distributed", "accelerate")
TOLERANCE = 0.005  # a tuple's re-pack stops when its heaviest row is within 0.5% of the tuple's mean
_MAX_MOVES = 64  # moves per tuple at most (each lowers the tuple's heaviest row or narrows its spread)


def balance_bins(bins: Bins, lengths, max_len: int, dp_size: int, rows_per_step: int = 1, *,
                 cost: CostModel, seed: int = 0, sampler: str = "distributed") -> Bins:
    """``bins`` (whole sequences or pieces, rows of at most ``max_len`` tokens) re-packed and ordered so
    that each step of ``dp_size * rows_per_step`` rows gives the ranks equal cost under ``sampler``."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    if dp_size < 1 or rows_per_step < 1:
        raise ValueError("dp_size and rows_per_step must be >= 1")
    entries = bins.entry_lengths(lengths)
    rows = [np.arange(bins.offsets[b], bins.offsets[b + 1]) for b in range(bins.n_bins)]
    rng = np.random.default_rng(seed)
    n_tuples = len(rows) // dp_size
    rest = np.sort(rng.choice(len(rows), len(rows) - n_tuples * dp_size, replace=False))
    costs = cost.row_costs(entries, bins.offsets)
    keep = np.setdiff1d(np.arange(len(rows)), rest)
    ranked = keep[np.argsort(-costs[keep], kind="stable")]
    tuples = [[rows[b] for b in ranked[t * dp_size:(t + 1) * dp_size]] for t in range(n_tuples)]
    seq_cost = cost.sequence_costs(entries)
    for group in tuples:
        _repack(group, entries, seq_cost, max_len)
    shuffled = [tuples[t] for t in rng.permutation(n_tuples)]
    order = []
    for first in range(0, n_tuples, rows_per_step):
        order += _step(shuffled[first:first + rows_per_step], seq_cost, dp_size, sampler)
    order += [rows[b] for b in rest]
    return _assemble(bins, order)


def _step(group_tuples: list, seq_cost: np.ndarray, dp_size: int, sampler: str) -> list:
    """The rows of one step in the sampler's order: each rank one row of every tuple, the tuple's
    heaviest row to the rank with the least cost so far."""
    load = np.zeros(dp_size)
    ranks: list[list] = [[] for _ in range(dp_size)]
    for group in group_tuples:
        row_cost = np.array([seq_cost[row].sum() for row in group])
        for row, rank in zip(np.argsort(-row_cost, kind="stable"), np.argsort(load, kind="stable")):
            ranks[rank].append(group[row])
            load[rank] += row_cost[row]
    if sampler == "distributed":  # row j*N + r of the step is rank r's j-th
        return [ranks[r][j] for j in range(len(group_tuples)) for r in range(dp_size)]
    return [row for rank in ranks for row in rank]  # rank r's rows are consecutive


def _repack(group: list, entries: np.ndarray, seq_cost: np.ndarray, max_len: int) -> None:
    """Move or swap sequences between the heaviest and the lightest row of ``group`` (in place) while
    that lowers the heavier of the two, until the rows' costs are within TOLERANCE of their mean."""
    if len(group) < 2:
        return
    costs = np.array([seq_cost[row].sum() for row in group])
    tokens = np.array([entries[row].sum() for row in group])
    for _ in range(_MAX_MOVES):
        heavy, light = int(np.argmax(costs)), int(np.argmin(costs))
        gap = costs[heavy] - costs[light]
        if costs[heavy] <= (1 + TOLERANCE) * costs.mean() or gap <= 0:
            return
        move = _best_move(group[heavy], group[light], entries, seq_cost, gap,
                          max_len - tokens[light], max_len - tokens[heavy])
        if move is None:
            return
        x, y = move  # entry x leaves heavy for light; entry y (or none) goes the other way
        out_h = group[heavy][group[heavy] != x]
        out_l = group[light] if y is None else group[light][group[light] != y]
        group[heavy] = out_h if y is None else np.append(out_h, y)
        group[light] = np.append(out_l, x)
        delta = seq_cost[x] - (0.0 if y is None else seq_cost[y])
        size = entries[x] - (0 if y is None else entries[y])
        costs[heavy] -= delta
        costs[light] += delta
        tokens[heavy] -= size
        tokens[light] += size


def _best_move(heavy: np.ndarray, light: np.ndarray, entries, seq_cost, gap: float, room_light: int,
               room_heavy: int):
    """(x, y): the entry of ``heavy`` to move to ``light`` and the one (or None) to bring back that
    leaves the pair's cost difference smallest, if it is smaller than ``gap``; else None."""
    cx, cy = seq_cost[heavy], seq_cost[light]
    lx, ly = entries[heavy].astype(np.int64), entries[light].astype(np.int64)
    best, choice = gap, None
    moved = np.abs(gap - 2 * cx)  # one entry moved, none back
    moved[lx > room_light] = np.inf
    if moved.size and moved.min() < best:
        best, choice = float(moved.min()), (heavy[int(moved.argmin())], None)
    if cy.size:
        swapped = np.abs(gap - 2 * (cx[:, None] - cy[None, :]))
        grow = lx[:, None] - ly[None, :]  # tokens light gains (heavy loses)
        swapped[(grow > room_light) | (-grow > room_heavy)] = np.inf
        k = int(swapped.argmin())
        if swapped.flat[k] < best - 1e-9 * gap:
            i, j = divmod(k, cy.size)
            best, choice = float(swapped.flat[k]), (heavy[i], light[j])
    return choice


def _assemble(bins: Bins, order: list) -> Bins:
    """A Bins whose rows hold these entry indices of ``bins``, in this order."""
    sizes = np.array([len(row) for row in order], dtype=np.int64)
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    take = np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64)

    def pick(values):
        return None if values is None else values[take]

    return Bins(items=bins.items[take], offsets=offsets, starts=pick(bins.starts), lengths=pick(bins.lengths))


def step_efficiency(costs: np.ndarray, dp_size: int, rows_per_step: int = 1, sampler: str = "distributed") -> float:
    """Mean over whole steps of (mean rank cost / slowest rank cost), rows dealt to ranks in this
    ``costs`` order by ``sampler`` (1.0 where there is no whole step)."""
    per_step = dp_size * rows_per_step
    steps = len(costs) // per_step
    if steps == 0:
        return 1.0
    whole = np.asarray(costs[: steps * per_step], dtype=np.float64)
    if sampler == "accelerate":  # rank r's rows are consecutive
        rank = whole.reshape(steps, dp_size, rows_per_step).sum(axis=2)
    else:  # row j*N + r of the step is rank r's j-th
        rank = whole.reshape(steps, rows_per_step, dp_size).sum(axis=1)
    return float(np.mean(rank.mean(axis=1) / rank.max(axis=1)))


def can_balance(strategy) -> bool:
    """Whether rows of ``strategy`` (a :class:`packprep.packing.Strategy`) can be balanced: whole rows of
    at most max_len tokens that a packer filled (greedy, bfd), not cut samples or one sample a row."""
    return not (strategy.cuts_samples or strategy.rows_may_exceed_max_len or strategy.baseline)


def balance_summary(entry_lengths, offsets, dp_size: int, rows_per_step: int, sampler: str, cost: CostModel,
                    seed: int = 0) -> dict:
    """What the manifest records of rows in their written order: the predicted step efficiency as
    written and with the same rows dealt by a shuffling sampler, and the cost model."""
    costs = cost.row_costs(entry_lengths, offsets)
    shuffled = costs[np.random.default_rng(seed).permutation(len(costs))]
    return {
        "dp_size": int(dp_size),
        "rows_per_step": int(rows_per_step),
        "sampler": sampler,
        "steps": len(costs) // (dp_size * rows_per_step),
        "step_efficiency": round(step_efficiency(costs, dp_size, rows_per_step, sampler), 4),
        "step_efficiency_shuffled": round(step_efficiency(shuffled, dp_size, rows_per_step, sampler), 4),
        "attention_share": round(cost.attention_share(entry_lengths), 4),
        "cost_model": cost.as_dict(),
    }
