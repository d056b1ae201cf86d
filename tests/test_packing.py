"""Tests for packprep.packing: property tests against naive reference packers."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packprep.packing import (
    ROW_ORDERS,
    STRATEGIES,
    Bins,
    lower_bound,
    order_bins,
    pack_lengths,
    pieces_to_bins,
    split_pieces,
)

from .conftest import REPO

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- references


def naive_ffd(lengths, max_len):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        for b in range(len(bins)):
            if room[b] >= lengths[i]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_len - lengths[i])
    return bins


def naive_bfd(lengths, max_len):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        best = -1
        for b in range(len(bins)):
            if room[b] >= lengths[i] and (best < 0 or room[b] < room[best]):
                best = b
        if best < 0:
            bins.append([i])
            room.append(max_len - lengths[i])
        else:
            bins[best].append(i)
            room[best] -= lengths[i]
    return bins


def as_lists(bins: Bins):
    return [bins.items[bins.offsets[b] : bins.offsets[b + 1]].tolist() for b in range(bins.n_bins)]


def check_csr(bins: Bins):
    # one entry a sequence: int32 (4 bytes, not 8) while the values fit; offsets, one a bin, int64
    assert bins.items.dtype == np.int32 and bins.offsets.dtype == np.int64
    assert bins.offsets[0] == 0 and bins.offsets[-1] == bins.items.shape[0]
    assert np.all(np.diff(bins.offsets) >= 0)
    if bins.starts is not None:
        assert bins.starts.dtype == np.int32 and bins.lengths.dtype == np.int32
        assert bins.starts.shape == bins.items.shape == bins.lengths.shape


def check_whole_items(bins: Bins, n):
    """Every item in exactly one bin, no pieces."""
    check_csr(bins)
    assert bins.starts is None and bins.lengths is None
    assert np.array_equal(np.sort(bins.items), np.arange(n))


def check_pieces(bins: Bins, lengths):
    """Pieces of each item are contiguous, start at 0 and sum to its length."""
    check_csr(bins)
    lengths = np.asarray(lengths)
    assert np.all(bins.lengths >= 1)
    order = np.lexsort((bins.starts, bins.items))
    it, s, ln = bins.items[order], bins.starts[order], bins.lengths[order]
    assert np.array_equal(np.unique(it), np.arange(len(lengths))) or len(lengths) == 0
    for i in range(len(lengths)):
        sel = it == i
        ss, ll = s[sel], ln[sel]
        assert ss[0] == 0
        assert np.array_equal(ss[1:], (ss + ll)[:-1])
        assert ll.sum() == lengths[i]


lengths_and_cap = st.integers(1, 60).flatmap(
    lambda cap: st.tuples(st.lists(st.integers(1, cap), min_size=0, max_size=80), st.just(cap))
)
any_lengths_and_cap = st.integers(1, 40).flatmap(
    lambda cap: st.tuples(st.lists(st.integers(1, 3 * cap), min_size=0, max_size=60), st.just(cap))
)
seeds = st.integers(0, 2**32 - 1)


# ---------------------------------------------------------------- greedy / bfd


@SETTINGS
@given(lengths_and_cap)
def test_greedy_equals_naive_ffd(lc):
    lengths, cap = lc
    bins = pack_lengths(np.array(lengths, dtype=np.int64), cap, "greedy")
    check_whole_items(bins, len(lengths))
    assert as_lists(bins) == naive_ffd(lengths, cap)
    assert np.all(bins.bin_lengths(lengths) <= cap)
    assert lower_bound(lengths, cap) <= bins.n_bins


@SETTINGS
@given(lengths_and_cap)
def test_bfd_equals_naive_bfd(lc):
    lengths, cap = lc
    bins = pack_lengths(np.array(lengths, dtype=np.int64), cap, "bfd")
    check_whole_items(bins, len(lengths))
    assert as_lists(bins) == naive_bfd(lengths, cap)
    assert np.all(bins.bin_lengths(lengths) <= cap)
    assert lower_bound(lengths, cap) <= bins.n_bins


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.integers(50, 400), st.sampled_from([64, 100, 512]))
def test_greedy_bfd_larger_inputs_match_naive(seed, n, cap):
    # many equal lengths and many small items: exercises run batching and the heaps
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(cap / 6), 1.0, n), 1, cap).astype(np.int64)
    assert as_lists(pack_lengths(lengths, cap, "greedy")) == naive_ffd(lengths.tolist(), cap)
    assert as_lists(pack_lengths(lengths, cap, "bfd")) == naive_bfd(lengths.tolist(), cap)


def test_greedy_known_example():
    lengths = np.array([5, 4, 3, 3, 2, 2, 1])
    bins = pack_lengths(lengths, 6, "greedy")
    # order: 0(5) 1(4) 2(3) 3(3) 4(2) 5(2) 6(1)
    assert as_lists(bins) == [[0, 6], [1, 4], [2, 3], [5]]


def test_first_fit_and_best_fit_disagree():
    # cap 7: 5 -> b0 (room 2); 3 -> b1 (room 4); 3 -> b1 (room 1);
    # 1 -> first fit: b0 (lowest bin that fits), best fit: b1 (least room)
    lengths = np.array([5, 3, 3, 1])
    assert as_lists(pack_lengths(lengths, 7, "greedy")) == [[0, 3], [1, 2]]
    assert as_lists(pack_lengths(lengths, 7, "bfd")) == [[0], [1, 2, 3]]


def test_ties_by_input_index():
    # equal lengths are taken in input order; bins are numbered by creation
    lengths = np.array([2, 3, 2, 3, 2])
    assert as_lists(pack_lengths(lengths, 5, "greedy")) == [[1, 0], [3, 2], [4]]
    assert as_lists(pack_lengths(lengths, 5, "bfd")) == [[1, 0], [3, 2], [4]]


def test_ffd_and_bfd_do_differ_somewhere():
    rng = np.random.default_rng(1)
    differ = 0
    for _ in range(200):
        lengths = rng.integers(1, 20, 12)
        f = as_lists(pack_lengths(lengths, 20, "greedy"))
        b = as_lists(pack_lengths(lengths, 20, "bfd"))
        assert f == naive_ffd(lengths.tolist(), 20)
        assert b == naive_bfd(lengths.tolist(), 20)
        differ += f != b
    assert differ > 0


# ---------------------------------------------------------------- other strategies


@SETTINGS
@given(any_lengths_and_cap, seeds)
def test_random_pieces(lc, seed):
    lengths, cap = lc
    arr = np.array(lengths, dtype=np.int64)
    bins = pack_lengths(arr, cap, "random", seed=seed)
    check_pieces(bins, arr)
    totals = bins.bin_lengths(arr)
    assert bins.n_bins == lower_bound(arr, cap)
    if bins.n_bins:
        assert np.all(totals[:-1] == cap)
        assert 1 <= totals[-1] <= cap
    # the stream order is the seeded permutation
    perm = np.random.default_rng(seed).permutation(len(lengths))
    first_seen = bins.items[np.sort(np.unique(bins.items, return_index=True)[1])]
    assert np.array_equal(first_seen, perm)
    again = pack_lengths(arr, cap, "random", seed=seed)
    assert all(np.array_equal(getattr(bins, f), getattr(again, f)) for f in ("items", "offsets", "starts", "lengths"))


def test_random_small_example():
    lengths = np.array([3, 5, 2])
    bins = pack_lengths(lengths, 4, "random", seed=0)
    perm = np.random.default_rng(0).permutation(3)
    stream = np.concatenate([np.full(lengths[i], i) for i in perm])
    assert bins.n_bins == 3
    for b in range(bins.n_bins):
        sl = slice(bins.offsets[b], bins.offsets[b + 1])
        rebuilt = np.concatenate([np.full(ln, it) for it, ln in zip(bins.items[sl], bins.lengths[sl])])
        assert np.array_equal(rebuilt, stream[4 * b : 4 * b + 4])


@SETTINGS
@given(lengths_and_cap)
def test_pad_one_per_bin(lc):
    lengths, cap = lc
    bins = pack_lengths(np.array(lengths, dtype=np.int64), cap, "pad")
    check_whole_items(bins, len(lengths))
    assert np.array_equal(bins.items, np.arange(len(lengths)))
    assert bins.n_bins == len(lengths)


@SETTINGS
@given(any_lengths_and_cap, st.integers(1, 7), seeds)
def test_minibatch(lc, k, seed):
    lengths, cap = lc
    arr = np.array(lengths, dtype=np.int64)
    bins = pack_lengths(arr, cap, "minibatch", seed=seed, samples_per_row=k)
    check_whole_items(bins, len(lengths))
    assert np.array_equal(bins.items, np.random.default_rng(seed).permutation(len(lengths)))
    sizes = np.diff(bins.offsets)
    assert bins.n_bins == -(-len(lengths) // k)
    if bins.n_bins:
        assert np.all(sizes[:-1] == k) and 1 <= sizes[-1] <= k


@pytest.mark.parametrize("strategy", ["greedy", "bfd", "random", "pad", "minibatch"])
def test_determinism_and_dtypes(strategy):
    rng = np.random.default_rng(7)
    base = rng.integers(1, 300, 2000)
    ref = pack_lengths(base.astype(np.int64), 300, strategy, seed=3, samples_per_row=4)
    for dt in (np.int16, np.uint16, np.int32, np.uint32, np.uint64):
        other = pack_lengths(base.astype(dt), 300, strategy, seed=3, samples_per_row=4)
        assert np.array_equal(ref.items, other.items) and np.array_equal(ref.offsets, other.offsets)
    assert np.array_equal(pack_lengths(base.tolist(), 300, strategy, seed=3, samples_per_row=4).items, ref.items)
    if strategy in ("random", "minibatch"):
        diff = pack_lengths(base, 300, strategy, seed=4, samples_per_row=4)
        assert not np.array_equal(diff.items, ref.items)


@pytest.mark.parametrize("strategy", ["greedy", "bfd", "random", "pad", "minibatch"])
def test_empty_input(strategy):
    bins = pack_lengths(np.zeros(0, dtype=np.int64), 16, strategy, samples_per_row=2)
    assert bins.n_bins == 0 and bins.items.shape == (0,) and np.array_equal(bins.offsets, [0])
    assert bins.bin_lengths(np.zeros(0, dtype=np.int64)).shape == (0,)


def test_items_of_exactly_max_len_and_len_one():
    lengths = np.array([8, 1, 8, 1, 7, 1])
    for s in ("greedy", "bfd"):
        bins = pack_lengths(lengths, 8, s)
        assert np.all(bins.bin_lengths(lengths) <= 8)
        assert as_lists(bins) == [[0], [2], [4, 1], [3, 5]]
    bins = pack_lengths(np.ones(1000, dtype=np.int64), 1, "greedy")
    assert bins.n_bins == 1000


def test_lengths_past_int32_are_cut_without_overflow():
    """Arrays are int32 while the values fit; a sample of 2**31 tokens or more makes them int64."""
    big = 2**31 + 5
    item, start, length = split_pieces([big, 3], 2**30)
    assert start.dtype == length.dtype == np.int64
    assert start.tolist() == [0, 2**30, 2**31, 0] and length.tolist() == [2**30, 2**30, 5, 3]
    bins = pack_lengths(np.array([big, 3]), 2**30, "random", seed=0)
    assert bins.starts.dtype == bins.lengths.dtype == np.int64
    assert int(bins.lengths.sum()) == big + 3 and int(bins.lengths.max()) == 2**30


def test_large_max_len_uses_fallback_sort():
    lengths = np.array([10**6, 5, 10**6 - 5, 3, 2])
    for s in ("greedy", "bfd"):
        bins = pack_lengths(lengths, 2 * 10**6 + 10, s)
        assert as_lists(bins) == (naive_ffd if s == "greedy" else naive_bfd)(lengths.tolist(), 2 * 10**6 + 10)


# ---------------------------------------------------------------- split_pieces


@SETTINGS
@given(any_lengths_and_cap, st.sampled_from(["greedy", "bfd", "pad", "random"]))
def test_split_pieces_then_pack(lc, strategy):
    lengths, cap = lc
    arr = np.array(lengths, dtype=np.int64)
    item, start, length = split_pieces(arr, cap)
    assert item.dtype == start.dtype == length.dtype == np.int32
    assert np.all(length >= 1) and np.all(length <= cap)
    assert np.all(np.diff(item) >= 0)
    short = arr <= cap
    assert np.array_equal(np.bincount(item, minlength=len(arr))[short], np.ones(short.sum()))
    bins = pieces_to_bins(pack_lengths(length, cap, strategy), item, start, length)
    check_pieces(bins, arr)
    assert np.all(bins.bin_lengths(arr) <= cap)


def test_split_pieces_example():
    item, start, length = split_pieces(np.array([3, 10, 4]), 4)
    assert item.tolist() == [0, 1, 1, 1, 2]
    assert start.tolist() == [0, 0, 4, 8, 0]
    assert length.tolist() == [3, 4, 4, 2, 4]


# ---------------------------------------------------------------- order_bins


@SETTINGS
@given(any_lengths_and_cap, st.sampled_from(["greedy", "bfd", "random", "pad"]), st.sampled_from(ROW_ORDERS), seeds)
def test_order_bins_is_a_permutation_of_bins(lc, strategy, row_order, seed):
    lengths, cap = lc
    arr = np.array(lengths, dtype=np.int64)
    if strategy != "random":
        arr = np.minimum(arr, cap)
    bins = pack_lengths(arr, cap, strategy, seed=seed)
    out = order_bins(bins, row_order, seed=seed)
    check_csr(out)
    assert out.n_bins == bins.n_bins
    assert (out.starts is None) == (bins.starts is None)

    def rows(b):
        res = []
        for k in range(b.n_bins):
            sl = slice(b.offsets[k], b.offsets[k + 1])
            row = (tuple(b.items[sl].tolist()),)
            if b.starts is not None:
                row += (tuple(b.starts[sl].tolist()), tuple(b.lengths[sl].tolist()))
            res.append(row)
        return res

    before, after = rows(bins), rows(out)
    assert sorted(before) == sorted(after)
    if row_order == "length":
        assert before == after
    elif row_order == "input":
        mins = [min(r[0]) for r in after]
        assert mins == sorted(mins)
    else:
        perm = np.random.default_rng(seed).permutation(bins.n_bins)
        assert after == [before[k] for k in perm]
    assert np.array_equal(order_bins(bins, row_order, seed=seed).items, out.items)


def test_order_bins_input_is_stable_for_split_items():
    bins = pack_lengths(np.array([10, 1]), 4, "random", seed=0)
    out = order_bins(bins, "input")
    perm = np.random.default_rng(0).permutation(2)
    assert out.n_bins == 3
    if perm[0] == 0:  # stream: item 0 (10 tokens) then item 1: bins all contain item 0
        assert np.array_equal(out.offsets, bins.offsets) and np.array_equal(out.starts, bins.starts)


# ---------------------------------------------------------------- errors and lower bound


def test_lower_bound():
    assert lower_bound(np.array([4, 4, 1]), 4) == 3
    assert lower_bound(np.array([4, 4]), 4) == 2
    assert lower_bound(np.zeros(0, dtype=np.int64), 4) == 0


@pytest.mark.parametrize("strategy", ["greedy", "bfd", "pad"])
def test_overlong_raises(strategy):
    with pytest.raises(ValueError, match=r"longer than max_len=4.*lengths\[1\] = 5"):
        pack_lengths(np.array([4, 5, 1]), 4, strategy)


def test_random_and_minibatch_accept_overlong():
    assert pack_lengths(np.array([9]), 4, "random").n_bins == 3
    assert pack_lengths(np.array([9, 9]), 4, "minibatch", samples_per_row=2).n_bins == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=np.array([1, 0, 2]), max_len=4), r">= 1; lengths\[1\] = 0"),
        (dict(lengths=np.array([1, -3]), max_len=4), r">= 1"),
        (dict(lengths=np.array([1.0, 2.0]), max_len=4), "integer dtype"),
        (dict(lengths=np.array([[1, 2]]), max_len=4), "1-D"),
        (dict(lengths=np.array([1, 2]), max_len=0), "max_len must be >= 1"),
        (dict(lengths=np.array([1, 2]), max_len=4.0), "max_len must be an integer"),
        (dict(lengths=np.array([1, 2]), max_len=2**31), "max_len must be < 2"),
        (dict(lengths=np.array([1, 2]), max_len=4, strategy="ffd"), "unknown strategy"),
        (dict(lengths=np.array([1, 2]), max_len=4, strategy="minibatch"), "requires samples_per_row"),
        (dict(lengths=np.array([1, 2]), max_len=4, strategy="minibatch", samples_per_row=0), "samples_per_row must be >= 1"),
    ],
)
def test_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_lengths(**kwargs)


def test_order_bins_bad_row_order():
    with pytest.raises(ValueError, match="unknown row_order"):
        order_bins(pack_lengths(np.array([1]), 4), "sorted")


def test_strategies_constant():
    assert STRATEGIES == ("greedy", "bfd", "random", "pad", "minibatch")
    assert ROW_ORDERS == ("shuffle", "length", "input")


def test_large_max_len_paths_match_naive():
    """Above CLASS_LIMIT greedy/bfd switch to structures indexed by bin: small instances scaled past it
    (each length times k, less a jitter below k), so that bins still hold several sequences."""
    from packprep.packing import CLASS_LIMIT

    rng = np.random.default_rng(5)
    for _ in range(30):
        small = int(rng.integers(9, 60))
        k = CLASS_LIMIT // small + 1
        cap = small * k
        assert cap > CLASS_LIMIT
        n = int(rng.integers(0, 120))
        lengths = rng.integers(1, small + 1, n) * k - rng.integers(0, k, n)
        assert as_lists(pack_lengths(lengths, cap, "greedy")) == naive_ffd(lengths.tolist(), cap)
        assert as_lists(pack_lengths(lengths, cap, "bfd")) == naive_bfd(lengths.tolist(), cap)


@pytest.mark.slow
def test_numba_is_imported_at_the_first_kernel_call_not_at_start_up():
    """``packprep pack`` imports the CLI and the pipeline before its first record is read; numba
    (0.15-0.5 s to import) waits until packing starts."""
    code = (
        "import sys, numpy as np, packprep.cli; print('numba' in sys.modules); "
        "from packprep.packing import pack_lengths; "
        "print(pack_lengths(np.array([3, 5, 2]), 8).n_bins, 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["False", "2", "True"]


@pytest.mark.slow
def test_the_kernels_run_where_numba_cannot_cache_them():
    """A read-only install and home, no NUMBA_CACHE_DIR: numba refuses ``cache=True``. The kernels
    are then compiled for the run, with a warning that says how to keep them."""
    code = (
        "import warnings, numpy as np\n"
        "from numba.core import caching\n"
        "caching.CacheImpl._locator_classes = []  # nowhere to cache: what numba finds on a read-only system\n"
        "from packprep.packing import pack_lengths\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    print(pack_lengths(np.array([3, 5, 2]), 8).n_bins)\n"
        "print(any('NUMBA_CACHE_DIR' in str(w.message) for w in caught))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["2", "True"]
