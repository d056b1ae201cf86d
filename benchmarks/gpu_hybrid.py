"""GPU proof for hybrid models: packed sequences kept apart by the fast kernels, and what packing buys.

1. equality (bf16): a Qwen3.5-shaped model and a Bamba (Mamba-2 hybrid) model with random weights;
   ``register_packed_layers`` (flash-linear-attention's varlen kernels: gated delta rule, causal conv,
   simple GLA for the Mamba-2 scan); a packed row of several sequences through ``collate_packed`` vs
   each sequence alone: max logit difference against the bf16 tolerance, and the same row with its
   boundaries withheld (the leak the kernels prevent).
2. speed: a Qwen3.5-shaped ~1B model (vocabulary 32k) (hidden 2048, 16 layers, 3 Gated DeltaNet : 1 attention) trains
   on the same sequences packed (``collate_packed``, one (1, T) row a step, varlen attention) and
   padded (``collate_padded``, SDPA with a padding mask), side by side: real (non-pad) tokens/s.

    python benchmarks/gpu_hybrid.py [--steps 6] [--tokens 8192] [--out results.json]
    python benchmarks/gpu_hybrid.py --tiny      # CPU smoke run of the same code (no fla: per-sequence path)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from packprep.training import (collate_packed, collate_padded, register_packed_layers,  # noqa: E402
                            register_varlen_attention)


def qwen3_5(tiny: bool, big: bool = False):
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                     linear_num_value_heads=4, vocab_size=256)
    elif big:
        shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, head_dim=256,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                     linear_num_value_heads=16, vocab_size=32000, tie_word_embeddings=True)
    else:
        shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, head_dim=128,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
                     linear_num_value_heads=8, vocab_size=4096)
    layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return transformers.Qwen3_5TextConfig(num_attention_heads=8, num_key_value_heads=2, use_cache=False,
                                          layer_types=layers * (shape["num_hidden_layers"] // 4),
                                          initializer_range=0.02 if big else 0.1, **shape)


def bamba(tiny: bool):
    shape = (dict(hidden_size=64, intermediate_size=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                  vocab_size=256) if tiny else dict(hidden_size=512, intermediate_size=1024, mamba_n_heads=16, mamba_d_head=64,
                               mamba_d_state=128, vocab_size=4096))
    return transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[3], num_attention_heads=8,
                                    num_key_value_heads=2, mamba_chunk_size=64, use_cache=False, initializer_range=0.1,
                                    **shape)


def build(config, device, dtype, attn):
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model, register_packed_layers(model)


def equality(name, config, device, dtype, attn, lengths=(300, 77, 513, 150)) -> dict:
    model, used = build(config, device, dtype, attn)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in lengths]
    batch = collate_packed([{"input_ids": torch.cat(seqs), "labels": torch.cat(seqs), "seq_lens": list(lengths)}])
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    withheld = {k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                            "max_length_k", "seq_idx")}
    cu = batch["cu_seq_lens_q"].tolist()
    spans = list(zip(cu[:-1], cu[1:]))
    with torch.no_grad():
        packed = model(**batch).logits[0].float()
        leaky = model(**withheld).logits[0].float()
        alone = [model(input_ids=s[None].to(device), use_cache=False).logits[0].float() for s in seqs]
        model.float()  # the fp32 reference: the same weights, each sequence alone (SDPA: flash is bf16-only)
        model.set_attn_implementation("sdpa")
        ref = [model(input_ids=s[None].to(device), use_cache=False).logits[0].float() for s in seqs]

    def err(parts, truth):
        return max(float((one - true).abs().max()) for one, true in zip(parts, truth))

    def split(full):
        return [full[a:b] for a, b in spans]

    scale = max(float(one.abs().max()) for one in ref)
    tol = 1e-3 if dtype == torch.float32 else max(0.25, 0.05 * scale)
    row = {"model": name, "layers": used, "attn": attn, "packed_vs_alone": err(split(packed), alone),
           "packed_vs_fp32": err(split(packed), ref), "alone_vs_fp32": err(alone, ref),
           "withheld_vs_fp32": err(split(leaky), ref), "logit_scale": scale, "tolerance": tol}
    row["equal"] = row["packed_vs_fp32"] <= max(tol, 2 * row["alone_vs_fp32"])
    print(json.dumps(row), flush=True)
    return row


def lengths_for(n_tokens: int, rng) -> list[list[int]]:
    """Steps of sequence lengths (a long-tailed chat mix, 32..2048 tokens), each step about ``n_tokens``."""
    steps, step = [], []
    while len(steps) < 64:
        n = int(np.clip(rng.lognormal(6.3, 0.9), 32, 2048))
        if sum(step) + n > n_tokens:
            steps.append(step)
            step = []
        step.append(n)
    return steps


def throughput(model, steps, vocab, device, packed: bool, forward_only: bool, warmup: int = 2) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    model.train()
    torch.set_grad_enabled(not forward_only)
    rng = np.random.default_rng(0)
    done = tokens = 0
    padded_tokens = 0
    start = None
    for i, lens in enumerate(steps):
        rows = [{"input_ids": rng.integers(3, vocab, n), "labels": rng.integers(3, vocab, n), "seq_lens": [n]}
                for n in lens]
        batch = collate_packed(rows) if packed else collate_padded(rows)
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(**batch).loss
        if not forward_only:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            done += 1
            tokens += sum(lens)
            padded_tokens += batch["input_ids"].numel()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del opt
    torch.set_grad_enabled(True)
    return {"packed": packed, "forward_only": forward_only, "steps": done, "tokens": tokens,
            "batch_tokens_with_pad": padded_tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (fp32, tiny models, no speed part)")
    parser.add_argument("--steps", type=int, default=6, help="measured optimizer steps per mode (after 2 warm-up)")
    parser.add_argument("--tokens", type=int, default=8192, help="real tokens per step")
    parser.add_argument("--forward-only", action="store_true",
                        help="time forward passes only (fla 0.6 refuses the gated-delta backward on Hopper with "
                             "Triton < 3.7.1)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_hybrid.json"))
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    varlen = register_varlen_attention() or "sdpa"
    results = {"torch": torch.__version__, "transformers": transformers.__version__,
               "device": "cpu" if args.tiny else torch.cuda.get_device_name(), "equality": [], "speed": []}
    lengths = (30, 7, 51, 15) if args.tiny else (300, 77, 513, 150)
    for name, config in (("qwen3_5", qwen3_5(args.tiny)), ("bamba", bamba(args.tiny))):
        results["equality"].append(equality(name, config, device, dtype, varlen, lengths))
    if not args.tiny:
        config = qwen3_5(False, big=True)
        steps = lengths_for(args.tokens, np.random.default_rng(0))[: args.steps + 2]
        for packed in (True, False):
            torch.cuda.reset_peak_memory_stats()
            model, _ = build(config, device, dtype, varlen if packed else "sdpa")
            row = throughput(model, steps, config.vocab_size, device, packed, args.forward_only)
            row.update(params_b=round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
                       attn=varlen if packed else "sdpa")
            print(json.dumps(row), flush=True)
            results["speed"].append(row)
            del model
            torch.cuda.empty_cache()
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
