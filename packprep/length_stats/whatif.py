"""stats, the plan: what ``pack`` would produce for each max_len × strategy, from lengths alone.

Pure: it plans with pack's own planner (:func:`packprep.plan.plan_bins`) and ``--overlong`` rule
(:func:`packprep.plan.overlong_fates`), so rows, tokens, padding, lost tokens and optimizer steps
are exactly what ``pack`` produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from ..balance import balance_bins, balance_summary, can_balance
from ..cost import CostModel, model_cost
from ..fates import TRUNCATED
from ..packing import STRATEGY_TABLE, Bins, order_bins, split_pieces
from ..plan import overlong_fates, plan_bins
from ..settings import check_what_if

DEFAULT_MAX_LENS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_STRATEGIES = ("pad", "random", "greedy")


def what_if(
    lengths,
    supervised=None,
    max_lens: Iterable[int] = DEFAULT_MAX_LENS,
    strategies: Iterable[str] = DEFAULT_STRATEGIES,
    *,
    supervised_within: Mapping[int, np.ndarray] | None = None,
    split_masked: Mapping[int, np.ndarray] | None = None,
    turns_cut: Mapping[int, np.ndarray] | None = None,
    overlong: str = "truncate",
    seed: int = 0,
    samples_per_row: int | None = None,
    partition_size: int | None = None,
    global_batch_size: int = 64,
    epochs: int = 1,
    dp_size: int | None = None,
    rows_per_step: int = 1,
    cost: CostModel | None = None,
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
        turns_cut: for a max_len ``L``, the turns of each sample that ``--overlong`` leaves
            without a trained token (:func:`packprep.plan.cut_cost`). With it (and
            ``supervised_within`` or ``split_masked``), each row has ``turns_cut`` and
            ``supervised_cut``: what ``pack`` counts in its manifest.
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
    ``attention_vs_pad``. With ``dp_size`` (and ``cost``, a :class:`packprep.cost.CostModel`, by default
    :func:`packprep.cost.model_cost`'s), also
    ``step_efficiency`` (rows dealt to the ranks in shuffled order, ``rows_per_step`` each),
    ``step_efficiency_balanced`` (as ``pack --balance-dp``; None for a strategy it does not apply to)
    and ``attention_share`` (the cost model's share of attention in these rows).
    """
    lengths, supervised = _as_arrays(lengths, supervised)
    max_lens, strategies = check_what_if(max_lens, strategies, global_batch_size, epochs, overlong, samples_per_row)
    global_batch_size, epochs = int(global_batch_size), int(epochs)
    cost = cost or model_cost()
    table = []
    for max_len in max_lens:
        fit = _fit(lengths, supervised, max_len, overlong, supervised_within, split_masked, turns_cut)
        for strategy in strategies:
            bins, entry, row_lengths = _plan(fit.lens, max_len, strategy, seed, samples_per_row, partition_size,
                                             split=overlong == "split")
            table.append({
                **_row(fit, max_len, strategy, entry, row_lengths, global_batch_size, epochs),
                **(_steps(bins, fit.lens, entry, max_len, strategy, dp_size, rows_per_step, cost, seed)
                   if dp_size else {}),
            })
    return table


