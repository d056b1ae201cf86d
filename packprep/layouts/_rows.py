"""Vectorised helpers the stack adapters share: canonical list columns in, fixed-width columns out.

Canonical rows are unpadded and carry ``seq_lens``; several stacks stack rows into a
``(batch, max_len)`` tensor without a collator of their own, so their layouts pad every row to one
width. These helpers do that once, in numpy, for a whole row group.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..layout import list_column


class Rows:
    """The canonical columns of one row group, flat, with per-token row and sequence coordinates."""

    def __init__(self, table: pa.Table):
        self.input_ids, self.offsets = list_column(table, "input_ids")
        self.labels, _ = list_column(table, "labels")
        self.seq_lens, self.seq_offsets = list_column(table, "seq_lens")
        self.num_rows = len(self.offsets) - 1
        self.row_lens = np.diff(self.offsets)
        seq_lens = self.seq_lens.astype(np.int64)
        # sequence k of the whole group starts at token seq_starts[k] (flat coordinates)
        self.seq_starts = np.cumsum(seq_lens) - seq_lens
        self.seqs_per_row = np.diff(self.seq_offsets)
        # per token: its sequence's number within its row, from 0
        seq_rank = np.arange(len(seq_lens)) - np.repeat(self.seq_offsets[:-1], self.seqs_per_row)
        self.token_seq = np.repeat(seq_rank, seq_lens)
        # per token: its position within its sequence
        self.token_pos = np.arange(len(self.input_ids)) - np.repeat(self.seq_starts, seq_lens)

    def check_width(self, width: int, stack: str) -> None:
        """Refuse rows longer than the fixed width a stack stacks them at."""
        if self.num_rows and self.row_lens.max() > width:
            raise ValueError(
                f"{stack} stacks rows of {width} tokens, but a row holds {int(self.row_lens.max())} (strategy "
                "minibatch makes such rows); pack with a strategy that respects --max-len"
            )

    def fixed(self, flat: np.ndarray, width: int, fill, dtype) -> np.ndarray:
        """Scatter a per-token array into ``(num_rows, width)``, the tail filled with ``fill``."""
        self.check_width(width, "this layout")
        out = np.full((self.num_rows, width), fill, dtype=dtype)
        rows = np.repeat(np.arange(self.num_rows), self.row_lens)
        cols = np.arange(len(flat)) - np.repeat(self.offsets[:-1], self.row_lens)
        out[rows, cols] = flat
        return out


def fixed_list(matrix: np.ndarray, value_type: pa.DataType = pa.int32()) -> pa.ListArray:
    """A ``(rows, width)`` matrix as a list column (one list per row)."""
    rows, width = matrix.shape
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width, pa.int32())
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1), value_type))


def ragged_list(values: np.ndarray, offsets: np.ndarray, value_type: pa.DataType = pa.int32()) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32), pa.int32()), pa.array(values, value_type))
