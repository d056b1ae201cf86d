"""Collators: packed rows to one varlen batch (``collate_packed``), or to a padded one (``collate_padded``)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..layout import IGNORE_INDEX
from .tree import refuse_tree_rows


def _as_np(x, dtype=np.int64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def _row_seq_lens(row: Mapping[str, Any]) -> np.ndarray:
    n = len(row["input_ids"])
    stored = row.get("seq_lens", row.get("seq_lengths"))
    if stored is not None:
        seq_lens = _as_np(stored)
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


def collate_packed(rows: Sequence[Mapping[str, Any]], *, check_positions: bool = True, count: bool = False) -> dict:
    """Concatenate packed rows into one ``(1, T)`` varlen batch (see the package docstring).

    ``rows``: dicts with ``input_ids`` and ``labels`` and at least one of ``seq_lens`` /
    ``seq_lengths`` / ``position_ids`` (a row with none is one sequence; transformers' Trainer
    drops ``seq_lens``, keeping ``position_ids``).  With ``check_positions`` (default) stored
    ``position_ids`` must restart at 0 at each sequence.  Every key is a model argument, so the
    result goes to ``model(**batch)`` and to ``Trainer(data_collator=collate_packed)`` as is;
    ``count=True`` adds ``num_supervised_tokens`` (not a model argument: pop it) for a loop that
    normalises the loss over an optimizer step.
    """
    if isinstance(rows, Mapping):
        rows = [rows]
    if not rows:
        raise ValueError("collate_packed needs at least one row")
    ids, labels, positions, lens = [], [], [], []
    for row in rows:
        refuse_tree_rows(row, "collate_packed")
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
    batch = {
        "input_ids": torch.from_numpy(np.concatenate(ids)).long().unsqueeze(0),
        "labels": torch.from_numpy(labels_np).long().unsqueeze(0),
        "position_ids": torch.from_numpy(np.concatenate(positions)).long().unsqueeze(0),
        "cu_seq_lens_q": cu_t,
        "cu_seq_lens_k": cu_t.clone(),
        "max_length_q": max_len,
        "max_length_k": max_len,
        "seq_idx": torch.from_numpy(np.repeat(np.arange(len(seq_lens), dtype=np.int32), seq_lens)).unsqueeze(0),
        "use_cache": False,
    }
    if count:
        batch["num_supervised_tokens"] = num_supervised_tokens(labels_np, seq_lens)
    return batch


class PackedCollator:
    """Callable form of :func:`collate_packed` (for ``DataLoader(collate_fn=...)``)."""

    def __init__(self, check_positions: bool = True, count: bool = False):
        self.check_positions = check_positions
        self.count = count

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict:
        return collate_packed(rows, check_positions=self.check_positions, count=self.count)


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
    count: bool = False,
) -> dict:
    """The padding baseline: one sample per batch row, right-padded to the longest.

    Packed rows (with several ``seq_lens``) are split into their sequences first, so the
    result has one batch row per sequence.  Returns ``input_ids``, ``labels`` (-100 on pads),
    ``attention_mask`` (1 on tokens, 0 on pads), ``use_cache=False``, and with ``count``
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
    batch = {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(lab),
        "attention_mask": torch.from_numpy(mask),
        "use_cache": False,
    }
    if count:
        batch["num_supervised_tokens"] = n_sup
    return batch


class PaddedCollator:
    """Callable form of :func:`collate_padded`."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None, count: bool = False):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.count = count

    def __call__(self, rows):
        return collate_padded(rows, self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of, count=self.count)
