"""Every assistant turn is trained in its inference context (render.py's label definition).

For the tokenizer folders of current chat models (tests/template_folders.py) and the fixture ones, on
multi-turn chat, tool calls, reasoning and OpenAI content-part data, packprep's sequences and labels
equal those of an independent per-turn labeler built on transformers' renderer
(tests/reference_labels.py); the policies' costs are counted; a conversation trained as several
sequences is packed, accounted and checked again by ``verify --retokenize``.
"""

from __future__ import annotations

import json

import pytest

import packprep
from packprep.normalize import FieldNames, Rejected, detect_format, normalize
from packprep.render import ChatTemplate, probe_shape
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures, slow_but
from .reference_labels import SHAPES, exact_sequences, renderer, token_sequences, turn_targets

FAMILIES = ["qwen3", "qwq", "deepseek-r1-distill-qwen", "phi-3.5-mini", "mistral-v3", "llama-3.1", "llama-3.2"]
FIXTURE_TOKENIZERS = ["llama3", "qwen2.5"]


def _call(name, arguments, id_=None):
    return {"id": id_ or f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
RECORDS = {
    "chat": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."}]},
    "tools": {"tools": WEATHER, "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("weather", '{"city": "Paris"}'),
                                                             _call("weather", {"city": "Rome"}, "call_2")]},
        {"role": "tool", "tool_call_id": "call_weather", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "call_weather", "content": "5C"},
        {"role": "assistant", "content": "Oslo 5C."}]},
    "reasoning": {"messages": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisor but 1 and 7."},
        {"role": "user", "content": "Is 9?"},
        {"role": "assistant", "content": "<think>\n9 = 3 * 3.\n</think>\n\nNo."},
        {"role": "user", "content": "Is 11?"},
        {"role": "assistant", "content": "Yes, 11 is prime.", "reasoning_content": "No divisor up to 3."}]},
    "content parts": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "Another?"}, {"type": "text", "text": " Please."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]},
}


def _folder(name, template_folder):
    return template_folder(name) if name in FAMILIES else fixture_tokenizer(name)


def _conversation(encoder, record):
    policy = fit_to_template(encoder.template.render)  # as pack fits records to the template
    return normalize(json.loads(json.dumps(record)), detect_format(record), FieldNames(), policy)


@needs_fixtures
@pytest.mark.parametrize("data", list(RECORDS))
@pytest.mark.parametrize("name", slow_but({"phi-3.5-mini", "mistral-v3"}, FAMILIES + FIXTURE_TOKENIZERS))
def test_every_turn_is_trained_in_its_inference_context(name, data, template_folder):
    folder = _folder(name, template_folder)
    tok = load_tokenizer(folder, transformers=True)  # the reference's own tokenizer and renderer
    encoder = ChatEncoder(load_tokenizer(folder), backend="hf")
    try:
        conversation = _conversation(encoder, RECORDS[data])
    except Rejected as exc:
        pytest.fail(f"{name} {data}: normalizing rejected the record: {exc}")
    messages = conversation.messages[: max(k for k, m in enumerate(conversation.messages) if m["role"] == "assistant") + 1]
    found, missing, _ = turn_targets(renderer(tok), messages, conversation.tools, SHAPES.get(name, ("", "", "")),
                                     trained=conversation.trained)
    expected = [seq for text, spans in exact_sequences(found) for seq in token_sequences(tok, text, spans)]
    (encoded,) = encoder.encode([conversation])
    if not any(label != -100 for _, labels in expected for label in labels[1:]):
        assert isinstance(encoded, Rejected)
        return
    assert isinstance(encoded, Encoded), f"{name} {data}: rejected {encoded}"
    assert [(ids.tolist(), labels.tolist()) for ids, labels in encoded.sequences] == expected
    assert encoded.turns_not_located == missing
    # DeepSeek-R1's template writes a later tool-calling message without its <｜Assistant｜> header (ns.is_first
    # is never reset): that turn's rendering does not extend its context, and it is trained as the template
    # writes it after its generation prompt
    assert missing == 0, "every turn has a context"
    trained = "".join(tok.decode([t for t, label in zip(ids, labels) if label != -100]) for ids, labels in expected)
    if name in ("qwen3", "qwq", "deepseek-r1-distill-qwen"):  # templates that render reasoning: all of it is trained
        given = [m["reasoning_content"] for m in messages if m.get("reasoning_content")]  # as normalize passes it on
        inline = [m["content"].split("</think>")[0].split("<think>")[-1].strip() for m in messages
                  if m["role"] == "assistant" and "</think>" in (m.get("content") or "")]
        assert (data != "reasoning") or inline or given
        for reasoning in given + inline:
            assert reasoning in trained


