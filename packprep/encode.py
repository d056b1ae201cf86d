"""Step 3: every input record read, normalized and encoded, in input order, on any engine.

``pack`` and ``stats`` both encode through :class:`Encoding`: the same readers, formats, chat
template, labels and rejections, so what ``stats`` measures is what ``pack`` packs. Each record is
counted in a :class:`Ledger`, which also says what became of it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from .errors import ConfigError, InputError
from .normalize import Conversation, FieldNames, Policy, Rejected, detect_format, fit_to_template, normalize
from .read import Record, Source, read_records
from .tokenize import ChatEncoder, Encoded, load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import PackConfig

# What became of each input record (the manifest counts these; verify checks they add up).
FATES = ("packed", "truncated", "split", "rejected")
PACKED, TRUNCATED, SPLIT, REJECTED = range(len(FATES))
BATCH = 256  # conversations a batch: the unit handed to a worker process or a Ray actor


@dataclass
class Encoding:
    """The inputs of a run ready to encode: their formats, and the tokenizer and its encoder."""

    sources: list[Source]
    formats: list[str]
    fields: FieldNames
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
        encoder = ChatEncoder(tok, config.train_on, config.tokenizer_backend)
        fields = FieldNames(config.messages_field, config.text_field)
        formats = [_source_format(source, config.format, fields) for source in sources]
        _check_template(encoder, formats, config.max_len if max_len is None else max_len)
        return cls(sources, formats, fields, tok, tokenizer, encoder, config, _record_policy(encoder, config))

    def batches(
        self, ledger: "Ledger", num_proc: int = 1, engine: str = "local", ray_address: str | None = None
    ) -> Iterator[list[tuple[int, Record, Conversation | Rejected, Encoded | Rejected]]]:
        """Every record, in batches in input order, as ``(source_index, record, conversation, encoded)``;
        ``encoded`` is a ``Rejected`` where it could not be (``ledger.accept`` records it)."""
        records = _in_batches(_normalized(self.sources, self.formats, self.fields, ledger, self.policy,
                                          forced=bool(self.config.format)), BATCH)
        for batch, encoded in _encoded_batches(records, self.encoder, self.tokenizer_name, self.config, num_proc,
                                              engine, ray_address):
            yield [(index, record, conversation, item) for (index, record, conversation), item in zip(batch, encoded)]


class Ledger:
    """Where each record ended up; rejected records are written to rejects.jsonl as they happen."""

    def __init__(self, on_error: str = "skip", rejects_path=None):
        self.on_error = on_error
        self.rejects_path = rejects_path  # None: count only (stats)
        self.status = bytearray()  # the FATES index of each record: one byte a record
        self.reasons: Counter = Counter()
        self.turns_not_located = 0
        self.changes: Counter = Counter()  # what normalize.py's transforms changed in the kept records
        self.formats: dict[int, Counter] = {}  # source number -> records of each format
        self._handle = None

    def __enter__(self):
        if self.rejects_path is not None:
            self._handle = open(self.rejects_path, "w", encoding="utf-8")
        return self

    def __exit__(self, *exc):
        if self._handle is not None:
            self._handle.close()
            if not self.reasons:
                os.remove(self.rejects_path)

    def add(self) -> int:
        """Count a new record (packed until said otherwise); return its source index."""
        self.status.append(PACKED)
        return len(self.status) - 1

    def accept(self, record: Record, source_index: int, item: "Encoded | Rejected") -> Encoded | None:
        """The encoded record, or None once a ``Rejected`` in its place is recorded (what a kept record
        brings is counted by :meth:`keep`)."""
        if isinstance(item, Rejected):
            self.reject(record, source_index, str(item), item.code)
            return None
        return item

    def keep(self, conversation: Conversation, encoded: Encoded) -> None:
        """Count what a record that is kept brings: normalizing changes, turns not located."""
        self.changes.update(conversation.changes)
        self.turns_not_located += encoded.turns_not_located

    def formats_seen(self, number: int, fallback: str) -> str:
        """The format of input ``number``'s records, "sharegpt+openai" for a file that mixes them."""
        seen = self.formats.get(number)
        return "+".join(fmt for fmt, _ in seen.most_common()) if seen else fallback

    def reject(self, record: Record, source_index: int, reason: str, code: str) -> None:
        if self.on_error == "fail":
            where = f"line {record.line}" if record.line else f"record {record.index}"
            raise InputError(f"{record.file}, {where}: {reason} (use --on-error skip to set such records aside)")
        self.status[source_index] = REJECTED
        self.reasons[code] += 1
        entry = {
            "file": record.file,
            "index": record.index,
            "line": record.line,
            "source_index": source_index,
            "reason": reason,
            "code": code,
            "record": _preview(record),
        }
        if self._handle is not None:
            self._handle.write(json.dumps(entry, ensure_ascii=False) + "\n")


def _preview(record: Record) -> str:
    """The first 200 characters of the record as it was: raw text if it did not decode, else JSON."""
    if record.error is not None:
        return (record.data or "")[:200]
    return json.dumps(record.data, ensure_ascii=False, default=str)[:200]


