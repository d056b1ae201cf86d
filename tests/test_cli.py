"""The ``packprep`` command driven through click's CliRunner: every command's output, exit codes and
--help examples, and that the CLI adds no policy of its own (the library's defaults and errors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG, EXIT_VERIFY, ConfigError
from packprep.pipeline import repack

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

COMMANDS = ("pack", "verify", "stats", "inspect", "push", "export")


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "packed"
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 512, "-o", out, "-q", "--num-proc", 1)
    assert result.exit_code == 0, result.output
    return out


def test_main_help_and_version():
    result = run("--help")
    assert result.exit_code == 0
    assert "packprep pack chats.jsonl" in result.output
    assert all(command in result.output for command in COMMANDS)
    assert "Exit codes:" in result.output
    assert run("--version").output.strip() == f"packprep, version {packprep.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_shows_examples_and_exit_codes(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    examples = re.split(r"^\S.*:$", result.output.split("Examples:", 1)[1], flags=re.M)[0]
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("packprep ")]
    assert lines and all(line.split()[1] == command for line in lines)
    assert "Exit codes:" in result.output


def test_pack_prints_what_became_of_every_record(packed):
    manifest = json.loads((packed / "packprep.json").read_text())
    counts = manifest["counts"]
    # the summary, as pack prints it, from the manifest's own numbers
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 512, "-o", packed, "-q",
                 "--num-proc", 1, "--overwrite")
    assert result.exit_code == 0, result.output
    assert f"read {counts['records']:,} records: packed whole {counts['packed']:,}, truncated {counts['truncated']:,}" \
        in result.output
    assert f"rejected {counts['rejected']:,} (see {packed}/rejects.jsonl)" in result.output
    assert f"train: {manifest['rows']:,} rows, {manifest['sequences']:,} sequences" in result.output
    assert f"next: packprep verify {packed}" in result.output


def summary_numbers(output: str) -> dict:
    """The fates pack's summary line names, as numbers."""
    line = next(line for line in output.splitlines() if line.startswith("read "))
    return {name: int(n.replace(",", "")) for n, name in
            [(m.split()[-1], " ".join(m.split()[:-1])) for m in line.split(": ", 1)[1].split(" (")[0].split(", ")]} | {
        "unsampled": int(line.split("unsampled ")[1].split()[0].replace(",", "")) if "unsampled" in line else 0,
        "records": int(line.split()[1].replace(",", ""))}


def test_the_summary_accounts_for_every_record_of_a_mixture(tmp_path):
    """Packed whole, truncated, split, rejected and unsampled add up to the records read; the held-out
    records are named; no doubled slash; a singular is singular."""
    out = tmp_path / "mixed/"
    result = run("pack", "--mix", Path(EXAMPLE_CHATS).parent / "mix.yaml", "-t", EXAMPLE_TOKENIZER, "--max-len", 1024,
                 "-o", f"{out}/", "-q", "--num-proc", 1, "--validation-size", 0.02)
    assert result.exit_code == 0, result.output
    counts = json.loads((out / "packprep.json").read_text())["counts"]
    said = summary_numbers(result.output)
    assert said["unsampled"] == counts["unsampled"] > 0
    assert said["packed whole"] + said["truncated"] + said["split"] + said["rejected"] + said["unsampled"] \
        == said["records"] == counts["records"]
    assert "validation: 14 records of those above" in result.output
    assert "//" not in result.output and "(copies included)" in result.output
    assert f"unsampled {counts['unsampled']:,} (left" in run("stats", out).output


def test_minibatch_and_balance_say_what_they_did(tmp_path):
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 1024, "-o", tmp_path / "mb", "-q",
                 "--strategy", "minibatch", "--samples-per-row", 8, "--num-proc", 1)
    assert result.exit_code == 0, result.output
    fill = float(result.output.split("fill ")[1].split("%")[0])
    assert 0 < fill <= 100 and "efficiency" not in result.output  # rows above --max-len: not an efficiency
    report = run("stats", tmp_path / "mb")
    assert f"fill {fill:.2f}% of rows padded to the longest" in report.output and "efficiency" not in report.output
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 2048, "-o", tmp_path / "bal", "-q",
                 "--balance-dp", 4, "--num-proc", 1)
    balance = json.loads((tmp_path / "bal" / "packprep.json").read_text())["balance"]
    assert (f"balanced for 4 data-parallel ranks (distributed sampler, 1 row a rank a step, {balance['steps']:,} whole "
            f"steps): predicted step efficiency {balance['step_efficiency']:.3f} read in order, "
            f"{balance['step_efficiency_shuffled']:.3f} if a sampler shuffles them") in result.output


