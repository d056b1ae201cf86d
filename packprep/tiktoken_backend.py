"""An exact tiktoken fast path for byte-level BPE tokenizers (Llama-3, GPT-2, Qwen2/2.5).

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

Tokens carry byte offsets (cumulative token byte lengths), from which the labels are placed.
``check_equivalence`` is the guard: HF and tiktoken must give the same ids on a sample.
"""

from __future__ import annotations

import json
import os
import tempfile
import unicodedata

import numpy as np

# The ByteLevel pre-tokenizer's regex (use_regex=True), as in tokenizers' byte_level.rs.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class _NotEligible(Exception):
    pass


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


class TiktokenBackend:
    def __init__(self, encoding, token_bytes: np.ndarray, nfc: bool, prefix, suffix, num_threads: int):
        self.encoding = encoding
        self._token_bytes = token_bytes  # int64 byte length of each id
        self._nfc = nfc
        self._prefix = np.asarray(prefix, dtype=np.int32)  # what add_special_tokens=True adds
        self._suffix = np.asarray(suffix, dtype=np.int32)
        self.num_threads = num_threads

    @classmethod
    def from_hf(cls, tokenizer, num_threads: int | None = None) -> tuple[TiktokenBackend | None, str]:
        """An exact tiktoken copy of ``tokenizer`` (transformers fast or ``tokenizers.Tokenizer``),
        or ``(None, reason)`` when one cannot be made."""
        try:
            import tiktoken
        except ImportError:
            return None, "tiktoken is not installed (pip install tiktoken)"
        hf = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(hf, "pre_tokenizer"):
            return None, "not a Hugging Face fast tokenizer"
        if hf.truncation or hf.padding:
            return None, "the tokenizer truncates or pads"
        try:
            nfc = _normalizer(_state(hf.normalizer))
            pattern = _pattern(_state(hf.pre_tokenizer))
            special = _added_tokens(hf.get_added_tokens_decoder())
            ranks = _ranks(hf.model, set(special.values()))
            _check_post_processor(_state(hf.post_processor))
            prefix, suffix = _added_by_post_processor(hf)
        except _NotEligible as exc:
            return None, str(exc)
        encoding = tiktoken.Encoding("packprep-bpe", pat_str=pattern,
                                     mergeable_ranks=ranks, special_tokens=special)
        lengths = np.zeros(encoding.max_token_value + 1, dtype=np.int64)
        for piece, rank in ranks.items():
            lengths[rank] = len(piece)
        for content, token in special.items():
            lengths[token] = len(content.encode("utf-8"))
        threads = num_threads or len(os.sched_getaffinity(0))
        return cls(encoding, lengths, nfc, prefix, suffix, threads), "exact tiktoken conversion"

    def can_encode(self, text: str) -> bool:
        """False for a text the normalizer would change (non-NFC text under an NFC normalizer)."""
        return not self._nfc or unicodedata.is_normalized("NFC", text)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32, byte offset where each token starts int64) for each text."""
        if self.num_threads > 1 and len(texts) > 1:
            batch = self.encoding.encode_batch(texts, allowed_special="all", num_threads=self.num_threads)
        else:
            batch = [self.encoding.encode(text, allowed_special="all") for text in texts]
        out = []
        for text, ids in zip(texts, batch):
            ids = np.array(ids, dtype=np.int32)
            starts = np.zeros(len(ids), dtype=np.int64)
            np.cumsum(self._token_bytes[ids[:-1]], out=starts[1:])
            if add_special_tokens and (len(self._prefix) or len(self._suffix)):
                end = int(starts[-1] + self._token_bytes[ids[-1]]) if len(ids) else 0
                ids = np.concatenate([self._prefix, ids, self._suffix])
                starts = np.concatenate([np.zeros(len(self._prefix), np.int64), starts,
                                         np.full(len(self._suffix), end, np.int64)])
            out.append((ids, starts))
        return out

    def first_token_at_or_after(self, byte_starts: np.ndarray, text: str, char_pos: int) -> int:
        """Index of the first token that starts at or after character ``char_pos`` of ``text``."""
        return int(self.first_tokens_at_or_after(byte_starts, text, [char_pos])[0])

    def first_tokens_at_or_after(self, byte_starts: np.ndarray, text: str, char_positions: list[int]) -> np.ndarray:
        """The same for many positions, converting characters to bytes in one pass when sorted."""
        if text.isascii():
            positions = char_positions
        else:
            positions, char, byte = [], 0, 0
            for pos in char_positions:
                if pos < char:
                    char, byte = 0, 0
                byte += len(text[char:pos].encode("utf-8", "surrogatepass"))
                char = pos
                positions.append(byte)
        return np.searchsorted(byte_starts, positions, side="left")


def check_equivalence(hf_tokenizer, backend: TiktokenBackend, sample_texts: list[str]) -> str | None:
    """None if HF and ``backend`` give identical ids on every sample text (with and without the
    post-processor's special tokens), else a description of the first difference."""
    hf = getattr(hf_tokenizer, "backend_tokenizer", hf_tokenizer)
    texts = [text for text in sample_texts if backend.can_encode(text)]
    for special in (False, True):
        expected = hf.encode_batch(texts, add_special_tokens=special)
        for text, want, (got, _) in zip(texts, expected, backend.encode_batch(texts, special)):
            got = got.tolist()
            if got != want.ids:
                k = next((i for i, (a, b) in enumerate(zip(want.ids, got)) if a != b), min(len(got), len(want.ids)))
                return (f"text {text[:40]!r}{'...' if len(text) > 40 else ''}: token {k} is "
                        f"{want.ids[k:k + 3]} with HF but {got[k:k + 3]} with tiktoken")
    return None


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
    ]