def _source_format(source: Source, fmt: str | None, fields: FieldNames) -> str:
    """The format of one input: forced by --format, else detected from its first decodable record."""
    if fmt:
        return fmt
    for record in islice(read_records(source), 100):
        if record.data is not None:
            fmt = detect_format(record.data, fields)
            if fmt:
                return fmt
    raise InputError(
        f"{source.path}: cannot tell the record format from its first records; expected "
        "'conversations' (ShareGPT), 'messages' (OpenAI), 'instruction'+'output' (Alpaca) or 'text' "
        "keys. Pass --format, or --messages-field for other column names."
    )


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
    return fit_to_template(encoder.template.render, config.leading_assistant, config.consecutive, config.system)


def _normalized(sources, formats, fields, ledger, policy: Policy, forced: bool
                ) -> Iterator[tuple[int, Record, Conversation | Rejected]]:
    """Yield (source_index, record, conversation), or a Rejected in its place, in input order.

    Without --format (``forced``) the format is told per record (a file may mix ShareGPT and OpenAI
    records); a record that shows none is read as its file's format, so that its reason names what
    is missing.
    """
    for number, (source, fmt) in enumerate(zip(sources, formats)):
        seen = ledger.formats.setdefault(number, Counter())
        for record in read_records(source):
            source_index = ledger.add()
            if record.error is not None:
                yield source_index, record, Rejected(record.error, "unreadable")
                continue
            own = fmt if forced else detect_format(record.data, fields) or fmt
            seen[own] += 1
            try:
                yield source_index, record, normalize(record.data, own, fields, policy)
            except Rejected as exc:
                yield source_index, record, exc


def _in_batches(iterable: Iterable, size: int) -> Iterator[list]:
    iterator = iter(iterable)
    while batch := list(islice(iterator, size)):
        yield batch


_WORKER_ENCODER: ChatEncoder | None = None  # set before forking: workers inherit the loaded encoder


def _worker_encode(conversations: list[Conversation]) -> tuple[list, str]:
    """Encode a batch in a worker process; also say which backend did (the guard may have switched)."""
    encoded = _WORKER_ENCODER.encode(conversations)
    return encoded, _WORKER_ENCODER.backend_name


def _encoded_batches(batches, encoder, tokenizer, config, num_proc=1, engine="local", ray_address=None):
    """Yield ``(batch, encoded)`` in input order, encoded in-process, by worker processes or on Ray.

    Records already rejected while normalizing keep their place, so rejections (and
    ``--on-error fail``) follow input order whatever the engine.
    """
    waiting: deque = deque()

    def to_encode():
        for batch in batches:
            waiting.append(batch)
            yield [item for item in batch if not isinstance(item[2], Rejected)]

    for _, encoded in _encode(to_encode(), encoder, tokenizer, config, num_proc, engine, ray_address):
        batch = waiting.popleft()
        done = iter(encoded)
        yield batch, [c if isinstance(c, Rejected) else next(done) for _, _, c in batch]


def _encode(batches, encoder, tokenizer, config, num_proc, engine, ray_address):
    if engine == "ray":
        from .engines.ray import ray_encode_batches

        for batch, (encoded, backend) in ray_encode_batches(batches, tokenizer, config, ray_address, num_proc):
            _note_backend(encoder, backend)
            yield batch, encoded
    elif num_proc == 1:
        for batch in batches:
            encoded = encoder.encode([c for _, _, c in batch])
            _note_backend(encoder, encoder.backend_name)
            yield batch, encoded
    else:
        # Forked workers inherit the parent's encoder: no second tokenizer load or tiktoken build.
        # Each worker tokenizes on one thread; the processes are the parallelism.
        global _WORKER_ENCODER
        _WORKER_ENCODER = encoder
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with encoder.one_thread(), ProcessPoolExecutor(num_proc, multiprocessing.get_context("fork")) as pool:
                for batch, (encoded, backend) in _ordered_map(pool, batches, num_proc * 4):
                    _note_backend(encoder, backend)
                    yield batch, encoded
        finally:
            _WORKER_ENCODER = None
            if saved is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved


def _note_backend(encoder: ChatEncoder, backend: str) -> None:
    """Record the backend that encoded a batch; when a worker fell back, say so here (its own
    warning stays in the worker)."""
    if backend != encoder.backend_name and backend not in encoder.backends_used:
        warnings.warn(f"a worker tokenized with {backend}, not {encoder.backend_name}: its runtime check found "
                      "a text tiktoken tokenizes differently from HF (the output is HF's either way)", stacklevel=2)
    encoder.backends_used.add(backend)


def _ordered_map(pool, batches, in_flight: int):
    """Like pool.map, but reads its input lazily so memory stays bounded."""
    pending = []
    for batch in batches:
        pending.append((batch, pool.submit(_worker_encode, [c for _, _, c in batch])))
        if len(pending) >= in_flight:
            batch, future = pending.pop(0)
            yield batch, future.result()
    for batch, future in pending:
        yield batch, future.result()


