"""Packed rows with images train as each conversation alone, in three model families.

Tiny random models (hidden 64, 2 layers, a 2-layer vision tower, init std 0.5, float32, SDPA and eager) of
Qwen2.5-VL (M-RoPE), Idefics3 (1-D positions, tiled images) and Gemma 3 (image tokens attend both ways,
sliding layers): ``VisionCollator`` batches must give every packed conversation the logits of the model's own
single-conversation path. Each way of breaking isolation (no per-sequence rope restart, no text row in the
positions, a padding mask, Gemma 3 without per-sequence masks, images out of order) must be caught.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from packprep.training import PackingIsolationError  # noqa: E402
from packprep.training.vision import VisionCollator, VisionRowError  # noqa: E402
from packprep.training.vision_check import check_vision_pipeline, split_sequences  # noqa: E402

from .vision_models import FAMILIES, IMAGE, family, packed_rows  # noqa: E402
from .conftest import needs_vision_transformers  # noqa: E402

needs_vision_transformers()

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    name = request.param
    model, processor, kwargs = family(name)
    folder = tmp_path_factory.mktemp(name)
    rows = packed_rows(name, model, processor, folder)
    collator = VisionCollator(processor, model=model, image_root=folder, **kwargs)
    return name, model, processor, kwargs, folder, rows, collator


def test_packed_equals_each_conversation_alone(setup):
    name, model, _, _, _, rows, collator = setup
    report = check_vision_pipeline(collator, model, rows, rows=2)
    assert report["sequences"] == 3 and report["images"] == 3
    assert report["max_abs_diff"] < 1e-3
    assert abs(report["loss_packed"] - report["loss_alone"]) <= 1e-5 * report["loss_alone"]


@pytest.mark.parametrize("name", ["idefics3", "gemma3"])
def test_eager_attention_too(name, tmp_path):
    model, processor, kwargs = family(name, attn="eager")
    rows = packed_rows(name, model, processor, tmp_path)
    collator = VisionCollator(processor, model=model, image_root=tmp_path, **kwargs)
    assert check_vision_pipeline(collator, model, rows, rows=2)["max_abs_diff"] < 1e-3


def test_batch_form(setup):
    """What the model's forward takes for packed rows: (4, 1, T) positions for M-RoPE (text row first,
    restarting per sequence), else (1, T); pixels in row order; no 2-D mask; first labels of sequences -100."""
    name, _, _, _, _, rows, collator = setup
    batch = collator(rows[1:2])
    seq_lens = rows[1]["seq_lens"]
    text = np.concatenate([np.arange(n) for n in seq_lens])
    positions = batch["position_ids"]
    if name == "qwen2_5_vl":
        assert positions.shape == (4, 1, sum(seq_lens))
        assert np.array_equal(positions[0, 0].numpy(), text)
        assert np.array_equal(positions[1:, 0].numpy(), np.asarray(rows[1]["mrope_position_ids"]))
        assert batch["image_grid_thw"].shape == (2, 3)
    else:
        assert np.array_equal(positions[0].numpy(), text)
    assert not isinstance(batch.get("attention_mask"), torch.Tensor)
    assert (batch["labels"][0, np.cumsum(seq_lens) - seq_lens] == -100).all()
    assert batch["use_cache"] is False
    assert ("token_type_ids" in batch) == (name == "gemma3")


def test_rope_index_not_restarted_is_caught(setup):
    """M-RoPE computed over the whole packed row: the collator refuses it (the row is not what the contract
    says); 1-D positions in place of the rope index: the check catches them."""
    name, model, _, _, _, rows, collator = setup
    if name != "qwen2_5_vl":
        pytest.skip("M-RoPE only")
    row = copy.deepcopy(rows[1])
    first = row["seq_lens"][0]
    mrope = np.asarray(row["mrope_position_ids"])
    mrope[:, first:] += mrope[:, first - 1 : first].max() + 1  # continues the first sequence's index
    row["mrope_position_ids"] = mrope.tolist()
    with pytest.raises(VisionRowError, match="do not restart"):
        collator([row])

    # the rope index shifted per sequence only rotates it: attention, kept within each sequence, cannot tell.
    # What it can tell is the text collator's 1-D positions, which the model spreads over t, h and w alike
    def one_d(batch_rows):
        batch = collator(batch_rows)
        batch["position_ids"] = batch["position_ids"][0]  # (1, T): restarted, but no rope index of the images
        return batch

    with pytest.raises(PackingIsolationError, match="rope index"):
        check_vision_pipeline(one_d, model, rows, collator=collator)


def test_positions_without_text_row_are_caught(setup):
    name, model, _, _, _, rows, collator = setup
    if name != "qwen2_5_vl":
        pytest.skip("M-RoPE only")

    def three_rows(batch_rows):
        batch = collator(batch_rows)
        batch["position_ids"] = batch["position_ids"][1:]
        return batch

    with pytest.raises(PackingIsolationError, match="carry no text row"):
        check_vision_pipeline(three_rows, model, rows, collator=collator)


def test_positions_not_restarted_are_caught(setup):
    name, model, _, _, _, rows, collator = setup

    def whole_row(batch_rows):
        batch = collator(batch_rows)
        n = batch["input_ids"].shape[1]
        batch["position_ids"][..., :] = torch.arange(n)
        batch.pop("attention_mask", None)
        return batch

    with pytest.raises(PackingIsolationError, match="restart at"):
        check_vision_pipeline(whole_row, model, rows, collator=collator)


def test_a_padding_mask_is_caught(setup):
    name, model, _, _, _, rows, collator = setup
    if name == "gemma3":
        pytest.skip("Gemma 3's mask is the per-sequence dict")

    def with_mask(batch_rows):
        batch = collator(batch_rows)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    with pytest.raises(PackingIsolationError, match="attention_mask"):
        check_vision_pipeline(with_mask, model, rows, collator=collator)


def test_gemma3_needs_its_per_sequence_masks(tmp_path):
    """transformers' own packed path (token_type_ids + restarted positions, no mask) is not each sequence
    alone in Gemma 3's sliding layers: the check names it, and the collator given the model fixes it."""
    model, processor, kwargs = family("gemma3")
    rows = packed_rows("gemma3", model, processor, tmp_path)
    with_masks = VisionCollator(processor, model=model, image_root=tmp_path, **kwargs)
    without = VisionCollator(processor, image_root=tmp_path, **kwargs)
    assert "attention_mask" not in without(rows[:1])
    with pytest.raises(PackingIsolationError, match="per-sequence masks"):
        check_vision_pipeline(without, model, rows, collator=with_masks, rows=2)
    assert check_vision_pipeline(with_masks, model, rows, rows=2)["max_abs_diff"] < 1e-3


