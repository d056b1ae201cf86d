"""The output contract of ``packprep.pack``, checked by reading the shards independently of verify."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import packprep
from packprep.errors import ConfigError, InputError
from packprep.normalize import Conversation, detect_format, normalize
from packprep.read import resolve_inputs, read_records
from packprep.tokenization import ChatEncoder, Encoded, load_tokenizer

from .conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures

TOKENIZER = str(EXAMPLE_TOKENIZER)


def read_rows(folder: Path) -> list[dict]:
    rows = []
    for shard in sorted((folder / "data").glob("train-*.parquet")):
        rows += pq.read_table(shard).to_pylist()
    return rows


def rejected_indices(folder: Path) -> set[int]:
    path = folder / "rejects.jsonl"
    if not path.exists():
        return set()
    return {json.loads(line)["source_index"] for line in path.read_text().splitlines()}


def assert_contract(folder: Path, max_len: int | None, records: int) -> list[dict]:
    rows = read_rows(folder)
    packed = set()
    for row in rows:
        ids, labels, positions = row["input_ids"], row["labels"], row["position_ids"]
        assert len(ids) == len(labels) == len(positions) == sum(row["seq_lens"])
        assert len(row["seq_lens"]) == len(row["source_index"])
        if max_len is not None:
            assert len(ids) <= max_len
        start = 0
        for length in row["seq_lens"]:
            assert positions[start : start + length] == list(range(length)), "position ids restart per sequence"
            assert labels[start] == -100, "first label of every packed sequence is -100"
            start += length
        assert all(label in (-100, token) for label, token in zip(labels, ids))
        packed.update(row["source_index"])
    rejected = rejected_indices(folder)
    assert not packed & rejected
    assert packed | rejected == set(range(records)), "every record is packed or rejected"
    return rows


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(load_tokenizer(TOKENIZER))


def example_conversations():
    source = resolve_inputs([str(EXAMPLE_CHATS)])[0]
    return [record.data for record in read_records(source)]


@pytest.mark.parametrize("strategy", ["greedy", "bfd", "random", "pad", "minibatch"])
def test_every_strategy_keeps_the_contract(tmp_path, strategy):
    extra = {"samples_per_row": 3} if strategy == "minibatch" else {}
    manifest = packprep.pack(
        str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, strategy=strategy, num_proc=1, **extra
    )
    records = len(example_conversations())
    rows = assert_contract(tmp_path / "out", None if strategy == "minibatch" else 512, records)
    assert manifest["rows"] == len(rows)
    counts = manifest["counts"]
    assert counts["records"] == records
    assert counts["packed"] + counts["truncated"] + counts["split"] + counts["rejected"] == records
    assert counts["rejected"] == 4  # the four bad records make_example.py plants
    assert manifest["lower_bound_rows"] <= manifest["rows"]
    if strategy == "pad":
        assert all(len(row["seq_lens"]) == 1 for row in rows)
    if strategy == "minibatch":
        sizes = sorted(len(row["seq_lens"]) for row in rows)
        assert sizes[1:] == [3] * (len(rows) - 1) and sizes[0] in (1, 2, 3)  # 400 % 3: one short row
        assert manifest["rows_may_exceed_max_len"]


def test_packed_sequences_are_the_tokenized_records(tmp_path, encoder):
    """Each packed sequence is exactly its record's tokens and labels (bar the masked first label)."""
    packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=2048, num_proc=1)
    records = example_conversations()
    checked = 0
    for row in read_rows(tmp_path / "out"):
        start = 0
        for length, source in zip(row["seq_lens"], row["source_index"]):
            expected = encoder.encode([normalize(records[source], detect_format(records[source]))])[0]
            assert row["input_ids"][start : start + length] == expected.input_ids.tolist()
            assert row["labels"][start + 1 : start + length] == expected.labels[1:].tolist()
            start += length
            checked += 1
    assert checked == 400


def test_labels_are_assistant_replies_with_end_of_turn(encoder):
    tok = encoder.tokenizer
    record = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"}]}
    encoded = encoder.encode([normalize(record, "sharegpt")])[0]
    trained = tok.decode([t for t, label in zip(encoded.input_ids, encoded.labels) if label != -100])
    assert trained == "Hello there<|im_end|>\n"
    reference = load_tokenizer(TOKENIZER, transformers=True)
    assert encoded.input_ids.tolist() == reference.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}], tokenize=True,
        return_dict=False,
    )


def test_same_seed_same_bytes_other_seed_other_rows(tmp_path):
    hashes = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / name, TOKENIZER, max_len=512, seed=seed,
                                 strategy="random", num_proc=1)
        hashes.append([shard["sha256"] for shard in manifest["shards"]])
    assert hashes[0] == hashes[1]
    assert hashes[0] != hashes[2]


