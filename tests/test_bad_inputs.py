"""Bad input never breaks a run and never loses a row (issue 9).

Every file in ``tests/bad_inputs/`` is one case; ``tests/bad_inputs/EXPECTED.json`` says what must
happen to it: a file-level error (exit code, message naming the file and where parsing stopped, no
output left behind) or a completed run whose manifest and rejects.jsonl account for every record.
Then the configuration errors that must be caught before any work starts, ``--on-error fail``,
disk full, and the exit codes in ``--help``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures

BAD = Path(__file__).resolve().parent / "bad_inputs"
EXPECTED = json.loads((BAD / "EXPECTED.json").read_text(encoding="utf-8"))
TOKENIZER = str(EXAMPLE_TOKENIZER)
MAX_LEN = 512
FATES = ("packed", "truncated", "split", "rejected")


def invoke(*args: str):
    """Run the CLI in-process; stdout and stderr together in ``result.output``."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def pack_args(inputs, out: Path, *extra: str) -> list[str]:
    inputs = inputs if isinstance(inputs, list) else [inputs]
    return ["pack", *map(str, inputs), "-t", TOKENIZER, "-o", str(out), "--max-len", str(MAX_LEN),
            "--num-proc", "1", "-q", *extra]


def assert_clean_exit(result, code: int) -> None:
    """The documented exit code, and an error is one line for a person: never a traceback."""
    assert "Traceback" not in result.output, result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}") from result.exception
    assert result.exit_code == code, result.output


