"""``torch.nn.attention.varlen.varlen_attn`` as a transformers attention function."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

VARLEN_ATTENTION_NAME = "packprep_varlen"


def _cu_from_position_ids(position_ids: torch.Tensor):
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
    return cu, int(cu.diff().max().item())


def varlen_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """transformers attention function on ``torch.nn.attention.varlen.varlen_attn``.

    ``query``: (B, Hq, T, D); ``key``/``value``: (B, Hkv, T, D).  Sequence boundaries come from
    ``cu_seq_lens_q/k`` + ``max_length_q/k`` (as emitted by :func:`collate_packed`), else from
    restarted ``position_ids``, else each batch row is one sequence.  Causal.
    """
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("varlen_attn has no attention dropout; set attention_dropout=0")
    if softcap:
        raise ValueError("varlen_attn does not support logit softcapping")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "varlen attention got a padding mask: feed packed batches (packprep.training.collate_packed), not padded ones"
        )
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or max_q is None:
        pos = kwargs.get("position_ids")
        if pos is not None:
            cu_q, max_q = _cu_from_position_ids(pos.expand(b, -1) if pos.shape[0] != b else pos)
        else:
            cu_q = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=query.device)
            max_q = t
        cu_k, max_k = cu_q, max_q
    if cu_k is None:
        cu_k, max_k = cu_q, max_q
    cu_q = cu_q.to(device=query.device, dtype=torch.int32)
    cu_k = cu_k.to(device=query.device, dtype=torch.int32)
    max_q = int(max_q.item()) if isinstance(max_q, torch.Tensor) else int(max_q)
    max_k = int(max_k.item()) if isinstance(max_k, torch.Tensor) else int(max_k)

    q = query.transpose(1, 2).reshape(b * t, hq, d)
    k = key.transpose(1, 2).reshape(b * key.shape[2], hkv, d)
    v = value.transpose(1, 2).reshape(b * value.shape[2], hkv, d)
    params = _parameters(varlen_attn)
    extra: dict[str, Any] = {}
    if hq != hkv:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
    if "window_size" in params:
        left = -1 if sliding_window is None else int(sliding_window) - 1
        extra["window_size"] = (left, 0)
    else:
        if sliding_window is not None:
            raise ValueError("this torch's varlen_attn has no sliding window support")
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, **extra)
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(b, t, hq, d), None


@functools.lru_cache(maxsize=4)
def _parameters(function) -> frozenset:
    """The parameter names of the ``varlen_attn`` being called (torch versions add some), looked up once
    a function: a cache of the module's name alone would outlive a replaced ``varlen_attn``."""
    return frozenset(inspect.signature(function).parameters)


def register_varlen_attention(name: str = VARLEN_ATTENTION_NAME, *, require_cuda: bool = True) -> str | None:
    """Register ``varlen_attn`` with transformers; return the ``attn_implementation`` name.

    Returns ``None`` when ``torch.nn.attention.varlen.varlen_attn`` or transformers'
    ``AttentionInterface`` is missing, or (with ``require_cuda``, the default: the kernel is
    CUDA-only) when no CUDA device is available.  The mask function registered with it is
    transformers' ``flash_attention_mask`` (no 4-D mask is ever built).
    """
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:
        return None
    if require_cuda and not torch.cuda.is_available():
        return None
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
