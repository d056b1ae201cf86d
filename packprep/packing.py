"""Packing engine: a pure function from token lengths to bins.

Everything here works on a 1-D integer array of sample lengths and returns a
:class:`Bins` (CSR form: ``items`` grouped by bin, ``offsets`` of length
``n_bins + 1``).  No I/O, no tokenizer, no imports from the rest of packprep but its kernels.

Strategies: the :data:`STRATEGY_TABLE` at the end of this module, one :class:`Strategy` record
each (what it does, and what the rest of packprep needs to know about it).  Adding a strategy is
one entry there plus its tests.

The numba kernels and how they work are in :mod:`packprep.packing_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import packing_kernels as kernels

__all__ = [
    "Bins",
    "Strategy",
    "STRATEGY_TABLE",
    "STRATEGIES",
    "ROW_ORDERS",
    "pack_lengths",
    "order_bins",
    "split_pieces",
    "pieces_to_bins",
    "lower_bound",
]

ROW_ORDERS = ("shuffle", "length", "input")

_MAX_LEN_LIMIT = 2**31 - 1
_INF = np.int64(1) << np.int64(62)
# greedy/bfd use arrays indexed by remaining capacity (0..max_len) up to this
# max_len; above it, structures indexed by bin (memory O(n), slower).
CLASS_LIMIT = 1 << 20


@dataclass(frozen=True)
class Bins:
    """Bins in CSR form.

    ``items[offsets[b]:offsets[b+1]]`` are the item indices of bin ``b``.  When
    pieces exist (``random``, or bins mapped back from :func:`split_pieces`),
    ``starts``/``lengths`` are aligned with ``items``: the first token of the
    piece inside its item and the piece length.  Otherwise they are ``None`` and
    each entry is a whole item.  ``items`` has :func:`index_dtype` of the item
    count (int32 below 2**31 items), ``starts``/``lengths`` the lengths' dtype
    (int32 unless a length is 2**31 or more); ``offsets`` is int64.
    """

    items: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray | None = None
    lengths: np.ndarray | None = None

    @property
    def n_bins(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def entry_lengths(self, lengths) -> np.ndarray:
        """Token count of each entry of ``items`` (piece length when pieces exist)."""
        if self.lengths is not None:
            return self.lengths.astype(np.int64, copy=False)
        return np.asarray(lengths)[self.items].astype(np.int64, copy=False)

    def bin_lengths(self, lengths) -> np.ndarray:
        """Total tokens per bin (int64, length ``n_bins``)."""
        per_entry = self.entry_lengths(lengths)
        cs = np.zeros(per_entry.shape[0] + 1, dtype=np.int64)
        np.cumsum(per_entry, out=cs[1:])
        return cs[self.offsets[1:]] - cs[self.offsets[:-1]]

    def __len__(self) -> int:
        return self.n_bins


# --------------------------------------------------------------------------
# validation helpers


def index_dtype(n: int) -> type:
    """The dtype of indices into (and counts of) ``n`` things: int32 while they fit, else int64."""
    return np.int32 if n < 2**31 else np.int64


def _as_lengths(lengths) -> np.ndarray:
    """Checked lengths, contiguous, as int32 (int64 if one does not fit): what the kernels take."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"lengths must have an integer dtype, got {arr.dtype}")
    mn = int(arr.min())
    if mn < 1:
        bad = int(np.flatnonzero(arr < 1)[0])
        raise ValueError(f"all lengths must be >= 1; lengths[{bad}] = {int(arr[bad])}")
    top = int(arr.max())
    if top > np.iinfo(np.int64).max:
        raise ValueError("lengths do not fit in int64")
    return np.ascontiguousarray(arr, dtype=index_dtype(top))


def _check_max_len(max_len) -> int:
    if isinstance(max_len, (bool, np.bool_)) or not isinstance(max_len, (int, np.integer)):
        raise ValueError(f"max_len must be an integer, got {max_len!r}")
    max_len = int(max_len)
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if max_len > _MAX_LEN_LIMIT:
        raise ValueError(f"max_len must be < 2**31, got {max_len}")
    return max_len