def _state(component) -> dict | None:
    """A tokenizers component (normalizer, pre-tokenizer, ...) as its tokenizer.json dict."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer(normalizer: dict | None) -> bool:
    if normalizer is None:
        return False
    if normalizer.get("type") == "NFC":
        return True
    raise _NotEligible(f"normalizer {normalizer.get('type')} cannot be reproduced by tiktoken")


def _pattern(pre: dict | None) -> str:
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    types = [step.get("type") for step in steps]
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        byte_level, pattern = steps[0], GPT2_PATTERN
    elif types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split, byte_level = steps
        if "Regex" not in split["pattern"] or split.get("behavior") != "Isolated" or split.get("invert"):
            raise _NotEligible("the Split pre-tokenizer is not an isolating regex split")
        pattern = split["pattern"]["Regex"]
    else:
        raise _NotEligible(f"pre-tokenizer {types or None} is not byte-level BPE as tiktoken runs it")
    if byte_level.get("add_prefix_space"):
        raise _NotEligible("the ByteLevel pre-tokenizer adds a prefix space")
    return pattern


def _added_tokens(added: dict) -> dict[str, int]:
    """Every added token ({id: tokenizers.AddedToken}) as a tiktoken special token."""
    special = {}
    for token_id, token in added.items():
        if token.lstrip or token.rstrip or token.single_word:
            raise _NotEligible(f"added token {token.content!r} uses lstrip/rstrip/single_word")
        special[token.content] = token_id
    return special


def _ranks(model, added_ids: set[int]) -> dict[bytes, int]:
    if type(model).__name__ != "BPE":
        raise _NotEligible(f"model {type(model).__name__} is not BPE")
    if model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        raise _NotEligible("BPE with dropout or a subword prefix/suffix")
    with tempfile.TemporaryDirectory() as folder:  # the only fast way to read the merges
        vocab_file, merges_file = model.save(folder)
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
        with open(merges_file, encoding="utf-8") as handle:
            merged = handle.read().replace(" ", "").splitlines()[1:]  # "a b" -> "ab" (no spaces in the alphabet)
    vocab = {piece: token for piece, token in vocab.items() if token not in added_ids}
    alphabet = bytes_to_unicode()
    stray = set("".join(vocab)) - set(alphabet.values())
    if stray:
        raise _NotEligible(f"the vocabulary is not byte-level (it has {sorted(stray)[:3]!r})")
    to_latin1 = str.maketrans({char: chr(byte) for byte, char in alphabet.items()})
    ranks = {piece.translate(to_latin1).encode("latin-1"): token for piece, token in vocab.items()}
    if len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        raise _NotEligible("not a byte-level BPE vocabulary (a byte is missing, or ids repeat)")
    # tiktoken merges the pair whose result has the lowest rank; HF the pair listed first. They
    # agree when ranks (ids) rise along the merge list and every multi-byte token has a merge.
    previous, produced = -1, set()
    for piece in merged:
        token = vocab.get(piece)
        if token is None or token < previous:
            raise _NotEligible("the merge order is not the id order, so ids cannot serve as tiktoken ranks")
        previous = token
        produced.add(token)
    if any(len(piece) > 1 and token not in produced for piece, token in ranks.items()):
        raise _NotEligible("some multi-byte tokens come from no merge")
    return ranks


def _check_post_processor(post: dict | None) -> None:
    for step in (post or {}).get("processors", [post or {}]):
        if step.get("type") == "ByteLevel" and step.get("trim_offsets"):
            raise _NotEligible("the ByteLevel post-processor trims offsets")


def _added_by_post_processor(hf) -> tuple[list[int], list[int]]:
    """The ids that ``add_special_tokens=True`` puts before and after a text."""
    plain = hf.encode("Hello", add_special_tokens=False).ids
    full = hf.encode("Hello", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    raise _NotEligible("the post-processor changes the text's own tokens")
