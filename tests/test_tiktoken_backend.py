"""The tiktoken fast path gives exactly what the Hugging Face tokenizer gives, or is not used."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from contextlib import nullcontext

import numpy as np
import pytest

import packprep
from packprep import encode, tiktoken_backend, tiktoken_convert
from packprep.errors import ConfigError, WorkerDied
from packprep.normalize import Conversation, Rejected
from packprep.tiktoken_backend import TiktokenBackend, check_equivalence, fast_backend, guard_sample
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer
from packprep.tokenizer_folder import FolderTokenizer

from .conftest import CONVERSATIONS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures
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
        for start in range(0, len(rendered), 256):  # ids and cuts (where the labels start and stop)
            assert fast.differs_from_hf(rendered[start : start + 256]) is None
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
    with pytest.raises(ConfigError, match='tiktoken"? is not possible'):
        ChatEncoder(lowercasing, backend="tiktoken")


@needs_fixtures
@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_byte_fallback_and_space_runs_equal_hf(tokenizers, name):
    tok = tokenizer(tokenizers, name)
    backend, reason = TiktokenBackend.from_hf(tok)
    assert backend is not None, reason
    vocab = tok.get_vocab()
    ranks = set(backend.encoding.token_byte_values())
    # a character outside the vocabulary whose first two bytes are a prefix of one inside it:
    # tiktoken merges those two bytes, and they must come back as two byte-fallback tokens
    orphan = next(c for c in map(chr, range(0x4E00, 0xA000)) if c not in vocab and c.encode()[:2] in ranks)
    texts = [f"x{orphan}y", orphan * 3, TRICKY, *(" " * n + "z" for n in range(70)), *(" " * n for n in range(70))]
    assert check_equivalence(tok, backend, texts) is None


@needs_fixtures
@pytest.mark.parametrize("name", ["llama3", *SENTENCEPIECE])
def test_cuts_equal_hf_at_every_character(tokenizers, name):
    """The first token at or after each character, as HF's offsets place it (the labels rest on it)."""
    tok = tokenizer(tokenizers, name)
    backend, _ = TiktokenBackend.from_hf(tok)
    encoding = tok.backend_tokenizer.encode(TRICKY, add_special_tokens=False)
    starts = [start for start, _ in encoding.offsets]
    expected = [next((t for t, start in enumerate(starts) if start >= c), len(starts)) for c in range(len(TRICKY) + 1)]
    (ids, cuts), = backend.encode_batch([TRICKY], False, [list(range(len(TRICKY) + 1))])
    assert ids.tolist() == encoding.ids
    assert cuts.tolist() == expected


