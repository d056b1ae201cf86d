"""Real conversations, faithfully (issue 13): normalize.py's transforms, and what each fixture
tokenizer trains of a ShareGPT file built from the shapes real dumps have.

The transforms are checked on literal messages; the trained turns are checked against transformers'
own ``apply_chat_template`` of the normalised messages, per prefix, as test_labels_reference does.
"""

from __future__ import annotations

import json

import pytest

from packprep.normalize import ROLES, Conversation, FieldNames, Policy, Rejected, detect_format, normalize
from packprep.record_schema import load_schema
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import CONVERSATIONS, fixture_tokenizer, needs_fixtures, slow_but
from .test_labels_reference import TOKENIZERS, conversations, reference_texts


def turn(speaker, value):
    return {"from": speaker, "value": value}


def messages(record, policy=Policy()):
    return normalize(record, "sharegpt", FieldNames(), policy).messages


def test_every_alias_maps_through_the_one_table():
    record = {"conversations": [turn("human", "a"), turn("bing", "b"), turn("user", "c"), turn("bard", "d"),
                                turn("prompter", "e"), turn("chatgpt", "f"), turn("user", "g"), turn("model", "h")]}
    assert [m["role"] for m in messages(record)] == ["user", "assistant"] * 4
    # the schemas list the same names as the table
    assert load_schema("sharegpt")["properties"]["conversations"]["items"]["properties"]["from"]["enum"] == sorted(ROLES)
    assert load_schema("openai")["properties"]["messages"]["items"]["properties"]["role"]["enum"] == sorted(ROLES)


def test_an_unknown_role_is_rejected_by_name():
    with pytest.raises(Rejected, match="unknown role 'narrator'") as caught:
        messages({"conversations": [turn("human", "a"), turn("narrator", "b")]})
    assert caught.value.code == "unknown_role"


def test_leading_assistant_turns_are_dropped_and_counted_or_rejected():
    record = {"system": "S", "conversations": [turn("gpt", "x"), turn("gpt", "y"), turn("human", "q"), turn("gpt", "a")]}
    conversation = normalize(record, "sharegpt")
    assert conversation.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                                     {"role": "assistant", "content": "a"}]
    assert conversation.changes == {"leading_turns_dropped": 2}
    with pytest.raises(Rejected, match="before the first user turn") as caught:
        normalize(record, "sharegpt", policy=Policy(leading_assistant="reject"))
    assert caught.value.code == "leading_assistant"
    with pytest.raises(Rejected, match="no assistant turn to train on after the first user turn") as caught:
        normalize({"conversations": [turn("gpt", "alone")]}, "sharegpt")
    assert caught.value.code == "no_assistant_turn"


def test_consecutive_turns_kept_merge_or_reject():
    """Kept by default: the template decides what two turns in a row become (template_fit merges the
    roles it refuses); merged on request, a role at a time."""
    record = {"conversations": [turn("human", "a"), turn("human", "b"), turn("gpt", "c"), turn("gpt", "d")]}
    assert len(messages(record)) == 4 and normalize(record, "sharegpt").changes == {}
    conversation = normalize(record, "sharegpt", policy=Policy(consecutive="merge"))
    assert conversation.messages == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c\n\nd"}]
    assert conversation.changes == {"turns_merged": 2}
    assistants = normalize(record, "sharegpt", policy=Policy(consecutive="merge", merged_roles=("assistant",)))
    assert [m["content"] for m in assistants.messages] == ["a", "b", "c\n\nd"]
    assert len(messages(record, Policy(consecutive="keep"))) == 4
    with pytest.raises(Rejected, match="messages 0 and 1 are both 'user' turns") as caught:
        messages(record, Policy(consecutive="reject"))
    assert caught.value.code == "consecutive_turns"


