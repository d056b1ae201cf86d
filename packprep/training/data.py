"""``PackedDataset``: map-style access to the packed rows of an output folder, for a DataLoader."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from ..layout import COLUMN_NAMES, TREE_COLUMN, TREE_LAYOUT, ShardReader, list_column, shard_files


class _Shard:
    """One shard's list columns as flat numpy values + offsets (views of a memory map for Arrow)."""

    def __init__(self, reader: ShardReader, columns: Sequence[str]):
        table = reader.read([c for c in columns if c in reader.schema.names])
        self.values: dict[str, np.ndarray] = {}
        self.offsets: dict[str, np.ndarray] = {}
        for name in table.column_names:
            self.values[name], self.offsets[name] = list_column(table, name)

    def row(self, i: int) -> dict[str, np.ndarray]:
        return {name: values[self.offsets[name][i] : self.offsets[name][i + 1]] for name, values in self.values.items()}


class PackedDataset:
    """Map-style dataset over packprep shards: ``ds[i]`` is packed row ``i`` as numpy arrays.

    ``dir_or_files``: an output folder (with ``data/`` and ``packprep.json``: its ``split``, ``train``
    unless ``split="validation"``), a folder of shards, one shard file, or a list of shard files
    (``.parquet`` or Arrow IPC ``.arrow``).
    ``columns``: the list columns to load (default: all canonical ones present). Rows always
    carry canonical names, whatever the folder's layout (``trl``'s ``seq_lengths`` reads as
    ``seq_lens``); a layout that is more than renamed columns is refused. Shards are opened
    lazily, per process, so the dataset is safe to hand to ``DataLoader`` workers.
    """

    def __init__(self, dir_or_files: str | os.PathLike | Sequence[str | os.PathLike], columns: Sequence[str] | None = None,
                 split: str = "train"):
        self.files = shard_files(dir_or_files, split)
        self.columns = tuple(columns) if columns is not None else COLUMN_NAMES
        self.manifest: dict[str, Any] | None = None
        if isinstance(dir_or_files, (str, os.PathLike)) and os.path.isdir(dir_or_files):
            path = os.path.join(os.fspath(dir_or_files), "packprep.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as handle:
                    self.manifest = json.load(handle)
        self.layout = (self.manifest or {}).get("layout")
        if columns is None and self.layout == TREE_LAYOUT.name:  # shared-prefix rows: their own column too
            self.columns += (TREE_COLUMN.name,)
        counts = [self._reader(k).num_rows for k in range(len(self.files))]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._shards: dict[int, _Shard] = {}

    def _reader(self, k: int) -> ShardReader:
        return ShardReader(self.files[k], self.layout)

    @property
    def max_len(self) -> int | None:
        return (self.manifest or {}).get("config", {}).get("max_len")

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
            shard = self._shards[k] = _Shard(self._reader(k), self.columns)
        return shard.row(idx - int(self._starts[k]))

    def seq_lens(self) -> list[np.ndarray]:
        """The ``seq_lens`` of every row, reading only that column of each shard."""
        out = []
        for k in range(len(self.files)):
            values, offsets = list_column(self._reader(k).read(["seq_lens"]), "seq_lens")
            out.extend(values[a:b] for a, b in zip(offsets[:-1], offsets[1:]))
        return out

    # shards are re-opened lazily in each DataLoader worker
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_shards"] = {}
        return state
