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
   : 1 attention, vocabulary 32k) and a Mamba-2 hybrid of about 1B (Bamba: hidden 2048, 16 layers, 3 Mamba-2
   : 1 attention), bf16, AdamW, train on the same sequences (a long-tailed chat mix from 32 tokens), one
   optimizer step per group filling a row of each of ``--max-len`` tokens: packed (``collate_packed``, one
   row, varlen attention, fla's varlen kernels) and padded (``collate_padded``, SDPA with its mask, the same
   fla kernels without boundaries: the group sorted by length, in micro-batches of at most ``--slots`` padded
   tokens, each padded to the first of ``--buckets`` that holds its longest sequence; ``padded_max``: every
   sequence padded to the row length). ``packed_fallback`` runs the packed rows through packprep's torch
   fallback (rows of at most ``restarts.ROW`` tokens), ``packed_fallback_longest`` through the same with rows
   as long as the longest sequence (the layout before). Every batch shape runs once before the clock
   (compilation and autotuning untimed); real tokens/s and every step's loss, from the same initial weights,
   and the first step's loss of a float32 copy on transformers' torch functions (``fp32``, no step taken).

    python benchmarks/gpu_hybrid.py [--part speed,grads] [--models qwen3_5,bamba] [--max-len 4096,16384]
                                    [--modes packed,padded] [--paths fla,fallback] [--steps 6] [--out results.json]
    python benchmarks/gpu_hybrid.py --device cpu --part grads --paths fallback   # CPU smoke runs
    python benchmarks/gpu_hybrid.py --device cpu --part speed --max-len 512 --buckets 128,256,512 --steps 3 \
        --modes fp32,packed_fallback,packed_fallback_longest,padded

On Hopper, flash-linear-attention 0.6 needs Triton >= 3.7.1 for its gated kernels' backward. fla compiles and
autotunes its kernels on first use (minutes on an empty Triton cache): keep ``TRITON_CACHE_DIR`` between runs,
and ``--autotune-configs 1`` compiles one config a kernel (the nearest 4 warps and 2 stages) and times none.
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
from packprep.training import register_varlen_attention, restarts  # noqa: E402
from packprep.training.layers import layer_type_of, stateful_layers  # noqa: E402

HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MIX = ["linear_attention"] * 3 + ["full_attention"]
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
           layer_types=MIX, num_hidden_layers=4, **HEADS)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_chunk_size=64, **HEADS)
