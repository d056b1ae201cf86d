"""This tree against an earlier packprep, the same ``packprep pack`` command, in one run.

    python benchmarks/bench_versions.py --rev 777d603 --n 100000 --num-proc 2
    python benchmarks/bench_versions.py --old .old/777d603 --n 1000000 --num-proc 16 --repeat 3

A refactor must not make packing slower: this writes ``--n`` synthetic conversations
(``bench_scale.generate``), then runs ``python -m packprep pack DATA -t TOK -o OUT -q`` with each
tree on ``PYTHONPATH``, alternating old and new ``--repeat`` times so that a noisy shared machine
weighs on both alike, and reports each tree's median wall time, their ratio, and whether the two
outputs' shards are byte for byte the same (the manifests' sha256 of every shard). ``--rev`` takes
the old tree from git (``git archive``); ``--old`` names a folder holding one (where there is no
git, e.g. on a lent machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import EXAMPLE_TOKENIZER, generate  # noqa: E402


def _old_tree(rev: str | None, old: str | None, work: Path) -> Path:
    if old:
        return Path(old).resolve()
    tree = work / f"tree-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "packprep"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def _run(tree: Path, data: Path, out: Path, args) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "packprep", "pack", str(data), "-t", args.tokenizer, "-o", str(out), "-q",
               "--max-len", str(args.max_len), "--num-proc", str(args.num_proc), "--strategy", args.strategy]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return took


def _shards(out: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((out / "packprep.json").read_text())["shards"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="the earlier packprep as a git revision")
    parser.add_argument("--old", help="the earlier packprep as a folder holding packprep/")
    parser.add_argument("--n", type=int, default=100_000, help="conversations [100000]")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--strategy", default="greedy")
    parser.add_argument("--tokenizer", default=str(EXAMPLE_TOKENIZER))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not (args.rev or args.old):
        parser.error("name the earlier packprep: --rev REV or --old DIR")
    with tempfile.TemporaryDirectory(prefix="packprep-versions-") as tmp:
        work = Path(tmp)
        data = work / "data.jsonl"
        generate(data, args.n)
        trees = {"old": _old_tree(args.rev, args.old, work), "new": REPO}
        times: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                times[name].append(_run(tree, data, work / name, args))
        same = _shards(work / "old") == _shards(work / "new")
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {"n": args.n, "num_proc": args.num_proc, "cpus": os.cpu_count(), "old": args.rev or args.old,
              "times_s": times, "median_s": medians, "new_over_old": medians["new"] / medians["old"],
              "shards_identical": same}
    print(f"| tree | median s ({args.repeat} runs) | runs |\n|---|---:|---|")
    for name in trees:
        print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{t:.2f}' for t in times[name])} |")
    print(f"\nnew / old = {result['new_over_old']:.3f}; shards identical: {same}; "
          f"{args.n:,} conversations, --num-proc {args.num_proc}, {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
