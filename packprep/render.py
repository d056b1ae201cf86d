"""Step 3a: render a conversation with the chat template and find the characters each turn trains.

Label semantics (unshifted, Hugging Face convention: the model shifts them by one):

* ``train_on="assistant"`` — for assistant turn *k*, exactly the text that
  ``render(messages[:k+1])`` adds beyond ``render(messages[:k], add_generation_prompt=True)``:
  the reply and the template's end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ``</s>``).
  Everything else (system, user, tool and header text) is ``-100``.
* ``train_on="last"`` — only the final assistant turn.
* ``train_on="all"`` — every token.

Templates that rewrite earlier turns (e.g. strip reasoning from past assistant replies) are not
prefix-stable: ``render(messages[:k+1])`` is then not a prefix of the full rendering. Rule: such a
turn is left untrained (it is not what the model saw when it produced it) and counted in
``turns_not_located``; a conversation in which no turn can be located is rejected. A turn whose
prefix the template refuses to render at all (a template that needs a user message first, and a
prefix that has none) is not located either: the definition has no value there. normalize.py's
transforms make every prefix start with a user turn, so this is rare.

Trailing non-assistant messages are dropped before rendering: they carry no label and, under
causal attention, cannot influence any trained token.

This module is the definition: :class:`ChatTemplate` renders as transformers'
``apply_chat_template(tokenize=False)`` does, and every prefix on its own.
``render_onepass.py`` is an optional accelerator that gets the same prefixes out of one rendering
per conversation; it is used only where it agrees with this reference (checked once per template),
and the manifest says which of the two ran.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError
from .normalize import Conversation, Rejected, template_refusal


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans that are trained
    turns_not_located: int = 0
    train_all: bool = False
    add_special_tokens: bool = False


def template_source(tokenizer) -> str | None:
    """The tokenizer's chat template as text (of a dict of named templates, the "default" one)."""
    template = getattr(tokenizer, "chat_template", None)
    return template.get("default") if isinstance(template, dict) else template


class ChatTemplate:
    """A tokenizer's chat template, rendered as ``apply_chat_template(tokenize=False)`` renders it
    (compiled in transformers' sandboxed environment, see tokenizer_folder.compile_template), every
    prefix on its own: the reference."""

    name = "reference"  # what the manifest records as the rendering that ran

    def __init__(self, tokenizer, *, transformers: bool = False, variables: dict | None = None):
        """``transformers=True``: render with transformers' own ``render_jinja_template`` (what
        ``apply_chat_template`` calls) instead of packprep's compiled copy: an independent check.
        ``variables``: what every rendering gets besides the messages (template_inputs.py; default:
        the fixed default date, no template arguments)."""
        from .template_inputs import template_variables

        self.variables = template_variables() if variables is None else dict(variables)
        template = template_source(tokenizer)
        self.source = template
        self._special = dict(tokenizer.special_tokens_map)
        self._transformers = transformers
        self._compiled = self._compile(template) if template and not transformers else None
        self.prefix_renders = 0  # prefixes rendered on their own

    @staticmethod
    def _compile(template: str):
        from .tokenizer_folder import compile_template

        try:
            return compile_template(template)
        except ImportError as exc:  # the environment, not the record: stop the run
            raise ConfigError(f"cannot render chat templates: {exc}") from exc

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = False) -> str:
        try:
            if self._transformers:
                from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

                # transformers passes variables to the template as plain data (a function would arrive as a
                # placeholder string), so the clock of the template it compiles and caches is set instead
                variables = {k: v for k, v in self.variables.items() if k != "strftime_now"}
                if "strftime_now" in self.variables:
                    _compile_jinja_template(self.source).globals["strftime_now"] = self.variables["strftime_now"]
                texts, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=self.source,
                                                 add_generation_prompt=add_generation_prompt, **self._special,
                                                 **variables)
                return texts[0]
            return self._compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self._special, **self.variables,
            )
        except Exception as exc:  # jinja raise_exception, TemplateError, TypeError from bad data
            rejected = Rejected(template_refusal(messages, exc), "template_error")
            rejected.template_error = exc  # for a reason in the whole conversation's terms (render_conversation)
            raise rejected from None

    def with_variables(self, extra: dict | None) -> "ChatTemplate":
        """This template with a record's own ``chat_template_kwargs`` on top of the run's variables."""
        if not extra:
            return self
        clone = copy.copy(self)
        clone.variables = {**self.variables, **extra}
        return clone

    def render_with_prefixes(self, messages: list[dict], tools: list | None) -> tuple[str, Callable[[int, bool], str]]:
        """``render(messages)``, and a function ``prefix(n, g)`` equal to
        ``render(messages[:n], add_generation_prompt=g)``."""
        text = self.render(messages, tools)

        def prefix(n: int, generation: bool) -> str:
            self.prefix_renders += 1
            return self.render(messages[:n], tools, generation)

        return text, prefix


def render_conversation(template: ChatTemplate, conversation: Conversation, train_on: str) -> Rendered:
    """The conversation's text and the character spans its labels train (see the module docstring)."""
    if conversation.text is not None:
        return Rendered(conversation.text, [], train_all=True, add_special_tokens=True)
    if not template.source:
        raise ConfigError(
            "the tokenizer has no chat template; pass a tokenizer that has one, or set "
            "tokenizer.chat_template in its tokenizer_config.json"
        )
    messages = conversation.messages
    assistant_turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_turns:
        raise Rejected("no assistant turn to train on", "no_assistant_turn")
    messages = messages[: assistant_turns[-1] + 1]
    if train_on == "all":
        return Rendered(template.render(messages, conversation.tools), [], train_all=True)
    full, prefix = template.render_with_prefixes(messages, conversation.tools)
    if train_on == "last":
        assistant_turns = assistant_turns[-1:]
    spans = []
    not_located = 0
    refused = None  # why the template refused a prefix the definition needs
    for k in assistant_turns:
        try:
            before = prefix(k, True)
            after = full if k == len(messages) - 1 else prefix(k + 1, False)
        except Rejected as exc:  # the definition cannot be evaluated for this turn: not located
            not_located, refused = not_located + 1, refused or (k, getattr(exc, "template_error", exc))
            continue
        if full.startswith(after) and after.startswith(before):
            if len(after) > len(before):
                spans.append((len(before), len(after)))
        else:
            not_located += 1
    if not spans:
        if refused:
            k, error = refused
            raise Rejected(f"{template_refusal(messages, error)} (it refused the messages before assistant "
                           f"message {k}, so no assistant turn could be located)", "template_error")
        if not_located:
            raise Rejected(
                "chat template rewrites earlier turns and no assistant turn could be located "
                "(the rendering of a prefix is not a prefix of the full rendering)",
                "template_not_prefix_stable",
            )
        raise Rejected("assistant turns render to no tokens", "no_supervised_tokens")
    return Rendered(full, spans, not_located)