def test_library_errors_name_arguments_and_the_cli_names_options(packed):
    with pytest.raises(ConfigError, match=r"pass overwrite=True to replace it") as caught:
        packprep.pack([str(EXAMPLE_CHATS)], packed, tokenizer=str(EXAMPLE_TOKENIZER))
    assert "--" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"^max_len must be between"):
        packprep.pack([str(EXAMPLE_CHATS)], packed.parent / "new", tokenizer=str(EXAMPLE_TOKENIZER), max_len=1)
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", packed, "--max-len", 1)
    assert "--max-len must be between" in result.output


def test_reject_reasons_name_arguments_from_python_and_options_from_the_cli(tmp_path):
    """rejects.jsonl and the manifest's examples name settings as the caller does, as errors do; repack's
    too, where it says the new length in a reason the folder holds."""
    lead = {"conversations": [{"from": "gpt", "value": "Hi."}, {"from": "human", "value": "Q?"},
                              {"from": "gpt", "value": "A."}]}
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(lead) + "\n" + EXAMPLE_CHATS.read_text())

    def reasons(folder: Path) -> dict[str, str]:
        lines = (folder / "rejects.jsonl").read_text().splitlines()
        return {entry["code"]: entry["reason"] for entry in map(json.loads, lines)}

    manifest = packprep.pack(str(data), str(tmp_path / "lib"), str(EXAMPLE_TOKENIZER), max_len=400, overlong="drop",
                             leading_assistant="reject", num_proc=1)
    said = reasons(tmp_path / "lib")
    assert 'leading_assistant="drop" removes them' in said["leading_assistant"]
    assert 'longer than max_len 400 (overlong="drop")' in said["overlong"]
    assert "--" not in json.dumps([said, manifest["counts"]["top_rejections"]])
    repack(tmp_path / "lib", tmp_path / "shorter", max_len=300, num_proc=1)
    assert "longer than max_len 300" in reasons(tmp_path / "shorter")["overlong"]
    result = run("pack", data, "-t", EXAMPLE_TOKENIZER, "--max-len", 400, "--overlong", "drop", "--leading-assistant",
                 "reject", "-o", tmp_path / "cli", "-q", "--num-proc", 1)
    assert result.exit_code == 0, result.output
    said = reasons(tmp_path / "cli")
    assert "--leading-assistant drop removes them" in said["leading_assistant"]
    assert "longer than --max-len 400 (--overlong drop)" in said["overlong"]


def test_pack_refuses_to_overwrite(packed):
    before = (packed / "packprep.json").read_bytes()
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", packed, "-q")
    assert result.exit_code == EXIT_CONFIG
    assert "already exists; pass --overwrite" in result.output
    assert (packed / "packprep.json").read_bytes() == before


def test_pack_bad_choice_is_a_usage_error(tmp_path):
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", tmp_path / "o", "--strategy", "ffd")
    assert result.exit_code == 2 and "'ffd' is not one of" in result.output
    result = run("pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", tmp_path / "o", "--strategy", "minibatch")
    assert result.exit_code == EXIT_CONFIG and "--samples-per-row" in result.output
    assert not (tmp_path / "o").exists()


def test_cli_and_library_pack_the_same_way(packed, tmp_path):
    """The CLI sets no default of its own: its config is the library's for the same arguments
    (with --engine ray too: the partition size is the library's)."""
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "lib"), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    assert json.loads((packed / "packprep.json").read_text())["config"] == manifest["config"]
    from packprep.cli import pack as pack_command

    defaults = {p.name: p.default for p in pack_command.params if not p.required}
    assert defaults["engine"] == "local" and defaults["partition_size"] is None


