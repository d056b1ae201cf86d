"""Axolotl: pre-tokenized rows it passes through untouched, so that transformers splits at positions.

What its code (axolotl 0.19) does with a pre-tokenized data set:

* with ``sample_packing: true`` it maps ``add_position_ids`` over the rows, overwriting
  ``position_ids`` with ``0..n-1`` per row, and its multipack collator concatenates whole rows:
  every packprep row would become ONE sequence. packprep's packing cannot survive that path;
* a data set only counts as "already tokenized" with ``input_ids``, ``attention_mask`` and
  ``labels``, and an all-ones ``attention_mask`` switches transformers' packed-sequence
  detection off (sequences of a row see each other);
* ``skip_prepare_dataset: true`` hands the loaded rows to the trainer as they are (no length
  filter, no ``add_position_ids``, ``remove_unused_columns: false``), and its
  ``DataCollatorForSeq2Seq`` pads ``labels`` with -100 and ``position_ids`` with a fresh
  ``0, 1, ...`` and, when the rows carry no ``attention_mask``, deletes the one the tokenizer
  adds; axolotl also sets ``use_cache = False``. With restarted ``position_ids`` and no mask,
  transformers' SDPA, eager and flash-attention paths keep every sequence to itself.

So this layout is packprep's rows with just ``input_ids``, ``labels`` and ``position_ids`` (no
mask; ``seq_lens``/``source_index`` would reach the model as unknown arguments), read with
``skip_prepare_dataset: true`` and ``sample_packing: false``.
"""

from __future__ import annotations

import pyarrow as pa

COLUMNS = ("input_ids", "labels", "position_ids")


def convert(table: pa.Table, context) -> pa.Table:
    """Canonical rows -> the three columns axolotl passes to the model."""
    return table.select(list(COLUMNS))
