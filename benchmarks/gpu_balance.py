#!/usr/bin/env python3
"""Four GPUs: tokens/s of rows balanced by compute (``pack --balance-dp``) against greedy rows dealt by
a shuffling DistributedSampler, DDP synchronising every micro-batch (issue 26, docs/balanced-packing.md).

Run from the repo root on a machine with 4 GPUs (torch with CUDA and transformers; nothing to install:
packprep is read from this tree without pyarrow, click or numba, which is used if present, else the
same first-fit-decreasing in Python):

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/gpu_balance.py

(``$OUT``, default ./out, receives the report.) The fixture conversations' tokens come from
``benchmarks/fixtures_llama3.npz`` (git-ignored; carry it to the machine), made where the fixtures are:

    python benchmarks/bench_train.py --dump-fixtures benchmarks/fixtures_llama3.npz --max-len 1048576

Without it (and without ../shared/fixtures) the run uses synthetic sequences only and says so.

CPU dry run (gloo, a tiny model; what the tests of this script run):

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_balance.py --tiny --max-len 512

What it does, each phase timed against ``--budget-s`` (400 s by default, under 8 minutes with start-up):
1. Model: a Llama-3.2-1B-shaped LlamaForCausalLM, random weights (seed 0), bf16, vocabulary 32000
   (fixture token ids are taken modulo 32000). Attention: packprep.training's varlen attention
   (``torch.nn.attention.varlen``, CUDA), else flash_attention_2 if installed, else transformers' sdpa
   on packed position ids, else eager: the first that ``packprep.training.check_isolation`` passes
   (sequences kept apart) runs, and the report names it.
2. Memory: a ``--max-len`` row of one sequence, forward and backward, on every rank; on out-of-memory,
   again with gradient checkpointing, then at ``--fallback-max-len``.
3. Calibration on rank 0 alone (the others wait): forward+backward time of rows of 1, 2, 4, 16 and 64
   equal sequences of max_len tokens and two half rows; a least-squares fit of seconds against tokens,
   sum of squared lengths and sequences gives the cost model that balances the rows.
4. Data: the fixture conversations (``--fixtures-npz``, made by ``bench_train.py --dump-fixtures``, or
   tokenized here from ``--fixtures-dir`` with its llama3 tokenizer) for at most half the tokens, plus
   lognormal synthetic sequences (mu 6.6 + ln(max_len / 32768), sigma 1.5, random ids, first 20-60%
   masked), as many as make ``--steps`` steps (fewer if the calibrated times say the budget is short).
   Plan (a): packprep's greedy rows, read through ``DistributedSampler(shuffle=True)``. Plan (b): the same
   rows balanced by ``packprep.balance.balance_bins`` for the world size, one row a rank a step, read
   through ``DistributedSampler(shuffle=False)``. Both must hold the same sequences (checked).
5. Loss check (initial weights): every sequence of a few balanced steps (the heaviest, the lightest, the
   first two) and of the greedy rows that hold them: its mean token loss in either plan must agree
   (0.02 in bf16, 1e-4 in float32).
6. Measurement: one epoch of each plan (a, then b, the same initial weights, a fresh AdamW), one row a
   rank a micro-batch, an optimizer step every micro-batch (DDP all-reduces every backward: ranks
   synchronise each step). Per step: wall time (synchronised), each rank's forward time. The first two
   steps of each plan are not timed.

Writes ``$OUT/gpu_balance.json`` and ``$OUT/gpu_balance.md`` (OUT defaults to ./out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from packprep.balance import balance_bins, step_efficiency  # noqa: E402
from packprep.cost import CostModel  # noqa: E402
from packprep.packing import Bins  # noqa: E402
from packprep.training import check_isolation, collate_packed, register_varlen_attention  # noqa: E402

IGNORE = -100
VOCAB = 32000
CUDA = torch.cuda.is_available() and os.environ.get("BENCH_DEVICE", "cuda") == "cuda"


def log(*parts):
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def device():
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# model, attention, memory


def build_model(tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16) if tiny else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64))
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=500000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, use_cache=False, attention_dropout=0.0,
                         **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if CUDA else torch.float32
    with torch.device(device()):
        model = LlamaForCausalLM(config).to(dtype)
    return model


def choose_attention(model, wanted: str) -> str:
    """The first attention implementation that keeps packed sequences apart in this model."""
    candidates = [wanted] if wanted != "auto" else ["packprep_varlen", "flash_attention_2", "sdpa", "eager"]
    for name in candidates:
        if name == "packprep_varlen" and register_varlen_attention() is None:
            continue
        try:
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(name)
            else:  # older transformers: the layers read the config
                model.config._attn_implementation = name
            check_isolation(model, via_collator=True, lengths=(40, 23))
            return name
        except Exception as exc:  # not installed, not supported here, or leaking: the next one
            log(f"attention {name}: not used ({type(exc).__name__}: {str(exc)[:160]})")
    raise SystemExit("no attention implementation keeps packed sequences apart on this machine")


def random_row(lengths, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, int(sum(lengths))).astype(np.int64)
    return {"input_ids": ids, "labels": ids.copy(), "seq_lens": np.asarray(lengths, np.int64)}


def to_device(batch: dict) -> dict:
    return {k: (v.to(device(), non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def forward_backward(model, row: dict) -> None:
    out = model(**to_device(collate_packed([row])))
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def set_checkpointing(model, on: bool) -> None:
    """Activation checkpointing on or off (transformers 5.2x names it so; earlier, gradient_...)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _room_left(model) -> bool:
    """Whether the peak of a forward+backward leaves room for what training adds: AdamW's two states
    and DDP's gradient buckets (three more copies of the weights), and 4 GiB to spare."""
    if not CUDA:
        return True
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return torch.cuda.max_memory_allocated() + 3 * weights + (4 << 30) <= total


