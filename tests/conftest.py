"""Shared test fixtures: the bundled example, and the real tokenizers and data beside the repo."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
# conversions packprep caches between runs (tiktoken ranks) go to a folder of this test session
if "PACKPREP_CACHE" not in os.environ:
    os.environ["PACKPREP_CACHE"] = tempfile.mkdtemp(prefix="packprep-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PACKPREP_CACHE"], True)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CHATS = REPO / "examples" / "chats.jsonl"
EXAMPLE_TOKENIZER = REPO / "examples" / "tokenizer"
FIXTURES = REPO.parent / "shared" / "fixtures"
CONVERSATIONS = FIXTURES / "conversations"
TOKENIZERS = FIXTURES / "tokenizers"

needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="../shared/fixtures is not beside the repo")


def fixture_tokenizer(name: str) -> str:
    return str(TOKENIZERS / name)


@pytest.fixture(scope="session")
def template_folder(tmp_path_factory):
    """``template_folder("qwen3")``: the path of that family's tokenizer folder (tests/template_folders.py)."""
    from .template_folders import build_folder

    root = tmp_path_factory.mktemp("template-folders")
    built = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_folder(name, root / name))
        return built[name]

    return get
