"""``check_vision_pipeline``: packed rows with images, through the user's collator (or Trainer) and model,
against every sequence run alone the way the model runs one conversation at inference.

The reference for a sequence is the model's own path, not packprep's: its tokens, its images' pixels, and
only what the model derives itself (M-RoPE: the rope index from ``mm_token_type_ids`` and the grid; Gemma 3:
the image-block mask from ``token_type_ids``), no position ids and no mask. So a stored rope index that does
not restart per sequence, a mask that lets sequences (or images) see each other, or pixels out of row order
all show as a logit difference.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..layout import IGNORE_INDEX
from .collate import _as_np, _row_seq_lens
from .parity import PackingIsolationError, logits_of, model_dtype, tolerance
from .vision import VisionCollator, _field

_HEAD = "packed sequences with images are NOT isolated in this pipeline: "


def read_vision_rows(data: str | os.PathLike, limit: int = 64, split: str = "train") -> list[dict]:
    """The first ``limit`` stored rows of a packprep output folder (or shard), every column as stored."""
    import pyarrow.parquet as pq

    from ..layout import shard_files

    rows: list[dict] = []
    for path in shard_files(data, split):
        rows.extend(pq.read_table(path).slice(0, limit - len(rows)).to_pylist())
        if len(rows) >= limit:
            break
    return rows


def split_sequences(row: Mapping[str, Any]) -> list[dict]:
    """The row's sequences, each as a row of one sequence: its tokens, labels and images (starts rebased)."""
    seq_lens = _row_seq_lens(row)
    ids, labels = _as_np(row["input_ids"]), _as_np(row["labels"])
    images = list(row.get("images") or ())
    out, at = [], 0
    for j, n in enumerate(seq_lens.tolist()):
        mine = [dict(image if isinstance(image, Mapping) else vars(image)) for image in images
                if at <= int(_field(image, "start")) < at + n]
        for image in mine:
            image["start"] = int(image["start"]) - at
            image["seq"] = 0
        out.append({"input_ids": ids[at : at + n], "labels": labels[at : at + n], "seq_lens": [n], "images": mine})
        at += n
    return out


def _alone_inputs(collator: VisionCollator, model, seq: dict, device) -> dict:
    """One sequence as the model takes it at inference: tokens, its images' pixels, and what the model
    derives its positions and masks from; nothing packprep computed."""
    ids = torch.as_tensor(seq["input_ids"], dtype=torch.long, device=device)[None]
    inputs = {"input_ids": ids, "use_cache": False}
    inputs.update(collator.image_inputs(seq))
    types = (ids == collator.image_token_id).long()
    if collator.token_type_ids:
        inputs["token_type_ids"] = types
    elif "image_grid_thw" in inputs:
        inputs["mm_token_type_ids"] = types.int()
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None  # a previous call's cached deltas are not this sequence's
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def check_vision_pipeline(pipeline, model=None, data=None, *, collator: VisionCollator | None = None,
                          atol: float | None = None, rows: int = 1) -> dict:
    """Run ``rows`` packed rows of ``data`` (a packprep output folder, or a list of stored rows; default: a
    trainer's ``train_dataset``) through ``pipeline`` (a collate function, or a Trainer: its column removal,
    collator and device move, as ``train()`` feeds the model) and ``model``; every packed
    sequence's logits must equal the sequence run alone (see the module docstring), within ``atol`` (1e-3 in
    float32, else bf16 rounding). ``collator``: the ``VisionCollator`` whose image processor makes the
    reference's pixels (default: the pipeline itself, or the trainer's ``data_collator``). Raises
    :class:`PackingIsolationError` naming what differs; returns the largest difference and the losses."""
    trainer = pipeline if hasattr(pipeline, "data_collator") and hasattr(pipeline, "model") else None
    model = model if model is not None else getattr(trainer, "model", None)
    if model is None or (data is None and trainer is None):
        raise TypeError("check_vision_pipeline needs the model and data= (an output folder or stored rows)")
    collate = trainer.data_collator if trainer is not None else pipeline
    collator = collator or (collate if isinstance(collate, VisionCollator) else None)
    if collator is None:
        raise TypeError("check_vision_pipeline needs collator=: the VisionCollator that makes the reference pixels")
    if data is None:  # the trainer's own rows, as loaded
        data = [trainer.train_dataset[i] for i in range(min(64, len(trainer.train_dataset)))]
    stored = read_vision_rows(data) if isinstance(data, (str, os.PathLike)) else list(data)
    picked = sorted(range(len(stored)), key=lambda i: -len(_row_seq_lens(stored[i])))[:rows]
    if trainer is not None:  # its column removal, its collator, its device move: what train() feeds
        examples = trainer._remove_unused_columns(trainer.train_dataset.select(picked), "check_vision_pipeline")
        batch = trainer._prepare_inputs(collate(list(examples)))
    else:
        batch = _to(collate([stored[i] for i in picked]), next(model.parameters()).device)
    seqs = [seq for i in picked for seq in split_sequences(stored[i])]
    return _compare(collator, model, batch, seqs, atol)


