"""GPU proof for hybrid models trained on packed rows: gradients equal to each sequence alone, and the speed.

1. ``--part grads``: every covered family (Qwen3.5, Qwen3-Next, Bamba, Nemotron-H, Falcon-H1, LFM2, Granite 4)
   as a small random model (hidden 256, 4 token-mixing layers, 3 recurrent or convolutional : 1 attention,
   init std 0.02), attention ``packprep_varlen``, ``register_packed_layers``. One row of 4 packed sequences
   (300, 77, 513, 150 tokens) through ``collate_packed``. For each path of the stateful layers
   (flash-linear-attention's varlen kernels; packprep's torch fallback, the whole row in one call), the
   gradient of the summed loss in bf16, packed, against a float32 reference: the same weights, each sequence
   run alone (SDPA). Beside it, the sequences run alone in bf16 (what bf16 rounding alone costs) and the row
   with its boundaries withheld (the leak). Relative L2 error over all parameters.
2. ``--part speed``: a Qwen3.5-shaped model of about 1B parameters (hidden 2048, 16 layers, 3 Gated DeltaNet
   : 1 attention, vocabulary 32k, bf16, AdamW) trains on the same sequences (a long-tailed chat mix of 32 to
   4096 tokens) packed into rows of 4096 tokens (``collate_packed``, one row a step, varlen attention) and
   padded (``collate_padded``, the same sequences as one right-padded batch a step, SDPA with its mask):
   real tokens/s and the loss of every step in both modes, from the same initial weights.

    python benchmarks/gpu_hybrid.py [--part speed,grads] [--modes packed,padded] [--paths fla,fallback]
                                    [--steps 8] [--out results.json]
    python benchmarks/gpu_hybrid.py --device cpu --part grads --paths fallback   # CPU smoke run

On Hopper, flash-linear-attention 0.6 needs Triton >= 3.7.1 for its gated kernels' backward.
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

from packprep.training import collate_packed, collate_padded, hybrid, register_packed_layers  # noqa: E402
from packprep.training import register_varlen_attention  # noqa: E402

HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MIX = ["linear_attention"] * 3 + ["full_attention"]
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
           layer_types=MIX, num_hidden_layers=4, **HEADS)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64, **HEADS)
FAMILIES = {
    "qwen3_5": lambda **c: transformers.Qwen3_5TextConfig(**GDN, **c),
    "qwen3_next": lambda **c: transformers.Qwen3NextConfig(
        **GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        **c),
    "bamba": lambda **c: transformers.BambaConfig(num_hidden_layers=4, attn_layer_indices=[3], **MAMBA2, **c),
    "nemotron_h": lambda **c: transformers.NemotronHConfig(
        layers_block_type=["linear_attention", "mlp"] * 3 + ["full_attention", "mlp"], mamba_num_heads=8,
        mamba_head_dim=64, n_groups=1, ssm_state_size=64, chunk_size=64, **HEADS, **c),
    "falcon_h1": lambda **c: transformers.FalconH1Config(num_hidden_layers=4, mamba_d_ssm=512, **MAMBA2, **c),
    "lfm2": lambda **c: transformers.Lfm2Config(num_hidden_layers=4, layer_types=["conv"] * 3 + ["full_attention"],
                                                block_auto_adjust_ff_dim=False, **HEADS, **c),
    "granite4": lambda **c: transformers.GraniteMoeHybridConfig(
        num_hidden_layers=4, layer_types=MIX, num_local_experts=0, shared_intermediate_size=512, **MAMBA2, **c),
}
FLA_AVAILABLE = hybrid.fla_available


def use_path(path: str) -> None:
    """flash-linear-attention's kernels (``fla``) or packprep's torch fallback (``fallback``, even with fla installed)
    for the packed rows of the stateful layers: the functions look ``fla_available`` up at each call."""
    hybrid.fla_available = (lambda: False) if path == "fallback" else FLA_AVAILABLE


BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _on(batch: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _grads(model, batches) -> torch.Tensor:
    """The gradient of the summed token loss of ``batches`` (each a forward), all parameters in one float32 vector."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0].float()
        labels = batch["labels"][0]
        torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum").backward()
    grads = [p.grad.float().reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
             for p in model.parameters()]
    return torch.cat(grads)


