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


def needs_vision_transformers():
    """Skip the calling test module below transformers 5, whose processors' replace_image_token the vision
    path uses (packprep refuses an older one for images with that reason)."""
    return pytest.importorskip("transformers", minversion="5.0",
                               reason="the vision path needs transformers 5 (its processors' replace_image_token)")


def fixture_tokenizer(name: str) -> str:
    return str(TOKENIZERS / name)


# The tests the fast lane (pytest -m "not slow") leaves out, by module: real tokenizers over whole
# fixture files, Ray, the trainers and the training stacks, and runs of the CLI in subprocesses.
# CI runs everything (.ci/run). A test elsewhere may carry @pytest.mark.slow itself.
SLOW_MODULES = {
    "test_labels_reference", "test_tiktoken_backend", "test_render", "test_retokenize", "test_real_inputs",
    "test_tokenizer_folder", "test_ray_cluster", "test_ray_engine", "test_trainers", "test_stack_layouts",
    "test_torch_packed", "test_robustness", "test_gpu_balance_dry",
}
SLOW_TESTS = {  # real tokenizers over whole fixture files, in modules that are otherwise fast
    "test_real_tokenizers_decode_exactly", "test_packs_every_fixture_file_with_real_tokenizers",
    "test_stats_equals_pack_on_fixture_data_with_llama3",
    "test_every_block_on_the_page_runs",  # every command of README.md and docs/, run (tests/test_docs.py)
}


def slow_but(fast, values) -> list:
    """``values`` to parametrize a slow test with, all but those in ``fast`` marked slow: its quick
    cases stay in the fast lane. A tuple is the values of several arguments."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if v in fast else pytest.mark.slow)
            for v in values]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


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
