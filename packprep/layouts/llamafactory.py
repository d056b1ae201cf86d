"""LLaMA-Factory: a ``save_to_disk`` folder for ``tokenized_path``, rows as its neat packing makes them.

What its code (llamafactory 0.9.5) does with pre-tokenized packed data:

* ``tokenized_path: DIR`` makes ``get_dataset`` call ``datasets.load_from_disk(DIR)`` and use the
  rows as they are ("Loading dataset from disk will ignore other data arguments");
* its own packer (``PackedSupervisedDatasetProcessor`` with ``neat_packing``) writes
  ``input_ids``, ``labels`` (unshifted, -100 on padding), ``position_ids`` (restarting at 0 per
  sequence, 0 on padding) and an ``attention_mask`` holding the 1-based index of each token's
  sequence (0 on padding), every row padded to the same length;
* ``neat_packing: true`` sets ``block_diag_attn``, and ``SFTDataCollatorWith4DAttentionMask``
  turns that index mask into a block-diagonal causal 4-D mask (eager/SDPA), or drops it and lets
  transformers split sequences at the restarted ``position_ids`` (flash-attention 2);
* its collator pads ``input_ids`` and the mask to a multiple of 8 (``pad_to_multiple_of=8`` when
  training) but not ``position_ids``, so rows must already be a multiple of 8 long: the width
  here is ``--max-len`` rounded up to one.

Without ``neat_packing`` the same rows get a plain 2-D mask: every non-zero index means "attend",
the sequences of a row see each other, silently. The recipe says so, and the guard catches it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..layout import IGNORE_INDEX
from ._rows import Rows, fixed_list

PAD_MULTIPLE = 8


def width(max_len: int) -> int:
    return -(-int(max_len) // PAD_MULTIPLE) * PAD_MULTIPLE


def convert(table: pa.Table, context) -> pa.Table:
    """Canonical rows -> LLaMA-Factory neat-packing rows of ``width(context.max_len)`` tokens."""
    w = width(context.max_len)
    rows = Rows(table)
    rows.check_width(w, "LLaMA-Factory")
    pad_id = getattr(context, "pad_token_id", 0) or 0
    columns = {
        "input_ids": fixed_list(rows.fixed(rows.input_ids, w, pad_id, np.int32)),
        "attention_mask": fixed_list(rows.fixed(rows.token_seq + 1, w, 0, np.int32)),
        "position_ids": fixed_list(rows.fixed(rows.token_pos, w, 0, np.int32)),
        "labels": fixed_list(rows.fixed(rows.labels, w, IGNORE_INDEX, np.int32)),
    }
    return pa.table(columns)
