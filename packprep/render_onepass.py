"""Optional accelerator for render.py: every prefix rendering cut out of one rendering per conversation.

The definition (render.py) costs two prefix renderings per assistant turn, quadratic in the turns.
This renders each conversation once and watches the template run:

1. The template's last top-level ``{% for %}`` is its message loop, and everything after that loop
   must be text that depends on nothing but ``add_generation_prompt`` and variables the template
   never assigns (special tokens, template arguments; checked once, on the template's syntax tree,
   see ``_tail_reads``). Call that text the *tail*: for given variables, the same after every prefix.
2. The template gets the messages through a read-only stand-in that records which messages it has
   read and whether it has read how many there are.
3. When the message loop itself steps to message *j* and the template has read no message at or
   after *j*, nor their number, the output so far is exactly what rendering ``messages[:j]`` has
   output at that point: the same code ran on the same data. There that rendering's loop ends and
   its tail follows, so ``render(messages[:j], add_generation_prompt=g)`` is the output so far plus
   ``tail(g)``.

A prefix the watch cannot vouch for (the template looked ahead: ``loop.last``, ``messages|length``,
``messages[loop.index0 + 1]``...) is rendered the reference way. The stand-in is not a ``list``, so
whatever it does not implement faithfully fails loudly, and the conversation is then rendered the
reference way too. Tests compare the result with the reference on every real template and on
templates written to defeat the watch.

This reaches into Jinja (a rewritten syntax tree, the compiled template's ``root_render_func``,
``LoopContext.__next__``, ``sys._getframe``). :func:`choose_template` checks, once per template, that the result agrees with
the reference :class:`packprep.render.ChatTemplate` on probe conversations; where it cannot be
built or does not agree, it says why and the reference is used (the manifest records which ran).
``tests/test_render.py`` fails when the installed Jinja no longer allows it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .normalize import Conversation, Rejected
from .render import ChatTemplate, Work, render_conversation
from .tokenizer_folder import RENDERED_CHARS, RenderTooLong, snapshot_globals

WATCH = "__packprep_watch"  # the name under which the rewritten template's message loop calls the watch
# Conversations on which the accelerator must agree with the reference before it is used.
PROBES = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
     {"role": "assistant", "content": "1"}, {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b "}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d\n"}, {"role": "user", "content": "e"}, {"role": "assistant", "content": ""}],
]


class Unavailable(Exception):
    """The one-pass rendering cannot be used for this template (the message says why)."""


class _Reads:
    """What one rendering has read of its messages, and where the message loop stepped unhindered."""

    __slots__ = ("furthest", "count", "written", "cuts")

    def __init__(self):
        self.furthest = -1  # the highest message index read
        self.count = False  # whether the number of messages was read (len, negative index, reversal...)
        self.written = 0  # characters output so far
        self.cuts: dict[int, int] = {}  # j -> characters output when the loop stepped to message j


class _Messages:
    """A read-only stand-in for the messages list that records what the template reads of it.

    Deliberately not a ``list`` subclass: C code (``json.dumps``, ``pprint``) reads a list subclass
    without calling its methods, so a read would go unrecorded; here such code raises instead.
    Printing and comparing the list raise too, rather than differ from a real list.
    """

    __slots__ = ("_items", "_start", "_reads")

    def __init__(self, items: list, reads: _Reads, start: int = 0):
        self._items, self._reads, self._start = items, reads, start

    def _read(self, index: int) -> None:
        if self._start + index > self._reads.furthest:
            self._reads.furthest = self._start + index

    def _read_all(self):
        self._reads.count = True
        return self._items

    def __getitem__(self, key):
        if isinstance(key, int):
            if key < 0:
                return self._read_all()[key]
            self._read(key)
            return self._items[key]
        if isinstance(key, slice) and key.step is None and isinstance(key.start, (int, type(None))):
            start = key.start or 0
            if start >= 0 and key.stop is None:  # messages[1:]: the view stays watched
                return _Messages(self._items[start:], self._reads, self._start + start)
            if start >= 0 and isinstance(key.stop, int) and key.stop >= 0:
                if key.stop > start:
                    self._read(key.stop - 1)
                return self._items[key]
        return self._read_all()[key]

    def __iter__(self):
        for index, item in enumerate(self._items):
            self._read(index)
            yield item
        self._reads.count = True

    def __len__(self):
        return len(self._read_all())

    def __bool__(self):
        return bool(self._read_all())

    def __reversed__(self):
        return reversed(self._read_all())

    def __contains__(self, item):
        return item in self._read_all()

    def count(self, item):
        return self._read_all().count(item)

    def index(self, *args):
        return self._read_all().index(*args)

    def copy(self):
        return list(self._read_all())

    def _unwatchable(self, *args):
        raise TypeError("the messages list cannot be printed or compared while watched")

    __str__ = __repr__ = __format__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _unwatchable
    __hash__ = None


@dataclass
class _Watch:
    """A template rewritten for watching (see ``_watchable``), with what its loop needs to know."""

    template: object  # the jinja2 Template whose message loop runs on WATCH(...)
    tail: object  # the text after the loop, as a template of its own (rendered with a template copy's variables)
    template_file: str  # the file name of the template's compiled code: its own loop steps come from there
    loop_step: object  # the code of LoopContext.__next__: the loop's steps when the template uses `loop`
    reads: frozenset  # the names the tail reads: a rendering's own top-level value of each, where it set one

    def loop(self, iterable):
        """WATCH: the message loop's iterable, watched when it is the messages."""
        return _MessageLoop(iterable, self) if isinstance(iterable, _Messages) else iterable


