"""Step 5: turn bins of (sample, start, length) pieces into packed rows.

This is where the two isolation guarantees are made, in one vectorised place:

* ``position_ids`` restart at 0 at every packed sequence, so a varlen attention kernel (or
  transformers' packed-sequence detection) never lets a token attend across a boundary;
* the first label of every packed sequence is ``-100``, so after the model's one-token shift no
  label asks it to predict sequence B's first token from sequence A's last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .tokenize import IGNORE_INDEX

ROW_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32())),
        pa.field("labels", pa.list_(pa.int32())),
        pa.field("position_ids", pa.list_(pa.int32())),
        pa.field("seq_lens", pa.list_(pa.int32())),
        pa.field("source_index", pa.list_(pa.int64())),
    ]
)


@dataclass
class TokenStore:
    """All accepted sequences as flat arrays (CSR): compact, and sliceable without copies."""

    input_ids: np.ndarray  # int32, all sequences concatenated
    labels: np.ndarray  # int32
    offsets: np.ndarray  # int64, n + 1
    source_index: np.ndarray  # int64, input record of each sequence

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.source_index)


@dataclass
class TokenStoreBuilder:
    """Collects encoded sequences chunk by chunk, then freezes them into a TokenStore."""

    _ids: list = field(default_factory=list)
    _labels: list = field(default_factory=list)
    _lengths: list = field(default_factory=list)
    _sources: list = field(default_factory=list)

    def append(self, input_ids: np.ndarray, labels: np.ndarray, source_index: int) -> None:
        self._ids.append(input_ids)
        self._labels.append(labels)
        self._lengths.append(len(input_ids))
        self._sources.append(source_index)

    def build(self) -> TokenStore:
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        concat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int32)  # noqa: E731
        return TokenStore(
            concat(self._ids).astype(np.int32, copy=False),
            concat(self._labels).astype(np.int32, copy=False),
            offsets,
            np.asarray(self._sources, dtype=np.int64),
        )


@dataclass
class Segments:
    """The flat piece list of a set of bins: bin b holds pieces ``offsets[b]:offsets[b+1]``."""

    item: np.ndarray  # int64, index into the TokenStore
    start: np.ndarray  # int64, first token of the piece within its sequence
    length: np.ndarray  # int64
    offsets: np.ndarray  # int64, n_bins + 1

    def row_lengths(self) -> np.ndarray:
        totals = np.concatenate([[0], np.cumsum(self.length)])
        return totals[self.offsets[1:]] - totals[self.offsets[:-1]]

    def select(self, first_bin: int, last_bin: int) -> "Segments":
        lo, hi = self.offsets[first_bin], self.offsets[last_bin]
        return Segments(
            self.item[lo:hi], self.start[lo:hi], self.length[lo:hi], self.offsets[first_bin : last_bin + 1] - lo
        )


def materialize(store: TokenStore, segments: Segments) -> pa.Table:
    """Gather the tokens of ``segments`` from ``store`` into a table of packed rows."""
    lengths = segments.length
    total = int(lengths.sum())
    piece_first = np.cumsum(lengths) - lengths  # offset of each piece inside the flat output
    position = np.arange(total, dtype=np.int64) - np.repeat(piece_first, lengths)
    gather = np.repeat(store.offsets[segments.item] + segments.start, lengths) + position

    input_ids = store.input_ids[gather]
    labels = store.labels[gather]
    labels[piece_first[lengths > 0]] = IGNORE_INDEX  # first label of every packed sequence

    token_offsets = np.concatenate([[0], np.cumsum(lengths)])[segments.offsets].astype(np.int32)
    piece_offsets = segments.offsets.astype(np.int32)

    def lists(offsets, values, value_type):
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))

    return pa.Table.from_arrays(
        [
            lists(token_offsets, input_ids, pa.int32()),
            lists(token_offsets, labels, pa.int32()),
            lists(token_offsets, position.astype(np.int32), pa.int32()),
            lists(piece_offsets, lengths.astype(np.int32), pa.int32()),
            lists(piece_offsets, store.source_index[segments.item], pa.int64()),
        ],
        schema=ROW_SCHEMA,
    )
