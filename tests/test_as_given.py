"""By default a record reaches the chat template as the data has it: the template is the authority.

Two assistant messages in a row are two trained replies, each after its own header, where the template
renders them so; a system message goes to the template even where it writes none (it drops it at
inference too). Merging and folding happen where the template refuses the record as it is (counted,
and said in the summary), or on request (``--consecutive merge``, ``--system fold``). Each record is
checked against the token-exact reference on transformers' renderer (tests/zoo_reference.py).
"""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from packprep.cli import main

from .conftest import EXAMPLE_TOKENIZER
from .zoo_conformance import pack_and_read, trained_in_context
from .zoo_reference import as_messages, fit, probe, reference_turns, renderer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_SYSTEM = CHATML.replace("{% for m in messages %}", "{% for m in messages if m.role != 'system' %}")
ALTERNATING = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if (m.role == 'user') != "
                             "(loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}")
NO_SYSTEM_ALLOWED = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m.role == 'system' %}"
                                   "{{ raise_exception('System role not supported') }}{% endif %}")
TWO_REPLIES = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                            {"role": "assistant", "content": "How can I help?"}]}
SYSTEM = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."}]}


def folder(tmp_path, template: str) -> str:
    dest = tmp_path / "tokenizer"
    shutil.copytree(EXAMPLE_TOKENIZER, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(dest)


def pack(tmp_path, template: str, record: dict, **settings):
    """(normalized counts, trained texts, whether every reference turn is trained in its context)."""
    from transformers import AutoTokenizer

    path = folder(tmp_path, template)
    (tmp_path / "work").mkdir()
    manifest, sequences, _ = pack_and_read(path, [record], tmp_path / "work", **settings)
    tok = AutoTokenizer.from_pretrained(path)
    render = renderer(tok)
    shape = probe(render)
    messages, tools = as_messages(record)
    turns = [t for t in reference_turns(tok, render, fit(messages, shape), tools, shape) if t.reason is None]
    exact = bool(turns) and all(trained_in_context(sequences.get(0, []), t.context, t.target) for t in turns)
    runs = [tok.decode([t for t, label in zip(ids, labels) if label != -100]) for ids, labels in sequences.get(0, [])]
    return manifest["counts"]["normalized"], runs, exact


def test_two_assistant_messages_in_a_row_are_two_trained_replies(tmp_path):
    normalized, runs, exact = pack(tmp_path, CHATML, TWO_REPLIES)
    assert exact and normalized["turns_merged"] == 0
    assert runs == ["Hello.<|im_end|>\nHow can I help?<|im_end|>\n"], "each reply after its own header"
    merged, runs, exact = pack(tmp_path / "merge", CHATML, TWO_REPLIES, consecutive="merge")
    assert merged["turns_merged"] == 1 and runs == ["Hello.\n\nHow can I help?<|im_end|>\n"] and not exact


def test_a_system_message_goes_to_a_template_that_writes_none(tmp_path):
    normalized, runs, exact = pack(tmp_path, NO_SYSTEM, SYSTEM)
    assert exact and normalized["system_folded"] == 0, "the context is the template's own, without the system text"
    folded, _, exact = pack(tmp_path / "fold", NO_SYSTEM, SYSTEM, system="fold")
    assert folded["system_folded"] == 1 and not exact


def test_what_the_template_refuses_is_merged_or_folded_and_counted(tmp_path):
    normalized, runs, _ = pack(tmp_path, ALTERNATING, TWO_REPLIES)
    assert normalized["turns_merged"] == 1 and runs == ["Hello.\n\nHow can I help?<|im_end|>\n"]
    normalized, _, _ = pack(tmp_path / "system", NO_SYSTEM_ALLOWED, SYSTEM)
    assert normalized["system_folded"] == 1


def test_the_summary_says_the_turns_went_as_the_data_has_them_or_what_changed(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(TWO_REPLIES) + "\n")
    for template, said in ((CHATML, "turns: as the data has them, none dropped, merged or converted"),
                           (ALTERNATING, "1 turns merged into the turn before (the template refuses two in a row")):
        out = tmp_path / f"out{len(said)}"
        result = CliRunner().invoke(main, ["pack", str(data), "-t", folder(tmp_path / str(len(said)), template), "-o",
                                           str(out), "--max-len", "256", "--num-proc", "1"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert said in " ".join(result.output.split()), result.output
        assert said in " ".join((out / "README.md").read_text().split())
