"""Recurrent and convolutional layers (hybrid models) kept apart at packed-sequence boundaries.

A Gated DeltaNet, a Mamba-2 scan or a short causal convolution carries state from one token to the next:
restarted ``position_ids`` and varlen attention do not stop it, so packed sequence B would start from
sequence A's state. transformers' hybrid modeling code calls a few module-level functions for these
layers and hands them its keyword arguments (``cu_seq_lens_q``, ``seq_idx``); on CPU, without the
optional kernel packages, those functions refuse the boundaries or ignore them.

:func:`register_packed_layers` puts packprep's own functions in their place, in the modeling module of
each covered layer of the given model. With sequence boundaries in the call they keep sequences apart:
flash-linear-attention's varlen kernels on a CUDA tensor when ``fla`` is installed, else transformers'
own torch function, called on the whole row laid out so that each sequence restarts (``restarts``: exact,
the computation of the sequence alone; a scan once for each wave of rows of at most ``restarts.ROW`` tokens).
Without boundaries they are transformers' functions. A model with a stateful layer type packprep does
not cover is refused, naming it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Callable

import torch

from .restarts import causal_conv1d as restart_conv1d
from .restarts import gated_delta_rule as restart_gated_delta_rule
from .restarts import mamba2_scan as restart_mamba2_scan
from .restarts import unwrap
from ..errors import transformers_lacks
from .layers import BY_CLASS, LayerType, layer_type_of, stateful_layers

_MARK = "_packprep_packed"
FALLBACK = "transformers' torch functions on the packed row, restarted at each sequence"


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def register_packed_layers(model) -> dict[str, str]:
    """Make every recurrent/convolutional layer of ``model`` keep packed sequences apart; or refuse.

    Installs packprep's boundary-aware functions in the transformers modeling module of each covered
    layer (idempotent; without boundaries they behave as transformers' own), then checks the model:
    two random sequences packed through :func:`collate_packed` must give their logits run alone.
    Returns ``{layer type: implementation}``. Raises ``PackingIsolationError`` naming any stateful
    layer type packprep does not cover, or the layer that still leaks.
    """
    from .isolation import PackingIsolationError, check_isolation

    layers = stateful_layers(model)
    uncovered = [(name, m) for name, m in layers if layer_type_of(m) is None]
    if uncovered:
        name, module = uncovered[0]
        raise PackingIsolationError(
            f"packed rows cannot be kept apart in this model: its layer {name} ({type(module).__name__}) carries "
            "state from token to token and packprep has no implementation that restarts it at each packed "
            f"sequence (covered: {', '.join(sorted(BY_CLASS))}). Train it on padded rows "
            "(packprep.training.collate_padded, or `packprep pack --strategy pad`)."
        )
    used: dict[str, str] = {}
    for _, module in layers:
        layer = layer_type_of(module)
        _install(sys.modules[type(module).__module__], layer)
        on_gpu = next(module.parameters()).is_cuda
        used[layer.name] = ("flash-linear-attention varlen kernels" if on_gpu and fla_available()
                            else FALLBACK)
    if used:
        check_isolation(model, via_collator=True)
    return used


def _install(modeling, layer: LayerType) -> None:
    for name in layer.functions:
        original = getattr(modeling, name, None)
        if original is None:
            raise RuntimeError(transformers_lacks(f"{modeling.__name__}.{name} (packed {layer.name} layers)"))
        if not getattr(original, _MARK, False):
            replacement = _REPLACEMENTS[name](original)
            setattr(replacement, _MARK, True)
            setattr(modeling, name, replacement)


def _boundaries(kwargs: dict, length: int) -> torch.Tensor | None:
    """Cumulative sequence lengths of a ``(1, T)`` packed row from the call's keyword arguments, or None."""
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        cu = kwargs.get("cu_seq_lens_q")
    seq_idx = kwargs.get("seq_idx")
    if cu is None and seq_idx is not None:
        if seq_idx.shape[0] != 1:
            raise ValueError("packed rows need one (1, T) row per batch (packprep.training.collate_packed)")
        starts = torch.nonzero(torch.diff(seq_idx[0], prepend=seq_idx[0, :1] - 1)).reshape(-1)
        cu = torch.cat([starts, torch.tensor([seq_idx.shape[1]], device=starts.device)])
    if cu is None or len(cu) <= 2:
        return None
    if int(cu[-1]) != length:
        raise ValueError(f"sequence boundaries cover {int(cu[-1])} tokens, the batch row has {length}: "
                         "packed rows need one (1, T) row per batch (packprep.training.collate_packed)")
    return cu.to(torch.long)


_BOUNDARY_KEYS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _plain(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in _BOUNDARY_KEYS}


def _no_state(kwargs: dict, *names: str) -> None:
    if any(kwargs.get(n) is not None and kwargs.get(n) is not False for n in names):
        raise ValueError("packed rows are for training: a recurrent state (cache) cannot span several packed "
                         "sequences; pass use_cache=False")


def _conv(original: Callable) -> Callable:
    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        cu = _boundaries(kwargs, x.shape[-1])
        if cu is None:
            return original(x, weight, bias, activation=activation, **_plain(kwargs))
        if x.is_cuda and fla_available():
            from fla.modules.causal_conv1d import causal_conv1d

            y, _ = causal_conv1d(x.transpose(1, 2), weight, bias, activation=activation, cu_seqlens=cu)
            return y.transpose(1, 2)
        return restart_conv1d(unwrap(original), x, weight, bias, activation, cu)
    return causal_conv1d_fn


def _gated_delta_rule(original: Callable) -> Callable:
    def chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        cu = _boundaries(kwargs, query.shape[1])
        if cu is None:
            return original(query, key, value, g=g, beta=beta, **_plain(kwargs))
        _no_state(kwargs, "initial_state", "output_final_state")
        l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        if query.is_cuda and fla_available():
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

            return fla_chunk(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
        return restart_gated_delta_rule(unwrap(original), query, key, value, g, beta, cu, use_qk_l2norm_in_kernel=l2norm,
                                         chunk_size=kwargs.get("chunk_size"))
    return chunk_gated_delta_rule


def _mamba2_scan(original: Callable) -> Callable:
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, **kwargs):
        cu = _boundaries(kwargs, hidden_states.shape[1])
        if cu is None:
            return original(hidden_states, dt, A, B, C, chunk_size, **_plain(kwargs))
        _no_state(kwargs, "initial_states", "return_final_states")
        named = {k: kwargs[k] for k in ("D", "dt_bias", "dt_softplus", "dt_limit") if k in kwargs}
        if hidden_states.is_cuda and fla_available():
            return _mamba2_fla(hidden_states, dt, A, B, C, cu, **named)
        return restart_mamba2_scan(unwrap(original), hidden_states, dt, A, B, C, chunk_size, cu, **named)
    return mamba2_chunk_scan


def _mamba2_fla(x, dt, A, B, C, cu, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """The Mamba-2 scan as flash-linear-attention's varlen simple GLA: ``q=C, k=B, v=dt*x, log-decay=dt*A``."""
    from fla.ops.simple_gla import chunk_simple_gla

    dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    heads = x.shape[2]
    q = C.repeat_interleave(heads // C.shape[2], dim=2).to(x.dtype)
    k = B.repeat_interleave(heads // B.shape[2], dim=2).to(x.dtype)
    v = (x.float() * dt[..., None]).to(x.dtype)
    y, _ = chunk_simple_gla(q, k, v, g=dt * A.float(), scale=1.0, cu_seqlens=cu)
    return y.float() + (x.float() * D.float()[:, None] if D is not None else 0.0)


def _mamba2_fused(original: Callable) -> Callable:
    def mamba2_split_conv1d_scan_combined(zxbcdt, *args, **kwargs):
        if _boundaries(kwargs, zxbcdt.shape[1]) is not None:
            return None  # the layer then takes its unfused path: packprep's short convolution and scan above
        return original(zxbcdt, *args, **_plain(kwargs))
    return mamba2_split_conv1d_scan_combined


_REPLACEMENTS = {
    "causal_conv1d_fn": _conv,
    "torch_chunk_gated_delta_rule": _gated_delta_rule,
    "mamba2_chunk_scan": _mamba2_scan,
    "mamba2_split_conv1d_scan_combined": _mamba2_fused,
}
