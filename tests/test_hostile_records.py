"""Hostile data beyond single files: JSON nested thousands deep inside a record's strings or an option,
numbers longer than Python reads, reasoning given under several names, and templates that build
gigabytes without writing them. Each ends in a counted rejection or a one-line error, never an
internal one."""

from __future__ import annotations

import json

import pytest

import packprep
from packprep.json_limits import MAX_DEPTH
from packprep.tokenizer_folder import RenderTooLong, compile_template, faster_sandbox

from .test_bad_inputs import assert_clean_exit, assert_nothing_left, invoke, pack_args, read_rejects
from .test_hostile_inputs import chats, tokenizer_template

DEEP = "[" * 10_000 + "]" * 10_000
LONG = "1" * 5_001
USER = {"role": "user", "content": "hi"}


def call(arguments) -> dict:
    return {"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": arguments}}]}, {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "ok"}]}


def function_call(value: str) -> dict:
    return {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": value},
                              {"from": "observation", "value": "r"}, {"from": "gpt", "value": "ok"}]}


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


RECORDS = {  # a record's field holding JSON text or a value past the bounds -> the rejection's code
    "arguments string 10,000 deep": (call(DEEP), "nested_too_deep"),
    "arguments string 500 deep, readable": (call(nested(500)), "nested_too_deep"),
    "arguments string with a 5,001-digit number": (call('{"a": ' + LONG + "}"), "number_too_long"),
    "function_call 5,000 deep": (function_call('{"name": "f", "arguments": ' + nested(5_000) + "}"), "nested_too_deep"),
    "function_call with a 5,001-digit number": (function_call('{"name": "f", "arguments": {"a": ' + LONG + "}}"),
                                                "number_too_long"),
    "messages as a string 10,000 deep": ({"messages": DEEP}, "nested_too_deep"),
    "tools as a string 10,000 deep": ({"messages": [USER, {"role": "assistant", "content": "ok"}], "tools": DEEP},
                                      "nested_too_deep"),
}


def write_lines(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_json_nested_too_deep_or_too_long_inside_a_record_is_a_counted_rejection(tmp_path, name):
    record, code = RECORDS[name]
    good = json.dumps({"messages": [USER, {"role": "assistant", "content": "fine"}]})
    data = write_lines(tmp_path / "chats.jsonl", [good, json.dumps(record), good])
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(data, out)), 0)
    [reject] = read_rejects(out)
    assert (reject["line"], reject["code"]) == (2, code), reject
    assert ("more than 100 deep" if code == "nested_too_deep" else "more than 4,300 digits") in reject["reason"]
    assert packprep.verify(out).ok


@pytest.mark.parametrize("depth, code", [(MAX_DEPTH - 20, None), (MAX_DEPTH + 1, "nested_too_deep"),
                                         (900, "nested_too_deep")])
def test_a_record_nested_deep_as_objects_is_packed_or_rejected_by_the_same_bound(tmp_path, depth, code):
    """Arguments given as an object nested past the bound (readable by the JSON reader, deeper than
    the walkers after it take) are rejected as the same text in a string is."""
    head = json.dumps(call({}))
    text = head.replace('"arguments": {}', '"arguments": ' + nested(depth))
    data = write_lines(tmp_path / "chats.jsonl", [json.dumps({"messages": [USER, {"role": "assistant", "content": "x"}]}),
                                                  text])
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(data, out)), 0)
    assert [r["code"] for r in read_rejects(out)] == ([code] if code else [])


