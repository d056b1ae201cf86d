"""The transformers-free tokenizer loader is held to transformers itself: same ids, same renderings.

packprep loads a tokenizer folder with ``tokenizers`` + ``jinja2`` (tokenizer_folder.py) so that a
run starts in a second instead of importing torch; these tests are what makes that safe.
"""

import json
import subprocess
import sys

import pytest

from packprep.normalize import Rejected, detect_format, normalize
from packprep.read import read_records, resolve_inputs
from packprep.render import ChatTemplate
from packprep.tokenization import load_tokenizer
from packprep.tokenizer_folder import FolderTokenizer, loadable

from .conftest import CONVERSATIONS, EXAMPLE_TOKENIZER, REPO, fixture_tokenizer, needs_fixtures

NAMES = ["llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2"]


def folders():
    return [str(EXAMPLE_TOKENIZER)] + [fixture_tokenizer(name) for name in NAMES]


def fixture_conversations(limit_per_file: int = 60):
    out = []
    for path in sorted(CONVERSATIONS.glob("*.json*")):
        for n, record in enumerate(read_records(resolve_inputs([str(path)])[0])):
            if n >= limit_per_file:
                break
            try:
                out.append(normalize(record.data, detect_format(record.data)))
            except Rejected:
                pass
    return out


@needs_fixtures
@pytest.mark.parametrize("folder", folders(), ids=["example"] + NAMES)
def test_the_folder_loader_matches_transformers(folder):
    ours, theirs = load_tokenizer(folder), load_tokenizer(folder, transformers=True)
    assert isinstance(ours, FolderTokenizer) and not isinstance(theirs, FolderTokenizer)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)
    assert len(ours) == len(theirs)
    assert ours.chat_template == theirs.chat_template

    conversations = fixture_conversations()
    texts = [m["content"] for c in conversations for m in c.messages][:3000]
    for special in (False, True):
        mine = [e.ids for e in ours.backend_tokenizer.encode_batch(texts, add_special_tokens=special)]
        assert mine == theirs(texts, add_special_tokens=special)["input_ids"]
    assert ours.decode(mine[5]) == theirs.decode(mine[5])

    template = ChatTemplate(ours)
    rendered = 0
    for conversation in conversations:
        for generation in (False, True):
            try:
                expected = theirs.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=False,
                                                      add_generation_prompt=generation)
            except Exception:
                with pytest.raises(Rejected):
                    template.render(conversation.messages, conversation.tools, generation)
                continue
            assert template.render(conversation.messages, conversation.tools, generation) == expected
            rendered += 1
    assert rendered > 100


def test_folders_whose_class_rebuilds_the_pipeline_go_to_transformers(tmp_path):
    (tmp_path / "tokenizer.json").write_text((EXAMPLE_TOKENIZER / "tokenizer.json").read_text())
    config = json.loads((EXAMPLE_TOKENIZER / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="LlamaTokenizer")))
    assert not loadable(tmp_path)
    assert loadable(EXAMPLE_TOKENIZER)
    assert not loadable(tmp_path / "missing")


def test_a_template_file_beside_the_config_wins(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((EXAMPLE_TOKENIZER / name).read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert FolderTokenizer(tmp_path).chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_tokenizer(str(tmp_path), transformers=True).chat_template == FolderTokenizer(tmp_path).chat_template


def test_loading_a_tokenizer_folder_imports_neither_transformers_nor_torch():
    """Start-up: what made every command take 5-10 s on a machine with torch installed."""
    code = (
        "import sys, packprep; from packprep.tokenization import load_tokenizer, ChatEncoder; "
        f"ChatEncoder(load_tokenizer({str(EXAMPLE_TOKENIZER)!r})); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


@needs_fixtures
def test_the_tiktoken_conversion_is_cached_by_the_tokenizer_files_hash(tmp_path, monkeypatch):
    """The second start reads the ranks from the cache (converting needs the HF tokenizer, which it never
    builds; the cache files stay as they were) and encodes the same."""
    from packprep.tiktoken_backend import fast_backend
    from packprep.tokenization import ChatEncoder

    monkeypatch.setenv("PACKPREP_CACHE", str(tmp_path))
    first = ChatEncoder(load_tokenizer(fixture_tokenizer("llama3")))
    assert first.backend_name == "tiktoken"
    assert sorted(p.name.split("-v1-")[0] for p in tmp_path.iterdir()) == ["tiktoken-ranks", "tiktoken-verified"]
    cache = lambda: {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}  # noqa: E731
    before = cache()
    tok = load_tokenizer(fixture_tokenizer("llama3"))
    second = ChatEncoder(tok)
    assert second.backend_name == "tiktoken"
    backend, _, verified_before = fast_backend(tok)  # what ChatEncoder(tok) started with
    assert verified_before and not tok.backend_loaded, "converted again instead of reading the cache"
    assert cache() == before
    texts = [m["content"] for c in fixture_conversations(20) for m in c.messages]
    hf = load_tokenizer(fixture_tokenizer("llama3"), transformers=True)
    fast = [ids.tolist() for ids, _ in backend.encode_batch(texts)]
    assert fast == hf(texts, add_special_tokens=False)["input_ids"]
