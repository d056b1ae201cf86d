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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from .ledger import Ledger
from .fates import DROPPED, EMPTIED, TRUNCATED
from .layout import IGNORE_INDEX, ROW_SCHEMA, tree_row_schema
from .packing import index_dtype
from .plan import cut_cost, overlong_fates
from .prefix_tree import build_trees, truncate_tree
from .parts import Part

RUNNING_BLOCK = 1 << 20  # values summed at a time into int64 (see _running_total)


@dataclass
class TokenStore:
    """All accepted sequences: their offsets in memory (8 bytes a sequence), tokens on disk.

    The tokens stay in the files the encode workers spilled, two flat int32 files a part
    (:class:`TokenSpill`), in part order. Rows are gathered from them with ``pread``, which keeps
    resident memory bounded by one row group (a memory map would not: every page it touches
    counts as resident). Records are spilled in input order, each kept one as one sequence or, where
    a conversation is trained as several (render.py, turn_context exact), as consecutive ones; so a
    sequence's record number is computed from the rejected records and the sequences that continue
    a record alone (:meth:`source_index`), not held for every sequence.
    """

    offsets: np.ndarray  # int64, n + 1: first token of each sequence, over all parts
    skips: np.ndarray  # sorted: rejected[j] - j for each rejected record number, j its rank
    cache_dir: Path
    part_starts: np.ndarray  # int64, parts + 1: first token of each part's files
    repeats: np.ndarray  # sorted int64: the sequences that continue the record of the sequence before them
    tree: bool = False  # shared-prefix rows: each sequence is a record's prefix tree, with TREE_FILES beside

    @classmethod
    def from_spills(cls, cache_dir: Path, spills: list["Spilled"], rejected: np.ndarray) -> "TokenStore":
        """The store of every part's spill, in part order; ``rejected``: the sorted numbers of the
        input records that are not sequences."""
        firsts = np.cumsum([0] + [len(s.lengths) for s in spills])
        repeats = np.concatenate([np.zeros(0, np.int64)] + [s.continued.astype(np.int64) + first
                                                            for s, first in zip(spills, firsts.tolist())])
        offsets = np.zeros(sum(len(s.lengths) for s in spills) + 1, dtype=np.int64)
        at = 0
        for spill in spills:
            _running_total(spill.lengths, offsets[at + 1 : at + 1 + len(spill.lengths)], offsets[at])
            at += len(spill.lengths)
        part_tokens = np.array([s.lengths.sum(dtype=np.int64) for s in spills], dtype=np.int64)
        part_starts = np.concatenate([[0], np.cumsum(part_tokens)]).astype(np.int64)
        skips = (np.asarray(rejected, dtype=np.int64) - np.arange(len(rejected))).astype(index_dtype(len(offsets)))
        return cls(offsets, skips, Path(cache_dir), part_starts, repeats, any(s.tree for s in spills))

    @property
    def lengths(self) -> np.ndarray:
        """Each sequence's length, int32 as the spills count them."""
        lengths = np.empty(len(self), dtype=np.int32)
        np.subtract(self.offsets[1:], self.offsets[:-1], out=lengths, casting="unsafe")
        return lengths

    def source_index(self, items: np.ndarray) -> np.ndarray:
        """The input record (int64) of each sequence in ``items``: its record's first sequence
        among the first sequences (its index less the repeats at or before it), plus the records
        rejected before it (those whose ``skips`` value is at most that)."""
        if len(self.repeats):
            items = items - np.searchsorted(self.repeats, items, side="right")
        return items + np.searchsorted(self.skips, items, side="right")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def gather(self, first_token: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and labels of the pieces ``[first_token, first_token + length)``, concatenated."""
        return self._pread("ids", first_token, lengths), self._pread("labels", first_token, lengths)

    def gather_tree(self, first_token: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions (depth) and descendants of the same pieces (shared-prefix rows)."""
        return tuple(self._pread(column, first_token, lengths) for column in TREE_FILES)

    def _pread(self, column: str, first_token: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        out = np.empty(int(lengths.sum()), dtype=np.int32)
        view = memoryview(out).cast("B")
        parts = np.searchsorted(self.part_starts, first_token, side="right") - 1
        local = (first_token - self.part_starts[parts]) * 4
        fds: dict[int, int] = {}
        try:
            at = 0
            for part, start, length in zip(parts.tolist(), local.tolist(), (lengths.astype(np.int64) * 4).tolist()):
                if part not in fds:
                    fds[part] = os.open(spill_path(self.cache_dir, part, column), os.O_RDONLY)
                got = os.preadv(fds[part], [view[at : at + length]], start)
                if got != length:
                    raise OSError(f"short read from the token cache {spill_path(self.cache_dir, part, column)}")
                at += length
        finally:
            for fd in fds.values():
                os.close(fd)
        return out


def spill_path(cache_dir: Path, part: int, column: str) -> Path:
    return Path(cache_dir) / f"part-{part:06d}.{column}"


TREE_FILES = ("positions", "descendants")  # a shared-prefix spill's two more files


@dataclass
class Spilled:
    """What a part's spill tells the driver: the length of each kept sequence, in input order."""

    lengths: np.ndarray  # int32
    continued: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64: the sequences that continue the record of the one before them
    tree: bool = False  # its sequences are prefix trees, TREE_FILES beside


class TokenSpill:
    """Writes one part's sequences to its two files under ``cache_dir`` (an encode worker's output),
    one or more for each record not rejected, in input order (what :meth:`TokenStore.source_index`
    counts on)."""

    def __init__(self, cache_dir: Path, part: int, tree: bool = False):
        self._lengths = array("i")  # 4 bytes a sequence, not a Python int object each
        self._continued = array("q")
        self.tree = tree
        columns = ("ids", "labels", *(TREE_FILES if tree else ()))
        self._files = tuple(open(spill_path(cache_dir, part, column), "wb") for column in columns)

    def append(self, input_ids: np.ndarray, labels: np.ndarray, continues: bool = False, *tree: np.ndarray) -> None:
        """Spill a sequence; ``continues``: of the same record as the one before it; ``tree``: its
        positions and descendants (shared-prefix rows)."""
        if continues:
            self._continued.append(len(self._lengths))
        for handle, values in zip(self._files, (input_ids, labels, *tree)):
            handle.write(np.ascontiguousarray(values, dtype=np.int32).tobytes())
        self._lengths.append(len(input_ids))

    def finish(self) -> Spilled:
        for handle in self._files:
            handle.close()
        return Spilled(np.frombuffer(self._lengths, dtype=np.int32).copy(),
                       np.frombuffer(self._continued, dtype=np.int64).copy(), self.tree)


@dataclass
class Segments:
    """The flat piece list of a set of bins: bin b holds pieces ``offsets[b]:offsets[b+1]``.
    8 bytes a piece (int32 item and length, as the packer gives them); ``start`` only where
    sequences were cut into pieces."""

    item: np.ndarray  # int32 (int64 past 2**31 sequences), index into the TokenStore
    start: np.ndarray | None  # first token of the piece within its sequence; None: every piece is whole
    length: np.ndarray  # int32
    offsets: np.ndarray  # int64, n_bins + 1

    def row_lengths(self) -> np.ndarray:
        totals = np.zeros(len(self.length) + 1, dtype=np.int64)
        _running_total(self.length, totals[1:])
        return totals[self.offsets[1:]] - totals[self.offsets[:-1]]

    def select(self, first_bin: int, last_bin: int) -> "Segments":
        lo, hi = self.offsets[first_bin], self.offsets[last_bin]
        return Segments(self.item[lo:hi], None if self.start is None else self.start[lo:hi], self.length[lo:hi],
                        self.offsets[first_bin : last_bin + 1] - lo)


def _running_total(lengths: np.ndarray, out: np.ndarray, before: int = 0) -> None:
    """``out[i] = before + lengths[: i + 1].sum()`` in ``out``'s int64, a block at a time: a cumsum of
    int32 into int64 first casts every value, 8 bytes a sequence more than the result."""
    for lo in range(0, len(lengths), RUNNING_BLOCK):
        block = out[lo : lo + RUNNING_BLOCK]
        np.cumsum(lengths[lo : lo + RUNNING_BLOCK], out=block)
        block += before
        before = block[-1]


def materialize(store: TokenStore, segments: Segments) -> pa.Table:
    """Gather the tokens of ``segments`` from ``store`` into a table of packed rows."""
    lengths = segments.length
    total = int(lengths.sum())
    piece_first = np.cumsum(lengths) - lengths  # offset of each piece inside the flat output
    position = np.arange(total, dtype=np.int32)  # int32 throughout: a row group's arrays are its writer's memory
    position -= np.repeat(piece_first.astype(np.int32), lengths)

    first_token = store.offsets[segments.item]
    if segments.start is not None:
        first_token += segments.start
    input_ids, labels = store.gather(first_token, lengths)
    labels[piece_first[lengths > 0]] = IGNORE_INDEX  # first label of every packed sequence

    token_offsets = np.concatenate([[0], np.cumsum(lengths)])[segments.offsets].astype(np.int32)
    piece_offsets = segments.offsets.astype(np.int32)

    def lists(offsets, values, value_type):
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))

    tree = []
    if store.tree:  # shared-prefix rows: depth as position; pieces are whole trees (no --overlong split)
        position, descendants = store.gather_tree(first_token, lengths)
        tree = [lists(token_offsets, descendants, pa.int32())]
    return pa.Table.from_arrays(
        [
            lists(token_offsets, input_ids, pa.int32()),
            lists(token_offsets, labels, pa.int32()),
            lists(token_offsets, position, pa.int32()),
            lists(piece_offsets, lengths.astype(np.int32), pa.int32()),
            lists(piece_offsets, store.source_index(segments.item), pa.int64()),
            *tree,
        ],
        schema=tree_row_schema() if store.tree else ROW_SCHEMA,
    )