def test_tool_results_are_never_merged_and_parallel_calls_join_one_turn():
    call = lambda name: turn("function_call", json.dumps({"name": name, "arguments": {"x": 1}}))  # noqa: E731
    record = {"conversations": [turn("human", "q"), call("f"), call("g"), turn("observation", "1"),
                                turn("observation", "2"), turn("gpt", "done")],
              "tools": json.dumps([{"name": "f", "parameters": {}}])}
    assert [len(m.get("tool_calls", [])) for m in messages(record)] == [0, 1, 1, 0, 0, 0], "as the data has them"
    conversation = normalize(record, "sharegpt", policy=Policy(consecutive="merge"))
    assert conversation.messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"type": "function", "function": {"name": "g", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    assert conversation.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def test_openai_tool_calls_keep_their_structure_and_arguments_are_decoded():
    record = {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "done"}]}
    assert normalize(record, "openai").messages[1:3] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ]
    with pytest.raises(Rejected, match="tool call that is not a JSON object") as caught:
        normalize({"conversations": [turn("human", "q"), turn("function_call", "not json")]}, "sharegpt")
    assert caught.value.code == "bad_tool_call"


def test_messages_are_read_per_turn_shape_whatever_the_key():
    """OpenAI-shaped turns under 'conversations' (a common export) and ShareGPT turns under 'messages'."""
    a = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    b = {"messages": [turn("human", "q"), turn("gpt", "a")]}
    for record in (a, b):
        assert normalize(record, detect_format(record)).messages == [{"role": "user", "content": "q"},
                                                                     {"role": "assistant", "content": "a"}]


def test_the_template_probe_decides_system_and_tool_handling():
    expected = {  # (system, tool_calls, tool_results)
        "llama3": ("keep", "text", "tool"),  # Llama-3.0's template renders no tool_calls but any role
        "qwen2.5": ("keep", "native", "tool"),
        "mistral-7b-v0.1": ("fold", "text", "user"),
        "llama2": ("keep", "text", "user"),
        "gpt2": ("keep", "text", "tool"),
    }
    if not (CONVERSATIONS.parent / "tokenizers").is_dir():
        pytest.skip("../shared/fixtures is not beside the repo")
    for name, (system, calls, results) in expected.items():
        policy = fit_to_template(ChatEncoder(load_tokenizer(fixture_tokenizer(name)), backend="hf").template.render)
        assert (policy.system, policy.tool_calls, policy.tool_results) == (system, calls, results), name


# Every shape the issue names, in one small ShareGPT file; each text says whether it must be trained.
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
SHAPES = [
    {"conversations": [turn("gpt", "UNTRAINED leading chunk"), turn("human", "USER one"),
                       turn("gpt", "TRAINED answer one")]},
    {"conversations": [turn("human", "USER two"), turn("gpt", "TRAINED part a"), turn("gpt", "TRAINED part b"),
                       turn("human", "USER three"), turn("gpt", "TRAINED answer three")]},
    {"conversations": [turn("human", "USER four"), turn("bing", "TRAINED by bing"), turn("human", "USER five"),
                       turn("bard", "TRAINED by bard")]},
    {"conversations": [turn("system", "SYSTEM be terse"), turn("human", "USER six"), turn("gpt", "TRAINED terse")]},
    {"conversations": [turn("human", "USER seven"), turn("human", "USER seven again"), turn("gpt", "TRAINED yes")]},
    {"conversations": [turn("system", "SYSTEM two"), turn("gpt", "UNTRAINED lead a"), turn("gpt", "UNTRAINED lead b"),
                       turn("human", "USER eight"), turn("gpt", "TRAINED eight")]},
    {"conversations": [turn("human", "USER weather in Paris?"),
                       turn("function_call", json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})),
                       turn("observation", json.dumps({"UNTRAINED_temperature": 21})),
                       turn("gpt", "TRAINED it is 21 degrees")], "tools": json.dumps(TOOLS)},
]