FAMILIES = {
    "qwen3_5": lambda **c: transformers.Qwen3_5TextConfig(**GDN, **c),
    "qwen3_next": lambda **c: transformers.Qwen3NextConfig(  # every token to all 4 experts: bf16 flips no choice
        **GDN, num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128,
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
    restarts.ROW = MODES["packed"][2]
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
    raise _Timeout("no result within its time limit (--family-timeout, --part-timeout)")


def guarded(run, limit: int, label: dict) -> dict:
    """``run()``'s row, or ``label`` with the error if it fails or runs past ``limit`` seconds: one failure is a
    result, not the end of the run."""
    print(json.dumps({"start": label, "t": round(time.perf_counter() - T0, 1)}), flush=True)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    faulthandler.dump_traceback_later(limit + 15)  # where it is stuck, if the alarm cannot interrupt it
    try:
        return run()
    except (Exception, _Timeout) as exc:
        return {**label, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()


def gradient_rows(families, paths, attn: str, device: str, limit: int, results: dict, out: str) -> None:
    """One row per family and path; a family that fails or runs past ``limit`` seconds is a row with its error."""
    for family in families:
        for path in paths:
            results["grads"].append(guarded(lambda: gradients(family, path, attn, device), limit,
                                            {"family": family, "path": path}))
            if "error" in results["grads"][-1]:
                print(json.dumps(results["grads"][-1]), flush=True)
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


def bamba_1b(tiny: bool = False):
    """The Mamba-2 hybrid speed model (Bamba: 3 Mamba-2 layers : 1 attention); ``tiny`` for a CPU smoke run."""
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4) if tiny else dict(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=16)
    layers = size["num_hidden_layers"]
    return transformers.BambaConfig(
        **size, num_attention_heads=16, num_key_value_heads=4, attn_layer_indices=list(range(3, layers, 4)),
        mamba_n_heads=size["hidden_size"] * 2 // 64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_chunk_size=256, vocab_size=32000, tie_word_embeddings=True, initializer_range=0.02, use_cache=False)


SPEED_MODELS = {"qwen3_5": qwen3_5_1b, "bamba": bamba_1b}


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


def _fla_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, float("inf")), **kwargs):
    return hybrid._mamba2_fla(hidden_states, dt, A, B, C, None, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit)


@contextlib.contextmanager
def padded_through_fla(model):
    """Padded batches of a Mamba-2 model through fla's scan without boundaries (``chunk_simple_gla``), the kernel
    its packed rows run; transformers already binds a Gated DeltaNet's padded batches to fla's kernel."""
    modules = {sys.modules[type(m).__module__] for _, m in stateful_layers(model) if layer_type_of(m).name == "mamba2"}
    saved = {modeling: modeling.mamba2_chunk_scan for modeling in modules}
    for modeling in modules:
        modeling.mamba2_chunk_scan = _fla_scan
    try:
        yield
    finally:
        for modeling, function in saved.items():
            modeling.mamba2_chunk_scan = function


MODES = {  # mode: (packed, path of the packed rows' stateful layers, restarts.ROW, dtype)
    "packed": (True, "fla", restarts.ROW, torch.bfloat16),
    "packed_fallback": (True, "fallback", restarts.ROW, torch.bfloat16),
    "packed_fallback_longest": (True, "fallback", 1 << 40, torch.bfloat16),
    "padded": (False, "fla", restarts.ROW, torch.bfloat16),
    "padded_max": (False, "fla", restarts.ROW, torch.bfloat16),
    "fp32": (False, "fallback", restarts.ROW, torch.float32),
}


def _model(config, mode: str, attn: str, device: str):
    packed, path, row, dtype = MODES[mode]
    use_path(path)
    restarts.ROW = row
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn if packed else "sdpa",
                                                              dtype=dtype)
    used = register_packed_layers(model) if packed else {}
    if mode == "fp32":
        return model, used, torch_path(model)
    on_fla = not packed and device == "cuda" and FLA_AVAILABLE()
    return model, used, padded_through_fla(model) if on_fla else contextlib.nullcontext()


