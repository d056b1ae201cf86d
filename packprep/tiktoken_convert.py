"""A Hugging Face tokenizer.json state read into tiktoken's terms, for :mod:`packprep.tiktoken_backend`:
the split pattern, the ranks (byte-level BPE or SentencePiece BPE), the added tokens and the
post-processor's tokens. Anything tiktoken cannot reproduce exactly raises ``_NotEligible`` saying why.
"""

from __future__ import annotations

import json
import re
import tempfile

import numpy as np

# The ByteLevel pre-tokenizer's regex (use_regex=True), as in tokenizers' byte_level.rs.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPACE = "\u2581"  # SentencePiece's visible space
SPM_PATTERN = " *[^ ]+| +"  # a run of spaces and the word after it (tiktoken sees ▁ as a plain space)


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


def _sentencepiece_normalizer(normalizer: dict | None, pre: dict | None) -> bool:
    """Whether each segment gets a ``▁`` prefix; _NotEligible unless the normalizer is SentencePiece's."""
    if pre is not None:
        raise _NotEligible(f"SentencePiece BPE with a pre-tokenizer ({pre.get('type')}) is not supported")
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else \
        [normalizer] if normalizer else []
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if steps == [{"type": "Prepend", "prepend": SPACE}, replace]:
        return True
    if steps == [replace]:
        return False
    raise _NotEligible(f"normalizer {[step.get('type') for step in steps]} is not SentencePiece's space handling")


def _sentencepiece_ranks(model, added_ids: set[int]) -> tuple[dict[bytes, int], np.ndarray, dict[int, list[int]]]:
    """tiktoken ranks for a SentencePiece BPE model, each rank's HF id, and the byte-fallback ids of
    the ranks that are only a prefix of a character (see the module docstring)."""
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        raise _NotEligible("not a plain BPE model")
    with tempfile.TemporaryDirectory() as folder:
        vocab_file, merges_file = model.save(folder)
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
        with open(merges_file, encoding="utf-8", newline="") as handle:  # pieces may hold "\r"
            merges = [tuple(line.split(" ")) for line in handle.read().split("\n")[1:] if line]
    try:
        byte_ids = [vocab[f"<0x{b:02X}>"] for b in range(256)]
    except KeyError as exc:
        raise _NotEligible(f"byte-fallback token {exc} is missing") from None
    pieces = {piece: token for piece, token in vocab.items() if token not in added_ids}
    if any(re.search(f"[^{SPACE}]{SPACE}", piece) for piece in pieces):
        raise _NotEligible("a vocabulary piece has a space after another character: words cannot be split")
    if SPACE not in pieces or any(" " in piece for piece in pieces):
        raise _NotEligible("the vocabulary has no \u2581, or has a plain space")
    ranks: dict[bytes, int] = {}
    rank_ids: list[int] = []
    fallback: dict[int, list[int]] = {}

    def add(piece: bytes, token: int) -> None:
        ranks[piece] = len(rank_ids)
        rank_ids.append(token)

    for b in range(256):  # single bytes: an ASCII character of the vocabulary, else a byte-fallback token
        add(bytes([b]), pieces.get(chr(b), byte_ids[b]) if b < 128 else byte_ids[b])
    rank_ids[ord(" ")] = pieces[SPACE]  # the stand-in for ▁
    for char in (piece for piece in pieces if len(piece) == 1 and ord(piece) >= 128 and piece != SPACE):
        encoded = char.encode("utf-8")
        for end in range(2, len(encoded)):
            if encoded[:end] not in ranks:
                fallback[len(rank_ids)] = [byte_ids[b] for b in encoded[:end]]
                add(encoded[:end], -1)
        add(encoded, pieces[char])
    made, runs = None, {}
    for index, (left, right) in enumerate(merges):
        piece = left + right
        if set(piece) == {SPACE}:  # runs of spaces: ranked below, after every other piece
            runs[(len(left), len(right))] = index
            continue
        if runs:
            raise _NotEligible("a merge of runs of spaces comes before other merges")
        if piece == made:
            continue
        if _key(piece) in ranks:
            raise _NotEligible(f"the merges that make {piece!r} are not listed together")
        if left not in pieces or right not in pieces or piece not in pieces:
            raise _NotEligible(f"merge {left!r} + {right!r} is not between vocabulary pieces")
        add(_key(piece), pieces[piece])
        made = piece
    _rank_runs(runs, pieces, add)
    merge_set = set(merges)
    ranked = {piece for piece in pieces if _key(piece) in ranks}
    for piece in (p for p in ranked if len(p) > 1):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ranked and right in ranked and (left, right) not in merge_set:
                raise _NotEligible(f"{left!r} + {right!r} makes {piece!r} but is not a merge")
    return ranks, np.array(rank_ids, dtype=np.int32), fallback


def _key(piece: str) -> bytes:
    """A SentencePiece piece as tiktoken sees it: ▁ becomes one plain space byte instead of three."""
    return piece.replace(SPACE, " ").encode("utf-8")


def _rank_runs(runs: dict[tuple[int, int], int], pieces: dict[str, int], add) -> None:
    """Rank the pieces that are runs of spaces, longest first.

    SentencePiece converters list the merges of runs last, with equal scores, longer left part
    first; so only runs merge with runs, after everything else. Both ways of choosing the next
    merge (HF: the listed-first pair; tiktoken: the lowest-ranked result) are played out on every
    run up to four times the longest piece and must split it alike; both grow runs left to right,
    so longer runs repeat what these show.
    """
    lengths = sorted((len(piece) for piece in pieces if set(piece) == {SPACE} and len(piece) > 1), reverse=True)
    for n in lengths:
        add(_key(SPACE * n), pieces[SPACE * n])
    rank = {n: i for i, n in enumerate(lengths)}
    for n in range(2, 4 * max(lengths, default=1) + 2):
        if _split_run(n, lambda a, b: runs.get((a, b))) != _split_run(n, lambda a, b: rank.get(a + b)):
            raise _NotEligible(f"a run of {n} spaces splits differently with tiktoken's ranks")


def _split_run(n: int, priority) -> list[int]:
    """How BPE splits n single spaces when ``priority(a, b)`` orders merging runs a and b (None: no merge)."""
    parts = [1] * n
    while True:
        candidates = [(p, i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if (p := priority(a, b)) is not None]
        if not candidates:
            return parts
        _, i = min(candidates)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def _check_post_processor(post: dict | None) -> None:
    for step in (post or {}).get("processors", [post or {}]):
        if step.get("type") == "ByteLevel" and step.get("trim_offsets"):
            raise _NotEligible("the ByteLevel post-processor trims offsets")


def added_by_post_processor(hf) -> tuple[list[int], list[int]]:
    """The ids that ``add_special_tokens=True`` puts before and after a text."""
    plain = hf.encode("Hello", add_special_tokens=False).ids
    full = hf.encode("Hello", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    raise _NotEligible("the post-processor changes the text's own tokens")
