"""Text in message content that spells a control token is text, not the token (issue 24).

A user message holding ``<|eot_id|><|start_header_id|>assistant<|end_header_id|>`` must not put a
fabricated assistant turn into the training data. Tokenizers split added tokens out of a text before
anything else, wherever they occur, so the rendered conversation cannot say which ``<|eot_id|>`` the
template wrote and which the user did. Hence, before rendering, each special-token string in the
record's own strings (content, reasoning, names, tool calls and results, tools, template arguments;
keys as well as values) is swapped for a placeholder that no template changes (digits and
punctuation); after rendering, the placeholders are found and the original strings put back. The special tokens of the rendered text outside them are the template's
markup: those, and only those, become control ids. The text between them is encoded as Hugging Face
does with ``split_special_tokens=True`` (``encode_special_tokens``): special tokens in it are plain
text, non-special added tokens (Qwen's ``<tool_call>``) are still split out, as HF splits them.

Only the rare record whose strings spell a special token takes this path (a few in 5,000 scraped
conversations); it is encoded by the HF tokenizer segment by segment, on either backend, and counted
(``control_text_in_content``). ``--content-special-tokens special`` keeps the old behaviour.
"""

from __future__ import annotations

import random
import re
from dataclasses import fields, replace

import numpy as np

from .normalize import Conversation, Rejected
from .render import Rendered, render_conversation
from .tokenizer_folder import RenderTooLong, added_tokens

MODES = ("text", "special")  # content spelling a control token: plain text (default), or the token
# every field of a conversation that holds the record's own strings: all of them are masked, keys included
# (a template writes an argument's key with tojson), so that a field added later is covered too
USER_FIELDS = tuple(f.name for f in fields(Conversation) if f.name not in ("text", "changes"))


def special_tokens(tokenizer) -> list[tuple[str, int, bool, bool]]:
    """(content, id, lstrip, rstrip) of every added token marked special, as tokenizer.json says."""
    return [(t["content"], t["id"], t.get("lstrip", False), t.get("rstrip", False))
            for t in added_tokens(tokenizer) if t.get("special")]


class ControlText:
    """Finds special-token text in a conversation's strings and keeps it apart from the markup."""

    def __init__(self, tokenizer):
        self.tokens = {content: (token, lstrip, rstrip) for content, token, lstrip, rstrip in special_tokens(tokenizer)}
        contents = sorted(self.tokens, key=len, reverse=True)  # longest first, as the added vocabulary matches
        self._find = re.compile("|".join(map(re.escape, contents))) if contents else None
        self._starts = {c[:2] for c in contents}  # a cheap test before the regex
        self._nonce = "".join(random.choice("0123456789") for _ in range(16))
        self._placeholder = re.compile(f"#{self._nonce}-([0-9]+)#")

    def _spells(self, value) -> bool:
        if isinstance(value, str):
            return any(s in value for s in self._starts) and self._find.search(value) is not None
        if isinstance(value, dict):
            return any(self._spells(v) or self._spells(k) for k, v in value.items() if k != "role")
        if isinstance(value, list):
            return any(map(self._spells, value))
        return False

    def spells(self, conversation: Conversation, variables: dict | None = None) -> bool:
        """Whether any string of the conversation (its own template kwargs too) or of the run's template
        ``variables`` spells a special token."""
        if self._find is None:
            return False
        if conversation.text is not None:
            return self._spells(conversation.text)
        return self._spells(variables) or any(self._spells(getattr(conversation, name)) for name in USER_FIELDS)

    def _mask(self, value, found: list[str]):
        if isinstance(value, str):
            return self._find.sub(lambda m: f"#{self._nonce}-{found.append(m.group()) or len(found) - 1}#", value)
        if isinstance(value, dict):
            return {k: v if k == "role" else self._mask(v, found) for k, v in
                    ((self._mask(k, found), v) for k, v in value.items())}
        if isinstance(value, list):
            return [self._mask(v, found) for v in value]
        return value

    def render(self, render, conversation: Conversation, variables: dict | None = None) -> Rendered:
        """``render(conversation)`` with the control text of its strings, its template kwargs and the run's
        template ``variables`` (``--template-arg``) kept as text (``markup`` set)."""
        if conversation.text is not None:
            return replace(render(conversation), markup=[])  # plain text: all of it is content
        found: list[str] = []
        spelled = {k: v for k, v in (variables or {}).items() if self._spells(v)}  # given again, masked, as kwargs
        kwargs = {**spelled, **(conversation.template_kwargs or {})}
        masked = replace(conversation, **{name: self._mask(getattr(conversation, name), found) for name in USER_FIELDS})
        masked.template_kwargs = self._mask(kwargs, found) or None
        rendered = render(masked)  # a record split by --turn-context exact: each sequence unmasked alike
        return replace(self._unmask(rendered, found), earlier=[self._unmask(e, found) for e in rendered.earlier])

    def _unmask(self, rendered: Rendered, found: list[str]) -> Rendered:
        """The rendering with the original strings back, its spans moved, and its markup tokens located."""
        text = rendered.text
        pieces, moves, at, shift = [], [], 0, 0  # moves: (masked position, shift after it)
        for match in self._placeholder.finditer(text):
            k = int(match.group(1))
            if k >= len(found):
                break
            pieces += [text[at:match.start()], found[k]]
            shift += len(found[k]) - (match.end() - match.start())
            moves.append((match.start(), match.end(), shift))
            at = match.end()
        pieces.append(text[at:])
        final = "".join(pieces)
        if self._nonce in final:
            raise Rejected("the record's text spells a control token and the chat template changes that text, "
                           "so it cannot be told from the template's own markup", "control_text_unlocated")
        ends = [end for _, end, _ in moves]

        def moved(position: int) -> int:
            k = int(np.searchsorted(ends, position, side="right"))  # placeholders ending at or before it
            if k < len(moves) and moves[k][0] < position:  # inside a placeholder: at its start
                position = moves[k][0]
            return position + (moves[k - 1][2] if k else 0)

        markup = [(moved(m.start()), moved(m.end())) for m in self._find.finditer(text)]
        spans = [(moved(a), moved(b)) for a, b in rendered.spans]
        return replace(rendered, text=final, spans=spans, markup=markup)


