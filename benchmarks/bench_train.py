#!/usr/bin/env python3
"""GPU training benchmark: padding vs length-grouped padding vs packed rows (SDPA / varlen_attn).

A Llama-3.2-1B-shaped model with random bf16 weights is trained for one epoch over the same
samples in each mode (AdamW, one optimizer step per batch, loss normalised per supervised token):

  padding        batches of --pad-batch samples in random order, padded to the longest, SDPA + mask
  grouped        the same, but length-grouped like transformers' group_by_length
                 (megabatches of 50 * batch sorted by length)
  packed_sdpa    FFD-packed rows of --max-len (one row a step) written as packprep shards, read back
                 through packprep.training.PackedDataset + collate_packed, transformers' SDPA
                 packed-sequence path (position_ids, no mask, use_cache=False)
  packed_varlen  the same rows through torch.nn.attention.varlen.varlen_attn
                 (packprep.training.register_varlen_attention)
  random_varlen  rows packed in random order (next-fit, no sorting), varlen_attn
  <packed mode>_xK  K packed rows a step, concatenated by collate_packed into one (1, K*max-len) batch

Reports supervised tokens/s, time per epoch, optimizer steps, peak GPU memory and ratios to
padding.  With --data shards:DIR the packed modes train on the rows of a real packprep output
folder (packprep.pack) and the padding modes on the same conversations unpacked.  Samples come from a synthetic lognormal length distribution (--data lognormal) or
from the fixture conversations tokenized with the llama3 tokenizer (--data fixtures:PATH.npz,
made on a machine with the fixtures by --dump-fixtures).  --exactness runs the packed-vs-alone
check in bf16 on the GPU with the real kernels instead of the timing.

Needs only torch, transformers, numpy and pyarrow (plus packprep/ from this tree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" only for dry runs of --exactness


def load_packprep_torch():
    """packprep.training from this tree (it needs only torch and numpy to import; pyarrow to read shards)."""
    sys.path.insert(0, REPO)
    import packprep.training as pt

    return pt


# ------------------------------------------------------------------------------------------
# samples
# ------------------------------------------------------------------------------------------


def lognormal_samples(n, max_len, seed, vocab=128000, mu=6.6, sigma=0.8):
    """n samples with lognormal lengths (mean ~1000 tokens), a masked prompt and a trained answer."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 16, max_len).astype(np.int64)
    samples = []
    for n_tok in lens:
        ids = rng.integers(0, vocab, n_tok).astype(np.int32)
        prompt = int(n_tok * rng.uniform(0.2, 0.6))
        lab = ids.copy()
        lab[: max(prompt, 1)] = IGNORE
        samples.append((ids, lab))
    return samples


ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
        "function_call": "assistant", "observation": "ipython", "function": "ipython",
        "tool": "ipython", "system": "system"}


def _conversations(path):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as fh:
            data = [json.loads(line) for line in fh if line.strip()]
    else:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    for ex in data:
        msgs = []
        if ex.get("system"):
            msgs.append(("system", ex["system"]))
        if "conversations" in ex:
            for m in ex["conversations"]:
                msgs.append((ROLE.get(m.get("from"), "user"), m.get("value", "")))
            if isinstance(ex.get("chosen"), dict):  # DPO demo: train on the chosen answer
                msgs.append(("assistant", ex["chosen"].get("value", "")))
        elif "messages" in ex:
            for m in ex["messages"]:
                msgs.append((ROLE.get(m.get("role"), "user"), m.get("content", "")))
        if any(r == "assistant" for r, _ in msgs):
            yield msgs


