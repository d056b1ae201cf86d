"""What a user reads: reasons and errors whole (never cut mid-sentence), naming what they typed, in
packprep's one ``error:`` style; --help under headings; every split reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
from click.testing import CliRunner

from packprep.cli import main
from packprep.cli_frame import GROUP_OF, SectionedCommand
from packprep.errors import listing

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

EXAMPLES = Path(EXAMPLE_CHATS).parent


def run(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kwargs)


def test_every_option_of_a_sectioned_command_has_a_heading():
    sectioned = [command for command in main.commands.values() if isinstance(command, SectionedCommand)]
    assert {command.name for command in sectioned} >= {"pack", "stats"}
    for command in sectioned:
        ctx = click.Context(command)
        options = [p.name for p in command.get_params(ctx) if isinstance(p, click.Option)
                   and p is not command.get_help_option(ctx)]
        assert [name for name in options if name not in GROUP_OF] == [], command.name


def test_pack_help_shows_the_essentials_on_the_first_screen_under_headings():
    lines = run("pack", "--help").output.splitlines()
    headings = [line for line in lines if line.endswith(":") and not line.startswith((" ", "Usage"))]
    assert headings[:3] == ["Input:", "Output:", "Packing:"]
    first_screen = "\n".join(lines[:62])
    assert all(option in first_screen for option in ("--tokenizer", "--output", "--overwrite", "--mix", "--max-len"))


def test_click_usage_errors_come_in_packprep_style(tmp_path):
    for args, said in [(("pack", "a.jsonl", "-t", "tok", "-o", tmp_path / "o", "--max-len", "abc"),
                        "error: invalid value for '--max-len': 'abc' is not a valid integer"),
                       (("pack", "a.jsonl", "-o", tmp_path / "o"), "error: missing option '--tokenizer'"),
                       (("nope",), "error: no such command 'nope'")]:
        result = run(*args)
        assert result.exit_code == 2
        assert result.output.startswith(said), result.output
        assert "Usage:" not in result.output and "Error:" not in result.output
        assert "--help)" in result.output and len(result.output.strip().splitlines()) == 1


def test_the_example_summary_lists_every_reject_reason_whole(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}'
    bad.write_text(good + '\n{"conversations": [{"from": "human", "value": "a\tb"}]}\n')
    result = run("pack", bad, EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 1024, "-o", tmp_path / "p", "-q",
                 "--num-proc", 1)
    assert result.exit_code == 0, result.output
    summary = result.output.split("  train:")[0]
    for code in ("unreadable", "empty", "no_assistant_turn", "unknown_role", "wrong_type"):
        assert f"    {code} 1: e.g." in summary
    assert "Invalid control character at" not in summary and "JSON needs it escaped" in summary
    rejects = [json.loads(line) for line in (tmp_path / "p" / "rejects.jsonl").read_text().splitlines()]
    role = next(r["reason"] for r in rejects if r["code"] == "unknown_role")
    assert role.endswith("'tool', 'user'"), role  # the list whole, not cut mid-item


def test_a_list_too_long_to_show_says_how_many_more():
    assert listing(range(3)) == "0, 1, 2"
    assert listing(range(12), 8) == "0, 1, 2, 3, 4, 5, 6, 7, +4 more"


def test_more_reasons_than_shown_are_named_not_cut(tmp_path):
    lines = [{"conversations": []}, {"conversations": [{"from": "human", "value": "x"}]},
             {"conversations": [{"from": "narrator", "value": "x"}]}, {"conversations": [{"from": "human", "value": 1}]},
             {"conversations": "x"}, [1], {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{bad\n")
    result = run("pack", path, "-t", EXAMPLE_TOKENIZER, "-o", tmp_path / "p", "-q", "--num-proc", 1)
    assert result.exit_code == 0, result.output
    more = [line for line in result.output.splitlines() if "more reasons:" in line]
    assert len(more) == 1 and more[0].strip().startswith("+"), result.output


def test_a_copied_mixture_file_names_itself_and_the_folder_its_paths_are_read_from(tmp_path, monkeypatch):
    shutil.copy(EXAMPLES / "mix.yaml", tmp_path / "mix.yaml")
    monkeypatch.chdir(tmp_path)
    result = run("pack", "--mix", "mix.yaml", "-t", EXAMPLE_TOKENIZER, "-o", "packed/", "-q")
    assert result.exit_code == 2
    assert "--mix mix.yaml, source 1" in result.output and str(tmp_path) in result.output
    assert "chats.jsonl: no such file or folder" in result.output


def test_the_output_exists_error_shows_the_path_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "packed").mkdir()
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", "packed/", "-q")
    assert result.exit_code == 2 and result.output.startswith("error: packed/ already exists"), result.output


def test_verify_and_stats_report_the_validation_split(tmp_path):
    out = tmp_path / "p"
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 1024, "--validation-size", 0.1,
                 "-o", out, "-q", "--num-proc", 1)
    assert result.exit_code == 0, result.output
    validation = json.loads((out / "packprep.json").read_text())["validation"]
    said = run("verify", out, "--num-proc", 1).output
    assert said.startswith("ok: train ") and f"; validation {validation['rows']:,} rows" in said
    assert json.loads(run("verify", out, "--json", "--num-proc", 1).output)["validation"]["tokens"] == \
        validation["tokens"]["total"]
    stats = run("stats", out).output
    assert f"validation: {validation['rows']:,} rows, {validation['sequences']:,} sequences" in stats