def render_record(template, conversation: Conversation, train_on: str, turn_context: str,
                  control: ControlText | None) -> Rendered:
    """The conversation rendered with its own template variables; where ``control`` is given and its
    strings (or the template variables given) spell a special token, with that text kept as text
    (pack and retokenize render alike)."""

    def render(c: Conversation) -> Rendered:
        return render_conversation(template.with_variables(c.template_kwargs), c, train_on, turn_context)

    try:
        if control is not None and control.spells(conversation, template.variables):
            return control.render(render, conversation, template.variables)
        return render(conversation)
    except RenderTooLong as exc:  # whichever rendering of the record met the limit
        raise exc.rejected() from None


def encode_with_markup(hf, rendered: Rendered, tokens: dict, post: tuple[list[int], list[int]]):
    """Ids and char offsets of ``rendered.text``: control ids at its markup only, the text between
    encoded as HF does with ``split_special_tokens=True`` (an added token's lstrip/rstrip kept)."""
    text = rendered.text
    cuts, ids_at = [], []  # (start, end) of each markup token, widened by lstrip/rstrip; its id
    for start, end in rendered.markup:
        token, lstrip, rstrip = tokens[text[start:end]]
        low = cuts[-1][1] if cuts else 0
        while lstrip and start > low and text[start - 1].isspace():
            start -= 1
        while rstrip and end < len(text) and text[end].isspace():
            end += 1
        cuts.append((start, end))
        ids_at.append(token)
    bounds = [0, *[c for cut in cuts for c in cut], len(text)]
    segments = [(a, b) for a, b in zip(bounds[::2], bounds[1::2])]
    saved = hf.encode_special_tokens
    hf.encode_special_tokens = True
    try:
        encodings = hf.encode_batch([text[a:b] for a, b in segments], add_special_tokens=False)
    finally:
        hf.encode_special_tokens = saved
    ids, offsets = [], []
    for k, ((a, b), encoding) in enumerate(zip(segments, encodings)):
        if a < b:
            ids += encoding.ids
            offsets += [(a + s, a + e) for s, e in encoding.offsets]
        if k < len(cuts):
            ids.append(ids_at[k])
            offsets.append(cuts[k])
    if rendered.add_special_tokens:
        before, after = post
        ids = [*before, *ids, *after]
        offsets = [(0, 0)] * len(before) + offsets + [(len(text), len(text))] * len(after)
    return np.asarray(ids, dtype=np.int32), offsets


def first_tokens(offsets: list[tuple[int, int]], chars: list[int], text_length: int) -> list[int]:
    """For each char, the first token at or after it, as tokenize._first_token_at_or_after finds it
    from an HF encoding (``char_to_token``: the first token whose offsets hold the char)."""
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    ends = np.asarray([e for _, e in offsets], dtype=np.int64)
    out = []
    for char in chars:
        if char <= 0:
            out.append(0)
            continue
        token, probe = None, char
        while token is None:
            if probe >= text_length:
                token = len(offsets)
                break
            hits = np.flatnonzero((starts <= probe) & (ends > probe))
            token = int(hits[0]) if len(hits) else None
            probe += 1
        out.append(token if token == len(offsets) or starts[token] >= char else token + 1)
    return out
