"""PyTorch integration for packprep shards (the ``torch`` extra).

Everything that needs ``torch`` lives in this package; ``import packprep`` never imports torch, and
``import packprep.training`` loads neither numba nor pyarrow (shards are opened on first use).

``data``      ``PackedDataset(dir_or_files)``: map-style dataset; item ``i`` is packed row ``i`` as
              1-D numpy arrays with the canonical column names (``packprep.layout``), whatever
              the folder's layout; safe in ``DataLoader`` workers.
``collate``   ``collate_packed(rows)`` / ``PackedCollator``: one or more packed rows as ONE flat
              ``(1, T)`` varlen batch::

                  input_ids, labels, position_ids   LongTensor (1, T)
                  cu_seq_lens_q, cu_seq_lens_k      IntTensor  (N + 1,) = [0, cumsum(seq_lens of all rows)]
                  max_length_q, max_length_k        int        (longest packed sequence)
                  seq_idx                           IntTensor  (1, T)   (sequence number of each token)
                  use_cache                         False

              Every key is a model argument: ``model(**batch)`` and ``Trainer(data_collator=
              collate_packed)`` take it as is. It never emits an ``attention_mask`` (an all-ones
              mask next to restarted ``position_ids`` silently disables packed-sequence isolation
              in transformers' SDPA/eager path and in flash-attention), and always sets
              ``use_cache=False`` (transformers skips its packed-sequence detection whenever a
              KV cache is created). It forces the first label of every packed sequence to -100.
              ``count=True`` adds ``num_supervised_tokens``: the tokens in the causal-LM loss after
              the shift (``labels[t] != -100``, ``t >= 1`` within a sequence), to normalise the loss
              over an optimizer step across gradient accumulation; pop it before ``model(**batch)``.
              ``collate_padded`` is the padding baseline (one sequence a row, with a mask).
``attention`` ``register_varlen_attention()``: ``torch.nn.attention.varlen.varlen_attn`` as a
              transformers attention function; returns its ``attn_implementation`` name, or None.
``hybrid``    ``register_packed_layers(model)``: the recurrent and convolutional layers of hybrid models
              (Gated DeltaNet, Mamba-2, short convolutions) keep packed sequences apart, from the
              ``cu_seq_lens_q``/``seq_idx`` of ``collate_packed`` (see docs/hybrid-models.md); a layer
              type packprep does not cover is refused, named.
``restarts``  without the kernel packages, those layers' torch functions on a whole packed row in one
              call, laid out so that every sequence restarts (exact against each sequence alone).
``isolation`` ``check_pipeline(collate_fn_or_trainer, model, data)``: one real packed row through
              the user's own collator/Trainer and model, compared with its sequences run alone;
              raises ``PackingIsolationError`` naming the cause. ``check_isolation(model)``: the
              model alone, on two random sequences.
``tree``      ``collate_tree(rows)`` + ``register_tree_attention()``: shared-prefix rows
              (``pack --shared-prefix``) through a FlexAttention mask read from ``tree_descendants``;
              ``tree_check``: what ``check_pipeline`` checks of such rows (every root-to-leaf path alone).
``vision``    ``VisionCollator(processor)``: packed rows with images (layout ``packprep-vision``) as one
              ``(1, T)`` batch: each image loaded (embedded bytes or its path, sha256-checked) and run
              through the processor's image part once, ``pixel_values`` (+ ``image_grid_thw`` /
              ``pixel_attention_mask``) in row order, ``(4, 1, T)`` M-RoPE positions (text row first) or
              ``(1, T)``; Gemma 3 gets per-sequence masks laid block-diagonally (``vision_masks``).
              ``check_vision_pipeline(collator_or_trainer, model, data)``: every packed conversation's
              logits against the model's own path for it alone (see docs/vision.md).
``order``     ``check_order(loader_or_trainer, data)``: warns (``BalanceOrderWarning``) when the sampler
              would not read rows packed with ``--balance-dp`` in the order they were balanced for.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("packprep.training needs PyTorch: install the extra with `pip install packprep[torch]`") from exc

from ..layout import IGNORE_INDEX
from .attention import VARLEN_ATTENTION_NAME, register_varlen_attention, varlen_attention_forward
from .collate import (PackedCollator, PaddedCollator, collate_packed, collate_padded, num_supervised_tokens,
                      unpack_rows)
from .data import PackedDataset
from .hybrid import register_packed_layers
from .isolation import PackingIsolationError, check_isolation, check_pipeline
from .order import BalanceOrderWarning, check_order
from .tree import TREE_ATTENTION_NAME, TreeRowsError, collate_tree, register_tree_attention
from .vision import VisionCollator, VisionRowError
from .vision_check import check_vision_pipeline

__all__ = [
    "IGNORE_INDEX",
    "BalanceOrderWarning",
    "VARLEN_ATTENTION_NAME",
    "PackedDataset",
    "PackedCollator",
    "PaddedCollator",
    "PackingIsolationError",
    "check_isolation",
    "check_order",
    "check_pipeline",
    "collate_packed",
    "collate_padded",
    "unpack_rows",
    "num_supervised_tokens",
    "register_packed_layers",
    "register_varlen_attention",
    "varlen_attention_forward",
    "TREE_ATTENTION_NAME",
    "TreeRowsError",
    "collate_tree",
    "register_tree_attention",
    "VisionCollator",
    "VisionRowError",
    "check_vision_pipeline",
]