SHAPE_EXPECTED = {
    "qwen3": ("", "", ""), "qwq": ("", "<think>\n", "</think>"),
    "deepseek-r1-distill-qwen": ("", "<think>\n", "</think>"), "phi-3.5-mini": ("<|endoftext|>", "", ""),
    "mistral-v3": ("", "", ""), "llama-3.1": ("", "", ""), "llama-3.2": ("", "", ""),
}


@needs_fixtures
@pytest.mark.parametrize("name", FAMILIES)
def test_probing_finds_the_tail_and_the_reasoning_opening(name, template_folder):
    shape = ChatTemplate(load_tokenizer(template_folder(name))).shape
    assert (shape.tail, shape.opening, shape.closing) == SHAPE_EXPECTED[name]


CHATML_LOOP = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
TAILS = {
    "constant": ("{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<END>{% endif %}", "<END>", 1),
    "counts the messages": ("{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<END {{ messages|length }}>"
                            "{% endif %}", "", 3),
    "prints the last message": ("{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}"
                                "<END {{ messages[-1]['content'] }}>{% endif %}", "", 3),
    "only after long conversations": ("{% if add_generation_prompt %}<|im_start|>assistant\n{% elif messages|length > 3 %}"
                                      "<END>{% endif %}", "", 2),  # its first turn renders as at inference
}


@pytest.mark.parametrize("name", list(TAILS))
def test_the_tail_rule_fires_only_for_a_constant_tail(name):
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = CHATML_LOOP + TAILS[name][0]
    template = ChatTemplate(tok)
    assert template.shape.tail == TAILS[name][1]
    encoder = ChatEncoder(tok, backend="hf")
    messages = [{"role": r, "content": f"{r} {i}"} for i, r in enumerate(["user", "assistant"] * 3)]
    (encoded,) = encoder.encode([_conv(messages)])
    theirs = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    found, _, _ = turn_targets(renderer(theirs, tok.chat_template), messages, None, (TAILS[name][1], "", ""))
    expected = [seq for text, spans in exact_sequences(found) for seq in token_sequences(theirs, text, spans)]
    assert [(i.tolist(), l.tolist()) for i, l in encoded.sequences] == expected
    assert len(encoded.sequences) == TAILS[name][2]


def _conv(messages):
    from packprep.normalize import Conversation

    return Conversation(messages=messages)


def test_a_prompt_that_opens_a_block_no_reply_is_stripped_of_is_not_a_reasoning_opening():
    render = lambda messages, tools, generation: ("".join(m["content"] for m in messages)  # noqa: E731
                                                  + ("<start>\n" if generation else "."))
    assert probe_shape(render).opening == ""


@needs_fixtures
@pytest.mark.parametrize("name", slow_but({"qwen3"}, ["qwen3", "deepseek-r1-distill-qwen"]))
def test_policies_trade_tokens_for_turns_in_context(name, template_folder):
    encoders = {p: ChatEncoder(load_tokenizer(template_folder(name)), backend="hf", turn_context=p)
                for p in ("exact", "intact", "rendered")}
    conversation = _conversation(encoders["exact"], RECORDS["chat"])
    results = {p: e.encode([conversation])[0] for p, e in encoders.items()}
    exact = results["exact"]
    assert len(exact.sequences) == 3 and exact.turns_not_located == 0 and exact.turns_rewritten == 3 - (name == "qwen3")
    assert exact.repeated_tokens == sum(len(ids) for ids, _ in exact.sequences[:-1]) > 0
    rendered = results["rendered"]
    assert len(rendered.sequences) == 1 and rendered.turns_not_located == 0
    assert rendered.turns_out_of_context == exact.turns_rewritten
    if name == "qwen3":  # the full rendering holds the last turn as at inference
        assert results["intact"].turns_not_located == 2 and len(results["intact"].sequences) == 1
    else:  # DeepSeek's generation prompt opens <think>, which no rendered turn holds
        assert isinstance(results["intact"], Rejected) and results["intact"].code == "template_not_prefix_stable"


@needs_fixtures
def test_a_conversation_of_several_sequences_is_packed_accounted_and_checked_again(tmp_path, template_folder):
    inputs = tmp_path / "chats.jsonl"
    records = [RECORDS["chat"], RECORDS["reasoning"], {"messages": [{"role": "user", "content": "Hi"}]},
               RECORDS["content parts"]]
    inputs.write_text("".join(json.dumps(r) + "\n" for r in records))
    folder = template_folder("qwen3")
    manifest = packprep.pack(str(inputs), str(tmp_path / "out"), folder, max_len=256, num_proc=1)
    counts = manifest["counts"]
    assert (counts["records"], counts["packed"], counts["rejected"]) == (4, 3, 1)
    assert counts["extra_sequences"] == 2 + 2 + 1 and manifest["sequences"] == 3 + 3 + 2
    assert counts["turns_rewritten"] == 5 and counts["turns_not_located"] == 0 and counts["repeated_tokens"] > 0
    assert manifest["config"]["turn_context"] == "exact"
    import pyarrow.parquet as pq

    sources = [s for path in sorted((tmp_path / "out").rglob("*.parquet"))
               for row in pq.read_table(path).column("source_index").to_pylist() for s in row]
    assert sorted(sources) == [0, 0, 0, 1, 1, 1, 3, 3]  # each sequence points at its record
    report = packprep.verify(str(tmp_path / "out"), retokenize=8)
    assert report.ok, report.failures
    intact = packprep.pack(str(inputs), str(tmp_path / "intact"), folder, max_len=256, num_proc=1, turn_context="intact")
    assert intact["sequences"] == 3 and intact["counts"]["turns_not_located"] == 5
    assert intact["tokens"]["total"] + counts["repeated_tokens"] == manifest["tokens"]["total"]


