"""Packed rows with images vs padded batches, one GPU: a ~2B Qwen2.5-VL shape in bf16, random init 0.02.

The same conversations (text around 0-3 images each, image token counts from Qwen's own resize rule:
``smart_resize`` of random sizes, 14-pixel patches merged 2x2) train one epoch in three ways, each from the
same initial weights with AdamW:

- ``padded``: batches of ``--batch`` conversations in data order, right-padded, attention mask (SDPA);
- ``grouped``: the same, conversations sorted by length into batches (``group_by_length``), batches shuffled;
- ``packed``: first-fit-decreasing rows of ``--max-len`` tokens collated by ``packprep.training.VisionCollator``
  ((4, 1, T) positions, no mask), attention ``varlen_attn`` when torch has it (``register_varlen_attention``),
  else flash-attention-2 when installed, else transformers' SDPA packed path (a block-diagonal mask).

Pixels are random, made on the GPU from each image's seed, so every mode feeds the same pixels for the same
image (decoding is not what is timed). Reported: supervised tokens/s (labels that count in the loss), time,
peak memory, the token-weighted mean loss of the epoch, and before training the logits of one packed row
against its conversations run alone (the model's own rope index, no positions given).

    python3 benchmarks/gpu_vision.py --out results.json            # the GPU run (about 4 minutes)
    python3 benchmarks/gpu_vision.py --shape tiny --sequences 24    # the same code on CPU, tiny shape
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

from packprep.training.attention import register_varlen_attention  # noqa: E402
from packprep.training.vision import VisionCollator  # noqa: E402

IMAGE, START, END, PATCH = 151655, 151652, 151653, 14 * 14 * 3 * 2


def qwen_config(shape: str):
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as configuration

    if shape == "2b":  # Qwen2-VL-2B's text shape, Qwen2.5-VL's vision tower
        text = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=1536)
    else:
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[1])
    head = text["hidden_size"] // text["num_attention_heads"] // 2
    section = [head - 2 * (3 * head // 8), 3 * head // 8, 3 * head // 8]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": section}
    return configuration.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                         vision_start_token_id=START, vision_end_token_id=END, initializer_range=0.02)


def conversations(n: int, seed: int, max_seq: int, max_pixels: int) -> list[dict]:
    """``n`` conversations: prompt text, 0-3 images, answer text; lengths drawn lognormal, cut to ``max_seq``."""
    try:  # the torchvision backend's module, or the PIL one where torchvision is missing
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rng = np.random.default_rng(seed)
    out, image_id = [], 0
    while len(out) < n:
        ids, images = [], []
        for _ in range(int(rng.choice(4, p=[0.2, 0.5, 0.2, 0.1]))):
            ids += rng.integers(0, 150000, int(rng.integers(4, 40))).tolist()
            h, w = smart_resize(int(rng.integers(160, 1400)), int(rng.integers(160, 1400)), factor=28,
                                min_pixels=56 * 56, max_pixels=max_pixels)
            grid = [1, h // 14, w // 14]
            images.append({"start": len(ids) + 1, "length": grid[1] * grid[2] // 4, "grid": grid, "id": image_id})
            ids += [START] + [IMAGE] * (grid[1] * grid[2] // 4) + [END]
            image_id += 1
        ids += rng.integers(0, 150000, int(min(3000, rng.lognormal(5.0, 1.0)) + 8)).tolist()
        prompt = len(ids)
        ids += rng.integers(0, 150000, int(min(3000, rng.lognormal(5.5, 0.9)) + 4)).tolist()
        if len(ids) <= max_seq:
            out.append({"input_ids": np.array(ids), "labels": np.array([-100] * prompt + ids[prompt:]),
                        "images": images})
    return out


def add_rope_index(model, seqs: list[dict]) -> None:
    """Each conversation's own M-RoPE index (3, n), as the model computes it for the conversation alone."""
    for seq in seqs:
        ids = torch.as_tensor(seq["input_ids"])[None]
        if not seq["images"]:
            seq["mrope"] = np.tile(np.arange(ids.shape[1]), (3, 1))
            continue
        grids = torch.tensor([image["grid"] for image in seq["images"]])
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=grids)
        seq["mrope"] = pos[:, 0].numpy()


