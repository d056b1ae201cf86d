"""What templates get besides the messages: a fixed date, template arguments, a named template.

On the real Llama-3.2 and Qwen3 templates (tests/templates/): the same inputs give the same bytes
whatever the system clock says, ``--date`` and ``--template-arg`` reach every rendering and the
manifest, a record's own ``chat_template_kwargs`` go on top (counted), and a tokenizer with named
templates packs with the one chosen.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG, ConfigError
from packprep.render import ChatTemplate
from packprep.template_inputs import parse_template_args, template_variables
from packprep.tokenization import load_tokenizer

from .conftest import REPO, needs_fixtures

pytestmark = needs_fixtures

CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"messages": [{"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}],
     "chat_template_kwargs": {"date_string": "01 Jan 2000"}},
]


def write_chats(path: Path, records=CHATS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def decoded_rows(folder: Path, tokenizer: str) -> list[str]:
    tok = load_tokenizer(tokenizer)
    rows = []
    for shard in sorted((folder / "data").glob("*.parquet")):
        rows += [tok.decode(ids) for ids in pq.read_table(shard).column("input_ids").to_pylist()]
    return rows


FAKE_CLOCK = """
import datetime, sys
import packprep, packprep.cli, packprep.tokenizer_folder, transformers.utils.chat_template_utils
class Fake(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(*map(int, sys.argv[1].split("-")))
# every module that reads the clock as ``datetime.now()`` (transformers' strftime_now, any in packprep)
# sees this day (the C type itself cannot be replaced: pyarrow and pandas check it)
for module in list(sys.modules.values()):
    if getattr(module, "datetime", None) is datetime.datetime and module.__name__ not in ("datetime", "_datetime"):
        module.datetime = Fake
from transformers import AutoTokenizer
folder, chats, out = sys.argv[2:5]
chat = [{"role": "user", "content": "hi"}]
print(AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False).split("Today Date: ")[1][:11])
packprep.pack(chats, out, folder, num_proc=1, max_len=256)
"""


@pytest.mark.slow
def test_the_same_inputs_give_the_same_bytes_whatever_the_clock_says(template_folder, tmp_path):
    folder, chats = template_folder("llama-3.2"), write_chats(tmp_path / "chats.jsonl")
    outputs = []
    for day in ("2031-01-02", "2032-12-30"):
        out = tmp_path / day
        done = subprocess.run([sys.executable, "-c", FAKE_CLOCK, day, folder, str(chats), str(out)], cwd=REPO,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        # the clock is faked: transformers itself renders that day
        assert done.stdout.splitlines()[-1] == {"2031-01-02": "02 Jan 2031", "2032-12-30": "30 Dec 2032"}[day]
        outputs.append(out)
    files = sorted(p.relative_to(outputs[0]) for p in outputs[0].rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(outputs[1]) for p in outputs[1].rglob("*") if p.is_file())
    for name in files:
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name
    text = "".join(decoded_rows(outputs[0], folder))
    assert "Today Date: 26 Jul 2024" in text and "2031" not in text
    assert json.loads((outputs[0] / "packprep.json").read_text())["config"]["date"] == "2024-07-26"


@pytest.mark.slow
def test_date_and_template_args_reach_every_rendering_and_the_manifest(template_folder, tmp_path):
    folder, chats = template_folder("llama-3.2"), write_chats(tmp_path / "chats.jsonl")
    manifest = packprep.pack(str(chats), str(tmp_path / "out"), folder, num_proc=1, max_len=256, date="2025-01-31",
                             template_args={"custom_tools": None})
    assert manifest["config"]["date"] == "2025-01-31" and manifest["config"]["template_args"] == {"custom_tools": None}
    assert manifest["counts"]["normalized"]["template_kwargs"] == 1
    text = "\n".join(decoded_rows(tmp_path / "out", folder))
    assert text.count("Today Date: 31 Jan 2025") == 1  # the first record
    assert text.count("Today Date: 01 Jan 2000") == 1  # the second, by its own chat_template_kwargs
    report = packprep.verify(tmp_path / "out", retokenize=10)  # transformers' renderer, given the same inputs
    assert report.ok and report.retokenized == 2, report.failures
    card = (tmp_path / "out" / "README.md").read_text()
    assert '| template inputs | date `2025-01-31`, template args `{"custom_tools": null}`' in card
    assert "1 records rendered with their own chat_template_kwargs" in card


def test_llama_3_1_reads_date_string_and_keeps_its_own_default(template_folder):
    tok = load_tokenizer(template_folder("llama-3.1"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert "Today Date: 26 Jul 2024\n" in ChatTemplate(tok).render(chat, None)
    assert "Today Date: 31 Jan 2025\n" in ChatTemplate(tok, variables=template_variables("2025-01-31")).render(chat, None)
    # transformers, given nothing, renders the template's own default: packprep's default date is that day
    theirs = load_tokenizer(template_folder("llama-3.1"), transformers=True)
    assert theirs.apply_chat_template(chat, tokenize=False) == ChatTemplate(tok).render(chat, None)


def test_template_args_reach_qwen3s_generation_prompt(template_folder):
    tok = load_tokenizer(template_folder("qwen3"))
    chat = [{"role": "user", "content": "hi"}]
    off = template_variables(args=parse_template_args(["enable_thinking=false"]))
    assert ChatTemplate(tok, variables=off).render(chat, None, True).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ChatTemplate(tok).render(chat, None, True).endswith("<|im_start|>assistant\n")
    theirs = load_tokenizer(template_folder("qwen3"), transformers=True)
    assert ChatTemplate(tok, variables=off).render(chat, None, True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True, enable_thinking=False, **template_variables())


def test_template_args_are_parsed_as_json_else_text():
    assert parse_template_args(["a=false", "b=3", "c=x y", 'd={"k": [1]}', "e="]) == {
        "a": False, "b": 3, "c": "x y", "d": {"k": [1]}, "e": ""}
    for bad in (["novalue"], ["=1"], ["two words=1"]):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_template_args(bad)


@pytest.mark.parametrize("args, message", [
    (["--date", "31/01/2025"], "--date must be a date written YYYY-MM-DD"),
    (["--date", "2025-02-30"], "--date must be a date written YYYY-MM-DD"),
    (["--template-arg", "add_generation_prompt=true"], "cannot set add_generation_prompt"),
    (["--template-arg", "oops"], "expected KEY=VALUE"),
])
def test_bad_template_inputs_are_refused_before_any_work(args, message, template_folder, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl")
    for command in (["pack", "-o", str(tmp_path / "out")], ["stats"]):
        result = CliRunner().invoke(main, [*command, str(chats), "-t", template_folder("llama-3.2"), *args])
        assert result.exit_code in (EXIT_CONFIG, 2), result.output
        assert message in result.output
    assert not (tmp_path / "out").exists()


def test_a_bad_record_kwargs_field_is_rejected_with_a_reason(template_folder, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [CHATS[0], {**CHATS[0], "chat_template_kwargs": ["x"]},
                                                    {**CHATS[0], "chat_template_kwargs": {"messages": []}}])
    manifest = packprep.pack(str(chats), str(tmp_path / "out"), template_folder("llama-3.2"), num_proc=1, max_len=256)
    assert manifest["counts"]["rejected"] == 2
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert "field 'chat_template_kwargs' must map template variable names" in reasons[0]
    assert "field 'chat_template_kwargs' cannot set messages" in reasons[1]


@pytest.fixture(scope="module")
def named_folder(tmp_path_factory, template_folder) -> Path:
    """Llama-3.1's tokenizer with the list form of chat_template: a default and a tool_use template."""
    folder = tmp_path_factory.mktemp("named") / "tok"
    shutil.copytree(template_folder("llama-3.1"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    default = config["chat_template"]
    tool_use = default.replace("Cutting Knowledge Date", "Tool-use knowledge date")
    config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_named_templates_default_or_chosen(named_folder, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", CHATS[:1])
    templates = {e["name"]: e["template"] for e in json.loads((named_folder / "tokenizer_config.json").read_text())[
        "chat_template"]}
    for name in (None, "default", "tool_use"):
        out = tmp_path / f"out-{name}"
        manifest = packprep.pack(str(chats), str(out), str(named_folder), num_proc=1, max_len=256, chat_template=name)
        chosen = templates[name or "default"]
        assert manifest["config"]["chat_template"] == name
        assert manifest["tokenizer"]["chat_template_sha256"] == hashlib.sha256(chosen.encode()).hexdigest()
        assert ("Tool-use knowledge date" in decoded_rows(out, str(named_folder))[0]) == (name == "tool_use")
        report = packprep.verify(out, retokenize=1)
        assert report.ok and report.retokenized == 1, report.failures
    result = CliRunner().invoke(main, ["pack", str(chats), "-t", str(named_folder), "-o", str(tmp_path / "x"),
                                       "--chat-template", "rag"])
    assert result.exit_code == EXIT_CONFIG
    assert "named chat templates (default, tool_use) and no 'rag' one" in result.output


def test_named_templates_without_a_default_must_be_chosen(named_folder, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(named_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [dict(entry, name=f"v{n}") for n, entry in enumerate(config["chat_template"])]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    chats = write_chats(tmp_path / "chats.jsonl", CHATS[:1])
    result = CliRunner().invoke(main, ["stats", str(chats), "-t", str(folder)])
    assert result.exit_code == EXIT_CONFIG
    assert "named chat templates (v0, v1) and no 'default' one; pick one with --chat-template NAME" in result.output
    result = CliRunner().invoke(main, ["stats", str(chats), "-t", str(folder), "--chat-template", "v1", "--json"])
    assert result.exit_code == 0, result.output


def test_a_template_that_calls_strftime_now_gets_the_fixed_date(template_folder):
    tok = load_tokenizer(template_folder("llama-3.2"))
    tok.chat_template = "{{ strftime_now('%Y-%m-%d %H:%M') }}|{{ date_string }}|{{ messages[0].content }}"
    chat = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(tok).render(chat, None) == "2024-07-26 00:00|26 Jul 2024|hi"
    dated = ChatTemplate(tok, variables=template_variables("2030-02-03", {"date_string": "then"}))
    assert dated.render(chat, None) == "2030-02-03 00:00|then|hi"
    assert dated.with_variables({"date_string": "now"}).render(chat, None) == "2030-02-03 00:00|now|hi"
    theirs = load_tokenizer(template_folder("llama-3.2"), transformers=True)  # verify --retokenize's renderer
    theirs.chat_template = tok.chat_template
    assert ChatTemplate(theirs, transformers=True).render(chat, None) == "2024-07-26 00:00|26 Jul 2024|hi"
    assert ChatTemplate(theirs, transformers=True, variables=template_variables("2030-02-03")).render(chat, None) == (
        "2030-02-03 00:00|03 Feb 2030|hi")