class _MessageLoop:
    """What the rewritten message loop iterates: records a cut each time the loop itself steps on.

    A step taken for the loop by ``loop.last`` or ``loop.nextitem`` (a peek) is not a cut: after it
    the current iteration goes on, knowing whether there is a next message.
    """

    __slots__ = ("_messages", "_next", "_watch")

    def __init__(self, messages: _Messages, watch: _Watch):
        self._messages, self._next, self._watch = messages, 0, watch

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._messages)

    def __next__(self):
        messages, reads = self._messages, self._messages._reads
        j = messages._start + self._next
        caller = sys._getframe(1).f_code
        stepping = caller is self._watch.loop_step or caller.co_filename == self._watch.template_file
        if stepping and not reads.count and reads.furthest < j:
            reads.cuts[j] = reads.written
        if self._next >= len(messages._items):
            reads.count = True
            raise StopIteration
        self._next += 1
        messages._read(self._next - 1)
        return messages._items[self._next - 1]


# what the tail may be made of: output, literal text and choices, read from variables it never assigns
_TAIL_NODES = frozenset({"Output", "If", "TemplateData", "Const", "Name", "Getattr", "Getitem", "Filter", "Test", "Not",
                         "And", "Or", "Compare", "Operand", "Concat", "CondExpr", "Add", "Sub", "Mul", "Div",
                         "FloorDiv", "Mod", "Pos", "Neg", "Keyword", "Slice", "Tuple", "List"})
_NOT_CONSTANT = frozenset({"messages", "tools", "documents", "loop", WATCH})  # differ between records or prefixes
_IMMUTABLE = frozenset({str, int, float, bool, type(None)})  # values the tail may read from a rendering's state


def _tail_reads(nodes_after: list, unsafe: set[str]) -> set[str] | None:
    """The names ``nodes_after`` read, if they output text chosen only by ``add_generation_prompt``,
    by variables the template never assigns (special tokens such as Phi-3.5's ``eos_token``, template
    arguments) and by names it assigns only at its top level before the message loop (``unsafe``:
    every other name it assigns); else None.

    Why that text is the same after every vouched prefix's loop as after the whole conversation's,
    for the same values of those names: it is built of output, literals, choices and filters (no
    call, no assignment, no loop; checked node by node on the syntax tree), and reads neither the
    messages, nor the tools, nor ``loop``. A name no statement sets is the value the rendering was
    given, the same for every prefix of a record. A name set only at the top level before the loop
    (directly or under a top-level ``{% if %}``, which opens no scope) keeps through the loop the
    value it had when the loop began: a ``{% set %}`` in the loop's body binds a name of the body's
    own scope. Up to a vouched cut the prefix's rendering ran the same code on the same data as the
    whole one, so that value is the same in both; where it is immutable (a string, a number, a bool,
    None: checked on each rendering) nothing in the loop can have changed it. A namespace can be
    changed in the loop (``{% set ns.x = ... %}``): a tail that reads one cuts nothing.
    """
    from jinja2 import nodes

    read = set()
    for top in nodes_after:
        if not isinstance(top, (nodes.Output, nodes.If)):
            return None
        for node in [top, *top.find_all(nodes.Node)]:
            if type(node).__name__ not in _TAIL_NODES:
                return None
            if isinstance(node, nodes.Name):
                if node.ctx != "load" or node.name in unsafe or node.name in _NOT_CONSTANT:
                    return None
                read.add(node.name)
    return read