def fit_memory(model, max_lens, checkpointing: str) -> tuple[int, bool]:
    """(max_len, gradient checkpointing): the first setting in which a row of one max_len sequence
    runs forward and backward on every rank."""
    choices = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]
    for max_len in max_lens:
        for ckpt in choices:
            set_checkpointing(model, ckpt)
            ok = torch.ones(1, device=device())
            try:
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                forward_backward(model, random_row([max_len]))
                sync()
                ok.fill_(float(_room_left(model)))
            except (torch.OutOfMemoryError, RuntimeError) as exc:  # cuBLAS reports some as RuntimeError
                if "out of memory" not in str(exc).lower():
                    raise
                ok.zero_()
            model.zero_grad(set_to_none=True)
            if CUDA:
                torch.cuda.empty_cache()
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            verdict = "fits" if ok.item() else "out of memory, or too little room left to train"
            log(f"max_len {max_len}, gradient checkpointing {ckpt}: {verdict}")
            if ok.item():
                return max_len, ckpt
    raise SystemExit("not even --fallback-max-len fits in memory")


# ------------------------------------------------------------------------------------------------
# calibration


def time_row(model, lengths, repeats: int) -> float:
    row = random_row(lengths, seed=len(lengths))
    forward_backward(model, row)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        forward_backward(model, row)
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def calibrate(model, max_len: int, repeats: int) -> tuple[CostModel, list]:
    """Rank 0 times rows of different mixes; every rank gets the fitted cost model (seconds)."""
    mixes = [[max_len // k] * k for k in (1, 2, 4, 16, 64)] + [[max_len // 2], [max_len // 64] * 32]
    payload = [None]
    if dist.get_rank() == 0:
        rows = [(mix, time_row(model, mix, repeats)) for mix in mixes]
        payload = [(_fit(rows), [{"sequences": len(m), "length": m[0], "seconds": round(t, 4)} for m, t in rows])]
    dist.barrier()
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _fit(rows) -> CostModel:
    """Least squares of seconds on (tokens, sum of squares, sequences, 1); a negative coefficient is
    dropped and the rest refitted; the intercept (a row's fixed time) is the same on every rank."""
    x = np.array([[sum(m), sum(v * v for v in m), len(m), 1.0] for m, _ in rows], dtype=np.float64)
    y = np.array([t for _, t in rows])
    scale = x.max(axis=0)
    keep = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
        negative = [k for k, c in zip(keep, coef) if c < 0 and k != 3]
        if not negative:
            break
        keep.remove(negative[0])
    full = np.zeros(4)
    full[keep] = coef / scale[keep]
    per_token, per_square = max(full[0], 1e-12), max(full[1], 1e-18)
    return CostModel(float(per_token), float(per_square), float(full[2]), source="fit: forward+backward seconds")


# ------------------------------------------------------------------------------------------------
# data and plans


def fixture_sequences(args) -> list:
    """(ids, labels) of the fixture conversations tokenized with the llama3 tokenizer, if found."""
    import bench_train

    path = args.fixtures_npz
    if not os.path.exists(path) and os.path.isdir(args.fixtures_dir):
        if dist.get_rank() == 0:
            bench_train.dump_fixtures(args.fixtures_dir, path, 1 << 20)
        dist.barrier()
    if not os.path.exists(path):
        log(f"no fixtures ({path}, {args.fixtures_dir}): synthetic sequences only")
        return []
    return [(ids.astype(np.int64) % VOCAB, np.where(labels == IGNORE, IGNORE, labels.astype(np.int64) % VOCAB))
            for ids, labels in bench_train.fixture_samples(path)]


def synthetic(rng, max_len: int) -> tuple:
    n = int(min(max_len, max(16, round(rng.lognormal(6.6 + math.log(max_len / 32768), 1.5)))))
    ids = rng.integers(0, VOCAB, n).astype(np.int64)
    labels = ids.copy()
    labels[: max(1, int(n * rng.uniform(0.2, 0.6)))] = IGNORE
    return ids, labels


def make_sequences(fixtures: list, max_len: int, tokens: int, seed: int) -> list:
    """Fixture conversations (at most half the tokens, truncated to max_len) then synthetic ones."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    for k in rng.permutation(len(fixtures)):
        ids, labels = fixtures[k]
        if total + min(len(ids), max_len) > tokens // 2:
            break
        out.append((ids[:max_len], labels[:max_len]))
        total += len(out[-1][0])
    while total < tokens:
        out.append(synthetic(rng, max_len))
        total += len(out[-1][0])
    return out


def greedy(lengths: np.ndarray, max_len: int) -> Bins:
    """packprep's greedy rows (numba); without numba the same first-fit-decreasing in Python."""
    try:
        import numba  # noqa: F401
        from packprep.packing import pack_lengths

        return pack_lengths(lengths, max_len, "greedy")
    except ImportError:
        rows, free = [], []
        for i in np.argsort(-lengths, kind="stable"):
            n = int(lengths[i])
            b = next((b for b, f in enumerate(free) if f >= n), len(rows))
            if b == len(rows):
                rows.append([])
                free.append(max_len)
            rows[b].append(int(i))
            free[b] -= n
        offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        return Bins(items=np.concatenate(rows).astype(np.int32), offsets=offsets)


def rows_of(bins: Bins, sequences: list) -> list:
    out = []
    for b in range(bins.n_bins):
        items = bins.items[bins.offsets[b]:bins.offsets[b + 1]].tolist()
        out.append({"input_ids": np.concatenate([sequences[i][0] for i in items]),
                    "labels": np.concatenate([sequences[i][1] for i in items]),
                    "seq_lens": np.array([len(sequences[i][0]) for i in items], np.int64), "items": items})
    return out


def plan(args, fixtures, max_len: int, cost: CostModel, world: int) -> dict:
    """The sequences, then plan (a) greedy rows and (b) the same balanced, sized to the time left."""
    pool = make_sequences(fixtures, max_len, args.steps * world * max_len, args.seed)
    lengths = np.array([len(ids) for ids, _ in pool], np.int64)
    rows = greedy(lengths, max_len)
    costs = cost.row_costs(rows.entry_lengths(lengths), rows.offsets)
    shuffled = costs[np.random.default_rng(args.seed).permutation(len(costs))]
    step_s = float(np.mean(shuffled[: len(costs) // world * world].reshape(-1, world).max(axis=1))) * 1.1 + 0.15
    steps = max(8, min(args.steps, int(args.plan_budget_s / step_s)))
    if steps < args.steps:  # fewer sequences: the same mixture, as many tokens as the budget allows
        pool = make_sequences(fixtures, max_len, steps * world * max_len, args.seed)
        lengths = np.array([len(ids) for ids, _ in pool], np.int64)
        rows = greedy(lengths, max_len)
    balanced = balance_bins(rows, lengths, max_len, world, 1, cost=cost, seed=args.seed)
    same = sorted(rows.items.tolist()) == sorted(balanced.items.tolist()) == list(range(len(pool)))
    if not same:
        raise SystemExit("the two plans do not hold the same sequences")
    predicted = {
        "greedy_shuffled": step_efficiency(shuffled, world),
        "balanced": step_efficiency(cost.row_costs(balanced.entry_lengths(lengths), balanced.offsets), world),
    }
    log(f"{len(pool)} sequences, {int(lengths.sum()):,} tokens, {rows.n_bins} greedy rows = {balanced.n_bins} "
        f"balanced rows; predicted step efficiency {predicted}")
    return {"sequences": pool, "lengths": lengths, "greedy": rows_of(rows, pool),
            "balanced": rows_of(balanced, pool), "predicted": predicted, "same_sequences": same,
            "estimated_step_s": step_s}


# ------------------------------------------------------------------------------------------------
# loss check


def sequence_losses(model, rows: list) -> dict:
    """{sequence: (summed token loss, tokens in the loss)} of every sequence of ``rows``."""
    out = {}
    with torch.no_grad():
        for row in rows:
            batch = to_device(collate_packed([row]))
            labels = batch.pop("labels")[0]
            logits = model(**batch).logits[0].float()
            token = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="none")
            counted = (labels[1:] != IGNORE)
            start = 0
            for item, n in zip(row["items"], row["seq_lens"].tolist()):
                out[item] = (float(token[start:start + n - 1].sum()), int(counted[start:start + n - 1].sum()))
                start += n
    return out


def check_losses(model, plans: dict, world: int) -> dict:
    """Each sequence of a few balanced steps, and of the greedy rows that hold them: its mean token loss
    in either plan, under the same (initial) weights."""
    balanced, greedy_rows = plans["balanced"], plans["greedy"]
    steps = len(balanced) // world
    step_tokens = [sum(len(balanced[s * world + r]["input_ids"]) for r in range(world)) for s in range(steps)]
    step_load = [sum(float(np.square(balanced[s * world + r]["seq_lens"]).sum()) for r in range(world))
                 for s in range(steps)]
    chosen = sorted({0, min(1, steps - 1), int(np.argmax(step_load)), int(np.argmin(step_tokens))})
    b_rows = [balanced[s * world + r] for s in chosen for r in range(world)]
    wanted = {i for row in b_rows for i in row["items"]}
    g_rows = [row for row in greedy_rows if wanted & set(row["items"])]
    model.eval()
    mine = (sequence_losses(model, b_rows[dist.get_rank()::world]),
            sequence_losses(model, g_rows[dist.get_rank()::world]))
    model.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    in_b = {k: v for part in gathered for k, v in part[0].items()}
    in_g = {k: v for part in gathered for k, v in part[1].items() if k in wanted}
    tolerance = 0.02 if CUDA else 1e-4
    diffs = [abs(in_b[k][0] / max(1, in_b[k][1]) - in_g[k][0] / max(1, in_g[k][1])) for k in wanted]
    counts_equal = all(in_b[k][1] == in_g[k][1] for k in wanted)
    result = {"steps_checked": chosen, "sequences": len(wanted), "max_abs_diff_mean_token_loss": max(diffs),
              "tolerance": tolerance, "counts_equal": counts_equal,
              "equal": bool(max(diffs) <= tolerance and counts_equal and set(in_g) == wanted)}
    log(f"loss check: {result}")
    return result


# ------------------------------------------------------------------------------------------------
# measurement


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return {k: row[k] for k in ("input_ids", "labels", "seq_lens")}


def run_plan(ddp, rows: list, shuffle: bool, seed: int, deadline: float, warmup: int = 2) -> dict:
    """One epoch of ``rows`` through a DistributedSampler, one row a rank a step; per-step times."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = Rows(rows)
    sampler = DistributedSampler(data, shuffle=shuffle, seed=seed, drop_last=True)
    loader = DataLoader(data, batch_size=1, sampler=sampler, collate_fn=collate_packed)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-5, foreach=True)
    records = []
    for step, batch in enumerate(loader):
        stop = torch.tensor([float(time.time() > deadline)], device=device())
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            log(f"time budget: stopped after {step} steps of {len(loader)}")
            break
        tokens = int(batch["input_ids"].shape[1])
        batch = to_device(batch)
        sync()
        start = time.perf_counter()
        loss = ddp(**batch).loss
        sync()
        forward = time.perf_counter() - start
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        records.append({"step": step, "seconds": time.perf_counter() - start, "forward": forward,
                        "tokens": tokens, "timed": step >= warmup})
    del optimizer
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return summarize(gathered)


def summarize(per_rank: list) -> dict:
    steps = min(len(r) for r in per_rank)
    timed = [k for k in range(steps) if per_rank[0][k]["timed"]]
    wall = np.array([max(r[k]["seconds"] for r in per_rank) for k in timed])
    tokens = np.array([sum(r[k]["tokens"] for r in per_rank) for k in timed])
    forward = np.array([[r[k]["forward"] for r in per_rank] for k in timed])
    if not timed:  # the budget ran out during the warm-up steps
        wall, tokens, forward = np.full(1, np.nan), np.zeros(1), np.full((1, 1), np.nan)
    return {
        "steps": steps, "timed_steps": len(timed), "tokens": int(tokens.sum()), "seconds": float(wall.sum()),
        "tokens_per_s": float(tokens.sum() / wall.sum()),
        "step_s": {"mean": float(wall.mean()), "p10": float(np.percentile(wall, 10)),
                   "p50": float(np.median(wall)), "p90": float(np.percentile(wall, 90)),
                   "max": float(wall.max()), "cv": float(wall.std() / wall.mean())},
        "forward_rank_balance": float(np.mean(forward.mean(axis=1) / forward.max(axis=1))),
    }


# ------------------------------------------------------------------------------------------------
# report and main


def markdown(report: dict) -> str:
    a, b = report["greedy_shuffled"], report["balanced"]
    lines = [f"Machine: {report['machine']}; {report['world_size']} ranks, DDP (all-reduce every backward, no "
             f"accumulation: ranks synchronise every micro-batch), one row of max_len {report['max_len']} a rank a "
             f"step, AdamW every step; attention `{report['attention']}`, gradient checkpointing "
             f"{report['gradient_checkpointing']}, {report['dtype']}.", "",
             "| plan | steps timed | tokens | seconds | tokens/s | step s p10 / p50 / p90 / max | step CV "
             "| forward balance | predicted step efficiency |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for name, run, key in (("greedy rows, shuffled DistributedSampler", a, "greedy_shuffled"),
                           ("balanced rows (--balance-dp), in order", b, "balanced")):
        t = run["step_s"]
        spread = " / ".join(f"{t[k]:.3f}" for k in ("p10", "p50", "p90", "max"))
        lines.append(f"| {name} | {run['timed_steps']} | {run['tokens']:,} | {run['seconds']:.1f} | "
                     f"{run['tokens_per_s']:,.0f} | {spread} | "
                     f"{t['cv']:.3f} | {run['forward_rank_balance']:.3f} | {report['predicted'][key]:.3f} |")
    check = report["loss_check"]
    lines += ["", f"Balanced / greedy tokens/s: **{report['ratio']:.3f}x**. Same sequences in both plans: "
              f"{report['same_sequences']}. Loss check (initial weights, {check['sequences']} sequences of balanced "
              f"steps {check['steps_checked']}): max difference of a sequence's mean token loss "
              f"{check['max_abs_diff_mean_token_loss']:.2e} (tolerance {check['tolerance']}), equal: {check['equal']}.",
              f"Cost model fitted on rank 0: {report['cost_model']['per_token']:.3e} s a token, "
              f"{report['cost_model']['per_square']:.3e} s a squared length, "
              f"{report['cost_model']['per_sequence']:.3e} s a sequence. Forward balance: mean over steps of "
              "mean / slowest rank's forward time."]
    return "\n".join(lines) + "\n"


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--fallback-max-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=80, help="steps of each plan at most (one epoch)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="the whole run, start-up excluded")
    parser.add_argument("--attention", default="auto",
                        help="auto | packprep_varlen | flash_attention_2 | sdpa | eager")
    parser.add_argument("--checkpointing", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--calibration-repeats", type=int, default=2)
    parser.add_argument("--fixtures-npz", default=os.path.join(REPO, "benchmarks", "fixtures_llama3.npz"))
    parser.add_argument("--fixtures-dir", default=os.path.join(REPO, "..", "shared", "fixtures"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry runs)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    started = time.time()
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if CUDA else "gloo")
    world = dist.get_world_size()
    model = build_model(args.tiny)
    attention = choose_attention(model, args.attention)
    log(f"attention: {attention}")
    max_len, ckpt = fit_memory(model, [args.max_len, args.fallback_max_len], args.checkpointing)
    cost, calibration = calibrate(model, max_len, args.calibration_repeats)
    log(f"calibration: {calibration}; fit {cost}")
    fixtures = fixture_sequences(args)
    spent = time.time() - started
    args.plan_budget_s = max(10.0, (args.budget_s - spent - 40) / 2)
    plans = plan(args, fixtures, max_len, cost, world)
    loss_check = check_losses(model, plans, world)
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False,
                                                    device_ids=[torch.cuda.current_device()] if CUDA else None)
    left = args.budget_s - (time.time() - started) - 10
    runs = {"greedy_shuffled": run_plan(ddp, plans["greedy"], True, args.seed, time.time() + left / 2)}
    log(f"greedy, shuffled: {runs['greedy_shuffled']}")
    model.load_state_dict(initial)
    runs["balanced"] = run_plan(ddp, plans["balanced"], False, args.seed, time.time() + left / 2 - 5)
    log(f"balanced: {runs['balanced']}")
    if dist.get_rank() == 0:
        machine = (f"{world} x {torch.cuda.get_device_name(0)}" if CUDA else f"{world} CPU processes (gloo)")
        report = {"machine": machine, "world_size": world, "max_len": max_len, "attention": attention,
                  "gradient_checkpointing": ckpt, "dtype": str(next(model.parameters()).dtype),
                  "torch": torch.__version__, "calibration": calibration, "cost_model": cost.as_dict(),
                  "predicted": plans["predicted"], "same_sequences": plans["same_sequences"],
                  "sequences": len(plans["sequences"]), "loss_check": loss_check, **runs,
                  "ratio": runs["balanced"]["tokens_per_s"] / max(1e-9, runs["greedy_shuffled"]["tokens_per_s"]),
                  "wall_s": time.time() - started, "args": {k: v for k, v in vars(args).items()}}
        out = os.environ.get("OUT", "./out")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_balance.json"), "w") as handle:
            json.dump(report, handle, indent=1)
        with open(os.path.join(out, "gpu_balance.md"), "w") as handle:
            handle.write(markdown(report))
        print(markdown(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