def test_texts_encoded_in_one_call_come_out_as_if_encoded_alone():
    """The texts of a batch go to tiktoken joined by a special token; one that runs from a text into
    that separator ("a<se" in "xa<sep>b") must not change what either text encodes to."""
    import tiktoken

    encoding = tiktoken.Encoding("bytes", pat_str=tiktoken_convert.GPT2_PATTERN,
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
    """Break the conversion as from_hf gets it. A verified record in the cache would rebuild the
    good one without from_hf, so the cache starts empty (a run that makes the conversion)."""
    monkeypatch.setenv("PACKPREP_CACHE", tempfile.mkdtemp(prefix="packprep-broken-"))
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
    assert not list(tiktoken_backend.cache_dir().glob("tiktoken-verified-*")) or \
        "differs" in next(tiktoken_backend.cache_dir().glob("tiktoken-verified-*")).read_text()


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
    # the difference is recorded: the next run does not trust the conversion, even before any text
    with pytest.warns(UserWarning, match="an earlier run found that it tokenizes this text differently"):
        assert ChatEncoder(load_tokenizer(fixture_tokenizer("gpt2"))).backend_name == "hf"


@needs_fixtures
def test_the_manifest_says_when_worker_processes_fell_back_to_hf(tokenizers, monkeypatch, tmp_path):
    """On the run that makes the conversion each worker also runs the runtime guard on its own first
    texts; a fallback there, past what the driver's data guard checks, must reach the manifest."""
    import json

    swap_ranks(monkeypatch, b" Paris", b" London")
    monkeypatch.setattr(tiktoken_backend, "guard_sample", lambda tokenizer: ["nothing to see"])
    monkeypatch.setattr(encode, "GUARD_CHARS", 1000)  # the driver's guard checks the first records only
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as handle:
        for i in range(600):  # three batches of 256; only the second mentions Paris
            reply = "It is Paris." if 256 <= i < 512 else f"It is number {i}."
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


def pack_outputs(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "packprep.json"}


def hf_tokenizer_only_in_the_data_guard(monkeypatch):
    """From here on a folder's ``tokenizers.Tokenizer`` is built (or used) only in the data guard's
    process (encode.DataGuard), forked as the encode stage starts: never in the driver (its start-up
    included), nor in the workers."""
    build = FolderTokenizer.backend_tokenizer.fget

    def only_in_the_guard(self):
        if multiprocessing.current_process().name != encode.DataGuard.NAME:
            raise AssertionError(f"built the tokenizers.Tokenizer of {self.name_or_path} in "
                                 f"{multiprocessing.current_process().name}, process {os.getpid()}")
        return build(self)

    monkeypatch.setattr(FolderTokenizer, "backend_tokenizer", property(only_in_the_guard))


@needs_fixtures
@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_a_warm_cache_packs_without_the_hf_tokenizer_and_writes_the_same_bytes(tmp_path, monkeypatch, name):
    """Start-up: the first run makes the conversion, checks it against HF and records it; the next
    runs rebuild it from the record, build no tokenizers.Tokenizer (0.3-0.5 s for llama3) but in
    the data guard's process, beside the workers, and write the same shards, card, rejects and
    manifest."""
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "cache"))
    source = str(CONVERSATIONS / "llamafactory_glaive_toolcall_en_demo.json")
    loads = FolderTokenizer.backend_loads
    cold = packprep.pack(source, tmp_path / "cold", fixture_tokenizer(name), max_len=2048, num_proc=1)
    assert FolderTokenizer.backend_loads > loads  # the run that made the conversion needed HF
    assert sorted(p.name.split("-v1-")[0] for p in (tmp_path / "cache").iterdir()) == \
        ["tiktoken-ranks", "tiktoken-verified"]
    hf_tokenizer_only_in_the_data_guard(monkeypatch)
    for num_proc in (1, 2):  # in this process, and in forked workers
        loads, checked = FolderTokenizer.backend_loads, encode.DataGuard.checked
        warm = packprep.pack(source, tmp_path / f"warm{num_proc}", fixture_tokenizer(name), max_len=2048,
                             num_proc=num_proc)
        assert FolderTokenizer.backend_loads == loads, "the driver built none (the data guard's process did)"
        assert encode.DataGuard.checked - checked >= encode.GUARD_CHARS, "it checked the first 200k characters"
        assert warm["tokenizer"] == cold["tokenizer"]  # vocab_size, eos_token, hashes, backend "tiktoken"
        assert warm["tokenizer"]["backend"] == "tiktoken"
        assert warm["counts"] == cold["counts"]
        assert pack_outputs(tmp_path / f"warm{num_proc}") == pack_outputs(tmp_path / "cold")


@needs_fixtures
@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_what_the_record_knows_of_a_tokenizer_is_what_hf_says(tmp_path, monkeypatch, name):
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path))
    ChatEncoder(load_tokenizer(fixture_tokenizer(name)))
    warm, hf = load_tokenizer(fixture_tokenizer(name)), load_tokenizer(fixture_tokenizer(name))
    assert ChatEncoder(warm).backend_name == "tiktoken"
    backend, _, verified_before = fast_backend(warm)
    assert verified_before, "rebuilt from the record, not converted again"
    assert not warm.backend_loaded and warm.known
    for attribute in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(warm, attribute) == getattr(hf, attribute)
    assert len(warm) == len(hf)
    assert not warm.backend_loaded and hf.backend_loaded
    texts = [TRICKY, "Hello world", *guard_sample(hf)]
    assert [ids.tolist() for ids, _ in backend.encode_batch(texts, True)] == \
        [e.ids for e in hf.backend_tokenizer.encode_batch(texts, add_special_tokens=True)]