def assert_nothing_left(parent: Path, out: Path) -> None:
    """A failed run leaves neither DIR nor a hidden ``.DIR.packprep-tmp-PID`` sibling."""
    assert not out.exists(), f"{out} was left behind"
    leftovers = [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.packprep-")]
    assert not leftovers, f"temporary folders left behind: {leftovers}"


def read_rejects(out: Path) -> list[dict]:
    path = out / "rejects.jsonl"
    if not path.exists():
        return []
    # split on "\n" only: a record may hold U+2028 or \x85, which str.splitlines() would cut at
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def test_corpus_is_complete():
    """Every file is a case and every case a file (the generator and EXPECTED.json aside)."""
    files = {p.name for p in BAD.iterdir() if not p.name.startswith(("_", "EXPECTED"))}
    assert {case["file"] for case in EXPECTED.values()} == files
    assert len(files) >= 20 and len(EXPECTED) >= 170


def case_args(spec: dict, source: Path, out: Path) -> list[str]:
    """``pack``'s arguments for a case: its file as the input, or ``as`` a mixture file or model config."""
    given, extra = spec.get("as", "input"), spec.get("args", [])
    if given == "--mix":
        return pack_args([], out, "--mix", str(source), *extra)
    if given == "--model-config":
        return pack_args(BAD / "good_for_settings.jsonl", out, "--balance-dp", "2", "--model-config", str(source), *extra)
    assert given == "input", given
    return pack_args(source, out, *extra)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_input(case, tmp_path):
    spec = EXPECTED[case]
    source = BAD / spec["file"]
    out = tmp_path / "out"
    result = invoke(*case_args(spec, source, out))
    assert_clean_exit(result, spec["exit"])

    if spec["exit"] != 0:
        message = result.output
        assert message.startswith("error: "), message
        assert str(source) in message or not spec.get("names_file", True), "the message names the file"
        for part in spec["message"]:
            assert part in message, f"{part!r} not in {message!r}"
        assert_nothing_left(tmp_path, out)
        return

    manifest = json.loads((out / "packprep.json").read_text())
    counts = manifest["counts"]
    for name, value in spec["counts"].items():
        assert counts[name] == value, f"{name}: {counts}"
    assert counts["rejected_by_reason"] == spec["rejected_by_reason"]
    for name, value in spec.get("normalized", {}).items():
        assert counts["normalized"][name] == value, f"{name}: {counts['normalized']}"
    assert sum(counts[f] for f in FATES) == counts["records"], "every record has exactly one fate"
    assert counts["records"] == sum(i["records"] for i in manifest["inputs"]), "counts add up to records read"

    rejects = read_rejects(out)
    assert len(rejects) == counts["rejected"]
    by_index = {entry["index"]: entry for entry in rejects}
    assert len(by_index) == len(rejects), "a record is rejected at most once"
    for entry in rejects:
        assert entry["file"] == str(source)
        assert entry["reason"] and entry["code"]
        assert len(entry["record"]) <= 200
        assert entry["source_index"] == entry["index"]  # one input file: the two numberings agree
    for want in spec["rejects"]:
        got = by_index[want["index"]]
        assert got["line"] == want["line"]
        assert got["code"] == want["code"]
        assert want["reason"] in got["reason"], got["reason"]
        assert got["record"].startswith(want["record"]), got["record"]
    report = packprep.verify(out)
    assert report.ok, report.failures


FAIL_CASES = sorted(case for case, spec in EXPECTED.items() if spec["exit"] == 0 and spec["rejects"])


@pytest.mark.parametrize("case", FAIL_CASES)
def test_on_error_fail_stops_at_the_first_bad_record(case, tmp_path):
    spec = EXPECTED[case]
    source = BAD / spec["file"]
    out = tmp_path / "out"
    result = invoke(*pack_args(source, out, *spec.get("args", []), "--on-error", "fail"))
    assert_clean_exit(result, 3)
    first = min(spec["rejects"], key=lambda r: r["index"])
    where = f"line {first['line']}" if first["line"] else f"record {first['index']}"
    message = result.output
    assert f"{source}, {where}: " in message, message
    assert first["reason"] in message
    assert "--on-error skip" in message, "says how to go on"
    assert_nothing_left(tmp_path, out)


def test_on_error_fail_reports_the_first_record_across_stages(tmp_path):
    """A record rejected by the tokenizer stage (line 1) comes before one rejected while normalizing
    (line 2): --on-error fail must name line 1, and rejects.jsonl lists them in input order."""
    data = tmp_path / "order.jsonl"
    data.write_text(
        '{"conversations": [{"from": "system", "value": "only a system turn"}]}\n'
        '{"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]}\n'
        '{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}\n'
    )
    result = invoke(*pack_args(data, tmp_path / "strict", "--on-error", "fail"))
    assert_clean_exit(result, 3)
    skipped = invoke(*pack_args(data, tmp_path / "lenient"))
    assert_clean_exit(skipped, 0)
    assert [r["line"] for r in read_rejects(tmp_path / "lenient")] == [1, 2]
    assert f"{data}, line 1: no assistant turn" in result.output


def test_several_bad_files_in_one_run_are_numbered_per_file(tmp_path):
    """Rejects name their own file and line; source_index counts over all inputs."""
    files = [BAD / "broken_jsonl_lines.jsonl", BAD / "crlf_broken.jsonl", BAD / "array_of_non_objects.json"]
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(files, out)), 0)
    manifest = json.loads((out / "packprep.json").read_text())
    assert [i["records"] for i in manifest["inputs"]] == [4, 3, 6]
    rejects = read_rejects(out)
    assert {(Path(r["file"]).name, r["line"] or r["index"]) for r in rejects} == {
        ("broken_jsonl_lines.jsonl", 2), ("broken_jsonl_lines.jsonl", 4), ("crlf_broken.jsonl", 2),
        ("array_of_non_objects.json", 1), ("array_of_non_objects.json", 2), ("array_of_non_objects.json", 3),
        ("array_of_non_objects.json", 4),
    }
    offsets = {"broken_jsonl_lines.jsonl": 0, "crlf_broken.jsonl": 4, "array_of_non_objects.json": 7}
    for entry in rejects:
        assert entry["source_index"] == offsets[Path(entry["file"]).name] + entry["index"]
    assert packprep.verify(out).ok


def test_one_unreadable_file_among_good_ones_stops_the_run(tmp_path):
    out = tmp_path / "out"
    result = invoke(*pack_args([EXAMPLE_CHATS, BAD / "truncated.jsonl.gz"], out))
    assert_clean_exit(result, 3)
    assert "truncated.jsonl.gz: cannot read past line 92" in result.output
    assert_nothing_left(tmp_path, out)


