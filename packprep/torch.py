"""PyTorch integration for packprep shards (the ``torch`` extra).

Everything that needs ``torch`` lives in this module; ``import packprep`` never imports torch.

What is here
------------
``PackedDataset(dir_or_files)``
    Map-style dataset over the shards of a packprep output folder (``DIR/data/*.parquet`` or
    ``*.arrow``), or over a list of shard files.  Item ``i`` is one packed row: a dict of 1-D
    numpy arrays ``input_ids``, ``labels``, ``position_ids``, ``seq_lens`` (int32) and
    ``source_index`` (int64).  Arrow IPC shards are memory-mapped (zero copy); Parquet shards
    are read through a memory map.  Shards are opened lazily, per process, so the dataset is
    safe to hand to ``torch.utils.data.DataLoader`` workers.

``collate_packed(rows)`` / ``PackedCollator``
    Concatenates one or more packed rows into ONE flat sequence of shape ``(1, T)`` for
    varlen ("padding-free") attention::

        input_ids, labels, position_ids   LongTensor (1, T)
        cu_seq_lens_q, cu_seq_lens_k      IntTensor  (N + 1,) = [0, cumsum(seq_lens of all rows)]
        max_length_q, max_length_k        int        (longest packed sequence)
        use_cache                         False
        num_supervised_tokens             int        (see below; NOT a model argument)

    It never emits an ``attention_mask``: an all-ones mask next to restarted ``position_ids``
    silently disables packed-sequence isolation in transformers' SDPA/eager path and in
    flash-attention.  ``use_cache=False`` is always set, because transformers skips its
    packed-sequence detection whenever a KV cache is created (``use_cache`` defaults to True,
    also in training), and packed sequences then attend across their boundaries, silently.

    ``num_supervised_tokens`` is the number of tokens that contribute to the causal-LM loss
    AFTER the shift: for every packed sequence, the positions ``t >= 1`` with
    ``labels[t] != -100`` (``labels[0]`` of a sequence is never predicted from within the
    sequence).  Use it to normalise the loss per token across gradient accumulation:
    ``loss = sum_of_token_losses / total_num_supervised_tokens_of_the_optimizer_step``
    (e.g. pass ``num_items_in_batch=<that total>`` to a transformers model).  Pop it before
    ``model(**batch)``.  The collator also forces the first label of every packed sequence to
    -100 (the shard contract already guarantees it), so that the shifted loss of a packed row
    never predicts the first token of a sequence from the end of the previous one.

``collate_padded(rows_or_samples, pad_token_id=0)``
    The padding baseline: one sample per batch row, padded to the longest with an
    ``attention_mask`` and ``labels == -100`` on padding.  Packed rows are split into their
    sequences first (``unpack_rows``).

``check_isolation(model, vocab_size=None, device=None)``
    Runs two short random sequences packed and alone through ``model`` as configured and
    raises ``PackingIsolationError`` naming the cause when the logits differ.

``register_varlen_attention()``
    Registers ``torch.nn.attention.varlen.varlen_attn`` as a transformers attention function
    and returns its name (pass it as ``attn_implementation``), or ``None`` when unavailable.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "packprep.torch needs PyTorch: install the extra with `pip install packprep[torch]`"
    ) from exc

IGNORE_INDEX = -100
VARLEN_ATTENTION_NAME = "packprep_varlen"
COLUMNS = ("input_ids", "labels", "position_ids", "seq_lens", "source_index")

__all__ = [
    "IGNORE_INDEX",
    "PackedDataset",
    "PackedCollator",
    "PaddedCollator",
    "PackingIsolationError",
    "collate_packed",
    "collate_padded",
    "unpack_rows",
    "num_supervised_tokens",
    "check_isolation",
    "register_varlen_attention",
    "varlen_attention_forward",
]


# --------------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------------


def _shard_files(dir_or_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    if isinstance(dir_or_files, (str, os.PathLike)):
        path = os.fspath(dir_or_files)
        if os.path.isdir(path):
            base = os.path.join(path, "data") if os.path.isdir(os.path.join(path, "data")) else path
            files = sorted(
                glob.glob(os.path.join(base, "*.parquet")) + glob.glob(os.path.join(base, "*.arrow"))
            )
            if not files:
                raise FileNotFoundError(f"no *.parquet or *.arrow shards under {base}")
            return files
        return [path]
    files = [os.fspath(f) for f in dir_or_files]
    if not files:
        raise ValueError("no shard files given")
    return files


def _read_table(path: str):
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path, memory_map=True)
    source = pa.memory_map(path, "r")
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.memory_map(path, "r")).read_all()


class _Shard:
    """One shard: per list column, the flat values and the offsets (numpy views, no copy for IPC)."""

    def __init__(self, path: str, columns: Sequence[str]):
        import pyarrow as pa

        table = _read_table(path)
        self.num_rows = table.num_rows
        self.values: dict[str, np.ndarray] = {}
        self.offsets: dict[str, np.ndarray] = {}
        for name in columns:
            if name not in table.column_names:
                continue
            col = table.column(name)
            arr = col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)
            if pa.types.is_large_list(arr.type) or pa.types.is_list(arr.type):
                # offsets/values of the (possibly sliced) list array
                offsets = np.asarray(arr.offsets)
                self.offsets[name] = offsets
                self.values[name] = np.asarray(arr.values)
            else:
                raise TypeError(f"{path}: column {name!r} is {arr.type}, expected a list column")

    def row(self, i: int) -> dict[str, np.ndarray]:
        out = {}
        for name, values in self.values.items():
            off = self.offsets[name]
            out[name] = values[off[i] : off[i + 1]]
        return out


class PackedDataset:
    """Map-style dataset over packprep shards: ``ds[i]`` is packed row ``i`` as numpy arrays.

    ``dir_or_files``: an output folder (with ``data/`` and ``packprep.json``), a folder of
    shards, one shard file, or a list of shard files (``.parquet`` or Arrow IPC ``.arrow``).
    ``columns``: the list columns to load (default: all of the contract's that are present).
    """

    def __init__(
        self,
        dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
        columns: Sequence[str] | None = None,
    ):
        self.files = _shard_files(dir_or_files)
        self.columns = tuple(columns) if columns is not None else COLUMNS
        self.manifest: dict[str, Any] | None = None
        if isinstance(dir_or_files, (str, os.PathLike)) and os.path.isdir(dir_or_files):
            mpath = os.path.join(os.fspath(dir_or_files), "packprep.json")
            if os.path.exists(mpath):
                with open(mpath, encoding="utf-8") as fh:
                    self.manifest = json.load(fh)
        import pyarrow.parquet as pq

        counts = []
        for f in self.files:
            if f.endswith(".parquet"):
                counts.append(pq.ParquetFile(f).metadata.num_rows)
            else:
                counts.append(_read_table(f).num_rows)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._shards: dict[int, _Shard] = {}

    @property
    def max_len(self) -> int | None:
        cfg = (self.manifest or {}).get("config", {})
        return cfg.get("max_len")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(idx)
        k = int(np.searchsorted(self._starts, idx, side="right") - 1)
        shard = self._shards.get(k)
        if shard is None:
            shard = self._shards[k] = _Shard(self.files[k], self.columns)
        return shard.row(idx - int(self._starts[k]))

    def seq_lens(self) -> list[np.ndarray]:
        """The ``seq_lens`` of every row (reads only that column)."""
        return [self[i]["seq_lens"] for i in range(len(self))]

    # shards are re-opened lazily in each DataLoader worker
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_shards"] = {}
        return state


# --------------------------------------------------------------------------------------------
# Collators
# --------------------------------------------------------------------------------------------


def _as_np(x, dtype=np.int64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def _row_seq_lens(row: Mapping[str, Any]) -> np.ndarray:
    n = len(row["input_ids"])
    if row.get("seq_lens") is not None:
        seq_lens = _as_np(row["seq_lens"])
    elif row.get("position_ids") is not None:
        pos = _as_np(row["position_ids"])
        starts = np.flatnonzero(pos == 0)
        if n and (len(starts) == 0 or starts[0] != 0):
            raise ValueError("position_ids of a packed row must start at 0")
        seq_lens = np.diff(np.append(starts, n))
    else:
        seq_lens = np.array([n], dtype=np.int64)
    if seq_lens.sum() != n or (seq_lens <= 0).any():
        raise ValueError(f"seq_lens {seq_lens.tolist()} do not partition a row of {n} tokens")
    return seq_lens


def _restarted_positions(seq_lens: np.ndarray) -> np.ndarray:
    total = int(seq_lens.sum())
    starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    return np.arange(total, dtype=np.int64) - starts


def num_supervised_tokens(labels, seq_lens) -> int:
    """Tokens that count in the causal-LM loss after the shift: ``labels[1:] != -100`` per sequence."""
    labels = _as_np(labels)
    seq_lens = _as_np(seq_lens)
    supervised = labels != IGNORE_INDEX
    starts = np.cumsum(seq_lens) - seq_lens
    supervised[starts[seq_lens > 0]] = False
    return int(supervised.sum())


def collate_packed(rows: Sequence[Mapping[str, Any]], *, check_positions: bool = True) -> dict:
    """Concatenate packed rows into one ``(1, T)`` varlen batch (see the module docstring).

    ``rows``: dicts with ``input_ids`` and ``labels`` and at least one of ``seq_lens`` /
    ``position_ids`` (a row with neither is one sequence).  With ``check_positions`` (default)
    stored ``position_ids`` must restart at 0 at each sequence of ``seq_lens``.
    """
    if isinstance(rows, Mapping):
        rows = [rows]
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    ids, labels, positions, lens = [], [], [], []
    for row in rows:
        seq_lens = _row_seq_lens(row)
        pos = _restarted_positions(seq_lens)
        if check_positions and row.get("position_ids") is not None:
            stored = _as_np(row["position_ids"])
            if not np.array_equal(stored, pos):
                raise ValueError(
                    "position_ids do not restart at 0 at every packed sequence (seq_lens="
                    f"{seq_lens.tolist()}): packed sequences would not be isolated"
                )
        lab = _as_np(row["labels"]).copy()
        if len(lab) != len(pos) or len(_as_np(row["input_ids"])) != len(pos):
            raise ValueError("input_ids, labels and seq_lens lengths disagree")
        lab[np.cumsum(seq_lens) - seq_lens] = IGNORE_INDEX  # first label of each sequence
        ids.append(_as_np(row["input_ids"]))
        labels.append(lab)
        positions.append(pos)
        lens.append(seq_lens)
    seq_lens = np.concatenate(lens)
    labels_np = np.concatenate(labels)
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    cu_t = torch.from_numpy(cu)
    max_len = int(seq_lens.max())
    return {
        "input_ids": torch.from_numpy(np.concatenate(ids)).long().unsqueeze(0),
        "labels": torch.from_numpy(labels_np).long().unsqueeze(0),
        "position_ids": torch.from_numpy(np.concatenate(positions)).long().unsqueeze(0),
        "cu_seq_lens_q": cu_t,
        "cu_seq_lens_k": cu_t.clone(),
        "max_length_q": max_len,
        "max_length_k": max_len,
        "use_cache": False,
        "num_supervised_tokens": num_supervised_tokens(labels_np, seq_lens),
    }


class PackedCollator:
    """Callable form of :func:`collate_packed` (for ``DataLoader(collate_fn=...)``)."""

    def __init__(self, check_positions: bool = True):
        self.check_positions = check_positions

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict:
        return collate_packed(rows, check_positions=self.check_positions)


def unpack_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """Split packed rows into their sequences: ``[{"input_ids": ..., "labels": ...}, ...]``."""
    out = []
    for row in rows:
        seq_lens = _row_seq_lens(row)
        ids = _as_np(row["input_ids"])
        lab = _as_np(row["labels"])
        src = row.get("source_index")
        src = _as_np(src) if src is not None else None
        start = 0
        for j, n in enumerate(seq_lens):
            sample = {"input_ids": ids[start : start + n], "labels": lab[start : start + n]}
            if src is not None and len(src) == len(seq_lens):
                sample["source_index"] = src[j : j + 1]
            out.append(sample)
            start += n
    return out


def collate_padded(
    rows: Sequence[Mapping[str, Any]],
    pad_token_id: int = 0,
    *,
    pad_to_multiple_of: int | None = None,
) -> dict:
    """The padding baseline: one sample per batch row, right-padded to the longest.

    Packed rows (with several ``seq_lens``) are split into their sequences first, so the
    result has one batch row per sequence.  Returns ``input_ids``, ``labels`` (-100 on pads),
    ``attention_mask`` (1 on tokens, 0 on pads), ``use_cache=False`` and
    ``num_supervised_tokens`` (same definition as :func:`collate_packed`).
    """
    if isinstance(rows, Mapping):
        rows = [rows]
    samples = unpack_rows(rows)
    if not samples:
        raise ValueError("collate_padded needs at least one sample")
    longest = max(len(s["input_ids"]) for s in samples)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    ids = np.full((b, longest), pad_token_id, dtype=np.int64)
    lab = np.full((b, longest), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((b, longest), dtype=np.int64)
    n_sup = 0
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = s["input_ids"]
        lab[i, :n] = s["labels"]
        lab[i, 0] = IGNORE_INDEX
        mask[i, :n] = 1
        n_sup += int((lab[i, 1:n] != IGNORE_INDEX).sum())
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(lab),
        "attention_mask": torch.from_numpy(mask),
        "use_cache": False,
        "num_supervised_tokens": n_sup,
    }


class PaddedCollator:
    """Callable form of :func:`collate_padded`."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows):
        return collate_padded(rows, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)


# --------------------------------------------------------------------------------------------
# varlen_attn as a transformers attention function
# --------------------------------------------------------------------------------------------


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
            "varlen attention got a padding mask: feed packed batches (packprep.torch.collate_packed), not padded ones"
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
    params = _varlen_params()
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


_VARLEN_PARAMS: frozenset | None = None


def _varlen_params() -> frozenset:
    global _VARLEN_PARAMS
    if _VARLEN_PARAMS is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMS


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


# --------------------------------------------------------------------------------------------
# Isolation check
# --------------------------------------------------------------------------------------------


class PackingIsolationError(RuntimeError):
    """A packed sequence's logits differ from the same sequence run alone."""


_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _model_dtype(model) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _attn_impl(model) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or getattr(cfg, "attn_implementation", "?"))