def test_verify_ok_json_and_failure(packed, tmp_path):
    result = run("verify", packed)
    assert result.exit_code == 0
    assert result.output.startswith("ok: ") and " rows, " in result.output
    report = json.loads(run("verify", packed, "--json").output)
    assert report["ok"] is True and report["failures"] == []
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "packprep.json").write_text("{}")
    result = CliRunner().invoke(main, ["verify", str(broken)])
    assert result.exit_code == EXIT_VERIFY
    assert "[manifest]" in result.output


def test_stats_on_inputs_text_and_json():
    result = run("stats", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 256, "--max-len", 512, "-q",
                 "--num-proc", 1)
    assert result.exit_code == 0, result.output
    assert "what if (global batch 64, 1 epoch, --overlong truncate):" in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    report = json.loads(run("stats", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "--max-len", 512, "--strategy", "greedy",
                            "-q", "--num-proc", 1, "--json").output)
    assert [(r["max_len"], r["strategy"]) for r in report["what_if"]["rows"]] == [(512, "greedy")]


def test_stats_on_a_packed_folder(packed):
    result = run("stats", packed)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"packed folder: {packed}")


def test_stats_needs_a_tokenizer_for_inputs():
    result = CliRunner().invoke(main, ["stats", str(EXAMPLE_CHATS)])
    assert result.exit_code == EXIT_CONFIG
    assert "--tokenizer is required" in result.output


def test_inspect_row_and_bad_row(packed):
    result = run("inspect", packed, "--row", 0, "--no-color")
    assert result.exit_code == 0
    assert result.output.startswith("row 0 of ")
    assert "[[" in result.output
    result = CliRunner().invoke(main, ["inspect", str(packed), "--row", "100000"])
    assert result.exit_code == EXIT_CONFIG


def test_export_writes_another_layout_and_refuses_to_overwrite(packed, tmp_path):
    out = tmp_path / "trl"
    result = run("export", packed, "--to", "trl", out)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("wrote ") and "laid out for trl" in result.output
    result = CliRunner().invoke(main, ["export", str(packed), "--to", "trl", str(out)])
    assert result.exit_code == EXIT_CONFIG and "--overwrite" in result.output


def test_push_refuses_a_folder_that_fails_verify(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "packprep.json").write_text("{}")
    result = CliRunner().invoke(main, ["push", str(broken), "me/repo", "--token", "hf_x"])
    assert result.exit_code == EXIT_VERIFY


@pytest.mark.parametrize("call", ["pack", "stats"])
def test_an_unknown_setting_is_the_same_config_error(call, tmp_path):
    with pytest.raises(ConfigError, match=rf"unknown setting\(s\) for {call}: max_length \(known: max_len, "):
        if call == "pack":
            packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "o"), str(EXAMPLE_TOKENIZER), max_length=512)
        else:
            packprep.stats(str(EXAMPLE_CHATS), str(EXAMPLE_TOKENIZER), max_length=512)
    assert not (tmp_path / "o").exists()


def test_the_command_starts_no_blas_thread_per_core():
    """packprep does no linear algebra: numpy under the CLI must not start OpenBLAS's thread pool
    (on 16 cores it cost 0.1 s of start-up and 2 CPU-seconds)."""
    import os
    import subprocess
    import sys

    code = ("import os, packprep.cli, numpy; import numpy.linalg\n"
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "print(sum(name != 'jemalloc_bg_thd' for name in names))")  # pyarrow's allocator keeps one
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_a_reader_that_leaves_early_gets_no_traceback(packed):
    """`packprep inspect ... | true`: the reader is gone before the first print; the command stops quietly."""
    import subprocess
    import sys

    command = f"{sys.executable} -m packprep inspect {packed} --row 0 | true"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 141  # stopped by the closed pipe, as `yes | head` is


def test_every_flag_is_spelled_as_a_flag_for_library_callers():
    """A library error that names a CLI flag reads ``name=True``, not ``name="next-word"``: the speller's
    list of flags is the CLI's."""
    from packprep.errors import FLAGS

    flags = {opt.lstrip("-") for command in main.commands.values() for param in command.params
             if getattr(param, "is_flag", False) for opt in param.opts if opt.startswith("--")}
    assert flags - {"help", "version"} <= FLAGS
