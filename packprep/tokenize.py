"""Step 3: render conversations with the tokenizer's chat template and label them.

Label semantics (unshifted, Hugging Face convention: the model shifts them by one):

* ``train_on="assistant"`` — for assistant turn *k*, exactly the tokens that
  ``render(messages[:k+1])`` adds beyond ``render(messages[:k], add_generation_prompt=True)``:
  the reply and the template's end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ``</s>``).
  Everything else (system, user, tool and header tokens) is ``-100``.
* ``train_on="last"`` — only the final assistant turn.
* ``train_on="all"`` — every token.

How it is computed: each prefix is *rendered* (cheap string work), but the conversation is
*tokenized once*; a token is trained when it starts inside a turn's character span. The tests
prove this equals the per-prefix reference on every real tokenizer and fixture file.

Templates that rewrite earlier turns (e.g. strip reasoning from past assistant replies) are not
prefix-stable: ``render(messages[:k+1])`` is then not a prefix of the full rendering. Rule: such a
turn is left untrained (it is not what the model saw when it produced it) and counted in
``turns_not_located``; a conversation in which no turn can be located is rejected.

Trailing non-assistant messages are dropped before rendering: they carry no label and, under
causal attention, cannot influence any trained token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import ConfigError
from .normalize import Conversation, Rejected

TRAIN_ON = ("assistant", "last", "all")
IGNORE_INDEX = -100


@dataclass
class Encoded:
    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX where not trained
    turns_not_located: int = 0


def load_tokenizer(name_or_path: str):
    """Load a Hugging Face tokenizer by folder or Hub id, with a clear error when it cannot be."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except Exception as exc:
        raise ConfigError(
            f"cannot load tokenizer {name_or_path!r}: {exc}. Pass a folder holding tokenizer.json "
            "and tokenizer_config.json, or a Hub id that is in the local cache (HF_HUB_OFFLINE=1)."
        ) from exc


class ChatTemplate:
    """A compiled chat template that renders the way ``apply_chat_template(tokenize=False)`` does."""

    def __init__(self, tokenizer):
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        self.source = template
        self._tokenizer = tokenizer
        self._compiled = None
        if template:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(template)
            except ImportError:  # older/newer transformers: fall back to the public API
                self._compiled = None
        self._special = dict(tokenizer.special_tokens_map)

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = False) -> str:
        try:
            if self._compiled is not None:
                return self._compiled.render(
                    messages=messages,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._special,
                )
            return self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raise_exception, TemplateError, TypeError from bad data
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise Rejected(f"chat template rejected the conversation: {message}", "template_error") from None


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans that are trained
    turns_not_located: int = 0
    train_all: bool = False
    add_special_tokens: bool = False


