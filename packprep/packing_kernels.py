"""The numba kernels of :mod:`packprep.packing`: pure loops over flat integer arrays.

Implementation notes (chosen by measurement, see benchmarks/bench_packing.py).
Lengths are bounded ints, so the decreasing order is a counting sort.  Both
``greedy`` and ``bfd`` group open bins by remaining capacity ``c`` (an int in
[0, max_len]): per ``c`` a pairing heap of bin numbers (links stored in flat
arrays indexed by bin).  ``greedy`` keeps a min segment tree over ``c`` of the
heap minima, so "the lowest-numbered bin with room >= L" is a range-min over
[L, max_len] in a tree of max_len+1 leaves that stays in cache; ``bfd`` keeps a
two-level bitmap of non-empty capacities, so "the least room >= L" is a
find-next-set-bit.  Items longer than ``max_len // 2`` each open their own bin
(no two fit together and none fits an earlier bin), and a run of equal lengths
is placed in one step per bin touched (the chosen bin stays the choice until it
is full).  The kernels are compiled by numba with ``cache=True``; numba itself is imported at the
first kernel call, not with this module (see :func:`njit`).

All work arrays are allocated with numpy in Python (not inside numba), so
``tracemalloc`` sees the true peak memory of a call.  Lengths and every array of
one entry an item (or a bin) are int32 wherever the values fit (:func:`index_dtype`):
``pack`` plans tens of millions of sequences in one process, and its memory is
these arrays.
"""

from __future__ import annotations

from functools import wraps
from typing import Callable

import numpy as np

# --------------------------------------------------------------------------
# numba kernels

_KERNELS: dict[str, tuple[Callable, dict]] = {}  # name -> (Python function, njit options)


def njit(**options):
    """``numba.njit(**options)``, applied when a kernel of this module is first called.

    Importing numba takes 0.15-0.5 s, and packing starts only after every record is tokenized, so
    importing this module (as ``packprep pack`` does at start-up) does not import numba. The first
    call hands every kernel to numba at once, so that kernels calling one another find numba
    functions under their names; with ``cache=True`` numba loads them from its cache.
    """

    def register(function):
        _KERNELS[function.__name__] = (function, options)

        @wraps(function)
        def first_call(*args):
            _jit_kernels()
            return globals()[function.__name__](*args)

        return first_call

    return register


def _jit_kernels() -> None:
    """Hand every kernel to numba. Where numba finds nowhere to cache them (the package folder and
    the home folder both read-only, no NUMBA_CACHE_DIR) it refuses ``cache=True``: compile them
    for this run only, and say how to keep them."""
    import warnings

    from numba import njit as numba_njit

    try:
        kernels = {name: numba_njit(**options)(function) for name, (function, options) in _KERNELS.items()}
    except RuntimeError as exc:  # numba: "cannot cache function ...: no locator available for file ..."
        warnings.warn(f"packing kernels are compiled anew on every run (a few seconds): {exc}; set "
                      "NUMBA_CACHE_DIR to a writable folder to keep them", stacklevel=3)
        kernels = {name: numba_njit(**{**options, "cache": False})(function)
                   for name, (function, options) in _KERNELS.items()}
    globals().update(kernels)


@njit(cache=True)
def _counting_order_desc(lengths, max_len, counts, order):
    """Stable order by length descending (ties: index ascending)."""
    n = lengths.shape[0]
    for i in range(n):
        counts[lengths[i]] += 1
    pos = 0
    for v in range(max_len, 0, -1):
        c = counts[v]
        counts[v] = pos
        pos += c
    for i in range(n):
        v = lengths[i]
        order[counts[v]] = i
        counts[v] += 1


@njit(cache=True, inline="always")
def _heap_pop(root, child, sibling, scratch, c):
    """Remove the minimum of pairing heap ``root[c]`` (two-pass); return the new root."""
    b = root[c]
    first = child[b]
    top = 0
    while first >= 0:
        a = first
        s = sibling[a]
        if s < 0:
            scratch[top] = a
            top += 1
            break
        first = sibling[s]
        sibling[a] = -1
        sibling[s] = -1
        if s < a:
            a, s = s, a
        sibling[s] = child[a]
        child[a] = s
        scratch[top] = a
        top += 1
    r = -1
    while top > 0:
        top -= 1
        a = scratch[top]
        if r < 0:
            r = a
        else:
            if a < r:
                a, r = r, a
            sibling[a] = child[r]
            child[r] = a
    root[c] = r
    return r


