"""Megatron-Bridge / NeMo: the packed ``.npy`` that ``GPTSFTPackedDataset`` loads.

What its code (megatron-bridge 0.3.1, ``data/datasets/sft.py``) reads, per packed row, from
``np.load(path, allow_pickle=True)``: a dict with

* ``input_ids``: the row's tokens (a list);
* ``seq_start_id``: the start offset of every packed sequence (a Python list: the dataset appends
  ``[len(input_ids)]`` to it with ``+``);
* ``loss_mask``: one flag per token, ALREADY SHIFTED: ``loss_mask[t]`` says whether the token at
  ``t + 1`` is trained. Its own packer rolls the mask by one (``x[1:] + [False]``).

Its ``collate_fn`` then cuts every sequence ``[s, e)`` into inputs ``ids[s:e-1]`` and targets
``ids[s+1:e]`` (so the last token of a sequence is never an input), keeps ``loss_mask[s:e-1]``
(with ``answer_only_loss=True``, the default), restarts ``position_ids`` per sequence and passes
``cu_seqlens`` to the THD attention kernel. So from packprep's unshifted labels:
``loss_mask[t] = labels[t + 1] != -100`` inside a sequence and 0 at its last token.

One thing no layout can change: 0.3.1's collate also zeroes the loss wherever the INPUT token is
the tokenizer's ``eos_id`` (``loss_mask[tokens == eos_id] = 0``). A template that trains a token
after its end-of-turn token (Qwen's ``<|im_end|>\\n``, when ``<|im_end|>`` is the eos) loses that
token's loss in Megatron-Bridge. The export counts such labels and warns.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from ..layout import IGNORE_INDEX, list_column
from ._rows import Rows, ragged_list

TRAIN_FILE = "training.npy"
METADATA_FILE = "metadata.json"


def shifted_loss_mask(rows: Rows) -> np.ndarray:
    """Per token: 1 when the NEXT token of the same sequence is trained (Megatron's loss_mask)."""
    n = len(rows.labels)
    mask = np.zeros(n, np.int8)
    if n > 1:
        mask[:-1] = rows.labels[1:] != IGNORE_INDEX
    ends = rows.seq_starts + rows.seq_lens.astype(np.int64) - 1
    mask[ends] = 0  # a sequence's last token predicts nothing of its own sequence
    return mask


SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())),
                    ("seq_start_id", pa.list_(pa.int64()))])


def convert(table: pa.Table, context=None) -> pa.Table:
    """Canonical rows -> the rows of ``training.npy`` as a table: what ``pack --layout megatron``'s
    writers make of each row group (``write_files`` saves them) and ``check_pipeline(..., layout="megatron")`` feeds."""
    rows = Rows(table)
    starts = rows.seq_starts - np.repeat(rows.offsets[:-1], rows.seqs_per_row)  # each sequence's start in its row
    return pa.table([ragged_list(rows.input_ids, rows.offsets, pa.int64()),
                     ragged_list(shifted_loss_mask(rows), rows.offsets, pa.int8()),
                     ragged_list(starts, rows.seq_offsets, pa.int64())], schema=SCHEMA)


def npy_rows(converted: pa.Table) -> list[dict]:
    """Converted rows -> the dicts ``GPTSFTPackedDataset`` indexes (Python lists, as its packer writes)."""
    columns = [list_column(converted, name) for name in SCHEMA.names]
    flat = [values.tolist() for values, _ in columns]  # one conversion a column, then slices of Python lists
    (_, offsets), (_, _), (_, seq_offsets) = columns
    offsets, seq_offsets = offsets.tolist(), seq_offsets.tolist()
    return [{"input_ids": flat[0][offsets[r]:offsets[r + 1]], "loss_mask": flat[1][offsets[r]:offsets[r + 1]],
             "seq_start_id": flat[2][seq_offsets[r]:seq_offsets[r + 1]]} for r in range(converted.num_rows)]


def megatron_rows(table: pa.Table) -> list[dict]:
    """Canonical rows -> the dicts ``GPTSFTPackedDataset`` indexes."""
    return npy_rows(convert(table))


def _after_eos(converted: pa.Table, eos_id: int) -> int:
    """Trained labels of converted rows whose input token is ``eos_id`` (``loss_mask[t]``: token t+1 is trained)."""
    ids, _ = list_column(converted, "input_ids")
    mask, _ = list_column(converted, "loss_mask")
    return int(np.count_nonzero(mask.astype(bool) & (ids == eos_id)))


def labels_after_eos(table: pa.Table, eos_id: int) -> int:
    """Trained labels whose input token (the one before, same sequence) is ``eos_id``: Megatron drops them."""
    return _after_eos(convert(table), eos_id)


def eos_id(manifest: Mapping[str, Any]) -> int | None:
    """The tokenizer's eos id (what Megatron's HF tokenizer wrapper uses), from the manifest's tokenizer."""
    tok = manifest.get("tokenizer") or {}
    if isinstance(tok.get("eos_token_id"), int):
        return tok["eos_token_id"]
    name = tok.get("name_or_path")
    if not name:
        return None
    try:
        from ..tokenizer_folder import FolderTokenizer, loadable

        if loadable(name):  # a tokenizer folder: read without importing transformers (seconds of start-up)
            return FolderTokenizer(name).eos_token_id
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True).eos_token_id
    except Exception:  # noqa: BLE001 - no tokenizer at hand: the check is skipped, and said so
        return None


