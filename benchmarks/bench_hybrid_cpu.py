#!/usr/bin/env python3
"""CPU cost of a packed row through tiny hybrid models, against a Llama of the same width and depth.

Every covered family (Qwen3.5, Qwen3-Next, Bamba, Nemotron-H, Falcon-H1, LFM2, Granite 4) as a tiny random
model (hidden 64, 4 token-mixing layers, 3 recurrent or convolutional : 1 attention where the family mixes
them; fp32, SDPA), after ``register_packed_layers`` (no kernel packages: transformers' torch functions, the
whole row in one call a wave). One packed row of 16 sequences through ``collate_packed`` (or, with
``--tokens N``, a row of N tokens from the GPU benchmark's long-tailed chat mix); forward and backward of the
summed cross-entropy; median of ``--reps`` rounds, the models taking turns within each round. ``--rows`` times
each model under each scan row length (``restarts.ROW``; 0: rows as long as the longest sequence, the layout
before rows were capped).

    python benchmarks/bench_hybrid_cpu.py [--reps 5] [--threads 2] [--out results.json]
    python benchmarks/bench_hybrid_cpu.py --tokens 4096 --rows 1024,0 --families qwen3_5,bamba

Granite 4's attention keeps packed sequences apart only with a cu_seq_lens attention (flash-attention or
``register_varlen_attention``, CUDA); on CPU it is timed with Mamba-2 layers alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from packprep.training import collate_packed, register_packed_layers, restarts  # noqa: E402

HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
MIX = ["linear_attention"] * 3 + ["full_attention"]
GDN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=16, layer_types=MIX, num_hidden_layers=4, **HEADS)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16, **HEADS)
CONFIGS = {
    "llama": lambda **c: transformers.LlamaConfig(num_hidden_layers=4, **HEADS, **c),
    "qwen3_5": lambda **c: transformers.Qwen3_5TextConfig(**GDN, **c),
    "qwen3_next": lambda **c: transformers.Qwen3NextConfig(
        **GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **c),
    "bamba": lambda **c: transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[3], **MAMBA2, **c),
    "nemotron_h": lambda **c: transformers.NemotronHConfig(  # its MLPs are layers of their own: 4 mixers, 4 MLPs
        layers_block_type=["linear_attention", "mlp"] * 3 + ["full_attention", "mlp"], head_dim=16, mamba_num_heads=4,
        mamba_head_dim=32, n_groups=1, ssm_state_size=16, chunk_size=16, **HEADS, **c),
    "falcon_h1": lambda **c: transformers.FalconH1Config(num_hidden_layers=4, mamba_d_ssm=128, **MAMBA2, **c),
    "lfm2": lambda **c: transformers.Lfm2Config(num_hidden_layers=4, layer_types=["conv"] * 3 + ["full_attention"],
                                                block_auto_adjust_ff_dim=False, **HEADS, **c),
    "granite4": lambda **c: transformers.GraniteMoeHybridConfig(
        num_hidden_layers=4, layer_types=["linear_attention"] * 4, num_local_experts=0, shared_intermediate_size=128,
        **MAMBA2, **c),
}


def build(family: str, vocab: int):
    torch.manual_seed(0)
    config = CONFIGS[family](vocab_size=vocab, hidden_size=64, intermediate_size=128, initializer_range=0.02,
                             max_position_embeddings=4096, pad_token_id=0, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model, register_packed_layers(model)


def row(n_seqs: int, vocab: int, tokens: int = 0, seed: int = 0) -> dict:
    """``n_seqs`` short sequences, or (``tokens``) sequences of the chat mix until the next would not fit."""
    rng = np.random.default_rng(seed)
    if tokens:
        lengths: list[int] = []
        while sum(lengths) + (n := int(np.clip(rng.lognormal(6.3, 0.9), 32, tokens))) <= tokens:
            lengths.append(n)
    else:
        lengths = np.clip(rng.lognormal(4.3, 0.7, n_seqs), 8, 400).astype(int).tolist()
    ids = rng.integers(1, vocab, sum(lengths))
    return collate_packed([{"input_ids": ids, "labels": ids, "seq_lens": lengths}])


def step(model, batch) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=0, help="a row of this many tokens of the chat mix")
    parser.add_argument("--rows", default=str(restarts.ROW), help="scan row lengths to time each model under "
                        "(0: as long as the longest sequence)")
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 256
    batch = row(args.sequences, vocab, args.tokens)
    models = {family: build(family, vocab) for family in args.families.split(",")}
    runs = [(family, int(r)) for family in models for r in args.rows.split(",")]
    times: dict[tuple, list[float]] = {run: [] for run in runs}
    for rep in range(args.reps + 1):  # the first round is a warm-up
        for family, r in runs:
            restarts.ROW = r or 1 << 40
            seconds = step(models[family][0], batch)
            times[(family, r)] += [seconds] if rep else []
    result = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
              "tokens": int(batch["input_ids"].shape[1]), "sequences": len(batch["cu_seq_lens_q"]) - 1, "rows": []}
    print(f"{'model':12} {'row':>6} {'fwd+bwd s':>10} {'x llama':>8}  path")
    for family, r in runs:
        median = statistics.median(times[(family, r)])
        base = statistics.median(times[("llama", r)]) if ("llama", r) in times else None
        entry = {"model": family, "row": r, "median_s": round(median, 4),
                 "vs_llama": round(median / base, 2) if base else None, "layers": models[family][1],
                 "times": [round(t, 4) for t in times[(family, r)]]}
        result["rows"].append(entry)
        print(f"{family:12} {r:>6} {median:10.3f} {entry['vs_llama'] or '':>8}  {models[family][1]}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
