"""Reasoning and tool calls in the shapes 2025-2026 data sets use, fitted to each current template.

Literal cases first (normalize + assistant_turns), then each real template (tests/templates/):
what fit_to_template decides for it, that the fitted conversation renders in packprep exactly as
transformers' own ``apply_chat_template`` renders it, that reasoning reaches the text or is counted,
and that tool calls (JSON-string and object arguments, parallel calls, ``content: None``) are
rendered natively where the template can.
"""

from __future__ import annotations

import json

import pytest

from packprep.normalize import Policy, Rejected, normalize
from packprep.render import ChatTemplate
from packprep.template_fit import fit_to_template
from packprep.template_inputs import template_variables
from packprep.tokenization import load_tokenizer

from .conftest import needs_fixtures, slow_but


def chat(*messages, **extra) -> dict:
    return {"messages": list(messages), **extra}


USER = {"role": "user", "content": "What is 2+2?"}


@pytest.mark.parametrize("assistant", [
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    {"role": "assistant", "content": "4", "reasoning": "Add them."},
    {"role": "assistant", "content": "4", "thinking": "Add them."},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "assistant", "content": "  <think>Add them.</think>4"},
    {"role": "assistant", "content": [{"type": "text", "text": "<think>Add them.</think>"}, {"type": "text", "text": "4"}]},
])
def test_every_shape_of_reasoning_becomes_one_field(assistant):
    conversation = normalize(chat(USER, assistant), "openai")
    assert conversation.messages[1] == {"role": "assistant", "content": "4", **fields("Add them.")}
    sharegpt = {"from": "gpt", **{k: v for k, v in assistant.items() if k not in ("role", "content")},
                "value": assistant["content"] if isinstance(assistant["content"], str) else "<think>Add them.</think>4"}
    turns = normalize({"conversations": [{"from": "human", "value": "q"}, sharegpt]}, "sharegpt").messages
    assert turns[1] == {"role": "assistant", "content": "4", **fields("Add them.")}


@pytest.mark.parametrize("content", ["4", "<think></think>4", "<think>\n\n</think>\n\n4", "I <think> so</think>", "<think>open"])
def test_content_without_reasoning_is_left_as_it_is(content):
    assistant = {"role": "assistant", "content": content, "reasoning_content": "", "thinking": None}
    assert normalize(chat(USER, assistant), "openai").messages[1] == {"role": "assistant", "content": content}


def test_reasoning_that_is_not_text_is_rejected():
    with pytest.raises(Rejected, match="message 1 'reasoning' is not a string"):
        normalize(chat(USER, {"role": "assistant", "content": "4", "reasoning": ["a"]}), "openai")


def record_with_reasoning() -> dict:
    return chat(USER, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "<think>Add again.</think>6"})


def fields(reasoning: str) -> dict:
    return {"reasoning_content": reasoning, "thinking": reasoning, "reasoning": reasoning}


@pytest.mark.parametrize("fields_read, policy, expected, trained, counted", [
    # under every name, as transformers passes it: the template reads its own
    (("reasoning_content",), "inline", [{"content": "4", **fields("Add.")}, {"content": "6", **fields("Add again.")}], {}, {}),
    (("thinking",), "inline", [{"content": "4", **fields("Add.")}, {"content": "6", **fields("Add again.")}], {}, {}),
    # no field read: the history as given (an inline block stays where the record wrote it); reasoning given
    # apart is written inline into the turn's trained form only, never into the context of later turns
    ((), "inline", [{"content": "4", **fields("Add.")}, {"content": "<think>Add again.</think>6"}],
     {1: "<think>\nAdd.\n</think>\n\n4"}, {}),
    ((), "drop", [{"content": "4"}, {"content": "6"}], {}, {"reasoning_dropped": 2}),
])
def test_reasoning_goes_where_the_template_reads_it_or_is_counted(fields_read, policy, expected, trained, counted):
    conversation = normalize(record_with_reasoning(), "openai",
                             policy=Policy(reasoning=policy, reasoning_fields=fields_read))
    assert [{k: v for k, v in m.items() if k != "role"} for m in conversation.messages[1::2]] == expected
    assert {k: m["content"] for k, m in conversation.trained.items()} == trained
    assert conversation.changes == counted


def test_reasoning_reject_names_the_message_and_the_options():
    with pytest.raises(Rejected, match="assistant message 1 has reasoning.*--reasoning inline") as caught:
        normalize(record_with_reasoning(), "openai", policy=Policy(reasoning="reject", reasoning_fields=()))
    assert caught.value.code == "reasoning_not_rendered"


