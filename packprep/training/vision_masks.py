"""Block-diagonal attention masks for packed rows of models whose image tokens attend both ways (Gemma 3).

Each packed sequence's masks are the model's own, built by its modeling module for that sequence alone
(``create_masks_for_vision_model`` from its ``token_type_ids``), and laid on the diagonal of the row's
mask; everything off the diagonal is masked. So every layer type (full and sliding) sees exactly what
the sequence alone sees. transformers' own packed detection is not enough here: it remaps the causal and
sliding masks to in-sequence positions, but the image-block overlay of the sliding layers is then read at
those in-sequence positions too, i.e. from the first sequence's tokens.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def _builders(model):
    module = sys.modules[type(getattr(model, "model", model)).__module__]
    build = getattr(module, "create_masks_for_vision_model", None)
    blocks = getattr(module, "get_block_sequence_ids_for_mask", None)
    if build is None or blocks is None:
        raise TypeError(f"{type(model).__name__}: packprep builds per-sequence image masks from the modeling module's "
                        "create_masks_for_vision_model (Gemma 3); this model's module has none")
    return build, blocks


def packed_vision_masks(model, token_type_ids: torch.Tensor, seq_lens) -> dict[str, torch.Tensor]:
    """``{layer type: (1, 1, T, T) mask}`` for one packed row: each sequence's own masks on the diagonal."""
    build, blocks = _builders(model)
    config = model.config.get_text_config()
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise ValueError(f"packed image masks are dense 4-D masks: attn_implementation {impl!r} does not take them; "
                         "use 'sdpa' or 'eager'")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    total = int(token_type_ids.shape[-1])
    masks: dict[str, torch.Tensor] = {}
    at = 0
    for n in np.asarray(seq_lens, dtype=np.int64).tolist():
        types = token_type_ids[:, at : at + n]
        dummy = torch.empty((1, n, 1), dtype=dtype)
        alone = build(config=config, inputs_embeds=dummy, attention_mask=None, cache=None, position_ids=None,
                      block_sequence_ids=blocks(types))
        for name, mask in alone.items():
            if name not in masks:
                off = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
                masks[name] = torch.full((1, 1, total, total), off, dtype=mask.dtype)
            masks[name][..., at : at + n, at : at + n] = mask[..., -n:, -n:]
        at += n
    return masks
