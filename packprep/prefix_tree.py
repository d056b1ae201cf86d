"""Shared-prefix rows: a record's exact sequences merged into one prefix tree of token ids (pure).

``--turn-context exact`` gives every rewritten turn a sequence of its own that repeats the whole
conversation before it. Those sequences share most of their tokens; :func:`build_tree` stores each
shared prefix once, as one packed sequence in depth-first order, with per token:

* ``position_ids``: the token's depth (its position in every flat sequence that holds it);
* ``descendants``: how many of the tokens stored after it lie below it in the tree. Token ``q``
  may attend to token ``k`` iff ``k <= q <= k + descendants[k]`` (``k`` is ``q`` or an ancestor):
  one comparison a pair, which a FlexAttention ``mask_mod`` reads (packprep.training.tree). Rows
  of several trees need nothing more: no interval reaches past its own tree.
* ``labels``: unshifted, as in flat rows. The label of token ``t`` is predicted from the logits of
  token ``t - 1`` (the model's one-token shift), so a branch's first token must be stored right
  after its branch point. The first child of a node follows it; every later child is stored
  behind a **repeated branch-point token**: a copy of the node's last token, at the same
  position, attending to the same ancestors (a sibling of the original, so never to both), with
  label -100. A token whose stored predecessor is not its parent is always such a head or a root,
  and its label is -100 (:func:`check_tree` holds that). Cost: one token a branch.

A token trained in any flat sequence is trained once in the tree: its context (the path to it) is
the same in every sequence that holds it. :func:`paths` gives the flat sequences back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .layout import IGNORE_INDEX


@dataclass
class TreeRow:
    """One record's prefix tree, stored depth first (what a shared-prefix row holds for it)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, unshifted, -100 where not trained, at every root and branch head
    position_ids: np.ndarray  # int32: depth
    descendants: np.ndarray  # int32: tokens after this one that lie in its subtree

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def branches(self) -> int:
        """Repeated branch-point tokens (heads that are not roots)."""
        heads = _heads(self.descendants)
        return int((self.position_ids[heads] > 0).sum())


@dataclass
class _Node:
    ids: np.ndarray
    labels: np.ndarray
    children: list["_Node"] = field(default_factory=list)

    def child(self, token: int) -> "_Node | None":
        return next((c for c in self.children if int(c.ids[0]) == token), None)

    def split(self, at: int) -> None:
        """Keep ``ids[:at]`` here; the rest becomes the only child (holding the old children)."""
        rest = _Node(self.ids[at:], self.labels[at:], self.children)
        self.ids, self.labels, self.children = self.ids[:at], self.labels[:at], [rest]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _merge_labels(node: _Node, labels: np.ndarray, where: str) -> None:
    """A token trained in any sequence that holds it is trained (once) in the tree."""
    mine, theirs = node.labels, labels[: len(node.labels)]
    clash = (mine != IGNORE_INDEX) & (theirs != IGNORE_INDEX) & (mine != theirs)
    if clash.any():  # labels are the token ids where trained: two sequences cannot disagree
        raise ValueError(f"{where}: two sequences label the same token differently")
    node.labels = np.where(mine != IGNORE_INDEX, mine, theirs)