def test_merged_turns_keep_both_reasonings():
    record = chat(USER, {"role": "assistant", "content": "a", "reasoning_content": "r1"},
                  {"role": "assistant", "content": "b", "reasoning_content": "r2"})
    merged = normalize(record, "openai", policy=Policy(consecutive="merge")).messages[1]
    assert merged == {"role": "assistant", "content": "a\n\nb", **fields("r1\n\nr2")}


CALLS = [{"id": "CallOne01", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
         {"id": "CallTwo02", "type": "function", "function": {"name": "time", "arguments": {"city": "Paris"}}}]


@pytest.mark.parametrize("content, arguments, text, expected_content, shaped", [
    ("empty", "object", None, "", [{"city": "Paris"}, {"city": "Paris"}]),
    ("empty", "object", "Checking.", "Checking.", [{"city": "Paris"}, {"city": "Paris"}]),
    ("none", "string", None, None, ['{"city": "Paris"}', '{"city": "Paris"}']),
    ("none", "object", "Checking.", None, [{"city": "Paris"}, {"city": "Paris"}]),
])
def test_tool_calls_take_the_shape_the_template_reads(content, arguments, text, expected_content, shaped):
    record = chat(USER, {"role": "assistant", "content": text, "tool_calls": CALLS},
                  {"role": "tool", "tool_call_id": "CallOne01", "content": "sunny"},
                  {"role": "tool", "tool_call_id": "CallTwo02", "content": "noon"}, {"role": "assistant", "content": "ok"})
    conversation = normalize(record, "openai", policy=Policy(call_content=content, call_arguments=arguments))
    calls = conversation.messages[1]
    assert calls["content"] == expected_content
    assert [c["function"]["arguments"] for c in calls["tool_calls"]] == shaped
    assert [c["id"] for c in calls["tool_calls"]] == ["CallOne01", "CallTwo02"]
    assert conversation.changes == ({"tool_call_text_dropped": 1} if content == "none" and text else {})


def test_record_kwargs_are_kept_and_counted():
    conversation = normalize(chat(USER, {"role": "assistant", "content": "4"},
                                  chat_template_kwargs={"enable_thinking": False}), "openai")
    assert conversation.template_kwargs == {"enable_thinking": False}
    assert conversation.changes == {"template_kwargs": 1}


# ---------------------------------------------------------------------------------------------
# the real templates
# ---------------------------------------------------------------------------------------------

# (system, tool_calls, tool_results, call_content, call_arguments, reasoning fields, own roles) found by probing
OWN = ("developer", "ipython", "function")
DECIDED = {
    "qwen3": ("keep", "native", "tool", "empty", "object", ("reasoning_content",), OWN),
    "qwq": ("keep", "native", "tool", "empty", "object", (), OWN),
    "deepseek-r1-distill-qwen": ("keep", "native", "tool", "none", "string", (), OWN),
    "phi-3.5-mini": ("keep", "text", "user", "empty", "object", (), OWN),
    "mistral-v3": ("keep", "native", "tool", "null", "object", (), ()),
    "llama-3.1": ("keep", "native", "tool", "null", "object", (), OWN),  # every template but Mistral's takes them
    "llama-3.2": ("keep", "native", "tool", "null", "object", (), OWN),
}

RECORDS = [
    record_with_reasoning(),
    chat(USER, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
         {"role": "tool", "tool_call_id": "CallOne01", "content": "sunny"},
         {"role": "assistant", "content": [{"type": "text", "text": "It is "}, {"type": "text", "text": "sunny."}]},
         tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]),
    chat(USER, {"role": "assistant", "content": "", "tool_calls": CALLS},
         {"role": "tool", "tool_call_id": "CallOne01", "content": "sunny"}, {"role": "tool", "tool_call_id": "CallTwo02", "content": "noon"},
         {"role": "assistant", "content": "Sunny at noon.", "reasoning_content": "Both tools answered."}),
]


def reference(tokenizer, conversation) -> str:
    """transformers' rendering of the fitted conversation: ``apply_chat_template``, or, for a message
    that holds a None (DeepSeek-R1's tool calls), the ``render_jinja_template`` it calls: transformers 5
    drops None-valued keys before rendering, and DeepSeek-R1's template then fails on every tool call
    (it renders calls only when ``content`` is None, as transformers 4 passed it)."""
    if not any(value is None for message in conversation.messages for value in message.values()):
        return tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=False,
                                             **template_variables())
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(conversations=[conversation.messages], tools=conversation.tools,
                                     chat_template=tokenizer.chat_template, **tokenizer.special_tokens_map,
                                     **template_variables())
    return texts[0]


