"""Packed rows with images (layout ``packprep-vision``) to one ``(1, T)`` batch the model's forward takes.

Rows carry references to their images, not pixels: the collator loads each image (its embedded ``data``
bytes, else its ``source`` path), checks its sha256, runs the processor's image part once per image, and
puts ``pixel_values`` (and ``image_grid_thw`` / ``pixel_attention_mask``) beside the tokens, in row order,
which is the order the model scatters image features into the image tokens. Positions are the model's
packed form: for M-RoPE models ``(4, 1, T)``, row 0 the text positions restarting at every sequence
(transformers reads sequence boundaries from it), rows 1-3 the stored per-sequence rope index; else
``(1, T)``. No ``attention_mask`` is emitted: transformers then builds the packed block mask itself
(SDPA/eager) or runs flash-attention varlen from the positions. Models whose image tokens attend both
ways (Gemma 3) also get ``token_type_ids`` and, as an ``attention_mask`` dict, masks built per sequence
alone and laid block-diagonally (``vision_masks``): transformers' own packed path indexes the image
blocks of sliding layers by in-sequence position and so is not each sequence alone.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..layout import IGNORE_INDEX
from .collate import _as_np, _restarted_positions, _row_seq_lens, num_supervised_tokens

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask")


class VisionRowError(ValueError):
    """A packed row's image cannot be used as stored: missing, changed since packing, or a token count
    the processor no longer gives."""


def _field(image, name):
    return image.get(name) if isinstance(image, Mapping) else getattr(image, name, None)


def load_image_bytes(image: Mapping[str, Any], image_root: str | os.PathLike | None, where: str) -> bytes:
    """The image's bytes (embedded ``data``, else ``source`` resolved against ``image_root``), sha256-checked."""
    data, source = _field(image, "data"), _field(image, "source")
    if data is None:
        if source and source.startswith("bytes:"):
            raise VisionRowError(f"{where}: the input held this image as bytes and the row does not embed them: "
                                 "pack with --embed-images")
        if not source:
            raise VisionRowError(f"{where}: the image has neither embedded data nor a source path")
        path = source[len("file://"):] if source.startswith("file://") else source
        if not os.path.isabs(path) and image_root is not None:
            path = os.path.join(os.fspath(image_root), path)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise VisionRowError(f"{where}: cannot read the image {source!r} ({exc.strerror}); pass image_root= "
                                 "the folder the conversations were read from, or pack with embedded images") from exc
    digest = _field(image, "sha256")
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise VisionRowError(f"{where}: the image {source!r} changed since it was packed (sha256 differs): its token "
                             "count may differ too; pack again")
    return bytes(data)


def _open_rgb(data: bytes, where: str):
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Exception as exc:  # PIL raises many types for a bad file
        raise VisionRowError(f"{where}: the image cannot be decoded ({type(exc).__name__}: {exc})") from exc


