"""Hostile input beyond single files (issue 24): templates that never finish, output paths through
symbolic links, the top rejection reasons, and folders exported for other stacks."""

from __future__ import annotations

import json
import shutil

import pytest

import packprep
from packprep.errors import EXIT_LAYOUT

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER
from .test_bad_inputs import assert_clean_exit, assert_nothing_left, invoke, pack_args, read_rejects

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def chats(tmp_path, *users: str):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": u}, {"from": "gpt", "value": "ok"}]})
                            + "\n" for u in users))
    return path


def tokenizer_with(tmp_path, loop_when: str):
    """The example tokenizer with a template that loops without end where ``loop_when`` holds."""
    folder = tmp_path / "tok"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    head = "{% for message in messages %}"
    assert head in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(head, head + f"{{% if {loop_when} %}}{LOOP}{{% endif %}}", 1)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_record_whose_rendering_never_ends_is_rejected_and_the_rest_kept(tmp_path):
    data = chats(tmp_path, "hi", "LOOP", "there")
    out = tmp_path / "out"
    result = invoke("pack", data, "-t", tokenizer_with(tmp_path, "'LOOP' in message['content']"), "-o", out,
                    "--num-proc", 1, "-q", "--render-timeout", 1)
    assert_clean_exit(result, 0)
    counts = json.loads((out / "packprep.json").read_text())["counts"]
    assert counts["packed"] == 2 and counts["rejected_by_reason"] == {"render_timeout": 1}
    [reject] = read_rejects(out)
    assert reject["line"] == 2 and "did not finish rendering this record in 1 s (--render-timeout)" in reject["reason"]
    assert f"render_timeout 1: e.g. {data.name}, line 2: the chat template did not finish" in result.output
    assert packprep.verify(out).ok


def test_a_template_that_never_ends_on_its_probes_stops_the_run_at_once(tmp_path):
    tok = tokenizer_with(tmp_path, "true")
    out = tmp_path / "out"
    result = invoke("pack", chats(tmp_path, "hi"), "-t", tok, "-o", out, "--num-proc", 1, "-q", "--render-timeout", 1)
    assert_clean_exit(result, 2)
    assert f"the chat template of {tok} did not finish rendering a two-message probe conversation in 1 s" in result.output
    assert_nothing_left(tmp_path, out)


def test_every_record_rejected_names_the_top_reasons_with_an_example(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"conversations": [{"from": "system", "value": "x"}]}\n{"conversations": "nope"}\n'
                    '{"conversations": [{"from": "system", "value": "y"}]}\n')
    out = tmp_path / "out"
    result = invoke(*pack_args(data, out))
    assert_clean_exit(result, 3)
    assert f"no_assistant_turn 2: e.g. {data}, line 1: no assistant turn to train on" in result.output
    assert f"e.g. {data}, line 2: " in result.output
    stats = invoke("stats", data, "-t", EXAMPLE_TOKENIZER, "-q", "--num-proc", 1)
    assert_clean_exit(stats, 0)
    assert f"no_assistant_turn 2: e.g. {data}, line 1: no assistant turn" in " ".join(stats.output.split())


@pytest.mark.parametrize("kind", ["loop", "loop_parent", "dangling"])
def test_output_paths_through_broken_links_fail_before_any_work(tmp_path, kind):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    out = {"loop": tmp_path / "loop", "loop_parent": tmp_path / "loop" / "out", "dangling": tmp_path / "dangling"}[kind]
    result = invoke(*pack_args(EXAMPLE_CHATS, out))
    assert_clean_exit(result, 2)
    assert ("symbolic link loop" if kind != "dangling" else "which does not exist") in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop"]


def test_overwrite_through_a_link_replaces_the_folder_and_leaves_nothing_behind(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "old.txt").write_text("old")
    link = tmp_path / "link"
    link.symlink_to(real)
    result = invoke(*pack_args(EXAMPLE_CHATS, link))
    assert_clean_exit(result, 2)
    assert "already exists" in result.output and (real / "old.txt").exists()
    assert_clean_exit(invoke(*pack_args(EXAMPLE_CHATS, link, "--overwrite")), 0)
    assert link.is_symlink() and not (real / "old.txt").exists() and (real / "packprep.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "out"
    assert_clean_exit(invoke(*pack_args(EXAMPLE_CHATS, out)), 0)
    return out


@pytest.mark.parametrize("stack", ["torchtune", "llamafactory", "axolotl", "megatron"])
def test_verify_and_inspect_on_an_export_for_another_stack(packed, tmp_path, stack):
    exported = tmp_path / stack
    assert_clean_exit(invoke("export", packed, "--to", stack, exported), 0)
    for command in (["verify", exported], ["inspect", exported]):
        result = invoke(*command)
        assert_clean_exit(result, EXIT_LAYOUT)
        assert result.output.count(f"layout '{stack}' is written for") == 1, result.output
        assert "the packprep-layout folder it was exported from" in result.output
    listed = json.loads((exported / "packprep.json").read_text())["shards"]
    if not listed:  # a save_to_disk folder (LLaMA-Factory): its files are the dataset's own
        return
    shard = exported / listed[0]["path"]
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a broken export still fails verification
    assert_clean_exit(invoke("verify", exported), 4)


def test_verify_retokenize_and_num_proc_are_range_checked(packed):
    for args, message in ((["--retokenize", "-5"], "--retokenize must be between 0 and"),
                          (["--num-proc", "0"], "--num-proc must be between 1 and 4,096, not 0")):
        result = invoke("verify", packed, *args)
        assert_clean_exit(result, 2)
        assert message in result.output
