"""Step 3: every input record read, normalized and encoded, part by part, on any engine.

``pack`` and ``stats`` both encode through :class:`Encoding`: the same readers, formats, chat
template, labels and rejections, so what ``stats`` measures is what ``pack`` packs. The inputs are
cut into parts (parts.plan_parts); a worker reads, normalizes and encodes a part on its own and hands
the records to a *sink* (pack's spills tokens to a file, stats' keeps lengths), so the driver never
sees a record: it merges each part's small result, in part order, into one :class:`Ledger` that
counts every record and says what became of it.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import tempfile
import threading
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

from .errors import ConfigError, InputError, WorkerDied
from .ledger import Ledger, RecordFailure
from .normalize import Conversation, FieldNames, Policy, Rejected, detect_format, normalize
from .parts import Part, first_records, read_part
from .read import Record, Source
from .template_fit import fit_to_template
from .template_inputs import prepare_template
from .tokenization import GUARD_CHARS, ChatEncoder, Encoded, load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from .engines import Engine
    from .settings import PackConfig

BATCH = 256  # conversations a tokenizer call
TOKENIZER_FILES_LIMIT = 64 << 20  # a tokenizer folder travels to remote workers as its files up to this size

Item = tuple[int, Record, "Conversation | Rejected", "Encoded | Rejected"]  # (record number in the part, ...)


class Sink(Protocol):
    """What a worker does with a part's encoded records (pack: spill tokens; stats: keep lengths)."""

    def take(self, batch: list[Item], ledger: "Ledger") -> int:
        """Keep what stays of ``batch`` (rejecting through ``ledger``); return the tokens kept."""
        ...

    def finish(self) -> Any:
        """The part's small result for the driver."""
        ...


@dataclass
class Encoding:
    """The inputs of a run ready to encode: their formats, and the tokenizer and its encoder."""

    sources: list[Source]
    formats: list[str]
    fields: list[FieldNames]  # a source's own messages_field (a mixture's), else the run's
    tokenizer: Any  # the loaded Hugging Face tokenizer
    tokenizer_name: str  # as given: a folder or a Hub id
    encoder: ChatEncoder
    config: "PackConfig"
    policy: Policy  # how records are fitted to training and to this template (normalize.py)

    @classmethod
    def open(cls, sources: list[Source], tokenizer: str, config: "PackConfig", max_len: int | None = None) -> "Encoding":
        """Load the tokenizer, tell each input's format, and check the chat template against ``max_len``
        (default ``config.max_len``) before any record is encoded."""
        tok = load_tokenizer(tokenizer)
        encoder = ChatEncoder(tok, config.train_on, config.tokenizer_backend, variables=_template_variables(tok, config),
                              turn_context=config.turn_context, content_special=config.content_special_tokens,
                              render_timeout=config.render_timeout)
        fields = [FieldNames(s.messages_field or config.messages_field, config.text_field) for s in sources]
        formats = [_source_format(s, s.format or config.format, f, config.preference) for s, f in zip(sources, fields)]
        with encoder.probing():
            _check_template(encoder, formats, config.max_len if max_len is None else max_len)
            policy = _record_policy(encoder, config)
        return cls(sources, formats, fields, tok, tokenizer, encoder, config, policy)

    def run(self, engine: "Engine", parts: list[Part], ledger: "Ledger", sink: Callable[[Part], Sink]) -> Iterator["PartResult"]:
        """Encode ``parts`` (``packprep.pipeline.plan_parts``) on ``engine``; merge each result into
        ``ledger`` in input order and yield it (``payload``: its sink's result; ``sink(part)`` makes a
        part's sink, in the worker)."""
        context = EncodeContext(self.tokenizer_name, self.config, self.fields, self.policy, self.formats, sink,
                                self.encoder, forced=[bool(s.format or self.config.format) for s in self.sources])
        merged = _Merge(self.sources, ledger)
        for part, result in zip(parts, self._guarded(engine, context, parts)):
            _note_backend(self.encoder, result.backend)
            merged.add(part, result)
            yield result
        merged.finish()

    def _guarded(self, engine: "Engine", context: EncodeContext, parts: list[Part]) -> Iterator["PartResult"]:
        """The encode stage's results, in part order. With tiktoken, the data guard runs beside it
        (:class:`DataGuard`) and no result is given out before the guard has passed; where it finds
        a difference, the results are dropped (every task ended first) and the stage runs again
        with HF, whose results alone are given out: the output is what HF alone gives."""
        if self.encoder.backend_name != "tiktoken":
            yield from engine.map(encode_part, context, parts)
            return
        guard = DataGuard(context, parts)
        stage = engine.map(encode_part, context, parts)
        try:
            held = []
            for result in stage:
                held.append(result)
                if guard.finished:
                    break
            problem = guard.verdict()
            if problem is None:
                yield from held
                yield from stage
                return
        finally:
            stage.close()  # a local engine waits for its running tasks: none writes a spill after this
            guard.stop()  # nor does the guard outlive the stage (a run that fails, say)
        self.encoder._refuse_tiktoken(problem, True, f" (found by the check of this run's first {guard.chars:,} "
                                      "characters against HF); encoding every record again with HF")
        _ = self.encoder._backend  # the HF tokenizer, built here once: forked workers share it
        yield from engine.map(encode_part, replace(context, config=replace(self.config, tokenizer_backend="hf")),
                              parts)