def test_whole_compressed_files_are_read_to_the_end(tmp_path):
    """The counterpart of the cut-off cases: gzip, and zstd as one frame, several frames or a stream."""
    import gzip

    import zstandard

    data = EXAMPLE_CHATS.read_bytes()
    half = data.index(b"\n", len(data) // 2) + 1
    streamed = tmp_path / "streamed.jsonl.zst"
    with open(streamed, "wb") as handle, zstandard.ZstdCompressor().stream_writer(handle) as writer:
        for start in range(0, len(data), 4096):
            writer.write(data[start : start + 4096])
    (tmp_path / "one.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "one.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    (tmp_path / "two.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(data[:half]) + zstandard.ZstdCompressor().compress(data[half:])
    )
    records = data.count(b"\n")
    for name in ("one.jsonl.gz", "one.jsonl.zst", "two.jsonl.zst", "streamed.jsonl.zst"):
        out = tmp_path / f"out-{name}"
        assert_clean_exit(invoke(*pack_args(tmp_path / name, out)), 0)
        assert json.loads((out / "packprep.json").read_text())["counts"]["records"] == records, name


def test_a_real_subprocess_prints_one_line_and_no_traceback(tmp_path):
    out = tmp_path / "out"
    source = BAD / "truncated_array.json"
    proc = subprocess.run(
        [sys.executable, "-m", "packprep", *pack_args(source, out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.startswith(f"error: {source}: not valid JSON at line 22, column 14"), proc.stderr
    assert proc.stderr.count("\n") == 1, "one line"
    assert_nothing_left(tmp_path, out)


@needs_fixtures
def test_template_rejections(tmp_path):
    """A template that raises (Mistral: no system turn) rejects the record when normalizing is told not
    to fit it (--system keep); by default the system turn is folded and the leading turn dropped."""
    data = tmp_path / "chats.jsonl"
    rows = [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hello"}]},
        json.loads((BAD / "starts_with_assistant.jsonl").read_text().splitlines()[0]),
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = invoke("pack", data, "-t", fixture_tokenizer("mistral-7b-v0.1"), "-o", out, "--max-len", 512,
                    "--num-proc", 1, "-q", "--system", "keep")
    assert_clean_exit(result, 0)
    rejects = read_rejects(out)
    assert [(r["line"], r["code"]) for r in rejects] == [(2, "template_error")]
    assert rejects[0]["reason"].startswith("the chat template cannot render a system message (--system fold")
    assert packprep.verify(out).ok
    fitted = tmp_path / "fitted"
    assert_clean_exit(invoke("pack", data, "-t", fixture_tokenizer("mistral-7b-v0.1"), "-o", fitted, "--max-len",
                             512, "--num-proc", 1, "-q"), 0)
    counts = json.loads((fitted / "packprep.json").read_text())["counts"]
    assert counts["packed"] == 3 and counts["normalized"]["system_folded"] == 1
    assert counts["normalized"]["leading_turns_dropped"] == 1


# ---------------------------------------------------------------- configuration errors, before work


def assert_config_error(result, tmp_path: Path, out: Path, *parts: str) -> None:
    assert_clean_exit(result, 2)
    for part in parts:
        assert part in result.output, result.output
    assert_nothing_left(tmp_path, out)


@pytest.fixture
def tokenizer_without_template(tmp_path) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert config.pop("chat_template", None), "the example tokenizer has a chat template"
    config_path.write_text(json.dumps(config))
    for extra in folder.glob("chat_template*"):
        extra.unlink()
    return folder


def test_tokenizer_without_chat_template(tmp_path, tokenizer_without_template):
    out = tmp_path / "out"
    result = invoke("pack", EXAMPLE_CHATS, "-t", tokenizer_without_template, "-o", out, "--num-proc", 1, "-q")
    assert_config_error(result, tmp_path, out, "no chat template", "chat_template", "--format text")
    # ... and plain text needs no template.
    text = BAD / "text_empty.jsonl"
    result = invoke("pack", text, "-t", tokenizer_without_template, "-o", out, "--num-proc", 1, "-q")
    assert_clean_exit(result, 0)


def test_max_len_below_the_template_overhead(tmp_path):
    out = tmp_path / "out"
    result = invoke("pack", EXAMPLE_CHATS, "-t", TOKENIZER, "-o", out, "--max-len", 4, "--num-proc", 1, "-q")
    assert_config_error(result, tmp_path, out, "--max-len 4", "overhead", "raise --max-len")


def test_library_entry_points_refuse_what_the_cli_refuses(tmp_path):
    """The library checks its arguments where the CLI does (settings.py): the same ConfigError and
    message from each entry point, before it writes anything, naming its own arguments (num_proc),
    not the CLI's options (--num-proc)."""
    from packprep.errors import ConfigError
    from packprep.pipeline import repack

    packed, out, chats = tmp_path / "packed", tmp_path / "out", str(EXAMPLE_CHATS)
    packprep.pack(chats, str(packed), TOKENIZER, max_len=MAX_LEN, num_proc=1)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"- path: {chats}\n  format: csv\n")
    cases = [
        (partial(packprep.pack, chats, str(out), TOKENIZER, engine="spark"), "engine must be one of local, ray"),
        (partial(packprep.pack, chats, str(out), TOKENIZER, num_proc=0), "num_proc must be between 1 and 4,096, not 0"),
        (partial(packprep.pack, chats, str(out), TOKENIZER, train_on="all-of-it"),
         "train_on must be one of assistant, last, all"),
        (partial(packprep.pack, [], str(out), TOKENIZER, mix=str(mix)), f"mix {mix}, source 1: format must be one of sharegpt"),
        (partial(packprep.stats, chats, TOKENIZER, num_proc=0), "num_proc must be between 1 and 4,096, not 0"),
        (partial(packprep.stats, chats, TOKENIZER, epochs=0), "epochs must be at least 1"),
        (partial(packprep.stats, chats, TOKENIZER, dp_size=0), "dp_size and rows_per_step must be at least 1"),
        (partial(packprep.stats, str(packed), dp_size=0), "dp_size and rows_per_step must be at least 1"),
        (partial(packprep.verify, str(packed), retokenize=-5), "retokenize must be between 0 and 2,147,483,647, not -5"),
        (partial(repack, str(packed), str(out), num_proc=0), "num_proc must be between 1 and 4,096, not 0"),
        (partial(repack, str(packed), str(out), strategy="ffd"), "strategy must be one of greedy, bfd, random"),
        (partial(repack, str(packed), str(out), train_on="all"), "repack cannot change train_on"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as refused:
            call()
        assert message in str(refused.value), (message, str(refused.value))
        assert not out.exists()


@pytest.mark.parametrize("missing", ["does-not-exist.jsonl", "no/such/folder/chats.parquet", "/no/such/file.json"])
def test_missing_input(tmp_path, missing, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    result = invoke("pack", missing, "-t", TOKENIZER, "-o", out, "-q")
    assert_config_error(result, tmp_path, out, missing, "no such file")


def test_output_exists_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke(*pack_args(EXAMPLE_CHATS, out))
    assert_clean_exit(result, 2)
    assert "already exists" in result.output and "--overwrite" in result.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"], "the existing folder is untouched"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_under_a_regular_file(tmp_path):
    """Running as root, chmod cannot make a folder unwritable; a path under a file is unwritable for all."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "out"
    result = invoke(*pack_args(EXAMPLE_CHATS, out))
    assert_clean_exit(result, 2)
    assert str(blocker) in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.fixture
def mount_tmpfs(tmp_path):
    """Mount a small tmpfs (needs root and a permissive container); skip when impossible."""
    mounted = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        try:
            proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        except OSError as exc:
            pytest.skip(f"cannot run mount: {exc}")
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_read_only_output_parent(tmp_path, mount_tmpfs):
    point = mount_tmpfs("ro", "ro,size=64k")
    out = point / "out"
    result = invoke(*pack_args(EXAMPLE_CHATS, out))
    assert_clean_exit(result, 2)
    assert "not writable" in result.output and "--output" in result.output


def test_disk_full(tmp_path, mount_tmpfs):
    point = mount_tmpfs("full", "size=64k")
    out = point / "out"
    result = invoke(*pack_args(EXAMPLE_CHATS, out))
    assert_clean_exit(result, 5)
    assert "disk full" in result.output and str(out) in result.output
    assert_nothing_left(point, out)
    assert list(point.iterdir()) == [], "the space is given back"


# ---------------------------------------------------------------- help


@pytest.mark.parametrize("command", [None, *sorted(main.commands)])
def test_help_lists_exit_codes(command):
    result = invoke(*([command] if command else []), "--help")
    assert_clean_exit(result, 0)
    text = " ".join(result.output.split())
    assert "Exit codes:" in text
    for code in ("0 success", "1 an unexpected internal error", "2 usage or configuration error",
                 "3 an input file cannot be read", "4 verification failed", "5 the output could not be written"):
        assert code in text, f"{command or 'packprep'} --help lacks {code!r}"


def test_corpus_generator_is_kept_beside_the_cases():
    """The binary cases are rebuilt by _generate.py; it must at least import and name every case file."""
    source = (BAD / "_generate.py").read_text()
    for case in EXPECTED.values():
        assert f'"{case["file"]}"' in source, case["file"]
