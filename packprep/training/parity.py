"""How a packed run is held to the same sequences run alone: the error raised when they differ, the
logits compared (float32, one row per token) and the tolerance, exact in float32 and a rounding
allowance in half precision. ``check_isolation``, ``check_pipeline`` and the tree check share them.
"""

from __future__ import annotations

import torch


class PackingIsolationError(RuntimeError):
    """A packed sequence's logits differ from the same sequence run alone."""


def model_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def logits_of(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.reshape(-1, logits.shape[-1]).float()


def tolerance(dtype: torch.dtype, scale: float, atol: float | None) -> float:
    if atol is not None:
        return atol
    return 1e-3 if dtype in (torch.float32, torch.float64) else max(0.25, 0.05 * scale)