@dataclass
class EncodeContext:
    """What every encode task shares. Forked workers inherit the driver's loaded ``encoder``; on a
    Ray node it is loaded from ``tokenizer_files`` by :meth:`load`, once a node, before the node's
    workers fork."""

    tokenizer_name: str
    config: "PackConfig"
    fields: list[FieldNames]  # a source's
    policy: Policy
    formats: list[str]
    sink: Callable[[Part], Sink]
    encoder: ChatEncoder | None = None
    tokenizer_files: dict[str, bytes] | None = None  # the folder's files, once the context travels
    forced: list[bool] = field(default_factory=list)  # a source's format was given, not detected per record

    def __getstate__(self) -> dict:
        # a loaded tokenizer does not pickle: the receiving process loads it again, from the files
        files = self.tokenizer_files or _tokenizer_files(self.tokenizer_name)
        return {**self.__dict__, "encoder": None, "tokenizer_files": files}

    def load(self) -> None:
        """Load the tokenizer now: an engine does this before it forks workers, which then share it."""
        self.loaded_encoder()

    def loaded_encoder(self) -> ChatEncoder:
        if self.encoder is None:
            name = self.tokenizer_name
            if self.tokenizer_files is not None:
                self._folder = tempfile.TemporaryDirectory(prefix="packprep-tokenizer-")
                for file_name, data in self.tokenizer_files.items():
                    with open(os.path.join(self._folder.name, file_name), "wb") as handle:
                        handle.write(data)
                name = self._folder.name
            tokenizer = load_tokenizer(name)
            self.encoder = ChatEncoder(tokenizer, self.config.train_on, self.config.tokenizer_backend,
                                       variables=_template_variables(tokenizer, self.config),
                                       turn_context=self.config.turn_context,
                                       content_special=self.config.content_special_tokens,
                                       render_timeout=self.config.render_timeout)
        return self.encoder


@dataclass
class PartResult:
    """What a worker says about one part: counts, rejections and its sink's result; records are
    numbered from the part's start (the driver knows where each part starts once earlier ones are in)."""

    lines: int = 0  # lines read (JSONL): where the next part of the file starts counting
    status: bytearray = field(default_factory=bytearray)  # each record's fate
    reasons: Counter = field(default_factory=Counter)
    changes: Counter = field(default_factory=Counter)
    formats: Counter = field(default_factory=Counter)
    turns_not_located: int = 0
    context: Counter = field(default_factory=Counter)  # Ledger.context
    cut: Counter = field(default_factory=Counter)  # Ledger.cut
    rejects: list[dict] = field(default_factory=list)
    failure: dict | None = None  # --on-error fail: the first bad record; nothing after it was read
    tokens: int = 0
    backend: str = ""
    payload: Any = None

    @property
    def records(self) -> int:
        return len(self.status)


def encode_part(context: EncodeContext, part: Part) -> PartResult:
    """The encode stage: read, normalize and encode one part, and hand its records to a sink."""
    encoder = context.loaded_encoder()
    ledger = Ledger(context.config.on_error)
    sink = context.sink(part)
    seen: Counter = Counter()
    records = read_part(part)
    tokens = 0
    failure = None
    with encoder.one_thread():  # the engine's workers are the parallelism
        try:
            for batch in _in_batches(_normalized(context, part, records, ledger, seen), BATCH):
                done = iter(encoder.encode([c for _, _, c in batch if not isinstance(c, Rejected)]))
                items = [(n, r, c, c if isinstance(c, Rejected) else next(done)) for n, r, c in batch]
                tokens += sink.take(items, ledger)
        except RecordFailure as exc:
            failure = {"file": exc.record.file, "index": exc.record.index, "line": exc.record.line,
                       "reason": exc.reason}
    return PartResult(records.lines, ledger.status, ledger.reasons, ledger.changes, seen,
                      ledger.turns_not_located, ledger.context, ledger.cut, ledger.entries, failure, tokens,
                      encoder.backend_name, sink.finish())