@njit(cache=True, inline="always")
def _heap_push(root, child, sibling, c, b):
    """Insert bin ``b`` into pairing heap ``root[c]``; return the new root."""
    child[b] = -1
    sibling[b] = -1
    r = root[c]
    if r < 0:
        root[c] = b
        return b
    if b < r:
        child[b] = r
        root[c] = b
        return b
    sibling[b] = child[r]
    child[r] = b
    return r


@njit(cache=True, inline="always")
def _ctree_set(ct, size, c, v):
    """Set leaf c of the min segment tree ``ct`` to v and fix its ancestors."""
    node = c + size
    ct[node] = v
    node >>= 1
    while node >= 1:
        a = ct[2 * node]
        d = ct[2 * node + 1]
        m = a if a <= d else d
        if ct[node] == m:
            break
        ct[node] = m
        node >>= 1


@njit(cache=True, inline="always")
def _run_end(lengths, order, i, n):
    """End of the run of equal lengths that starts at ``i`` (``order`` sorts them descending)."""
    j = i + 1
    while j < n and lengths[order[j]] == lengths[order[i]]:
        j += 1
    return j


@njit(cache=True, inline="always")
def _fill(bin_of, b, i, j, room, L):
    """Put as many of the equal items ``i..j-1`` (L tokens each) in bin ``b`` as its room holds; return how many."""
    m = min(room // L, j - i)
    bin_of[i : i + m] = b
    return m


@njit(cache=True)
def _ffd_kernel(lengths, order, max_len, root, child, sibling, scratch, ct, bincls, bin_of):
    """First-fit-decreasing.  Open bins are grouped by remaining capacity c:
    ``root[c]`` is a pairing heap (keyed by bin number) of the bins with exactly
    c tokens left, and ``ct`` is a min segment tree over c of the heap minima,
    so "lowest-numbered bin with room >= L" is a range-min over [L, max_len]
    (the tree has max_len+1 leaves: small and cache resident).  Returns n_bins.
    """
    n = order.shape[0]
    size = ct.shape[0] // 2
    INF = ct[0]
    nb = 0
    min_len = lengths[order[n - 1]]
    half = max_len // 2
    i = 0
    while i < n and lengths[order[i]] > half:
        c = max_len - lengths[order[i]]
        bin_of[i] = i
        if c >= min_len:
            bincls[i] = c
            r = _heap_push(root, child, sibling, c, i)
            if r == i:
                _ctree_set(ct, size, c, i)
        i += 1
    nb = i
    while i < n:
        L = lengths[order[i]]
        j = _run_end(lengths, order, i, n)
        while i < j:
            lo = L + size
            hi = max_len + size + 1
            best = INF
            while lo < hi:
                if lo & 1:
                    v = ct[lo]
                    if v < best:
                        best = v
                    lo += 1
                if hi & 1:
                    hi -= 1
                    v = ct[hi]
                    if v < best:
                        best = v
                lo >>= 1
                hi >>= 1
            if best == INF:
                b = nb
                nb += 1
                c = max_len
            else:
                b = best
                c = bincls[b]
                r = _heap_pop(root, child, sibling, scratch, c)
                _ctree_set(ct, size, c, INF if r < 0 else r)
            m = _fill(bin_of, b, i, j, c, L)
            i += m
            c -= m * L
            if c >= min_len:
                bincls[b] = c
                r = _heap_push(root, child, sibling, c, b)
                if r == b:
                    _ctree_set(ct, size, c, b)
    return nb

@njit(cache=True)
def _ffd_tree_kernel(lengths, order, max_len, tree, bin_of):
    """First-fit-decreasing over a max segment tree indexed by bin (memory
    O(bins), used when max_len is too large for per-capacity arrays).  Leaves of
    bins not yet opened hold max_len, so a new bin is just the leftmost leaf
    that fits.  Returns n_bins."""
    n = order.shape[0]
    size = tree.shape[0] // 2
    for p in range(size, 2 * size):
        tree[p] = max_len
    for p in range(size - 1, 0, -1):
        tree[p] = max_len
    nb = 0
    i = 0
    while i < n:
        L = lengths[order[i]]
        j = _run_end(lengths, order, i, n)
        while i < j:
            node = 1
            while node < size:
                node *= 2
                if tree[node] < L:
                    node += 1
            cap = tree[node]
            b = node - size
            m = _fill(bin_of, b, i, j, cap, L)
            i += m
            if b >= nb:
                nb = b + 1
            tree[node] = cap - m * L
            node //= 2
            while node >= 1:
                a = tree[2 * node]
                c = tree[2 * node + 1]
                v = a if a >= c else c
                if tree[node] == v:
                    break
                tree[node] = v
                node //= 2
    return nb


@njit(cache=True, inline="always")
def _ctz64(w):
    # index of the lowest set bit of a non-zero uint64 (de Bruijn)
    return _DEBRUIJN_TABLE[((w & (~w + np.uint64(1))) * np.uint64(0x03F79D71B4CB0A89)) >> np.uint64(58)]


_DEBRUIJN_TABLE = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _DEBRUIJN_TABLE[(((1 << _i) * 0x03F79D71B4CB0A89) & 0xFFFFFFFFFFFFFFFF) >> 58] = _i
del _i


@njit(cache=True, inline="always")
def _bit_set(w0, w1, c):
    w0[c >> 6] |= np.uint64(1) << np.uint64(c & 63)
    w1[c >> 12] |= np.uint64(1) << np.uint64((c >> 6) & 63)


@njit(cache=True, inline="always")
def _bit_clear(w0, w1, c):
    i = c >> 6
    w0[i] &= ~(np.uint64(1) << np.uint64(c & 63))
    if w0[i] == np.uint64(0):
        w1[i >> 6] &= ~(np.uint64(1) << np.uint64(i & 63))


@njit(cache=True, inline="always")
def _bit_next(w0, w1, c):
    """Smallest set position >= c, or -1."""
    i = c >> 6
    if i >= w0.shape[0]:
        return -1
    w = w0[i] & (~np.uint64(0) << np.uint64(c & 63))
    if w != np.uint64(0):
        return (i << 6) + _ctz64(w)
    i += 1
    j = i >> 6
    if j >= w1.shape[0]:
        return -1
    if (i & 63) == 0:
        w = w1[j]
    else:
        w = w1[j] & (~np.uint64(0) << np.uint64(i & 63))
    while w == np.uint64(0):
        j += 1
        if j >= w1.shape[0]:
            return -1
        w = w1[j]
    i = (j << 6) + _ctz64(w)
    return (i << 6) + _ctz64(w0[i])


@njit(cache=True)
def _bfd_kernel(lengths, order, max_len, root, child, sibling, scratch, w0, w1, bin_of):
    """Best-fit-decreasing with per-capacity pairing heaps keyed by bin number.

    ``root[c]`` is the heap of open bins whose remaining capacity is exactly c
    (-1 if empty), with ``child``/``sibling`` links per bin.  Returns n_bins.
    """
    n = order.shape[0]
    nb = 0
    min_len = lengths[order[n - 1]] if n > 0 else 1
    i = 0
    while i < n:
        L = lengths[order[i]]
        j = _run_end(lengths, order, i, n)
        while i < j:
            c = _bit_next(w0, w1, L)
            if c < 0:
                b = nb
                nb += 1
                c = max_len
            else:
                b = root[c]
                r = _heap_pop(root, child, sibling, scratch, c)
                if r < 0:
                    _bit_clear(w0, w1, c)
            m = _fill(bin_of, b, i, j, c, L)
            i += m
            c -= m * L
            if c >= min_len:
                if root[c] < 0:
                    _bit_set(w0, w1, c)
                _heap_push(root, child, sibling, c, b)
    return nb


@njit(cache=True)
def _csr_from_bin_of(order, bin_of, n_bins, offsets, items):
    n = order.shape[0]
    for k in range(n):
        offsets[bin_of[k] + 1] += 1
    for b in range(n_bins):
        offsets[b + 1] += offsets[b]
    # use items as output; fill via a moving cursor stored in a copy of offsets
    for k in range(n):
        b = bin_of[k]
        items[offsets[b]] = order[k]
        offsets[b] += 1
    for b in range(n_bins, 0, -1):
        offsets[b] = offsets[b - 1]
    offsets[0] = 0


@njit(cache=True)
def _random_kernel(perm, lengths, max_len, items, starts, plens, offsets):
    """Cut the concatenation of ``lengths[perm]`` every max_len tokens."""
    p = 0
    b = 0
    room = max_len
    for t in range(perm.shape[0]):
        it = perm[t]
        L = lengths[it]
        s = 0
        while L > 0:
            take = L if L < room else room
            items[p] = it
            starts[p] = s
            plens[p] = take
            p += 1
            s += take
            L -= take
            room -= take
            if room == 0:
                b += 1
                offsets[b] = p
                room = max_len
    if room != max_len:
        b += 1
        offsets[b] = p
    return p, b


@njit(cache=True)
def _take_kernel(values, offsets, perm, out):
    """``out``: the entries of bin ``perm[0]`` of ``values`` (CSR by ``offsets``), then of ``perm[1]``, ..."""
    p = 0
    for k in range(perm.shape[0]):
        b = perm[k]
        for e in range(offsets[b], offsets[b + 1]):
            out[p] = values[e]
            p += 1
