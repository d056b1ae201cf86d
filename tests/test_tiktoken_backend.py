"""The tiktoken fast path gives exactly what the Hugging Face tokenizer gives, or is not used."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

import packprep
from packprep import tiktoken_backend
from packprep.errors import ConfigError
from packprep.normalize import Conversation, Rejected
from packprep.tiktoken_backend import TiktokenBackend, check_equivalence, guard_sample
from packprep.tokenize import ChatEncoder, Encoded, load_tokenizer

from .conftest import CONVERSATIONS, fixture_tokenizer, needs_fixtures
from .test_labels_reference import FILES, conversations

BYTE_LEVEL = ["llama3", "qwen2.5", "gpt2"]
SENTENCEPIECE = ["mistral-7b-v0.1", "llama2"]
TRICKY = ("<s>[INST] a  b   c [/INST]  x</s>\n\n  \t é 中文 𝔘 \u0001 \u2028 鿿 " + " " * 40 + "end "
          "<|eot_id|>  <|im_end|>\n" + "".join(f"{' ' * m}w" for m in range(1, 20)))


@pytest.fixture(scope="module")
def tokenizers():
    return {}


def tokenizer(cache, name):
    if name not in cache:
        cache[name] = load_tokenizer(fixture_tokenizer(name))
    return cache[name]


def assert_same(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert type(a) is type(b)
        if isinstance(a, Encoded):
            np.testing.assert_array_equal(a.input_ids, b.input_ids)
            np.testing.assert_array_equal(a.labels, b.labels)
            assert a.turns_not_located == b.turns_not_located
        else:
            assert (str(a), a.code) == (str(b), b.code)


@needs_fixtures
@pytest.mark.parametrize("name", BYTE_LEVEL + SENTENCEPIECE)
def test_ids_and_labels_equal_hf_on_every_fixture_file(tokenizers, name):
    tok = tokenizer(tokenizers, name)
    hf, fast = ChatEncoder(tok, backend="hf"), ChatEncoder(tok, backend="tiktoken")
    assert (hf.backend_name, fast.backend_name) == ("hf", "tiktoken")
    non_nfc = Conversation(messages=[{"role": "user", "content": "Cafe\u0301 ?"},  # decomposed: left to HF
                                     {"role": "assistant", "content": "e\u0301 \u212b \u00e9 中文"}])
    plain = Conversation(text="Plain text is trained on every token, with BOS/EOS as the tokenizer adds them. 你好")
    assert_same(hf.encode([non_nfc, plain]), fast.encode([non_nfc, plain]))
    for file in FILES:  # rendering does not depend on the backend: render once, tokenize both ways
        rendered = []
        for conversation in conversations(file):
            try:
                rendered.append(hf.render(conversation))
            except Rejected:
                pass
        for start in range(0, len(rendered), 256):
            batch = rendered[start : start + 256]
            assert_same(hf._tokenize(batch), fast._tokenize(batch))
    assert fast.backend_name == "tiktoken", "the runtime guard found no difference"


@needs_fixtures
def test_pack_writes_the_same_shards_with_either_backend(tmp_path):
    source = str(CONVERSATIONS / "llamafactory_glaive_toolcall_en_demo.json")
    outputs = {}
    for backend in ("hf", "tiktoken"):
        manifest = packprep.pack(source, tmp_path / backend, fixture_tokenizer("qwen2.5"), max_len=2048,
                                 num_proc=1, tokenizer_backend=backend)
        assert manifest["tokenizer"]["backend"] == backend
        outputs[backend] = {p.relative_to(tmp_path / backend): p.read_bytes()
                            for p in sorted((tmp_path / backend / "data").rglob("*")) if p.is_file()}
    assert outputs["hf"] and outputs["hf"] == outputs["tiktoken"]


@needs_fixtures
def test_a_tokenizer_tiktoken_cannot_reproduce_is_left_to_hf(tokenizers):
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizer(tokenizers, "llama2")
    changed = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    changed.normalizer = normalizers.Sequence([normalizers.Lowercase(), changed.normalizer])
    lowercasing = PreTrainedTokenizerFast(tokenizer_object=changed, bos_token="<s>", eos_token="</s>")
    lowercasing.chat_template = tok.chat_template
    backend, reason = TiktokenBackend.from_hf(lowercasing)
    assert backend is None and "normalizer ['Lowercase', 'Prepend', 'Replace']" in reason
    with pytest.warns(UserWarning, match="not tiktoken: normalizer"):
        assert ChatEncoder(lowercasing).backend_name == "hf"
    with pytest.raises(ConfigError, match="tiktoken is not possible"):
        ChatEncoder(lowercasing, backend="tiktoken")


@needs_fixtures
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_byte_fallback_and_space_runs_equal_hf(tokenizers, name):
    tok = tokenizer(tokenizers, name)
    backend, reason = TiktokenBackend.from_hf(tok)
    assert backend is not None, reason
    vocab = tok.get_vocab()
    ranks = backend.encoding._mergeable_ranks
    # a character outside the vocabulary whose first two bytes are a prefix of one inside it:
    # tiktoken merges those two bytes, and they must come back as two byte-fallback tokens
    orphan = next(c for c in map(chr, range(0x4E00, 0xA000)) if c not in vocab and c.encode()[:2] in ranks)
    texts = [f"x{orphan}y", orphan * 3, TRICKY, *(" " * n + "z" for n in range(70)), *(" " * n for n in range(70))]
    assert check_equivalence(tok, backend, texts) is None


@needs_fixtures
@pytest.mark.parametrize("name", ["llama3", *SENTENCEPIECE])
def test_cuts_equal_hf_at_every_character(tokenizers, name):
    """The first token at or after each character, as HF's offsets place it (the labels rest on it)."""
    from packprep.tokenize import _first_token_at_or_after

    tok = tokenizer(tokenizers, name)
    backend, _ = TiktokenBackend.from_hf(tok)
    encoding = tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False)
    expected = [_first_token_at_or_after(encoding, c, len(encoding.ids), len(TRICKY)) for c in range(len(TRICKY) + 1)]
    (ids, cuts), = backend.encode_batch([TRICKY], False, [list(range(len(TRICKY) + 1))])
    assert ids.tolist() == encoding.ids
    assert cuts.tolist() == expected