def _normalized(context: EncodeContext, part: Part, records: Iterable[Record], ledger: "Ledger",
                seen: Counter) -> Iterator[tuple[int, Record, Conversation | Rejected]]:
    """A part's records, numbered by ``ledger``, each normalized or the ``Rejected`` in its place
    (``seen`` counts their formats): what the encode stage encodes, and the data guard checks."""
    fmt, forced, fields = context.formats[part.source], context.forced[part.source], context.fields[part.source]
    for record in records:
        number = ledger.add()
        if record.error is not None:
            yield number, record, Rejected(record.error, record.code)
            continue
        data = record.data
        if context.config.preference == "chosen" and isinstance(data, dict) and "chosen" in data:
            data = chosen_record(data)
        own = fmt if forced else detect_format(data, fields) or fmt
        seen[own] += 1
        try:
            if not fields.messages and isinstance(data, dict) and "conversations" in data and "messages" in data:
                raise Rejected("the record has both 'conversations' and 'messages'; pass --messages-field to say "
                               "which holds the conversation", "ambiguous_record")
            conversation = normalize(data, own, fields, context.policy)
            _check_size(conversation, context.config.max_record_chars, context.config.template_args)
            yield number, record, conversation
        except Rejected as exc:
            yield number, record, exc


def _check_size(conversation: Conversation, limit: int, template_args: dict | None = None) -> None:
    """Reject a record whose text is over ``limit`` characters before it is rendered: rendering and
    tokenizing 50 MB takes minutes and GBs in one worker, with no word, for --max-len tokens. The text
    the template is given beside the messages (``--template-arg``, the record's kwargs) counts too."""
    size = _chars([conversation.messages, conversation.tools, conversation.text, conversation.template_kwargs,
                   template_args])
    if size > limit:
        raise Rejected(f"the record holds {size:,} characters of text, over --max-record-chars {limit:,}; raise "
                       "it to pack the record anyway (slow; cut per --overlong)", "record_too_long")


