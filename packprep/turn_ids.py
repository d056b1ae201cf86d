"""Step 3c: each trained turn's context as its own ids, where tokenizing the sequence whole would not give them.

The label definition (render.py) is on token ids: turn *k*'s context is
``tokenizer(context, add_special_tokens=False)``, the prompt tokenized on its own as an inference
server tokenizes it, and its target is what the model emits after those ids: the tokens that
tokenizing ``context + target`` adds beyond them, or, where that joint tokenization merges across
the boundary (``<think>\\n`` then ``\\n</think>``: one token ``\\n\\n``), the target tokenized on its own.

A sequence is tokenized whole once (tokenization.py). That no token straddles a trained span's
boundary does not make the ids before it the boundary's own: a pre-tokenizer that looks ahead
(GPT-2's ``\\s+(?!\\S)``, shared by Llama-3 and Qwen2.5) cuts ``"\\n\\n"`` in two before a letter
and keeps it one token at the end of a text. :class:`AddedTokens` proves each boundary instead, from
the one rule every Hugging Face tokenizer keeps: it cuts a text at its added tokens first and
tokenizes each piece between them on its own. So the ids of ``text[:b]`` are the whole's up to the
last added token before ``b``, then that token and the piece after it up to ``b`` tokenized alone;
a boundary next to an added token needs nothing more, any other is checked by tokenizing that short
piece (``"<|im_start|>assistant\\n"``). Where every boundary holds, the sequence's ids are the
definition's and nothing more is done (nearly always). Only a sequence where a boundary does not
hold comes here: each of its turns is tokenized as the definition says, the sequence is the last
turn's context and target ids, and an earlier turn it does not hold id for id gets a sequence of
its own (``exact``), is left untrained (``intact``), or keeps the joint tokenization (``rendered``,
which trains turns as the whole rendering writes them).
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


class AddedTokens:
    """A tokenizer's added tokens, as they prove where a text's ids begin again (the module's rule).

    A token marked ``normalized`` is found after the normalizer has run over the text around it, and
    one marked ``lstrip`` or ``single_word`` takes or looks at the text before it: neither starts a
    piece that is tokenized on its own, so neither proves a boundary (they still end the search for
    the last added token before one)."""

    def __init__(self, tokens: list[dict]):
        self.content = {int(t["id"]): t["content"] for t in tokens}
        self.ids = np.array(sorted(self.content), dtype=np.int64)
        self.restarts = {int(t["id"]) for t in tokens
                         if not (t.get("normalized") or t.get("lstrip") or t.get("single_word"))}

    def unproven(self, text: str, ids: np.ndarray, bounds: list[int], cuts: list[int], markup: bool
                 ) -> list[tuple[int, int, int, int]]:
        """``(a, b, i, j)`` for each boundary ``b`` (``cuts``: the index of the first token at or
        after each, none straddling it) that an added token next to it does not prove: ``text[a:b]``
        must tokenize alone to ``ids[i:j]``. ``a`` is where the last added token before ``b`` starts
        (``i``, its index) where that token restarts the tokenization, else 0: the whole prefix.
        ``markup``: the text's content spells control tokens as text (control_text.py), which the
        search by content could take for the token; its boundaries are checked whole."""
        found = np.zeros(0, np.int64) if markup or not len(self.ids) else np.flatnonzero(np.isin(ids, self.ids))
        out = []
        for b, j in zip(bounds, cuts):
            if b <= 0 or b >= len(text):
                continue
            before = int(found[np.searchsorted(found, j) - 1]) if len(found) and found[0] < j else -1
            after = j < len(ids) and int(ids[j]) in self.restarts and j in found
            if after and text.startswith(self.content[int(ids[j])], b):
                continue  # the piece before the token ends at b in the whole text as in text[:b]
            if before == j - 1 >= 0 and int(ids[before]) in self.restarts and text.endswith(
                    self.content[int(ids[before])], 0, b):
                continue  # text[:b] ends with that token: no piece after it
            if before >= 0 and int(ids[before]) in self.restarts:
                start = text.rfind(self.content[int(ids[before])], 0, b)
                if start >= 0:
                    out.append((start, b, before, j))
                    continue
            out.append((0, b, 0, j))
        return out
