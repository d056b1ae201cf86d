"""Optional accelerator for render.py: every prefix rendering cut out of one rendering per conversation.

The definition (render.py) costs two prefix renderings per assistant turn, quadratic in the turns.
This renders each conversation once and watches the template run:

1. The template's last top-level ``{% for %}`` is its message loop, and everything after that loop
   must be text that depends on nothing but ``add_generation_prompt`` and variables the template
   never assigns (special tokens, template arguments; checked once, on the template's syntax tree,
   see ``_is_tail``). Call that text the *tail*: for given variables, the same after every prefix.
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
from .render import ChatTemplate, Work, render_conversation, snapshot_globals

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


def _is_tail(nodes_after: list, assigned: set[str]) -> bool:
    """Whether ``nodes_after`` output text chosen only by ``add_generation_prompt`` and by variables
    the template never assigns (special tokens such as Phi-3.5's ``eos_token``, template arguments).

    Why that text is the same after every prefix's loop: it is built of output, literals, choices
    and filters (no call, no assignment, no loop; checked node by node on the syntax tree), and
    every name it reads is one that no statement of the template sets, loops over, imports or
    defines, so its value there is the value the rendering was given, which is the same for every
    prefix of a record (the messages, tools and documents excepted, and refused). Rendered as a
    template of its own with the same variables, it therefore writes what it writes after the loop.
    """
    from jinja2 import nodes

    for top in nodes_after:
        if not isinstance(top, (nodes.Output, nodes.If)):
            return False
        for node in [top, *top.find_all(nodes.Node)]:
            if type(node).__name__ not in _TAIL_NODES:
                return False
            if isinstance(node, nodes.Name) and (node.ctx != "load" or node.name in assigned
                                                 or node.name in _NOT_CONSTANT):
                return False
    return True


def _assigned_names(tree) -> set[str]:
    """Every name the template sets, loops over, imports or defines as a macro."""
    from jinja2 import nodes

    names = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")}
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
    if not _is_tail(after, _assigned_names(tree)):
        return None
    tail = environment.from_string(nodes.Template(after, lineno=1))
    snapshot_globals(tail)
    loop.iter = nodes.Call(nodes.Name(WATCH, "load"), [loop.iter], [], None, None, lineno=loop.lineno)
    template = environment.from_string(tree)
    snapshot_globals(template)
    return _Watch(template, tail, template.root_render_func.__code__.co_filename, LoopContext.__next__.__code__)


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
    fast.prefix_renders, fast.work = 0, Work()  # the probes' work is not the output's
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
        self._tails: dict[bool, str] | None = None  # tail(g) for this copy's variables

    def with_variables(self, extra: dict | None) -> "ChatTemplate":
        clone = super().with_variables(extra)
        if clone is not self:
            clone._tails = None  # the tail may read a template argument
        return clone

    def _tail(self, generation: bool) -> str | None:
        """The text after the message loop (see ``_is_tail``), rendered with this copy's variables."""
        if self._tails is None:
            variables = {"documents": None, **self._special, **self.variables}
            try:
                self._tails = {g: self._watch.tail.render(**variables, add_generation_prompt=g) for g in (False, True)}
            except Exception:  # a tail that fails on its own cannot vouch for a cut: every prefix rendered
                self._tails = {False: None, True: None}
        return self._tails[generation]

    def render_with_prefixes(self, messages: list[dict], tools: list | None):
        """``render(messages)``, and a function ``prefix(n, g)`` equal to
        ``render(messages[:n], add_generation_prompt=g)``: cut from the one rendering where the watch
        vouches for it, rendered otherwise."""
        watch = self._watch
        if watch is None:
            text, cuts = self.render(messages, tools), {}
        else:
            text, cuts = self._render_watched(watch, messages, tools)

        def prefix(n: int, generation: bool) -> str:
            if n in cuts:
                return text[: cuts[n]] + self._tail(generation)
            self.prefix_renders += 1
            return self.render(messages[:n], tools, generation)

        return text, prefix

    def _render_watched(self, watch: _Watch, messages, tools) -> tuple[str, dict[int, int]]:
        """The rendering and its cuts; no cuts where the loop's end could not be vouched for."""
        reads = _Reads()
        context = watch.template.new_context({"messages": _Messages(messages, reads), "tools": tools,
                                              **self._variables, **self.variables})
        parts = []
        try:
            for part in watch.template.root_render_func(context):
                parts.append(part)
                reads.written += len(part)
        except Exception:
            text = self.render(messages, tools)  # a record the template rejects is rejected the reference way
            self._watch = None  # the template does something the stand-in refuses: stop watching it
            return text, {}
        text = "".join(parts)  # what the plain template renders: the stand-in is faithful or raises
        self.work.renders += 1
        self.work.chars += len(text)
        end, tail = reads.cuts.get(len(messages)), self._tail(False)
        if end is None or tail is None or text[end:] != tail:
            return text, {}
        return text, reads.cuts


