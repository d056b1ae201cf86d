"""An exact tiktoken fast path for byte-level BPE tokenizers (Llama-3, GPT-2, Qwen2/2.5) and
SentencePiece BPE tokenizers (Llama-2, Mistral v0.1).

tiktoken runs the same algorithm as a Hugging Face byte-level BPE model: split the text on added
tokens, split the rest with one regex, map each piece's bytes to GPT-2's printable alphabet and
merge pairs by priority. It does so several times faster and in threads. ``TiktokenBackend.from_hf``
rebuilds the tokenizer as a tiktoken ``Encoding`` *only* when every part of the HF pipeline can be
reproduced exactly, and otherwise says why not:

* model: BPE over the byte alphabet, merge order == id order (tiktoken's rank is the token id),
  no dropout, no subword prefix/suffix;
* pre-tokenizer: ``Split(regex, Isolated)`` + ``ByteLevel(use_regex=False)`` (Llama-3, Qwen), or
  ``ByteLevel(use_regex=True)`` (GPT-2's own regex); never ``add_prefix_space``;
* normalizer: none, or NFC (Qwen). NFC is the identity on NFC text; other texts are left to HF
  (``can_encode`` is False), since normalizing would shift character offsets;
* added tokens: all become tiktoken special tokens (none may use lstrip/rstrip/single_word);
* post-processor: only adds tokens around the text, offsets untrimmed.

SentencePiece BPE (``byte_fallback``, no pre-tokenizer, normalizer ``Prepend("▁")`` +
``Replace(" ", "▁")`` or the Replace alone) is reproduced like this, see ``_SentencePiece``:

* the text is split on added tokens and each other segment normalized as HF does (every non-empty
  segment gets the ``▁`` prefix: the "legacy" behaviour of these tokenizer.json files). tiktoken
  sees ``▁`` as a plain space, one byte instead of three (the vocabulary has no plain space), so a
  literal ``▁`` in the text becomes a space too, as HF's normalizer makes them alike;
* HF runs BPE over each whole segment; tiktoken needs pieces. Cutting before each run of ``▁`` is
  exact when no vocabulary piece holds a ``▁`` after another character (checked): no merge can
  then cross the cut;
* HF starts from characters, tiktoken from bytes. Each multi-byte character of the vocabulary gets
  ranks for its byte prefixes, so its bytes merge into it first (a UTF-8 prefix never merges with
  anything else); bytes left unmerged are the byte-fallback tokens ``<0xNN>``;
* pieces are ranked in the order of the merge that first makes them, and every split of a piece
  into two pieces must be a merge (checked), so "lowest merge first" and "lowest rank first" agree.

Tokens carry byte offsets (cumulative token byte lengths), from which the labels are placed.
``check_equivalence`` is the guard: HF and tiktoken must give the same ids on a sample. Reading the
tokenizer.json state into tiktoken's terms (pattern, ranks, added tokens) is :mod:`packprep.tiktoken_convert`;
this module builds the encoder, encodes, and keeps the verified conversions and their cache.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .tiktoken_convert import (
    SPACE, SPM_PATTERN, _added_tokens, _check_post_processor, _normalizer, _NotEligible, _pattern, _ranks,
    _sentencepiece_normalizer, _sentencepiece_ranks, _state, added_by_post_processor,
)


class _SentencePiece:
    """What turns SentencePiece BPE into a tiktoken encoding: the text transform and the id map."""

    def __init__(self, prepend: bool, special: list[str], rank_ids: np.ndarray, fallback: dict[int, list[int]]):
        self.prepend = prepend
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")").split \
            if special else (lambda text: [text])
        self.rank_ids = rank_ids  # tiktoken rank -> HF id; -1 for a byte prefix left unmerged
        self._fallback_size = np.zeros(len(rank_ids), dtype=np.int64)  # such a prefix's length in bytes,
        self._fallback_ids = np.zeros((len(rank_ids), max(map(len, fallback.values()), default=0)), np.int32)
        for rank, byte_ids in fallback.items():  # and the byte-fallback ids of its bytes
            self._fallback_size[rank] = len(byte_ids)
            self._fallback_ids[rank, : len(byte_ids)] = byte_ids

    def transform(self, text: str, positions: list[int]) -> tuple[str, list[int]]:
        """The text as HF's normalizer leaves it (segment by segment), and ``positions`` moved with it."""
        out, starts, at = [], [], 0
        for i, part in enumerate(self._split(text)):
            if i % 2 or not part:
                out.append(part)
            else:
                out.append((" " if self.prepend else "") + part.replace(SPACE, " "))
                starts.append(at)
            at += len(part)
        if self.prepend:
            positions = [p + bisect.bisect_left(starts, p) for p in positions]
        return "".join(out), positions

    def ids(self, ranks: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """HF ids and byte starts of tiktoken's tokens: a leftover byte prefix becomes one token per byte."""
        ids = self.rank_ids[ranks]
        leftover = np.flatnonzero(ids < 0)
        if not len(leftover):
            return ids, starts
        sizes = np.ones(len(ids), dtype=np.int64)
        sizes[leftover] = self._fallback_size[ranks[leftover]]
        at = np.cumsum(sizes) - sizes  # where each of tiktoken's tokens lands
        out_ids = np.empty(int(sizes.sum()), dtype=np.int32)
        out_starts = np.empty(len(out_ids), dtype=np.int64)
        out_ids[at], out_starts[at] = ids, starts
        for k in range(self._fallback_ids.shape[1]):  # the k-th byte of every leftover prefix that long
            hit = leftover[sizes[leftover] > k]
            out_ids[at[hit] + k] = self._fallback_ids[ranks[hit], k]
            out_starts[at[hit] + k] = starts[hit] + k
        return out_ids, out_starts


class TiktokenBackend:
    def __init__(self, encoding, token_bytes: np.ndarray, nfc: bool, prefix, suffix, num_threads: int,
                 sentencepiece: _SentencePiece | None = None):
        self.encoding = encoding
        self._token_bytes = token_bytes  # int64 byte length of each rank
        self._nfc = nfc
        self._prefix = np.asarray(prefix, dtype=np.int32)  # what add_special_tokens=True adds
        self._suffix = np.asarray(suffix, dtype=np.int32)
        self.num_threads = num_threads
        self._spm = sentencepiece
        # what joins the texts of one tiktoken call (see _encode_joined): the longest special token
        self._separator = max(encoding.special_tokens_set, key=len, default=None)
        if self._separator is not None:
            rank = encoding.encode_single_token(self._separator)
            self._separator_id = int(sentencepiece.rank_ids[rank]) if sentencepiece else rank
            self._separator_bytes = len(self._separator.encode("utf-8"))

    @classmethod
    def from_hf(cls, tokenizer, num_threads: int | None = None, fresh: bool = False
                ) -> tuple[TiktokenBackend | None, str]:
        """An exact tiktoken copy of ``tokenizer`` (transformers fast or ``tokenizers.Tokenizer``),
        or ``(None, reason)`` when one cannot be made. ``fresh``: convert the ranks from the
        tokenizer even if the cache has them (and cache them anew)."""
        try:
            import tiktoken
        except ImportError:
            return None, "tiktoken is not installed (pip install tiktoken)"
        hf = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(hf, "pre_tokenizer"):
            return None, "not a Hugging Face fast tokenizer"
        if hf.truncation or hf.padding:
            return None, "the tokenizer truncates or pads"
        spm = None
        try:
            special = _added_tokens(hf.get_added_tokens_decoder())
            if getattr(hf.model, "byte_fallback", False):
                if any(token.normalized for token in hf.get_added_tokens_decoder().values()):
                    raise _NotEligible("an added token is matched after normalization")
                prepend = _sentencepiece_normalizer(_state(hf.normalizer), _state(hf.pre_tokenizer))
                nfc, pattern = False, SPM_PATTERN
                ranks, rank_ids, fallback = _sentencepiece_ranks(hf.model, set(special.values()))
                special_ranks = {content: len(rank_ids) + i for i, content in enumerate(special)}
                rank_ids = np.concatenate([rank_ids, np.array(list(special.values()), dtype=np.int32)])
                spm = _SentencePiece(prepend, list(special), rank_ids, fallback)
                special = special_ranks
            else:
                nfc = _normalizer(_state(hf.normalizer))
                pattern = _pattern(_state(hf.pre_tokenizer))
                ranks = _cached_ranks(hf.model, set(special.values()), getattr(tokenizer, "file_sha256", None), fresh)
            _check_post_processor(_state(hf.post_processor))
            prefix, suffix = added_by_post_processor(hf)
        except _NotEligible as exc:
            return None, str(exc)
        ids = np.fromiter(ranks.values(), np.int64, len(ranks))
        lengths = np.fromiter(map(len, ranks), np.int64, len(ranks))
        backend = cls._build(pattern, ranks, ids, lengths, special, nfc, prefix, suffix, num_threads, spm)
        kind = "SentencePiece" if spm else "byte-level"
        return backend, f"exact tiktoken conversion ({kind} BPE)"

    @classmethod
    def _build(cls, pattern: str, ranks: dict[bytes, int], ids: np.ndarray, lengths: np.ndarray,
               special: dict[str, int], nfc: bool, prefix, suffix, num_threads: int | None,
               spm: _SentencePiece | None = None) -> TiktokenBackend:
        """The backend of a conversion: ``ids`` and ``lengths`` are each rank's and its piece's byte
        length, in the order of ``ranks``."""
        import tiktoken

        encoding = tiktoken.Encoding("packprep-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        token_bytes = np.zeros(encoding.max_token_value + 1, dtype=np.int64)
        token_bytes[ids] = lengths
        for content, rank in special.items():
            token_bytes[rank] = len(content.encode("utf-8"))
        threads = num_threads or len(os.sched_getaffinity(0))
        return cls(encoding, token_bytes, nfc, prefix, suffix, threads, spm)

    @classmethod
    def from_verified(cls, tokenizer, num_threads: int | None = None) -> TiktokenBackend | str | None:
        """The conversion that an earlier run made from this very tokenizer.json and checked against
        HF, rebuilt from the cache without ``tokenizers`` (see ``save_verified``); a str (why not)
        where an earlier run found it differs from HF; None when there is no such record or any
        doubt about it (then the caller takes the full path, ``from_hf`` and the guards).

        Its key is the tokenizer.json's sha256 and the versions of packprep, the conversion,
        tiktoken and tokenizers; its own checksum and the ranks' digest must match, and the rebuilt
        encoding must give the ids HF gave on the record's guard sample (with and without the
        post-processor's tokens)."""
        sha = getattr(tokenizer, "file_sha256", None)  # a tokenizer folder (tokenizer_folder.py) only
        if not isinstance(sha, str):
            return None
        path = _record_path(sha)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            meta = record["meta"]
            if record["checksum"] != _checksum(meta) or meta["key"] != _record_key(sha):
                return None
            if meta["verdict"] == "differs":
                return f"{meta['reason']} (recorded in {path}; remove it to try tiktoken again)"
            if meta["verdict"] != "exact":
                return None
            with np.load(_ranks_path(sha), allow_pickle=False) as saved:
                pieces, offsets, ids = saved["pieces"], saved["offsets"], saved["ids"]
            if _ranks_digest(pieces, offsets, ids) != meta["ranks_sha256"]:
                return None
            blob, bounds = pieces.tobytes(), offsets.tolist()
            ranks = {blob[a:b]: token for a, b, token in zip(bounds, bounds[1:], ids.tolist())}
            special = {content: token for content, token in meta["special"]}
            backend = cls._build(meta["pattern"], ranks, ids, np.diff(offsets), special, meta["nfc"],
                                 meta["prefix"], meta["suffix"], 1)  # one thread: the check is a few texts
            texts, expected = meta["guard"]["texts"], meta["guard"]["ids"]
            if not texts or not all(map(backend.can_encode, texts)) or \
                    _first_difference(backend, texts, {False: expected[0], True: expected[1]}) is not None:
                return None
            backend.num_threads = num_threads or len(os.sched_getaffinity(0))
            known = {"vocab_size": int(meta["vocab_size"]), "token_ids": dict(meta["token_ids"])}
        except Exception:  # unreadable, truncated, of another layout: any doubt means the full path
            return None
        if isinstance(getattr(tokenizer, "known", None), dict):
            tokenizer.known.update(known)
        return backend

    def can_encode(self, text: str) -> bool:
        """False for a text the normalizer would change (non-NFC text under an NFC normalizer)."""
        return not self._nfc or unicodedata.is_normalized("NFC", text)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False,
                     positions: list[list[int]] | None = None, clean: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each text: ids (int32), and the index of the first token that starts at or after each
        of its character ``positions``. The texts go to tiktoken in one call a thread (see
        ``_encode_joined``); ``num_threads`` > 1 splits them between threads. ``clean``, a list,
        gets for each text whether a token starts exactly at each of its positions (none straddles
        one: the text before it tokenizes alone as it does here, tokenization.py)."""
        positions = positions or [[] for _ in texts]
        if self._spm is not None:
            texts, positions = zip(*map(self._spm.transform, texts, positions)) if texts else ((), ())
        texts, positions = list(texts), list(positions)
        chunks = min(self.num_threads, len(texts))
        bounds = [len(texts) * i // chunks for i in range(chunks + 1)] if chunks else []
        jobs = [(texts[a:b], positions[a:b]) for a, b in zip(bounds, bounds[1:])]
        if len(jobs) > 1:
            with ThreadPoolExecutor(len(jobs)) as pool:  # tiktoken lets go of the GIL while it encodes
                done = list(pool.map(lambda job: self._encode_joined(*job), jobs))
        else:
            done = [self._encode_joined(*job) for job in jobs]
        out = []
        for ids, cuts, exact in (item for chunk in done for item in chunk):
            if clean is not None:
                clean.append(exact)
            if add_special_tokens and len(self._prefix):
                ids, cuts = np.concatenate([self._prefix, ids]), cuts + len(self._prefix) * (cuts > 0)
            if add_special_tokens and len(self._suffix):
                ids = np.concatenate([ids, self._suffix])
            out.append((ids, cuts))
        return out

    def _encode_joined(self, texts: list[str], positions: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``encode_batch`` of the texts (already normalized) from one tiktoken call on the texts joined
        by a special token: a call costs some 30 µs besides its text, a quarter of tiktoken's time on
        chat texts, one call a text.

        tiktoken cuts a text at its special tokens and encodes each piece between them on its own, so
        each text comes out as if encoded alone, unless a special token it finds runs from the end
        of one text into the separator. Hence the separator must be found, as a token of its own,
        exactly where each text ends in bytes; if it is not, the texts are encoded one by one.
        """
        if len(texts) > 1 and self._separator is None:
            return [item for text, wanted in zip(texts, positions) for item in self._encode_joined([text], [wanted])]
        ranks = self.encoding.encode_to_numpy(self._separator.join(texts) if len(texts) > 1 else texts[0],
                                              allowed_special="all").astype(np.int32)
        starts = np.zeros(len(ranks), dtype=np.int64)  # each token's first byte
        np.cumsum(self._token_bytes[ranks[:-1]], out=starts[1:])
        ids = ranks
        if self._spm is not None:
            ids, starts = self._spm.ids(ranks, starts)
        sizes = np.fromiter((len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
        bases = np.zeros(len(texts), dtype=np.int64)  # where each text starts in the joined text, in bytes
        np.cumsum(sizes[:-1] + (self._separator_bytes if len(texts) > 1 else 0), out=bases[1:])
        ends = bases[:-1] + sizes[:-1]
        at = np.searchsorted(starts, ends)
        if not (at < len(ids)).all() or (starts[at] != ends).any() or (ids[at] != self._separator_id).any():
            return [item for text, wanted in zip(texts, positions) for item in self._encode_joined([text], [wanted])]
        firsts = np.concatenate([[0], at + 1]).tolist()
        stops = np.concatenate([at, [len(ids)]]).tolist()
        counts = np.fromiter(map(len, positions), np.int64, len(positions))
        wanted = np.fromiter((b for text, chars in zip(texts, positions) for b in _byte_positions(text, chars)),
                             np.int64, int(counts.sum()))
        wanted = wanted + np.repeat(bases, counts)
        at = np.searchsorted(starts, wanted)
        exact = (at >= len(starts)) | (starts[np.minimum(at, len(starts) - 1)] == wanted) if len(starts) else at >= 0
        cuts = at - np.repeat(firsts, counts)
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return [(ids[a:b], cuts[c:d], bool(exact[c:d].all())) for a, b, c, d in zip(firsts, stops, offsets, offsets[1:])]


def _byte_positions(text: str, char_positions: list[int]) -> list[int]:
    """Character positions of ``text`` as byte offsets into its UTF-8."""
    if text.isascii():
        return char_positions
    positions, char, byte = [], 0, 0
    for pos in char_positions:
        if pos < char:
            char, byte = 0, 0
        byte += len(text[char:pos].encode("utf-8", "surrogatepass"))
        char = pos
        positions.append(byte)
    return positions


def check_equivalence(hf_tokenizer, backend: TiktokenBackend, sample_texts: list[str]) -> str | None:
    """None if HF and ``backend`` give identical ids on every sample text (with and without the
    post-processor's special tokens), else a description of the first difference."""
    texts = [text for text in sample_texts if backend.can_encode(text)]
    return _first_difference(backend, texts, _hf_ids(hf_tokenizer, texts))


def _hf_ids(hf_tokenizer, texts: list[str]) -> dict[bool, list[list[int]]]:
    """HF's ids of each text, without (False) and with (True) the post-processor's special tokens."""
    hf = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    return {special: [e.ids for e in hf.encode_batch(texts, add_special_tokens=special)] for special in (False, True)}


def _first_difference(backend: TiktokenBackend, texts: list[str], expected: dict[bool, list[list[int]]]) -> str | None:
    """None if ``backend`` gives ``expected`` (``_hf_ids``) on ``texts``, else the first difference."""
    for special in (False, True):
        if len(expected[special]) != len(texts):
            return f"{len(expected[special])} expected encodings for {len(texts)} texts"
        for text, want, (got, _) in zip(texts, expected[special], backend.encode_batch(texts, special)):
            got = got.tolist()
            if got != want:
                k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(got), len(want)))
                return (f"text {text[:40]!r}{'...' if len(text) > 40 else ''}: token {k} is "
                        f"{want[k:k + 3]} with HF but {got[k:k + 3]} with tiktoken")
    return None


def fast_backend(tokenizer, num_threads: int | None = None) -> tuple[TiktokenBackend | None, str, bool]:
    """The tiktoken copy of ``tokenizer`` that ``ChatEncoder`` uses: ``(backend or None, reason,
    verified_before)``.

    From the cache when an earlier run made and checked the conversion of this tokenizer.json
    (``verified_before``: ``from_verified``, no ``tokenizers.Tokenizer`` is built); else the full
    path: ``from_hf``, then the start guard (HF and tiktoken on ``guard_sample``), whose verdict
    is recorded for the next run (``save_verified``, ``remember_difference``).
    """
    cached = TiktokenBackend.from_verified(tokenizer, num_threads)
    if isinstance(cached, TiktokenBackend):
        return cached, "exact tiktoken conversion (byte-level BPE), checked by an earlier run", True
    if isinstance(cached, str):
        return None, cached, True
    # the full path trusts nothing in the cache: the ranks are converted again, and saved with the record
    backend, reason = TiktokenBackend.from_hf(tokenizer, num_threads, fresh=True)
    if backend is None:
        return None, reason, False
    texts = [text for text in guard_sample(tokenizer) if backend.can_encode(text)]
    expected = _hf_ids(tokenizer, texts)
    problem = _first_difference(backend, texts, expected)
    if problem:
        reason = f"it differs from the tokenizer on the built-in sample: {problem}"
        remember_difference(tokenizer, reason)
        return None, reason, False
    save_verified(tokenizer, backend, texts, expected)
    return backend, reason, False


def guard_sample(tokenizer) -> list[str]:
    """Built-in texts for the guard: every added token, many scripts, whitespace runs, digits."""
    hf = getattr(tokenizer, "backend_tokenizer", tokenizer)
    added = [t.content for t in hf.get_added_tokens_decoder().values()]
    return [
        "Hello world! I'm here, you're there; we'll see. DON'T SHOUT, it's 3:45pm.",
        "".join(added),
        " ".join(f"x{token}y" for token in added),
        "\n".join(f"  {token}\n\n" for token in added[:50]),
        "数字 1234567890, 3.14159, 1,000,000 and ١٢٣ and ⅻ; 2024-01-31T12:00:00Z",
        "中文测试：你好，世界！日本語のテキスト。한국어 텍스트. Привет, мир! مرحبا بالعالم नमस्ते दुनिया",
        "Emoji 👩‍👩‍👧‍👦 🇫🇷 ✔️ café naïve Å Ω ﬁ ½ x² — “quotes” ‘single’ … «» ¿¡",
        "   leading\tand trailing   \n\n\n  \r\n\r\n \t \u00a0\u2003\u3000 spaces   ",
        "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x != 0:\n\t\tpass\n",
        "'s 't 're 've 'm 'll 'd 'S 'T 'RE Ve'll ''quoted'' ' ' '",
        "<|not_a_token|> <s> </s> [INST] <<SYS>> <think>\n</think>\n\n",
        "",
        " ",
        "\n",
        "a" * 300 + " " + "ab" * 150 + " " + "9" * 40,
        "".join(f"{' ' * n}w{n}\n" for n in range(1, 40)) + " " * 100,
    ]


RANKS_CACHE_VERSION = 1  # bump when _ranks changes what it returns


def cache_dir() -> Path:
    """Where conversions are kept between runs: $PACKPREP_CACHE, else $XDG_CACHE_HOME/packprep."""
    if os.environ.get("PACKPREP_CACHE"):
        return Path(os.environ["PACKPREP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "packprep"


def _ranks_path(file_sha256: str) -> Path:
    return cache_dir() / f"tiktoken-ranks-v{RANKS_CACHE_VERSION}-{file_sha256}.npz"


def _cached_ranks(model, added_ids: set[int], file_sha256: str | None, fresh: bool = False) -> dict[bytes, int]:
    """``_ranks``, kept on disk under the tokenizer.json's sha256: the conversion costs 0.5-1 s of
    every start with a 128k vocabulary, loading it 50 ms. (What it returns is still checked against
    the tokenizer on the guard sample and the first texts of the run.) ``fresh``: convert even if
    the file is there, and replace it."""
    if file_sha256 is None:
        return _ranks(model, added_ids)
    path = _ranks_path(file_sha256)
    if not fresh:
        try:
            with np.load(path, allow_pickle=False) as saved:
                blob, offsets, ids = saved["pieces"].tobytes(), saved["offsets"].tolist(), saved["ids"].tolist()
            return {blob[a:b]: token for a, b, token in zip(offsets, offsets[1:], ids)}
        except Exception:  # not there yet, or unreadable (a torn or corrupt zip raises BadZipFile): convert
            pass
    ranks = _ranks(model, added_ids)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.npz")
        np.savez(partial, **dict(zip(("pieces", "offsets", "ids"), _ranks_arrays(ranks))))
        os.replace(partial, path)  # readers see a whole file or none
    except OSError:
        pass  # a read-only home: convert again next time
    return ranks


def _ranks_arrays(ranks: dict[bytes, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks as the cache stores them: the pieces' bytes end to end (uint8), where each starts
    (int64, one more), and their ranks (int64), in the dict's order."""
    offsets = np.zeros(len(ranks) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, ranks), np.int64, len(ranks)), out=offsets[1:])
    return (np.frombuffer(b"".join(ranks), dtype=np.uint8), offsets,
            np.fromiter(ranks.values(), np.int64, len(ranks)))


def _ranks_digest(pieces: np.ndarray, offsets: np.ndarray, ids: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in (pieces.astype(np.uint8, copy=False), offsets.astype(np.int64, copy=False),
                  ids.astype(np.int64, copy=False)):
        digest.update(len(array).to_bytes(8, "little"))
        digest.update(array.tobytes())
    return digest.hexdigest()


CONVERSION_VERSION = 1  # bump when what from_hf builds, or what the verified record holds, changes


def _record_path(file_sha256: str) -> Path:
    return cache_dir() / f"tiktoken-verified-v{CONVERSION_VERSION}-{file_sha256}.json"


def _record_key(file_sha256: str) -> dict:
    """What a verified record must have been made with: the same tokenizer.json and code (this
    module's own text too, so that a change to the conversion needs no version bump to be seen)."""
    import tiktoken
    import tokenizers

    from . import __version__

    try:
        code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    except OSError:
        code = None
    return {"tokenizer_json_sha256": file_sha256, "packprep": __version__, "conversion": CONVERSION_VERSION,
            "ranks": RANKS_CACHE_VERSION, "code": code, "tiktoken": tiktoken.__version__,
            "tokenizers": tokenizers.__version__}


def _checksum(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode("utf-8")).hexdigest()


def _write_record(tokenizer, meta: dict) -> None:
    sha = getattr(tokenizer, "file_sha256", None)
    if not isinstance(sha, str):
        return
    path = _record_path(sha)
    meta = {"key": _record_key(sha), **meta}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"checksum": _checksum(meta), "meta": meta}), encoding="utf-8")
        os.replace(partial, path)  # readers see a whole file or none
    except OSError:
        pass  # a read-only home: the full path again next time


def save_verified(tokenizer, backend: TiktokenBackend, texts: list[str], expected: dict[bool, list[list[int]]]) -> None:
    """Record that ``backend`` (made by ``from_hf`` from ``tokenizer``'s tokenizer.json) gave HF's
    ``expected`` ids on ``texts``, with what ``from_verified`` needs to rebuild it without HF: the
    split pattern, the added tokens, the post-processor's tokens, the vocabulary size and the ids
    of the added and special tokens. The ranks stay in their own cache file, named by digest here.
    Only a byte-level conversion of a tokenizer folder whose ranks file holds exactly these ranks
    is recorded."""
    sha = getattr(tokenizer, "file_sha256", None)
    if not isinstance(sha, str) or backend._spm is not None:
        return
    ranks = backend.encoding._mergeable_ranks
    digest = _ranks_digest(*_ranks_arrays(ranks))
    try:
        with np.load(_ranks_path(sha), allow_pickle=False) as saved:
            if _ranks_digest(saved["pieces"], saved["offsets"], saved["ids"]) != digest:
                return
    except Exception:
        return  # no ranks file (a read-only cache), or not these ranks
    hf = tokenizer.backend_tokenizer
    contents = [*backend.encoding._special_tokens, *tokenizer.special_tokens_map.values()]
    _write_record(tokenizer, {
        "verdict": "exact",
        "kind": "byte-level",
        "pattern": backend.encoding._pat_str,
        "special": [[content, token] for content, token in backend.encoding._special_tokens.items()],
        "nfc": backend._nfc,
        "prefix": backend._prefix.tolist(),
        "suffix": backend._suffix.tolist(),
        "ranks_sha256": digest,
        "vocab_size": len(tokenizer),
        "token_ids": {content: hf.token_to_id(content) for content in contents},
        "guard": {"texts": texts, "ids": [expected[False], expected[True]]},
    })


def remember_difference(tokenizer, reason: str) -> None:
    """Record that tiktoken's copy of this tokenizer.json differs from HF (the start guard or the
    data guard found it): later runs go to HF at once instead of trusting the conversion."""
    _write_record(tokenizer, {"verdict": "differs", "reason": reason})
