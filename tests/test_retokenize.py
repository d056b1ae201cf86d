"""``verify --retokenize N``: passes on real data with real tokenizers, and catches what the row
checks cannot: labels shifted by one token, still equal to their input ids."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_VERIFY, ConfigError
from packprep.read import file_sha256

from .conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures
from .test_labels_reference import FILES

TOKENIZERS = ["llama3", "qwen2.5", "mistral-7b-v0.1", "llama2", "gpt2"]
# each file packed a different way, so that whole, truncated and cut sequences are all checked
SETTINGS = {
    "fastchat_dummy_conversation.json": {"max_len": 1024},
    "llamafactory_dpo_en_demo.json": {"max_len": 512, "overlong": "split", "preference": "chosen"},
    "llamafactory_glaive_toolcall_en_demo.json": {"max_len": 1024, "strategy": "bfd"},
    "llamafactory_kto_en_demo.json": {"max_len": 256, "overlong": "truncate"},
    "medicalgpt_sharegpt_zh_1K_format.jsonl": {"max_len": 2048, "strategy": "random", "overlong": "split"},
}


@needs_fixtures
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_every_fixture_file_with_every_tokenizer_retokenizes_equal(tmp_path, tokenizer, name):
    out = tmp_path / "out"
    packprep.pack(str(CONVERSATIONS / name), str(out), fixture_tokenizer(tokenizer), num_proc=1, **SETTINGS[name])
    report = packprep.verify(out, retokenize=200)
    assert report.ok, [str(f) for f in report.failures[:3]]
    assert report.retokenized == min(200, report.sequences)


def shift_labels_by_one(folder):
    """Move every sequence's trained positions one token later: labels still equal their input ids
    or -100 and every first label stays -100, so only a check against the inputs can tell."""
    manifest = json.loads((folder / "packprep.json").read_text())
    supervised = 0
    for shard in manifest["shards"]:
        path = folder / shard["path"]
        table = pq.read_table(path)
        labels = []
        for ids, old, lens in zip(*(table.column(c).to_pylist() for c in ("input_ids", "labels", "seq_lens"))):
            new, start = [], 0
            for n in lens:
                trained = [label != -100 for label in old[start : start + n]]
                shifted = [False, *trained[:-1]]
                new += [t if keep and k else -100 for k, (t, keep) in enumerate(zip(ids[start : start + n], shifted))]
                start += n
            labels.append(new)
        table = table.set_column(table.schema.get_field_index("labels"), table.schema.field("labels"),
                                 pa.array(labels, table.schema.field("labels").type))
        pq.write_table(table, path, compression="zstd", use_dictionary=False, write_statistics=False)
        shard["supervised_tokens"] = sum(label != -100 for row in labels for label in row)
        shard["sha256"] = file_sha256(path)
        supervised += shard["supervised_tokens"]
    manifest["tokens"]["supervised"] = supervised
    (folder / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")


def test_labels_shifted_by_one_pass_the_row_checks_and_fail_retokenize(tmp_path):
    out = tmp_path / "out"
    packprep.pack(str(EXAMPLE_CHATS), str(out), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    assert packprep.verify(out, retokenize=200).ok
    shift_labels_by_one(out)
    assert packprep.verify(out).ok, "the row checks cannot see a shift"
    report = packprep.verify(out, retokenize=200)
    assert not report.ok
    assert {f.check for f in report.failures} == {"retokenize"}
    assert len(report.failures) > 150  # nearly every sampled sequence has a trained turn to show it
    assert "labels differ from the record re-tokenized" in str(report.failures[0])
    result = CliRunner().invoke(main, ["verify", str(out), "--retokenize", "20"])
    assert result.exit_code == EXIT_VERIFY
    assert "[retokenize]" in result.output


def test_retokenize_says_when_an_input_changed(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_bytes(EXAMPLE_CHATS.read_bytes())
    out = tmp_path / "out"
    packprep.pack(str(data), str(out), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    data.write_bytes(EXAMPLE_CHATS.read_bytes() + b"\n")  # any edit: the sha256 no longer matches
    with pytest.raises(ConfigError, match="chats.jsonl changed since it was packed .sha256 differs.; it checks records "
                       "against the inputs and the tokenizer as they were packed"):
        packprep.verify(out, retokenize=5)


def test_retokenize_samples_every_sequence_of_a_small_output(tmp_path):
    out = tmp_path / "out"
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(out), str(EXAMPLE_TOKENIZER), max_len=256, overlong="split",
                             strategy="random", num_proc=1)
    report = packprep.verify(out, retokenize=10**6)
    assert report.ok, [str(f) for f in report.failures[:3]]
    assert report.retokenized == manifest["sequences"]


def test_retokenize_reads_a_json_array_an_item_at_a_time(tmp_path, monkeypatch):
    """A ShareGPT dump is often one JSON array of a few GB: verify --retokenize reads its items as
    it goes, up to the last record it needs, and never loads the file whole."""
    records = [json.loads(line) for line in EXAMPLE_CHATS.read_text().splitlines()]
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(records, indent=1))
    out = tmp_path / "out"
    manifest = packprep.pack(str(data), str(out), str(EXAMPLE_TOKENIZER), max_len=512, num_proc=1)
    loads, size = json.loads, data.stat().st_size

    def not_whole(text, *args, **kwargs):  # json.load(handle) comes here too
        if len(text) > size // 2:
            raise AssertionError(f"{data} loaded whole")
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", not_whole)
    report = packprep.verify(out, retokenize=10**6)
    assert report.ok, [str(f) for f in report.failures[:3]]
    assert report.retokenized == manifest["sequences"] > 0


REASONING_TEMPLATES = ["qwen3", "qwq", "deepseek-r1-distill-qwen", "deepseek-r1-distill-llama", "qwen3.5", "smollm3",
                       "kimi-k2-thinking", "glm-4.6", "gpt-oss", "seed-oss", "ministral-3-reasoning", "apriel-1.6",
                       "nemotron-3-nano", "deepseek-v3.1", "minimax-m2"]


@needs_fixtures
@pytest.mark.parametrize("template", REASONING_TEMPLATES)
def test_shared_prefix_folders_of_reasoning_templates_retokenize_equal(tmp_path, template):
    """Each packed sequence of a shared-prefix folder is a record's prefix tree: verify re-makes the
    record's sequences, builds their trees and finds them equal (whole, or packed again at a shorter
    max_len, where a tree is split at its branch points and a sequence longer than the row is cut),
    where it compared the tree with one flat sequence and failed a folder packprep had just written."""
    from .template_folders import build_zoo_folder
    from .zoo_shapes import shape_records

    records = [r for shape in ("reasoning_content", "think_inline", "thinking", "chat") for r in shape_records(shape, 3)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    folder = str(build_zoo_folder(template, tmp_path / "tok"))
    longest = trees = None
    for name in ("whole", "shorter"):
        out = tmp_path / name
        settings = {"max_len": longest - 8, "overlong": "truncate"} if longest else {}
        manifest = packprep.pack(str(data), str(out), folder, num_proc=1, shared_prefix=True, **settings)
        counts = manifest["counts"]
        assert counts["packed"] + counts["truncated"] >= 6
        if longest:  # the longest tree was split at its branch points, or cut where one sequence is longer
            assert manifest["sequences"] > trees or counts["truncated"] > 0
        trees = manifest["sequences"]
        shard = pq.read_table(out / manifest["shards"][0]["path"])
        assert "tree_descendants" in shard.schema.names
        report = packprep.verify(out, retokenize=100)
        assert report.ok, [str(f) for f in report.failures[:3]]
        assert report.retokenized == report.sequences
        longest = max(n for lens in shard.column("seq_lens").to_pylist() for n in lens)