class ChatEncoder:
    """Renders and tokenizes conversations in batches; one tokenizer call per batch."""

    def __init__(self, tokenizer, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on must be one of {TRAIN_ON}, not {train_on!r}")
        self.tokenizer = tokenizer
        self.train_on = train_on
        self.template = ChatTemplate(tokenizer)
        self._backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else None
        self.eos_token_id = tokenizer.eos_token_id

    @property
    def has_template(self) -> bool:
        return bool(self.template.source)

    def render(self, conversation: Conversation) -> Rendered:
        if conversation.text is not None:
            return Rendered(conversation.text, [], train_all=True, add_special_tokens=True)
        if not self.has_template:
            raise ConfigError(
                "the tokenizer has no chat template; pass a tokenizer that has one, or set "
                "tokenizer.chat_template in its tokenizer_config.json"
            )
        messages = conversation.messages
        tools = conversation.tools
        assistant_turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
        if not assistant_turns:
            raise Rejected("no assistant turn to train on", "no_assistant_turn")
        messages = messages[: assistant_turns[-1] + 1]
        full = self.template.render(messages, tools)
        if self.train_on == "all":
            return Rendered(full, [], train_all=True)
        if self.train_on == "last":
            assistant_turns = assistant_turns[-1:]
        spans = []
        not_located = 0
        for k in assistant_turns:
            before = self.template.render(messages[:k], tools, add_generation_prompt=True)
            after = full if k == len(messages) - 1 else self.template.render(messages[: k + 1], tools)
            if full.startswith(after) and after.startswith(before):
                if len(after) > len(before):
                    spans.append((len(before), len(after)))
            else:
                not_located += 1
        if not spans:
            if not_located:
                raise Rejected(
                    "chat template rewrites earlier turns and no assistant turn could be located "
                    "(the rendering of a prefix is not a prefix of the full rendering)",
                    "template_not_prefix_stable",
                )
            raise Rejected("assistant turns render to no tokens", "no_supervised_tokens")
        return Rendered(full, spans, not_located)

    def encode(self, conversations: Sequence[Conversation]) -> list[Encoded | Rejected]:
        """Encode a batch; a conversation that cannot be encoded becomes a ``Rejected`` in place."""
        results: list[Any] = [None] * len(conversations)
        rendered: list[Rendered] = []
        where: list[int] = []
        for position, conversation in enumerate(conversations):
            try:
                rendered.append(self.render(conversation))
                where.append(position)
            except Rejected as exc:
                results[position] = exc
        for position, item in zip(where, self._tokenize(rendered)):
            results[position] = item
        return results

    def _tokenize(self, rendered: list[Rendered]) -> list[Encoded | Rejected]:
        chats = [r for r in rendered if not r.add_special_tokens]
        texts = [r for r in rendered if r.add_special_tokens]
        encodings = {}
        for group, special in ((chats, False), (texts, True)):
            if group:
                batch = self._backend.encode_batch([r.text for r in group], add_special_tokens=special)
                encodings.update({id(r): e for r, e in zip(group, batch)})
        out: list[Encoded | Rejected] = []
        for r in rendered:
            encoding = encodings[id(r)]
            ids = np.asarray(encoding.ids, dtype=np.int32)
            if r.train_all:
                if r.add_special_tokens and self.eos_token_id is not None and (
                    len(ids) == 0 or ids[-1] != self.eos_token_id
                ):
                    ids = np.append(ids, np.int32(self.eos_token_id))
                labels = ids.copy()
            else:
                labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
                for start, stop in r.spans:
                    first = _first_token_at_or_after(encoding, start, len(ids), len(r.text))
                    last = _first_token_at_or_after(encoding, stop, len(ids), len(r.text))
                    labels[first:last] = ids[first:last]
            if len(ids) == 0:
                out.append(Rejected("renders to no tokens", "empty"))
            elif not (labels[1:] != IGNORE_INDEX).any():
                out.append(Rejected("no supervised token (every label is -100)", "no_supervised_tokens"))
            else:
                out.append(Encoded(ids, labels, r.turns_not_located))
        return out


def _first_token_at_or_after(encoding, char: int, n_tokens: int, text_length: int) -> int:
    """Index of the first token whose first character is at or after ``char``."""
    if char <= 0:
        return 0
    token = None
    probe = char
    while token is None:  # a character no token covers (e.g. a stripped space): look further on
        if probe >= text_length:
            return n_tokens
        token = encoding.char_to_token(probe)
        probe += 1
    start, _ = encoding.token_to_chars(token)
    return token if start >= char else token + 1


def tokenizer_fingerprint(tokenizer, name_or_path: str) -> dict:
    """What the manifest records about the tokenizer: enough to tell two tokenizers apart."""
    import hashlib
    import json

    files_hash = hashlib.sha256()
    if os.path.isdir(name_or_path):
        for name in sorted(os.listdir(name_or_path)):
            path = os.path.join(name_or_path, name)
            if os.path.isfile(path) and name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                files_hash.update(name.encode())
                with open(path, "rb") as handle:
                    files_hash.update(handle.read())
    else:
        files_hash.update(json.dumps(tokenizer.backend_tokenizer.to_str()).encode())
    template = ChatTemplate(tokenizer).source or ""
    return {
        "name_or_path": name_or_path,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "files_sha256": files_hash.hexdigest(),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
    }