def throughput(config, steps, mode: str, attn: str, buckets: list[int], slots: int, device: str = "cuda") -> dict:
    """Train on ``steps`` from fixed initial weights; every batch shape is run once (forward and backward, no
    optimizer step) before the clock starts, so that compilation and autotuning are outside the timing.
    ``fp32``: the first step's loss alone, no gradient."""
    packed = MODES[mode][0]
    model, used, context = _model(config, mode, attn, device)
    rng = np.random.default_rng(0)
    data = [_batches(lens, packed, buckets, slots, config.vocab_size, rng, device) for lens in steps]
    if mode == "fp32":
        with context, torch.no_grad():
            total = sum(n for _, n in data[0])
            loss = sum(float(model(**batch).loss) * n / total for batch, n in data[0])
        return {"mode": mode, "losses": [round(loss, 4)]}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model.train()
    shapes = {tuple(b["input_ids"].shape): (b, n) for micro in data for b, n in micro}
    with context:
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
    row = {"mode": mode, "attn": attn if packed else "sdpa", "layers": used, "steps": len(steps),
           "micro_batches": sum(len(m) for m in data), "shapes": sorted(shapes), "warmup_seconds": round(warmup, 1),
           "tokens": tokens, "slots_with_pad": sum(b["input_ids"].numel() for m in data for b, _ in m),
           "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds), "losses": losses,
           "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
           "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None}
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


def _ratios(rows: dict) -> dict:
    """Packed over each other mode (tokens/s), and the largest step-loss difference over the steps both ran."""
    out = {}
    for mode, row in rows.items():
        for base in ("packed", "packed_fallback_longest"):
            if mode != base and base in rows and "tokens_per_s" in row and "tokens_per_s" in rows[base]:
                out[f"{base}_over_{mode}"] = round(rows[base]["tokens_per_s"] / row["tokens_per_s"], 2)
        if mode != "packed" and "packed" in rows and "losses" in row and "losses" in rows["packed"]:
            pairs = list(zip(rows["packed"]["losses"], row["losses"]))
            out[f"loss_max_abs_diff_packed_vs_{mode}"] = round(max(abs(a - b) for a, b in pairs), 4)
    return out


def speed(args, attn: str, results: dict, lengths: str) -> None:
    """Packed and padded training of the same steps, from the same weights: tokens/s and every step's loss, for
    each model and row length."""
    tiny = args.device == "cpu"
    buckets = [int(b) for b in args.buckets.split(",")]
    for name in args.models.split(","):
        for max_len in (int(n) for n in lengths.split(",")):
            steps = steps_of(max_len, args.steps, np.random.default_rng(0))
            rows = {}
            for mode in args.modes.split(","):
                label = {"model": name, "max_len": max_len, "mode": mode}
                todo = steps[:args.steps_padded_max] if mode == "padded_max" else steps
                row = guarded(lambda: throughput(
                    SPEED_MODELS[name](tiny), todo, mode, attn, [max_len] if mode == "padded_max" else
                    [b for b in buckets if b < max_len] + [max_len], args.slots or max(16384, max_len), args.device),
                    args.part_timeout, label)
                rows[mode] = {**label, **row}
                results["speed"].append(rows[mode])
                print(json.dumps(rows[mode]), flush=True)
                save(results, args.out)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            results["ratios"].append({"model": name, "max_len": max_len, **_ratios(rows)})
            print(json.dumps(results["ratios"][-1]), flush=True)
            save(results, args.out)


def prune_autotuning(keep: int) -> None:
    """Triton autotunes a kernel by compiling and timing each of its configs on first use (minutes for fla on
    an empty cache): keep the ``keep`` nearest 4 warps and 2 stages, the next if one does not fit the GPU."""
    from triton.runtime import autotuner, errors

    run = autotuner.Autotuner.run

    def pruned(self, *args, **kwargs):
        if not hasattr(self, "_ranked"):
            self._ranked = sorted(self.configs, key=lambda c: (abs(c.num_warps - 4), abs(c.num_stages - 2)))
            self.configs = self._ranked[:keep]
        while True:
            try:
                return run(self, *args, **kwargs)
            except errors.OutOfResources:
                if len(self._ranked) <= keep:
                    raise
                self._ranked = self._ranked[keep:]
                self.configs = self._ranked[:keep]

    autotuner.Autotuner.run = pruned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="speed,grads", help="the parts, run in this order; speed@N: the speed "
                        "part at row length N alone")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--paths", default="fla,fallback")
    parser.add_argument("--family-timeout", type=int, default=240, help="grads: seconds for one family and path")
    parser.add_argument("--models", default="qwen3_5,bamba", help="speed: " + ", ".join(SPEED_MODELS))
    parser.add_argument("--modes", default="fp32,packed,padded,padded_max,packed_fallback,packed_fallback_longest",
                        help="speed: " + ", ".join(MODES))
    parser.add_argument("--steps", type=int, default=6, help="speed: timed optimizer steps per mode")
    parser.add_argument("--steps-padded-max", type=int, default=2, help="speed: of those, how many padded_max runs")
    parser.add_argument("--max-len", default="4096,16384", help="speed: row lengths")
    parser.add_argument("--buckets", default="512,1024,2048,4096,8192", help="speed: the lengths padded batches pad "
                        "to (below the row length; the row length is the last)")
    parser.add_argument("--slots", type=int, default=0, help="speed: padded tokens a micro-batch (0: the row "
                        "length, at least 16384)")
    parser.add_argument("--part-timeout", type=int, default=240, help="speed: seconds for one model, length, mode")
    parser.add_argument("--autotune-configs", type=int, default=0, help="compile this many configs a Triton "
                        "kernel (0: all, as Triton does)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (a tiny speed model)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_hybrid.json"))
    args = parser.parse_args()
    attn = register_varlen_attention() or "sdpa"
    for family in FAMILIES:  # transformers' torch functions, read before any register_packed_layers replaces them
        _torch_functions(_tiny(family, "meta"))
    if args.autotune_configs:
        prune_autotuning(args.autotune_configs)
    results = {**versions(), "args": vars(args), "grads": [], "speed": [], "ratios": []}
    print(json.dumps(results), flush=True)
    for part in args.part.split(","):
        if part.startswith("speed"):
            speed(args, attn, results, part.partition("@")[2] or args.max_len)
        elif part == "grads":
            gradient_rows(args.families.split(","), args.paths.split(","), attn, args.device, args.family_timeout,
                          results, args.out)


if __name__ == "__main__":
    main()