@needs_fixtures
@pytest.mark.parametrize("name", slow_but({"phi-3.5-mini", "mistral-v3"}, sorted(DECIDED)))
def test_each_template_gets_what_it_reads_and_renders_as_transformers_does(name, template_folder):
    ours, theirs = load_tokenizer(template_folder(name)), load_tokenizer(template_folder(name), transformers=True)
    template = ChatTemplate(ours)
    policy = fit_to_template(template.render)
    assert (policy.system, policy.tool_calls, policy.tool_results, policy.call_content, policy.call_arguments,
            policy.reasoning_fields, policy.roles) == DECIDED[name]
    rendered = 0
    for record in RECORDS:
        conversation = normalize(record, "openai", policy=policy)
        try:
            expected = reference(theirs, conversation)
        except Exception:  # the template's own refusal (Llama-3.x: one tool call at a time): packprep's too
            with pytest.raises(Rejected):
                template.render(conversation.messages, conversation.tools)
            continue
        text = template.render(conversation.messages, conversation.tools)
        assert text == expected
        rendered += 1
        if policy.tool_calls == "native" and "tool_calls" in json.dumps(record):
            assert "weather" in text and "Paris" in text  # the call itself, not dropped
        if not policy.reasoning_fields and record is RECORDS[0]:  # no place for it: inline in the trained turn only
            assert [m["content"] for m in conversation.trained.values()] == ["<think>\nAdd.\n</think>\n\n4"]
    assert rendered >= 2


@needs_fixtures
def test_deepseek_renders_tool_calls_only_because_content_stays_none(template_folder):
    template = ChatTemplate(load_tokenizer(template_folder("deepseek-r1-distill-qwen")))
    policy = fit_to_template(template.render)
    fitted = normalize(RECORDS[1], "openai", policy=policy).messages
    assert fitted[1]["content"] is None and fitted[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Paris\"}\n```" in template.render(
        fitted, None)
    as_before = [dict(m, content="") if m.get("tool_calls") else m for m in fitted]  # what packprep did before
    assert "weather" not in template.render(as_before, None)


@needs_fixtures
def test_a_template_that_reads_thinking_gets_it_there(template_folder):
    tok = load_tokenizer(template_folder("qwen3"))
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{% if m.thinking %}[{{ m.thinking }}]{% endif %}"
                         "{{ m.content }}{% endfor %}")  # reads reasoning as gpt-oss's template does
    template = ChatTemplate(tok)
    policy = fit_to_template(template.render)
    assert policy.reasoning_fields == ("thinking",)
    conversation = normalize(record_with_reasoning(), "openai", policy=policy)
    assert template.render(conversation.messages, None) == (
        "<|user|>What is 2+2?<|assistant|>[Add.]4<|user|>And 3+3?<|assistant|>[Add again.]6")
    assert conversation.changes == {}


@needs_fixtures
@pytest.mark.parametrize("policy, line", slow_but({("drop", "2 assistant turns' reasoning in no trained token")},
                                                  [("inline", "1 trained turns' reasoning written inline"),
                                                   ("drop", "2 assistant turns' reasoning in no trained token")]))
def test_stats_and_pack_count_every_turn_whose_reasoning_has_no_place(policy, line, template_folder, tmp_path):
    from click.testing import CliRunner

    from packprep.cli import main

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(record_with_reasoning()) + "\n")
    folder = template_folder("llama-3.2")
    stats = CliRunner().invoke(main, ["stats", str(chats), "-t", folder, "--reasoning", policy, "--json", "-q"])
    assert stats.exit_code == 0, stats.output
    # inline: the reasoning given apart is written into the trained turn, the <think> block the record wrote
    # into its content is trained as the template renders it; each counted once, as the shards hold it
    counted = {"inline": {"reasoning_inlined": 1, "reasoning_trained": 1}, "drop": {"reasoning_dropped": 2}}[policy]
    normalized = json.loads(stats.stdout)["normalized"]
    assert {k: v for k, v in normalized.items() if k.startswith("reasoning") and v} == counted
    pack = CliRunner().invoke(main, ["pack", str(chats), "-t", folder, "--reasoning", policy, "-o", str(tmp_path / "o"),
                                     "-q", "--num-proc", "1", "--max-len", "512"])
    assert pack.exit_code == 0, pack.output
    assert line in pack.output
    manifest = json.loads((tmp_path / "o" / "packprep.json").read_text())
    assert manifest["config"]["reasoning"] == policy
    reject = CliRunner().invoke(main, ["pack", str(chats), "-t", folder, "--reasoning", "reject", "-o",
                                       str(tmp_path / "r"), "-q"])
    assert reject.exit_code != 0 and "reasoning_not_rendered" in reject.output
