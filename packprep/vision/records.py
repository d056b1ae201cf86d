"""The shapes people write images in, read into a conversation whose messages carry image parts.

OpenAI content parts (``{"type": "image_url", "image_url": {"url": ...}}``, ``{"type": "image",
"image"|"url"|"path": ...}``, or a bare ``{"type": "image"}`` taking the next of the record's
``images``), ShareGPT/LLaVA ``<image>`` placeholders with an ``images`` list (or one ``image``), and
the same fields holding a datasets ``Image`` column's ``{"bytes", "path"}``. Each image becomes a
marker in the text, so that normalize.py fits the conversation exactly as it fits text (merges,
system folding, roles); then each message's content becomes the list of text and image parts that the
processors' chat templates render (``as_parts``).
"""

from __future__ import annotations

from typing import Any

from ..errors import Rejected
from ..normalize import IMAGE_FIELDS, Conversation, record_images

MARK = "\ue000packprep-image\ue001"  # private-use characters: no tokenizer input holds them by chance
PLACEHOLDER = "<image>"  # LLaVA / ShareGPT
def extract(record: dict) -> tuple[dict, list]:
    """``record`` with each image replaced by :data:`MARK` in its text, and the image references in
    order; Rejected when placeholders and images do not match."""
    listed = record_images(record)
    pending = iter(listed)
    found: list = []
    placeholders = 0
    out = {k: v for k, v in record.items() if k not in IMAGE_FIELDS}
    for key, value in record.items():
        if key in IMAGE_FIELDS or not isinstance(value, list):
            continue
        turns = []
        for turn in value:
            if not isinstance(turn, dict):
                turns.append(turn)
                continue
            turn = dict(turn)
            for field in ("value", "content"):
                text = turn.get(field)
                if isinstance(text, str) and PLACEHOLDER in text:
                    placeholders += text.count(PLACEHOLDER)
                    turn[field] = text.replace(PLACEHOLDER, MARK)
                elif isinstance(text, list):
                    turn[field] = [_part(part, pending, found) for part in text]
            turns.append(turn)
        out[key] = turns
    if placeholders:
        taken = len(found)
        if placeholders != len(listed) - taken:
            raise Rejected(f"the record has {placeholders} {PLACEHOLDER} placeholder(s) for {len(listed) - taken} "
                           f"image(s) in its {'images' if 'images' in record else 'image'} field", "image_count_mismatch")
        found += listed[taken:]
    elif len(found) != len(listed) and len(listed) > len(found):
        raise Rejected(f"the record lists {len(listed)} image(s) but its messages place {len(found)} "
                       f"(no {PLACEHOLDER} placeholder or image part for the others)", "image_count_mismatch")
    return out, found


def _image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def _part(part: Any, pending, found: list):
    """A content part: an image one becomes a text part holding the marker."""
    if not _image_part(part):
        return part
    if part.get("type") == "image_url":
        url = part.get("image_url")
        reference = url.get("url") if isinstance(url, dict) else url
    else:
        reference = next((part[k] for k in ("image", "url", "path") if part.get(k) not in (None, "")), None)
        if reference is None:
            reference = next(pending, None)
            if reference is None:
                raise Rejected("an image part names no image and the record's images list has none left",
                               "image_count_mismatch")
    found.append(reference)
    return {"type": "text", "text": MARK}


def as_parts(conversation: Conversation, images: int) -> Conversation:
    """The conversation with every message's content as a list of text and image parts (the form the
    processors' templates render); Rejected if the markers are not all in user or system messages."""
    def parts(message: dict) -> dict:
        content = message.get("content")
        if not isinstance(content, str):
            return message
        pieces = content.split(MARK)
        if len(pieces) > 1 and message.get("role") == "assistant":
            raise Rejected("an assistant message holds an image: images are inputs, never trained",
                           "image_in_assistant_turn")
        listed = []
        for n, text in enumerate(pieces):
            if n:
                listed.append({"type": "image"})
            if text:
                listed.append({"type": "text", "text": text})
        return {**message, "content": listed or [{"type": "text", "text": ""}]}

    messages = [parts(m) for m in conversation.messages]
    seen = sum(1 for m in messages for p in (m["content"] if isinstance(m.get("content"), list) else [])
               if p.get("type") == "image")
    if seen != images:
        raise Rejected(f"{images} image(s) in the record, {seen} left in its messages once fitted to the template",
                       "image_count_mismatch")
    trained = {k: parts(m) for k, m in conversation.trained.items()}
    return Conversation(messages=messages, tools=conversation.tools, changes=conversation.changes,
                        template_kwargs=conversation.template_kwargs, trained=trained,
                        reasoning=conversation.reasoning)