def _chars(value: Any) -> int:
    """Characters in the strings of a normalized record (keys aside)."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if type(item) is str:
            size += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return size


def chosen_record(data: dict) -> dict:
    """A preference record (a conversation or prompt, and its 'chosen' and 'rejected' replies: DPO data)
    as one conversation that ends with the chosen reply (``--preference chosen``)."""
    chosen, rest = data["chosen"], {k: v for k, v in data.items() if k not in ("chosen", "rejected")}
    key = next((k for k in ("conversations", "messages") if isinstance(data.get(k), list)), None)
    sharegpt = key == "conversations"
    if key is None:  # TRL's layout: a prompt (text or messages) beside the replies
        prompt = data.get("prompt")
        key, rest["messages"] = "messages", prompt if isinstance(prompt, list) else \
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []
    if isinstance(chosen, str):
        chosen = {"from": "gpt", "value": chosen} if sharegpt else {"role": "assistant", "content": chosen}
    rest[key] = [*rest[key], *(chosen if isinstance(chosen, list) else [chosen])]
    return rest


class DataGuard:
    """The data guard of a run that encodes with tiktoken: a process forked from the driver as the
    encode stage starts renders the run's first texts as the stage does (the first parts' records,
    in input order, up to ``GUARD_CHARS`` characters: what the workers encode first) and compares
    the fast path's ids and cuts on them with HF's (``ChatEncoder.differs_from_hf``), building the
    HF tokenizer there. ``Encoding.run`` gives out no result before it has passed.

    A process rather than a thread of the driver: building llama3's HF tokenizer holds the GIL for
    0.4-0.5 s, which would stall the driver for as long (the pool's feeding of its workers, or the
    one worker that runs in the driver); and the HF tokenizer's 100-145 MiB leave with the process.
    It ends with ``os._exit`` (multiprocessing's way): no atexit handler of the driver runs there.
    """

    NAME = "packprep-data-guard"
    checked = 0  # characters compared with HF by this process's data guards (tests read it)

    def __init__(self, context: EncodeContext, parts: list[Part]):
        import multiprocessing

        self.context, self.parts = context, parts
        self.chars = 0  # of the texts compared
        self._said = None  # what the guard sent: ("ok", (chars, problem or None)) or ("error", exception)
        self._receive, send = multiprocessing.Pipe(duplex=False)
        self._process = multiprocessing.get_context("fork").Process(target=self._run, args=(send,), name=self.NAME,
                                                                    daemon=True)
        try:
            with _interrupt_after_fork():
                self._process.start()
        finally:
            send.close()  # the guard's end is the only one left: its death is an EOF here

    @property
    def finished(self) -> bool:
        return self._said is not None or self._receive.poll()

    def verdict(self) -> str | None:
        """Wait for the guard: None if it found no difference, else the first; its error if it failed."""
        if self._said is None:
            try:
                self._said = self._receive.recv()
            except EOFError:
                pass
            self._process.join()
            self._receive.close()
            if self._said is None:
                self._said = ("error", WorkerDied.of("the data guard's process (tiktoken against HF on the first "
                                                     "texts)", self._process.exitcode))
            if self._said[0] == "ok":
                self.chars = self._said[1][0]
                DataGuard.checked += self.chars
        kind, value = self._said
        if kind == "error":
            raise value
        return value[1]

    def stop(self) -> None:
        """End the guard's process: a run that fails does not wait for it."""
        if self._said is None and self._process.is_alive():
            self._process.kill()
        self._process.join()

    def _run(self, send) -> None:
        """In the forked process."""
        gc.freeze()  # the driver's objects stay out of this process's collections: no copy-on-write of them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, beside the workers
        try:
            with self.context.encoder.one_thread():
                rendered = self._first_texts()
                said = ("ok", (sum(len(r.text) for r in rendered), self.context.encoder.differs_from_hf(rendered)))
        except BaseException as exc:  # the driver raises it
            said = ("error", exc)
        try:
            pickle.loads(pickle.dumps(said))
        except Exception:  # an error that would not arrive whole
            said = ("error", RuntimeError(f"the data guard failed: {said[1]!r}"))
        try:
            send.send(said)
        except OSError:  # the driver is gone
            pass

    def _first_texts(self) -> list:
        """The texts the run encodes first, rendered as ``ChatEncoder.encode`` renders them."""
        encoder, rendered, chars = self.context.encoder, [], 0
        for part in self.parts:
            for _, _, conversation in _normalized(self.context, part, read_part(part), Ledger(), Counter()):
                if isinstance(conversation, Rejected):
                    continue
                try:
                    r = encoder.render(conversation)
                except Rejected:
                    continue
                rendered += [*r.earlier, r]
                chars += sum(len(piece.text) for piece in (*r.earlier, r))
                if chars >= GUARD_CHARS:
                    return rendered
        return rendered


@contextmanager
def _interrupt_after_fork():
    """A Ctrl-C that arrives while this process forks is raised once the fork is done: CPython may
    run its handler inside the fork's after-fork callbacks, which drop the KeyboardInterrupt (the
    run would go on). The forked process keeps the stand-in handler: the driver ends it."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None:  # not the main thread, or a handler Python did not install: leave it be
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)  # Python's own raises KeyboardInterrupt here
        elif caught and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class _Merge:
    """Folds part results into the run's ledger, in part order, numbering records across parts:
    source index (over all inputs), record index and line (within the file)."""

    def __init__(self, sources: list[Source], ledger: "Ledger"):
        self.sources, self.ledger = sources, ledger
        self.records = {n: 0 for n in range(len(sources))}
        self.lines = dict(self.records)

    def add(self, part: Part, result: PartResult) -> None:
        ledger, source = self.ledger, part.source
        base, index_base, line_base = len(ledger.status), self.records[source], self.lines[source]
        if result.failure is not None:
            failure = result.failure
            where = (f"line {failure['line'] + line_base}" if failure["line"] else
                     f"record {failure['index'] + index_base}")
            raise InputError(f"{failure['file']}, {where}: {failure['reason']} "
                             "(use --on-error skip to set such records aside)")
        ledger.status += result.status
        ledger.reasons.update(result.reasons)
        ledger.changes.update(result.changes)
        ledger.turns_not_located += result.turns_not_located
        ledger.context.update(result.context)
        ledger.cut.update(result.cut)
        ledger.formats.setdefault(source, Counter()).update(result.formats)
        for entry in result.rejects:
            entry["index"] += index_base
            entry["source_index"] += base
            if entry["line"]:
                entry["line"] += line_base
            ledger.write(entry)
        self.records[source] += result.records
        self.lines[source] += result.lines

    def finish(self) -> None:
        for number, source in enumerate(self.sources):
            source.records = self.records[number]


def _source_format(source: Source, fmt: str | None, fields: FieldNames, preference: str = "refuse") -> str:
    """The format of one input: forced by --format, else detected from its first decodable record.
    Preference data is refused unless ``preference`` says what to train on."""
    records = first_records(source, 100)
    first = next((record.data for record in records if isinstance(record.data, dict)), None)
    if preference == "refuse" and first is not None and "chosen" in first and "rejected" in first:
        raise InputError(
            f"{source.path}: preference data (DPO): each record holds a prompt and a 'chosen' and a 'rejected' "
            "reply to it, not one conversation to learn from. packprep packs conversations for supervised "
            "training: pass --preference chosen to train on each prompt with its chosen reply (rejected replies "
            "are left out); for DPO itself, give the file to TRL's DPOTrainer as it is.")
    if fmt:
        return fmt
    for record in records:
        if record.error is None:
            fmt = detect_format(chosen_record(record.data) if preference == "chosen" and isinstance(record.data, dict)
                                and "chosen" in record.data else record.data, fields)
            if fmt:
                return fmt
    raise InputError(f"{source.path}: {_why_no_format(records)}")


def _why_no_format(records: list) -> str:
    """Why no format could be told from a file's first records, in their own terms."""
    if not records:
        return "the file holds no records (it is empty, or holds blank lines, an empty array or zero rows)"
    if all(record.error is not None for record in records):
        first = records[0]
        where = f"line {first.line}" if first.line else f"record {first.index}"
        hint = ""
        if first.line and str(first.data).strip() in ("{", "["):
            hint = (" It looks like pretty-printed JSON objects one after another: write one object per line "
                    "(JSON Lines), or one JSON array in a .json file.")
        return f"none of its first {len(records)} records can be decoded ({where}: {first.error}).{hint}"
    keys = next((sorted(r.data)[:8] for r in records if isinstance(r.data, dict)), None)
    return ("cannot tell the record format from its first records" + (f" (keys: {', '.join(keys)})" if keys else "")
            + "; expected 'conversations' (ShareGPT), 'messages' (OpenAI), 'instruction'+'output' (Alpaca) or "
            "'text' keys. Pass --format, or --messages-field for other column names.")


def _check_template(encoder: ChatEncoder, formats: list[str], max_len: int) -> None:
    if any(fmt != "text" for fmt in formats):
        if not encoder.has_template:
            raise ConfigError(
                "the tokenizer has no chat template, so conversations cannot be rendered; use a "
                "tokenizer with one (tokenizer_config.json 'chat_template'), or --format text"
            )
        probe = Conversation(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}])
        encoded = encoder.encode([probe])[0]
        if isinstance(encoded, Encoded) and len(encoded.input_ids) >= max_len:
            raise ConfigError(
                f"--max-len {max_len} is not more than the chat template's own overhead "
                f"({len(encoded.input_ids)} tokens for a one-word exchange); raise --max-len"
            )