def record_checksum(meta: dict) -> str:
    """A verified record's checksum: sha256 of its meta as sorted JSON (as _rewrite_record checks)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode("utf-8")).hexdigest()


def _rewrite_record(path, change):
    record = json.loads(path.read_text())
    assert record["checksum"] == record_checksum(record["meta"]), "forged as packprep writes them"
    change(record["meta"])
    record["checksum"] = record_checksum(record["meta"])  # a well-formed record, with wrong contents
    path.write_text(json.dumps(record))


def _swap_saved_ranks(path):
    with np.load(path) as saved:
        arrays = dict(saved)
    ids = arrays["ids"]
    first, second = np.flatnonzero(ids == ids[300])[0], np.flatnonzero(ids == ids[301])[0]
    ids[[first, second]] = ids[[second, first]]
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


CORRUPTIONS = {
    "ranks swapped in a well-formed file": lambda ranks, record: _swap_saved_ranks(ranks),
    "ranks file cut short": lambda ranks, record: ranks.write_bytes(ranks.read_bytes()[:100_000]),
    "ranks file gone": lambda ranks, record: ranks.unlink(),
    "record cut short": lambda ranks, record: record.write_text(record.read_text()[:1000]),
    "record edited, checksum not": lambda ranks, record: record.write_text(record.read_text().replace(
        '"nfc": false', '"nfc": true')),
    "record of other versions": lambda ranks, record: _rewrite_record(
        record, lambda meta: meta["key"].update(tokenizers="0.0.1")),
    "record of other code": lambda ranks, record: _rewrite_record(
        record, lambda meta: meta["key"].update(code="0" * 64)),
    "record of another split pattern": lambda ranks, record: _rewrite_record(
        record, lambda meta: meta.update(pattern=tiktoken_convert.GPT2_PATTERN)),
    "record with other guard ids": lambda ranks, record: _rewrite_record(
        record, lambda meta: meta["guard"]["ids"][0][0].append(0)),
    "record of other special tokens": lambda ranks, record: _rewrite_record(
        record, lambda meta: meta.update(special=meta["special"][:-1])),
}


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory):
    """A copy of the Llama-3 tokenizer folder and the cache its first run leaves (the converted ranks and
    the verified record), made once: each case corrupts its own copy of the cache."""
    root = tmp_path_factory.mktemp("tiktoken-good-cache")
    folder, cache = root / "llama3", root / "cache"
    shutil.copytree(fixture_tokenizer("llama3"), folder)
    cache.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PACKPREP_CACHE", str(cache))
        ChatEncoder(load_tokenizer(str(folder)))
    return folder, cache


@needs_fixtures
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_or_stale_cache_is_not_trusted(tmp_path, monkeypatch, corruption, good_cache):
    """Whatever is wrong with the cache, the run takes the full path (HF, a fresh conversion, the
    guards), gets HF's ids, and leaves a good cache behind."""
    folder, good = good_cache
    shutil.copytree(good, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path))
    [ranks] = tmp_path.glob("tiktoken-ranks-*")
    [record] = tmp_path.glob("tiktoken-verified-*")
    CORRUPTIONS[corruption](ranks, record)
    tok = load_tokenizer(str(folder))
    backend, _, verified_before = fast_backend(tok)  # what ChatEncoder(tok) starts with
    assert tok.backend_loaded and backend is not None and not verified_before, "the full path was taken"
    texts = [TRICKY, "Hello world, how are you?", "Fine. 中文 café"]
    assert [ids.tolist() for ids, _ in backend.encode_batch(texts, True)] == \
        [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=True)]
    encoder = ChatEncoder(tok)
    assert encoder.backend_name == "tiktoken"
    hf = ChatEncoder(tok, backend="hf")
    batch = [Conversation(messages=[{"role": "user", "content": "Hello world, how are you?"},
                                    {"role": "assistant", "content": f"Fine {n}. 中文 café {TRICKY}"}])
             for n in range(5)]
    assert_same(hf.encode(batch), encoder.encode(batch))
    again = load_tokenizer(str(folder))
    assert fast_backend(again)[2] and not again.backend_loaded, "the cache was made good again"


@needs_fixtures
def test_a_changed_tokenizer_json_is_a_new_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "gpt2"
    shutil.copytree(fixture_tokenizer("gpt2"), folder)
    ChatEncoder(load_tokenizer(str(folder)))
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # still a byte-level BPE tiktoken can copy
    (folder / "tokenizer.json").write_text(json.dumps(data))
    tok = load_tokenizer(str(folder))
    backend, _, verified_before = fast_backend(tok)
    assert tok.backend_loaded and backend is not None and not verified_before, "converted again, not from the record"
    encoder = ChatEncoder(tok)
    assert encoder.backend_name == "tiktoken"
    plain = [Conversation(text="a b ab ba")]
    got = encoder.encode(plain)
    assert_same(ChatEncoder(tok, backend="hf").encode(plain), got)
    assert got[0].input_ids[0] == vocab["a"]
    assert len(list((tmp_path / "cache").glob("tiktoken-verified-*"))) == 2


