"""Repack against pack: changing ``--max-len`` (and the strategy) of a packed folder, with and without the inputs.

    python benchmarks/bench_repack.py                            # 1,000,000 conversations, 2 processes
    python benchmarks/bench_repack.py --n 100000 --num-proc 2 --repeat 3
    python benchmarks/bench_repack.py --n 1000000 --num-proc 16 --repeat 3   # a 16-core machine
    python benchmarks/bench_repack.py --n 100000 --baseline /tmp/main   # and repack of /tmp/main/packprep
    python benchmarks/bench_repack.py --n 100000 --tokenizer ../shared/fixtures/tokenizers/llama3

In one run: ``bench_scale``'s synthetic ShareGPT conversations (``--words W``: one exchange of W-word
turns each: many sequences, few tokens) are packed at ``--max-len`` (the folder a user has), then
the new settings (``--to-max-len``, ``--to-strategy``) are made ``--repeat`` times each, the two
side by side (pack, repack, pack, repack, ...: a machine's drift hits both alike): ``packprep pack``
from the inputs (read, tokenize, pack, write, verify) and ``packprep repack`` from the folder (read
the stored rows on the workers, pack, write, verify). Each is a fresh ``python -m packprep`` process;
the table gives the median wall time (and every run's), the peak memory (PSS of the process and its
workers, as ``bench_scale``), the ratio of the medians, and which files of the two new folders differ
(none but ``rejects.jsonl`` and the card and manifest that count its records where a record
truncated at ``--max-len`` has no trained token left at ``--to-max-len``: repack has no copy of the
record to show, and names it by its stored length).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import EXAMPLE_TOKENIZER, _Sampler, generate  # noqa: E402


def run(args: list[str], packprep: str | None = None) -> tuple[float, int]:
    """Wall seconds and the peak memory (MiB, PSS of the process and its workers, sampled every 0.1 s)
    of ``python -m packprep ARGS``; ``packprep``: the folder holding the package to run instead of the
    installed one."""
    path = os.pathsep.join(filter(None, [packprep, os.environ.get("PYTHONPATH")]))  # keep what else is on it
    env = None if packprep is None else {**os.environ, "PYTHONPATH": path}
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "packprep", *args], stdout=subprocess.DEVNULL, env=env)
    peak = 0
    while process.poll() is None:
        tree, pids = _Sampler._children(), [process.pid]
        for pid in pids:
            pids += tree.get(pid, [])
        peak = max(peak, sum(_Sampler._kib(pid) for pid in pids))
        time.sleep(0.1)
    if process.returncode != 0:
        raise SystemExit(f"packprep {' '.join(args)} failed")
    return time.perf_counter() - started, peak // 1024


def differing(a: Path, b: Path) -> list[str]:
    """The files (relative paths) that are not byte for byte the same in folders ``a`` and ``b``, or in one only."""
    ours, theirs = ({str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} for folder in (a, b))
    return sorted((ours ^ theirs) | {f for f in ours & theirs if not filecmp.cmp(a / f, b / f, shallow=False)})


def row(step: str, runs: list[tuple[float, int]]) -> str:
    times = ", ".join(f"{t:.1f}" for t, _ in runs)
    return f"| {step} | {statistics.median(t for t, _ in runs):.1f} | {times} | {max(m for _, m in runs):,} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="conversations")
    parser.add_argument("--words", type=int, default=None, help="one exchange of W-word turns each (bench_scale)")
    parser.add_argument("--tokenizer", default=str(EXAMPLE_TOKENIZER))
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=8192, help="the folder's row length")
    parser.add_argument("--to-max-len", type=int, default=4096, help="the new row length (shorter: the same shards and manifest even where the folder truncated; rejects.jsonl has no record preview for a record dropped at the new length)")
    parser.add_argument("--to-strategy", default="bfd")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each of pack and repack at the new settings")
    parser.add_argument("--baseline", default=None, help="a folder holding another packprep/ (an older checkout, say) "
                        "whose repack is timed too, side by side")
    parser.add_argument("--workdir", default=None, help="where data and outputs go [a temp dir, removed after]")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-repack-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        data = work / "data.jsonl"
        described = generate(data, args.n, words_per_turn=args.words)
        common = ["-t", args.tokenizer, "--num-proc", str(args.num_proc), "-q", "--overwrite"]
        first = run(["pack", str(data), "-o", str(work / "old"), "--max-len", str(args.max_len), *common])
        new = ["--max-len", str(args.to_max_len), "--strategy", args.to_strategy]
        packed, repacked, baseline = [], [], []
        repack = ["repack", str(work / "old"), *new, "--num-proc", str(args.num_proc), "-q", "--overwrite", "-o"]
        for _ in range(args.repeat):  # side by side: drift of a shared machine hits each alike
            packed.append(run(["pack", str(data), "-o", str(work / "packed"), *new, *common]))
            repacked.append(run([*repack, str(work / "repacked")]))
            if args.baseline:
                baseline.append(run([*repack, str(work / "baseline")], str(Path(args.baseline).absolute())))
        manifest = json.loads((work / "old" / "packprep.json").read_text())
        print(f"{args.n:,} conversations ({described['bytes'] / 1e6:,.0f} MB of JSONL, {manifest['tokens']['total']:,} "
              f"tokens), {manifest['sequences']:,} sequences; "
              f"{args.num_proc} processes; --max-len {args.max_len} -> {args.to_max_len}, --strategy {args.to_strategy}\n")
        print("| step | median wall s | each run, s | peak memory (PSS, MiB) |\n|---|---:|---|---:|")
        print(row(f"pack from the inputs at {args.max_len} (the folder)", [first]))
        print(row(f"pack from the inputs at {args.to_max_len}", packed))
        print(row(f"repack the folder at {args.to_max_len}", repacked))
        if baseline:
            print(row(f"repack the folder at {args.to_max_len}, {args.baseline}", baseline))
        ratio = statistics.median(t for t, _ in repacked) / statistics.median(t for t, _ in packed)
        print(f"\nrepack / pack: {ratio:.2f}x the median time; files that differ: "
              f"{', '.join(differing(work / 'packed', work / 'repacked')) or 'none'}")
        if baseline:
            print(f"repack / {args.baseline}'s repack: "
                  f"{statistics.median(t for t, _ in repacked) / statistics.median(t for t, _ in baseline):.2f}x the "
                  f"median time; files that differ: {', '.join(differing(work / 'baseline', work / 'repacked')) or 'none'}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
