"""Step 3b: tokenize rendered conversations and turn their trained character spans into labels.

The conversation is tokenized once; a token is trained when it starts inside a trained span (see
render.py for which spans those are). The tests prove this equals the per-prefix reference on every
real tokenizer and fixture file.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .control_text import ControlText, encode_with_markup, first_tokens, render_record
from .errors import ConfigError, PackprepError
from .layout import IGNORE_INDEX
from .timelimit import RenderTimeout, time_limit
from .tokenizer_folder import RenderTooLong, added_tokens
from .normalize import Conversation, Rejected
from .render import Rendered, template_source
from .turn_ids import AddedTokens, exact_sequences
from .render_onepass import choose_template

TRAIN_ON = ("assistant", "last", "all")
BACKENDS = ("auto", "hf", "tiktoken")
GUARD_CHARS = 200_000  # the first texts encoded are also encoded by HF and compared, up to this many characters


@dataclass
class Encoded:
    """A record's tokens: its last (usually only) sequence, and any earlier ones (render.py, turn_context exact)."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX where not trained
    turns_not_located: int = 0
    control_text: bool = False  # its content spells a control token, encoded as text (control_text.py)
    earlier: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (input_ids, labels) each
    turns_out_of_context: int = 0
    turns_rewritten: int = 0
    changes: dict[str, int] = field(default_factory=dict)  # render.Rendered.changes

    @property
    def sequences(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every sequence of the record, in conversation order (the last is the longest context)."""
        return [*self.earlier, (self.input_ids, self.labels)]

    @property
    def repeated_tokens(self) -> int:
        """Tokens beyond one sequence a record: the price of training every turn in its context."""
        return sum(len(ids) for ids, _ in self.earlier)


def load_tokenizer(name_or_path: str, *, transformers: bool = False):
    """Load a Hugging Face tokenizer by folder or Hub id, with a clear error when it cannot be.

    A folder whose tokenizer.json says everything is read without importing transformers (seconds
    faster to start, see tokenizer_folder.py); ``transformers=True`` always loads it with
    transformers, as the independent checks (``verify --retokenize``, the reference tests) do.
    A name that is not a folder here is a Hub id only if it looks like one (``org/name``); either
    way, it is checked at once (read.check_hub) rather than through the loader's retries.
    """
    from .tokenizer_folder import FolderTokenizer, loadable

    if not transformers and loadable(name_or_path):
        return FolderTokenizer(name_or_path)
    from .read import check_hub, looks_like_hub_id

    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        raise ConfigError(f"tokenizer {name_or_path!r} is a file; pass the folder that holds tokenizer.json "
                          "and tokenizer_config.json")
    if not path.is_dir():
        if not looks_like_hub_id(name_or_path):
            raise ConfigError(f"tokenizer {name_or_path!r}: no such folder")
        try:
            check_hub(name_or_path, "model")
        except PackprepError as exc:
            raise ConfigError(f"tokenizer {str(exc).replace('no such local file or folder', 'no such folder')}") from None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else name_or_path)
    except Exception as exc:
        raise ConfigError(
            f"cannot load tokenizer {name_or_path!r}: {exc}. Pass a folder holding tokenizer.json "
            "and tokenizer_config.json, or a Hub id that is in the local cache (HF_HUB_OFFLINE=1)."
        ) from exc


class ChatEncoder:
    """Renders and tokenizes conversations in batches; one tokenizer call per batch.

    ``backend``: "hf" (the tokenizer itself), "tiktoken" (an exact tiktoken copy of a byte-level BPE
    tokenizer, see tiktoken_backend; ConfigError if none can be made) or "auto" (tiktoken when it can
    be made and agrees with HF on a built-in sample, else HF with a warning). On the tiktoken path the
    first texts encoded (``GUARD_CHARS``) are checked against HF too, ids and labels; on a difference
    the encoder switches to HF for good. Either way the output is what HF alone would give; past the
    guard that rests on the conversion being exact, which ``packprep verify --retokenize N`` checks
    on any output (retokenize.py shares nothing with this path).
    ``backend_name`` is the backend in use.

    A tokenizer folder's conversion, once made and through the guard on the sample, is recorded
    in the cache with HF's ids on that sample (tiktoken_backend.fast_backend). A later run with the
    same tokenizer.json and versions rebuilds it from there, checks it on the recorded ids, and
    builds no ``tokenizers.Tokenizer`` (0.3-0.5 s of start-up for llama3) unless a text needs HF
    (``can_encode``) or ``backend="hf"``; its runtime guard, which needs HF, is off then. ``pack``
    and ``stats`` check their data on every run with tiktoken all the same: the data guard
    (encode.DataGuard, through ``differs_from_hf``) compares the first ``GUARD_CHARS`` characters
    of the run's input with HF in a process beside the workers, and on a difference the encode
    stage runs again with HF. A difference either guard finds is recorded too: later runs then
    use HF from the start.
    """

    def __init__(self, tokenizer, train_on: str = "assistant", backend: str = "auto", variables: dict | None = None,
                 turn_context: str = "exact", content_special: str = "text", render_timeout: float | None = None):
        self.turn_context = turn_context  # the options are PackConfig's, checked there (settings.py)
        self.tokenizer = tokenizer
        self.train_on = train_on
        if backend != "hf" and hasattr(tokenizer, "hash_in_background"):
            tokenizer.hash_in_background()  # the cache key, hashed while the template compiles
        self.render_timeout = render_timeout  # seconds a record's rendering may take (timelimit.py)
        with self.probing():
            # the one-pass accelerator where it agrees with the reference; variables: template_inputs.py
            self.template = choose_template(tokenizer, variables)
        self.requested_backend = backend
        self._fast = None
        self._guard_chars = GUARD_CHARS
        self.backends_used: set[str] = set()  # what encoded the run's data batches, in any process
        if backend != "hf":
            from .tiktoken_backend import fast_backend

            fast, reason, verified_before = fast_backend(tokenizer)
            if fast is None:
                self._refuse_tiktoken(reason)
            elif verified_before:
                self._guard_chars = 0
            self._fast = fast
        self.eos_token_id = tokenizer.eos_token_id  # after fast_backend: a verified record knows it
        self._control = ControlText(tokenizer) if content_special == "text" else None
        self._post = None  # what add_special_tokens=True adds around a text, for control_text.encode_with_markup
        self._added: AddedTokens | None = None  # built on first use (turn_ids.py)

    @contextmanager
    def probing(self):
        """A block that renders the start-up probes: a template that does not finish them stops the run."""
        try:
            with time_limit(self.render_timeout):
                yield
        except RenderTimeout:
            name = getattr(self.tokenizer, "name_or_path", "the tokenizer")
            raise ConfigError(f"the chat template of {name} did not finish rendering a two-message probe "
                              f"conversation in {self.render_timeout:g} s (--render-timeout): it may loop without "
                              "end; fix the template or pass a tokenizer with another") from None
        except RenderTooLong as exc:  # every record would be rejected: the template or the run's variables
            name = getattr(self.tokenizer, "name_or_path", "the tokenizer")
            raise ConfigError(f"{str(exc).replace('the chat template', f'the chat template of {name}')} for a "
                              "probe conversation of a few words, so it would for every record; fix the template "
                              "or the values given to it (--template-arg)") from None

    @property
    def _backend(self):
        """The HF tokenizer (``tokenizers.Tokenizer``), built on first use by a tokenizer folder."""
        return getattr(self.tokenizer, "backend_tokenizer", None)

    @contextmanager
    def one_thread(self):
        """Tokenize on one thread meanwhile: in worker processes, the processes are the parallelism."""
        saved = self._fast.num_threads if self._fast is not None else None
        if self._fast is not None:
            self._fast.num_threads = 1
        try:
            yield
        finally:
            if self._fast is not None:
                self._fast.num_threads = saved

    @property
    def backend_name(self) -> str:
        return "tiktoken" if self._fast is not None else "hf"

    @property
    def backends_summary(self) -> str:
        """For the manifest: "tiktoken", "hf", or "tiktoken+hf" when some process fell back to HF
        after the runtime guard (the output is identical either way)."""
        if len(self.backends_used) > 1:
            return "tiktoken+hf"
        return next(iter(self.backends_used), self.backend_name)

    def _refuse_tiktoken(self, reason: str, remember: bool = False, then: str = "") -> None:
        """Use HF from here on (``then``: what else follows, for the warning)."""
        self._fast = None
        if remember:  # a data guard found it: the next run goes to HF at once
            from .tiktoken_backend import remember_difference

            remember_difference(self.tokenizer, f"an earlier run found that {reason}")
        if self.requested_backend == "tiktoken":
            raise ConfigError(f"--tokenizer-backend tiktoken is not possible with this tokenizer: {reason}")
        warnings.warn(f"tokenizing with Hugging Face tokenizers, not tiktoken: {reason}{then}", stacklevel=3)

    @property
    def has_template(self) -> bool:
        return bool(self.template.source)

    def render(self, conversation: Conversation) -> Rendered:
        """The conversation rendered, in at most ``render_timeout`` seconds (else Rejected)."""
        try:
            with time_limit(self.render_timeout):
                return render_record(self.template, conversation, self.train_on, self.turn_context, self._control)
        except RenderTimeout:
            raise Rejected(f"the chat template did not finish rendering this record in {self.render_timeout:g} s "
                           "(--render-timeout)", "render_timeout") from None

    def encode(self, conversations: Sequence[Conversation],
               expand: Callable[[int, Rendered], Rendered] | None = None) -> list[Encoded | Rejected]:
        """Encode a batch; a conversation that cannot be encoded becomes a ``Rejected`` in place.
        ``expand(position, rendered)``: the rendering rewritten before it is tokenized (the image
        placeholders a processor expands, packprep.vision), or Rejected."""
        results: list[Any] = [None] * len(conversations)
        rendered: list[Rendered] = []
        where: list[int] = []
        for position, conversation in enumerate(conversations):
            try:
                r = self.render(conversation)
                rendered.append(r if expand is None else expand(position, r))
                where.append(position)
            except Rejected as exc:
                results[position] = exc
        flat = [piece for r in rendered for piece in (*r.earlier, r)]
        labelled = iter(self._tokenize(flat))
        for position, r in zip(where, rendered):
            pieces, untrained, moved = [], 0, 0
            for _ in range(len(r.earlier) + 1):  # a piece may become several (turn_ids.py)
                more, lost, split = next(labelled)
                pieces += more
                untrained, moved = untrained + lost, moved + split
            # a sequence that trains nothing once packed (its first label is -100) is left out, its turns counted
            kept = [e for e in pieces if isinstance(e, Encoded)]
            if not kept:
                results[position] = pieces[-1]
                continue
            item = kept[-1]
            item.earlier = [(e.input_ids, e.labels) for e in kept[:-1]]
            item.turns_not_located = r.turns_not_located + len(pieces) - len(kept) + untrained
            item.turns_out_of_context, item.turns_rewritten, item.changes = \
                r.turns_out_of_context, r.turns_rewritten + moved + untrained, r.changes
            results[position] = item
        return results

    def _tokenize(self, rendered: list[Rendered]) -> list[tuple[list[Encoded | Rejected], int, int]]:
        """Each text's sequences (one, unless a token straddles a trained span's boundary:
        turn_ids.py), with the turns that left untrained and those moved to sequences of their own."""
        out = []
        for r, (ids, cuts, clean) in zip(rendered, self._proven(rendered, self._ids_and_cuts(rendered))):
            if not (clean or r.train_all or self.turn_context == "rendered"):
                sequences, untrained, moved = exact_sequences(len(r.text), r.spans, self._piece_encoder(r),
                                                              self.turn_context)
                out.append(([self._checked(r, i, l) for i, l in reversed(sequences)], untrained, moved))
                continue
            if r.train_all:
                if r.add_special_tokens and self.eos_token_id is not None and (
                    len(ids) == 0 or ids[-1] != self.eos_token_id
                ):
                    ids = np.append(ids, np.int32(self.eos_token_id))
                labels = ids.copy()
            else:
                labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
                for first, last in zip(cuts[::2], cuts[1::2]):
                    labels[first:last] = ids[first:last]
            out.append(([self._checked(r, ids, labels)], 0, 0))
        return out

    @staticmethod
    def _checked(r: Rendered, ids: np.ndarray, labels: np.ndarray) -> Encoded | Rejected:
        if len(ids) == 0:
            return Rejected("renders to no tokens", "empty")
        if not (labels[1:] != IGNORE_INDEX).any():  # a sequence's first label is never trained once packed
            return Rejected("no supervised token (every label is -100)", "no_supervised_tokens")
        return Encoded(ids, labels, control_text=r.markup is not None)

    def _proven(self, rendered: list[Rendered], encoded: list[tuple[np.ndarray, list[int], bool]]
                ) -> list[tuple[np.ndarray, list[int], bool]]:
        """``encoded``, no longer clean where the ids before a trained span's boundary are not the
        prefix's own (turn_ids.AddedTokens): what the added tokens around the boundaries leave to
        check, the short piece after the last one, is tokenized for all texts in one batch."""
        if self.turn_context == "rendered":
            return encoded  # turns as the whole rendering writes them
        if self._added is None:
            self._added = AddedTokens(added_tokens(self.tokenizer))
        checks = []
        for n, (r, (ids, cuts, clean)) in enumerate(zip(rendered, encoded)):
            if clean and r.spans and not r.train_all:
                bounds = [c for span in r.spans for c in span]
                pieces = self._added.unproven(r.text, ids, bounds, cuts, r.markup is not None)
                checks += [(n, *piece) for piece in pieces]
        if not checks:
            return encoded
        got = self._ids_and_cuts([_piece(rendered[n], a, b) for n, a, b, _, _ in checks])
        wrong = {n for (n, _, _, i, j), (ids, _, _) in zip(checks, got) if not np.array_equal(ids, encoded[n][0][i:j])}
        return [(ids, cuts, clean and n not in wrong) for n, (ids, cuts, clean) in enumerate(encoded)]

    def _piece_encoder(self, r: Rendered):
        """``encode(ranges)`` for turn_ids.py: ids of ``r.text[a:b]`` on its own, for each (a, b)."""
        def encode(ranges: list[tuple[int, int]]) -> list[np.ndarray]:
            return [ids for ids, _, _ in self._ids_and_cuts([_piece(r, a, b) for a, b in ranges])]

        return encode

    def _ids_and_cuts(self, rendered: list[Rendered]) -> list[tuple[np.ndarray, list[int], bool]]:
        """Token ids of each text, the first token at or after each span boundary (start, stop, ...),
        and whether no token straddles a boundary (turn_ids.py)."""
        results = self._encode(rendered, self._fast)
        if self._fast is not None and self._guard_chars > 0:
            n = 0
            while n < len(rendered) and self._guard_chars > 0:
                self._guard_chars -= len(rendered[n].text)
                n += 1
            expected = self._encode(rendered[:n], None)
            problem = _first_difference(rendered, expected, results)
            if problem:
                self._refuse_tiktoken(problem, True)
                return expected + self._encode(rendered[n:], None)
        return results

    def differs_from_hf(self, rendered: list[Rendered]) -> str | None:
        """The data guard's comparison (encode.DataGuard): None if the fast path gives HF's ids and
        cuts on every text, else which text it does not (as the runtime guard says it)."""
        fast = self._fast
        if fast is None:
            return None
        return _first_difference(rendered, self._encode(rendered, None), self._encode(rendered, fast))

    def _encode(self, rendered: list[Rendered], fast) -> list[tuple[np.ndarray, list[int], bool]]:
        results: list[Any] = [None] * len(rendered)
        groups: dict[tuple[bool, bool], list[int]] = {}  # (add special tokens, on the fast path) -> texts
        for i, r in enumerate(rendered):
            if r.markup is not None:  # content spells a control token: HF, segment by segment, on any backend
                results[i] = self._encode_markup(r)
                continue
            groups.setdefault((r.add_special_tokens, fast is not None and fast.can_encode(r.text)), []).append(i)
        for (special, use_fast), group in groups.items():
            texts = [rendered[i].text for i in group]
            if use_fast:
                bounds = [[c for span in rendered[i].spans for c in span] for i in group]
                clean: list[bool] = []
                for i, (ids, cuts), exact in zip(group, fast.encode_batch(texts, special, bounds, clean), clean):
                    results[i] = (ids, cuts.tolist(), exact)
            else:
                for i, encoding in zip(group, self._backend.encode_batch(texts, add_special_tokens=special)):
                    ids, n = np.asarray(encoding.ids, dtype=np.int32), len(rendered[i].text)
                    bounds = [c for span in rendered[i].spans for c in span]
                    results[i] = (ids, [_first_token_at_or_after(encoding, c, len(ids), n) for c in bounds],
                                  not bounds or _clean(encoding.offsets, bounds))
        return results

    def _encode_markup(self, r: Rendered) -> tuple[np.ndarray, list[int], bool]:
        """Ids, cuts and cleanness of a text whose content spells control tokens (control_text.py)."""
        if self._post is None:
            from .tiktoken_convert import added_by_post_processor

            self._post = added_by_post_processor(self._backend)
        ids, offsets = encode_with_markup(self._backend, r, self._control.tokens, self._post)
        bounds = [c for span in r.spans for c in span]
        return ids, first_tokens(offsets, bounds, len(r.text)), not bounds or _clean(offsets, bounds)


def _piece(r: Rendered, a: int, b: int) -> Rendered:
    """``r.text[a:b]`` to tokenize on its own, with the markup inside it (control_text.py)."""
    return Rendered(r.text[a:b], [], markup=None if r.markup is None else
                    [(x - a, y - a) for x, y in r.markup if a <= x and y <= b])


def _first_difference(rendered: list[Rendered], expected: list, got: list) -> str | None:
    """None if ``got`` has ``expected``'s ids and cuts for each text (``expected`` may be shorter)."""
    for r, want, have in zip(rendered, expected, got):
        if not (np.array_equal(want[0], have[0]) and list(want[1]) == list(have[1])):
            return f"it tokenizes this text differently from HF: {r.text[:60]!r}"
    return None


