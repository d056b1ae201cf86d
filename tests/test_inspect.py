"""``packprep inspect``: one packed row decoded, with its sequence boundaries and trained tokens."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG, ConfigError
from packprep.inspection import CLOSE, OPEN, inspect_row
from packprep.tokenization import load_tokenizer

from .conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures

HEADER = re.compile(r"^── sequence (\d+)/(\d+) · record (\d+) · ([\d,]+) tokens, ([\d,]+) trained ─+$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect") / "packed"
    packprep.pack(str(EXAMPLE_CHATS), str(out), str(EXAMPLE_TOKENIZER), num_proc=1, max_len=512, shard_size="60KB")
    return out


def all_rows(folder: Path) -> list[dict]:
    manifest = json.loads((folder / "packprep.json").read_text())
    rows = []
    for shard in manifest["shards"]:
        rows += pq.read_table(folder / shard["path"]).to_pylist()
    return rows


def trained_runs(tok, row: dict) -> list[str]:
    """The trained stretches of a row, decoded: what must appear between [[ and ]]."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(run, skip_special_tokens=False) for run in runs]


def check_row(folder: Path, rows: list[dict], k: int, tok) -> None:
    text = inspect_row(folder, k, color=False)
    row = rows[k]
    headers = HEADER.findall(text)
    assert len(headers) == len(row["seq_lens"])
    for number, (n, total, record, length, trained) in enumerate(headers, start=1):
        assert (int(n), int(total)) == (number, len(row["seq_lens"]))
        assert int(record) == row["source_index"][number - 1]
        assert int(length.replace(",", "")) == row["seq_lens"][number - 1]
    assert sum(int(h[4].replace(",", "")) for h in headers) == sum(1 for x in row["labels"] if x != -100)
    body = text.split("\n", 2)[2]  # after the row line and the legend (which shows [[ and ]] itself)
    marked = re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), body, re.S)
    # a run may span a sequence boundary in the flat row, but a header splits it in the text
    assert "".join(marked) == "".join(trained_runs(tok, row))
    # with the brackets and headers removed, what is left is the decoded sequences
    body = HEADER.sub("", body).replace(OPEN, "").replace(CLOSE, "")
    start = 0
    for length in row["seq_lens"]:
        assert tok.decode(row["input_ids"][start : start + length], skip_special_tokens=False) in body
        start += length


def test_rows_across_shards(packed):
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    rows = all_rows(packed)
    manifest = json.loads((packed / "packprep.json").read_text())
    assert len(manifest["shards"]) >= 2
    last_of_first = manifest["shards"][0]["rows"] - 1
    for k in (0, last_of_first, last_of_first + 1, len(rows) - 1):
        check_row(packed, rows, k, tok)
    assert inspect_row(packed, -1, color=False) == inspect_row(packed, len(rows) - 1, color=False)
    head = inspect_row(packed, last_of_first + 1, color=False).splitlines()[0]
    assert head.startswith(f"row {last_of_first + 1} of {len(rows)} ({manifest['shards'][1]['path']}, row 0)")


def test_color(packed):
    plain = inspect_row(packed, 0, color=False)
    colored = inspect_row(packed, 0, color=True)
    assert OPEN not in colored and "\x1b[32m" in colored
    assert OPEN in plain and "\x1b[" not in plain
    # same text once the markup is gone (the legend line differs)
    strip = lambda s: s.split("\n", 2)[2].replace(OPEN, "").replace(CLOSE, "")  # noqa: E731
    assert ANSI.sub("", strip(colored)) == strip(plain)


def test_bad_row_and_folder(packed, tmp_path):
    rows = json.loads((packed / "packprep.json").read_text())["rows"]
    with pytest.raises(ConfigError, match=f"has {rows} rows"):
        inspect_row(packed, rows, color=False)
    with pytest.raises(ConfigError, match="packprep.json"):
        inspect_row(tmp_path, 0)
    moved = tmp_path / "moved"
    shutil.copytree(packed, moved)
    manifest = json.loads((moved / "packprep.json").read_text())
    manifest["tokenizer"]["name_or_path"] = str(tmp_path / "gone")
    (moved / "packprep.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="pass tokenizer"):
        inspect_row(moved, 0, color=False)
    assert inspect_row(moved, 0, color=False, tokenizer=str(EXAMPLE_TOKENIZER)) == inspect_row(packed, 0, color=False)


def test_cli_inspect(packed):
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(packed), "--row", "1"])
    assert result.exit_code == 0, result.output
    assert result.output == inspect_row(packed, 1, color=False)  # piped: brackets, no colour
    forced = runner.invoke(main, ["inspect", str(packed), "-r", "1", "--color"])
    assert "\x1b[32m" in forced.output
    bad = runner.invoke(main, ["inspect", str(packed), "--row", "100000"])
    assert bad.exit_code == EXIT_CONFIG and "--row" in bad.output


@needs_fixtures
@pytest.mark.parametrize("name", ["llama3", "llama2"])
def test_real_tokenizers_decode_exactly(tmp_path, name):
    """Byte-level BPE and SentencePiece: runs decode without lost spaces or broken characters."""
    lines = (CONVERSATIONS / "medicalgpt_sharegpt_zh_1K_format.jsonl").read_text(encoding="utf-8").splitlines()
    data = tmp_path / "medical.jsonl"
    data.write_text("\n".join(lines[:12]) + "\n", encoding="utf-8")
    tokenizer = fixture_tokenizer(name)
    out = tmp_path / "out"
    packprep.pack(str(data), str(out), tokenizer, num_proc=1, max_len=2048, on_error="skip")
    tok = load_tokenizer(tokenizer)
    rows = all_rows(out)
    text = inspect_row(out, 0, color=False)
    assert "\ufffd" not in text
    start, body = 0, HEADER.sub("", text.split("\n", 2)[2]).replace(OPEN, "").replace(CLOSE, "")
    for length in rows[0]["seq_lens"]:
        assert tok.decode(rows[0]["input_ids"][start : start + length], skip_special_tokens=False) in body
        start += length
