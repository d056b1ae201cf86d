"""Side-by-side packing benchmark: packprep vs TRL vs seqpacker on the same lengths.

    python benchmarks/bench_packing.py [--n 1000000] [--repeat 5] [--skip-slow]

Lengths: lognormal (mu = ln 700, sigma 1.0), clipped to [8, 4096], floored to
int64, numpy default_rng(seed 0); max_len 4096.  For every packer: median wall
time over the repeats (after one untimed warm-up call for packprep, whose numba
kernels are cached on disk), bins, % above the lower bound ceil(sum/max_len),
and peak memory of one extra call: the tracemalloc peak (numpy/Python
allocations) and the growth of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs), which also sees native allocations (Rust, Arrow).

Peers are skipped with a printed reason when they cannot be imported:
  * TRL ``pack_dataset(ds, 4096, strategy="bfd")`` on a ``datasets.Dataset`` with
    an ``input_ids`` column, as SFTTrainer calls it (batched map, windows of 1000
    rows) -- slow (~30 s), skipped by ``--skip-slow``;
  * TRL's core BFD loop (the sort + best-fit loop of ``trl.data_utils._pack_bfd``
    with TRL's own ``_SegmentTree``) on all lengths at once, and
    (opt-in, ``--with-trl-table``) ``_pack_bfd`` itself called once on the whole
    Arrow table (global; includes Arrow's list_slice/take of the token column);
  * seqpacker ``Packer(capacity, strategy).pack_flat(lengths)`` for its exact
    FFD/BFD-class strategies.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packprep.packing import lower_bound, pack_lengths  # noqa: E402

MAX_LEN = 4096


def make_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(700.0), 1.0, n), 8, MAX_LEN).astype(np.int64)


# ------------------------------------------------------------------ measuring


def _vm(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:  # noqa: BLE001
        pass


def _reset_hwm() -> bool:
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(fn, repeat: int, warmup: bool):
    """Return (median_s, all_times, result, tracemalloc_peak_bytes, rss_peak_growth_bytes)."""
    if warmup:
        fn()
    times = []
    result = None
    for _ in range(repeat):
        result = None
        gc.collect()
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    # memory: one extra call under tracemalloc, with the RSS high-water mark reset
    result = None
    gc.collect()
    can_hwm = _reset_hwm()
    rss0 = _vm("VmRSS")
    tracemalloc.start()
    result = fn()
    _, tm_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    hwm = _vm("VmHWM")
    rss_growth = (hwm - rss0) if (can_hwm and hwm is not None and rss0 is not None) else None
    return statistics.median(times), times, result, tm_peak, rss_growth


def check_bins(items, offsets, lengths, max_len):
    """Every item exactly once, no bin above max_len (cheap sanity check)."""
    items = np.asarray(items, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    assert items.shape[0] == lengths.shape[0], "not every item placed"
    assert np.array_equal(np.bincount(items, minlength=lengths.shape[0]), np.ones(lengths.shape[0])), "item twice"
    cs = np.concatenate([[0], np.cumsum(lengths[items])])
    assert (cs[offsets[1:]] - cs[offsets[:-1]]).max() <= max_len, "bin over max_len"


ROWS: list[dict] = []


def report(name, n, lengths, bins, med, times, tm_peak, rss_growth, note=""):
    lb = lower_bound(lengths, MAX_LEN)
    row = dict(
        name=name,
        n=n,
        median_s=med,
        times=times,
        bins=bins,
        above_lb=100.0 * (bins - lb) / lb if (bins is not None and lb) else None,
        tm_peak=tm_peak,
        rss=rss_growth,
        note=note,
    )
    ROWS.append(row)
    mb = lambda b: "n/a" if b is None else f"{b / 2**20:.0f} MB"  # noqa: E731
    above = "n/a" if row["above_lb"] is None else f"{row['above_lb']:.4f}%"
    print(
        f"  {name:<44} n={n:>9,}  median {med:8.4f} s  bins {bins if bins is not None else 'n/a':>9}  "
        f"+{above} over LB  tracemalloc peak {mb(tm_peak)}  RSS peak growth {mb(rss_growth)}"
        + (f"  [{note}]" if note else ""),
        flush=True,
    )
    return row


# ------------------------------------------------------------------ packers


def bench_packprep(lengths, strategy, repeat, label=None):
    def fn():
        return pack_lengths(lengths, MAX_LEN, strategy, seed=0)

    med, times, res, tm_peak, rss = measure(fn, repeat, warmup=True)
    if strategy in ("greedy", "bfd", "pad"):
        check_bins(res.items, res.offsets, lengths, MAX_LEN)
    report(label or f"packprep {strategy}", lengths.shape[0], lengths, res.n_bins, med, times, tm_peak, rss)


def first_call_times(n: int) -> None:
    """First call of packprep greedy in a fresh process, numba cache warm and cold."""
    code = (
        "import sys,time;t0=time.perf_counter();"
        f"sys.path.insert(0,{str(ROOT)!r});"
        "import numpy as np;"
        "from packprep.packing import pack_lengths;t1=time.perf_counter();"
        f"x=np.clip(np.random.default_rng(0).lognormal(np.log(700.0),1.0,{n}),8,{MAX_LEN}).astype(np.int64);"
        f"t2=time.perf_counter();pack_lengths(x,{MAX_LEN},'greedy');t3=time.perf_counter();"
        f"pack_lengths(x,{MAX_LEN},'greedy');t4=time.perf_counter();"
        "print(f'{t1-t0:.3f} {t3-t2:.3f} {t4-t3:.3f}')"
    )
    import tempfile

    for label, env_extra in (("numba cache warm", {}), ("numba cache cold", None)):
        env = dict(os.environ)
        tmp = None
        if env_extra is None:
            tmp = tempfile.mkdtemp(prefix="numba-cold-")
            env["NUMBA_CACHE_DIR"] = tmp
        else:
            subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)  # make sure it is warm
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"  first call ({label}): failed: {out.stderr.strip()[-300:]}")
            continue
        imp, first, second = (float(v) for v in out.stdout.split())
        print(
            f"  fresh process, {label}: import packprep.packing {imp:.3f} s, first greedy call {first:.3f} s, "
            f"second {second:.3f} s",
            flush=True,
        )
        ROWS.append(dict(name=f"first call ({label})", import_s=imp, first_s=first, second_s=second))


def bench_seqpacker(lengths, repeat):
    try:
        import seqpacker
    except Exception as e:  # noqa: BLE001
        print(
            f"  seqpacker: SKIPPED (not importable: {type(e).__name__}: {e}). It has no manylinux wheel; see "
            "benchmarks/README_packing.md for installing its musllinux wheel re-linked with patchelf."
        )
        return
    ver = getattr(seqpacker, "__version__", "?")
    for strategy in ("FFD", "BFD", "OBFD", "OBFDP"):
        packer = seqpacker.Packer(capacity=MAX_LEN, strategy=strategy)

        def fn(packer=packer):
            return packer.pack_flat(lengths)

        med, times, res, tm_peak, rss = measure(fn, repeat, warmup=True)
        items, splits = res
        offsets = np.concatenate([[0], np.asarray(splits, dtype=np.int64), [len(items)]])
        check_bins(items, offsets, lengths, MAX_LEN)
        report(f"seqpacker {ver} {strategy} (pack_flat)", lengths.shape[0], lengths, offsets.shape[0] - 1, med, times, tm_peak, rss)


def _token_table(lengths, ids_dtype):
    import pyarrow as pa

    total = int(lengths.sum())
    values = pa.array(np.zeros(total, dtype=ids_dtype))
    offs = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    if total < 2**31:
        col = pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)), values)
    else:
        col = pa.LargeListArray.from_arrays(pa.array(offs), values)
    return pa.table({"input_ids": col})


def bench_trl(lengths, repeat, skip_slow, ids_dtype, with_table=False):
    try:
        import trl
        from trl.data_utils import pack_dataset
    except Exception as e:  # noqa: BLE001
        print(f"  TRL: SKIPPED (not importable: {type(e).__name__}: {e})")
        return
    try:
        import datasets
        from datasets.table import InMemoryTable
    except Exception as e:  # noqa: BLE001
        print(f"  TRL: SKIPPED (datasets not importable: {type(e).__name__}: {e})")
        return
    datasets.disable_progress_bars()
    t = time.perf_counter()
    table = _token_table(lengths, ids_dtype)
    print(
        f"  (built an Arrow table of {int(lengths.sum()):,} {np.dtype(ids_dtype).name} token ids "
        f"in {time.perf_counter() - t:.1f} s)",
        flush=True,
    )
    ver = trl.__version__

    if skip_slow:
        print("  TRL pack_dataset(strategy='bfd'): SKIPPED (--skip-slow)")
    else:
        ds = datasets.Dataset(InMemoryTable(table))

        def fn():
            return pack_dataset(ds, MAX_LEN, strategy="bfd")

        med, times, res, tm_peak, rss = measure(fn, repeat, warmup=False)
        bins = len(res)
        res = None
        report(f"TRL {ver} pack_dataset bfd (SFTTrainer)", lengths.shape[0], lengths, bins, med, times, tm_peak, rss,
               note="windows of 1000 rows")
        del ds

    mod = sys.modules["trl.data_utils"]
    seg_tree = getattr(mod, "_SegmentTree", None)
    if seg_tree is None:
        print("  TRL core BFD loop: SKIPPED (trl.data_utils._SegmentTree not found in this TRL version)")
    else:
        def fn_loop():
            return trl_core_bfd_loop(seg_tree, lengths, MAX_LEN)

        med, times, bins, tm_peak, rss = measure(fn_loop, repeat, warmup=False)
        report(f"TRL {ver} core BFD loop, global", lengths.shape[0], lengths, bins, med, times, tm_peak, rss,
               note="_pack_bfd's sort+loop, no Arrow column work")

    core = getattr(mod, "_pack_bfd", None)
    if skip_slow or not with_table:
        print("  TRL _pack_bfd on the whole table: SKIPPED (opt-in: --with-trl-table, ~60 s at 1M, ~6 GB RSS)")
    elif core is None:
        print("  TRL _pack_bfd: SKIPPED (trl.data_utils._pack_bfd not found in this TRL version)")
    else:
        def fn_core():
            return core(table, MAX_LEN)

        med, times, res, tm_peak, rss = measure(fn_core, repeat, warmup=False)
        bins = res.num_rows
        res = None
        report(f"TRL {ver} _pack_bfd, whole table", lengths.shape[0], lengths, bins, med, times, tm_peak, rss,
               note="global, incl. Arrow list_slice/take of the tokens")


def trl_core_bfd_loop(seg_tree_cls, lengths, seq_length):
    """The sort + best-fit loop of ``trl.data_utils._pack_bfd`` (TRL 0.2x-1.x), verbatim
    apart from the Arrow column handling, run on all lengths at once.  Returns n_bins."""
    from collections import defaultdict, deque

    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pa.array(lengths.astype(np.int32))
    ids = np.arange(len(lengths))
    lengths = pc.make_struct(lengths, ids)
    lengths = lengths.sort("descending", by=0)

    segment_tree = seg_tree_cls(seq_length)
    segment_tree.add(seq_length)
    space_to_bin = defaultdict(deque)
    bins: list[dict] = []
    for length, idx in zip(lengths.field(0).to_numpy(), lengths.field(1).to_numpy(), strict=True):
        space = segment_tree.search(length)
        if space < seq_length:
            bin = space_to_bin[space].popleft()
        else:
            bin = {"ids": [], "length": 0}
            bins.append(bin)
        bin["ids"].append(idx)
        bin["length"] += length
        if space < seq_length and not space_to_bin[space]:
            segment_tree.remove(space)
        space = space - length
        space_to_bin[space].append(bin)
        if space > 0:
            segment_tree.add(space)
    return len(bins)


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="number of lengths (default 1,000,000)")
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats per packer (median is reported)")
    ap.add_argument("--slow-repeat", type=int, default=1, help="timed repeats for the TRL peers (default 1)")
    ap.add_argument("--skip-slow", action="store_true", help="skip TRL pack_dataset (~25 s per call at 1M)")
    ap.add_argument("--with-trl-table", action="store_true",
                    help="also time TRL _pack_bfd on the whole token table (~60 s per call at 1M, ~6 GB RSS)")
    ap.add_argument("--skip-peers", action="store_true", help="only packprep")
    ap.add_argument("--skip-scaling", action="store_true", help="skip greedy at n/10 and 10*n")
    ap.add_argument("--ids-dtype", default="int16", help="dtype of the dummy token ids given to TRL (default int16)")
    args = ap.parse_args(argv)

    lengths = make_lengths(args.n)
    lb = lower_bound(lengths, MAX_LEN)
    print(
        f"# {args.n:,} lengths, lognormal(ln 700, 1.0) clipped to [8, {MAX_LEN}], seed 0; max_len {MAX_LEN}; "
        f"sum {int(lengths.sum()):,} tokens; lower bound {lb:,} bins",
        flush=True,
    )
    print(f"# python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs; repeat {args.repeat}")
    print("packprep:")
    for strategy in ("greedy", "bfd", "random", "pad"):
        bench_packprep(lengths, strategy, args.repeat)
    if not args.skip_scaling:
        for n in (args.n // 10, args.n * 10):
            if n >= 1:
                bench_packprep(make_lengths(n), "greedy", args.repeat, label=f"packprep greedy (n={n:,})")
    first_call_times(args.n)
    if not args.skip_peers:
        print("peers:")
        bench_seqpacker(lengths, args.repeat)
        bench_trl(lengths, args.slow_repeat, args.skip_slow, np.dtype(args.ids_dtype), args.with_trl_table)

    print("markdown:")
    print("| packer | n | median time | bins | above lower bound | peak memory (tracemalloc / RSS growth) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in ROWS:
        if "median_s" not in r:
            continue
        mem = " / ".join("n/a" if v is None else f"{v / 2**20:.0f} MB" for v in (r["tm_peak"], r["rss"]))
        above = "n/a" if r["above_lb"] is None else f"{r['above_lb']:.4f}%"
        print(f"| {r['name']} | {r['n']:,} | {r['median_s']:.4f} s | {r['bins']:,} | {above} | {mem} |")

    base = {r["name"]: r for r in ROWS if "median_s" in r}
    g = base.get("packprep greedy")
    if g:
        print("ratios (peer median / packprep greedy median, same run):")
        for r in ROWS:
            if "median_s" in r and r["n"] == args.n and r is not g:
                print(f"  {r['name']:<44} {r['median_s'] / g['median_s']:8.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