def ffd(lengths, max_len: int) -> list[list[int]]:
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, free in enumerate(room) if free >= lengths[i]), None)
        if k is None:
            bins.append([]), room.append(max_len)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= lengths[i]
    return bins


class _GridsOnly(VisionCollator):
    """The collator with each image's processor output reduced to its grid: pixels are made on the GPU."""

    def _images(self, row, ids, r):
        return [{"image_grid_thw": torch.tensor([image["grid"]])} for image in row["images"]]


def packed_batches(seqs, max_len: int) -> list[dict]:
    collator = _GridsOnly(None, image_token_id=IMAGE, token_type_ids=False)
    batches = []
    for members in ffd([len(s["input_ids"]) for s in seqs], max_len):
        at, images = 0, []
        for i in members:
            images += [dict(image, start=image["start"] + at) for image in seqs[i]["images"]]
            at += len(seqs[i]["input_ids"])
        row = {"input_ids": np.concatenate([seqs[i]["input_ids"] for i in members]),
               "labels": np.concatenate([seqs[i]["labels"] for i in members]),
               "seq_lens": [len(seqs[i]["input_ids"]) for i in members], "images": images,
               "mrope_position_ids": np.concatenate([seqs[i]["mrope"] for i in members], axis=1)}
        batch = collator([row])
        batch["image_ids"] = [image["id"] for image in images]
        batches.append(batch)
    return batches


def padded_batch(seqs) -> dict:
    longest = max(len(s["input_ids"]) for s in seqs)
    ids = torch.zeros((len(seqs), longest), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    positions = torch.zeros((3, len(seqs), longest), dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s["input_ids"])
        ids[b, :n], labels[b, :n], mask[b, :n] = torch.as_tensor(s["input_ids"]), torch.as_tensor(s["labels"]), 1
        labels[b, 0] = -100
        positions[:, b, :n] = torch.as_tensor(s["mrope"])
    images = [image for s in seqs for image in s["images"]]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions,
             "use_cache": False, "image_ids": [image["id"] for image in images]}
    if images:
        batch["image_grid_thw"] = torch.tensor([image["grid"] for image in images])
    return batch


def padded_batches(seqs, size: int, grouped: bool, seed: int) -> list[dict]:
    order = list(range(len(seqs)))
    if grouped:
        order.sort(key=lambda i: len(seqs[i]["input_ids"]))
    chunks = [order[k : k + size] for k in range(0, len(order), size)]
    if grouped:
        np.random.default_rng(seed).shuffle(chunks)
    return [padded_batch([seqs[i] for i in chunk]) for chunk in chunks]


def on_device(batch: dict, device, dtype) -> dict:
    """The batch on the GPU, with each image's pixels made from its seed (same pixels in every mode)."""
    out = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "image_ids"}
    if batch["image_ids"]:
        grids = batch["image_grid_thw"].tolist()
        gen = torch.Generator(device=device)
        out["pixel_values"] = torch.cat([
            torch.randn((int(np.prod(g)), PATCH), generator=gen.manual_seed(i), device=device, dtype=dtype)
            for i, g in zip(batch["image_ids"], grids)])
    return out


def build_model(config, attn: str, device, dtype, seed: int = 0):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    torch.manual_seed(seed)
    with torch.device(device):
        model = modeling.Qwen2_5_VLForConditionalGeneration._from_config(
            config, attn_implementation={"text_config": attn, "vision_config": "sdpa", "": "sdpa"}, dtype=dtype)
    model.config.use_cache = False
    return model


