#!/usr/bin/env python3
"""Minimal training loop over packprep shards with a Hugging Face causal LM.

    pip install -e ".[torch]"
    packprep pack examples/chats.jsonl -t examples/tokenizer --max-len 1024 -o out/example
    python examples/train.py --data out/example --model-config tiny --steps 1        # a CPU is enough
    python examples/train.py --data out/ --model path/to/model --mode packed --attn varlen --steps 100

Modes:
  packed   packed rows through packprep.training.collate_packed: one (1, T) batch of --rows-per-batch
           rows, position_ids restarting at each sequence, cu_seq_lens/max_length for varlen
           kernels, use_cache=False, never an attention mask.
  padded   the rows' sequences one per batch row, padded to the longest, with an attention mask.
  grouped  like padded, but batches of similar lengths (transformers' group_by_length).

Attention (--attn): sdpa (transformers' packed-sequence path through position_ids), varlen
(torch.nn.attention.varlen.varlen_attn registered by packprep.training.register_varlen_attention;
CUDA only) or flash_attention_2 (needs the flash-attn package).

The loss is normalised per supervised token over each optimizer step: with --grad-accum K,
every micro-batch's summed token loss is divided by the number of supervised tokens of all K
micro-batches (num_supervised_tokens from the collator), so short and long micro-batches weigh
what their tokens weigh.  packprep.training.check_isolation and check_pipeline run before training
and stop the run if packed sequences would see each other.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from packprep.training import (  # noqa: E402
    PackedDataset,
    check_isolation,
    check_pipeline,
    collate_packed,
    collate_padded,
    register_varlen_attention,
    unpack_rows,
)

PRESETS = {
    # tiny random model: runs on a CPU in seconds
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    # Llama-3.2-1B shape (random weights)
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True, max_position_embeddings=131072),
}


def build_model(args, vocab_needed: int, attn: str, dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attn).to(device)
    spec = args.model_config
    if spec in PRESETS:
        kw = dict(PRESETS[spec])
    elif os.path.exists(spec):
        with open(spec, encoding="utf-8") as fh:
            kw = json.load(fh)
    else:
        kw = json.loads(spec)
    kw.setdefault("max_position_embeddings", 8192)
    kw["vocab_size"] = max(int(kw.get("vocab_size", 0)), vocab_needed)
    torch.manual_seed(args.seed)
    config = LlamaConfig(**kw)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


def micro_batches(ds: PackedDataset, args, rng):
    """Endless iterator of micro-batches (epochs reshuffled)."""
    if args.mode == "packed":
        while True:
            order = rng.permutation(len(ds))
            for i in range(0, len(order) - args.rows_per_batch + 1, args.rows_per_batch):
                yield collate_packed([ds[int(j)] for j in order[i:i + args.rows_per_batch]], count=True)
    samples = unpack_rows(ds[i] for i in range(len(ds)))
    bs = args.batch_size
    while True:
        order = rng.permutation(len(samples))
        if args.mode == "grouped":  # megabatches of 50 batches sorted by length, as group_by_length
            order = np.concatenate([sorted(order[i:i + 50 * bs], key=lambda j: -len(samples[j]["input_ids"]))
                                    for i in range(0, len(order), 50 * bs)])
            batches = [order[i:i + bs] for i in range(0, len(order), bs)]
            rng.shuffle(batches)
        else:
            batches = [order[i:i + bs] for i in range(0, len(order), bs)]
        for b in batches:
            yield collate_padded([samples[j] for j in b], pad_token_id=args.pad_token_id, count=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="packprep output folder (or shard file)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="pretrained model path or hub id (from_pretrained)")
    src.add_argument("--model-config", help="random init: 'tiny', 'llama-3.2-1b', a config JSON file or JSON text")
    p.add_argument("--mode", choices=["packed", "padded", "grouped"], default="packed")
    p.add_argument("--attn", choices=["sdpa", "varlen", "flash_attention_2", "eager"], default="sdpa")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--rows-per-batch", type=int, default=1, help="packed rows per micro-batch (packed mode)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (padded/grouped)")
    p.add_argument("--pad-token-id", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    ds = PackedDataset(args.data)
    print(f"{len(ds)} packed rows from {len(ds.files)} shard(s), max_len={ds.max_len}")

    attn = args.attn
    if attn == "varlen":
        attn = register_varlen_attention()
        if attn is None:
            raise SystemExit("--attn varlen needs torch.nn.attention.varlen.varlen_attn and a CUDA device")
    if args.mode != "packed" and attn not in ("sdpa", "eager", "flash_attention_2"):
        raise SystemExit("padded/grouped modes need --attn sdpa, eager or flash_attention_2")
    vocab_needed = max(int(ds[i]["input_ids"].max()) for i in range(min(len(ds), 1000))) + 1
    model = build_model(args, vocab_needed, attn, dtype, device)
    model.config.use_cache = False  # a KV cache disables transformers' packed-sequence detection
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.use_cache = False

    # Refuse to train if packed sequences can see each other, both with the model as configured
    # and with the exact batches the collator builds.
    check_isolation(model)
    if args.mode == "packed" and os.path.isdir(args.data):
        check_pipeline(collate_packed, model, args.data)  # a real packed row through this loop's collator
    print(f"check_isolation: packed sequences are isolated ({model.config._attn_implementation})")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    batches = micro_batches(ds, args, np.random.default_rng(args.seed))
    tokens_done, t0 = 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        micro = [next(batches) for _ in range(args.grad_accum)]
        total = sum(b["num_supervised_tokens"] for b in micro)  # supervised tokens of this optimizer step
        step_loss = 0.0
        for batch in micro:
            call = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
                    for k, v in batch.items() if k != "num_supervised_tokens"}
            # transformers' causal-LM loss: sum of token losses / num_items_in_batch
            loss = model(**call, num_items_in_batch=max(total, 1)).loss
            loss.backward()
            step_loss += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_done += total
        if step % args.log_every == 0 or step == args.steps:
            dt = time.perf_counter() - t0
            print(f"step {step}/{args.steps}  loss/token {step_loss:.4f}  supervised tokens {total}  "
                  f"{tokens_done / dt:,.0f} supervised tok/s", flush=True)
    if not math.isfinite(step_loss):
        raise SystemExit("loss is not finite")


if __name__ == "__main__":
    main()