def write_files(tables: Iterable[pa.Table], out: Path, context) -> list[dict]:
    """Write ``training.npy`` (+ ``metadata.json`` for ``PackedSequenceSpecs``) from ``convert``'s
    tables, in order; return the file entries."""
    out = Path(out) / "data"
    out.mkdir(parents=True, exist_ok=True)
    manifest = getattr(context, "manifest", {}) or {}
    eos = eos_id(manifest)
    rows: list[dict] = []
    dropped = 0
    seq_lens: list[np.ndarray] = []
    for table in tables:
        added = npy_rows(table)
        seq_lens.extend(np.diff(row["seq_start_id"] + [len(row["input_ids"])]) for row in added)
        rows.extend(added)
        if eos is not None:
            dropped += _after_eos(table, eos)
    if not rows:
        raise ValueError("no rows to export")
    path = out / TRAIN_FILE
    array = np.empty(len(rows), dtype=object)
    array[:] = rows
    np.save(path, array, allow_pickle=True)
    packed = np.array([s.sum() for s in seq_lens])
    metadata = [
        {
            "dataset_max_seqlen": int(max(s.max() for s in seq_lens)),
            "max_samples_per_bin": int(max(len(s) for s in seq_lens)),
            "packing_factor": round(sum(len(s) for s in seq_lens) / len(seq_lens), 2),
            "packing_efficiency": round(float(packed.mean()) / context.max_len * 100, 2),
            "pack_size": int(context.max_len),
            "min_packed_seqlen": int(packed.min()),
        }
    ]
    (out / METADATA_FILE).write_text(json.dumps(metadata) + "\n")
    if eos is None:
        warnings.warn(
            "megatron layout: the tokenizer is not at hand, so the labels Megatron-Bridge drops after an "
            "eos token (its collate zeroes the loss where the input token is eos_id) were not counted",
            stacklevel=2,
        )
    elif dropped:
        warnings.warn(
            f"megatron layout: {dropped} trained labels follow the eos token (id {eos}) as input; "
            "Megatron-Bridge's collate_fn zeroes their loss (loss_mask[tokens == eos_id] = 0), so they "
            "will not be trained there",
            stacklevel=2,
        )
    entries = []
    for name in (TRAIN_FILE, METADATA_FILE):
        p = out / name
        entries.append({"path": f"data/{name}", "bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
    entries[0].update(rows=len(rows), tokens=int(packed.sum()), labels_dropped_after_eos=dropped if eos is not None else None)
    return entries


def checkable(dataset):
    """Megatron-Bridge's ``GPTSFTPackedDataset.collate_fn`` in the terms of ``packprep.training.check_pipeline``.

    ``check_pipeline(checkable(dataset), hf_model, "packed/", layout="megatron")`` with the
    transformers model of the same checkpoint: each row goes through Megatron's own collate, and
    its ``tokens``, ``position_ids``, ``labels`` and ``loss_mask`` are laid back out as full
    sequences (Megatron never inputs a sequence's last token: it is the last label), so the guard
    checks the boundaries, positions and trained labels Megatron will use. Megatron's THD
    attention itself is not run. The labels its collate drops after an eos input are the one
    known difference (the export counts them); they are put back so the guard checks the rest.
    """
    import torch

    eos = dataset.tokenizer.eos_id

    def pipeline(rows):
        items = [{"input_ids": r["input_ids"], "seq_boundaries": list(r["seq_start_id"]) + [len(r["input_ids"])],
                  "loss_mask": r["loss_mask"]} for r in rows]
        batch = dataset.collate_fn(items)
        ids, pos, labels = [], [], []
        for i, row in enumerate(rows):
            starts = list(row["seq_start_id"]) + [len(row["input_ids"])]
            stored_mask = row["loss_mask"]
            r_ids, r_pos, r_labels = [], [], []
            c = 0  # Megatron's offset: each sequence is one token shorter there
            for s, e in zip(starts[:-1], starts[1:]):
                n = e - s - 1
                tok = batch["tokens"][i, c : c + n].tolist()
                lab = batch["labels"][i, c : c + n].tolist()
                mask = batch["loss_mask"][i, c : c + n].tolist()
                mask = [m or (t == eos and stored_mask[s + k]) for k, (m, t) in enumerate(zip(mask, tok))]
                r_ids += tok + lab[-1:] if n else [row["input_ids"][s]]
                r_pos += batch["position_ids"][i, c : c + n].tolist() + [n]
                r_labels += [IGNORE_INDEX] + [x if m else IGNORE_INDEX for x, m in zip(lab, mask)]
                c += n
            ids.append(r_ids), pos.append(r_pos), labels.append(r_labels)
        return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos), "labels": torch.tensor(labels),
                "use_cache": False}

    return pipeline
