#!/usr/bin/env python3
"""Simulation: the predicted step efficiency of greedy rows dealt by a shuffling sampler vs rows
balanced by ``pack --balance-dp`` (docs/balanced-packing.md), on long-tailed data.

Data: the fixture conversations (../shared/fixtures/conversations, tokenized as ``pack`` does with
the llama3 tokenizer) plus lognormal synthetic lengths (mu 6.6, sigma 1.5: median 735 tokens, 1 in
1,000 longer than 80k), truncated to ``--max-len`` as ``pack --overlong truncate`` does.
Step efficiency: mean over whole steps of (mean rank cost / slowest rank cost); one row a rank a
step (``--rows-per-step 1``, the hardest case). Two cost models:

  flops   what packprep uses by default: training FLOPs of the Llama-3.2-1B shape (packprep.cost)
  h200    fitted to the times measured on one H200 in issue 26 (1B Llama, bf16, varlen attention:
          32k row of one sequence 1.78 s, of 64 x 512 0.74 s): 2.208e-5 s a token + 9.84e-10 s a
          squared length (it reproduces the 16k figures, 0.63 s and 0.37 s)

Rows are balanced with the flops model and judged with the h200 one ("balanced"), so the column
includes the error of the default model; "balanced, fit" balances with the h200 model itself.

Usage: python benchmarks/bench_balance.py [--synthetic 20000] [--markdown]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from packprep.balance import balance_bins, step_efficiency  # noqa: E402
from packprep.cost import CostModel, model_cost  # noqa: E402
from packprep.packing import order_bins, pack_lengths  # noqa: E402

H200 = CostModel(per_token=2.208e-5, per_square=9.84e-10, source="fit: H200, issue 26")


def fixture_lengths(fixtures: str) -> np.ndarray:
    """Token counts of the fixture conversations, rendered and tokenized exactly as pack does."""
    from packprep.encode import Encoding
    from packprep.ledger import Ledger
    from packprep.engines import make_engine
    from packprep.pipeline import PackConfig
    from packprep.read import resolve_inputs
    from packprep.length_stats.collect import collect_inputs

    folder = os.path.join(fixtures, "conversations")
    paths = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith((".json", ".jsonl")))
    config = PackConfig.from_settings({"max_len": 1 << 20}, "stats")
    encoding = Encoding.open(resolve_inputs(paths), os.path.join(fixtures, "tokenizers", "llama3"), config, 1 << 20)
    engine = make_engine("local", 1)
    try:
        return collect_inputs(encoding, Ledger(config.on_error), [1 << 20], engine, False).lengths
    finally:
        engine.close()


def simulate(lengths: np.ndarray, max_len: int, dp: int, seed: int = 0) -> dict:
    lengths = np.minimum(lengths, max_len)
    greedy = pack_lengths(lengths, max_len, "greedy")
    shuffled = order_bins(greedy, "shuffle", seed)

    def efficiency(bins, judge=H200):
        return step_efficiency(judge.row_costs(bins.entry_lengths(lengths), bins.offsets), dp)

    started = time.perf_counter()
    balanced = balance_bins(greedy, lengths, max_len, dp, cost=model_cost(), seed=seed)
    seconds = time.perf_counter() - started
    fitted = balance_bins(greedy, lengths, max_len, dp, cost=H200, seed=seed)
    return {
        "max_len": max_len, "ranks": dp, "sequences": len(lengths), "rows_greedy": greedy.n_bins,
        "rows_balanced": balanced.n_bins, "greedy_shuffled": efficiency(shuffled),
        "greedy_shuffled_flops": efficiency(shuffled, model_cost()), "balanced": efficiency(balanced),
        "balanced_fit": efficiency(fitted), "attention_share": H200.attention_share(lengths),
        "balance_seconds": seconds,
    }


def table(results: list[dict]) -> str:
    lines = ["| max_len | ranks | rows (greedy = balanced) | greedy, shuffled sampler | balanced | balanced, fit "
             "| greedy, shuffled (flops model) | attention share | balance time |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows = f"{r['rows_greedy']:,}"
        if r["rows_balanced"] != r["rows_greedy"]:
            rows += f" / {r['rows_balanced']:,}"
        lines.append(f"| {r['max_len']:,} | {r['ranks']} | {rows} | {r['greedy_shuffled']:.3f} | {r['balanced']:.3f} | "
                     f"{r['balanced_fit']:.3f} | {r['greedy_shuffled_flops']:.3f} | {r['attention_share']:.0%} | "
                     f"{r['balance_seconds']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--synthetic", type=int, default=20000, help="lognormal sequences added to the fixtures")
    parser.add_argument("--fixtures", default=os.path.join(REPO, "..", "shared", "fixtures"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    fixtures = fixture_lengths(args.fixtures) if os.path.isdir(args.fixtures) else np.zeros(0, np.int64)
    rng = np.random.default_rng(args.seed)
    synthetic = np.maximum(np.rint(rng.lognormal(6.6, 1.5, args.synthetic)), 16).astype(np.int64)
    lengths = np.concatenate([fixtures, synthetic])
    print(f"{len(fixtures):,} fixture conversations ({int(fixtures.sum()):,} tokens) + {len(synthetic):,} lognormal "
          f"({int(synthetic.sum()):,} tokens); p50 {int(np.median(lengths))}, p99 {int(np.percentile(lengths, 99))}, "
          f"max {int(lengths.max()):,}\n")
    results = [simulate(lengths, max_len, dp, args.seed) for max_len in (16384, 32768) for dp in (4, 8)]
    print(table(results))


if __name__ == "__main__":
    main()
