"""Regenerate the bad-input corpus: ``python tests/bad_inputs/_generate.py``.

One small file per case; ``EXPECTED.json`` beside it says what packprep must do with each. The
binary cases (gzip, zstd, Parquet, invalid UTF-8) are easier to rebuild than to edit, hence this
script; the files it writes are committed, so the tests never need to run it.
"""

from __future__ import annotations

import gzip
import io
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def turn(speaker: str, value) -> dict:
    return {"from": speaker, "value": value}


def good(i: int = 0) -> dict:
    return {"conversations": [turn("human", f"What is {i} plus {i}?"), turn("gpt", f"{i} plus {i} is {2 * i}.")]}


def line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def lines(*objs) -> str:
    return "".join((o if isinstance(o, str) else line(o)) + "\n" for o in objs)


def write(name: str, content) -> None:
    path = HERE / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)


def main() -> None:
    rng = random.Random(9)

    # ---- file-level: the whole file cannot be used ----
    whole = json.dumps([good(1), good(2), good(3)], indent=1)
    write("truncated_array.json", whole[: whole.index('"value": "2 plus') + 12])
    write("binary_garbage.jsonl", bytes(rng.randrange(256) for _ in range(2048)))
    write("binary_garbage.json", b"\x89PNG\r\n\x1a\n" + bytes(rng.randrange(256) for _ in range(512)))
    write("object_without_records.json", json.dumps({"data": [good(1), good(2)], "version": 2}))
    write("json_scalar.json", "42\n")
    write("empty.jsonl", b"")
    write("empty.json", b"")
    write("whitespace_only.jsonl", " \n\n\t  \r\n   \n")
    write("empty_array.json", "[]\n")
    write("jsonl_named_json.json", lines(good(1), good(2)))
    write("deeply_nested.json", "[" * 25_000 + "]" * 25_000)
    write("all_lines_broken.jsonl", lines("{not json", "{\"conversations\": [", "conversations"))
    write("unknown_extension.txt", lines(good(1)))
    write("jsonl_not_gzip.jsonl.gz", lines(good(1)))

    data = lines(*[good(i) for i in range(200)]).encode()
    compressed = gzip.compress(data, mtime=0)
    write("truncated.jsonl.gz", compressed[: len(compressed) // 2])
    import zstandard

    compressed = zstandard.ZstdCompressor().compress(data)
    write("truncated.jsonl.zst", compressed[: len(compressed) // 2])

    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet_bytes(table: pa.Table) -> bytes:
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="none")
        return sink.getvalue()

    write("utf16.jsonl", lines(good(1)).encode("utf-16"))
    write("parquet_wrong_columns.parquet",
          parquet_bytes(pa.table({"id": [1, 2, 3], "body": ["hello", "there", "world"]})))
    ok = parquet_bytes(pa.table({"text": [f"row {i} " * 20 for i in range(50)]}))
    write("parquet_cut_off.parquet", ok[: len(ok) // 2])
    # A valid footer over a data page whose bytes are overwritten: opens, then fails mid-read.
    page = bytearray(ok)
    start = 4  # after the PAR1 magic
    page[start : start + 200] = bytes(rng.randrange(256) for _ in range(200))
    write("parquet_corrupt_page.parquet", bytes(page))
    write("arrow_garbage.arrow", b"ARROW1\x00\x00" + bytes(rng.randrange(256) for _ in range(256)))

    # ---- record-level: the file is fine, some records are not ----
    write("broken_jsonl_lines.jsonl", lines(good(1), '{"conversations": [{"from": "human", "value": "cut', good(2),
                                             "{'conversations': []}"))
    write("blank_lines.jsonl", "\n" + lines(good(1)) + "\n\n" + lines(good(2), "not json at all"))
    write("invalid_utf8.jsonl", lines(good(1)).encode() + b'{"conversations": [{"from": "human", "value": "caf\xe9 \xff\xfe"}]}\n'
          + lines(good(2)).encode())
    write("empty_conversations.jsonl", lines(good(1), {"conversations": []}, {"conversations": [], "system": "be nice"}))
    write("unknown_roles.jsonl", lines(
        good(1),
        {"conversations": [turn("narrator", "Once upon a time"), turn("gpt", "Hi")]},
        {"conversations": [turn("human", "Hi"), turn("GPT", "Hello")]},
    ))
    write("non_string_content.jsonl", lines(
        good(1),
        {"conversations": [turn("human", 42), turn("gpt", "A number?")]},
        {"conversations": [turn("human", "List?"), turn("gpt", ["a", "b"])]},
        {"conversations": [turn("human", {"text": "hi"}), turn("gpt", "An object?")]},
        {"conversations": [turn("human", True), turn("gpt", "A boolean?")]},
        '{"conversations": [{"from": "human", "value": NaN}, {"from": "gpt", "value": "NaN?"}]}',
    ))
    write("null_content.jsonl", lines(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "Hello"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
        {"conversations": [turn("human", None), turn("gpt", "x")]},
    ))
    write("openai_image_parts.jsonl", lines(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]},
                      {"role": "assistant", "content": "Text parts are joined."}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                      {"role": "assistant", "content": "A cat."}]},
    ))
    write("starts_with_assistant.jsonl", lines(
        {"conversations": [turn("gpt", "How can I help?"), turn("human", "Add 2 and 2."), turn("gpt", "4.")]},
        good(1),
    ))
    monster = {"conversations": [turn("human" if k % 2 == 0 else "gpt", f"Turn {k}: " + "word " * 5) for k in range(300)]}
    write("monster_300_turns.jsonl", lines(monster, good(1)))
    write("long_prompt.jsonl", lines(
        {"conversations": [turn("human", "blah " * 2000), turn("gpt", "Too long to learn from.")]}, good(1)
    ))
    write("not_objects.jsonl", lines(good(1), [1, 2], '"just a string"', 7, "null", True, "{broken"))
    write("array_of_non_objects.json", json.dumps([good(1), 1, "text", None, [good(2)], good(3)]))
    write("missing_from_value.jsonl", lines(
        good(1),
        {"conversations": [{"value": "who said this?"}, turn("gpt", "Nobody.")]},
        {"conversations": [{"from": "human"}, turn("gpt", "No value.")]},
        {"conversations": [turn("human", "Hi"), "not a turn"]},
        {"chat": [turn("human", "Hi"), turn("gpt", "wrong key")]},
    ))
    write("tools_not_json.jsonl", lines(
        good(1),
        {**good(2), "tools": "{not: json"},
        {**good(3), "tools": {"name": "calc"}},
        {**good(4), "tools": json.dumps([{"type": "function", "function": {"name": "calc"}}])},
    ))
    write("system_only.jsonl", lines(
        good(1),
        {"conversations": [turn("system", "You are terse.")]},
        {"conversations": [turn("system", "You are terse."), turn("human", "Hi?")]},
    ))
    write("text_empty.jsonl", lines({"text": "A plain text sample."}, {"text": ""}, {"text": "   \n  "}, {"text": None}))
    write("mixed_formats.jsonl", lines(
        good(1),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"instruction": "Say hi", "output": "Hi"},
        {"text": "plain"},
        good(2),
    ))
    write("bom.jsonl", b"\xef\xbb\xbf" + lines(good(1), good(2)).encode())
    write("bom.json", b"\xef\xbb\xbf" + json.dumps([good(1), good(2)]).encode())
    write("crlf.jsonl", lines(good(1), good(2), good(3)).replace("\n", "\r\n"))
    write("crlf_broken.jsonl", (lines(good(1), "{broken", good(2))).replace("\n", "\r\n"))
    write("object_single_record.json", json.dumps(good(7), indent=2))
    write("conversations_as_string.jsonl", lines(
        {"conversations": json.dumps(good(1)["conversations"])},
        {"conversations": "[{not json"},
        {"conversations": {"from": "human", "value": "an object, not a list"}},
    ))
    write("huge_number.jsonl", lines(good(1), '{"conversations": [], "id": ' + "9" * 5000 + "}", good(2)))
    write("deep_line.jsonl", lines(good(1), "[" * 25_000 + "]" * 25_000, good(2)))
    write("lone_surrogate.jsonl", lines(
        good(1), '{"conversations": [{"from": "human", "value": "bad \\ud800 half"}, {"from": "gpt", "value": "ok"}]}'
    ))
    write("alpaca_bad_fields.jsonl", lines(
        {"instruction": "Say hi", "input": "", "output": "Hi"},
        {"instruction": "Say hi", "output": None},
        {"instruction": ["list"], "output": "Hi"},
    ))


if __name__ == "__main__":
    main()
