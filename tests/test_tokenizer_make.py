"""``packprep tokenizer make``: a tokenizer folder from a vocabulary, a template file and the family's
special tokens, equal to the model's own folder where the fixtures hold its vocabulary."""

from __future__ import annotations

import json

from click.testing import CliRunner

from packprep.cli import main
from packprep.errors import EXIT_CONFIG

from .conftest import TOKENIZERS, needs_fixtures
from .template_folders import TEMPLATES, build_folder

QWEN3_TAGS = ("<tool_response>", "</tool_response>", "<think>", "</think>")


def make(*args):
    return CliRunner().invoke(main, ["tokenizer", "make", *map(str, args)], catch_exceptions=False)


@needs_fixtures
def test_qwen3_made_from_the_qwen25_vocabulary_is_the_qwen3_folder(tmp_path):
    tags = [arg for tag in QWEN3_TAGS for arg in ("--added-token", tag)]
    result = make("--vocab", TOKENIZERS / "qwen2.5", "--template", TEMPLATES / "qwen3.jinja", "--eos", "<|im_end|>",
                  *tags, "-o", tmp_path / "qwen3")
    assert result.exit_code == 0, result.output
    expected = build_folder("qwen3", tmp_path / "expected")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / "qwen3" / name).read_text()) == json.loads((expected / name).read_text()), name
    again = make("--vocab", TOKENIZERS / "qwen2.5", "--template", TEMPLATES / "qwen3.jinja", "--eos", "<|im_end|>",
                 "-o", tmp_path / "qwen3")
    assert again.exit_code == EXIT_CONFIG and "already exists" in again.output


@needs_fixtures
def test_a_new_special_token_is_one_token_at_the_next_free_id(tmp_path):
    from transformers import AutoTokenizer

    result = make("--vocab", TOKENIZERS / "llama3", "--template", TEMPLATES / "llama-3.2.jinja", "--eos", "<|eot_id|>",
                  "--special-token", "<|my_turn|>", "-o", tmp_path / "tok")
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    before = AutoTokenizer.from_pretrained(TOKENIZERS / "llama3")
    assert tokenizer.encode("a<|my_turn|>b", add_special_tokens=False)[1] == len(before)
    assert tokenizer.eos_token == "<|eot_id|>" and "Today Date" in tokenizer.chat_template


def test_a_missing_template_or_vocabulary_is_named(tmp_path):
    result = make("--vocab", tmp_path, "--template", tmp_path / "none.jinja", "--eos", "x", "-o", tmp_path / "o")
    assert result.exit_code == EXIT_CONFIG and "--template" in result.output and "none.jinja" in result.output
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    result = make("--vocab", tmp_path, "--template", tmp_path / "t.jinja", "--eos", "x", "-o", tmp_path / "o")
    assert result.exit_code == EXIT_CONFIG and "no tokenizer.json" in result.output
    assert not (tmp_path / "o").exists()
