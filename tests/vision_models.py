"""Tiny random vision-language models of three families and packed rows for them (layout ``packprep-vision``).

Models: hidden 64, 2 layers, a 2-layer vision tower, init std 0.5 (a leak shows in float32). Rows: drawn
PNG images on disk, random text around them, each image expanded to the count the family's image
processor gives (Qwen2.5-VL: its grid; Gemma 3: mm_tokens_per_image; Idefics3: tiles x tokens per tile),
labels -100 on image tokens, and for M-RoPE the model's own rope index of each sequence alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import transformers

VOCAB, IMAGE, START, END, FRAME = 300, 290, 292, 293, 289
TEXT = 280  # text tokens are below this


def _text(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.5, **extra)


def _vision(**extra) -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, initializer_range=0.5, **extra)


def qwen2_5_vl():
    config = transformers.Qwen2_5_VLConfig(
        text_config=_text(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=_vision(depth=2, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END,
        initializer_range=0.5)
    processor = transformers.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return config, transformers.Qwen2_5_VLForConditionalGeneration, processor, {}


def gemma3():
    config = transformers.Gemma3Config(
        text_config=_text(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        vision_config=_vision(num_hidden_layers=2, image_size=56, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=START, eoi_token_index=END, image_token_index=IMAGE,
        initializer_range=0.5)
    processor = transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56})
    return config, transformers.Gemma3ForConditionalGeneration, processor, {"token_type_ids": True, "tokens_per_image": 4}


def idefics3():
    config = transformers.Idefics3Config(
        text_config=_text(model_type="llama"),
        vision_config=_vision(num_hidden_layers=2, image_size=56, patch_size=14),
        scale_factor=2, image_token_id=IMAGE, initializer_range=0.5)
    processor = transformers.Idefics3ImageProcessor(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    return config, transformers.Idefics3ForConditionalGeneration, processor, {"tokens_per_image": 4}


FAMILIES = {"qwen2_5_vl": qwen2_5_vl, "gemma3": gemma3, "idefics3": idefics3}


def family(name: str, attn: str = "sdpa"):
    """(model in float32 eval mode, image processor, VisionCollator keyword arguments)."""
    config, cls, processor, kwargs = FAMILIES[name]()
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    for weight in model.parameters():  # Gemma 3's projection starts at zero: images would not show
        if weight.dim() == 2 and not weight.any():
            torch.nn.init.normal_(weight, std=0.5)
    return model, processor, {"image_token_id": IMAGE, **kwargs}


def draw_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` PNG images of varied sizes (noise over gradients), written to ``folder``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
        grad = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
        pixels = np.clip(grad * rng.random(3) + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        paths.append(folder / f"img{k}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def _image_tokens(name: str, processor, path: Path) -> tuple[list[int], list[int]]:
    """(the tokens the image becomes in the conversation, its grid)."""
    from PIL import Image

    out = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
    if name == "qwen2_5_vl":
        grid = out["image_grid_thw"][0].tolist()
        return [START] + [IMAGE] * (int(np.prod(grid)) // 4) + [END], grid
    if name == "gemma3":
        return [START] + [IMAGE] * 4 + [END], [1]
    tiles = int(out["pixel_values"].shape[1])
    return [FRAME] + [IMAGE] * (4 * tiles) + [FRAME], [tiles]


def packed_rows(name: str, model, processor, folder: Path, images_per_seq=((1,), (2, 0), (1,))) -> list[dict]:
    """Rows of ``packprep-vision``: row r packs len(images_per_seq[r]) sequences, sequence j holding that many
    images (a sequence may hold none). Images are referenced by path (relative to ``folder``) and sha256."""
    rng = np.random.default_rng(1)
    paths = iter(draw_images(folder, sum(sum(r) for r in images_per_seq)))
    rows = []
    for counts in images_per_seq:
        row = {"input_ids": [], "labels": [], "seq_lens": [], "images": [], "source_index": []}
        mrope = [[], [], []]
        for j, count in enumerate(counts):
            ids, labels, grids, start = [], [], [], len(row["input_ids"])
            for _ in range(count):
                ids += rng.integers(0, TEXT, int(rng.integers(3, 8))).tolist()
                path = next(paths)
                tokens, grid = _image_tokens(name, processor, path)
                row["images"].append({"seq": j, "start": start + len(ids) + 1, "length": len(tokens) - 2,
                                      "source": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                      "grid": grid, "data": None})
                ids += tokens
                grids.append(grid)
            prompt = len(ids)
            ids += rng.integers(0, TEXT, int(rng.integers(6, 14))).tolist()
            labels = [-100] * prompt + ids[prompt:]
            if name == "qwen2_5_vl":
                for axis, values in zip(mrope, _rope_index(model, ids, grids)):
                    axis.extend(values)
            row["input_ids"] += ids
            row["labels"] += labels
            row["seq_lens"].append(len(ids))
            row["source_index"].append(len(rows) * 10 + j)
        if name == "qwen2_5_vl":
            row["mrope_position_ids"] = mrope
        rows.append(row)
    return rows


def _rope_index(model, ids: list[int], grids: list[list[int]]) -> list[list[int]]:
    """The model's own M-RoPE index of one sequence (3 x n)."""
    tensor = torch.tensor([ids])
    if not grids:
        return [list(range(len(ids)))] * 3
    positions, _ = model.model.get_rope_index(tensor, mm_token_type_ids=(tensor == IMAGE).int(),
                                              image_grid_thw=torch.tensor(grids))
    return positions[:, 0].tolist()


def tiny_qwen_vl(processor):
    """A tiny random Qwen2.5-VL whose vocabulary and image tokens are the processor's."""
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           [("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>")]}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], initializer_range=0.5),
        image_token_id=processor.image_token_id, initializer_range=0.5, **ids)
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa",
                                                                          dtype=torch.float32)