def _unsafe_names(tree, loop: int) -> set[str]:
    """Every name the template sets, loops over, imports or defines as a macro, except where it is
    set only at its top level before its ``loop``-th top-level statement (see ``_tail_reads``)."""
    from jinja2 import nodes

    safe: set[int] = set()  # the ids of the Name nodes that assign at the top level before the loop
    stack = list(tree.body[:loop])
    while stack:
        node = stack.pop()
        if isinstance(node, (nodes.Assign, nodes.AssignBlock)):
            safe |= {id(n) for n in [node.target, *node.target.find_all(nodes.Name)] if isinstance(n, nodes.Name)}
        elif isinstance(node, nodes.If):
            stack += [*node.body, *node.elif_, *node.else_]
    names = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param") and id(n) not in safe}
    names |= {n.name for n in tree.find_all(nodes.Macro)}
    names |= {n.target for n in tree.find_all(nodes.Import)}
    for imported in tree.find_all(nodes.FromImport):
        names |= {name if isinstance(name, str) else name[1] for name in imported.names}
    return names


def _watchable(environment, source: str) -> _Watch | None:
    """The template rewritten so that its message loop runs on ``WATCH(...)``; None if its shape
    does not allow the watch."""
    from jinja2 import nodes
    from jinja2.runtime import LoopContext

    tree = environment.parse(source)
    if tree.find(nodes.Extends) is not None:
        return None
    loops = [i for i, node in enumerate(tree.body) if isinstance(node, nodes.For)]
    if not loops:
        return None
    loop, after = tree.body[loops[-1]], tree.body[loops[-1] + 1 :]
    if loop.else_ or loop.test is not None or loop.recursive:
        return None
    reads = _tail_reads(after, _unsafe_names(tree, loops[-1]))
    if reads is None:
        return None
    tail = environment.from_string(nodes.Template(after, lineno=1))
    snapshot_globals(tail)
    loop.iter = nodes.Call(nodes.Name(WATCH, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    template = environment.from_string(tree)
    snapshot_globals(template)
    return _Watch(template, tail, template.root_render_func.__code__.co_filename, LoopContext.__next__.__code__,
                  frozenset(reads))


def choose_template(tokenizer, variables: dict | None = None) -> ChatTemplate:
    """The one-pass template where it can be built and agrees with the reference on :data:`PROBES`;
    else the reference :class:`ChatTemplate`, with a warning saying why it is slower."""
    import warnings

    reference = ChatTemplate(tokenizer, variables=variables)
    if not reference.source:
        return reference  # nothing to render (plain text only)
    try:
        fast = OnePassTemplate(tokenizer, variables)
        for messages in PROBES:
            for train_on in ("assistant", "all"):
                if _outcome(fast, messages, train_on) != _outcome(reference, messages, train_on):
                    raise Unavailable(f"it renders {messages!r} differently from the reference")
    except Unavailable as exc:
        warnings.warn(f"rendering the chat template the reference way, every prefix on its own (slower): {exc}",
                      stacklevel=2)
        return reference
    fast.work = Work()  # the probes' work is not the output's
    return fast


def _outcome(template: ChatTemplate, messages: list[dict], train_on: str):
    try:
        rendered = render_conversation(template, Conversation(messages=messages), train_on)
    except Rejected as exc:
        return exc.code, str(exc)
    return (rendered.text, rendered.spans, rendered.turns_not_located, rendered.turns_out_of_context,
            [(r.text, r.spans) for r in rendered.earlier])


class OnePassTemplate(ChatTemplate):
    """A chat template compiled in its own sandbox, whose prefixes are cut from one watched rendering
    where the watch vouches for them and rendered on their own otherwise."""

    name = "one-pass"

    def __init__(self, tokenizer, variables: dict | None = None):
        super().__init__(tokenizer, variables=variables)  # compiles the template, once
        try:
            self._watch = _watchable(self._compiled.environment, self.source)
        except Exception as exc:  # Jinja's internals are not what the watch relies on
            raise Unavailable(f"the installed Jinja differs from what the watch relies on: {exc!r}") from exc
        if self._watch is None:
            raise Unavailable("the template's shape does not allow it (its message loop is not the last "
                              "top-level loop, or text after it depends on more than add_generation_prompt and "
                              "variables the template never assigns)")
        # the variables every watched rendering gets besides its messages and tools
        self._variables = {"documents": None, "add_generation_prompt": False, WATCH: self._watch.loop, **self._special}
        self._tails: dict[tuple, dict[bool, str] | None] = {}  # a rendering's state -> its tails (see _tail)

    def with_variables(self, extra: dict | None) -> "ChatTemplate":
        clone = super().with_variables(extra)
        if clone is not self:
            clone._tails = {}  # the tail may read a template argument
        return clone

    def _tail(self, state: tuple) -> dict[bool, str] | None:
        """The text after the message loop (see ``_tail_reads``) without and with the generation
        prompt, for this copy's variables and a rendering's ``state`` (the values it set of the names
        the tail reads); None where the tail fails on its own (then it vouches for no cut)."""
        if state not in self._tails:
            variables = {"documents": None, **self._special, **self.variables, **dict(state)}
            try:
                self._tails[state] = {g: self._watch.tail.render(**{**variables, "add_generation_prompt": g})
                                      for g in (False, True)}
            except Exception:
                self._tails[state] = None
        return self._tails[state]

    def render_with_prefixes(self, messages: list[dict], tools: list | None):
        """``render(messages)``, and a function ``prefix(n, g)`` equal to
        ``render(messages[:n], add_generation_prompt=g)``: cut from the one rendering where the watch
        vouches for it, rendered otherwise."""
        watch = self._watch
        if watch is None:
            text, cuts, tails = self.render(messages, tools), {}, None
        else:
            text, cuts, tails = self._render_watched(watch, messages, tools)

        def prefix(n: int, generation: bool) -> str:
            if n in cuts:
                return text[: cuts[n]] + tails[generation]
            self.work.prefixes += 1
            return self.render(messages[:n], tools, generation)

        return text, prefix

    def _render_watched(self, watch: _Watch, messages, tools) -> tuple[str, dict[int, int], dict | None]:
        """The rendering, its cuts and its tails; no cuts where the loop's end could not be vouched for."""
        reads = _Reads()
        context = watch.template.new_context({"messages": _Messages(messages, reads), "tools": tools,
                                              **self._variables, **self.variables})
        parts = []
        try:
            for part in watch.template.root_render_func(context):
                parts.append(part)
                reads.written += len(part)
                if reads.written > RENDERED_CHARS:  # the reference's bound (its Environment.concat)
                    raise RenderTooLong()
        except RenderTooLong:  # the record's size: the encoder rejects it; the watch stays on
            raise
        except Exception:
            text = self.render(messages, tools)  # a record the template rejects is rejected the reference way
            self._watch = None  # the template does something the stand-in refuses: stop watching it
            return text, {}, None
        text = self.work.add("".join(parts))  # what the plain template renders: the stand-in is faithful or raises
        state = tuple(sorted((name, context.vars[name]) for name in watch.reads if name in context.vars))
        if any(type(value) not in _IMMUTABLE for _, value in state):
            return text, {}, None  # a namespace, say: the loop may have changed what the tail reads
        end, tails = reads.cuts.get(len(messages)), self._tail(state)
        if end is None or tails is None or text[end:] != tails[False]:
            return text, {}, None
        return text, reads.cuts, tails
