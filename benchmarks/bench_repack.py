"""Repack against pack: changing ``--max-len`` (and the strategy) of a packed folder, with and without the inputs.

    python benchmarks/bench_repack.py                            # 1,000,000 conversations, 2 processes
    python benchmarks/bench_repack.py --n 1000000 --words 4 --num-proc 2
    python benchmarks/bench_repack.py --n 100000 --tokenizer ../shared/fixtures/tokenizers/llama3

In one run: ``bench_scale``'s synthetic ShareGPT conversations (``--words W``: one exchange of W-word
turns each: many sequences, few tokens) are packed at ``--max-len`` (the folder a user has), then
the new settings (``--to-max-len``, ``--to-strategy``) are made twice: ``packprep pack`` from the
inputs (read, tokenize, pack, write, verify) and ``packprep repack`` from the folder (read the
stored rows, pack, write, verify). Each is a fresh ``python -m packprep`` process; the table gives
its wall time and its peak memory (PSS of the process and its workers, as ``bench_scale``), and
whether the two new folders are byte for byte the same (they are, where no sequence was cut).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import EXAMPLE_TOKENIZER, _Sampler, generate  # noqa: E402


def run(args: list[str]) -> tuple[float, int]:
    """Wall seconds and the peak memory (MiB, PSS of the process and its workers, sampled every 0.1 s)
    of ``python -m packprep ARGS``."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "packprep", *args], stdout=subprocess.DEVNULL)
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


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()):
        return False
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000, help="conversations")
    parser.add_argument("--words", type=int, default=None, help="one exchange of W-word turns each (bench_scale)")
    parser.add_argument("--tokenizer", default=str(EXAMPLE_TOKENIZER))
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=8192, help="the folder's row length")
    parser.add_argument("--to-max-len", type=int, default=4096, help="the new row length (shorter: the same shards and manifest even where the folder truncated; rejects.jsonl has no record preview for a record dropped at the new length)")
    parser.add_argument("--to-strategy", default="bfd")
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
        packed = run(["pack", str(data), "-o", str(work / "packed"), *new, *common])
        repacked = run(["repack", str(work / "old"), "-o", str(work / "repacked"), *new,
                        "--num-proc", str(args.num_proc), "-q", "--overwrite"])
        manifest = json.loads((work / "old" / "packprep.json").read_text())
        print(f"{args.n:,} conversations ({described['bytes'] / 1e6:,.0f} MB of JSONL, {manifest['tokens']['total']:,} "
              f"tokens), {manifest['sequences']:,} sequences; "
              f"{args.num_proc} processes; --max-len {args.max_len} -> {args.to_max_len}, --strategy {args.to_strategy}\n")
        print("| step | wall s | peak memory (PSS, MiB) |\n|---|---:|---:|")
        print(f"| pack from the inputs at {args.max_len} (the folder) | {first[0]:.1f} | {first[1]:,} |")
        print(f"| pack from the inputs at {args.to_max_len} | {packed[0]:.1f} | {packed[1]:,} |")
        print(f"| repack the folder at {args.to_max_len} | {repacked[0]:.1f} | {repacked[1]:,} |")
        print(f"\nrepack / pack: {repacked[0] / packed[0]:.2f}x the time; outputs byte-identical: "
              f"{same_tree(work / 'packed', work / 'repacked')}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