def test_images_out_of_order_are_caught(setup):
    name, model, _, _, _, rows, collator = setup
    row = rows[1]
    assert len(row["images"]) == 2

    def swapped(batch_rows):
        batch = collator(batch_rows)
        a, b = (collator.image_inputs({**row, "images": [image]}) for image in row["images"])
        for key in a:
            dim = 1 if a[key].dim() == 5 or (a[key].dim() == 4 and key != "pixel_values") else 0
            batch[key] = torch.cat([b[key], a[key]], dim=dim)
        return batch

    if name == "qwen2_5_vl" and np.prod(row["images"][0]["grid"]) != np.prod(row["images"][1]["grid"]):
        with pytest.raises(PackingIsolationError):  # the model's features no longer fit the grids
            check_vision_pipeline(swapped, model, [row], collator=collator)
        return
    with pytest.raises(PackingIsolationError):
        check_vision_pipeline(swapped, model, [row], collator=collator)


def test_changed_or_missing_image_is_refused(setup, tmp_path):
    _, _, processor, kwargs, folder, rows, collator = setup
    row = copy.deepcopy(rows[0])
    row["images"][0]["sha256"] = "0" * 64
    with pytest.raises(VisionRowError, match="changed since it was packed"):
        collator([row])
    elsewhere = VisionCollator(processor, image_root=tmp_path, **kwargs)
    with pytest.raises(VisionRowError, match="cannot read the image"):
        elsewhere([rows[0]])


def test_embedded_bytes_need_no_files(setup):
    _, model, processor, kwargs, folder, rows, collator = setup
    row = copy.deepcopy(rows[1])
    for image in row["images"]:
        image["data"] = (folder / image["source"]).read_bytes()
        image["source"] = "gone/" + image["source"]
    embedded = VisionCollator(processor, model=collator.model, **kwargs)
    batch = embedded([row])
    assert torch.equal(batch["pixel_values"], collator([rows[1]])["pixel_values"])


def test_token_count_the_processor_no_longer_gives_is_refused(setup):
    name, _, _, _, _, rows, collator = setup
    row = copy.deepcopy(rows[0])
    image = row["images"][0]
    ids = np.asarray(row["input_ids"])
    ids[image["start"]] = 1  # one image token fewer than the images account for
    row["input_ids"] = ids.tolist()
    with pytest.raises(VisionRowError, match="image tokens in input_ids"):
        collator([row])
    row = copy.deepcopy(rows[0])
    row["images"][0]["length"] += 1
    with pytest.raises(VisionRowError, match="processor now gives"):
        collator([row])


def test_split_sequences_rebases_images(setup):
    _, _, _, _, _, rows, _ = setup
    seqs = split_sequences(rows[1])
    assert [len(s["input_ids"]) for s in seqs] == rows[1]["seq_lens"]
    assert [len(s["images"]) for s in seqs] == [2, 0]
    assert all(int(s["input_ids"][i["start"]]) == IMAGE for s in seqs for i in s["images"])
