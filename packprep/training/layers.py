"""The token-mixing layer types that carry state from one token to the next, by class name.

One table for the two places that need it: ``hybrid`` (which functions to replace for a layer type)
and ``isolation`` (which layer type to name when packed sequences leak).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class LayerType:
    """A token-mixing layer type that carries state, and the transformers functions its forward calls."""

    name: str
    what: str
    classes: tuple[str, ...]
    functions: tuple[str, ...]


LAYER_TYPES = (
    LayerType("gated_deltanet", "Gated DeltaNet linear attention with its short convolution",
              ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"),
              ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")),
    LayerType("mamba2", "Mamba-2 state-space scan with its short convolution",
              ("BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer"),
              ("causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined")),
    LayerType("short_conv", "LFM2 gated short convolution", ("Lfm2ShortConv", "Lfm2MoeShortConv"),
              ("causal_conv1d_fn",)),
)
BY_CLASS = {cls: layer for layer in LAYER_TYPES for cls in layer.classes}
# class names of layers that carry state from token to token (the ones packprep covers match too)
_STATEFUL = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|Recurren|Rwkv|RWKV|Retention|Lstm|LSTM|Hyena|SSM|"
                       r"LinearAttention")


def layer_type_of(module) -> LayerType | None:
    """The covered layer type of ``module`` (by class name), or None."""
    return BY_CLASS.get(type(module).__name__)


def stateful_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every outermost module of ``model`` whose class name says it carries state."""
    from transformers import PreTrainedModel

    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) or not _STATEFUL.search(type(module).__name__):
            continue
        if not any(name.startswith(p + ".") for p, _ in found):
            found.append((name, module))
    return found


def describe(module) -> str:
    """``'gated_deltanet' (Gated DeltaNet ..., Qwen3_5GatedDeltaNet)`` or the bare class name."""
    layer = layer_type_of(module)
    cls = type(module).__name__
    return f"{layer.name!r} ({layer.what}, {cls})" if layer else f"{cls!r}"
