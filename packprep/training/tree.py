"""Shared-prefix rows (packprep.prefix_tree) trained with FlexAttention.

A shared-prefix row stores a conversation's exact sequences as one prefix tree, depth first; token
``q`` sees token ``k`` iff ``k <= q <= k + tree_descendants[k]``. :func:`collate_tree` turns rows
into one ``(1, T)`` batch carrying ``tree_descendants``; the attention registered by
:func:`register_tree_attention` builds a FlexAttention block mask from it once a forward pass (every
layer reuses it) and runs ``flex_attention`` (compiled) on CUDA; on CPU, where FlexAttention has
no backward, SDPA with the same mask made dense. transformers hands the batch's
extra keys to every attention call, so ``model(**batch)`` and the Trainer need nothing else.

Refused, with the reason: a padding ``attention_mask`` (it would be the mask, not the tree), rows
without ``tree_descendants`` (read as ordinary packed rows, a branch would see its siblings),
hybrid models (a recurrent or convolutional state runs along the stored order, across branches)
and context parallelism (its shards split the row by position, not by subtree).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import transformers_lacks
from ..layout import IGNORE_INDEX
from ..layout import TREE_COLUMN as TREE_COLUMN_SPEC

TREE_ATTENTION_NAME = "packprep_tree"
TREE_COLUMN = TREE_COLUMN_SPEC.name


class TreeRowsError(ValueError):
    """Shared-prefix rows given to something that would read them wrongly."""


def tree_mask_mod(descendants: torch.Tensor):
    """The FlexAttention ``mask_mod`` of a flat tree: ``kv`` is ``q`` or one of its ancestors."""
    end = torch.arange(len(descendants), device=descendants.device, dtype=torch.int32) + descendants.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx <= end[kv_idx])

    return mask_mod


def tree_dense_mask(descendants: torch.Tensor) -> torch.Tensor:
    """The same mask as a dense (T, T) boolean tensor (small rows, tests, SDPA)."""
    n = len(descendants)
    index = torch.arange(n, device=descendants.device)
    end = index + descendants.to(index.dtype)
    q, kv = index[:, None], index[None, :]
    return (kv <= q) & (q <= end[None, :])


_CACHE: dict[str, Any] = {"tensor": None, "key": None, "mask": None}
_COMPILED: dict[str, Any] = {}


def _block_mask(descendants: torch.Tensor, device: torch.device):
    """One block mask per forward pass: every layer gets the same ``tree_descendants`` tensor. The
    cache holds that tensor itself (not its address, which a later batch may reuse)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (str(device), descendants._version)
    if _CACHE["tensor"] is not descendants or _CACHE["key"] != key:
        flat = descendants.reshape(-1).to(device)
        n = flat.numel()
        make = create_block_mask
        if device.type == "cuda":  # compiled: no (T, T) tensor is materialized
            if "block_mask" not in _COMPILED:
                _COMPILED["block_mask"] = torch.compile(create_block_mask)
            make = _COMPILED["block_mask"]
        _CACHE.update(tensor=descendants, key=key, mask=make(tree_mask_mod(flat), None, None, n, n, device=device))
    return _CACHE["mask"]


def _flex(query):
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type != "cuda":  # CPU: unfused, exact
        return flex_attention
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["cuda"]


def tree_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention function over a shared-prefix row (``query``: (1, Hq, T, D))."""
    descendants = kwargs.get(TREE_COLUMN)
    if descendants is None:
        raise TreeRowsError("packprep_tree attention got no tree_descendants: collate shared-prefix rows with "
                            "packprep.training.collate_tree (and keep the column: remove_unused_columns=False)")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise TreeRowsError("packprep_tree attention got a padding mask: the tree is the mask; collate with collate_tree")
    if dropout or softcap or sliding_window:
        raise TreeRowsError("packprep_tree attention has no dropout, logit softcapping or sliding window")
    if query.shape[0] != 1:
        raise TreeRowsError("packprep_tree attention takes one (1, T) row a batch (collate_tree makes it)")
    attend = tree_flex_attention if query.device.type == "cuda" else tree_dense_attention
    return attend(query, key, value, descendants, scaling).transpose(1, 2).contiguous(), None


def tree_flex_attention(query, key, value, descendants: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """FlexAttention over the tree of ``descendants`` (compiled on CUDA; on CPU unfused and
    forward only: torch has no FlexAttention backward there). (1, H, T, D) in and out."""
    block_mask = _block_mask(descendants, query.device)
    return _flex(query)(query, key, value, block_mask=block_mask, scale=scale,
                        enable_gqa=query.shape[1] != key.shape[1])


def tree_dense_attention(query, key, value, descendants: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The same attention through SDPA and a dense (T, T) mask: CPU training, where FlexAttention
    has no backward (the same predicate as :func:`tree_mask_mod`)."""
    mask = tree_dense_mask(descendants.reshape(-1).to(query.device))
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                            enable_gqa=query.shape[1] != key.shape[1])


def _no_mask(*args, **kwargs):
    """transformers builds no mask for this attention: it reads the tree from the batch."""
    return None