class VisionCollator:
    """``collator(rows)``: packed vision rows as one ``(1, T)`` batch (see the module docstring).

    ``processor``: the model's ``AutoProcessor`` (its ``image_processor`` is run) or its folder, or an image
    processor with ``image_token_id`` given. ``image_root``: the folder relative ``source`` paths are resolved in.
    ``token_type_ids``: emit them (default: when the processor's ``model_input_names`` has them, as
    Gemma 3's does). ``tokens_per_image``: image tokens per image (or per tile), to check each image's count
    where the processor does not say (Qwen's grid does). ``model``: needed for Gemma 3's per-sequence masks (its config and attention).
    ``count=True`` adds ``num_supervised_tokens`` (pop it before ``model(**batch)``).
    """

    def __init__(self, processor, *, model=None, image_root: str | os.PathLike | None = None,
                 image_token_id: int | None = None, token_type_ids: bool | None = None, tokens_per_image: int | None = None,
                 count: bool = False):
        if isinstance(processor, (str, os.PathLike)):  # a processor folder, loaded as packprep pack loads it
            from ..vision.processor import load_processor

            processor = load_processor(os.fspath(processor))
        self.processor = processor
        self.image_processor = getattr(processor, "image_processor", processor)
        self.image_token_id = image_token_id if image_token_id is not None else _image_token_id(processor)
        names = getattr(processor, "model_input_names", ()) or ()
        self.token_type_ids = ("token_type_ids" in names) if token_type_ids is None else token_type_ids
        self.tokens_per_image = tokens_per_image or getattr(processor, "image_seq_length", None) or getattr(
            processor, "image_seq_len", None)
        self.model, self.image_root, self.count = model, image_root, count

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict:
        if isinstance(rows, Mapping):
            rows = [rows]
        if not rows:
            raise ValueError("VisionCollator needs at least one row")
        ids, labels, text_pos, mrope, lens, pixels = [], [], [], [], [], []
        for r, row in enumerate(rows):
            seq_lens = _row_seq_lens(row)
            starts = np.cumsum(seq_lens) - seq_lens
            lab = _as_np(row["labels"]).copy()
            lab[starts] = IGNORE_INDEX  # no sequence predicts the next one's first token
            ids.append(_as_np(row["input_ids"]))
            labels.append(lab)
            text_pos.append(_restarted_positions(seq_lens))
            lens.append(seq_lens)
            if row.get("mrope_position_ids") is not None:
                mrope.append(_mrope(row, starts, r))
            pixels.extend(self._images(row, ids[-1], r))
        if mrope and len(mrope) != len(rows):
            raise VisionRowError("some rows carry mrope_position_ids and some do not: pack them with one processor")
        input_ids = torch.from_numpy(np.concatenate(ids)).long()[None]
        positions = torch.from_numpy(np.concatenate(text_pos)).long()[None]
        if mrope:  # (4, 1, T): text positions (sequence boundaries) above the rope index
            positions = torch.cat([positions, torch.from_numpy(np.concatenate(mrope, axis=1)).long()])[:, None]
        batch = {"input_ids": input_ids, "labels": torch.from_numpy(np.concatenate(labels)).long()[None],
                 "position_ids": positions, **join_image_outputs(pixels), "use_cache": False}
        seq_lens = np.concatenate(lens)
        if self.token_type_ids:
            batch["token_type_ids"] = (input_ids == self.image_token_id).long()
            if self.model is not None:
                from .vision_masks import packed_vision_masks

                batch["attention_mask"] = packed_vision_masks(self.model, batch["token_type_ids"], seq_lens)
        if self.count:
            batch["num_supervised_tokens"] = num_supervised_tokens(batch["labels"][0], seq_lens)
        return batch

    def image_inputs(self, row: Mapping[str, Any], r: int = 0) -> dict:
        """``pixel_values`` (and the family's other image inputs) of one row's images, in row order."""
        return join_image_outputs(self._images(row, None, r))

    def _images(self, row: Mapping[str, Any], ids: np.ndarray | None, r: int) -> list[dict]:
        """The image processor's output for each image of the row, in row order, token counts checked (with
        ``ids``, the row's tokens, also that its images account for all of its image tokens)."""
        images = sorted(list(row.get("images") or ()), key=lambda image: int(_field(image, "start")))
        outs = []
        for k, image in enumerate(images):
            where = f"row {r}, image {k} ({_field(image, 'source')!r})"
            pil = _open_rgb(load_image_bytes(image, self.image_root, where), where)
            out = self.image_processor(images=[pil], return_tensors="pt")
            want = self._token_count(out)
            if want is not None and int(_field(image, "length")) != want:
                raise VisionRowError(f"{where}: the row holds {int(_field(image, 'length'))} image tokens for it but "
                                     f"the processor now gives {want} (changed resizing settings?): pack again with "
                                     "this processor")
            outs.append(out)
        n_tokens = None if ids is None else int((ids == self.image_token_id).sum())
        if n_tokens is not None and n_tokens != sum(int(_field(image, "length")) for image in images):
            raise VisionRowError(f"row {r}: {n_tokens} image tokens in input_ids, but its images column accounts for "
                                 f"{sum(int(_field(image, 'length')) for image in images)}" + (
                                     " (dropped by the trainer? set remove_unused_columns=False)" if not images else ""))
        return outs

    def _token_count(self, out) -> int | None:
        """Image tokens the model fills from this processor output, where the processor says."""
        if "image_grid_thw" in out:
            merge = int(getattr(self.image_processor, "merge_size", 2))
            return int(out["image_grid_thw"].prod()) // (merge * merge)
        if self.tokens_per_image is None:
            return None
        pixel_values = out["pixel_values"]
        images = pixel_values.shape[1] if pixel_values.dim() == 5 else pixel_values.shape[0]
        return int(self.tokens_per_image) * int(images)


def _image_token_id(processor) -> int:
    found = getattr(processor, "image_token_id", None)
    if found is None and getattr(processor, "tokenizer", None) is not None:
        token = getattr(processor, "image_token", None)
        found = processor.tokenizer.convert_tokens_to_ids(token) if token else None
    if found is None:
        raise TypeError("VisionCollator needs image_token_id= with an image processor alone")
    return int(found)


def _mrope(row: Mapping[str, Any], starts: np.ndarray, r: int) -> np.ndarray:
    """The row's stored (3, n) rope index; each sequence's must start at (0, 0, 0), as computed alone."""
    stored = np.stack([_as_np(axis) for axis in row["mrope_position_ids"]])
    if stored.shape != (3, len(_as_np(row["input_ids"]))):
        raise VisionRowError(f"row {r}: mrope_position_ids has shape {stored.shape}, not 3 x the row's length")
    if (stored[:, starts] != 0).any():
        raise VisionRowError(f"row {r}: mrope_position_ids do not restart at every packed sequence: each sequence's "
                             "rope index must be computed alone")
    return stored


def join_image_outputs(outs: Sequence[Mapping[str, Any]]) -> dict:
    """Image processor outputs of single images as one batch's: stacked images (``(N, ...)``) are
    concatenated, per-sample ones (``(1, n, C, H, W)``: Idefics3, SmolVLM) joined into one sample, padded
    to the largest patch with zeros (the mask marks them)."""
    if not outs:
        return {}
    joined = {}
    for key in IMAGE_KEYS:
        parts = [out[key] for out in outs if key in out]
        if not parts:
            continue
        if parts[0].dim() >= 4 and key != "pixel_values" or parts[0].dim() == 5:  # per-sample: (1, n, ...)
            height = max(p.shape[-2] for p in parts)
            width = max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in parts]
            joined[key] = torch.cat(parts, dim=1)
        else:
            joined[key] = torch.cat(parts, dim=0)
    return joined
