"""Packed rows of sequences with images: the row contract of docs/vision.md (layout ``packprep-vision``).

Sequences are packed by their total tokens (text and image) with packing.py's strategies, whole: a
sequence is never cut across rows, so an image never is. A sequence longer than ``max_len`` is cut
first (``fit``): before the first image it would cut, or refused. Each row holds the text columns as
the text path writes them (labels' first token of every sequence -100, positions restarting at 0),
the M-RoPE index of each sequence alone for Qwen2-VL-family processors, and its images in row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import Rejected
from ..layout import IGNORE_INDEX, VISION_LAYOUT
from ..packing import order_bins, pack_lengths
from .encode import VisionSequence
from .images import ImageFile
from .processor import ImageTokens, rope_index

LAYOUT = VISION_LAYOUT


@dataclass
class Sequence:
    """A packed sequence: its tokens and its images' references."""

    seq: VisionSequence
    source_index: int
    files: list[ImageFile]
    grids: list[tuple[int, ...]]


def fit(seq: VisionSequence, max_len: int, overlong: str) -> tuple[VisionSequence, bool]:
    """The sequence within ``max_len`` tokens, and whether it was cut: under ``truncate`` it ends
    before the first image that would not fit whole; else (or when nothing trained is left) Rejected."""
    if len(seq.input_ids) <= max_len:
        return seq, False
    if overlong != "truncate":
        raise Rejected(f"a sequence of {len(seq.input_ids)} tokens is longer than --max-len {max_len} and an image "
                       f"is never cut (--overlong {overlong}: pass --overlong truncate to keep what fits)",
                       "too_long")
    stop = max_len
    kept = []
    for start, count, number in seq.images:
        if start + count > stop:
            stop = min(stop, start)
            break
        kept.append((start, count, number))
    labels = seq.labels[:stop].copy()
    if not (labels[1:] != IGNORE_INDEX).any():
        raise Rejected(f"a sequence of {len(seq.input_ids)} tokens is longer than --max-len {max_len}, and cut "
                       "before the image that does not fit nothing trained is left", "too_long")
    return VisionSequence(seq.input_ids[:stop].copy(), labels, kept), True


def plan(lengths: np.ndarray, max_len: int, strategy: str, row_order: str, seed: int):
    """The ordered bins of whole sequences (``strategy``: one that never cuts, run.check_settings)."""
    return order_bins(pack_lengths(lengths, max_len, strategy, seed), row_order, seed)


def row(sequences: list[Sequence], tokens: ImageTokens, embed: bool) -> dict:
    """One row's columns (Python lists, as pyarrow takes them)."""
    ids, labels, positions, seq_lens, sources, images = [], [], [], [], [], []
    mrope = [[], [], []] if tokens.mrope else None
    offset = 0
    for number, item in enumerate(sequences):
        seq = item.seq
        n = len(seq.input_ids)
        ids.append(seq.input_ids)
        first = seq.labels.copy()
        first[0] = IGNORE_INDEX
        labels.append(first)
        positions.append(np.arange(n, dtype=np.int32))
        seq_lens.append(n)
        sources.append(item.source_index)
        if mrope is not None:
            index = rope_index(seq.input_ids, [item.grids[k] for _, _, k in seq.images], tokens.token_ids,
                               tokens.merge_size)
            for axis in range(3):
                mrope[axis].append(index[axis])
        for start, count, k in seq.images:
            image = item.files[k]
            images.append({"seq": number, "start": offset + start, "length": count, "source": image.source,
                           "sha256": image.sha256, "grid": list(item.grids[k]),
                           "data": image.data if embed else None})
        offset += n
    out = {"input_ids": np.concatenate(ids).tolist(), "labels": np.concatenate(labels).tolist(),
           "position_ids": np.concatenate(positions).tolist(), "seq_lens": seq_lens, "source_index": sources}
    if mrope is not None:
        out["mrope_position_ids"] = [np.concatenate(axis).tolist() for axis in mrope]
    out["images"] = images
    return out


def schema(mrope: bool):
    import pyarrow as pa

    image = pa.struct([("seq", pa.int32()), ("start", pa.int32()), ("length", pa.int32()), ("source", pa.string()),
                       ("sha256", pa.string()), ("grid", pa.list_(pa.int32())), ("data", pa.binary())])
    fields = [("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
              ("position_ids", pa.list_(pa.int32())), ("seq_lens", pa.list_(pa.int32())),
              ("source_index", pa.list_(pa.int64()))]
    if mrope:
        fields.append(("mrope_position_ids", pa.list_(pa.list_(pa.int32()))))
    fields.append(("images", pa.list_(image)))
    return pa.schema(fields)


def table(rows: list[dict], mrope: bool):
    import pyarrow as pa

    columns = schema(mrope).names
    return pa.Table.from_pydict({c: [r[c] for r in rows] for c in columns}, schema=schema(mrope))
