"""Hostile paths and processes: an output folder that is, holds or lies inside a path the run reads
(through links too), and the exit code of each, with every input byte-identical afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.engines import LocalEngine
from packprep.errors import WorkerDied

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER
from .test_bad_inputs import assert_clean_exit, invoke

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
PACK = ["-t", "models/tok", "--max-len", "512", "--num-proc", "1", "-q"]

# Every command that writes a folder, and each path it reads: (the command line, the path read as typed,
# whether it is a folder). The command line writes to OUT.
READS = {
    "pack a data file": (["pack", "data/chats.jsonl", *PACK], "data/chats.jsonl", False),
    "pack an input folder": (["pack", "data", *PACK], "data", True),
    "pack the tokenizer": (["pack", "data/chats.jsonl", *PACK], "models/tok", True),
    "pack the mixture file": (["pack", "--mix", "mix/mix.yaml", *PACK], "mix/mix.yaml", False),
    "pack a mixture's source": (["pack", "--mix", "mix/mix.yaml", *PACK], "sets/more", True),
    "pack the model config": (["pack", "data/chats.jsonl", *PACK, "--balance-dp", "2", "--model-config",
                               "cfg/config.json"], "cfg/config.json", False),
    "repack its folder": (["repack", "packed", "--num-proc", "1", "-q"], "packed", True),
    "export its folder": (["export", "packed", "--to", "trl"], "packed", True),
}
# How the output stands to the path read (None: not for a file): the output as typed.
RELATIONS = {
    "is": lambda read, folder: read if folder else None,
    "inside": lambda read, folder: f"{read}/sub" if folder else None,
    "around": lambda read, folder: os.path.dirname(read) or ".",
    "around through a link": lambda read, folder: "link",
}


def with_output(args: list[str], out: str) -> list[str]:
    return [*args, "-o", out] if args[0] != "export" else [*args, out]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("packed") / "packed"
    packprep.pack(str(EXAMPLE_CHATS), str(folder), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    return folder


def workspace(root: Path, packed: Path) -> None:
    """Every kind of path a run reads, copied: a refusal that comes too late deletes only copies."""
    (root / "data").mkdir()
    shutil.copyfile(EXAMPLE_CHATS, root / "data" / "chats.jsonl")
    (root / "sets" / "more").mkdir(parents=True)
    shutil.copyfile(EXAMPLE_CHATS, root / "sets" / "more" / "more.jsonl")
    shutil.copytree(EXAMPLE_TOKENIZER, root / "models" / "tok")
    (root / "mix").mkdir()
    (root / "mix" / "mix.yaml").write_text("- path: ../sets/more\n  weight: 1\n")
    (root / "cfg").mkdir()
    (root / "cfg" / "config.json").write_text(json.dumps(CONFIG))
    shutil.copytree(packed, root / "packed")


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


CASES = [(command, relation) for command, (args, read, folder) in READS.items() for relation, out in RELATIONS.items()
         if out(read, folder) is not None]


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
@pytest.mark.parametrize("command, relation", CASES)
def test_no_command_writes_where_it_reads(command, relation, overwrite, packed, tmp_path, monkeypatch):
    args, read, folder = READS[command]
    out = RELATIONS[relation](read, folder)
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, packed)
    if out == "link":
        os.symlink(os.path.abspath(os.path.dirname(read) or "."), "link")
    before = snapshot(tmp_path)
    result = invoke(*with_output(args, out), *(["--overwrite"] if overwrite else []))
    assert_clean_exit(result, 2)
    option = "OUTPUT" if args[0] == "export" else "--output"
    assert result.output.startswith(f"error: {option} {out} ") and result.output.count("\n") == 1, result.output
    assert f" {read}, which this run reads" in result.output or f"/{os.path.basename(read)}, which" in result.output, \
        result.output
    assert snapshot(tmp_path) == before, "nothing read was changed"


@pytest.mark.parametrize("command", ["pack a data file", "repack its folder", "export its folder"])
def test_an_input_given_through_a_link_inside_the_output_is_kept(command, packed, tmp_path, monkeypatch):
    """The link is what the run was given: replacing the folder that holds it would delete it."""
    args, read, _ = READS[command]
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, packed)
    given = "given" + Path(read).suffix
    os.symlink(os.path.abspath(read), given)
    args = [a if a != read else given for a in args]
    before = snapshot(tmp_path)
    result = invoke(*with_output(args, "."), "--overwrite")
    assert_clean_exit(result, 2)
    option = "OUTPUT" if args[0] == "export" else "--output"
    assert result.output.startswith(f"error: {option} . holds {given}, which this run reads"), result.output
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("plot, read", [("data/chats.jsonl", "data/chats.jsonl"), ("data/plot.png", "data"),
                                        ("models/tok/plot.png", "models/tok"), ("link.jsonl", "data/chats.jsonl")])
def test_stats_never_draws_its_plot_over_what_it_reads(plot, read, packed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workspace(tmp_path, packed)
    os.symlink("data/chats.jsonl", "link.jsonl")
    before = snapshot(tmp_path)
    result = invoke("stats", read if read == "data" else "data/chats.jsonl", "-t", "models/tok", "--plot", plot, "-q",
                    "--num-proc", 1)
    assert_clean_exit(result, 2)
    assert result.output.startswith(f"error: --plot {plot} ") and f" {read}, which this run reads" in result.output, \
        result.output
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- verify: exit 4 blames the output, 2 the inputs
def small_pack(tmp_path: Path) -> tuple[Path, Path, Path]:
    data, tok, out = tmp_path / "chats.jsonl", tmp_path / "tok", tmp_path / "out"
    data.write_text("".join(EXAMPLE_CHATS.read_text().splitlines(True)[:20]))
    shutil.copytree(EXAMPLE_TOKENIZER, tok)
    packprep.pack(str(data), str(out), str(tok), max_len=512, num_proc=1)
    return data, tok, out


INPUT_CHANGES = {  # what happens to the inputs after packing, and what verify --retokenize must then say
    "input moved": (lambda data, tok: data.rename(data.with_suffix(".old")), "cannot read {data}"),
    "input changed": (lambda data, tok: data.write_text(data.read_text()[:-100]), "{data} changed since it was packed"),
    "tokenizer changed": (lambda data, tok: (tok / "tokenizer_config.json").write_text(
        (tok / "tokenizer_config.json").read_text() + " "), "the tokenizer {tok} changed since the folder was packed"),
    "tokenizer moved": (lambda data, tok: tok.rename(tok.with_name("elsewhere")), "{tok}"),
}


@pytest.mark.parametrize("change", sorted(INPUT_CHANGES))
def test_verify_retokenize_with_inputs_not_those_packed_is_a_usage_error(change, tmp_path):
    data, tok, out = small_pack(tmp_path)
    harm, message = INPUT_CHANGES[change]
    harm(data, tok)
    result = invoke("verify", out, "--retokenize", 5)
    assert_clean_exit(result, 2)
    assert result.output.startswith("error: ") and message.format(data=data, tok=tok) in result.output, result.output
    assert_clean_exit(invoke("verify", out), 0)


def test_verify_retokenize_of_a_folder_packed_from_standard_input_not_piped_again(tmp_path):
    out = tmp_path / "out"
    data = "".join(EXAMPLE_CHATS.read_text().splitlines(True)[:20])
    assert_clean_exit(CliRunner().invoke(main, ["pack", "-", "-t", EXAMPLE_TOKENIZER, "-o", out, "-q"], input=data), 0)
    result = CliRunner().invoke(main, ["verify", str(out), "--retokenize", "5"], input="")
    assert_clean_exit(result, 2)
    assert "pipe the same data into verify" in result.output


def test_verify_of_a_folder_that_is_no_packed_folder_is_a_usage_error(tmp_path):
    result = invoke("verify", tmp_path)
    assert_clean_exit(result, 2)
    assert f"{tmp_path} is not a packed output folder" in result.output


def test_verify_still_blames_a_damaged_output_when_its_inputs_are_gone(tmp_path):
    data, tok, out = small_pack(tmp_path)
    data.unlink()
    manifest = json.loads((out / "packprep.json").read_text())
    manifest["sequences"] += 1
    (out / "packprep.json").write_text(json.dumps(manifest))
    result = invoke("verify", out, "--retokenize", 5)
    assert_clean_exit(result, 4)


# ---------------------------------------------------------------- bytes that are not UTF-8, closed streams, dead workers
NOT_UTF8 = os.fsdecode(b"\xff")  # how Python hands over a name or an argument holding the byte 0xff


def not_utf8_args(tmp_path: Path) -> dict:
    data = tmp_path / f"in{NOT_UTF8}.jsonl"
    data.write_bytes(EXAMPLE_CHATS.read_bytes())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / f"a{NOT_UTF8}.jsonl").write_bytes(EXAMPLE_CHATS.read_bytes())
    out = tmp_path / "out"
    return {
        "output path": (["pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", tmp_path / f"out{NOT_UTF8}"],
                        "out\\xff holds bytes that are not UTF-8 (\\xff)"),
        "input path": (["pack", data, "-t", EXAMPLE_TOKENIZER, "-o", out], "in\\xff.jsonl holds bytes"),
        "a file in an input folder": (["pack", folder, "-t", EXAMPLE_TOKENIZER, "-o", out],
                                      f"the input {folder}/a\\xff.jsonl holds bytes"),
        "template argument": (["pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", out, "--template-arg",
                               f"x={NOT_UTF8}"], "the argument x=\\xff holds bytes that are not UTF-8"),
        "export output": (["export", EXAMPLE_TOKENIZER, "--to", "trl", tmp_path / f"out{NOT_UTF8}"], "out\\xff"),
    }


@pytest.mark.parametrize("where", ["output path", "input path", "a file in an input folder", "template argument",
                                   "export output"])
def test_bytes_that_are_not_utf8_are_a_clear_usage_error(where, tmp_path):
    args, message = not_utf8_args(tmp_path)[where]
    result = invoke(*args, "-q" if args[0] == "pack" else "--overwrite", *(["--num-proc", 1] if args[0] == "pack" else []))
    assert_clean_exit(result, 2)
    assert result.output.startswith("error: ") and message in result.output and result.output.count("\n") == 1, \
        result.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))], "nothing written"


def run_closed(args: list, closed: int, cwd: Path):
    """The CLI in a process whose standard stream ``closed`` (0, 1 or 2) is closed, as `<&-` leaves it."""
    return subprocess.run([sys.executable, "-m", "packprep", *map(str, args)], cwd=cwd, capture_output=closed != 1,
                          stdout=subprocess.PIPE if closed == 1 else None, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, preexec_fn=lambda: os.close(closed))


def test_a_closed_standard_input_is_a_clear_usage_error(tmp_path):
    result = run_closed(["pack", "-", "-t", EXAMPLE_TOKENIZER, "-o", "out", "-q"], 0, tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: standard input ('-') is closed: pipe the data into it (cat chats.jsonl | "
                             "packprep pack - ...), or give the file itself\n")
    assert list(tmp_path.iterdir()) == []


def test_closed_standard_output_and_error_do_not_break_a_run(tmp_path):
    pack = run_closed(["pack", EXAMPLE_CHATS, "-t", EXAMPLE_TOKENIZER, "-o", "out", "--num-proc", 1], 2, tmp_path)
    assert pack.returncode == 0 and packprep.verify(tmp_path / "out").ok
    shown = run_closed(["inspect", "out"], 1, tmp_path)
    assert shown.returncode == 0, shown.stderr


def die_on_three(context, item):
    """A stage whose worker is killed at its fourth task, as the out-of-memory killer would."""
    if item == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return item


def test_a_worker_killed_is_said_to_be_killed_not_a_bug():
    with pytest.raises(WorkerDied, match="^a worker process was killed by SIGKILL .the system's out-of-memory killer "
                                         "sends it: see dmesg. before its work was done; nothing was written"):
        list(LocalEngine(2).map(die_on_three, None, range(8)))
    assert WorkerDied.exit_code == 5


@pytest.mark.parametrize("data, message", [("", "the file holds no records"),
                                           ('{"a": [1,\n', "none of its first 1 records can be decoded")])
def test_standard_input_that_cannot_be_read_is_named_as_such(data, message, tmp_path):
    """Standard input is read from a copy the run makes: a message names what the user gave, not the copy."""
    result = CliRunner().invoke(main, ["pack", "-", "-t", str(EXAMPLE_TOKENIZER), "-o", str(tmp_path / "out"), "-q"],
                                input=data)
    assert_clean_exit(result, 3)
    assert result.output.startswith(f"error: standard input ('-'): {message}") and "packprep-stdin" not in result.output