def test_num_proc_does_not_change_the_output(tmp_path):
    one = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "one", TOKENIZER, max_len=512, num_proc=1)
    two = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "two", TOKENIZER, max_len=512, num_proc=2)
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]
    assert (tmp_path / "one" / "packprep.json").read_text() != ""
    assert (tmp_path / "one" / "rejects.jsonl").read_bytes() == (tmp_path / "two" / "rejects.jsonl").read_bytes()


@pytest.mark.parametrize("shard_format", ["parquet", "arrow"])
def test_shards_written_by_parallel_writers_are_the_same_bytes(tmp_path, shard_format):
    outputs = [
        packprep.pack(str(EXAMPLE_CHATS), tmp_path / f"out{n}", TOKENIZER, max_len=512, shard_size="40KB",
                      shard_format=shard_format, num_proc=n)
        for n in (1, 3)
    ]
    assert len(outputs[0]["shards"]) > 3
    assert outputs[0]["shards"] == outputs[1]["shards"]  # names, counts, sizes and sha256s
    assert packprep.verify(tmp_path / "out3").ok


def test_the_driver_holds_16_bytes_a_sequence_while_shards_are_written(tmp_path, monkeypatch):
    """What the memory formula of benchmarks/RESULTS.md counts on: int64 token offsets, int32 item and length of
    each piece, and no input record number a sequence (they follow from the rejected records)."""
    import numpy as np

    from packprep import pipeline

    held = {}
    write_shards = pipeline.write_shards

    def spy(folder, store, segments, *args, **kwargs):
        held.update(store=store, segments=segments)
        return write_shards(folder, store, segments, *args, **kwargs)

    monkeypatch.setattr(pipeline, "write_shards", spy)
    manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=192, overlong="drop", num_proc=1)
    store, segments = held["store"], held["segments"]
    sequences = manifest["sequences"]
    assert 0 < manifest["counts"]["rejected"] < sequences and len(store) == sequences
    arrays = [value for value in [*vars(store).values(), *vars(segments).values()] if isinstance(value, np.ndarray)]
    assert sum(array.itemsize for array in arrays if len(array) >= sequences) == 16
    assert len(store.skips) == manifest["counts"]["rejected"]
    rows = read_rows(tmp_path / "out")
    assert store.source_index(np.arange(sequences, dtype=np.int32)).tolist() == sorted(
        source for row in rows for source in row["source_index"])


def test_the_token_store_numbers_sequences_by_the_records_not_rejected(monkeypatch):
    import numpy as np

    from packprep import materialize
    from packprep.materialize import Segments, Spilled, TokenStore

    monkeypatch.setattr(materialize, "RUNNING_BLOCK", 3)  # offsets summed across blocks and parts
    parts = [[5, 1, 7, 2], [], [3, 3, 3, 3, 3, 3, 9]]
    store = TokenStore.from_spills(Path("unused"), [Spilled(np.array(p, np.int32)) for p in parts], np.array([1, 2, 9]))
    lengths = sum(parts, [])
    assert store.offsets.tolist() == [0] + np.cumsum(lengths).tolist() and store.lengths.tolist() == lengths
    assert store.part_starts.tolist() == [0, 15, 15, 42]
    assert store.source_index(np.arange(11, dtype=np.int32)).tolist() == [0, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13]
    segments = Segments(np.arange(11, dtype=np.int32), None, np.array(lengths, np.int32), np.array([0, 2, 3, 11]))
    assert segments.row_lengths().tolist() == [6, 7, 29]


def test_shards_hold_at_most_shard_size_and_an_oversized_row_alone():
    import numpy as np

    from packprep.write import BYTES_PER_SEQUENCE, BYTES_PER_TOKEN, plan_shards

    rng = np.random.default_rng(0)
    for shard_bytes in (1, 100, 1000, 5000):
        lengths, sequences = rng.integers(1, 60, 300), rng.integers(1, 4, 300)
        size = lengths * BYTES_PER_TOKEN + sequences * BYTES_PER_SEQUENCE
        shards = plan_shards(lengths, sequences, shard_bytes)
        assert [first for first, _ in shards] == [0] + [last for _, last in shards[:-1]] and shards[-1][1] == 300
        for first, last in shards:
            assert last > first and (last - first == 1 or size[first:last].sum() <= shard_bytes)
        for first, last in shards[:-1]:  # each shard as full as it could be
            assert size[first : last + 1].sum() > shard_bytes
    assert plan_shards(np.zeros(0, np.int64), np.zeros(0, np.int64), 100) == [(0, 0)]


