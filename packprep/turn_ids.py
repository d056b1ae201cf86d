"""Step 3c: each trained turn's context as its own ids, where tokenizing the sequence whole would not give them.

The label definition (render.py) is on token ids: turn *k*'s context is
``tokenizer(context, add_special_tokens=False)``, the prompt tokenized on its own as an inference
server tokenizes it, and its target is what the model emits after those ids: the tokens that
tokenizing ``context + target`` adds beyond them, or, where that joint tokenization merges across
the boundary (``<think>\\n`` then ``\\n</think>``: one token ``\\n\\n``), the target tokenized on its own.

A sequence is tokenized whole once (tokenization.py). Where no token straddles any of its trained
spans' boundaries, the ids before each context's end are that context's own ids, and the sequence's
ids are the definition's: nothing more is done (every template on plain text, nearly always). Only
a sequence where a token straddles a boundary comes here: each of its turns is tokenized as the
definition says, the sequence is the last turn's context and target ids, and an earlier turn it
does not hold id for id gets a sequence of its own (``exact``), is left untrained (``intact``), or
keeps the joint tokenization (``rendered``, which trains turns as the whole rendering writes them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .layout import IGNORE_INDEX

Encode = Callable[[list[tuple[int, int]]], list[np.ndarray]]  # ids of text[a:b] for each (a, b), alone


def turn_ids(spans: list[tuple[int, int]], encode: Encode) -> list[tuple[np.ndarray, np.ndarray]]:
    """(context ids, target ids) of each trained span ``(start, end)`` of a text that begins with
    each span's context: the context ``text[:start]`` tokenized alone; the target, the ids that
    ``text[:end]`` adds to them, or ``text[start:end]`` tokenized alone where those do not begin
    with the context's ids."""
    ranges = [r for start, end in spans for r in ((0, start), (0, end))]
    encoded = encode(ranges)
    out = []
    for (start, end), context, whole in zip(spans, encoded[::2], encoded[1::2]):
        if len(whole) >= len(context) and np.array_equal(whole[: len(context)], context):
            out.append((context, whole[len(context):]))
        else:
            out.append((context, encode([(start, end)])[0]))
    return out


def exact_sequences(length: int, spans: list[tuple[int, int]], encode: Encode, policy: str):
    """The sequences (ids, labels) of one rendered sequence ``text`` (``length`` characters, trained
    ``spans``), each turn trained on its own context ids: the last first; and the turns left
    untrained (``intact``) and the turns moved to a sequence of their own (``exact``)."""
    turns = turn_ids(spans, encode)
    left, sequences, untrained, moved = list(range(len(turns))), [], 0, 0
    while left:
        context, target = turns[left[-1]]
        ids = np.concatenate([context, target]).astype(np.int32)
        if spans[left[-1]][1] < length and left[-1] == len(turns) - 1:  # text after the last trained turn
            ids = np.concatenate([ids, encode([(spans[left[-1]][1], length)])[0]]).astype(np.int32)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        held = [k for k in left if _holds(ids, *turns[k])]
        for k in held:
            start = len(turns[k][0])
            labels[start:start + len(turns[k][1])] = ids[start:start + len(turns[k][1])]
        sequences.append((ids, labels))
        left = [k for k in left if k not in held]
        if len(sequences) == 1:
            moved = len(left)
        if policy != "exact":
            untrained = len(left)
            break
    return sequences, untrained, moved


def _holds(ids: np.ndarray, context: np.ndarray, target: np.ndarray) -> bool:
    """Whether ``ids`` begin with the turn's context ids, then its target ids."""
    n = len(context) + len(target)
    return len(ids) >= n and np.array_equal(ids[: len(context)], context) and np.array_equal(ids[len(context):n], target)
