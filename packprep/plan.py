"""Step 4a: plan the rows from lengths alone: the ``--overlong`` rule, partitions, the strategy's kernel.

``pack`` packs with :func:`plan_bins` and ``stats`` plans its what-if table with the same call, so
the table is what ``pack`` produces. What each strategy is and does lives in one place,
:data:`packprep.packing.STRATEGY_TABLE`; this module only asks it.
"""

from __future__ import annotations

import numpy as np

from .fates import DROPPED, EMPTIED, PACKED, TRUNCATED
from .layout import IGNORE_INDEX
from .packing import STRATEGY_TABLE, Bins, index_dtype, pack_lengths, pieces_to_bins, split_pieces

OVERLONG = ("truncate", "drop", "split")
WHOLE = PACKED  # what --overlong decides for a sample that stays whole (packprep.fates)


def overlong_fates(lengths, max_len: int, overlong: str, supervised_within=None) -> np.ndarray:
    """What ``--overlong`` does to each sample, before packing (int8 array of ``packprep.fates`` codes).

    ``WHOLE`` (``PACKED``): it fits, or ``split`` leaves it whole here and the planner cuts it into pieces.
    ``TRUNCATED``: cut to its first ``max_len`` tokens. ``DROPPED`` (``drop``) and ``EMPTIED``
    (truncated with no supervised token left) are rejected. ``supervised_within`` holds each
    sample's supervised tokens within its first ``max_len`` (position 0 not counted); without it
    no truncated sample is taken to be emptied.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > max_len
    fates = np.full(len(lengths), WHOLE, dtype=np.int8)
    if overlong == "drop":
        fates[over] = DROPPED
    elif overlong == "truncate":
        fates[over] = TRUNCATED
        if supervised_within is not None:
            fates[over & (np.asarray(supervised_within, dtype=np.int64) <= 0)] = EMPTIED
    return fates


def cut_cost(labels, max_len: int, pieces: bool = False) -> tuple[int, int]:
    """(turns, supervised tokens) that ``--max-len`` leaves untrained in one sequence: truncation
    (and a sequence left out because it kept nothing to train) loses the labels from ``max_len``
    on; ``pieces`` (``--overlong split``) loses each piece's first label, at ``max_len``,
    ``2 * max_len``, ... A turn is a run of trained labels (position 0 never counts: it is a packed
    sequence's first label); it is lost once none of its labels is left."""
    labels = np.asarray(labels)
    if len(labels) <= max_len:
        return 0, 0
    trained = labels != IGNORE_INDEX
    trained[0] = False
    starts = np.flatnonzero(trained & ~np.concatenate([[False], trained[:-1]]))
    if not pieces:
        return int((starts >= max_len).sum()), int(trained[max_len:].sum())
    ends = np.flatnonzero(trained & ~np.concatenate([trained[1:], [False]]))  # the last label of each run
    alone = (starts == ends) & (starts % max_len == 0)  # a one-label turn at a piece's first label
    return int(alone.sum()), int(trained[max_len::max_len].sum())


def cut_text(counts: dict, max_len: int) -> str:
    """One line for people (pack, stats, the dataset card): what ``--max-len`` cost the turns."""
    turns, supervised = counts.get("turns_cut", 0), counts.get("supervised_cut", 0)
    if not (turns or supervised):
        return f"--max-len {max_len:,}: no assistant turn or supervised token cut"
    return (f"--max-len {max_len:,}: {turns:,} assistant turn{'s' * (turns != 1)} left without a trained token, "
            f"{supervised:,} supervised token{'s' * (supervised != 1)} cut (turns_cut, supervised_cut)")


def plan_bins(
    lengths,
    max_len: int,
    strategy: str = "greedy",
    *,
    seed: int = 0,
    samples_per_row: int | None = None,
    overlong: str = "truncate",
    partition_size: int | None = None,
) -> Bins:
    """The bins ``pack`` makes of these sequence lengths, before row order.

    ``lengths`` are the samples kept after :func:`overlong_fates` (truncated ones at ``max_len``).
    Each run of ``partition_size`` samples is packed on its own (None: all at once). Under
    ``overlong="split"``, a strategy whose rows must fit gets samples longer than ``max_len`` as
    pieces of ``max_len`` tokens; the bins then say which piece of which sample each entry is.
    """
    chosen = STRATEGY_TABLE[strategy] if isinstance(strategy, str) else strategy
    lengths = np.asarray(lengths)  # its own dtype: the packer takes int32 lengths without a copy
    size = partition_size or max(1, len(lengths))
    firsts = range(0, max(1, len(lengths)), size)
    split = overlong == "split" and not chosen.rows_may_exceed_max_len
    parts = [_pack_partition(lengths[lo : lo + size], max_len, chosen, seed, samples_per_row, split) for lo in firsts]
    return _concat_bins(parts, firsts)


def _pack_partition(lengths, max_len, strategy, seed, samples_per_row, split) -> Bins:
    if not split:
        return pack_lengths(lengths, max_len, strategy, seed, samples_per_row)
    item, start, length = split_pieces(lengths, max_len)
    return pieces_to_bins(pack_lengths(length, max_len, strategy, seed, samples_per_row), item, start, length)


def _concat_bins(parts: list[Bins], firsts) -> Bins:
    """Join the bins of consecutive partitions into one Bins over the whole item range (every part
    was packed the same way, so either all have pieces or none has)."""
    if len(parts) == 1:
        return parts[0]
    index = index_dtype(sum(len(part.items) for part in parts))
    items = np.concatenate([part.items.astype(index, copy=False) + first for part, first in zip(parts, firsts)])
    sizes = np.concatenate([np.diff(part.offsets) for part in parts])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if parts[0].starts is None:
        return Bins(items, offsets)
    return Bins(items, offsets, np.concatenate([p.starts for p in parts]), np.concatenate([p.lengths for p in parts]))
