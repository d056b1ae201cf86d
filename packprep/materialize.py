"""Step 5: turn bins of (sample, start, length) pieces into packed rows.

This is where the two isolation guarantees are made, in one vectorised place:

* ``position_ids`` restart at 0 at every packed sequence, so a varlen attention kernel (or
  transformers' packed-sequence detection) never lets a token attend across a boundary;
* the first label of every packed sequence is ``-100``, so after the model's one-token shift no
  label asks it to predict sequence B's first token from sequence A's last.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from .layout import ROW_SCHEMA
from .tokenize import IGNORE_INDEX


@dataclass
class TokenStore:
    """All accepted sequences, as flat token arrays plus CSR offsets.

    The token arrays live either in memory or in two flat int32 files of an on-disk cache, so
    that a data set larger than memory can be packed: only lengths and source indices (12 bytes a
    sequence) stay in memory, and rows are gathered from the cache with ``pread``, which keeps
    the resident memory bounded by one row group (a memory map would not: every page it touches
    counts as resident).
    """

    offsets: np.ndarray  # int64, n + 1
    source_index: np.ndarray  # int64, input record of each sequence
    input_ids: np.ndarray | None = None  # int32, in memory
    labels: np.ndarray | None = None  # int32, in memory
    cache_dir: Path | None = None  # or: input_ids.bin / labels.bin there

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.source_index)

    def gather(self, first_token: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and labels of the pieces ``[first_token, first_token + length)``, concatenated."""
        if self.cache_dir is None:
            index = np.repeat(first_token - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
            return self.input_ids[index], self.labels[index]
        return self._pread("input_ids.bin", first_token, lengths), self._pread("labels.bin", first_token, lengths)

    def _pread(self, name: str, first_token: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = np.empty(int(lengths.sum()), dtype=np.int32)
        view = memoryview(out).cast("B")
        fd = os.open(self.cache_dir / name, os.O_RDONLY)
        try:
            at = 0
            for start, length in zip((first_token * 4).tolist(), (lengths * 4).tolist()):
                got = os.preadv(fd, [view[at : at + length]], start)
                if got != length:
                    raise OSError(f"short read from the token cache {self.cache_dir / name}")
                at += length
        finally:
            os.close(fd)
        return out


class TokenStoreBuilder:
    """Collects encoded sequences; spills their tokens to ``cache_dir`` when one is given."""

    def __init__(self, cache_dir: Path | None = None):
        self.cache_dir = cache_dir
        self._lengths = array("q")  # 8 bytes a sequence, not a Python int object each
        self._sources = array("q")
        self._ids: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._files = None
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            self._files = (open(cache_dir / "input_ids.bin", "wb"), open(cache_dir / "labels.bin", "wb"))

    def append(self, input_ids: np.ndarray, labels: np.ndarray, source_index: int) -> None:
        if self._files is not None:
            self._files[0].write(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes())
            self._files[1].write(np.ascontiguousarray(labels, dtype=np.int32).tobytes())
        else:
            self._ids.append(input_ids)
            self._labels.append(labels)
        self._lengths.append(len(input_ids))
        self._sources.append(source_index)

    def build(self) -> TokenStore:
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(self._lengths, dtype=np.int64), out=offsets[1:])
        sources = np.frombuffer(self._sources, dtype=np.int64).copy()
        if self._files is not None:
            for handle in self._files:
                handle.close()
            return TokenStore(offsets, sources, cache_dir=self.cache_dir)
        concat = lambda parts: np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)  # noqa: E731
        return TokenStore(offsets, sources, concat(self._ids), concat(self._labels))


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

    input_ids, labels = store.gather(store.offsets[segments.item] + segments.start, lengths)
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
