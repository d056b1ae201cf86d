"""A conversation with images encoded as inference sees it: rendered, every image's placeholder expanded
into the processor's text for that image, tokenized, each assistant turn trained in its context.

The text path's machinery does the rendering and the labels (tokenization.ChatEncoder: every turn in
its inference context, sequences of their own where a template rewrites earlier turns); this step
only loads the images, asks the processor what each becomes (processor.ImageTokens) and rewrites the
rendered text between rendering and tokenizing (``ChatEncoder.encode(..., expand=)``), the way the
processor rewrites a rendered prompt. Each sequence then holds a prefix of the record's images, whose
tokens are found in order; image tokens are never trained.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field, replace
from itertools import accumulate

import numpy as np

from ..errors import Rejected
from ..layout import IGNORE_INDEX
from ..normalize import Conversation
from ..render import Rendered
from ..tokenization import ChatEncoder, Encoded
from .images import ImageFile, named, open_image, resolve
from .processor import Expansion, ImageTokens
from .records import MARK, as_parts


@dataclass
class Prepared:
    """A conversation with image parts, its images read and checked, and their expansions."""

    conversation: Conversation
    files: list[ImageFile]
    expansions: list[Expansion]


@dataclass
class VisionSequence:
    input_ids: np.ndarray
    labels: np.ndarray
    images: list[tuple[int, int, int]]  # (offset of its first image token, image tokens, image number)


@dataclass
class VisionRecord:
    sequences: list[VisionSequence]  # conversation order: the last holds every image
    files: list[ImageFile]
    expansions: list[Expansion]
    encoded: Encoded = field(repr=False, default=None)


def prepare(conversation: Conversation, references: list, base_dir: str, tokens: ImageTokens) -> Prepared:
    """Read and check each image, ask the processor about it; Rejected naming the first bad image."""
    files, expansions = [], []
    for number, reference in enumerate(references):
        try:
            image_file = resolve(reference, base_dir)
            picture = open_image(image_file)
            expansions.append(tokens.expansion(picture))
        except Rejected as exc:
            raise named(number, exc) from None
        files.append(image_file)
    for message in conversation.messages:
        text = message.get("content")
        if isinstance(text, str) and tokens.placeholder in text.replace(MARK, ""):
            raise Rejected(f"a message spells the image placeholder {tokens.placeholder!r} as text: the processor "
                           "would take it for an image", "image_placeholder_in_text")
    return Prepared(as_parts(conversation, len(references)), files, expansions)


def expand(rendered: Rendered, prepared: Prepared, placeholder: str, last: bool) -> Rendered:
    """``rendered`` with its k-th placeholder replaced by image k's expansion, spans moved with the text."""
    pieces = rendered.text.split(placeholder)
    images = len(pieces) - 1
    if images > len(prepared.expansions) or (last and images != len(prepared.expansions)):
        raise Rejected(f"the chat template wrote {images} image placeholder(s) for the record's "
                       f"{len(prepared.expansions)} image(s) (it drops images in some messages)", "image_count_mismatch")
    if not images:
        return rendered
    text, places, at = [], [], 0  # places: where each placeholder starts in the rendering
    for k, piece in enumerate(pieces):
        text.append(piece)
        at += len(piece)
        if k < images:
            text.append(prepared.expansions[k].text)
            places.append(at)
            at += len(placeholder)
    for start, stop in rendered.spans:
        if any(start <= p < stop for p in places):
            raise Rejected("an image lies inside a trained turn: images are inputs, never trained",
                           "image_in_assistant_turn")
    grown = list(accumulate(len(e.text) - len(placeholder) for e in prepared.expansions[:images]))

    def moved(c: int) -> int:
        k = bisect_left(places, c)  # placeholders before character c
        return c + (grown[k - 1] if k else 0)

    markup = None if rendered.markup is None else [(moved(a), moved(b)) for a, b in rendered.markup]
    return replace(rendered, text="".join(text), spans=[(moved(a), moved(b)) for a, b in rendered.spans],
                   markup=markup, earlier=[])


class VisionEncoder:
    """``encode(batch)``: the text path's encoder with the processor's expansion in between."""

    def __init__(self, encoder: ChatEncoder, tokens: ImageTokens):
        self.encoder, self.tokens = encoder, tokens

    def encode(self, batch: list[Prepared]) -> list[VisionRecord | Rejected]:
        def expanded(position: int, rendered: Rendered) -> Rendered:
            prepared = batch[position]
            earlier = [expand(r, prepared, self.tokens.placeholder, False) for r in rendered.earlier]
            return replace(expand(rendered, prepared, self.tokens.placeholder, True), earlier=earlier)

        results = self.encoder.encode([p.conversation for p in batch], expand=expanded)
        return [r if isinstance(r, Rejected) else self._located(r, p) for r, p in zip(results, batch)]

    def _located(self, encoded: Encoded, prepared: Prepared) -> VisionRecord | Rejected:
        """Each sequence's images found in its tokens, in order; their tokens never trained."""
        sequences = []
        for ids, labels in encoded.sequences:
            is_image = np.isin(ids, self.tokens.token_ids)
            positions = np.flatnonzero(is_image)
            labels = np.where(is_image, IGNORE_INDEX, labels).astype(np.int32)
            images, used = [], 0
            for number, expansion in enumerate(prepared.expansions):
                if used == len(positions):
                    break
                if used + expansion.tokens > len(positions):
                    return Rejected(f"image {number}: {len(positions) - used} of its {expansion.tokens} image tokens "
                                    "are in the tokens (the tokenizer does not keep the processor's image tokens whole)",
                                    "image_tokens_mismatch")
                images.append((int(positions[used]), expansion.tokens, number))
                used += expansion.tokens
            if used != len(positions):
                return Rejected(f"{len(positions)} image tokens for images that make {used}", "image_tokens_mismatch")
            sequences.append(VisionSequence(ids, labels, images))
        return VisionRecord(sequences, prepared.files, prepared.expansions, encoded)
