"""The token-exact definition, one literal case a cause (docs/label-definition.md).

Each case is a small template on the example tokenizer, and each is checked against the
independent per-turn labeler (tests/reference_labels.py, on transformers' renderer and tokenizer)
besides what it shows on its own: the history never carries what packprep writes for a trained
turn, a context is tokenized on its own, every role and tool call the template renders reaches it,
and what became of each turn's reasoning is counted as the shards hold it.
"""

from __future__ import annotations

import json

import pytest

from packprep.normalize import FieldNames, Rejected, detect_format, normalize
from packprep.template_fit import fit_to_template
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import EXAMPLE_TOKENIZER
from .reference_labels import exact_sequences, renderer, token_sequences, turn_targets

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def encode(template: str, record: dict, **options):
    """(packprep's Encoded, the reference's sequences, the fitted conversation) for one record."""
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = template
    encoder = ChatEncoder(tok, backend="hf", **options)
    policy = fit_to_template(encoder.template.render)
    conversation = normalize(json.loads(json.dumps(record)), detect_format(record), FieldNames(), policy)
    (encoded,) = encoder.encode([conversation])
    theirs = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    messages = conversation.messages
    messages = messages[: max(k for k, m in enumerate(messages) if m["role"] == "assistant") + 1]
    found, _, _ = turn_targets(renderer(theirs, template), messages, conversation.tools, trained=conversation.trained)
    expected = [seq for text, spans in exact_sequences(found) for seq in token_sequences(theirs, text, spans)]
    return encoded, expected, conversation


def trained_texts(encoded) -> list[str]:
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    return [tok.decode([t for t, label in zip(ids, labels) if label != -100]) for ids, labels in encoded.sequences]


def sequences(encoded):
    return [(ids.tolist(), labels.tolist()) for ids, labels in encoded.sequences]


def chat(*turns, **extra) -> dict:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", **turn} if isinstance(turn, dict)
                         else {"role": "user" if i % 2 == 0 else "assistant", "content": turn}
                         for i, turn in enumerate(turns)], **extra}


def test_reasoning_is_written_into_the_trained_turn_only_never_into_the_history():
    record = chat("Is 7 prime?", {"content": "Yes.", "reasoning_content": "No divisor."},
                  "Is 9?", {"content": "No.", "reasoning_content": "9 = 3 * 3."})
    encoded, expected, _ = encode(CHATML, record)
    assert sequences(encoded) == expected
    assert trained_texts(encoded) == ["<think>\nNo divisor.\n</think>\n\nYes.<|im_end|>\n",
                                      "<think>\n9 = 3 * 3.\n</think>\n\nNo.<|im_end|>\n"]
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    assert "No divisor" not in tok.decode(encoded.input_ids), "the later turn's context holds the reply as given"
    assert encoded.changes == {"reasoning_inlined": 2}


def test_reasoning_a_template_strips_from_every_reply_is_counted_dropped():
    stripping = CHATML.replace("{{ m.content }}", "{{ m.content.split('</think>')[-1] }}")
    encoded, expected, _ = encode(stripping, chat("q", {"content": "a", "reasoning_content": "r"}))
    assert sequences(encoded) == expected and trained_texts(encoded) == ["\n\na<|im_end|>\n"]
    assert encoded.changes == {"reasoning_dropped": 1}
    reads = CHATML.replace("{{ m.content }}", "{% if m.reasoning %}[{{ m.reasoning }}]{% endif %}{{ m.content }}")
    encoded, _, conversation = encode(reads, chat("q", {"content": "a", "thinking": "r"}))
    assert conversation.messages[1]["reasoning"] == "r" and encoded.changes == {"reasoning_trained": 1}


# the prompt ends in a space, and the reply's first word takes it: " y" is one token when tokenized together
SPACED = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant: {% endif %}")


def test_each_context_is_tokenized_on_its_own():
    encoded, expected, _ = encode(SPACED, chat("x", "y", "z", "w"))
    assert sequences(encoded) == expected
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    first = encoded.sequences[0]
    context = tok("user: x\nassistant: ", add_special_tokens=False)["input_ids"]
    assert first[0].tolist()[: len(context)] == context, "the context's own ids, ending in the space"
    assert len(encoded.sequences) == 2 and encoded.turns_rewritten == 1  # turn 1 is not held in turn 2's ids
    assert trained_texts(encoded) == ["y\n", "w\n"]


