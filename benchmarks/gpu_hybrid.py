"""GPU proof for hybrid models trained on packed rows: gradients equal to each sequence alone, and the speed.

1. ``--part grads``: every covered family (Qwen3.5, Qwen3-Next, Bamba, Nemotron-H, Falcon-H1, LFM2, Granite 4)
   as a small random model (hidden 256, 4 token-mixing layers, 3 recurrent or convolutional : 1 attention,
   init std 0.02), attention ``packprep_varlen``, ``register_packed_layers``. One row of 4 packed sequences
   (300, 77, 513, 150 tokens) through ``collate_packed``. For each path of the stateful layers
   (flash-linear-attention's varlen kernels; packprep's torch fallback, the whole row in one call), the
   gradient of the summed loss in bf16, packed, against a float32 reference: the same weights, each sequence
   run alone (SDPA) through transformers' torch functions. Beside it, the sequences run alone in bf16 (what
   bf16 rounding alone costs) and the row with its boundaries withheld (the leak). Relative L2 error over all
   parameters. A family that fails or outruns ``--family-timeout`` is a row with its error.
2. ``--part speed``: a Qwen3.5-shaped model of about 1B parameters (hidden 2048, 16 layers, 3 Gated DeltaNet
   : 1 attention, vocabulary 32k, bf16, AdamW) trains on the same sequences (a long-tailed chat mix of 32 to
   4096 tokens), one optimizer step per group filling a row of 4096 tokens: packed (``collate_packed``, one
   row, varlen attention) and padded (``collate_padded``, SDPA with its mask: the group sorted by length, in
   micro-batches of at most ``--slots`` padded tokens, each padded to the first of ``--buckets`` that holds
   its longest sequence; ``padded_max``: every sequence padded to ``--max-len``). Every batch shape runs once
   before the clock (compilation and autotuning untimed); real tokens/s and every step's loss in both modes,
   from the same initial weights.

    python benchmarks/gpu_hybrid.py [--part speed,grads] [--modes packed,padded] [--paths fla,fallback]
                                    [--steps 12] [--out results.json]
    python benchmarks/gpu_hybrid.py --device cpu --part grads --paths fallback   # CPU smoke runs
    python benchmarks/gpu_hybrid.py --device cpu --part speed --max-len 512 --buckets 128,256,512 --steps 3

On Hopper, flash-linear-attention 0.6 needs Triton >= 3.7.1 for its gated kernels' backward. fla compiles and
autotunes its kernels on first use (minutes on an empty Triton cache): keep ``TRITON_CACHE_DIR`` between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from packprep.training import collate_packed, collate_padded, hybrid, register_packed_layers  # noqa: E402
from packprep.training import register_varlen_attention  # noqa: E402
from packprep.training.layers import layer_type_of, stateful_layers  # noqa: E402

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


_TORCH_FUNCTIONS: dict = {}  # (modeling module, function name) -> transformers' torch function, seen before packprep


def _torch_functions(model) -> dict:
    """transformers' own torch function for each function packprep replaces in ``model``'s stateful layers.

    transformers picks flash-linear-attention's kernel for a Gated DeltaNet whenever ``fla`` is importable (at
    import, ``use_kernel_func_from_hub_with_fallback``); the torch function is its wrapper's ``__wrapped__``.
    Read once per modeling module, before ``register_packed_layers`` replaces the wrapper."""
    found = {}
    for _, module in stateful_layers(model):
        modeling = sys.modules[type(module).__module__]
        for name in layer_type_of(module).functions:
            key = (modeling, name)
            if key not in _TORCH_FUNCTIONS:
                current = getattr(modeling, name)
                if getattr(current, "_packprep_packed", False):
                    raise RuntimeError(f"{modeling.__name__}.{name} was replaced before its torch function was read")
                _TORCH_FUNCTIONS[key] = getattr(current, "__wrapped__", current)
            found[key] = _TORCH_FUNCTIONS[key]
    return found


@contextlib.contextmanager
def torch_path(model):
    """Run ``model``'s stateful layers through transformers' torch functions (no fla kernel, no compile)."""
    swaps = _torch_functions(model)
    saved = {key: getattr(*key) for key in swaps}
    for (modeling, name), function in swaps.items():
        setattr(modeling, name, function)
    try:
        yield
    finally:
        for (modeling, name), function in saved.items():
            setattr(modeling, name, function)


def _tiny(family: str, device: str):
    torch.manual_seed(0)
    config = FAMILIES[family](vocab_size=4096, hidden_size=256, intermediate_size=512, initializer_range=0.02,
                              max_position_embeddings=4096, pad_token_id=0, use_cache=False)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def gradients(family: str, path: str, attn: str, device: str = "cuda", lengths=(300, 77, 513, 150)) -> dict:
    """bf16 packed / alone / boundaries-withheld gradients against the float32 gradients of each sequence alone.

    The float32 reference runs on transformers' torch functions (``torch_path``): exact arithmetic of each
    sequence alone, and no flash-linear-attention kernel compiled and autotuned for float32 and each new length."""
    use_path(path)
    started = time.perf_counter()
    model = _tiny(family, device)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in lengths]
    packed = _on(collate_packed([{"input_ids": torch.cat(seqs), "labels": torch.cat(seqs), "seq_lens": list(lengths)}]),
                 device)
    alone = [_on(collate_packed([{"input_ids": s, "labels": s, "seq_lens": [len(s)]}]), device) for s in seqs]
    alone = [{k: v for k, v in b.items() if k not in BOUNDARIES} for b in alone]
    with torch_path(model):
        reference = _grads(model, alone)  # float32, SDPA, torch functions, each sequence alone
    model.to(torch.bfloat16)
    model.set_attn_implementation(attn)
    used = register_packed_layers(model)
    got = {"packed": _grads(model, [packed]), "alone": _grads(model, alone),
           "withheld": _grads(model, [{k: v for k, v in packed.items() if k not in BOUNDARIES}])}
    err = {name: float((g - reference).norm() / reference.norm()) for name, g in got.items()}
    row = {"family": family, "path": path, "layers": used, "attn": attn, "packed_vs_fp32": round(err["packed"], 5),
           "alone_vs_fp32": round(err["alone"], 5), "withheld_vs_fp32": round(err["withheld"], 5)}
    row["equal"] = err["packed"] <= 1.5 * err["alone"] + 1e-3
    row["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(row), flush=True)
    return row


class _Timeout(BaseException):
    """Not an ``Exception``, so that no library's ``except Exception`` around a kernel call swallows it."""