@needs_fixtures
@pytest.mark.slow
def test_stats_shows_each_policys_cost(template_folder, tmp_path):
    inputs = tmp_path / "chats.jsonl"
    inputs.write_text(json.dumps(RECORDS["chat"]) + "\n")
    report = packprep.stats(str(inputs), template_folder("qwen3"), max_lens=[256], num_proc=1)
    policies = report["turn_context"]["policies"]
    assert [policies[p]["sequences"] for p in ("exact", "intact", "rendered")] == [3, 1, 1]
    assert policies["exact"]["tokens"] - policies["intact"]["tokens"] == report["turn_context"]["repeated_tokens"] > 0
    assert [policies[p]["turns_not_located"] for p in ("exact", "intact", "rendered")] == [0, 2, 0]
    assert policies["rendered"]["turns_out_of_context"] == 2
    from packprep.length_stats import render_text

    text = render_text(report)
    assert "turn context exact: 2 more sequences" in text and "rendered" in text
    plain = packprep.stats(str(inputs), fixture_tokenizer("llama3"), max_lens=[256], num_proc=1)
    assert "every --turn-context gives the same" in render_text(plain)


@needs_fixtures
def test_repack_refuses_a_folder_whose_records_are_several_sequences(tmp_path, template_folder):
    """The shards do not store which of a record's sequences came first: repack would lose or reorder
    them, so it refuses and says to pack again."""
    from packprep.errors import ConfigError
    from packprep.pipeline import repack

    inputs = tmp_path / "chats.jsonl"
    inputs.write_text(json.dumps(RECORDS["chat"]) + "\n")
    manifest = packprep.pack(str(inputs), str(tmp_path / "out"), template_folder("qwen3"), max_len=256, num_proc=1)
    assert manifest["counts"]["extra_sequences"] > 0
    with pytest.raises(ConfigError, match="pack again from the inputs"):
        repack(tmp_path / "out", tmp_path / "repacked", max_len=512)
    assert not (tmp_path / "repacked").exists()


@needs_fixtures
def test_a_validation_split_holds_out_whole_records_of_several_sequences(tmp_path, template_folder):
    """``--validation-size`` and weights draw records, not sequences: every sequence of a record
    (``--turn-context exact`` gives one a trained turn) lands in one split, with the same copies."""
    import pyarrow.parquet as pq

    inputs = tmp_path / "chats.jsonl"
    inputs.write_text("".join(json.dumps(RECORDS["chat"]) + "\n" for _ in range(12)))  # 3 sequences each
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - path: {inputs}\n    weight: 1.5\n")
    out = tmp_path / "out"
    manifest = packprep.pack([], str(out), template_folder("qwen3"), max_len=256, num_proc=1, mix=str(mix),
                             validation_size=4)
    assert packprep.verify(str(out)).ok

    def sources(split):
        return [s for path in sorted((out / "data").glob(f"{split}-*.parquet"))
                for row in pq.read_table(path).column("source_index").to_pylist() for s in row]

    train, held = sources("train"), sources("validation")
    assert sorted(set(held)) == manifest["validation"]["members"][0]["indices"] and len(set(held)) == 4
    assert not set(train) & set(held)
    assert sorted(held) == sorted(3 * sorted(set(held)))  # every sequence of each held-out record
    copies = {record: train.count(record) for record in set(train)}
    assert sorted(copies.values()) == [3] * 4 + [6] * 4  # 8 records at weight 1.5: 4 once, 4 twice
    row = manifest["mixture"]["sources"][0]
    assert (row["validation_records"], row["train_records"], row["train_sequences"]) == (4, 8, 36)
    predicted = packprep.stats([], template_folder("qwen3"), max_lens=[256], num_proc=1, mix=str(mix),
                               validation_size=4)["mixture"]["sources"][0]
    assert (predicted["conversations"], predicted["validation_records"]) == (12, 4)
    assert predicted["train_sequences"] == row["train_sequences"]  # stats draws as pack does