def test_a_prefix_stable_tokenization_is_one_sequence_tokenized_once():
    encoded, expected, _ = encode(CHATML, chat("x", "y", "z", "w"))
    assert sequences(encoded) == expected and len(expected) == 1 and not encoded.turns_rewritten


ANY_ROLE = CHATML
KNOWN_ROLES = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m.role not in "
                             "['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role') }}{% endif %}")


@pytest.mark.parametrize("template, role, mapped", [(ANY_ROLE, "developer", 0), (KNOWN_ROLES, "system", 1)])
def test_the_developer_role_is_passed_where_the_template_renders_it(template, role, mapped):
    record = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]}
    encoded, expected, conversation = encode(template, record)
    assert isinstance(encoded, Encoded) and sequences(encoded) == expected
    assert conversation.messages[0]["role"] == role and conversation.changes.get("roles_mapped", 0) == mapped


CALLS_WITH_TOOLS = CHATML.replace("{{ m.content }}", "{{ m.content }}{% if tools and m.tool_calls %}"
                                  "{% for c in m.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments }}"
                                  "</call>{% endfor %}{% endif %}")
JOINED_ARGUMENTS = CHATML.replace("{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls or [] %}"
                                  "{{ '<call>' + c.function.name + ' ' + c.function.arguments + '</call>' }}{% endfor %}")
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"a":["b","c"]}'}}]}
TOOLS = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("template, call_text", [
    (CALLS_WITH_TOOLS, "<call>find {'a': ['b', 'c']}</call>"),  # probed with tools: the calls are the template's own
    (JOINED_ARGUMENTS, '<call>find {"a":["b","c"]}</call>'),  # the record's JSON string, byte for byte
])
def test_tool_calls_reach_the_template_as_it_takes_them(template, call_text):
    record = {"tools": TOOLS, "messages": [{"role": "user", "content": "q"}, CALL,
                                           {"role": "tool", "tool_call_id": "c1", "content": "r"},
                                           {"role": "assistant", "content": "done"}]}
    encoded, expected, conversation = encode(template, record)
    assert sequences(encoded) == expected and "tool_calls_as_text" not in conversation.changes
    assert call_text in trained_texts(encoded)[0]


def test_a_call_without_text_is_not_trained_as_the_word_none():
    """A template that writes ``{{ content }}`` beside the calls prints None as "None"; the call's empty
    text reaches it as "" there, so the model is not trained to write "None" before its call."""
    record = {"tools": TOOLS, "messages": [{"role": "user", "content": "q"}, CALL]}
    encoded, expected, conversation = encode(CALLS_WITH_TOOLS, record)
    assert sequences(encoded) == expected
    assert trained_texts(encoded)[0].startswith("<call>find") and conversation.messages[1]["content"] == ""


def test_tool_calls_a_template_renders_nowhere_are_text_in_the_trained_turn_or_rejected():
    record = {"messages": [{"role": "user", "content": "q"}, CALL, {"role": "tool", "tool_call_id": "c1", "content": "r"},
                           {"role": "assistant", "content": "done"}]}
    encoded, expected, conversation = encode(CHATML, record)
    assert sequences(encoded) == expected and conversation.changes["tool_calls_as_text"] == 1
    assert '"find"' in trained_texts(encoded)[0] and len(encoded.sequences) == 2
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    assert '"find"' not in tok.decode(encoded.input_ids), "not written into the history"
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER))
    tok.chat_template = CHATML
    policy = fit_to_template(ChatEncoder(tok, backend="hf").template.render, tool_calls="reject")
    with pytest.raises(Rejected, match="--tool-calls text") as caught:
        normalize(record, "openai", policy=policy)
    assert caught.value.code == "tool_calls_not_rendered"


# keeps a tool-calling turn's thinking only while no final answer follows it (as gpt-oss's template does)
UNTIL_ANSWERED = (
    "{%- set ns = namespace(final=-1) -%}{%- for m in messages -%}{%- if m.role == 'assistant' and not m.tool_calls -%}"
    "{%- set ns.final = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}U:{{ m.content }}\n{%- elif m.role == 'tool' -%}T:{{ m.content }}\n"
    "{%- elif m.tool_calls -%}A:{% if loop.index0 > ns.final and m.thinking %}[{{ m.thinking }}]{% endif %}"
    "call {{ m.tool_calls[0].function.name }}\n{%- else -%}A:{{ m.content }}\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:{%- endif -%}")