class PackSink:
    """pack's encode sink, run in the workers: apply the ``--overlong`` rule to each encoded record,
    in input order, and spill what stays to the part's token files; what ``--max-len`` cost the
    records is counted in the ledger (``plan.cut_cost``). ``pieces``: the planner cuts sequences
    longer than ``max_len`` into pieces (``--overlong split`` with a strategy whose rows must fit)."""

    def __init__(self, cache_dir, max_len: int, overlong: str, part: Part, shared_prefix: bool = False,
                 pieces: bool = False):
        self.max_len, self.overlong, self.shared_prefix, self.pieces = max_len, overlong, shared_prefix, pieces
        self.spill = TokenSpill(cache_dir, part.number, shared_prefix)

    def _sequences(self, item) -> list:
        """A record's sequences: as encoded, or (``shared_prefix``) its prefix trees, split at branch
        points into trees that fit ``max_len`` where one does not (``prefix_tree.build_trees``)."""
        if not self.shared_prefix:
            return item.sequences
        return [(tree.input_ids, tree.labels, tree.position_ids, tree.descendants)
                for tree in build_trees(item.sequences, self.max_len)]

    def take(self, batch, ledger: Ledger) -> int:
        kept = [(number, record, conversation, item) for number, record, conversation, item in batch
                if ledger.accept(record, number, item) is not None]
        # a record may be several sequences (render.py, turn_context exact): --overlong applies to each
        sequences = [(at, ids, labels, *tree) for at, (*_, item) in enumerate(kept)
                     for ids, labels, *tree in self._sequences(item)]
        fates = self._fates(sequences)
        tokens = 0
        for at, (number, record, conversation, item) in enumerate(kept):
            mine = [(fate, ids, labels, *tree) for fate, (owner, ids, labels, *tree) in zip(fates, sequences)
                    if owner == at]
            longest = max(len(ids) for _, ids, *_ in mine)
            if any(fate == DROPPED for fate, *_ in mine):
                reason = f"{longest} tokens, longer than --max-len {self.max_len} (--overlong drop)"
                ledger.reject(record, number, reason, "overlong")
                continue
            self._count_cuts(mine, ledger)
            whole = [m for m in mine if m[0] != EMPTIED]
            if not whole:
                reason = f"{longest} tokens; no supervised token is left after truncation to --max-len {self.max_len}"
                ledger.reject(record, number, reason, "overlong")
                continue
            ledger.keep(conversation, item)
            if len(whole) < len(mine) or any(fate == TRUNCATED for fate, *_ in whole):
                ledger.status[number] = TRUNCATED  # cut, or a sequence of it left out: not packed whole
            for n, (fate, ids, labels, *tree) in enumerate(whole):
                if fate == TRUNCATED:  # a tree is cut only where it is one sequence (build_trees)
                    ids, labels = ids[: self.max_len], labels[: self.max_len]
                    tree = truncate_tree(*tree, self.max_len) if tree else tree
                self.spill.append(ids, labels, n > 0, *tree)
                tokens += len(ids)
        return tokens

    def _count_cuts(self, mine, ledger: Ledger) -> None:
        """Count the turns and supervised tokens ``--max-len`` leaves untrained in a record's sequences."""
        for fate, _, labels, *_ in mine:
            if fate in (TRUNCATED, EMPTIED) or self.pieces:
                turns, supervised = cut_cost(labels, self.max_len, pieces=fate not in (TRUNCATED, EMPTIED))
                ledger.cut.update(turns_cut=turns, supervised_cut=supervised)

    def _fates(self, sequences) -> list[int]:
        """The ``--overlong`` fate of each sequence (plan.overlong_fates)."""
        max_len = self.max_len
        lengths = np.array([len(ids) for _, ids, *_ in sequences], np.int64)
        within = None
        if self.overlong == "truncate" and (lengths > max_len).any():
            within = [int((labels[1:max_len] != IGNORE_INDEX).sum()) if n > max_len else 1
                      for (_, _, labels, *_), n in zip(sequences, lengths.tolist())]
        return overlong_fates(lengths, max_len, self.overlong, within).tolist()

    def finish(self):
        return self.spill.finish()
