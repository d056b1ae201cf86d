"""A packed row through a recurrent or convolutional layer's torch function in ONE call, restarted at each sequence.

Without their kernels (flash-linear-attention, mamba_ssm, causal_conv1d), transformers' hybrid layers call a
torch function over the whole ``(1, T)`` row: a short causal convolution, the chunked gated delta rule or the
chunked Mamba-2 scan. Each of those carries state across the row. These wrappers give the same function a
row laid out so that no state crosses a boundary, then take the tokens back:

* convolution (kernel ``K``): ``K - 1`` zeros before each sequence, the zeros the function puts before a
  sequence run alone;
* chunked scans (chunk ``C``): each sequence starts a chunk of its own (the chunks it has alone), and the
  slot after its last token gets a log-decay of :data:`WIPE`, whose ``exp`` is exactly 0 in float32: the
  state that reaches the next sequence is exactly zero, as it is at the start of a sequence alone. The
  sequences share rows as long as the longest, a batch: the scan's sequential loop over chunks is as long
  as for the longest sequence alone.

Every token thus goes through the computation of its sequence alone, in one call for the whole row. The cost
is the padding: ``K - 1`` slots a sequence for the convolution, 1 to ``C`` for a scan, and the rows' ends.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

WIPE = -1.0e4  # a log-decay: exp(WIPE + anything <= 0) is 0.0 in float32, so the carried state is wiped


@dataclass(frozen=True)
class Layout:
    """Where each token of a packed row goes in ``rows`` spread rows of ``length // rows`` slots (flattened), and
    the wipe slots."""

    index: torch.Tensor  # (T,) slot of each token
    wipes: torch.Tensor  # (N,) the slot after each sequence (scans), empty for a convolution
    length: int
    rows: int = 1


def _sequences(cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence number of each token, each token's offset in its sequence, the sequence lengths)."""
    lengths = cu.diff()
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=total)
    return seq, torch.arange(total, device=cu.device) - cu[:-1][seq], lengths


def gapped(cu: torch.Tensor, gap: int) -> Layout:
    """``gap`` empty slots before every sequence but the first (which the function pads itself)."""
    seq, _, lengths = _sequences(cu)
    index = torch.arange(len(seq), device=cu.device) + gap * seq
    return Layout(index, index[:0], len(seq) + gap * (len(lengths) - 1))


