"""torchtune: rows exactly as its ``PackedDataset`` hands them to ``padded_collate_packed``.

What its code (torchtune 0.6.1, ``datasets/_packed.py``, ``data/_collate.py``, the recipes) does
with a packed sample:

* a pack is ``tokens``, ``labels``, ``input_pos`` and ``seq_lens``, every one but ``seq_lens``
  padded to ``max_seq_len`` (tokens with the pad id, labels with -100, ``input_pos`` continuing
  from the last position, clamped to ``max_seq_len - 1``), and the padding counted as one more
  entry of ``seq_lens``;
* ``padded_collate_packed`` stacks them and turns ``seq_lens`` into a block-causal ``mask``;
  ``input_pos`` are the RoPE positions;
* labels are unshifted: the recipe shifts them (``hstack(labels[..., 1:], ignore)``), as
  packprep's are. packprep's ``-100`` at every sequence's first token is what keeps the last
  token of one sequence from being trained to predict the next one's first.

torchtune has no loader for already packed data: its recipes pack at start-up. So this module
also holds the dataset component a recipe config names (``packed_dataset``); it refuses to run
unless the config says ``packed: True``, because without it the recipe picks
``padded_collate_sft``, which drops ``seq_lens`` and ``input_pos``: every row becomes one
sequence, silently.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..layout import IGNORE_INDEX
from ._rows import Rows, fixed_list, ragged_list

COLUMNS = ("tokens", "labels", "input_pos", "seq_lens")


def convert(table: pa.Table, context) -> pa.Table:
    """Canonical rows -> torchtune packs of width ``context.max_len``."""
    width = int(context.max_len)
    rows = Rows(table)
    rows.check_width(width, "torchtune (max_seq_len)")
    tokens = rows.fixed(rows.input_ids, width, getattr(context, "pad_token_id", 0) or 0, np.int32)
    labels = rows.fixed(rows.labels, width, IGNORE_INDEX, np.int32)
    # padding positions continue from the last real one, clamped, as PackedDataset._pad_pack does
    last = np.full(rows.num_rows, -1, np.int64)
    nonempty = rows.row_lens > 0
    last[nonempty] = rows.token_pos[rows.offsets[1:][nonempty] - 1]
    tail = last[:, None] + 1 + np.arange(width)[None, :] - rows.row_lens[:, None]
    input_pos = np.minimum(tail, width - 1).astype(np.int32)
    real = np.arange(width)[None, :] < rows.row_lens[:, None]
    input_pos[real] = rows.token_pos
    # seq_lens: the row's, plus the padding as one more block
    pad = width - rows.row_lens
    counts = rows.seqs_per_row + (pad > 0)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq_lens = np.empty(offsets[-1], np.int32)
    is_pad = np.zeros(offsets[-1], bool)
    is_pad[offsets[1:][pad > 0] - 1] = True
    seq_lens[~is_pad] = rows.seq_lens
    seq_lens[is_pad] = pad[pad > 0]
    columns = {
        "tokens": fixed_list(tokens),
        "labels": fixed_list(labels),
        "input_pos": fixed_list(input_pos),
        "seq_lens": ragged_list(seq_lens, offsets),
    }
    if "source_index" in table.column_names:
        columns["source_index"] = table.column("source_index").combine_chunks()
    return pa.table(columns)


def packed_dataset(tokenizer=None, *, source: str, packed: bool = False, split: str = "train"):
    """The torchtune dataset component for a folder exported with ``--to torchtune``.

    In a recipe config: ``dataset: {_component_: packprep.layouts.torchtune.packed_dataset,
    source: DIR, packed: True}``. ``tokenizer`` is what the recipe passes; the rows are already
    tokens, so it is not used.
    """
    if packed is not True:
        raise ValueError(
            "packprep torchtune rows need `packed: True` in the dataset config: without it the recipe "
            "collates with padded_collate_sft, which drops seq_lens and input_pos, so every row would be "
            "trained as ONE sequence"
        )
    import torch
    from datasets import load_dataset

    data = load_dataset(str(source), split=split).select_columns(list(COLUMNS))

    class _Packs(torch.utils.data.Dataset):
        packed = True  # what recipes read from a ConcatDataset

        def __len__(self):
            return len(data)

        def __getitem__(self, index):
            row = data[index]
            return {k: torch.tensor(row[k], dtype=torch.long) for k in COLUMNS}

    return _Packs()


def checkable(collate_fn, model):
    """torchtune's collator and model in the terms ``packprep.training.check_pipeline`` speaks.

    ``check_pipeline(*checkable(padded_collate_packed, model), "packed/", layout="torchtune")``:
    each row goes through ``collate_fn`` and ``model`` unchanged; only the names differ
    (``tokens``/``input_pos`` are ``input_ids``/``position_ids`` there).
    """
    import torch

    def pipeline(rows):
        batch = collate_fn([{k: torch.tensor(row[k], dtype=torch.long) for k in COLUMNS} for row in rows])
        batch["input_ids"] = batch.pop("tokens")
        return batch

    class Checked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids=None, input_pos=None, mask=None, labels=None, use_cache=None):
            out = self.model(input_ids, mask=mask, input_pos=input_pos if input_pos is not None else position_ids)
            return torch.cat(out, dim=1) if isinstance(out, list) else out  # chunked-output models

    return pipeline, Checked()
