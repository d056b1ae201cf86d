"""A packed row through a recurrent or convolutional layer's torch function, restarted at each sequence.

Without their kernels (flash-linear-attention, mamba_ssm, causal_conv1d), transformers' hybrid layers call a
torch function over the whole ``(1, T)`` row: a short causal convolution, the chunked gated delta rule or the
chunked Mamba-2 scan. Each of those carries state across the row. These wrappers give the same function a
row laid out so that no state crosses a boundary, then take the tokens back:

* convolution (kernel ``K``): ``K - 1`` zeros before each sequence, the zeros the function puts before a
  sequence run alone; one call for the row.
* chunked scans (chunk ``C``): each sequence starts a chunk of its own (the chunks it has alone), and the
  slot after its last token gets a log-decay of :data:`WIPE`, whose ``exp`` is exactly 0 in float32: the
  state that reaches the next sequence is exactly zero, as it is at the start of a sequence alone. The
  chunks go into rows of at most :data:`ROW` tokens, the function's batch. A sequence longer than a row is
  cut at chunk boundaries into pieces, one a *wave* (one call of the function): each piece's row starts from
  the state its previous piece's row ended with (the functions' initial and final states). Shorter
  sequences fill the rows' free ends first-fit, longest first. The slots are the tokens, at most a chunk a
  sequence, and the rows' ends: work in proportion to the tokens. The scan's sequential steps over chunks
  stay those of the longest sequence alone.

Every token thus goes through the computation of its sequence alone, a call a wave for the whole row.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

WIPE = -1.0e4  # a log-decay: exp(WIPE + anything <= 0) is 0.0 in float32, so the carried state is wiped
ROW = 1024  # tokens in a row of a scan's batch at most (whole chunks, at least one); at least the longest
# sequence's chunks, every sequence is one piece and the rows are as long as the longest sequence


@dataclass(frozen=True)
class Layout:
    """Where each token goes in ``rows`` rows of ``length // rows`` slots (flattened), and the wipe slots."""

    index: torch.Tensor  # (n,) slot of each token
    wipes: torch.Tensor  # the slot after each sequence that ends here (scans), empty for a convolution
    length: int
    rows: int = 1
    tokens: torch.Tensor | None = None  # (n,) the tokens of the packed row placed (a scan's wave), None: all
    carry: torch.Tensor | None = None  # (rows,) the previous wave's row whose final state a row starts from, -1: 0


@dataclass(frozen=True)
class Scan:
    """A scan's waves, and where each packed token's output is in their outputs joined."""

    waves: list[Layout]
    back: torch.Tensor  # (T,)


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


def _place(chunks: list[int], width: int):
    """Rows of ``width`` chunks for sequences of ``chunks`` chunks, longest first: (chunks used in each row of
    each wave, each row's carried row, each sequence's first wave, the first chunk of each of its pieces, the
    chunk after its end)."""
    used: list[list[int]] = []
    carry: list[list[int]] = []
    first = [0] * len(chunks)
    starts: list[list[int]] = [[] for _ in chunks]
    ends = [0] * len(chunks)

    def new_row(wave: int, previous: int) -> int:
        if wave == len(used):
            used.append([])
            carry.append([])
        used[wave].append(0)
        carry[wave].append(previous)
        return len(used[wave]) - 1

    for s in sorted(range(len(chunks)), key=lambda i: -chunks[i]):
        if chunks[s] <= width:  # one piece: the first row with room, in any wave
            wave, row = next(((w, r) for w, rows in enumerate(used) for r, taken in enumerate(rows)
                              if taken + chunks[s] <= width), (0, None))
            row = new_row(0, -1) if row is None else row
            first[s], starts[s] = wave, [row * width + used[wave][row]]
            used[wave][row] += chunks[s]
        else:
            row = -1
            for wave, at in enumerate(range(0, chunks[s], width)):  # full rows, then the rest at a row's start
                row = new_row(wave, row)
                used[wave][row] = min(width, chunks[s] - at)
                starts[s].append(row * width)
        ends[s] = starts[s][-1] + chunks[s] - (len(starts[s]) - 1) * width
    return used, carry, first, starts, ends