def check_isolation(
    model,
    vocab_size: int | None = None,
    device=None,
    *,
    lengths: Sequence[int] = (24, 17),
    forward_kwargs: Mapping[str, Any] | None = None,
    via_collator: bool = False,
    atol: float | None = None,
    seed: int = 0,
) -> dict:
    """Check that packed sequences are isolated in ``model`` as configured; raise if not.

    Two random sequences (``lengths``) are run packed in one row (``position_ids`` restarting
    at 0, no attention mask) and each alone.  By default the packed call passes only
    ``input_ids`` and ``position_ids`` plus ``forward_kwargs``, so the model's own defaults
    (``config.use_cache``, the attention implementation) decide; with ``via_collator=True``
    the batch is exactly what :func:`collate_packed` emits (``use_cache=False``, varlen kwargs).
    The model is put in eval mode for the check (dropout off) and restored afterwards.

    Raises :class:`PackingIsolationError` naming the likely cause when a sequence's logits
    differ by more than ``atol`` (default 1e-3 in float32/float64, else
    ``max(0.25, 0.05 * max|logit|)``).  Returns the per-sequence max abs differences.
    """
    cfg = getattr(model, "config", None)
    if vocab_size is None:
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vocab_size = int(getattr(text_cfg, "vocab_size"))
    if device is None:
        device = next(model.parameters()).device
    dtype = _model_dtype(model)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
    rows = [
        {"input_ids": s, "labels": s, "seq_lens": [len(s)]} for s in seqs
    ]
    packed_row = {
        "input_ids": torch.cat(seqs),
        "labels": torch.cat(seqs),
        "seq_lens": [len(s) for s in seqs],
    }
    extra = dict(forward_kwargs or {})

    def run(batch: dict, kwargs: Mapping[str, Any]) -> torch.Tensor:
        call = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        call.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
        out = model(**call)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0].float()

    def batch_for(row: dict, packing_kwargs: bool, collator: bool) -> dict:
        full = collate_packed([row])
        if collator:
            b = {k: v for k, v in full.items() if k not in ("labels", "num_supervised_tokens")}
        else:
            b = {"input_ids": full["input_ids"], "position_ids": full["position_ids"]}
            if packing_kwargs:
                b.update({k: full[k] for k in _PACKING_KEYS})
        return b

    def measure(kwargs: Mapping[str, Any], packing_kwargs: bool = False, collator: bool = via_collator):
        alone_kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        packed = run(batch_for(packed_row, packing_kwargs, collator), kwargs)
        diffs, scale, start = [], 0.0, 0
        for row, s in zip(rows, seqs):
            alone = run(batch_for(row, packing_kwargs, collator), alone_kwargs)
            part = packed[start : start + len(s)]
            diffs.append(float((part - alone).abs().max()))
            scale = max(scale, float(alone.abs().max()))
            start += len(s)
        return diffs, scale

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            diffs, scale = measure(extra)
            tol = atol
            if tol is None:
                tol = 1e-3 if dtype in (torch.float32, torch.float64) else max(0.25, 0.05 * scale)
            if max(diffs) <= tol:
                return {"max_abs_diff": diffs, "tolerance": tol, "attn_implementation": _attn_impl(model)}
            impl = _attn_impl(model)
            head = (
                f"packed sequences are NOT isolated: logits of a packed sequence differ from the same "
                f"sequence run alone by {max(diffs):.3g} (tolerance {tol:.3g}; attn_implementation="
                f"{impl!r}, dtype={dtype}). "
            )
            cause = None
            if extra.get("attention_mask") is not None:
                cause = (
                    "An attention_mask was passed next to packed position_ids: transformers (SDPA/eager) "
                    "then skips its packed-sequence detection and flash-attention treats the row as ONE "
                    "sequence. Pass no attention_mask with packed rows (packprep.torch.collate_packed never does)."
                )
            elif extra.get("use_cache", getattr(cfg, "use_cache", False)) and not via_collator:
                no_cache = dict(extra, use_cache=False)
                d2, _ = measure(no_cache)
                if max(d2) <= tol:
                    cause = (
                        "use_cache is True (model.config.use_cache defaults to True, also in training): "
                        "transformers creates a KV cache and then skips its packed-sequence detection "
                        "for SDPA/eager attention, so packed sequences attend across their boundaries. "
                        "Pass use_cache=False in every forward (packprep.torch collators do) or set "
                        "model.config.use_cache = False."
                    )
            if cause is None:
                d3, _ = measure(dict(extra, use_cache=False), packing_kwargs=True, collator=False)
                if max(d3) <= tol and not via_collator:
                    cause = (
                        f"attention implementation {impl!r} ignores restarted position_ids; it isolates "
                        "sequences only when given cu_seq_lens_q/k and max_length_q/k. Feed batches "
                        "from packprep.torch.collate_packed."
                    )
                else:
                    cause = (
                        f"attention implementation {impl!r} ignores both position_ids and cu_seq_lens: "
                        "it cannot train on packed rows. Use 'sdpa', 'eager', 'flash_attention_2' or "
                        "packprep.torch.register_varlen_attention()."
                    )
            raise PackingIsolationError(head + cause)
    finally:
        if was_training:
            model.train()