def reference_labels(tok, conversation: Conversation) -> tuple[list[int], list[int]] | None:
    """ids and labels by the per-prefix definition, from transformers' own rendering; None if refused."""
    texts = reference_texts(tok, conversation)
    if texts is None:
        return None
    ids = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    labels = [-100] * len(ids[0])
    for before, after in zip(ids[1::2], ids[2::2]):
        labels[len(before) : len(after)] = after[len(before) :]
    return ids[0], labels


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_every_shape_trains_the_assistant_turns_of_its_normalised_messages(tokenizer_name):
    tok = load_tokenizer(fixture_tokenizer(tokenizer_name), transformers=True)  # the reference
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer(tokenizer_name)))
    policy = fit_to_template(encoder.template.render)
    convs = [normalize(record, detect_format(record), FieldNames(), policy) for record in SHAPES]
    for record, conversation, encoded in zip(SHAPES, convs, encoder.encode(convs)):
        assert isinstance(encoded, Encoded), f"{tokenizer_name} rejected {record}: {encoded}"
        assert encoded.turns_not_located == 0
        if not conversation.trained:  # else a turn's trained form differs from its history (tool calls as text)
            expected = tok.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                               return_dict=False)
            assert encoded.input_ids.tolist() == expected, "ids are transformers' rendering of the normalised messages"
            assert (encoded.input_ids.tolist(), encoded.labels.tolist()) == reference_labels(tok, conversation)
        trained = "".join(tok.decode([t for t, label in zip(ids, labels) if label != -100])
                          for ids, labels in encoded.sequences)
        untrained = "".join(tok.decode([t for t, label in zip(ids, labels) if label == -100])
                            for ids, labels in encoded.sequences)
        texts = [t["value"] for t in record["conversations"]]
        for text in texts:
            if text.startswith("TRAINED"):
                assert text in trained, (tokenizer_name, text)
            if text.startswith(("USER", "SYSTEM")):
                assert text not in trained and text in untrained, (tokenizer_name, text)
            if text.startswith("UNTRAINED"):
                assert text not in trained and text not in untrained, "a dropped leading turn is not rendered"
        if "UNTRAINED_temperature" in str(texts):
            assert "UNTRAINED_temperature" in untrained and "UNTRAINED_temperature" not in trained
            assert '"Paris"' in trained, "the assistant's tool call is trained"
            if tokenizer_name == "qwen2.5":
                assert "<tool_call>" in trained and '"name": "get_weather"' in trained


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", slow_but({"llama3"}, ["qwen2.5", "llama3"]))
def test_glaive_tool_calls_are_trained_in_the_templates_own_format(tokenizer_name):
    tok = load_tokenizer(fixture_tokenizer(tokenizer_name), transformers=True)  # the reference
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer(tokenizer_name)))
    policy = fit_to_template(encoder.template.render)
    convs = conversations("llamafactory_glaive_toolcall_en_demo.json", policy)
    calls = tool_turns = 0
    for conversation, encoded in zip(convs, encoder.encode(convs)):
        assert isinstance(encoded, Encoded)
        if not conversation.trained:  # else a turn's trained form differs from its history (tool calls as text)
            assert encoded.input_ids.tolist() == tok.apply_chat_template(
                conversation.messages, tools=conversation.tools, tokenize=True, return_dict=False)
        trained = "".join(tok.decode([t for t, label in zip(ids, labels) if label != -100])
                          for ids, labels in encoded.sequences)
        for message in conversation.messages:
            if message["role"] == "tool":
                tool_turns += 1
                assert message["content"].strip() not in trained, "a tool's result is never trained"
            for call in message.get("tool_calls") or []:
                calls += 1
                assert f'"name": "{call["function"]["name"]}"' in trained
                assert "<tool_call>" in trained, "Qwen is trained on its own <tool_call> tags"
        if tokenizer_name == "llama3" and conversation.changes.get("tool_calls_as_text"):
            calls += 1
            assert '"arguments"' in trained, "Llama-3.0 has no tool_calls: the call is trained as text"
    assert calls > 100 and (tool_turns > 100 or tokenizer_name != "qwen2.5")


@needs_fixtures
def test_a_template_refusal_names_the_record_not_the_template_internals():
    encoder = ChatEncoder(load_tokenizer(fixture_tokenizer("qwen2.5")))
    result = encoder.encode([Conversation(messages=[{"role": "assistant", "content": "x"}])])[0]
    assert isinstance(result, Rejected)
    assert "no element" not in str(result) and "list object" not in str(result)
    assert "starts with a 'assistant' turn" in str(result) and "--leading-assistant drop" in str(result)
    mistral = ChatEncoder(load_tokenizer(fixture_tokenizer("mistral-7b-v0.1")))
    twice = Conversation(messages=[{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi?"},
                                   {"role": "assistant", "content": "Hello"}])
    result = mistral.encode([twice])[0]
    assert "two 'user' turns in a row" in str(result) and "--consecutive merge" in str(result)
    assert "the template says: Conversation roles must alternate" in str(result)