def gradients(family: str, path: str, attn: str, device: str = "cuda", lengths=(300, 77, 513, 150)) -> dict:
    """bf16 packed / alone / boundaries-withheld gradients against the float32 gradients of each sequence alone."""
    use_path(path)
    torch.manual_seed(0)
    config = FAMILIES[family](vocab_size=4096, hidden_size=256, intermediate_size=512, initializer_range=0.02,
                              max_position_embeddings=4096, pad_token_id=0, use_cache=False)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in lengths]
    packed = _on(collate_packed([{"input_ids": torch.cat(seqs), "labels": torch.cat(seqs), "seq_lens": list(lengths)}]),
                 device)
    alone = [_on(collate_packed([{"input_ids": s, "labels": s, "seq_lens": [len(s)]}]), device) for s in seqs]
    alone = [{k: v for k, v in b.items() if k not in BOUNDARIES} for b in alone]
    reference = _grads(model, alone)  # float32, SDPA, each sequence alone
    model.to(torch.bfloat16)
    model.set_attn_implementation(attn)
    used = register_packed_layers(model)
    got = {"packed": _grads(model, [packed]), "alone": _grads(model, alone),
           "withheld": _grads(model, [{k: v for k, v in packed.items() if k not in BOUNDARIES}])}
    err = {name: float((g - reference).norm() / reference.norm()) for name, g in got.items()}
    row = {"family": family, "path": path, "layers": used, "attn": attn, "packed_vs_fp32": round(err["packed"], 5),
           "alone_vs_fp32": round(err["alone"], 5), "withheld_vs_fp32": round(err["withheld"], 5)}
    row["equal"] = err["packed"] <= 1.5 * err["alone"] + 1e-3
    print(json.dumps(row), flush=True)
    return row


def qwen3_5_1b():
    return transformers.Qwen3_5TextConfig(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, head_dim=256, num_attention_heads=8,
        num_key_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=16, vocab_size=32000, tie_word_embeddings=True, layer_types=MIX * 4,
        initializer_range=0.02, use_cache=False)


def steps_of(max_len: int, n_steps: int, rng) -> list[list[int]]:
    """Sequence lengths of ``n_steps`` packed rows of at most ``max_len`` tokens (next fit over a chat mix)."""
    steps, step = [], []
    while len(steps) < n_steps:
        n = int(np.clip(rng.lognormal(6.3, 0.9), 32, max_len))
        if sum(step) + n > max_len:
            steps.append(step)
            step = []
        step.append(n)
    return steps


def throughput(config, steps, packed: bool, attn: str, warmup: int = 2) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    used = register_packed_layers(model) if packed else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model.train()
    rng = np.random.default_rng(0)
    losses, tokens, slots, start = [], 0, 0, None
    torch.cuda.reset_peak_memory_stats()
    for i, lens in enumerate(steps):
        rows = [{"input_ids": ids, "labels": ids, "seq_lens": [n]}
                for n in lens for ids in [rng.integers(3, config.vocab_size, n)]]
        batch = _on(collate_packed(rows) if packed else collate_padded(rows), "cuda")
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss), 4))
        if i >= warmup:
            tokens += sum(lens)
            slots += batch["input_ids"].numel()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"mode": "packed" if packed else "padded", "attn": attn, "layers": used, "steps": len(steps) - warmup,
           "tokens": tokens, "slots_with_pad": slots, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds), "losses": losses,
           "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    print(json.dumps(row), flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return row


def versions() -> dict:
    import importlib.metadata as md

    found = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("triton", "fla-core", "flash-linear-attention"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def save(results: dict, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="speed,grads", help="the parts, run in this order")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--paths", default="fla,fallback")
    parser.add_argument("--modes", default="packed,padded", help="speed part: the modes to time")
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps per mode (after 2 warm-up)")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the gradient part (fallback path)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_hybrid.json"))
    args = parser.parse_args()
    attn = register_varlen_attention() or "sdpa"
    results = {**versions(), "grads": [], "speed": []}
    print(json.dumps(results), flush=True)
    for part in args.part.split(","):
        if part == "speed":
            use_path("fla")
            steps = steps_of(args.max_len, args.steps + 2, np.random.default_rng(0))
            for mode in args.modes.split(","):
                packed = mode == "packed"
                results["speed"].append(throughput(qwen3_5_1b(), steps, packed, attn if packed else "sdpa"))
                save(results, args.out)
            if len(results["speed"]) == 2:
                pk, pd = results["speed"]
                print(json.dumps({"packed_over_padded": round(pk["tokens_per_s"] / pd["tokens_per_s"], 2)}), flush=True)
        for family in args.families.split(",") if part == "grads" else []:
            for path in args.paths.split(","):
                try:
                    results["grads"].append(gradients(family, path, attn, args.device))
                except Exception as exc:  # one family's failure is a result, not the end of the run
                    results["grads"].append({"family": family, "path": path, "error": f"{type(exc).__name__}: {exc}"})
                    print(json.dumps(results["grads"][-1])[:2000], flush=True)
                save(results, args.out)


if __name__ == "__main__":
    main()