def test_a_turn_whose_rendering_rewrites_its_context_is_trained_after_that_context():
    record = {"messages": [{"role": "user", "content": "q"}, {**CALL, "thinking": "plan"},
                           {"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "assistant", "content": "done"}]}
    encoded, expected, _ = encode(UNTIL_ANSWERED, record)
    assert sequences(encoded) == expected and encoded.turns_not_located == 0
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    # the whole conversation renders "U:qA:call findT:rA:done" (the answer follows): no turn in its context there
    assert tok.decode(encoded.input_ids) == "U:qA:[plan]call findT:rA:done", "the answer after its own context"
    assert trained_texts(encoded) == ["[plan]call finddone"] and encoded.changes == {"reasoning_trained": 1}


def test_a_record_the_template_refuses_whole_still_trains_the_turns_it_renders():
    refuses_later = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m.content == 'bad' %}"
                                   "{{ raise_exception('no') }}{% endif %}")
    encoded, expected, _ = encode(refuses_later, chat("q", "a", "bad", "b"))
    assert isinstance(encoded, Encoded) and sequences(encoded) == expected
    assert trained_texts(encoded) == ["a<|im_end|>\n"] and encoded.turns_not_located == 1


def test_pack_counts_and_verify_retokenize_follow_the_definition(tmp_path):
    """A template whose prompt ends in a space, reasoning it has no place for: pack writes each turn on
    its context tokenized alone, counts the reasoning where the shards hold it, and ``verify
    --retokenize`` (transformers' renderer and tokenizer) re-makes every sequence the same."""
    import shutil

    import packprep

    folder = tmp_path / "tok"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SPACED}))
    records = [chat("x", {"content": "y", "reasoning_content": "r1"}, "z", {"content": "w", "reasoning_content": "r2"}),
               chat("x", "y", "z", "w")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    manifest = packprep.pack(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), str(folder), max_len=128, num_proc=1)
    assert manifest["counts"]["normalized"]["reasoning_inlined"] == 2
    assert manifest["sequences"] == 4 and manifest["counts"]["extra_sequences"] == 2
    report = packprep.verify(str(tmp_path / "out"), retokenize=10)
    assert report.ok, report.failures


# a thinking-mode prompt that ends in <think> with no newline, and past replies stripped of their reasoning
THINKING_PROMPT = ("{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n{% else %}A:"
                   "{{ m.content.split('</think>')[-1] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
                   "A:<think>{% endif %}")


def test_a_thinking_prompt_without_a_newline_trains_every_turn_after_it():
    record = chat("q", {"content": "a", "reasoning_content": "r"}, "p", "b")
    encoded, expected, _ = encode(THINKING_PROMPT, record)
    assert isinstance(encoded, Encoded) and sequences(encoded) == expected and encoded.turns_not_located == 0
    assert trained_texts(encoded) == ["\nr\n</think>\n\na\n", "\n\n</think>\n\nb\n"]  # the model opens with a newline
    assert encoded.changes == {"reasoning_trained": 1}


# writes the system prompt into the last message only, when that is a user turn (as Mistral Nemo's template does)
MOVED_SYSTEM = ("{% for m in messages %}{% if m.role == 'user' %}[INST]{% if loop.last and messages[0].role == 'system' %}"
                "{{ messages[0].content }} {% endif %}{{ m.content }}[/INST]{% elif m.role == 'assistant' %}"
                "{{ m.content }}</s>{% endif %}{% endfor %}")


def test_a_system_prompt_the_template_moves_is_kept_and_every_turn_trained_after_it():
    record = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}, {"role": "user", "content": "p"},
                           {"role": "assistant", "content": "b"}]}
    encoded, expected, conversation = encode(MOVED_SYSTEM, record)
    assert conversation.messages[0]["role"] == "system", "rendered in the context: not folded"
    assert sequences(encoded) == expected and encoded.turns_not_located == 0
    tok = load_tokenizer(str(EXAMPLE_TOKENIZER), transformers=True)
    assert [tok.decode(ids) for ids, _ in encoded.sequences] == ["[INST]S q[/INST]a</s>", "[INST]q[/INST]a</s>[INST]S p[/INST]b</s>"]


def test_a_prompt_that_opens_a_block_the_reply_closes_itself_is_closed_once():
    closes = THINKING_PROMPT.replace("A:{{ m.content.split('</think>')[-1] }}", "A:</think>{{ m.content.split('</think>')[-1] }}")
    encoded, expected, _ = encode(closes, chat("q", "a"))
    assert sequences(encoded) == expected and trained_texts(encoded) == ["</think>a\n"]