def dump_fixtures(fixtures, out_path, max_len):
    """Tokenize the fixture conversations with the llama3 chat format -> npz (ids, labels, lens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(fixtures, "tokenizers", "llama3", "tokenizer.json"))
    bos, sh, eh, eot = 128000, 128006, 128007, 128009
    all_ids, all_lab, lens, n_trunc = [], [], [], 0
    conv_dir = os.path.join(fixtures, "conversations")
    files = sorted(f for f in os.listdir(conv_dir) if f.endswith((".json", ".jsonl")))
    for name in files:
        for msgs in _conversations(os.path.join(conv_dir, name)):
            ids, lab = [bos], [IGNORE]
            for role, content in msgs:
                head = [sh] + tok.encode(role, add_special_tokens=False).ids + [eh] + \
                    tok.encode("\n\n", add_special_tokens=False).ids
                body = tok.encode(str(content).strip(), add_special_tokens=False).ids + [eot]
                ids += head + body
                lab += [IGNORE] * len(head) + (body if role == "assistant" else [IGNORE] * len(body))
            if len(ids) > max_len:
                ids, lab, n_trunc = ids[:max_len], lab[:max_len], n_trunc + 1
            all_ids += ids
            all_lab += lab
            lens.append(len(ids))
    np.savez_compressed(out_path, ids=np.array(all_ids, np.int32), labels=np.array(all_lab, np.int32),
                        lens=np.array(lens, np.int64), files=np.array(files))
    lens = np.array(lens)
    print(f"wrote {out_path}: {len(lens)} conversations from {len(files)} files, {lens.sum()} tokens, "
          f"mean {lens.mean():.0f}, max {lens.max()}, truncated to {max_len}: {n_trunc}")


def fixture_samples(path):
    with np.load(path) as z:  # load each array once (NpzFile decompresses on every access)
        ids, labels, lens = z["ids"], z["labels"], z["lens"]
    out, start = [], 0
    for n in lens:
        out.append((ids[start:start + n], labels[start:start + n]))
        start += n
    return out


# ------------------------------------------------------------------------------------------
# batching
# ------------------------------------------------------------------------------------------


def ffd(lengths, max_len):
    """First-fit decreasing: list of bins (lists of sample indices)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    bins, free = [], []
    for i in order:
        n = lengths[i]
        for b, f in enumerate(free):
            if f >= n:
                bins[b].append(int(i))
                free[b] -= n
                break
        else:
            bins.append([int(i)])
            free.append(max_len - n)
    return bins


def next_fit_random(lengths, max_len, rng):
    """Random-order packing: samples in random order, a new row when the next one doesn't fit."""
    bins, cur, used = [], [], 0
    for i in rng.permutation(len(lengths)):
        n = lengths[i]
        if cur and used + n > max_len:
            bins.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += n
    if cur:
        bins.append(cur)
    return bins


def rows_from_bins(samples, bins):
    rows = []
    for b in bins:
        ids = np.concatenate([samples[i][0] for i in b]).astype(np.int32)
        lab = np.concatenate([samples[i][1] for i in b]).astype(np.int32)
        lens = np.array([len(samples[i][0]) for i in b], np.int32)
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
        rows.append({"input_ids": ids, "labels": lab, "position_ids": pos, "seq_lens": lens,
                     "source_index": np.array(b, np.int64)})
    return rows


