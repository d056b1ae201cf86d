"""GPU: an epoch on shared-prefix rows (compiled FlexAttention) against flat exact rows (varlen).

Two steps, because the device machine has no fixtures:

    python benchmarks/gpu_shared_prefix.py prepare --template qwen3 --medical 400 --agentic 60 --out data.npz  # CPU
    python benchmarks/gpu_shared_prefix.py run data.npz --max-len 8192 --json out.json                         # GPU

``prepare`` encodes the medical ShareGPT fixture file and the synthetic agent traces of
shared_prefix_tokens.py with ``--turn-context exact`` and stores each record's flat sequences.
``run``, for each set: packs the flat sequences (first-fit decreasing into ``--max-len`` rows) and
the records' prefix trees (the same way), then on one random-weight Llama-3.2-1B-shaped model in
bf16 (init 0.02, the same weights for both):

1. per-turn losses: the first ``--check`` records' rows of both forms, forward only; every turn's
   mean token loss from the tree against the flat rows' (bf16: relative differences of ~1e-2);
2. one epoch of training (forward, backward, AdamW step a row) on each form: seconds, tokens and
   tokens/s; the first step (compilation) timed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from packprep.prefix_tree import build_tree, locate  # noqa: E402

IGNORE = -100
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True, initializer_range=0.02,
             vocab_size=151936, max_position_embeddings=131072)
TINY = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # --tiny: a CPU smoke run of the script
DEVICE = "cuda"


def prepare(args) -> None:
    import tempfile
    from pathlib import Path

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from shared_prefix_tokens import MEDICAL, agentic, encoded_records  # noqa: E402

    from packprep.tokenization import ChatEncoder, load_tokenizer
    from tests.template_folders import build_folder

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        encoder = ChatEncoder(load_tokenizer(str(build_folder(args.template, Path(tmp) / "tok"))), turn_context="exact")
        medical = [json.loads(line) for line in MEDICAL.read_text(encoding="utf-8").splitlines() if line.strip()]
        for name, records in (("medical", medical[: args.medical]), ("agentic", agentic(args.agentic))):
            ids, trained, seq_lens, seqs_per_record = [], [], [], []
            for encoded in encoded_records(encoder, records):
                seqs_per_record.append(len(encoded.sequences))
                for i, labels in encoded.sequences:
                    ids.append(i)
                    trained.append(labels != IGNORE)
                    seq_lens.append(len(i))
            out[f"{name}_ids"] = np.concatenate(ids).astype(np.int32)
            out[f"{name}_trained"] = np.concatenate(trained).astype(np.uint8)
            out[f"{name}_seq_lens"] = np.array(seq_lens, np.int64)
            out[f"{name}_seqs"] = np.array(seqs_per_record, np.int64)
    np.savez_compressed(args.out, template=args.template, **out)


def records_of(data, name: str) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    ids, trained = data[f"{name}_ids"], data[f"{name}_trained"].astype(bool)
    starts = np.concatenate([[0], np.cumsum(data[f"{name}_seq_lens"])])
    sequences = [(ids[a:b], np.where(trained[a:b], ids[a:b], IGNORE).astype(np.int32))
                 for a, b in zip(starts[:-1], starts[1:])]
    firsts = np.concatenate([[0], np.cumsum(data[f"{name}_seqs"])])
    return [sequences[a:b] for a, b in zip(firsts[:-1], firsts[1:])]


def first_fit(lengths: list[int], max_len: int) -> list[list[int]]:
    """Items into rows of at most ``max_len`` tokens, first fit decreasing."""
    rows, room = [], []
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[item] <= free:
                rows[r].append(item)
                room[r] -= lengths[item]
                break
        else:
            rows.append([item])
            room.append(max_len - lengths[item])
    return rows


def flat_rows(records, max_len):
    seqs = [s for r in records for s in r]
    return [[seqs[i] for i in row] for row in first_fit([len(s[0]) for s in seqs], max_len)]


def tree_rows(trees, max_len):
    return [[trees[i] for i in row] for row in first_fit([len(t) for t in trees], max_len)]


def flat_batch(row):
    from packprep.training import collate_packed

    return collate_packed([{"input_ids": ids, "labels": labels, "seq_lens": [len(ids)]} for ids, labels in row])


def tree_batch(row, pad_to):
    from packprep.training import collate_tree

    return collate_tree([{"input_ids": t.input_ids, "labels": t.labels, "position_ids": t.position_ids,
                          "tree_descendants": t.descendants} for t in row], pad_to=pad_to)


def model_for(attn: str, state=None):
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE),
                                                              attn_implementation=attn, dtype=torch.bfloat16)
    if state is not None:
        model.load_state_dict(state)
    return model


def token_losses(model, batch):
    import torch

    batch = {k: v.to(DEVICE) if hasattr(v, "to") else v for k, v in batch.items()}
    labels = batch.pop("labels")[0]
    with torch.no_grad():
        logits = model(**batch).logits[0].float()
    losses = torch.nn.functional.cross_entropy(logits[:-1], labels[1:].clamp(min=0), reduction="none")
    return torch.cat([torch.zeros(1, device=losses.device), torch.where(labels[1:] != IGNORE, losses, 0.0)]).cpu().numpy()


def turn_losses(model_flat, model_tree, records, max_len, pad_to) -> dict:
    """Every turn's mean loss, tree against flat, on the rows of ``records``."""
    trees = [build_tree(r) for r in records]
    diffs, turns = [], 0
    for group in first_fit([len(t) for t in trees], max_len):
        tree = token_losses(model_tree, tree_batch([trees[i] for i in group], pad_to))
        offset = 0
        for i in group:
            for ids, labels in records[i]:
                flat = token_losses(model_flat, flat_batch([(ids, labels)]))
                at = locate(trees[i], ids) + offset
                trained = np.flatnonzero(labels[1:] != IGNORE) + 1
                for turn in np.split(trained, np.flatnonzero(np.diff(trained) > 1) + 1):
                    if len(turn):
                        a, b = flat[turn].mean(), tree[at[turn]].mean()
                        diffs.append(abs(a - b) / abs(a))
                        turns += 1
            offset += len(trees[i])
    if not diffs:
        return {"turns": 0}
    return {"turns": turns, "max_relative": float(np.max(diffs)), "median_relative": float(np.median(diffs))}


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def epoch(model, batches) -> dict:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
    model.train()
    times, tokens = [], 0
    for batch, real in batches:
        batch = {k: v.to(DEVICE, non_blocking=True) if hasattr(v, "to") else v for k, v in batch.items()}
        sync()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        tokens += real
    return {"rows": len(times), "tokens": tokens, "first_step_s": round(times[0], 2),
            "seconds": round(sum(times), 2), "seconds_after_first": round(sum(times[1:]), 2),
            "tokens_per_s": round(tokens / sum(times), 1)}