@pytest.mark.parametrize("overlong", ["truncate", "drop", "split"])
def test_overlong_policies_account_for_every_record(tmp_path, overlong):
    manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=96, overlong=overlong,
                             num_proc=1)
    counts = manifest["counts"]
    rows = assert_contract(tmp_path / "out", 96, counts["records"])
    if overlong == "truncate":
        assert counts["truncated"] > 0 and counts["split"] == 0
    if overlong == "drop":
        assert counts["rejected_by_reason"].get("overlong", 0) > 0 and counts["truncated"] == 0
    if overlong == "split":
        assert counts["split"] > 0 and counts["truncated"] == 0
        # a split record appears once per piece, pieces together hold all of its tokens
        pieces = {}
        for row in rows:
            for length, source in zip(row["seq_lens"], row["source_index"]):
                pieces.setdefault(source, []).append(length)
        assert any(len(p) > 1 for p in pieces.values())


def test_output_is_loadable_by_datasets(tmp_path):
    import datasets

    packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, shard_size="40KB", num_proc=1)
    shards = sorted(p.name for p in (tmp_path / "out" / "data").iterdir())
    assert len(shards) > 1
    assert shards[0] == f"train-00000-of-{len(shards):05d}.parquet"
    loaded = datasets.load_dataset(str(tmp_path / "out"), split="train")
    assert loaded.num_rows == len(read_rows(tmp_path / "out"))
    assert loaded.features["input_ids"].feature.dtype == "int32"


def test_arrow_shards_memory_map_with_load_from_disk(tmp_path):
    import datasets

    manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, shard_format="arrow",
                             num_proc=1)
    loaded = datasets.load_from_disk(str(tmp_path / "out" / "data"))
    assert loaded.num_rows == manifest["rows"]
    assert packprep.verify(tmp_path / "out").ok


def test_existing_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="overwrite=True"):
        packprep.pack(str(EXAMPLE_CHATS), out, TOKENIZER, max_len=512)
    assert (out / "keep.txt").read_text() == "mine"
    packprep.pack(str(EXAMPLE_CHATS), out, TOKENIZER, max_len=512, overwrite=True, num_proc=1)
    assert not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no temporary folder is left behind"


def test_a_failed_run_leaves_nothing(tmp_path):
    with pytest.raises(InputError, match=r"chats.jsonl, line 201: empty conversation"):
        packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, on_error="fail", num_proc=1)
    assert list(tmp_path.iterdir()) == []


def test_max_len_below_template_overhead_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="overhead"):
        packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=4)
    assert list(tmp_path.iterdir()) == []


def test_manifest_records_inputs_tokenizer_and_efficiency(tmp_path):
    manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=1024, num_proc=1)
    assert manifest["inputs"][0]["records"] == 404
    assert len(manifest["inputs"][0]["sha256"]) == 64
    assert manifest["tokenizer"]["vocab_size"] == len(load_tokenizer(TOKENIZER))
    assert manifest["tokenizer"]["chat_template_sha256"]
    assert manifest["efficiency"] == pytest.approx(manifest["tokens"]["total"] / (manifest["rows"] * 1024), abs=1e-6)
    assert manifest["config"]["strategy"] == "greedy"
    on_disk = json.loads((tmp_path / "out" / "packprep.json").read_text())
    assert on_disk == manifest
    assert (tmp_path / "out" / "README.md").read_text().startswith("---\nconfigs:")


