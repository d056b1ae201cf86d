"""Step 3a: render a conversation with the chat template and find the characters each turn trains.

The label definition (unshifted, Hugging Face convention: the model shifts them by one). Assistant
turn *k* is trained on exactly what the model generates at inference, in exactly the context it
sees there: its *context* is ``render(messages[:k], add_generation_prompt=True)`` and its *target*
is what ``render(messages[:k+1])`` adds to it: the reply and the template's end-of-turn token
(``<|eot_id|>``, ``<|im_end|>``, ``</s>``). Everything else is ``-100``. Two refinements, both
found by probing the template once (:func:`probe_shape`), never from a list of model names:

* a generation prompt that *opens a reasoning block* (``<think>\\n``: DeepSeek-R1 distills, QwQ)
  whose opening the assistant's own rendering does not start with: the target is the reasoning
  and the answer as the model writes them after that prompt, ``reasoning + "\\n</think>\\n\\n" +``
  the template's rendering of the answer (the reasoning from ``reasoning_content``, or from the
  content up to ``</think>``);
* a *constant tail*, text the template appends after the conversation's last message only
  (Phi-3.5's ``<|endoftext|>``, the same on every probe): a turn with more after it is trained up
  to its own end-of-turn token (generation stops there); the tail is trained once, at the end.

A message may have a *trained form* (``Conversation.trained``: reasoning written inline, tool calls
as text, for a template that has no place for them): turn *k*'s target is rendered with message *k*
in that form, never the history. Where ``render(messages[:k+1])`` does not extend the context, the
target is what the template writes for the turn after its generation prompt
(:func:`inference_turn`). Token ids follow in turn_ids.py: each context tokenized on its own.

``turn_context`` says what is done with a turn that the full rendering does not hold in its
inference context (Qwen3 adds ``<think>\\n\\n</think>\\n\\n`` to the last assistant message only;
DeepSeek-R1 strips reasoning from every one):

* ``exact`` (default): the conversation becomes the fewest sequences such that every turn is
  trained in its inference context: greedily from the last turn backwards, the sequence that ends
  at turn *k* is its context and target, and also trains every earlier turn whose context and
  target it begins with. The repeated context tokens are the price (counted).
* ``intact``: one sequence, the full rendering; only the turns it holds in their inference context
  are trained, the others counted in ``turns_not_located``.
* ``rendered``: one sequence, the full rendering; a turn it rewrote is trained as it is written
  there (what trainers that label one rendering do), counted in ``turns_out_of_context``.

``train_on="last"`` trains only the final assistant turn; ``train_on="all"`` every token of the
one full rendering. A turn whose prefix the template refuses to render at all is not located:
the definition has no value there. Trailing non-assistant messages are dropped before rendering.

:class:`ChatTemplate` renders as transformers' ``apply_chat_template(tokenize=False)`` does, and
every prefix on its own. ``render_onepass.py`` is an optional accelerator that gets the same
prefixes out of one rendering per conversation, used only where it agrees with this reference.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .errors import ConfigError, transformers_lacks
from .normalize import Conversation, Rejected
from .template_fit import template_refusal
from .tokenizer_folder import RenderTooLong

TURN_CONTEXTS = ("exact", "intact", "rendered")


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # character spans that are trained
    turns_not_located: int = 0  # assistant turns left untrained
    train_all: bool = False
    add_special_tokens: bool = False
    markup: list[tuple[int, int]] | None = None  # control_text.py: the template's special tokens, when content spells one
    earlier: list["Rendered"] = field(default_factory=list)  # more sequences of this record (turn_context exact)
    turns_out_of_context: int = 0  # trained as the full rendering writes them (turn_context rendered)
    turns_rewritten: int = 0  # turns the full rendering does not hold as at inference (any turn_context)
    changes: dict[str, int] = field(default_factory=dict)  # what became of the turns' reasoning (assistant_turns.py)


@dataclass(frozen=True)
class Shape:
    """What probing finds about a template (see :func:`probe_shape`)."""

    tail: str = ""  # constant text appended after the conversation's last message only
    opening: str = ""  # the reasoning block the generation prompt opens, e.g. "<think>\n"
    closing: str = ""  # the tag that closes it, e.g. "</think>"


@dataclass
class Work:
    """What a template's renderings have cost, shared by its copies (``with_variables``): counted, not
    timed, so that tests can hold the growth with the turns (tests/test_render_work.py)."""

    renders: int = 0  # template renderings
    chars: int = 0  # characters they output
    prefixes: int = 0  # of those, prefixes rendered on their own (not cut out of a conversation's one rendering)

    def add(self, text: str) -> str:
        """Count one rendering, ``text``; return it."""
        self.renders += 1
        self.chars += len(text)
        return text


class Turn(NamedTuple):
    context: str  # what the model sees before it generates the turn
    target: str  # what it generates, up to the end of the rendering of messages[:k+1]
    core: str  # the target without the constant tail: what a longer sequence must hold


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
        self._shape: Shape | None = None
        self.work = Work()

    @staticmethod
    def _compile(template: str):
        """Compile ``template`` (tokenizer_folder.compile_template) with the sandbox's checks made once
        per type and name where their answer depends on nothing else (tokenizer_folder.faster_sandbox)."""
        from .tokenizer_folder import compile_template, faster_sandbox

        try:
            return faster_sandbox(compile_template(template))
        except ImportError as exc:  # the environment, not the record: stop the run
            raise ConfigError(f"cannot render chat templates: {exc}") from exc

    @property
    def shape(self) -> Shape:
        if self._shape is None:
            self._shape = probe_shape(self.render)
        return self._shape

    def render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = False) -> str:
        try:
            if self._transformers:
                try:
                    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template
                except ImportError as exc:  # the environment, not the record: stop the run
                    raise ConfigError(transformers_lacks("chat_template_utils.render_jinja_template")) from exc

                # transformers passes variables to the template as plain data (a function would arrive as a
                # placeholder string), so the clock of the template it compiles and caches is set instead
                variables = {k: v for k, v in self.variables.items() if k != "strftime_now"}
                if "strftime_now" in self.variables:
                    _compile_jinja_template(self.source).globals["strftime_now"] = self.variables["strftime_now"]
                texts, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=self.source,
                                                 add_generation_prompt=add_generation_prompt, **self._special,
                                                 **variables)
                return texts[0]
            return self.work.add(self._compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self._special, **self.variables,
            ))
        except (RenderTooLong, ConfigError):  # the record's own size, or the environment: not the template's refusal
            raise
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
        clone._shape = None  # probed again: enable_thinking=false, say, changes the generation prompt
        return clone

    def render_with_prefixes(self, messages: list[dict], tools: list | None) -> tuple[str, Callable[[int, bool], str]]:
        """``render(messages)``, and a function ``prefix(n, g)`` equal to
        ``render(messages[:n], add_generation_prompt=g)``."""
        text = self.render(messages, tools)

        def prefix(n: int, generation: bool) -> str:
            self.work.prefixes += 1
            return self.render(messages[:n], tools, generation)

        return text, prefix


def context_text(turn_context: str, counts: dict, shared_prefix: bool = False) -> str:
    """One line for people (pack, stats, the dataset card): what the turn-context policy cost, true
    of what was written: shared-prefix rows store no repeated context (each shared prefix once), and
    where ``--max-len`` cut sequences (a manifest's counts) the repeated context is as tokenized."""
    extra, repeated = counts.get("extra_sequences", 0), counts.get("repeated_tokens", 0)
    out_of_context = counts.get("turns_out_of_context", 0)
    line = f"turn context {turn_context}: "
    if turn_context == "rendered":
        return line + f"{out_of_context:,} assistant turns trained as the whole conversation renders them, not as at inference"
    if turn_context == "intact" or not extra:
        return line + "one sequence a conversation"
    line += f"{extra:,} more sequences, to train every turn in its inference context"
    if shared_prefix:
        return line + ", written as prefix trees that store each shared prefix once"
    cut = counts.get("truncated", 0) or counts.get("supervised_cut", 0)
    return line + f" ({repeated:,} tokens of repeated context{' as tokenized, before --max-len cut' if cut else ''})"


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _cut(text: str, at: int) -> int:
    """``at``, moved back to just after white space or a ``>``: where a tail can begin (``<|endoftext|>``
    and ``<|user|>`` share ``<|``; the tail must not start inside a token)."""
    while at > 0 and not text[at - 1].isspace() and text[at - 1] != ">":
        at -= 1
    return at


def probe_shape(render: Callable[[list, list | None, bool], str]) -> Shape:
    """The template's constant tail and reasoning opening, from a few probe conversations.

    Tail: in ``[u, a, ..., u, a]`` the rendering of all but the last exchange is cut where it
    parts from the whole; what it has left is the tail. It is constant only if the same text is
    left on three probes of different lengths and contents (a tail that prints the last message,
    or counts them, differs). Opening: the generation prompt after ``[u]`` goes on past where
    ``[u, a]``'s rendering parts from it with exactly an opening tag ``<name>`` (and white space).
    The cut is moved back to where a tail can begin (:func:`_cut`).
    """
    def probe(messages, generation=False):
        try:
            return render(messages, None, generation)
        except Rejected:
            return None

    tails = set()
    for n in (2, 3, 4):
        messages = [{"role": role, "content": f"{role[0]} probe {n}{i}"} for i in range(n) for role in ("user", "assistant")]
        first, whole = probe(messages[: 2 * n - 2]), probe(messages)
        if first is None or whole is None:
            break
        tails.add(first[_cut(first, _common_prefix(first, whole)):] if not whole.startswith(first) else "")
    tail = tails.pop() if len(tails) == 1 else ""
    user = {"role": "user", "content": "u probe"}
    prompt, reply = probe([user], True), probe([user, {"role": "assistant", "content": "a probe"}])
    if prompt is None or reply is None or reply.startswith(prompt):
        return Shape(tail)
    match = re.fullmatch(r"<([A-Za-z][\w-]*)>\s*", prompt[_common_prefix(prompt, reply):])
    if not match:
        return Shape(tail)
    opening, closing = match.group(0), f"</{match.group(1)}>"
    thought = {"role": "assistant", "content": f"{opening}r probe{closing}a probe"}
    history = probe([user, thought, user])  # the template knows the block: it strips it from past replies
    if history is None or "r probe" in history or "a probe" not in history:
        return Shape(tail)
    return Shape(tail, opening, closing)


# tags that open a reasoning block in a generation prompt, and their closing tags: ``<name>`` with "think" or
# "reason" in the name closes with ``</name>``; these are the other forms public templates use
OPENINGS = {"[THINK]": "[/THINK]", "<|START_THINKING|>": "<|END_THINKING|>", "<|channel>thought": "<channel|>"}
_TAG = re.compile(r"<([A-Za-z][\w:-]*)>")
SENTINEL = "\u2063packprep-content\u2063"  # a reply's content, to find where the template writes it


def _control_safe(a: str, b: str, n: int) -> int:
    """``n``, a common start of ``a`` and ``b``, backed up to the start of a control string (``<...>``,
    ``[...]``) it would cut in two (``<think>`` and ``<tool_call>`` share ``<t``)."""
    for opening, closing in (("<", ">"), ("[", "]")):
        cut = a.rfind(opening, 0, n)
        if cut >= 0 and a.find(closing, cut, n) < 0 and (a.find(closing, cut) >= 0 or b.find(closing, cut) >= 0):
            n = min(n, cut)
    return n


def _opening(prompt: str) -> tuple[str, str] | None:
    """The last reasoning block ``prompt`` opens and leaves open: (opening, closing)."""
    found = [(m.start(), m.group(0), f"</{m.group(1)}>") for m in _TAG.finditer(prompt)
             if "think" in m.group(1).lower() or "reason" in m.group(1).lower()]
    found += [(prompt.rfind(o), o, c) for o, c in OPENINGS.items() if o in prompt]
    for at, opening, closing in sorted(found, reverse=True):
        if closing not in prompt[at:]:
            return opening, closing
    return None


def inference_turn(before: str, after: str, message: dict, shape: Shape,
                   history: Callable[[], str] | None = None,
                   with_content: Callable[[str], str] | None = None, reasoning: str | None = None) -> Turn | None:
    """Turn *k*'s context and target from ``before`` (``render(messages[:k], True)``) and ``after``
    (``render(messages[:k+1])``, the turn in its trained form); None where the definition has no
    value. Where ``after`` does not extend ``before``, with ``history()`` = ``render(messages[:k])``:

    * both extend the history: the generation prompt (``before`` beyond it) and the turn's rendering
      share a start; where the rest of the prompt opens a reasoning block the rendering does not
      (the template strips reasoning from replies, its prompt asks for it: QwQ, DeepSeek-R1), the
      model writes the reasoning, the closing tag and the rest of the rendering
      (``reasoning + "\\n</think>\\n\\n" + rest``, a ``\\n`` first where the prompt ends without
      one); else the rest of the prompt is a marker the model sees and writes after (an empty
      thought channel): the rest of the rendering, less that marker where it starts with it;
    * else the template rewrites the history once a reply follows (reasoning kept only until an
      answer follows, a system prompt moved): the turn as the template writes it after its
      generation prompt, found last in ``after``, or, for an empty prompt, from where the turn's
      content begins (``with_content(text)`` renders the turn with other content).
    """
    if after.startswith(before):
        target = after[len(before):]
    else:
        target = _rewritten(before, after, message, history, with_content, reasoning)
        if target is None:
            return None
    tail = shape.tail
    core = target[: -len(tail)] if tail and target.endswith(tail) and len(target) > len(tail) else target
    return Turn(before, target, core)


def _rewritten(before: str, after: str, message: dict, history, with_content, reasoning: str | None) -> str | None:
    """The target of a turn whose rendering does not extend its context (:func:`inference_turn`)."""
    if history is None:
        return None
    try:
        past = history()
    except Rejected:
        return None
    if before.startswith(past) and after.startswith(past):
        prompt, own = before[len(past):], after[len(past):]
        common = _control_safe(prompt, own, _common_prefix(prompt, own))
        rest_prompt, rest = prompt[common:], own[common:]
        block = _opening(rest_prompt)
        if block and block[0] not in rest and rest.lstrip().startswith(block[1]):
            return (reasoning or "").strip("\n") + rest  # the turn's rendering closes the block itself (GLM-4.7)
        if block and block[0] not in rest:
            lead = "" if rest_prompt.endswith("\n") else "\n"
            return lead + (reasoning or "").strip("\n") + "\n" + block[1] + "\n\n" + rest.lstrip("\n")
        # a marker the context already ends with, that the turn's rendering starts with, is not written again
        overlap = next((len(rest_prompt) - j for j in range(len(rest_prompt)) if rest.startswith(rest_prompt[j:])), 0)
        return rest[overlap:]
    prompt = before[len(past):] if before.startswith(past) else ""
    at = after.rfind(prompt) if prompt.strip() else -1
    if at >= 0:
        return after[at + len(prompt):]
    if with_content is None or not isinstance(message.get("content"), str) or not message["content"]:
        return None
    try:
        other = with_content(SENTINEL)
    except Rejected:
        return None
    start = _common_prefix(after, other)
    return after[start:] if SENTINEL in other[start:] else None


def render_conversation(template: ChatTemplate, conversation: Conversation, train_on: str,
                        turn_context: str = "exact") -> Rendered:
    """The conversation's sequences and the character spans their labels train (see the module docstring)."""
    if conversation.text is not None:
        return Rendered(conversation.text, [], train_all=True, add_special_tokens=True)
    if not template.source:
        raise ConfigError(
            "the tokenizer has no chat template; pass a tokenizer that has one, or set "
            "tokenizer.chat_template in its tokenizer_config.json"
        )
    messages, trained = conversation.messages, conversation.trained
    assistant_turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant_turns:
        raise Rejected("no assistant turn to train on", "no_assistant_turn")
    messages = messages[: assistant_turns[-1] + 1]
    if train_on == "all":  # every message as the model writes it when trained
        return Rendered(template.render([trained.get(k, m) for k, m in enumerate(messages)], conversation.tools), [],
                        train_all=True)
    try:
        full, prefix = template.render_with_prefixes(messages, conversation.tools)
    except Rejected:  # the template refuses the whole conversation: each turn it renders is trained on its own
        if turn_context != "exact":
            raise
        full, prefix = None, _own_prefixes(template, messages, conversation.tools)
    if train_on == "last":
        assistant_turns = assistant_turns[-1:]

    def rendered_with(k: int) -> str:
        """``render(messages[:k+1])`` with message k in its trained form."""
        if k not in trained:
            return full if k == len(messages) - 1 and full is not None else prefix(k + 1, False)
        template.work.prefixes += 1
        return template.render(messages[:k] + [trained[k]], conversation.tools)

    pairs: dict[int, tuple[str, str]] = {}  # k -> (context, rendering of messages[:k+1])
    not_located, refused = 0, None  # refused: why the template refused a prefix the definition needs
    for k in assistant_turns:
        try:
            pairs[k] = prefix(k, True), rendered_with(k)
        except Rejected as exc:  # the definition cannot be evaluated for this turn: not located
            not_located, refused = not_located + 1, refused or (k, getattr(exc, "template_error", exc))
    if full is not None and all(after.startswith(before) and full.startswith(after) for before, after in pairs.values()):
        # every turn held as at inference (most templates): the full rendering is the one sequence
        spans = [(len(before), len(after)) for before, after in pairs.values() if len(after) > len(before)]
        sequences, untrained, out_of_context, rewritten = [(full, spans)], 0, 0, 0
        targets = {k: after[len(before):] for k, (before, after) in pairs.items()}
    else:
        turns = {k: turn for k, (before, after) in pairs.items()
                 if (turn := inference_turn(before, after, trained.get(k, messages[k]), template.shape,
                                            lambda k=k: prefix(k, False), lambda text, k=k: template.render(
                                                messages[:k] + [{**trained.get(k, messages[k]), "content": text}],
                                                conversation.tools), conversation.reasoning.get(k))) is not None}
        not_located += len(pairs) - len(turns)
        sequences, untrained, out_of_context, rewritten, targets = _sequences(full or "", turns, turn_context)
    if not any(spans for _, spans in sequences):
        if refused:
            k, error = refused
            raise Rejected(f"{template_refusal(messages, error)} (it refused the messages before assistant "
                           f"message {k}, so no assistant turn could be located)", "template_error")
        if not_located or untrained:
            raise Rejected(
                "chat template rewrites earlier turns and no assistant turn could be located "
                "(the rendering of a prefix is not a prefix of the full rendering)",
                "template_not_prefix_stable",
            )
        raise Rejected("assistant turns render to no tokens", "no_supervised_tokens")
    (text, spans), earlier = sequences[0], [Rendered(t, s) for t, s in reversed(sequences[1:])]
    return Rendered(text, spans, not_located + untrained, earlier=earlier, turns_out_of_context=out_of_context,
                    turns_rewritten=rewritten, changes=_reasoning_fates(messages, conversation, targets))


def _own_prefixes(template: ChatTemplate, messages: list[dict], tools: list | None) -> Callable[[int, bool], str]:
    """``prefix(n, g)``: ``render(messages[:n], add_generation_prompt=g)``, each rendered on its own."""
    def prefix(n: int, generation: bool) -> str:
        template.work.prefixes += 1
        return template.render(messages[:n], tools, generation)

    return prefix


def _reasoning_fates(messages: list[dict], conversation: Conversation, targets: dict[int, str]) -> dict[str, int]:
    """What became of each assistant turn's reasoning, judged on the text it is trained on
    (``targets``: turn -> trained text): trained as the template writes it, inlined by
    ``--reasoning inline`` (in the turn's trained form only), or in no trained token (dropped)."""
    fates: dict[str, int] = {}
    for k, message in enumerate(messages):
        reasoning = conversation.reasoning.get(k)
        if reasoning is None:
            continue
        needle = reasoning.strip()
        if needle not in targets.get(k, ""):
            fate = "reasoning_dropped"
        elif k in conversation.trained and (conversation.trained[k].get("content") or "").strip() in targets[k]:
            fate = "reasoning_inlined"
        else:
            fate = "reasoning_trained"
        fates[fate] = fates.get(fate, 0) + 1
    return fates


def _begins(text: str, turn: Turn) -> bool:
    """Whether ``text`` begins with the turn's context and target (tail left out)."""
    return text.startswith(turn.context) and text.startswith(turn.core, len(turn.context))


def _span(text: str, turn: Turn) -> tuple[int, int]:
    """Where ``turn`` is trained in ``text``, a sequence that begins with its context and core."""
    whole = len(text) == len(turn.context) + len(turn.target) and text.endswith(turn.target)
    return len(turn.context), len(turn.context) + len(turn.target if whole else turn.core)


def _sequences(full: str, turns: dict[int, Turn], policy: str):
    """([(text, spans)], turns untrained, turns trained out of context, turns the full rendering
    does not hold as at inference, {turn: the text it is trained on}): the last sequence first."""
    held = {k for k, turn in turns.items() if _begins(full, turn)}
    rewritten = len(turns) - len(held)
    if policy != "exact":
        spans = {k: _span(full, turns[k]) for k in sorted(held)}
        found = {} if policy == "intact" else {k: s for k in sorted(set(turns) - held)
                                               if (s := _as_rendered(full, turns[k])) is not None}
        targets = {k: full[a:b] for k, (a, b) in {**spans, **found}.items()}
        spans = sorted(s for s in [*spans.values(), *found.values()] if s[1] > s[0])
        return [(full, spans)], rewritten - len(found), len(found), rewritten, targets
    left, sequences = sorted(turns), []
    while left:
        last = turns[left[-1]]
        whole = left[-1] in held and len(last.context) + len(last.target) == len(full)
        text = full if whole else last.context + last.target  # the full rendering, where it ends with the last turn
        covered = [k for k in left if k in held] if whole else [k for k in left if _begins(text, turns[k])]
        spans = [s for k in covered if (s := _span(text, turns[k]))[1] > s[0]]
        if spans:  # turns that render to no text train nothing: no sequence for them alone
            sequences.append((text, spans))
        left = [k for k in left if k not in covered]
    return sequences or [(full, [])], 0, 0, rewritten, {k: turn.target for k, turn in turns.items()}


def _as_rendered(full: str, turn: Turn) -> tuple[int, int] | None:
    """Where the full rendering writes a turn it rewrote: from where its context parts from the
    full rendering, the longest end of its target that the full rendering holds there."""
    start = _common_prefix(turn.context, full)
    if start >= len(full):
        return None
    core, first = turn.core, full[start]
    i = core.find(first)
    while i != -1:
        if full.startswith(core[i:], start):
            return start, start + len(core) - i
        i = core.find(first, i + 1)
    return None