def _alarm(signum, frame):
    raise _Timeout("no result within --family-timeout seconds")


def gradient_rows(families, paths, attn: str, device: str, limit: int, results: dict, out: str) -> None:
    """One row per family and path; a family that fails or runs past ``limit`` seconds is a row with its error."""
    signal.signal(signal.SIGALRM, _alarm)
    for family in families:
        for path in paths:
            print(json.dumps({"start": family, "path": path, "t": round(time.perf_counter() - T0, 1)}), flush=True)
            signal.alarm(limit)
            faulthandler.dump_traceback_later(limit + 15)  # where it is stuck, if the alarm cannot interrupt it
            try:
                results["grads"].append(gradients(family, path, attn, device))
            except (Exception, _Timeout) as exc:  # one family's failure is a result, not the end of the run
                error = f"{type(exc).__name__}: {exc}"[:2000]
                results["grads"].append({"family": family, "path": path, "error": error})
                print(json.dumps(results["grads"][-1]), flush=True)
            finally:
                signal.alarm(0)
                faulthandler.cancel_dump_traceback_later()
            save(results, out)


def qwen3_5_1b(tiny: bool = False):
    """The speed model; ``tiny``: 4 layers of width 256 for a CPU smoke run."""
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4) if tiny else dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=16)
    return transformers.Qwen3_5TextConfig(
        **size, head_dim=256, num_attention_heads=8, num_key_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16, vocab_size=32000,
        tie_word_embeddings=True, layer_types=MIX * (size["num_hidden_layers"] // 4), initializer_range=0.02,
        use_cache=False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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


def padded_batches(lens: list[int], buckets: list[int], slots: int) -> list[list[int]]:
    """A padded trainer's micro-batches for one optimizer step: the step's sequences, longest first (grouped by
    length), as many a micro-batch as fit in ``slots`` tokens once each is padded to the bucket length of the
    micro-batch's longest (a fixed set of lengths, so that the kernels see a few shapes)."""
    batches: list[list[int]] = []
    for n in sorted(lens, reverse=True):
        if batches and (len(batches[-1]) + 1) * bucket_of(batches[-1][0], buckets) <= slots:
            batches[-1].append(n)
        else:
            batches.append([n])
    return batches


def bucket_of(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def _batches(lens, packed: bool, buckets, slots, vocab: int, rng, device) -> list[tuple[dict, int]]:
    """The step's (batch, supervised tokens) on ``device``: one packed row, or padded micro-batches."""
    rows = [{"input_ids": ids, "labels": ids, "seq_lens": [n]} for n in lens for ids in [rng.integers(3, vocab, n)]]
    if packed:
        return [(_on(collate_packed(rows), device), sum(lens) - len(lens))]
    out, at = [], 0
    for group in padded_batches(lens, buckets, slots):
        part = sorted(rows, key=lambda r: -len(r["input_ids"]))[at:at + len(group)]
        at += len(group)
        batch = collate_padded(part, pad_to_multiple_of=bucket_of(group[0], buckets), count=True)
        n = batch.pop("num_supervised_tokens")
        out.append((_on(batch, device), n))
    return out


def _step(model, micro: list[tuple[dict, int]]) -> float:
    """Forward and backward of one optimizer step: each micro-batch's mean loss weighted by its share of the
    step's supervised tokens, so that the step's loss is the same token mean in both modes."""
    total = sum(n for _, n in micro)
    loss = 0.0
    for batch, n in micro:
        part = model(**batch).loss * (n / total)
        part.backward()
        loss += float(part.detach())
    return loss


def throughput(config, steps, mode: str, attn: str, buckets: list[int], slots: int, device: str = "cuda") -> dict:
    """Train on ``steps`` from fixed initial weights; every batch shape is run once (forward and backward, no
    optimizer step) before the clock starts, so that compilation and autotuning are outside the timing."""
    packed = mode == "packed"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
    used = register_packed_layers(model) if packed else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model.train()
    rng = np.random.default_rng(0)
    data = [_batches(lens, packed, buckets, slots, config.vocab_size, rng, device) for lens in steps]
    shapes = {tuple(b["input_ids"].shape): (b, n) for micro in data for b, n in micro}
    t = time.perf_counter()
    for batch, n in shapes.values():
        _step(model, [(batch, n)])
    opt.zero_grad(set_to_none=True)
    _sync(device)
    warmup = time.perf_counter() - t
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    start = time.perf_counter()
    for micro in data:
        losses.append(round(_step(model, micro), 4))
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(sum(lens) for lens in steps)
    row = {"mode": mode, "attn": attn, "layers": used, "steps": len(steps),
           "micro_batches": sum(len(m) for m in data), "shapes": sorted(shapes), "warmup_seconds": round(warmup, 1),
           "tokens": tokens, "slots_with_pad": sum(b["input_ids"].numel() for m in data for b, _ in m),
           "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds), "losses": losses,
           "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None}
    print(json.dumps(row), flush=True)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def versions() -> dict:
    import importlib.metadata as md

    found = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
             "transformers": transformers.__version__}
    for name in ("triton", "fla-core", "flash-linear-attention"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def save(results: dict, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)


T0 = time.perf_counter()


def speed(args, attn: str, results: dict) -> None:
    """Packed and padded training of the same steps, from the same weights: tokens/s and every step's loss."""
    use_path("fla")
    tiny = args.device == "cpu"
    steps = steps_of(args.max_len, args.steps, np.random.default_rng(0))
    buckets = [int(b) for b in args.buckets.split(",")]
    for mode in args.modes.split(","):
        packed = mode == "packed"
        print(json.dumps({"start": mode, "t": round(time.perf_counter() - T0, 1)}), flush=True)
        try:
            row = throughput(qwen3_5_1b(tiny), steps, mode, attn if packed else "sdpa",
                             [args.max_len] if mode == "padded_max" else buckets, args.slots or 4 * args.max_len,
                             args.device)
            results["speed"].append(row)
        except Exception as exc:  # an out-of-memory padded mode is a result too
            results["speed"].append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(json.dumps(results["speed"][-1]), flush=True)
        save(results, args.out)
    done = {r["mode"]: r for r in results["speed"] if "tokens_per_s" in r}
    if {"packed", "padded"} <= set(done):
        pk, pd = done["packed"], done["padded"]
        results["packed_over_padded"] = round(pk["tokens_per_s"] / pd["tokens_per_s"], 2)
        results["loss_max_abs_diff"] = round(max(abs(a - b) for a, b in zip(pk["losses"], pd["losses"])), 4)
    if {"packed", "padded_max"} <= set(done):
        ratio = done["packed"]["tokens_per_s"] / done["padded_max"]["tokens_per_s"]
        results["packed_over_padded_max"] = round(ratio, 2)
    print(json.dumps({k: v for k, v in results.items() if k.startswith(("packed_over", "loss_max"))}), flush=True)
    save(results, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="speed,grads", help="the parts, run in this order")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--paths", default="fla,fallback")
    parser.add_argument("--family-timeout", type=int, default=240, help="grads: seconds for one family and path")
    parser.add_argument("--modes", default="packed,padded", help="speed: packed, padded (to --buckets), padded_max "
                        "(every sequence padded to --max-len)")
    parser.add_argument("--steps", type=int, default=12, help="speed: timed optimizer steps per mode")
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--buckets", default="512,1024,2048,4096", help="speed: the lengths padded batches pad to")
    parser.add_argument("--slots", type=int, default=0, help="speed: padded tokens a micro-batch (0: 4x --max-len)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (a tiny speed model)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_hybrid.json"))
    args = parser.parse_args()
    attn = register_varlen_attention() or "sdpa"
    results = {**versions(), "args": vars(args), "grads": [], "speed": []}
    print(json.dumps(results), flush=True)
    for part in args.part.split(","):
        if part == "speed":
            speed(args, attn, results)
        elif part == "grads":
            gradient_rows(args.families.split(","), args.paths.split(","), attn, args.device, args.family_timeout,
                          results, args.out)


if __name__ == "__main__":
    main()