def run(args) -> None:
    import torch
    import transformers

    from packprep.training import register_tree_attention, register_varlen_attention

    global DEVICE
    if args.tiny:
        DEVICE = "cpu"
        SHAPE.update(TINY)
    data = np.load(args.data)
    varlen, tree_attn = register_varlen_attention() or "sdpa", register_tree_attention()
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
               "transformers": transformers.__version__, "template": str(data["template"]), "max_len": args.max_len,
               "model": "Llama-3.2-1B-shaped, vocab 151936, random init 0.02, bf16, AdamW lr 1e-5",
               "flat_attention": varlen, "tree_attention": tree_attn + " (compiled flex_attention)", "sets": {}}
    base = model_for("sdpa").state_dict()
    for name in args.sets:
        records = [r for r in records_of(data, name) if max(len(i) for i, _ in r) <= args.max_len][: args.limit]
        trees = [build_tree(r) for r in records]
        keep = [n for n, t in enumerate(trees) if len(t) <= args.max_len]
        records, trees = [records[n] for n in keep], [trees[n] for n in keep]
        flat, tree = flat_rows(records, args.max_len), tree_rows(trees, args.max_len)
        out = results["sets"][name] = {
            "template": str(data[f"{name}_template"]) if f"{name}_template" in data else str(data["template"]),
            "records": len(records), "flat_tokens": sum(len(i) for r in records for i, _ in r),
            "tree_tokens": sum(len(t) for t in trees), "rendered_tokens": sum(len(r[-1][0]) for r in records),
            "flat_rows": len(flat), "tree_rows": len(tree)}
        model_flat, model_tree = model_for(varlen, base), model_for(tree_attn, base)
        model_flat.eval(), model_tree.eval()
        out["losses"] = turn_losses(model_flat, model_tree, records[: args.check], args.max_len, args.pad_to)
        del model_flat, model_tree
        print(name, json.dumps(out), flush=True)
        for form, rows in (("tree", [(tree_batch(r, args.pad_to), sum(len(t) for t in r)) for r in tree]),
                           ("flat", [(flat_batch(r), sum(len(i) for i, _ in r)) for r in flat])):
            model = model_for(tree_attn if form == "tree" else varlen, base)
            out[form] = epoch(model, rows)
            del model
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            print(name, form, json.dumps(out[form]), flush=True)
        out["speedup"] = round(out["flat"]["seconds"] / out["tree"]["seconds"], 2)
        out["speedup_after_first"] = round(out["flat"]["seconds_after_first"] / out["tree"]["seconds_after_first"], 2)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=1)
    print(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--template", default="qwen3")
    p.add_argument("--medical", type=int, default=400)
    p.add_argument("--agentic", type=int, default=60)
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("data")
    r.add_argument("--max-len", type=int, default=8192)
    r.add_argument("--pad-to", type=int, default=8192, help="tree rows padded to a multiple of this (one compile)")
    r.add_argument("--check", type=int, default=16, help="records whose per-turn losses are compared")
    r.add_argument("--sets", nargs="+", default=["medical", "agentic"])
    r.add_argument("--json")
    r.add_argument("--limit", type=int, help="at most this many records a set")
    r.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script")
    args = parser.parse_args()
    prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    main()