def test_texts_encoded_in_one_call_come_out_as_if_encoded_alone():
    """The texts of a batch go to tiktoken joined by a special token; one that runs from a text into
    that separator ("a<se" in "xa<sep>b") must not change what either text encodes to."""
    import tiktoken

    encoding = tiktoken.Encoding("bytes", pat_str=tiktoken_backend.GPT2_PATTERN,
                                 mergeable_ranks={bytes([b]): b for b in range(256)},
                                 special_tokens={"<sep>": 256, "a<se": 257})
    backend = TiktokenBackend(encoding, np.array([1] * 256 + [5, 4]), False, [], [], 1)
    for texts in (["xa", "b", "a<se", "p>"], ["b<sep>c", "", "d", "é<sep>"]):
        positions = [list(range(len(text) + 1)) for text in texts]
        alone = [backend.encode_batch([text], False, [wanted])[0] for text, wanted in zip(texts, positions)]
        joined = backend.encode_batch(texts, False, positions)
        assert [(ids.tolist(), cuts.tolist()) for ids, cuts in joined] == \
            [(ids.tolist(), cuts.tolist()) for ids, cuts in alone]
    assert backend.encode_batch(["xa"])[0][0].tolist() == [ord("x"), ord("a")]


def swap_ranks(monkeypatch, a: bytes, b: bytes):
    original = tiktoken_backend._cached_ranks  # the conversion as from_hf gets it, cached or not

    def broken(*args):
        ranks = original(*args)
        ranks[a], ranks[b] = ranks[b], ranks[a]
        return ranks

    monkeypatch.setattr(tiktoken_backend, "_cached_ranks", broken)


@needs_fixtures
def test_the_start_guard_catches_a_broken_conversion(tokenizers, monkeypatch):
    tok = tokenizer(tokenizers, "gpt2")
    swap_ranks(monkeypatch, b"Hello", b" world")
    backend, _ = TiktokenBackend.from_hf(tok)
    assert "token 0 is [15496" in check_equivalence(tok, backend, guard_sample(tok))
    with pytest.warns(UserWarning, match="differs from the tokenizer on the built-in sample"):
        assert ChatEncoder(tok).backend_name == "hf"
    with pytest.raises(ConfigError, match="differs"):
        ChatEncoder(tok, backend="tiktoken")


@needs_fixtures
def test_the_data_guard_catches_what_the_sample_missed(tokenizers, monkeypatch):
    tok = tokenizer(tokenizers, "gpt2")
    swap_ranks(monkeypatch, b" Paris", b" London")
    monkeypatch.setattr(tiktoken_backend, "guard_sample", lambda tokenizer: ["nothing to see"])
    encoder = ChatEncoder(tok)
    assert encoder.backend_name == "tiktoken"
    batch = [Conversation(messages=[{"role": "user", "content": "Capital?"},
                                    {"role": "assistant", "content": "It is Paris."}])]
    with pytest.warns(UserWarning, match="tokenizes this text differently"):
        got = encoder.encode(batch)
    assert encoder.backend_name == "hf"
    assert_same(ChatEncoder(tok, backend="hf").encode(batch), got)


@needs_fixtures
def test_the_manifest_says_when_worker_processes_fell_back_to_hf(tokenizers, monkeypatch, tmp_path):
    """Each worker runs the data guard on its own first texts; a fallback there must reach the manifest."""
    import json

    swap_ranks(monkeypatch, b" Paris", b" London")
    monkeypatch.setattr(tiktoken_backend, "guard_sample", lambda tokenizer: ["nothing to see"])
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as handle:
        for i in range(600):  # three batches of 256; only the first mentions Paris
            reply = "It is Paris." if i < 256 else f"It is number {i}."
            handle.write(json.dumps({"messages": [{"role": "user", "content": "Capital?"},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    outputs = {}
    for backend, num_proc in (("auto", 2), ("hf", 1)):
        with pytest.warns(UserWarning, match="a worker tokenized with hf") if backend == "auto" else nullcontext():
            manifest = packprep.pack(str(data), tmp_path / backend, fixture_tokenizer("gpt2"), max_len=256,
                                     num_proc=num_proc, tokenizer_backend=backend)
        outputs[backend] = [p.read_bytes() for p in sorted((tmp_path / backend / "data").iterdir())]
        if backend == "auto":
            assert manifest["tokenizer"]["backend"] in ("hf", "tiktoken+hf")
    assert outputs["auto"] == outputs["hf"]