def test_formats_openai_alpaca_text_and_parquet_input(tmp_path):
    import pyarrow as pa

    openai = tmp_path / "openai.json"
    openai.write_text(json.dumps([{"messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]}]))
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Add", "input": "2 and 2", "output": "4"}) + "\n")
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": ["plain text is trained on every token"]}), text)
    manifest = packprep.pack([str(openai), str(alpaca), str(text)], tmp_path / "out", TOKENIZER, max_len=256,
                             num_proc=1)
    assert [i["format"] for i in manifest["inputs"]] == ["openai", "alpaca", "text"]
    assert manifest["counts"]["packed"] == 3
    rows = assert_contract(tmp_path / "out", 256, 3)
    by_source = {}
    for row in rows:
        start = 0
        for length, source in zip(row["seq_lens"], row["source_index"]):
            by_source[source] = row["labels"][start : start + length]
            start += length
    assert all(label != -100 for label in by_source[2][1:]), "text records train on every token"


@needs_fixtures
@pytest.mark.parametrize("tokenizer_name", ["llama3", "qwen2.5"])
def test_packs_every_fixture_file_with_real_tokenizers(tmp_path, tokenizer_name):
    inputs = sorted(str(p) for p in CONVERSATIONS.iterdir() if p.suffix in (".json", ".jsonl"))
    # the DPO demo is preference data: refused unless told what to train (its chosen replies here)
    manifest = packprep.pack(inputs, tmp_path / "out", fixture_tokenizer(tokenizer_name), max_len=4096, num_proc=2,
                             preference="chosen")
    assert_contract(tmp_path / "out", 4096, manifest["counts"]["records"])
    assert packprep.verify(tmp_path / "out").ok
    counts = manifest["counts"]
    assert counts["records"] == 2400
    rejected = counts["rejected_by_reason"]
    assert rejected["no_assistant_turn"] == 1  # one conversation with no reply at all
    assert set(rejected) <= {"no_assistant_turn", "overlong"}  # overlong: nothing trained in its first 4,096 tokens
    assert counts["truncated"] > 0  # medicalgpt holds conversations of up to 37,793 tokens
    assert manifest["efficiency"] > 0.99


def test_saved_dataset_and_arrow_inputs_pack_like_jsonl(tmp_path):
    """A folder saved by datasets, a DatasetDict and an Arrow IPC file give the same rows as the JSONL."""
    import datasets
    import pyarrow as pa

    records = example_conversations()[:50]
    table = pa.Table.from_pylist([r for r in records if r["conversations"]])
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset(table)}).save_to_disk(str(tmp_path / "saved_dict"))
    with pa.OSFile(str(tmp_path / "chats.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    shards = []
    for name in ("saved", "saved_dict", "chats.arrow", "chats.jsonl"):
        manifest = packprep.pack(str(tmp_path / name), tmp_path / f"out-{name}", TOKENIZER, max_len=512, num_proc=1)
        assert manifest["counts"]["records"] == table.num_rows
        shards.append([s["sha256"] for s in manifest["shards"]])
    assert shards[0] == shards[1] == shards[2] == shards[3]


def test_an_unreachable_hub_id_is_a_clear_input_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="no such local file or folder, and HF_HUB_OFFLINE is set"):
        packprep.pack("nobody/no-such-dataset", tmp_path / "out", TOKENIZER, max_len=512, num_proc=1)
    assert list(tmp_path.iterdir()) == []


def test_missing_parent_folders_of_the_output_are_created(tmp_path):
    manifest = packprep.pack(str(EXAMPLE_CHATS), tmp_path / "a" / "b" / "out", TOKENIZER, max_len=512, num_proc=1)
    assert manifest["rows"] > 0 and packprep.verify(tmp_path / "a" / "b" / "out").ok


def test_a_broken_environment_is_a_config_error_not_a_rejected_record(tmp_path, monkeypatch):
    """Without jinja2 every render fails: that must stop the run, not reject every record."""
    import packprep.tokenizer_folder as tokenizer_folder

    def no_jinja(template):
        raise ImportError("chat templates need jinja2 to be installed")

    monkeypatch.setattr(tokenizer_folder, "compile_template", no_jinja)
    with pytest.raises(ConfigError, match="cannot render chat templates: .*jinja2"):
        packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, num_proc=1)
    assert list(tmp_path.iterdir()) == []


def test_worker_processes_tokenize_on_one_thread_each(monkeypatch):
    """With --num-proc > 1 the processes are the parallelism: tiktoken threads would oversubscribe.
    On 4 cores a batch is encoded on several threads, under ``one_thread`` on the caller's alone."""
    import os
    import threading

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    encoder = ChatEncoder(load_tokenizer(TOKENIZER))
    assert encoder.backend_name == "tiktoken"  # the example tokenizer is a byte-level BPE
    started, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or start(self))
    batch = [Conversation(text=f"Text number {n}, encoded on some thread.") for n in range(16)]

    def threads_to_encode() -> int:
        started.clear()
        assert all(isinstance(e, Encoded) for e in encoder.encode(batch))
        return sum(name.startswith("ThreadPoolExecutor") for name in started)

    assert threads_to_encode() > 1
    with encoder.one_thread():
        assert threads_to_encode() == 0
    assert threads_to_encode() > 1


@pytest.mark.parametrize("num_proc,layout", [(1, "packprep"), (2, "packprep"), (2, "trl"), (1, "torchtune"),
                                             (2, "megatron")])
def test_a_shard_written_wrong_is_caught_and_nothing_is_published(tmp_path, monkeypatch, num_proc, layout):
    """Each shard is read back and checked, or, in a layout whose rows cannot be read back, each row
    group is checked as its writer makes it: a packprep bug that let B's first label be trained
    (here: materialize forgetting the -100) stops the run before the output exists."""
    from packprep import materialize as materialize_module, write as write_module

    original = materialize_module.materialize

    def leaky(store, segments):
        table = original(store, segments)
        labels = table.column("labels").combine_chunks()
        ids = table.column("input_ids").combine_chunks()
        return table.set_column(1, "labels", ids.cast(labels.type))  # every label trained, first ones too

    monkeypatch.setattr(write_module, "materialize", leaky)
    with pytest.raises(RuntimeError, match=r"packed output failed verification: .*first_label"):
        packprep.pack(str(EXAMPLE_CHATS), tmp_path / "out", TOKENIZER, max_len=512, num_proc=num_proc,
                      shard_size="100KB", layout=layout)
    assert list(tmp_path.iterdir()) == []