def _record_policy(encoder: ChatEncoder, config: "PackConfig") -> Policy:
    """How records are fitted to training and to this tokenizer's chat template (normalize.py)."""
    if not encoder.has_template:
        return Policy(config.leading_assistant, config.consecutive)
    return fit_to_template(encoder.template.render, config.leading_assistant, config.consecutive, config.system,
                           config.reasoning, config.tool_calls)


def _template_variables(tokenizer, config: "PackConfig") -> dict:
    """The run's named template picked on ``tokenizer``, and what its renderings get (template_inputs.py)."""
    return prepare_template(tokenizer, config.chat_template, config.date, config.template_args)


def _in_batches(iterable: Iterable, size: int) -> Iterator[list]:
    iterator = iter(iterable)
    while batch := list(islice(iterator, size)):
        yield batch


def _note_backend(encoder: ChatEncoder, backend: str) -> None:
    """Record the backend that encoded a batch; when a worker fell back, say so here (its own
    warning stays in the worker)."""
    if backend != encoder.backend_name and backend not in encoder.backends_used:
        warnings.warn(f"a worker tokenized with {backend}, not {encoder.backend_name}: its runtime check found "
                      "a text tiktoken tokenizes differently from HF (the output is HF's either way)", stacklevel=2)
    encoder.backends_used.add(backend)


def _tokenizer_files(tokenizer: str) -> dict[str, bytes] | None:
    """A tokenizer folder's files, so that workers on other machines need not see the folder;
    None for a Hub id or a folder that holds more than tokenizer files (weights beside them)."""
    if not os.path.isdir(tokenizer):
        return None
    files, total = {}, 0
    for name in sorted(os.listdir(tokenizer)):
        path = os.path.join(tokenizer, name)
        if os.path.isfile(path):
            total += os.path.getsize(path)
            if total > TOKENIZER_FILES_LIMIT:
                return None
            with open(path, "rb") as handle:
                files[name] = handle.read()
    return files