def test_a_tokenizer_json_changed_after_the_cache_was_read_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "example"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    ChatEncoder(load_tokenizer(str(folder)))
    tok = load_tokenizer(str(folder))
    ChatEncoder(tok)
    assert not tok.backend_loaded
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text() + "\n")
    with pytest.raises(ConfigError, match="changed while packprep was using it"):
        tok.decode([1, 2])


@needs_fixtures
def test_a_special_token_tokenizer_json_does_not_add_is_left_to_transformers(tmp_path, monkeypatch):
    """tokenizer_config.json names an eos that tokenizer.json does not add: transformers adds it (and splits
    it out of text), so the folder is loaded by transformers, whatever a warm cache holds, and the eos id
    is transformers' own."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "llama3"
    shutil.copytree(fixture_tokenizer("llama3"), folder)
    ChatEncoder(load_tokenizer(str(folder)))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, eos_token="hello")))
    encoder = ChatEncoder(load_tokenizer(str(folder)))
    assert encoder.eos_token_id == AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("hello")


@needs_fixtures
def test_texts_only_hf_can_encode_still_go_to_hf_on_a_warm_cache(tmp_path, monkeypatch):
    """Qwen2.5 normalizes to NFC, so a text that is not NFC is HF's to encode: on a warm cache the
    process that meets one (here a forked worker) builds the tokenizers.Tokenizer then, and the
    output is HF's."""
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "cache"))
    ChatEncoder(load_tokenizer(fixture_tokenizer("qwen2.5")))
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as handle:
        for i in range(600):
            reply = f"Cafe\u0301 n\u0303 {i}" if i % 50 == 0 else f"It is number {i}."  # decomposed: not NFC
            handle.write(json.dumps({"messages": [{"role": "user", "content": "Say something"},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    outputs = {}
    for backend, num_proc in (("auto", 2), ("hf", 1)):
        manifest = packprep.pack(str(data), tmp_path / backend, fixture_tokenizer("qwen2.5"), max_len=256,
                                 num_proc=num_proc, tokenizer_backend=backend)
        assert manifest["tokenizer"]["backend"] == ("tiktoken" if backend == "auto" else "hf")
        outputs[backend] = pack_outputs(tmp_path / backend / "data")
    assert outputs["auto"] and outputs["auto"] == outputs["hf"]


WORD = "Zanzibar"  # in the test data, not in the built-in guard sample


def tiktoken_differs_on(monkeypatch, word: str):
    """From here on (and in forked workers) the fast path drops the last token of ``word`` (as it
    encodes after a space) wherever a text holds it: a conversion wrong on one word, which the
    guard sample never shows."""
    encode_batch = TiktokenBackend.encode_batch

    def altered(self, texts, add_special_tokens=False, positions=None, clean=None):
        out = encode_batch(self, texts, add_special_tokens, positions, clean)
        [(word_ids, _)] = encode_batch(self, [" " + word])
        assert len(word_ids) >= 2
        changed = []
        for text, (ids, cuts) in zip(texts, out):
            if word in text:
                windows = np.lib.stride_tricks.sliding_window_view(ids, len(word_ids))
                hits = np.flatnonzero((windows == word_ids).all(axis=1))
                assert len(hits)
                ids = np.delete(ids, hits + len(word_ids) - 1)
            changed.append((ids, cuts))
        return changed

    monkeypatch.setattr(TiktokenBackend, "encode_batch", altered)


def chats_mentioning(path, word: str, count: int = 3000):
    with open(path, "w") as handle:
        for i in range(count):
            reply = (f"Answer {i}: " + ("the spice islands of " + word if i % 97 == 5 else "nothing special") +
                     ". " + "Some more words to make this reply longer than a line. " * 6)
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"Tell me about place {i}."},
                                                  {"role": "assistant", "content": reply}]}) + "\n")
    return str(path)