def write_shards(rows, out_dir, max_len, strategy, rows_per_shard=256):
    """Write rows as a packprep output folder (the shard contract), with pyarrow directly."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    schema = pa.schema([(c, pa.list_(pa.int64() if c == "source_index" else pa.int32()))
                        for c in ("input_ids", "labels", "position_ids", "seq_lens", "source_index")])
    n_shards = max(1, math.ceil(len(rows) / rows_per_shard))
    for k in range(n_shards):
        part = rows[k * rows_per_shard:(k + 1) * rows_per_shard]
        table = pa.table({c: [r[c] for r in part] for c in schema.names}, schema=schema)
        pq.write_table(table, os.path.join(out_dir, "data", f"train-{k:05d}-of-{n_shards:05d}.parquet"))
    with open(os.path.join(out_dir, "packprep.json"), "w") as fh:
        json.dump({"config": {"max_len": max_len, "strategy": strategy}, "num_rows": len(rows)}, fh)


def padded_batches(pt, samples, batch_size, grouped, rng):
    order = rng.permutation(len(samples))
    if grouped:  # transformers' LengthGroupedSampler: megabatches of 50 * batch, sorted by length
        mega = 50 * batch_size
        order = np.concatenate([
            sorted(order[i:i + mega], key=lambda j: -len(samples[j][0]))
            for i in range(0, len(order), mega)
        ])
    batches = []
    for i in range(0, len(order), batch_size):
        rows = [{"input_ids": samples[j][0], "labels": samples[j][1]} for j in order[i:i + batch_size]]
        batches.append(pt.collate_padded(rows, pad_token_id=0, count=True))
    return batches


def packed_batches(pt, samples, bins, max_len, strategy, rng, tmp, rows_per_step=1):
    """Rows -> shards on disk -> PackedDataset -> collate_packed (rows_per_step rows a step)."""
    out_dir = os.path.join(tmp, strategy)
    if not os.path.exists(out_dir):
        write_shards(rows_from_bins(samples, bins), out_dir, max_len, strategy)
    ds = pt.PackedDataset(out_dir)
    assert len(ds) == len(bins)
    order = [int(i) for i in rng.permutation(len(ds))]
    return [pt.collate_packed([ds[i] for i in order[j:j + rows_per_step]], count=True)
            for j in range(0, len(order), rows_per_step)]


# ------------------------------------------------------------------------------------------
# model / training
# ------------------------------------------------------------------------------------------


def llama_1b_config(num_layers=16):
    from transformers import LlamaConfig

    return LlamaConfig(  # Llama-3.2-1B shape
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=num_layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, use_cache=False,
        bos_token_id=128000, eos_token_id=128001, attention_dropout=0.0,
    )


def build_model(attn, num_layers=16, seed=0):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(llama_1b_config(num_layers), dtype=torch.bfloat16,
                                                 attn_implementation=attn)
    model.config.use_cache = False
    return model


def set_attn(model, name):
    try:
        model.set_attn_implementation(name)
    except Exception:  # older/newer transformers: the layers read config._attn_implementation
        model.config._attn_implementation = name
    assert model.config._attn_implementation == name, model.config._attn_implementation


def to_device(batch):
    import torch

    return {k: (v.to(DEVICE, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def train_epoch(model, batches, lr=1e-5, warmup=3):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    model.train()

    def step(batch):
        n_sup = batch["num_supervised_tokens"]
        call = to_device({k: v for k, v in batch.items() if k != "num_supervised_tokens"})
        # per-token normalisation: summed CE / supervised tokens of the optimizer step
        loss = model(**call, num_items_in_batch=n_sup).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for b in batches[:warmup]:  # kernels, allocator, optimizer state; not timed
        step(b)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = []
    for b in batches:
        losses.append(step(b).detach())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30
    final_loss = float(torch.stack(losses[-10:]).float().mean())
    del opt
    torch.cuda.empty_cache()
    return dt, peak, final_loss


def batch_stats(batches):
    sup = sum(b["num_supervised_tokens"] for b in batches)
    if "attention_mask" in batches[0]:
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        slots = sum(b["input_ids"].numel() for b in batches)
    else:
        real = slots = sum(b["input_ids"].numel() for b in batches)
    return sup, real, slots


def run_benchmark(args, pt):
    import torch

    rng = np.random.default_rng(args.seed)
    shards = None
    if args.data == "lognormal":
        samples = lognormal_samples(args.n_samples, args.max_len, args.seed)
    elif args.data.startswith("shards:"):  # a real packprep output folder (packprep.pack)
        shards = pt.PackedDataset(args.data.split(":", 1)[1])
        rows = [shards[i] for i in range(len(shards))]
        samples = [(s["input_ids"], s["labels"]) for s in pt.unpack_rows(rows)]
        args.max_len = int(shards.max_len or args.max_len)
    else:
        samples = fixture_samples(args.data.split(":", 1)[1])
        if args.n_samples and args.n_samples < len(samples):
            keep = rng.choice(len(samples), args.n_samples, replace=False)
            samples = [samples[i] for i in sorted(keep)]
    lengths = [len(s[0]) for s in samples]
    print(f"data={args.data}: {len(samples)} samples, {sum(lengths)} tokens, mean {np.mean(lengths):.0f}, "
          f"median {np.median(lengths):.0f}, max {max(lengths)}", flush=True)
    varlen = pt.register_varlen_attention()
    modes = args.modes.split(",")
    if varlen is None:
        print("varlen_attn unavailable: skipping varlen modes")
        modes = [m for m in modes if "varlen" not in m]

    tmp = tempfile.mkdtemp(prefix="packprep_bench_")
    t0 = time.perf_counter()
    plan = {}
    pad_bs = args.pad_batch
    if pad_bs <= 0:
        pad_bs = 8 if torch.cuda.get_device_properties(0).total_memory > 120 * 2**30 else 4
    ffd_bins = ffd(lengths, args.max_len)
    for m in modes:
        base, _, k = m.partition("_x")  # packed_varlen_x2: two packed rows per step, one (1, 2*max_len) batch
        rows_per_step = int(k) if k else 1
        if rows_per_step > 1 and base not in ("packed_sdpa", "packed_varlen", "random_varlen"):
            raise SystemExit(f"unknown mode {m}")
        if m == "padding":
            plan[m] = ("sdpa", padded_batches(pt, samples, pad_bs, False, np.random.default_rng(args.seed)))
        elif m == "grouped":
            plan[m] = ("sdpa", padded_batches(pt, samples, pad_bs, True, np.random.default_rng(args.seed)))
        elif base in ("packed_sdpa", "packed_varlen") and shards is not None:  # the shards' own rows
            order = [int(i) for i in np.random.default_rng(args.seed).permutation(len(shards))]
            plan[m] = ("sdpa" if base == "packed_sdpa" else varlen,
                       [pt.collate_packed([shards[i] for i in order[j:j + rows_per_step]], count=True)
                        for j in range(0, len(order), rows_per_step)])
        elif base in ("packed_sdpa", "packed_varlen"):
            plan[m] = ("sdpa" if base == "packed_sdpa" else varlen,
                       packed_batches(pt, samples, ffd_bins, args.max_len, "ffd", np.random.default_rng(args.seed), tmp,
                                      rows_per_step))
        elif base == "random_varlen":
            bins = next_fit_random(lengths, args.max_len, np.random.default_rng(args.seed))
            plan[m] = (varlen, packed_batches(pt, samples, bins, args.max_len, "random", np.random.default_rng(args.seed),
                                              tmp, rows_per_step))
        else:
            raise SystemExit(f"unknown mode {m}")
    n_rows = len(shards) if shards is not None else len(ffd_bins)
    print(f"batches built in {time.perf_counter() - t0:.1f}s (padding batch {pad_bs}, "
          f"{'shard' if shards is not None else 'FFD'} rows {n_rows})", flush=True)

    model = build_model("sdpa", args.layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.3f}B params, bf16, {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    results = []
    for m in modes:
        attn, batches = plan[m]
        set_attn(model, attn)
        pt.check_isolation(model)  # raises if packed rows would leak across sequences
        sup, real, slots = batch_stats(batches)
        dt, peak, loss = train_epoch(model, batches)
        r = {"mode": m, "attn": attn, "steps": len(batches), "epoch_s": dt, "sup_tok": sup, "real_tok": real,
             "slots": slots, "sup_tok_s": sup / dt, "real_tok_s": real / dt, "peak_gib": peak,
             "fill": real / slots, "final_loss": loss}
        results.append(r)
        print(json.dumps(r), flush=True)
    base = next((r for r in results if r["mode"] == "padding"), results[0])
    grouped = next((r for r in results if r["mode"] == "grouped"), None)
    print()
    print(f"| mode | attention | optimizer steps | token fill | time/epoch (s) | supervised tok/s | real tok/s | "
          f"peak GiB | x padding (speed) | x grouped (speed) | peak / padding |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        xg = f"{r['sup_tok_s'] / grouped['sup_tok_s']:.2f}" if grouped else "-"
        print(f"| {r['mode']} | {r['attn']} | {r['steps']} | {r['fill']:.1%} | {r['epoch_s']:.1f} | "
              f"{r['sup_tok_s'] / 1e3:.1f}k | {r['real_tok_s'] / 1e3:.1f}k | {r['peak_gib']:.1f} | "
              f"{r['sup_tok_s'] / base['sup_tok_s']:.2f} | {xg} | {r['peak_gib'] / base['peak_gib']:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "pad_batch": pad_bs, "gpu": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "results": results}, fh, indent=1)


# ------------------------------------------------------------------------------------------
# bf16 exactness on the GPU
# ------------------------------------------------------------------------------------------


def run_exactness(args, pt):
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    print(f"exactness: {gpu}, torch {torch.__version__}, transformers {transformers.__version__}")
    varlen = pt.register_varlen_attention()
    print(f"register_varlen_attention() -> {varlen!r}")
    samples = lognormal_samples(64, args.max_len, args.seed + 1)
    bins = ffd([len(s[0]) for s in samples], args.max_len)
    bins = sorted(bins, key=len, reverse=True)[:3]  # the rows with the most sequences
    rows = rows_from_bins(samples, bins)
    model = build_model("sdpa", args.layers)
    model.eval()
    report = {}

    def logits_of(call):
        with torch.no_grad():
            return model(**to_device(call)).logits[0].float()

    def seq_loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits[:-1], labels[1:].to(DEVICE).long(), ignore_index=IGNORE,
                                                 reduction="sum")

    for attn in ["sdpa"] + ([varlen] if varlen else []):
        set_attn(model, attn)
        worst_logit, worst_loss, tot_p, tot_a, ref_scale = 0.0, 0.0, 0.0, 0.0, 0.0
        for row in rows:
            batch = pt.collate_packed([row], count=True)
            n_sup = batch.pop("num_supervised_tokens")
            labels = batch.pop("labels")[0]
            packed = logits_of(batch)
            cu = batch["cu_seq_lens_q"].tolist()
            for a, b in zip(cu[:-1], cu[1:]):
                one = pt.collate_packed([{"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]}], count=True)
                one.pop("num_supervised_tokens"); one.pop("labels")
                alone = logits_of(one)
                worst_logit = max(worst_logit, float((packed[a:b] - alone).abs().max()))
                ref_scale = max(ref_scale, float(alone.abs().max()))
                lp, la = seq_loss(packed[a:b], labels[a:b]), seq_loss(alone, labels[a:b])
                worst_loss = max(worst_loss, float((lp - la).abs() / max(1, int((labels[a + 1:b] != IGNORE).sum()))))
                tot_p += float(lp); tot_a += float(la)
        # the broken batch: all-ones attention mask next to packed position ids
        multi = next(r for r in rows if len(r["seq_lens"]) > 1)
        batch = pt.collate_packed([multi], count=True); batch.pop("num_supervised_tokens"); batch.pop("labels")
        cu = batch["cu_seq_lens_q"].tolist()
        if attn == "sdpa":
            broken = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]))
            broken_diff = float((logits_of(broken)[cu[1]:cu[2]] - logits_of(
                {"input_ids": batch["input_ids"][:, cu[1]:cu[2]], "use_cache": False})).abs().max())
        else:
            broken_diff = float("nan")
        rel_total = abs(tot_p - tot_a) / abs(tot_a)
        iso = pt.check_isolation(model)
        report[attn] = {"rows": len(rows), "max_abs_logit_diff": worst_logit, "max_abs_logit": ref_scale,
                        "max_per_token_seq_loss_diff": worst_loss, "summed_loss_rel_diff": rel_total,
                        "all_ones_mask_logit_diff": broken_diff, "check_isolation": iso["max_abs_diff"],
                        "check_isolation_tol": iso["tolerance"]}
        print(attn, json.dumps(report[attn]), flush=True)
    # use_cache=True (the transformers default) on the GPU with SDPA
    set_attn(model, "sdpa")
    model.config.use_cache = True
    try:
        pt.check_isolation(model)
        print("check_isolation with use_cache=True: NOT caught (unexpected)")
    except pt.PackingIsolationError as e:
        print(f"check_isolation with use_cache=True caught: {str(e)[:300]}")
    model.config.use_cache = False
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="lognormal",
                   help="lognormal | fixtures:PATH.npz | shards:DIR (a packprep output folder; packed modes use its rows)")
    p.add_argument("--n-samples", type=int, default=2000)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--pad-batch", type=int, default=0, help="padding batch size (0: 8 on >120 GiB GPUs, else 4)")
    p.add_argument("--modes", default="padding,grouped,packed_sdpa,packed_varlen")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results as JSON here")
    p.add_argument("--exactness", action="store_true", help="bf16 packed-vs-alone check instead of timing")
    p.add_argument("--dump-fixtures", metavar="NPZ", help="tokenize --fixtures-dir into NPZ and exit (CPU)")
    p.add_argument("--fixtures-dir", default=os.path.join(REPO, "..", "shared", "fixtures"))
    args = p.parse_args(argv)
    if args.dump_fixtures:
        dump_fixtures(args.fixtures_dir, args.dump_fixtures, args.max_len)
        return
    pt = load_packprep_torch()
    if args.exactness:
        run_exactness(args, pt)
    else:
        run_benchmark(args, pt)


if __name__ == "__main__":
    main()