def _clean(offsets, chars: list[int]) -> bool:
    """Whether no token (``offsets``: character (start, end) of each) straddles any of ``chars``."""
    if not len(offsets):
        return True
    spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    at = np.asarray(chars, dtype=np.int64)[:, None]
    return not ((spans[:, 0] < at) & (at < spans[:, 1])).any()


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


def tokenizer_files_sha256(folder: str) -> str:
    """The sha256 of a tokenizer folder's files that say how it tokenizes and renders."""
    import hashlib

    files_hash = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            files_hash.update(name.encode())
            with open(path, "rb") as handle:
                files_hash.update(handle.read())
    return files_hash.hexdigest()


def tokenizer_fingerprint(tokenizer, name_or_path: str) -> dict:
    """What the manifest records about the tokenizer: enough to tell two tokenizers apart."""
    import hashlib
    import json

    if os.path.isdir(name_or_path):
        files_sha256 = tokenizer_files_sha256(name_or_path)
    else:
        files_sha256 = hashlib.sha256(json.dumps(tokenizer.backend_tokenizer.to_str()).encode()).hexdigest()
    template = template_source(tokenizer) or ""  # the text only: compiling it again would cost up to 30 ms
    return {
        "name_or_path": name_or_path,  # as the user named it
        "kind": "folder" if os.path.isdir(name_or_path) else "hub",
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "eos_token": tokenizer.eos_token,
        "files_sha256": files_sha256,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
    }