@needs_fixtures
def test_a_difference_in_the_data_reruns_the_encode_stage_with_hf(tmp_path, monkeypatch):
    """Warm cache, so no process runs the runtime guard of its own: the data guard (the first 200k
    characters, in a process beside the workers) finds the difference, the encode stage
    runs again with HF, and the output is HF's, byte for byte, with one process or two; the manifest
    says hf and the verdict is cached. Without the guard the output would be wrong."""
    from packprep.parts import plan_parts
    from packprep.read import resolve_inputs

    tokenizer = fixture_tokenizer("llama3")
    assert not any(WORD in text for text in guard_sample(load_tokenizer(tokenizer)))
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "warm"))
    ChatEncoder(load_tokenizer(tokenizer))  # the run that makes, checks and records the conversion
    data = chats_mentioning(tmp_path / "chats.jsonl", WORD)
    assert len(plan_parts(resolve_inputs([data]), 2)) >= 2, "both workers encode"
    settings = dict(max_len=1024, seed=3)
    hf = packprep.pack(data, tmp_path / "hf", tokenizer, num_proc=1, tokenizer_backend="hf", **settings)
    tiktoken_differs_on(monkeypatch, WORD)

    def warm_cache(name):  # a copy of the warm cache for each run: the first rerun records "differs"
        shutil.copytree(tmp_path / "warm", tmp_path / name)
        monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / name))

    warm_cache("cache-unguarded")
    with monkeypatch.context() as unguarded:
        unguarded.setattr(ChatEncoder, "differs_from_hf", lambda self, rendered: None)
        wrong = packprep.pack(data, tmp_path / "wrong", tokenizer, num_proc=2, **settings)
    assert wrong["tokenizer"]["backend"] == "tiktoken"
    assert pack_outputs(tmp_path / "wrong" / "data") != pack_outputs(tmp_path / "hf" / "data")
    for num_proc in (1, 2):
        warm_cache(f"cache{num_proc}")
        with pytest.warns(UserWarning, match="tokenizes this text differently from HF: .*encoding every "
                                             "record again with HF"):
            manifest = packprep.pack(data, tmp_path / f"auto{num_proc}", tokenizer, num_proc=num_proc, **settings)
        assert manifest["tokenizer"]["backend"] == "hf"
        assert {key for key in manifest if manifest[key] != hf[key]} == {"config"}  # tokenizer_backend "auto"
        assert pack_outputs(tmp_path / f"auto{num_proc}" / "data") == pack_outputs(tmp_path / "hf" / "data")
        with pytest.warns(UserWarning, match="an earlier run found that it tokenizes this text differently"):
            assert ChatEncoder(load_tokenizer(tokenizer)).backend_name == "hf", "later runs go to HF at once"
    warm_cache("cache-explicit")
    with pytest.raises(ConfigError, match='tiktoken"? is not possible with this tokenizer: it tokenizes'):
        packprep.pack(data, tmp_path / "explicit", tokenizer, num_proc=2, tokenizer_backend="tiktoken", **settings)


@needs_fixtures
def test_stats_has_the_same_data_guard(tmp_path, monkeypatch):
    tokenizer = fixture_tokenizer("llama3")
    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path / "warm"))
    ChatEncoder(load_tokenizer(tokenizer))
    data = chats_mentioning(tmp_path / "chats.jsonl", WORD)
    hf = packprep.stats(data, tokenizer, num_proc=1, tokenizer_backend="hf")
    tiktoken_differs_on(monkeypatch, WORD)
    with pytest.warns(UserWarning, match="encoding every record again with HF"):
        assert packprep.stats(data, tokenizer, num_proc=2) == hf


@needs_fixtures
@pytest.mark.parametrize("failure", ["raises", "dies"])
def test_a_data_guard_that_fails_stops_the_run(tmp_path, monkeypatch, failure):
    """No verdict is no pass: the run stops, saying why, rather than keep tiktoken's output unchecked."""
    def differs_from_hf(self, rendered):
        if failure == "dies":
            os._exit(3)
        raise ValueError("not today")

    monkeypatch.setattr(ChatEncoder, "differs_from_hf", differs_from_hf)
    match = "not today" if failure == "raises" else "data guard's process .* ended with exit code 3 before its work was done"
    with pytest.raises(ValueError if failure == "raises" else WorkerDied, match=match):
        packprep.pack(str(CONVERSATIONS / "llamafactory_glaive_toolcall_en_demo.json"), tmp_path / "out",
                      fixture_tokenizer("llama3"), max_len=2048, num_proc=2)
    assert not (tmp_path / "out").exists()
