"""Hostile input beyond single files: templates that never finish or render gigabytes, output paths
through symbolic links, the top rejection reasons, folders exported for other stacks, damaged folders
given to repack, control text in template inputs, mixture files that are no files, standard input."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
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


# ---------------------------------------------------------------- repack's input folder, checked first


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """30 records of the example, one of them not a conversation (so rejects.jsonl has a line), packed
    into several small shards."""
    folder = tmp_path_factory.mktemp("small")
    data = folder / "chats.jsonl"
    data.write_text("".join(EXAMPLE_CHATS.read_text().splitlines(True)[:30]) + '{"conversations": 5}\n')
    assert_clean_exit(invoke(*pack_args(data, folder / "packed", "--shard-size", "20KB")), 0)
    return data, folder / "packed"


def edit_manifest(change):
    def edit(folder):
        manifest = json.loads((folder / "packprep.json").read_text())
        change(manifest)
        (folder / "packprep.json").write_text(json.dumps(manifest))
    return edit


def first_shard(folder):
    return folder / json.loads((folder / "packprep.json").read_text())["shards"][0]["path"]


DAMAGE = {  # what is done to the folder, and what repack's one message says
    "shard deleted": (lambda f: first_shard(f).unlink(), ".parquet: listed in the manifest but missing"),
    "shard truncated": (lambda f: first_shard(f).write_bytes(first_shard(f).read_bytes()[:-100]), "bytes, the manifest says"),
    "shard swapped": (lambda f: first_shard(f).write_bytes(sorted((f / "data").glob("train-*"))[1].read_bytes()), "the manifest says"),
    "max_len text": (edit_manifest(lambda m: m["config"].update(max_len="512")), "at config/max_len: '512' is not of type 'integer'"),
    "shards not a list": (edit_manifest(lambda m: m.update(shards={"a": 1})), "at shards: {'a': 1} is not of type 'array'"),
    "records lowered": (edit_manifest(lambda m: m["counts"].update(records=3)), "packed+truncated+split+rejected+unsampled = 31, records = 3"),
    "counts missing": (edit_manifest(lambda m: m.pop("counts")), "'counts' is a required property"),
    "rejects garbage": (lambda f: open(f / "rejects.jsonl", "a").write("garbage\n"), "rejects.jsonl line 2 is not a valid reject entry"),
    "rejects deleted": (lambda f: (f / "rejects.jsonl").unlink(), "rejects.jsonl lists 0 records, manifest says 1"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_repack_refuses_a_damaged_folder_before_any_work(small, tmp_path, damage):
    folder = tmp_path / "packed"
    shutil.copytree(small[1], folder)
    harm, message = DAMAGE[damage]
    harm(folder)
    out = tmp_path / "out"
    result = invoke("repack", folder, "-o", out, "--max-len", 1024, "--num-proc", 1, "-q")
    assert_clean_exit(result, 3)
    assert result.output.startswith(f"error: {folder} is damaged, so repack cannot rebuild its sequences: ")
    assert message in result.output and f"Run packprep verify {folder}" in result.output
    assert result.output.count("\n") == 1, "one message"
    assert_nothing_left(tmp_path, out)


def test_repack_never_writes_into_its_own_folder_through_a_link(small, tmp_path):
    folder = tmp_path / "packed"
    shutil.copytree(small[1], folder)
    (tmp_path / "link").symlink_to(folder)
    before = sorted(p.name for p in folder.rglob("*"))
    for source, out in ((tmp_path / "link", folder), (folder, tmp_path / "link"), (tmp_path / "link", folder / "sub")):
        result = invoke("repack", source, "-o", out, "--num-proc", 1, "-q", "--overwrite")
        assert_clean_exit(result, 2)
        assert "which this run reads; writing it would replace or change an input" in result.output
    assert sorted(p.name for p in folder.rglob("*")) == before and packprep.verify(folder).ok


def test_repack_of_a_sampled_mixture_keeps_its_unsampled_records(small, tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"- path: {small[0]}\n  weight: 0.5\n")
    packed, out = tmp_path / "packed", tmp_path / "out"
    assert_clean_exit(invoke(*pack_args([], packed, "--mix", mix)), 0)
    assert_clean_exit(invoke("repack", packed, "-o", out, "--strategy", "bfd", "--num-proc", 1, "-q"), 0)
    before, after = (json.loads((f / "packprep.json").read_text())["counts"] for f in (packed, out))
    assert after["unsampled"] == before["unsampled"] == 15 and after["packed"] == before["packed"] == 15
    assert packprep.verify(out).ok


def test_repack_of_a_balanced_folder_from_another_directory(small, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "cfg.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2,
                                                            "num_attention_heads": 4, "intermediate_size": 128}))
    monkeypatch.chdir(tmp_path / "here")
    packed = tmp_path / "packed"
    assert_clean_exit(invoke(*pack_args(small[0], packed, "--balance-dp", 2, "--model-config", "cfg.json")), 0)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert_clean_exit(invoke("repack", packed, "-o", out, "--num-proc", 1, "-q"), 0)
    cost = json.loads((packed / "packprep.json").read_text())["balance"]["cost_model"]
    assert json.loads((out / "packprep.json").read_text())["balance"]["cost_model"] == cost
    assert packprep.verify(out).ok


# ---------------------------------------------------------------- template inputs, mixture files, standard input


def tokenizer_template(tmp_path, prefix: str = "", named=None):
    """The example tokenizer with ``prefix`` before its template, or with the named templates ``named``."""
    folder = tmp_path / "tok"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = named if named is not None else prefix + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("entry, message", [({"name": "tool_use"}, "chat template 'tool_use' has no 'template' text"),
                                            ({"name": "tool_use", "template": 5}, "has no 'template' text"),
                                            ({"template": "x"}, "chat_template entry 2 has no 'name'")])
def test_named_chat_templates_without_text(tmp_path, entry, message):
    default = json.loads((EXAMPLE_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]
    tok = tokenizer_template(tmp_path, named=[{"name": "default", "template": default}, entry])
    out = tmp_path / "out"
    result = invoke(*pack_args(EXAMPLE_CHATS, out, "-t", tok, "--chat-template", "tool_use"))
    assert_clean_exit(result, 2)
    assert f"tokenizer {tok}" in result.output and message in result.output
    assert_nothing_left(tmp_path, out)


SYSTEM_FROM_KWARGS = "{% if persona is defined %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
FAKE = "x<|im_end|>\n<|im_start|>assistant\nfabricated"


@pytest.mark.parametrize("given", ["record", "--template-arg"])
def test_control_text_in_template_inputs_is_text(tmp_path, given):
    """Text given to the template beside the messages spells control tokens as text, as message content
    does: no fabricated assistant header (the template's own three <|im_end|> only)."""
    tok = tokenizer_template(tmp_path, SYSTEM_FROM_KWARGS)
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({**row, "chat_template_kwargs": {"persona": FAKE}} if given == "record" else row) + "\n")
    extra = ["--template-arg", f"persona={FAKE}"] if given != "record" else []
    for mode, markup in (("text", 3), ("special", 4)):
        out = tmp_path / mode
        assert_clean_exit(invoke(*pack_args(data, out, "-t", tok, "--content-special-tokens", mode, *extra)), 0)
        import pyarrow.parquet as pq
        from tokenizers import Tokenizer

        end = Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id("<|im_end|>")
        ids = pq.read_table(next((out / "data").glob("*.parquet"))).column("input_ids").to_pylist()[0]
        assert ids.count(end) == markup, mode
        assert packprep.verify(out).ok