def build_tree(sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> TreeRow:
    """The prefix tree of ``sequences`` ((input_ids, labels) each, unshifted labels) as one
    depth-first row. Children keep the order in which sequences first reach them."""
    root = _Node(np.zeros(0, np.int32), np.zeros(0, np.int32))
    for number, (ids, labels) in enumerate(sequences):
        ids, labels = np.asarray(ids, np.int32), np.asarray(labels, np.int32)
        if len(ids) != len(labels):
            raise ValueError(f"sequence {number}: {len(ids)} ids but {len(labels)} labels")
        node, at = root, 0
        while at < len(ids):
            child = node.child(int(ids[at]))
            if child is None:
                node.children.append(_Node(ids[at:].copy(), labels[at:].copy()))
                break
            same = _common(child.ids, ids[at:])
            if same < len(child.ids):
                child.split(same)
            _merge_labels(child, labels[at : at + same], f"sequence {number}")
            node, at = child, at + same
    return _emit(root)


def build_trees(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int) -> list[TreeRow]:
    """The prefix trees of ``sequences`` in rows of at most ``max_len`` tokens: one tree where it fits;
    else the tree split at branch points, each part holding consecutive sequences (conversation
    order: they share the most) with their common prefix copied, as many as fit. A sequence longer
    than ``max_len`` is a tree of its own, its flat sequence: only it is cut, as flat rows cut it."""
    whole = build_tree(sequences)
    if len(whole) <= max_len or len(sequences) < 2:
        return [whole]
    trees: list[TreeRow] = []
    group: list = []
    tree = whole
    for sequence in sequences:
        grown = build_tree([*group, sequence])
        if group and len(grown) > max_len:
            trees.append(tree)
            group, grown = [], build_tree([sequence])
        group.append(sequence)
        tree = grown
    return [*trees, tree]


def _emit(root: _Node) -> TreeRow:
    ids, labels, positions, ends = [], [], [], []  # lists of arrays, in storage order
    size = 0

    def put(values_ids, values_labels, first_position) -> int:
        nonlocal size
        n = len(values_ids)
        ids.append(values_ids)
        labels.append(values_labels)
        positions.append(np.arange(first_position, first_position + n, dtype=np.int32))
        ends.append(np.zeros(n, np.int64))
        size += n
        return size - n

    def region(node: _Node, depth: int) -> int:
        """Store ``node`` (its tokens from ``depth``) and its subtree; return the last index stored."""
        start = put(node.ids, node.labels, depth)
        chunk, m = len(ends) - 1, len(node.ids)
        last = start + m - 1
        first_end = last
        for n, child in enumerate(node.children):
            if n and m:  # a later child: behind a copy of the branch point, as its sibling
                put(node.ids[-1:], np.full(1, IGNORE_INDEX, np.int32), depth + m - 1)
                head = len(ends) - 1
                ends[head][0] = region(child, depth + m)
            else:
                end = region(child, depth + m)
                if n == 0:
                    first_end = end
        whole = size - 1
        if m:
            ends[chunk][: m - 1] = whole
            ends[chunk][m - 1] = first_end
        return whole

    for child in root.children:  # several roots: sequences that share no first token
        before = size
        region(child, 0)
        labels[_chunk_at(ids, before)][0] = IGNORE_INDEX  # nothing before a root predicts it
    if not ids:
        empty = np.zeros(0, np.int32)
        return TreeRow(empty, empty.copy(), empty.copy(), empty.copy())
    end = np.concatenate(ends)
    return TreeRow(np.concatenate(ids).astype(np.int32), np.concatenate(labels).astype(np.int32),
                   np.concatenate(positions), (end - np.arange(len(end))).astype(np.int32))


def _chunk_at(chunks: list[np.ndarray], index: int) -> int:
    """The chunk that starts at flat ``index`` (a root's)."""
    at = 0
    for n, chunk in enumerate(chunks):
        if at == index:
            return n
        at += len(chunk)
    raise IndexError(index)


def _heads(descendants: np.ndarray) -> np.ndarray:
    """Indices whose stored predecessor is not their parent: roots and repeated branch points."""
    heads = np.flatnonzero(np.concatenate([[0], descendants[:-1]]) == 0) if len(descendants) else np.zeros(0, int)
    return heads


def parents(descendants: Sequence[int]) -> np.ndarray:
    """Each token's parent index in the tree, -1 for a root."""
    desc = np.asarray(descendants, np.int64)
    n = len(desc)
    parent = np.arange(n, dtype=np.int64) - 1
    heads = _heads(desc)
    if len(heads):
        parent[heads] = -1
        end = np.arange(n) + desc
        stack: list[int] = []
        heads_set = set(heads.tolist())
        for i in range(n):  # the nearest open interval that holds a head is its parent
            while stack and end[stack[-1]] < i:
                stack.pop()
            if i in heads_set and stack:
                parent[i] = stack[-1]
            stack.append(i)
    return parent


def check_tree(row: TreeRow) -> str | None:
    """What is wrong with a tree row, or None: intervals that nest, positions that count depth,
    and no label predicted across a branch (the token before a head is not its parent)."""
    n = len(row.input_ids)
    if not (len(row.labels) == len(row.position_ids) == len(row.descendants) == n):
        return "columns of different lengths"
    desc = np.asarray(row.descendants, np.int64)
    index = np.arange(n)
    end = index + desc
    if n and ((desc < 0).any() or (end >= n).any()):
        return "a subtree reaches past the row"
    parent = parents(desc)
    has = parent >= 0
    if (end[has] > end[parent[has]]).any():
        return "subtrees overlap without nesting"
    expected = np.where(has, np.asarray(row.position_ids, np.int64)[np.maximum(parent, 0)] + 1, 0)
    if not np.array_equal(expected, np.asarray(row.position_ids, np.int64)):
        return "position_ids are not each token's depth"
    heads = _heads(desc)
    if (np.asarray(row.labels)[heads] != IGNORE_INDEX).any():
        return "a root or branch head is trained: its label would be predicted from another branch"
    repeated = heads[has[heads]]
    if (np.asarray(row.input_ids)[repeated] != np.asarray(row.input_ids)[parent[repeated] + 1]).any():
        return "a branch head is not a copy of its branch point"
    return None


def paths(row: TreeRow) -> list[tuple[np.ndarray, np.ndarray]]:
    """The flat sequences of the tree's leaves, root to leaf (ids, labels), a repeated branch
    point standing for its original: each flat sequence that ends at a leaf, as it was built."""
    return [(row.input_ids[chain].copy(), row.labels[chain].copy()) for chain in paths_indices(row)]


def bound(sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """What a shared-prefix row may hold at most: the last (whole) rendering, plus each earlier
    sequence's trained tokens once more and a token for its branch."""
    if not sequences:
        return 0
    *earlier, last = sequences
    return len(last[0]) + sum(int((np.asarray(labels) != IGNORE_INDEX).sum()) + 1 for _, labels in earlier)


def locate(row: TreeRow, ids: Sequence[int]) -> np.ndarray:
    """Where each token of the flat sequence ``ids`` sits in the tree: its index, chosen so that
    each token is stored right after the one before it or is the head after a repeated branch
    point (``index[j] - 1`` is then the copy of ``ids[j - 1]``). Raises KeyError if not held."""
    parent = parents(row.descendants)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parent.tolist()):
        children.setdefault(p, []).append(i)
    stored = np.asarray(row.input_ids)
    out, at = [], -1
    for j, token in enumerate(ids):
        options = [c for c in children.get(at, []) if stored[c] == token]
        if j + 1 < len(ids) and len(options) > 1:  # the original and its copies: the one whose child comes next
            options = [c for c in options if any(stored[g] == ids[j + 1] for g in children.get(c, []))] or options
        if not options:
            raise KeyError(f"token {j} of the sequence is not in the tree")
        at = options[0]
        out.append(at)
    return np.array(out, np.int64)


def truncate_tree(positions: np.ndarray, descendants: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The tree columns of a row's first ``max_len`` tokens: a depth-first prefix is a tree, with
    each subtree cut where the row ends."""
    index = np.arange(min(max_len, len(descendants)))
    return positions[:max_len], np.minimum(descendants[:max_len], max_len - 1 - index).astype(np.int32)


def paths_indices(row: TreeRow) -> list[np.ndarray]:
    """Each root-to-leaf path as the stored indices along it (a repeated branch point on its branch's)."""
    parent = parents(row.descendants)
    out = []
    for leaf in np.flatnonzero(np.asarray(row.descendants) == 0).tolist():
        chain = []
        while leaf >= 0:
            chain.append(leaf)
            leaf = int(parent[leaf])
        out.append(np.array(chain[::-1], np.int64))
    return out