def scan_layout(cu: torch.Tensor, chunk: int, row: int | None = None) -> Scan:
    """Each sequence from the start of a chunk, over whole chunks, with at least one slot after its end, in
    waves of rows of at most ``row`` tokens (:data:`ROW`), as :func:`_place` puts them."""
    seq, offset, lengths = _sequences(cu)
    chunks = ((lengths + chunk) // chunk).tolist()  # ceil((n + 1) / chunk)
    width = max(1, min(max(chunks), (row or ROW) // chunk))
    used, carry, first, starts, ends = _place(chunks, width)
    span = width * chunk
    table = torch.tensor([s + [0] * (len(used) - len(s)) for s in starts], device=cu.device) * chunk
    piece = offset // span
    slot = table[seq, piece] + offset % span
    wave_of = torch.tensor(first, device=cu.device)[seq] + piece
    last = torch.tensor([f + len(s) - 1 for f, s in zip(first, starts)], device=cu.device)
    wipes = torch.tensor(ends, device=cu.device) * chunk - 1
    waves = []
    for w, rows in enumerate(used):
        tokens = torch.nonzero(wave_of == w).reshape(-1)
        waves.append(Layout(slot[tokens], wipes[last == w], len(rows) * span, len(rows), tokens,
                            torch.tensor(carry[w], device=cu.device)))
    return Scan(waves, torch.argsort(torch.cat([wave.tokens for wave in waves])))


def spread(x: torch.Tensor, layout: Layout, dim: int = 1) -> torch.Tensor:
    """``x`` (a packed row along ``dim``) placed into zeros at the layout's slots (its tokens only, for a wave)."""
    if layout.tokens is not None:
        x = x.index_select(dim, layout.tokens)
    shape = list(x.shape)
    shape[dim] = layout.length
    return x.new_zeros(shape).index_copy(dim, layout.index, x)


def _rows(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A spread ``(1, length, ...)`` tensor as the layout's ``(rows, length // rows, ...)`` batch."""
    return x.reshape(layout.rows, -1, *x.shape[2:])


def _back(out: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The layout's tokens out of a ``(rows, length // rows, ...)`` result."""
    return out.reshape(1, layout.length, *out.shape[2:]).index_select(1, layout.index)


def _carried(state: torch.Tensor | None, wave: Layout) -> torch.Tensor | None:
    """Each row's initial state: the final state of the previous wave's row it continues, or zeros."""
    if state is None:
        return None
    return torch.cat([state.new_zeros(1, *state.shape[1:]), state]).index_select(0, wave.carry + 1)


def _joined(outs: list[torch.Tensor], scan: Scan) -> torch.Tensor:
    return torch.cat(outs, 1).index_select(1, scan.back)


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
    scan = scan_layout(cu, chunk)
    outs, state = [], None
    for wave in scan.waves:
        decay = spread(g.float(), wave).index_fill(1, wave.wipes, WIPE)  # the function computes it in float32
        q, k, v, b = (_rows(spread(x, wave), wave) for x in (query, key, value, beta))
        out, state = function(q, k, v, g=_rows(decay, wave), beta=b, chunk_size=chunk,
                              initial_state=_carried(state, wave), output_final_state=True,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(_back(out, wave))
    return _joined(outs, scan), None


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
    scan = scan_layout(cu, chunk_size)
    wipe = (WIPE / A.float()).clamp(max=1e30)
    outs, state = [], None
    for wave in scan.waves:
        step = _rows(spread(dt, wave).index_copy(1, wave.wipes, wipe.expand(1, len(wave.wipes), -1)), wave)
        xs, Bs, Cs = (_rows(spread(t, wave), wave) for t in (x, B, C))
        out, state = function(xs, step, A, Bs, Cs, chunk_size, D=D, dt_limit=(dt_limit[0], float("inf")),
                              initial_states=_carried(state, wave), return_final_states=True)
        outs.append(_back(out, wave))
    return _joined(outs, scan)