def supervised(batch) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def train(model, batches, device, dtype, lr: float, warmup: int, checkpointing: bool) -> dict:
    """One epoch; the first ``warmup`` steps untimed. Loss weighted by supervised tokens over all steps."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(warmup, len(batches) - 1)
    loss_sum, tokens, timed_tokens, start = 0.0, 0, 0, None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step, batch in enumerate(batches):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        inputs = on_device(batch, device, dtype)
        out = model(**inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = supervised(batch)
        loss_sum += float(out.loss.detach()) * n
        tokens += n
        timed_tokens += n if step >= warmup else 0
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"steps": len(batches), "seconds": seconds, "tokens_per_s": timed_tokens / seconds,
            "mean_loss": loss_sum / tokens, "supervised_tokens": tokens, "peak_gib": peak}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def exactness(model, seqs, batch, device, dtype) -> dict:
    """One packed row's logits against each conversation alone (the model's own rope index: no positions given),
    and against the same row given (3, 1, T) positions, which hide the sequence boundaries."""
    model.eval()
    spans = np.cumsum([0] + [len(s["input_ids"]) for s in seqs])
    with torch.no_grad():
        inputs = on_device(batch, device, dtype)
        packed = model(**inputs).logits[0].float()
        hidden = model(**{**inputs, "position_ids": inputs["position_ids"][1:]}).logits[0].float()
        diffs, leak, scale = [], [], 0.0
        for k, s in enumerate(seqs):
            one = {"input_ids": torch.as_tensor(s["input_ids"], device=device)[None], "use_cache": False,
                   "image_ids": [image["id"] for image in s["images"]]}
            if s["images"]:
                one["image_grid_thw"] = torch.tensor([image["grid"] for image in s["images"]])
                one["mm_token_type_ids"] = (one["input_ids"] == IMAGE).int()
            model.model.rope_deltas = None
            alone = model(**on_device(one, device, dtype)).logits[0].float()
            diffs.append(float((packed[spans[k] : spans[k + 1]] - alone).abs().max()))
            leak.append(float((hidden[spans[k] : spans[k + 1]] - alone).abs().max()))
            scale = max(scale, float(alone.abs().max()))
    model.train()
    return {"sequences": len(seqs), "max_abs_diff": max(diffs), "max_abs_logit": scale,
            "max_abs_diff_without_text_row": max(leak)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["2b", "tiny"], default="2b")
    parser.add_argument("--sequences", type=int, default=320)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--max-seq", type=int, default=3072)
    parser.add_argument("--max-pixels", type=int, default=1024 * 28 * 28)
    parser.add_argument("--batch", type=int, default=4, help="conversations per padded batch")
    parser.add_argument("--modes", default="packed,grouped,padded")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import importlib.util

    import transformers

    packed_attn = register_varlen_attention() or (
        "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa")
    config = qwen_config(args.shape)
    seqs = conversations(args.sequences, 0, args.max_seq, args.max_pixels)
    model = build_model(config, packed_attn, device, dtype)
    add_rope_index(model, seqs)
    params = sum(p.numel() for p in model.parameters())
    batches = {"packed": packed_batches(seqs, args.max_len),
               "grouped": padded_batches(seqs, args.batch, True, 0),
               "padded": padded_batches(seqs, args.batch, False, 0)}
    first = max(range(len(batches["packed"])), key=lambda b: len(batches["packed"][b]["image_ids"]))
    members = ffd([len(s["input_ids"]) for s in seqs], args.max_len)[first]
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "dtype": str(dtype),
              "parameters": params, "packed_attention": packed_attn, "padded_attention": "sdpa",
              "sequences": len(seqs), "images": sum(len(s["images"]) for s in seqs),
              "tokens": int(sum(len(s["input_ids"]) for s in seqs)),
              "image_tokens": int(sum(i["length"] for s in seqs for i in s["images"])), "args": vars(args),
              "exactness": exactness(model, [seqs[i] for i in members], batches["packed"][first], device, dtype)}
    print(json.dumps(report), flush=True)
    for mode in args.modes.split(","):
        if mode != "packed" or model is None:
            del model
            model = build_model(config, packed_attn if mode == "packed" else "sdpa", device, dtype)
        model.config.use_cache = False
        try:
            report[mode] = train(model, batches[mode], device, dtype, args.lr, args.warmup, not args.no_checkpointing)
        except torch.cuda.OutOfMemoryError as exc:
            report[mode] = {"error": f"out of memory: {exc}"[:300]}
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(mode, json.dumps(report[mode]), flush=True)
    for mode in ("packed", "grouped"):
        if "tokens_per_s" in report.get(mode, {}) and "tokens_per_s" in report.get("padded", {}):
            report[mode]["vs_padded"] = report[mode]["tokens_per_s"] / report["padded"]["tokens_per_s"]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0 if all(math.isfinite(report[m].get("mean_loss", float("nan"))) for m in args.modes.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
