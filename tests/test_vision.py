"""Conversations with images packed end to end for three families (Qwen2.5-VL, SmolVLM, Gemma 3): each
packed sequence is, token for token, what the model's own processor gives for the conversation and
its images (transformers' apply_chat_template and processor call, never packprep's code), image
tokens are never trained, positions restart, Qwen's M-RoPE is transformers' get_rope_index of the
sequence alone, and each image's reference (source, sha256, grid, tokens) is the processor's."""

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

import packprep
from packprep.vision.processor import ImageTokens, load_processor

from .conftest import needs_fixtures, needs_vision_transformers
from .vision_folders import FAMILIES, build, conversation_set, draw_image

needs_vision_transformers()

pytestmark = [pytest.mark.slow, needs_fixtures]  # the fixtures' vocabularies and conversations


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """family -> (processor, expected, manifest, rows)"""
    root = tmp_path_factory.mktemp("vision-e2e")
    data, expected = conversation_set(root / "data", 9)
    out = {}
    for family in sorted(FAMILIES):
        folder = build(family, root / family)
        manifest = packprep.pack(str(data), str(root / f"out-{family}"), str(folder), max_len=4096, row_order="input")
        rows = [r for f in sorted((root / f"out-{family}" / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        out[family] = (load_processor(str(folder)), expected, manifest, rows)
    return out


def _sequences(rows):
    for row in rows:
        start = 0
        for n, (length, source) in enumerate(zip(row["seq_lens"], row["source_index"])):
            yield row, n, source, start, length
            start += length


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_record_is_packed_as_the_processor_tokenizes_it(family, packed):
    processor, expected, manifest, rows = packed[family]
    assert manifest["layout"] == "packprep-vision" and manifest["counts"]["packed"] == len(expected)
    tokens = ImageTokens(processor)
    seen = set()
    for row, n, source, start, length in _sequences(rows):
        messages, files = expected[source]
        text = processor.apply_chat_template(messages, tokenize=False)
        images = [Image.open(f) for f in files]
        reference = processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0]
        ids = row["input_ids"][start:start + length]
        assert ids == list(reference), (family, source)
        labels = np.array(row["labels"][start:start + length])
        assert labels[0] == -100 and row["position_ids"][start:start + length] == list(range(length))
        image = np.isin(ids, tokens.token_ids)
        assert (labels[image] == -100).all() and (labels != -100).any()
        trained = processor.tokenizer.decode(np.array(ids)[labels != -100])
        for message in messages:
            if message["role"] == "assistant":
                assert message["content"][-1]["text"].strip()[:40] in trained
        mine = [i for i in row["images"] if i["seq"] == n]
        assert [i["sha256"] for i in mine] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
        assert sum(i["length"] for i in mine) == int(image.sum())
        for i, picture in zip(mine, images):
            assert row["input_ids"][i["start"]] in tokens.token_ids
            assert tuple(i["grid"]) == tokens.run(picture).grid and i["length"] == tokens.run(picture).tokens
            assert i["data"] is None
        seen.add(source)
    assert seen == set(range(len(expected)))
    assert manifest["tokens"]["image"] + manifest["tokens"]["text"] == manifest["tokens"]["total"]


def test_qwen_rows_carry_each_sequences_own_rope_index(packed):
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    processor, expected, manifest, rows = packed["qwen2.5-vl"]
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2,
                                                                                 tokens_per_second=2)))
    model.get_vision_position_ids = lambda *a, **k: qwen.Qwen2_5_VLModel.get_vision_position_ids(model, *a, **k)
    sequences = 0
    for row, n, source, start, length in _sequences(rows):
        messages, files = expected[source]
        text = processor.apply_chat_template(messages, tokenize=False)
        out = processor(text=[text], images=[Image.open(f) for f in files], add_special_tokens=False,
                        return_mm_token_type_ids=True, return_tensors="pt")
        index, _ = qwen.Qwen2_5_VLModel.get_rope_index(model, out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
                                                      image_grid_thw=out["image_grid_thw"])
        mrope = np.array(row["mrope_position_ids"])[:, start:start + length]
        assert np.array_equal(mrope, index[:, 0].numpy()), source
        sequences += 1
    assert sequences == len(expected) and "mrope_position_ids" not in packed["gemma3"][3][0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cli_packs_and_verifies_a_processor_folder(family, tmp_path):
    from click.testing import CliRunner

    from packprep.cli import main

    data, expected = conversation_set(tmp_path / "data", 3)
    folder = build(family, tmp_path / family)
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["pack", str(data), "-t", str(folder), "--max-len", "4096", "-o", out,
                                       "--embed-images", "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "packprep.json").read_text())
    assert manifest["layout"] == "packprep-vision" and manifest["counts"]["packed"] == 3
    rows = pq.read_table(next((tmp_path / "out" / "data").glob("*.parquet"))).to_pylist()
    assert all(i["data"] is not None and hashlib.sha256(i["data"]).hexdigest() == i["sha256"]
               for r in rows for i in r["images"])
    result = CliRunner().invoke(main, ["verify", out])
    assert result.exit_code == 0 and result.output.startswith("ok: "), result.output


def test_verify_checks_every_image_against_the_processor(tmp_path):
    from packprep.pipeline import verify_folder

    data, expected = conversation_set(tmp_path / "data", 4)
    folder = build("qwen2.5-vl", tmp_path / "qwen25vl")
    packprep.pack(str(data), str(tmp_path / "out"), str(folder), max_len=4096)
    report = verify_folder(tmp_path / "out")
    assert report.ok, [str(f) for f in report.failures]
    assert report.sequences == 4
    summary = packprep.stats(str(tmp_path / "out"))
    assert summary["kind"] == "vision-packed" and summary["sequences"] == 4
    assert summary["images"]["total"] == sum(len(files) for _, files in expected)
    first = expected[0][1][0]
    first.write_bytes(first.read_bytes() + b"changed")  # the file changes after packing
    draw_image(expected[3][1][0], (64, 64), 99)  # redrawn at another size
    failures = [str(f) for f in verify_folder(tmp_path / "out").failures]
    assert any("sha256" in f and first.name in f for f in failures), failures
    assert any(expected[3][1][0].name in f for f in failures), failures


def test_stats_reports_text_and_image_tokens_and_each_max_len(tmp_path):
    from click.testing import CliRunner

    from packprep.cli import main

    data, expected = conversation_set(tmp_path / "data", 4)
    folder = build("gemma3", tmp_path / "gemma3")
    report = packprep.stats(str(data), str(folder), max_lens=[256, 1024, 4096])
    assert report["kind"] == "vision" and report["images"]["total"] == sum(len(f) for _, f in expected)
    assert report["tokens"]["image"] == 256 * report["images"]["total"]  # Gemma 3: 256 an image, any size
    assert report["tokens"]["text"] + report["tokens"]["image"] == report["tokens"]["total"]
    by_len = {row["max_len"]: row for row in report["what_if"]}
    assert by_len[4096]["refused"] == by_len[4096]["truncated"] == 0 and by_len[4096]["rows"] >= 1
    assert by_len[256]["truncated"] + by_len[256]["refused"] == 4
    result = CliRunner().invoke(main, ["stats", str(data), "-t", str(folder), "--max-len", "1024"])
    assert result.exit_code == 0 and "image" in result.output, result.output


def test_the_output_is_the_same_with_any_number_of_processes(tmp_path):
    data, _ = conversation_set(tmp_path / "data", 7)
    folder = build("smolvlm", tmp_path / "smolvlm")
    shards = []
    for num_proc in (1, 2):
        manifest = packprep.pack(str(data), str(tmp_path / f"out{num_proc}"), str(folder), max_len=2048,
                                 num_proc=num_proc)
        shards.append([s["sha256"] for s in manifest["shards"]])
    assert shards[0] == shards[1]