def register_tree_attention(model=None, name: str = TREE_ATTENTION_NAME) -> str:
    """Register the tree attention with transformers; return its ``attn_implementation`` name.
    With ``model``: refuse it if a layer keeps a state along the stored order (hybrid models)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise RuntimeError(transformers_lacks("AttentionInterface / masking_utils.AttentionMaskInterface")) from exc

    if model is not None:
        refuse_model(model)
    AttentionInterface.register(name, tree_attention_forward)
    AttentionMaskInterface.register(name, _no_mask)
    return name


def refuse_model(model) -> None:
    """Refuse a model whose recurrent or convolutional layers would carry state across branches."""
    from .layers import stateful_layers

    layers = stateful_layers(model)
    if layers:
        name, module = layers[0]
        raise TreeRowsError(
            f"shared-prefix rows cannot train this model: its layer {name} ({type(module).__name__}) carries a "
            "state from each stored token to the next, and in a prefix tree the next stored token is often on "
            "another branch (a recurrent state cannot branch). Pack with --turn-context exact (flat rows).")


def refuse_context_parallel(trainer) -> None:
    """Refuse a Trainer that shards sequences across ranks (context parallelism)."""
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    size = getattr(config, "cp_size", 1) or 1
    if size > 1:
        raise TreeRowsError(
            f"shared-prefix rows cannot be trained with context parallelism (cp_size={size}): it cuts each row "
            "into contiguous chunks by position and ring-passes keys assuming a causal order, while a tree row's "
            "branches attend to a prefix stored anywhere before them. Train without context parallelism, or "
            "pack with --turn-context exact (flat rows).")


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def collate_tree(rows: Sequence[Mapping[str, Any]], *, count: bool = False, pad_to: int | None = None) -> dict:
    """Shared-prefix rows as one ``(1, T)`` batch: ``input_ids``, ``labels``, ``position_ids``,
    ``tree_descendants`` and ``use_cache=False``. ``count=True`` adds ``num_supervised_tokens``.
    ``pad_to``: pad ``T`` up to a multiple of it (one compiled kernel for every batch), each pad
    token a tree of its own, untrained."""
    if isinstance(rows, Mapping):
        rows = [rows]
    if not rows:
        raise ValueError("collate_tree needs at least one row")
    ids, labels, positions, descendants = [], [], [], []
    for row in rows:
        if row.get(TREE_COLUMN) is None:
            raise TreeRowsError(
                "a row without tree_descendants: collate_tree reads shared-prefix rows (pack --shared-prefix); "
                "a Trainer drops the column unless TrainingArguments(remove_unused_columns=False)")
        desc, lab = _np(row[TREE_COLUMN]), _np(row["labels"]).copy()
        n = len(desc)
        if not (len(_np(row["input_ids"])) == len(lab) == len(_np(row["position_ids"])) == n):
            raise ValueError("input_ids, labels, position_ids and tree_descendants differ in length")
        check_tree_row(row)
        ids.append(_np(row["input_ids"]))
        labels.append(lab)
        positions.append(_np(row["position_ids"]))
        descendants.append(desc)
    pad = -sum(len(d) for d in descendants) % pad_to if pad_to else 0
    if pad:
        zeros = np.zeros(pad, np.int64)
        ids, positions, descendants = ids + [zeros], positions + [zeros], descendants + [zeros]
        labels.append(np.full(pad, IGNORE_INDEX, np.int64))
    label = torch.from_numpy(np.concatenate(labels))[None]
    batch = {"input_ids": torch.from_numpy(np.concatenate(ids))[None], "labels": label,
             "position_ids": torch.from_numpy(np.concatenate(positions))[None],
             TREE_COLUMN: torch.from_numpy(np.concatenate(descendants))[None], "use_cache": False}
    if count:
        batch["num_supervised_tokens"] = int((label != IGNORE_INDEX).sum())
    return batch


def check_tree_row(row: Mapping[str, Any]) -> None:
    """Refuse a shared-prefix row whose trees break an invariant (prefix_tree.check_tree on each record's
    tree, where ``seq_lens`` says where each is; else on the row): a subtree reaching past its record (a
    token would attend to another record's) or past the row, subtrees that overlap, positions that are
    not depths, a trained or miscopied branch head. Checked here, not trusted to the folder's manifest."""
    from ..prefix_tree import TreeRow, check_tree

    columns = [_np(row[c]) for c in ("input_ids", "labels", "position_ids", TREE_COLUMN)]
    lengths = _np(row["seq_lens"]) if row.get("seq_lens") is not None else np.array([len(columns[0])])
    if (lengths < 1).any() or int(lengths.sum()) != len(columns[0]):
        raise TreeRowsError("a shared-prefix row whose seq_lens do not cut it into its records' trees")
    start = 0
    for length in lengths.tolist():
        problem = check_tree(TreeRow(*(c[start : start + length] for c in columns)))
        if problem is not None:
            raise TreeRowsError(f"a shared-prefix row whose tree is broken ({problem}) at token {start}: rows not "
                                "written by packprep, or changed since; run packprep verify on the folder")
        start += length


def refuse_tree_rows(row: Mapping[str, Any], who: str) -> None:
    """For readers of ordinary packed rows: refuse a shared-prefix row, saying why."""
    if TREE_COLUMN in row:
        raise TreeRowsError(
            f"{who} got a shared-prefix row (tree_descendants): read as an ordinary packed row, each branch "
            "would attend to its sibling branches. Collate it with packprep.training.collate_tree and train "
            "with register_tree_attention().")