def _check_fits(lengths: np.ndarray, max_len: int, strategy: str) -> None:
    if lengths.size and int(lengths.max()) > max_len:
        bad = np.flatnonzero(lengths > max_len)
        raise ValueError(
            f"strategy {strategy!r}: {bad.size} item(s) longer than max_len={max_len} "
            f"(first: lengths[{int(bad[0])}] = {int(lengths[bad[0]])}); apply an overlong "
            f"policy first (truncate, drop, or split_pieces)"
        )


def lower_bound(lengths, max_len) -> int:
    """``ceil(sum(lengths) / max_len)``: no packing can use fewer bins."""
    max_len = _check_max_len(max_len)
    total = int(np.sum(lengths, dtype=np.int64))
    return -(-total // max_len)


# --------------------------------------------------------------------------
# strategies


def _sorted_order(lengths: np.ndarray, max_len: int) -> np.ndarray:
    n = lengths.shape[0]
    if max_len <= 4 * n + (1 << 16):
        counts = np.zeros(max_len + 1, dtype=np.int64)
        order = np.empty(n, dtype=index_dtype(n))
        kernels._counting_order_desc(lengths, max_len, counts, order)
        return order
    return np.argsort(-lengths, kind="stable").astype(index_dtype(n), copy=False)


def _bin_bound(lengths: np.ndarray, max_len: int) -> int:
    # any first/best-fit packing has at most one bin at most half full, so
    # n_bins <= 2*sum/max_len + 1; and never more bins than items.
    total = int(lengths.sum(dtype=np.int64))
    return max(1, min(lengths.shape[0], 2 * total // max_len + 2))


def _csr(order, bin_of, nb) -> Bins:
    offsets = np.zeros(nb + 1, dtype=np.int64)
    items = np.empty(order.shape[0], dtype=order.dtype)
    kernels._csr_from_bin_of(order, bin_of, nb, offsets, items)
    return Bins(items=items, offsets=offsets)


def _empty_bins(with_pieces: bool = False) -> Bins:
    z = np.zeros(0, dtype=np.int32)
    if with_pieces:
        return Bins(items=z, offsets=np.zeros(1, dtype=np.int64), starts=z.copy(), lengths=z.copy())
    return Bins(items=z, offsets=np.zeros(1, dtype=np.int64))


def _pack_greedy(lengths: np.ndarray, max_len: int) -> Bins:
    n = lengths.shape[0]
    if n == 0:
        return _empty_bins()
    order = _sorted_order(lengths, max_len)
    bound = _bin_bound(lengths, max_len)
    index = index_dtype(n)  # bin numbers: never more bins than items
    bin_of = np.empty(n, dtype=index)
    if max_len > CLASS_LIMIT:
        size = 1
        while size < bound:
            size *= 2
        tree = np.empty(2 * size, dtype=np.int64)
        nb = kernels._ffd_tree_kernel(lengths, order, np.int64(max_len), tree, bin_of)
        del tree
        return _csr(order, bin_of, nb)
    root = np.full(max_len + 1, -1, dtype=index)
    child = np.empty(bound, dtype=index)
    sibling = np.empty(bound, dtype=index)
    scratch = np.empty(bound, dtype=index)
    bincls = np.empty(bound, dtype=np.int32)  # room left in a bin: at most max_len < 2**31
    size = 1
    while size < max_len + 1:
        size *= 2
    ct = np.full(2 * size, _INF, dtype=np.int64)  # ct[0] (unused node) holds the INF sentinel
    nb = kernels._ffd_kernel(lengths, order, np.int64(max_len), root, child, sibling, scratch, ct, bincls, bin_of)
    del root, child, sibling, scratch, bincls, ct
    return _csr(order, bin_of, nb)


def _pack_bfd(lengths: np.ndarray, max_len: int) -> Bins:
    n = lengths.shape[0]
    if n == 0:
        return _empty_bins()
    order = _sorted_order(lengths, max_len)
    if max_len > CLASS_LIMIT:
        return _pack_bfd_large(lengths, order, max_len)
    bound = _bin_bound(lengths, max_len)
    index = index_dtype(n)
    root = np.full(max_len + 1, -1, dtype=index)
    child = np.empty(bound, dtype=index)
    sibling = np.empty(bound, dtype=index)
    scratch = np.empty(bound, dtype=index)
    w0 = np.zeros((max_len >> 6) + 1, dtype=np.uint64)
    w1 = np.zeros((w0.shape[0] >> 6) + 1, dtype=np.uint64)
    bin_of = np.empty(n, dtype=index)
    nb = kernels._bfd_kernel(lengths, order, np.int64(max_len), root, child, sibling, scratch, w0, w1, bin_of)
    del root, child, sibling, scratch
    return _csr(order, bin_of, nb)


def _pack_bfd_large(lengths: np.ndarray, order: np.ndarray, max_len: int) -> Bins:
    """Best-fit-decreasing for very large max_len (per-capacity arrays would be
    too big): a sorted list of distinct open capacities plus a heap of bin
    numbers per capacity.  Same result as the numba kernel, slower."""
    import bisect
    import heapq

    n = lengths.shape[0]
    bin_of = np.empty(n, dtype=index_dtype(n))
    caps: list[int] = []  # sorted distinct remaining capacities of open bins
    heaps: dict[int, list[int]] = {}
    min_len = int(lengths[order[-1]])
    ls = lengths[order].tolist()
    nb = 0
    i = 0
    while i < n:
        L = ls[i]
        j = i + 1
        while j < n and ls[j] == L:
            j += 1
        while i < j:
            k = bisect.bisect_left(caps, L)
            if k == len(caps):
                b = nb
                nb += 1
                c = max_len
            else:
                c = caps[k]
                h = heaps[c]
                b = heapq.heappop(h)
                if not h:
                    del heaps[c]
                    caps.pop(k)
            m = min(c // L, j - i)
            bin_of[i : i + m] = b
            i += m
            c -= m * L
            if c >= min_len:
                h = heaps.get(c)
                if h is None:
                    heaps[c] = [b]
                    bisect.insort(caps, c)
                else:
                    heapq.heappush(h, b)
    return _csr(order, bin_of, nb)


def _pack_random(lengths: np.ndarray, max_len: int, seed) -> Bins:
    n = lengths.shape[0]
    if n == 0:
        return _empty_bins(with_pieces=True)
    perm = np.random.default_rng(seed).permutation(n).astype(index_dtype(n), copy=False)
    total = int(lengths.sum(dtype=np.int64))
    # every item contributes one piece plus one per cut strictly inside it
    max_pieces = n + total // max_len
    items = np.empty(max_pieces, dtype=index_dtype(n))
    starts = np.empty(max_pieces, dtype=lengths.dtype)
    plens = np.empty(max_pieces, dtype=lengths.dtype)
    offsets = np.zeros(-(-total // max_len) + 1, dtype=np.int64)
    p, b = kernels._random_kernel(perm, lengths, np.int64(max_len), items, starts, plens, offsets)
    assert b == offsets.shape[0] - 1
    if p != max_pieces:
        items, starts, plens = items[:p].copy(), starts[:p].copy(), plens[:p].copy()
    return Bins(items=items, offsets=offsets, starts=starts, lengths=plens)


def _pack_pad(lengths: np.ndarray) -> Bins:
    n = lengths.shape[0]
    return Bins(items=np.arange(n, dtype=index_dtype(n)), offsets=np.arange(n + 1, dtype=np.int64))


def _pack_minibatch(lengths: np.ndarray, seed, samples_per_row) -> Bins:
    if samples_per_row is None:
        raise ValueError("strategy 'minibatch' requires samples_per_row (>= 1)")
    if isinstance(samples_per_row, (bool, np.bool_)) or not isinstance(samples_per_row, (int, np.integer)):
        raise ValueError(f"samples_per_row must be an integer, got {samples_per_row!r}")
    k = int(samples_per_row)
    if k < 1:
        raise ValueError(f"samples_per_row must be >= 1, got {k}")
    n = lengths.shape[0]
    if n == 0:
        return _empty_bins()
    perm = np.random.default_rng(seed).permutation(n).astype(index_dtype(n), copy=False)
    offsets = np.minimum(np.arange(0, n + k, k, dtype=np.int64), n)
    offsets = offsets[: -(-n // k) + 1]
    return Bins(items=perm, offsets=offsets)


@dataclass(frozen=True)
class Strategy:
    """One packing strategy: its kernel, and what the planner, stats, verify and the CLI need to know."""

    name: str
    pack: Callable[..., Bins]  # (lengths, max_len, seed, samples_per_row) -> Bins; lengths already checked
    help: str  # one line for --help and the README
    cuts_samples: bool = False  # it cuts samples into pieces itself, where only the labels know the cost
    rows_may_exceed_max_len: bool = False  # max_len is not a bound on a row (nothing is split to fit)
    needs_samples_per_row: bool = False
    baseline: bool = False  # one sample a row: what the others are compared with

    @property
    def items_must_fit(self) -> bool:
        """Whether every length must be <= max_len before packing (else an overlong policy applies)."""
        return not (self.cuts_samples or self.rows_may_exceed_max_len)


STRATEGY_TABLE: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("greedy", lambda a, m, seed, k: _pack_greedy(a, m),
                 "first-fit-decreasing: exact, the fewest rows in practice, samples kept whole"),
        Strategy("bfd", lambda a, m, seed, k: _pack_bfd(a, m), "best-fit-decreasing"),
        Strategy("random", lambda a, m, seed, k: _pack_random(a, m, seed),
                 "shuffle, concatenate, cut every max_len tokens (splits samples)", cuts_samples=True),
        Strategy("pad", lambda a, m, seed, k: _pack_pad(a), "one sample a row", baseline=True),
        Strategy("minibatch", lambda a, m, seed, k: _pack_minibatch(a, seed, k),
                 "samples_per_row shuffled samples a row (rows may exceed max_len)",
                 rows_may_exceed_max_len=True, needs_samples_per_row=True),
    )
}
STRATEGIES = tuple(STRATEGY_TABLE)


def get_strategy(strategy: str | Strategy) -> Strategy:
    """The :class:`Strategy` of that name (ValueError naming the choices if there is none)."""
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return STRATEGY_TABLE[strategy]
    except (KeyError, TypeError):
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}") from None


def pack_lengths(lengths, max_len, strategy="greedy", seed=0, samples_per_row=None) -> Bins:
    """Pack items of the given token ``lengths`` into bins of ``max_len`` tokens.

    Args:
        lengths: 1-D integer array, every value >= 1.  Where the strategy's ``items_must_fit``
            (``greedy``, ``bfd``, ``pad``), every value must be <= ``max_len`` (apply an overlong
            policy first, e.g. :func:`split_pieces`); ``random`` cuts anything;
            ``minibatch`` does not check.
        max_len: bin capacity in tokens (1 <= max_len < 2**31).
        strategy: a name in :data:`STRATEGIES` (or a :class:`Strategy`).
        seed: seed for ``random`` and ``minibatch`` (``np.random.default_rng``).
        samples_per_row: items per bin, required for ``minibatch``.

    Returns:
        :class:`Bins`.  ``starts``/``lengths`` are set only where the strategy cuts samples.
        The result depends only on the arguments (never on process count).
    """
    chosen = get_strategy(strategy)
    max_len = _check_max_len(max_len)
    arr = _as_lengths(lengths)
    if chosen.items_must_fit:
        _check_fits(arr, max_len, chosen.name)
    return chosen.pack(arr, max_len, seed, samples_per_row)


# --------------------------------------------------------------------------
# overlong split and row order


def split_pieces(lengths, max_len) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every item into ``max_len``-sized pieces (the last may be shorter).

    Returns ``(item, start, length)`` arrays, one row per piece, in item
    order (``item`` of :func:`index_dtype`, ``start``/``length`` of the
    lengths' dtype, as :class:`Bins` has them); an item with length <= max_len
    is a single piece ``(i, 0, len)``.  Pack the piece lengths with
    :func:`pack_lengths`, then map the bins back to items with :func:`pieces_to_bins`.
    """
    max_len = _check_max_len(max_len)
    arr = _as_lengths(lengths)
    n_pieces = arr // max_len + (arr % max_len > 0)  # (not arr + max_len - 1: that overflows int32)
    item = np.repeat(np.arange(arr.shape[0], dtype=index_dtype(arr.shape[0])), n_pieces)
    first = np.zeros(arr.shape[0] + 1, dtype=np.int64)
    np.cumsum(n_pieces, out=first[1:])
    k = np.arange(item.shape[0], dtype=np.int64) - first[item]
    start = (k * max_len).astype(arr.dtype)
    length = np.minimum(arr[item] - start, max_len).astype(arr.dtype)
    return item, start, length


def pieces_to_bins(bins: Bins, item, start, length) -> Bins:
    """Map ``bins`` packed over pieces (indices into the piece arrays returned by
    :func:`split_pieces`) back to original items, with ``starts``/``lengths``."""
    item, start, length = np.asarray(item), np.asarray(start), np.asarray(length)
    idx = bins.items
    if bins.lengths is not None:  # the packer cut the pieces further (random)
        return Bins(items=item[idx], offsets=bins.offsets.copy(), starts=start[idx] + bins.starts,
                    lengths=bins.lengths.copy())
    return Bins(items=item[idx], offsets=bins.offsets.copy(), starts=start[idx], lengths=length[idx])


def order_bins(bins: Bins, row_order="shuffle", seed=0) -> Bins:
    """Return the same bins in a new order (entries within a bin keep their order).

    ``shuffle``: ``np.random.default_rng(seed).permutation(n_bins)``.
    ``length``: the packer's own order (for greedy/bfd: creation order, i.e.
    by decreasing first item).  ``input``: by the smallest item index in each
    bin (stable).
    """
    if row_order not in ROW_ORDERS:
        raise ValueError(f"unknown row_order {row_order!r}; expected one of {ROW_ORDERS}")
    nb = bins.n_bins
    if row_order == "length":
        return Bins(
            items=bins.items.copy(),
            offsets=bins.offsets.copy(),
            starts=None if bins.starts is None else bins.starts.copy(),
            lengths=None if bins.lengths is None else bins.lengths.copy(),
        )
    if row_order == "shuffle":
        perm = np.random.default_rng(seed).permutation(nb)
    else:
        sizes = np.diff(bins.offsets)
        if nb and np.any(sizes == 0):
            key = np.full(nb, np.iinfo(np.int64).max, dtype=np.int64)
            nz = sizes > 0
            key[nz] = np.minimum.reduceat(bins.items, bins.offsets[:-1][nz])
        elif nb:
            key = np.minimum.reduceat(bins.items, bins.offsets[:-1])
        else:
            key = np.zeros(0, dtype=np.int64)
        perm = np.argsort(key, kind="stable")
    return _take_bins(bins, perm)


def _take_bins(bins: Bins, perm: np.ndarray) -> Bins:
    """Bins ``perm[0], perm[1], ...`` of ``bins``, copied entry by entry: no index array of one
    entry a sequence (an int64 gather index would be the largest array of the planner)."""
    offsets = np.zeros(perm.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.diff(bins.offsets)[perm], out=offsets[1:])

    def take(values):
        if values is None:
            return None
        out = np.empty_like(values)
        kernels._take_kernel(values, bins.offsets, perm, out)
        return out

    return Bins(items=take(bins.items), offsets=offsets, starts=take(bins.starts), lengths=take(bins.lengths))
