"""The data shapes of the template zoo: synthetic but realistic records, in the forms users' files have.

Each shape is a list of records as a line of a user's JSONL file would hold them (OpenAI ``messages``
or ShareGPT ``conversations``). The texts vary per record (a seeded choice among realistic replies),
so that a shape covers replies that start with a space, a newline, a digit, code, or CJK text.
``fixtures`` takes records from the fixture files (../shared/fixtures/conversations) as they are.
"""

from __future__ import annotations

import json
import random

from .conftest import CONVERSATIONS

QUESTIONS = ["What is the capital of France?", "Can you explain recursion briefly?", "2+2?",
             "Write a haiku about the sea.", "How do I reverse a list in Python?", "翻译成英文：你好，世界",
             "Summarize: the cat sat on the mat.", "Is 17 prime?", "List three colors.", "Why is the sky blue?"]
ANSWERS = ["The capital of France is Paris.", "Recursion is when a function calls itself on a smaller input.",
           "4", "Waves fold on the shore,\nsalt wind carries gull voices,\nthe tide keeps its time.",
           "Use `reversed(xs)` or `xs[::-1]`:\n\n```python\nxs = [1, 2, 3]\nprint(xs[::-1])\n```",
           "Hello, world", " A cat sat on a mat.", "Yes, 17 is prime: it has no divisor but 1 and itself.",
           "Red, green and blue.", "Because air scatters blue light more than red light (Rayleigh scattering)."]
THOUGHTS = ["The user asks a factual question. I recall the answer and state it plainly.",
            "Let me think step by step.\nFirst, restate the problem.\nThen answer it briefly.",
            "Simple arithmetic: 2 plus 2 is 4.", "I should check each divisor up to the square root: 2, 3 — none divides."]
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence.",
           "Always answer in English."]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer"}}, "required": ["query"]}}},
]
CITIES = ["Paris", "Tokyo", "São Paulo", "Nairobi"]


def _pairs(rng, n):
    picks = rng.sample(range(len(QUESTIONS)), n)
    return [(QUESTIONS[i], ANSWERS[i]) for i in picks]


def _chat(rng, turns=3):
    out = []
    for q, a in _pairs(rng, turns):
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return out


def exchanges(turns: int) -> list[dict]:
    """A system prompt and ``turns`` exchanges of short chat, each text a little different: the
    conversation that rendering work is measured on as it grows (tests/test_render_work.py,
    benchmarks/onepass_census.py)."""
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: " + "why? " * (i % 5 + 1)},
                     {"role": "assistant", "content": f"Answer {i}. " + "Because. " * (i % 7 + 1)}]
    return messages


def _call(rng, n, as_string):
    city = CITIES[n % len(CITIES)]
    args = {"city": city, "unit": "celsius"} if n % 2 == 0 else {"query": f"news {city}", "max_results": 3}
    name = "get_weather" if n % 2 == 0 else "search"
    # ids of 9 letters or digits, which every template (Mistral's included) takes
    return {"id": f"call{n:05d}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, separators=(",", ":")) if as_string else args}}


def _result(call, text_parts=False):
    text = json.dumps({"city": "Paris", "temperature": 21} if call["function"]["name"] == "get_weather"
                      else {"results": ["a", "b"]})
    content = [{"type": "text", "text": text}] if text_parts else text
    return {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": content}


def _tool_use(rng, i, as_string=True, parallel=False, text_parts=False, end_in_call=False):
    calls = [_call(rng, i, as_string)] + ([_call(rng, i + 1, as_string)] if parallel else [])
    messages = [{"role": "user", "content": f"What's the weather in {CITIES[i % 4]}, and any news?"},
                {"role": "assistant", "content": None if i % 2 == 0 else "", "tool_calls": calls}]
    if end_in_call:
        return {"messages": messages, "tools": TOOLS}
    messages += [_result(c, text_parts) for c in calls]
    messages += [{"role": "assistant", "content": "It is 21 °C in Paris right now."}]
    messages += _chat(rng, 1)
    return {"messages": messages, "tools": TOOLS}


def _reasoning(rng, field):
    messages = _chat(rng, 2)
    for m in messages:
        if m["role"] == "assistant":
            thought = rng.choice(THOUGHTS)
            if field == "inline":
                m["content"] = f"<think>\n{thought}\n</think>\n\n{m['content']}"
            else:
                m[field] = thought
    return {"messages": messages}


def _sharegpt(messages):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}


def _fixture_records(per_file):
    out = []
    for name in ("llamafactory_glaive_toolcall_en_demo.json", "fastchat_dummy_conversation.json",
                 "medicalgpt_sharegpt_zh_1K_format.jsonl"):
        path = CONVERSATIONS / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        records = json.loads(text) if name.endswith(".json") else [json.loads(line) for line in text.splitlines()
                                                                    if line.strip()]
        out += records[:per_file]
    return out


SHAPES = {  # name -> (records) given a seeded rng and the record index
    "chat": lambda rng, i: {"messages": _chat(rng)},
    "system": lambda rng, i: {"messages": [{"role": "system", "content": SYSTEMS[i % 3]}] + _chat(rng)},
    "sharegpt": lambda rng, i: _sharegpt(([{"role": "system", "content": SYSTEMS[i % 3]}] if i % 2 else [])
                                         + _chat(rng)),
    "developer": lambda rng, i: {"messages": [{"role": "developer", "content": SYSTEMS[i % 3]}] + _chat(rng, 2)},
    "reasoning_content": lambda rng, i: _reasoning(rng, "reasoning_content"),
    "reasoning": lambda rng, i: _reasoning(rng, "reasoning"),
    "thinking": lambda rng, i: _reasoning(rng, "thinking"),
    "think_inline": lambda rng, i: _reasoning(rng, "inline"),
    "tools_str": lambda rng, i: _tool_use(rng, i, as_string=True),
    "tools_dict": lambda rng, i: _tool_use(rng, i, as_string=False),
    "tools_parallel": lambda rng, i: _tool_use(rng, i, as_string=False, parallel=True),
    "tool_text_parts": lambda rng, i: _tool_use(rng, i, as_string=False, text_parts=True),
    "ends_in_tool_call": lambda rng, i: _tool_use(rng, i, as_string=False, end_in_call=True),
}


def shape_records(shape: str, count: int = 6, seed: int = 0) -> list[dict]:
    """``count`` records of ``shape`` (the fixture files' first ``count`` records each for ``fixtures``)."""
    if shape == "fixtures":
        return _fixture_records(count)
    rng = random.Random(f"{shape}-{seed}")
    return [SHAPES[shape](rng, i) for i in range(count)]


SHAPE_NAMES = list(SHAPES) + ["fixtures"]