@pytest.mark.parametrize("value, message", [
    (DEEP[:10_000 // 2] + DEEP[-10_000 // 2:], "--template-arg x nests arrays and objects more than 100 deep"),
    (nested(MAX_DEPTH + 1), "--template-arg x nests arrays and objects more than 100 deep"),
    (LONG, "--template-arg x holds a number of more than 4,300 digits"),
])
def test_a_template_arg_too_deep_or_too_long_is_a_clear_error(tmp_path, value, message):
    out = tmp_path / "out"
    result = invoke(*pack_args(chats(tmp_path, "hi"), out, "--template-arg", f"x={value}"))
    assert_clean_exit(result, 2)
    assert message in result.output
    assert_nothing_left(tmp_path, out)


def test_reasoning_under_several_names_keeps_the_first_and_counts_the_others(tmp_path):
    """reasoning_content, reasoning and thinking all given, all different: reasoning_content is trained,
    the turn counted in reasoning_spellings_dropped (the same texts are no loss: not counted)."""
    turn = {"role": "assistant", "content": "ok", "reasoning_content": "FIRST", "reasoning": "SECOND", "thinking": "THIRD"}
    same = {"role": "assistant", "content": "ok", "reasoning_content": "SAME", "reasoning": "SAME"}
    data = write_lines(tmp_path / "chats.jsonl", [json.dumps({"messages": [USER, turn]}),
                                                  json.dumps({"messages": [USER, same]})])
    out = tmp_path / "out"
    result = invoke(*pack_args(data, out))
    assert_clean_exit(result, 0)
    normalized = json.loads((out / "packprep.json").read_text())["counts"]["normalized"]
    assert normalized["reasoning_spellings_dropped"] == 1 and normalized["reasoning_inlined"] == 2
    assert "1 assistant turns gave reasoning under several names with other texts" in " ".join(result.output.split())
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from .conftest import EXAMPLE_TOKENIZER

    text = Tokenizer.from_file(str(EXAMPLE_TOKENIZER / "tokenizer.json")).decode(
        pq.read_table(next((out / "data").glob("*.parquet"))).column("input_ids").to_pylist()[0])
    assert "FIRST" in text and "SECOND" not in text and "THIRD" not in text


HOSTILE_TEMPLATES = {  # each builds over 67M characters (or digits' worth of bytes) without writing them
    "a string doubled in a namespace": "{% set ns = namespace(s='x') %}{% for i in range(27) %}"
                                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a string doubled with ~": "{% set ns = namespace(s='x') %}{% for i in range(27) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}",
    "a list doubled": "{% set ns = namespace(s=[1]) %}{% for i in range(27) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "center(10**10)": "{% set s = 'x' | center(10**10) %}",
    "str.center": "{% set s = 'x'.center(10**10) %}",
    "ljust": "{% set s = 'x'.ljust(10**10) %}",
    "a list times 10**9": "{% set s = [1] * 10**9 %}",
    "a %-format width": "{% set s = '%10000000000s' % 'x' %}",
    "a format width": "{% set s = '{:10000000000}'.format('x') %}",
    "the format filter": "{% set s = '%10000000000s' | format('x') %}",
    "replace": "{% set s = ('x' * 100000) | replace('x', 'y' * 100000) %}",
    "str.replace": "{% set s = ('x' * 100000).replace('x', 'y' * 100000) %}",
    "indent": "{% set s = ('\\n' * 100000) | indent(100000) %}",
    "a power": "{% set s = 10 ** (10 ** 9) %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_template_that_builds_gigabytes_unwritten_is_stopped(name):
    """The size limit holds for what a template builds, not only for what it writes: each is refused
    before it is made (the old limit let a doubled string reach 4 GB in 2 s)."""
    template = faster_sandbox(compile_template(HOSTILE_TEMPLATES[name] + "ok"))
    with pytest.raises(RenderTooLong):
        template.render(messages=[USER])


def test_the_bounds_leave_ordinary_template_work_as_it_was():
    source = ("{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s + m.content ~ '|' %}"
              "{{ m.content | center(8) }}{{ '%-4s' % m.role }}{{ '{:>3}'.format(loop.index) }}{% endfor %}"
              "{{ ns.s | replace('|', ',') | indent(2) }}{{ 2 ** 10 }}{{ (['a'] * 2) | join }}{{ [1] + [2] }}")
    text = faster_sandbox(compile_template(source)).render(messages=[USER, {"role": "assistant", "content": "ok"}])
    assert text == "   hi   user  1   ok   assistant  2hi,ok,1024aa[1, 2]"


def test_a_record_whose_template_builds_gigabytes_is_rejected_and_the_rest_kept(tmp_path):
    tok = tokenizer_template(tmp_path, "{% if boom is defined %}" + HOSTILE_TEMPLATES["a string doubled in a namespace"]
                             + "{% endif %}")
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}
    data = write_lines(tmp_path / "chats.jsonl", [json.dumps(r) for r in (row, {**row, "chat_template_kwargs":
                                                                              {"boom": 1}}, row)])
    out = tmp_path / "out"
    assert_clean_exit(invoke(*pack_args(data, out, "-t", tok)), 0)
    [reject] = read_rejects(out)
    assert (reject["line"], reject["code"]) == (2, "render_too_long")
    assert packprep.verify(out).ok


@pytest.mark.parametrize("damage, message", [
    ("deep config", "cannot load tokenizer"),
    ("broken tokenizer.json", "its tokenizer.json cannot be read"),
])
def test_a_tokenizer_folder_that_cannot_be_read_is_a_clear_error(tmp_path, damage, message):
    tok = tokenizer_template(tmp_path)
    if damage == "deep config":
        config = (tok / "tokenizer_config.json").read_text()
        (tok / "tokenizer_config.json").write_text(config.rstrip()[:-1] + ', "extra": ' + DEEP + "}")
    else:
        (tok / "tokenizer.json").write_text((tok / "tokenizer.json").read_text()[:-50])
    out = tmp_path / "out"
    result = invoke(*pack_args(chats(tmp_path, "hi"), out, "-t", tok))
    assert_clean_exit(result, 2)
    assert message in result.output
    assert_nothing_left(tmp_path, out)