def _compare(collator, model, batch, seqs, atol) -> dict:
    device = next(model.parameters()).device
    ids = np.concatenate([s["input_ids"] for s in seqs])
    got = batch["input_ids"][0].cpu().numpy()
    if not np.array_equal(got, ids):
        raise PackingIsolationError(_HEAD + "the batch's input_ids are not the rows' tokens in order")
    forward = {k: v for k, v in batch.items() if k not in ("labels", "num_supervised_tokens")}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = logits_of(model(**forward))
            alone = [logits_of(model(**_alone_inputs(collator, model, s, device))) for s in seqs]
    finally:
        if was_training:
            model.train()
    spans = np.cumsum([0] + [len(s["input_ids"]) for s in seqs])
    diffs = [float((packed[a:b] - one).abs().max()) for a, b, one in zip(spans[:-1], spans[1:], alone)]
    tol = tolerance(model_dtype(model), max(float(one.abs().max()) for one in alone), atol)
    if max(diffs) > tol:
        worst = int(np.argmax(diffs))
        raise PackingIsolationError(
            _HEAD + f"logits of packed sequence {worst} (of {len(seqs)}) differ from it run alone by {max(diffs):.3g} "
            f"(tolerance {tol:.3g}). " + _cause(batch, seqs))
    labels = batch["labels"][0].cpu().numpy()
    if (labels[spans[1:-1]] != IGNORE_INDEX).any():
        raise PackingIsolationError(_HEAD + "labels: the first token of a packed sequence has a label, so the "
                                    "previous sequence's last token is trained to predict it")

    def loss(logits, a, b):
        return float(torch.nn.functional.cross_entropy(
            logits[:-1], torch.as_tensor(labels[a + 1 : b], device=logits.device), ignore_index=IGNORE_INDEX,
            reduction="sum"))

    return {"max_abs_diff": max(diffs), "tolerance": tol, "sequences": len(seqs), "tokens": len(ids),
            "images": sum(len(s["images"]) for s in seqs),
            "loss_packed": sum(loss(packed[a:b], a, b) for a, b in zip(spans[:-1], spans[1:])),
            "loss_alone": sum(loss(one, a, b) for a, b, one in zip(spans[:-1], spans[1:], alone))}


def _cause(batch: Mapping[str, Any], seqs: Sequence[dict]) -> str:
    """The likeliest cause, from what the batch carries."""
    positions = batch.get("position_ids")
    starts = np.cumsum([0] + [len(s["input_ids"]) for s in seqs[:-1]])
    mask = batch.get("attention_mask")
    if mask is not None and not isinstance(mask, Mapping):
        return ("A 2-D attention_mask came with the batch: transformers then skips its packed-sequence detection. "
                "Use packprep.training.VisionCollator, which emits none (or per-sequence masks).")
    if positions is None:
        return "No position_ids reached the model: it numbers the whole row as one sequence."
    text = positions[0, 0] if positions.dim() == 3 else positions[0]
    restarts = np.flatnonzero(text.cpu().numpy() == 0)
    if not np.array_equal(restarts, starts):
        return (f"The text position_ids restart at {restarts.tolist()}, but the sequences start at {starts.tolist()}.")
    if positions.dim() == 3 and positions.shape[0] == 3:
        return ("M-RoPE position_ids of shape (3, B, T) carry no text row: transformers cannot see the sequence "
                "boundaries. Pass (4, B, T) with the text positions first (VisionCollator does).")
    if "token_type_ids" in batch and not isinstance(mask, Mapping):
        return ("token_type_ids without per-sequence masks: transformers' packed path reads the sliding layers' "
                "image blocks at in-sequence positions. Give VisionCollator the model (model=...).")
    return ("The rope index, image order or attention differs from each sequence alone: were mrope_position_ids "
            "computed per sequence, and are the images in row order?")