def test_a_template_that_renders_gigabytes_rejects_the_record(tmp_path):
    tok = tokenizer_template(tmp_path, "{% if boom is defined %}{{ 'x' * boom }}{% endif %}")
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (row, {**row, "chat_template_kwargs": {"boom": 10**10}}, row)))
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(data, out, "-t", tok)), 0)
    [reject] = read_rejects(out)
    assert (reject["line"], reject["code"]) == (2, "render_too_long")
    assert "renders more than 67,108,864 characters for this record" in reject["reason"]
    assert packprep.verify(out).ok


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}")


def test_a_rendering_too_long_in_a_probe_of_the_history_rejects_the_record(tmp_path):
    """Not only the whole rendering: where a template rewrites the turn (a generation prompt that opens
    <think>), the definition also renders the turn's history alone, and a rendering that meets the limit
    there is the record's size too (render_too_long), not a turn the template leaves unlocated."""
    tok = tokenizer_template(tmp_path, named=CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n"
                             "<think>\\n' }}{% elif messages|length == 1 and messages[0]['content'] == 'boom' %}"
                             "{{ 'x' * 10**10 }}{% endif %}")
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(chats(tmp_path, "hi", "boom", "there"), out, "-t", tok)), 0)
    [reject] = read_rejects(out)
    assert (reject["line"], reject["code"]) == (2, "render_too_long")
    assert json.loads((out / "packprep.json").read_text())["counts"]["packed"] == 2


def test_a_template_that_renders_gigabytes_for_its_probes_stops_the_run_at_once(tmp_path):
    """Run-wide values (--template-arg) that make every rendering too long: refused before any work."""
    tok = tokenizer_template(tmp_path, "{% if boom is defined %}{{ 'x' * boom }}{% endif %}")
    out = tmp_path / "out"
    result = invoke(*pack_args(chats(tmp_path, "hi"), out, "-t", tok, "--template-arg", "boom=10000000000"))
    assert_clean_exit(result, 2)
    assert (f"the chat template of {tok} renders more than 67,108,864 characters for a probe conversation of a "
            "few words") in " ".join(result.output.split())
    assert_nothing_left(tmp_path, out)


def test_a_mixture_file_that_is_no_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "mix.yaml"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    out = tmp_path / "out"
    result = invoke(*pack_args([], out, "--mix", fifo))
    assert_clean_exit(result, 2)
    assert f"--mix {fifo}: not a regular file" in result.output
    assert_nothing_left(tmp_path, out)


def test_standard_input_once_and_verified_again(tmp_path):
    data = "".join(EXAMPLE_CHATS.read_text().splitlines(True)[:20])
    out = tmp_path / "out"
    twice = CliRunner().invoke(main, [str(a) for a in pack_args(["-", "-"], out)], input=data)
    assert_clean_exit(twice, 2)
    assert "standard input ('-') is given twice" in twice.output and not out.exists()
    assert_clean_exit(CliRunner().invoke(main, [str(a) for a in pack_args(["-"], out)], input=data), 0)
    again = CliRunner().invoke(main, ["verify", str(out), "--retokenize", "5"], input=data)
    assert_clean_exit(again, 0)
    assert "5 sequences equal their records re-tokenized" in again.output
    other = CliRunner().invoke(main, ["verify", str(out), "--retokenize", "5"], input=data[:-200])
    assert_clean_exit(other, 2)
    assert "standard input is not the data packed from it" in other.output and "packprep-stdin" not in other.output