def _as_arrays(lengths, supervised) -> tuple[np.ndarray, np.ndarray]:
    """``lengths`` and ``supervised`` as int64 arrays, checked: 1-D, each length >= 1, one value each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths must be 1-D")
    if lengths.size and int(lengths.min()) < 1:
        raise ValueError("every length must be >= 1")
    supervised = np.zeros_like(lengths) if supervised is None else np.asarray(supervised, dtype=np.int64)
    if supervised.shape != lengths.shape:
        raise ValueError("supervised must have one value per length")
    return lengths, supervised


@dataclass(frozen=True)
class _Fit:
    """The samples kept at one max_len under ``--overlong``, and what the cut cost."""

    lens: np.ndarray  # the kept samples' lengths, truncated ones at max_len
    n_over: int
    lost: int
    sup: int
    masked: int
    split_exact: bool
    rejected: int
    tokens: int
    pieces: np.ndarray | None  # the pieces' lengths under split, if any sample is over
    pad_attention: int
    cut: tuple[int, int] | None  # turns and supervised tokens --overlong leaves untrained (truncate, split)


def _fit(lengths, supervised, max_len, overlong, supervised_within, split_masked, turns_cut=None) -> _Fit:
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
    pieces = None
    if overlong == "split" and n_over:
        _, _, pieces = split_pieces(lens, max_len)
    pad_attention = int(np.square(pieces if pieces is not None else lens, dtype=np.int64).sum())
    cut = None
    if turns_cut is not None and max_len in turns_cut:  # drop cuts nothing: it rejects
        cut = (0, 0) if overlong == "drop" else (int(np.asarray(turns_cut[max_len], dtype=np.int64).sum()),
                                                 masked if overlong == "split" else int((supervised - within).sum()))
    return _Fit(lens, n_over, lost, sup, masked, split_exact, int((~keep).sum()), int(lens.sum()), pieces,
                pad_attention, cut)


def _row(fit: _Fit, max_len: int, strategy: str, entry, row_lengths, global_batch_size: int, epochs: int) -> dict:
    """One what-if row: a strategy's rows, efficiency, supervised tokens and attention at max_len."""
    rows = len(row_lengths)
    width = max(max_len, int(row_lengths.max()) if rows else 0)
    sup_here, exact = fit.sup, True
    if fit.pieces is not None and not STRATEGY_TABLE[strategy].rows_may_exceed_max_len:
        sup_here, exact = fit.sup - fit.masked, fit.split_exact  # first labels of pieces become -100
    if STRATEGY_TABLE[strategy].cuts_samples and len(entry) > (
        len(fit.pieces) if fit.pieces is not None else len(fit.lens)
    ):
        exact = False  # the strategy cut samples at places only the labels know
    attention = int(np.square(entry).sum())
    cut = {}
    if fit.cut is not None:  # split: pieces only where rows must fit
        whole = fit.pieces is not None and STRATEGY_TABLE[strategy].rows_may_exceed_max_len
        cut = dict(zip(("turns_cut", "supervised_cut"), (0, 0) if whole else fit.cut))
    return {
        "max_len": max_len,
        "strategy": strategy,
        "rows": rows,
        "tokens": fit.tokens,
        "efficiency": round(fit.tokens / (rows * width), 6) if rows else 0.0,
        "padding_tokens": rows * width - fit.tokens,
        "overlong_samples": fit.n_over,
        "overlong_tokens_lost": fit.lost,
        "rejected": fit.rejected,
        "sequences": int(len(entry)),
        "samples_per_row": round(len(entry) / rows, 3) if rows else 0.0,
        "supervised_tokens": sup_here,
        "supervised_exact": exact,
        "optimizer_steps": -(-rows // global_batch_size) * epochs,
        "attention_cost": attention,
        "attention_vs_pad": round(attention / fit.pad_attention, 4) if fit.pad_attention else 0.0,
        **cut,
    }


def _steps(bins, lens, entry, max_len, strategy, dp_size, rows_per_step, cost, seed) -> dict:
    """The predicted step efficiency of these rows shuffled, and balanced as pack --balance-dp would."""
    if not len(entry):
        return {"step_efficiency": 1.0, "step_efficiency_balanced": None, "attention_share": 0.0}
    shuffled = order_bins(bins, "shuffle", seed)
    plain = balance_summary(shuffled.entry_lengths(lens), shuffled.offsets, dp_size, rows_per_step, "distributed",
                            cost, seed)
    balanced = None
    if can_balance(STRATEGY_TABLE[strategy]):
        out = balance_bins(bins, lens, max_len, dp_size, rows_per_step, cost=cost, seed=seed)
        balanced = balance_summary(out.entry_lengths(lens), out.offsets, dp_size, rows_per_step, "distributed",
                                   cost, seed)["step_efficiency"]
    return {"step_efficiency": plain["step_efficiency"], "step_efficiency_balanced": balanced,
            "attention_share": plain["attention_share"]}


def _plan(lens, max_len, strategy, seed, samples_per_row, partition_size,
          split) -> tuple[Bins | None, np.ndarray, np.ndarray]:
    """(the bins, length of every packed sequence or piece, length of every row), exactly as ``pack`` packs ``lens``."""
    if len(lens) == 0:
        return None, np.zeros(0, np.int64), np.zeros(0, np.int64)
    bins = plan_bins(lens, max_len, strategy, seed=seed, samples_per_row=samples_per_row,
                     overlong="split" if split else "truncate", partition_size=partition_size)
    return bins, bins.entry_lengths(lens), bins.bin_lengths(lens)