def chunked(cu: torch.Tensor, chunk: int) -> Layout:
    """Each sequence from the start of a chunk, over whole chunks, with at least one slot after its end; the
    sequences placed first-fit, longest first, in rows as long as the longest: a scan's sequential steps over
    the chunks are then those of the longest sequence, and the rows its batch."""
    seq, offset, lengths = _sequences(cu)
    chunks = ((lengths + chunk) // chunk).tolist()  # ceil((n + 1) / chunk)
    width = max(chunks)
    used: list[int] = []  # chunks taken in each row
    first = [0] * len(chunks)  # first slot of each sequence
    for s in sorted(range(len(chunks)), key=lambda i: -chunks[i]):
        row = next((r for r, taken in enumerate(used) if taken + chunks[s] <= width), len(used))
        used += [0] * (row == len(used))
        first[s] = (row * width + used[row]) * chunk
        used[row] += chunks[s]
    starts = torch.tensor(first, device=cu.device)
    ends = starts + torch.tensor(chunks, device=cu.device) * chunk
    return Layout(starts[seq] + offset, ends - 1, len(used) * width * chunk, len(used))


def spread(x: torch.Tensor, layout: Layout, dim: int = 1) -> torch.Tensor:
    """``x`` (a packed row along ``dim``) placed into zeros at the layout's slots."""
    shape = list(x.shape)
    shape[dim] = layout.length
    return x.new_zeros(shape).index_copy(dim, layout.index, x)


def _rows(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A spread ``(1, length, ...)`` tensor as the layout's ``(rows, length // rows, ...)`` batch."""
    return x.reshape(layout.rows, -1, *x.shape[2:])


def _back(out: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The packed row's tokens out of a ``(rows, length // rows, ...)`` result."""
    return out.reshape(1, layout.length, *out.shape[2:]).index_select(1, layout.index)


def causal_conv1d(function: Callable, x: torch.Tensor, weight, bias, activation, cu: torch.Tensor) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (``x``: ``(1, D, T)``) with each sequence's window starting at it."""
    layout = gapped(cu, weight.shape[-1] - 1)
    return function(spread(x, layout, 2), weight, bias, activation=activation).index_select(2, layout.index)


DEFAULT_CHUNK = 64  # transformers' default chunk for its chunked gated delta rule (Qwen3-Next, Qwen3.5)


def unwrap(function: Callable) -> Callable:
    """transformers' torch function itself, under the wrappers its versions put around it: ``functools.wraps``
    wrappers (the kernel dispatcher, which refuses sequence boundaries) and, from 5.25 with ``kernels``
    installed, a ``Func`` module whose ``forward`` calls it. What cannot be unwrapped is returned as it is:
    it still computes the same function, through its dispatcher."""
    for _ in range(8):
        inner = getattr(function, "__wrapped__", None)
        if inner is None and isinstance(function, torch.nn.Module):
            closure = getattr(type(function).forward, "__closure__", None) or ()
            called = [c.cell_contents for c in closure
                      if callable(c.cell_contents) and not isinstance(c.cell_contents, (type, torch.nn.Module))]
            inner = called[0] if len(called) == 1 else None
        if inner is None:
            return function
        function = inner
    return function


@functools.lru_cache(maxsize=8)
def _default_chunk(function: Callable) -> int:
    """The function's own default ``chunk_size`` (its rounding is what a sequence alone gets), else
    :data:`DEFAULT_CHUNK` where a wrapper hides the signature."""
    try:
        default = inspect.signature(function).parameters["chunk_size"].default
    except (KeyError, TypeError, ValueError):
        return DEFAULT_CHUNK
    return default if isinstance(default, int) and default > 0 else DEFAULT_CHUNK


def gated_delta_rule(function: Callable, query, key, value, g, beta, cu: torch.Tensor, *,
                     use_qk_l2norm_in_kernel: bool = False, chunk_size: int | None = None):
    """transformers' ``torch_chunk_gated_delta_rule`` (``(1, T, heads, dim)``) with the state restarted at each
    sequence. Returns ``(output, None)``."""
    chunk = chunk_size or _default_chunk(function)
    layout = chunked(cu, chunk)
    decay = spread(g.float(), layout).index_fill(1, layout.wipes, WIPE)  # the function computes it in float32
    query, key, value, beta = (_rows(spread(x, layout), layout) for x in (query, key, value, beta))
    out, _ = function(query, key, value, g=_rows(decay, layout), beta=beta, chunk_size=chunk,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return _back(out, layout), None


def mamba2_scan(function: Callable, x, dt, A, B, C, chunk_size: int, cu: torch.Tensor, *, D=None, dt_bias=None,
                dt_softplus: bool = False, dt_limit=(0.0, float("inf"))):
    """transformers' ``mamba2_chunk_scan`` (``x``: ``(1, T, heads, dim)``) with the state restarted at each
    sequence. ``dt`` is discretised here as the function does it (bias, softplus, limits); the wipe slot's
    ``dt`` makes ``dt * A`` equal :data:`WIPE` in every head."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()  # the function multiplies it in float32
    layout = chunked(cu, chunk_size)
    wipe = (WIPE / A.float()).clamp(max=1e30).expand(1, len(layout.wipes), -1)
    dt = _rows(spread(dt, layout).index_copy(1, layout.wipes, wipe), layout)
    x, B, C = (_rows(spread(t, layout), layout) for t in (x, B, C))
    out = function(x, dt, A, B, C, chunk_size, D=D, dt_limit=(dt_limit[0], float("inf")))
    return _back(out, layout)
