"""The vision recipes, run through the real trainers on CPU: transformers' Trainer and TRL's SFTTrainer.

Real conversations with drawn images (``vision_folders.conversation_set``) packed by ``packprep.pack`` with
Qwen2.5-VL's processor folder (its resize limit lowered so that a CPU step is quick), a tiny random
Qwen2.5-VL on that vocabulary (hidden 64, 2 layers, a 2-layer vision tower, init std 0.5, float32, SDPA):
the batch each trainer makes itself (its column removal, ``VisionCollator``, its device move) must give
every packed conversation its logits alone, and two optimizer steps must run to a finite loss. The
trainers' defaults drop the images column: the check names it.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("PIL")

import packprep  # noqa: E402
from packprep.training.vision import VisionCollator, VisionRowError  # noqa: E402
from packprep.training.vision_check import check_vision_pipeline  # noqa: E402

from .vision_folders import build, conversation_set  # noqa: E402
from .vision_models import tiny_qwen_vl  # noqa: E402
from .conftest import needs_vision_transformers  # noqa: E402

needs_vision_transformers()

torch.set_num_threads(min(2, torch.get_num_threads()))


def small_qwen_folder(dest):
    """Qwen2.5-VL's processor folder, images resized to at most 64 merged patches (the model's own rule)."""
    folder = build("qwen2.5-vl", dest)
    path = folder / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config.update(max_pixels=64 * 28 * 28, min_pixels=4 * 28 * 28)
    config.get("size", {}).update(longest_edge=64 * 28 * 28, shortest_edge=4 * 28 * 28)
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-trainers")
    data, _ = conversation_set(root / "data", 6)
    folder = small_qwen_folder(root / "qwen")
    packprep.pack(str(data), str(root / "packed"), str(folder), max_len=1024, embed_images=True)
    return {"root": root, "folder": folder, "packed": root / "packed"}


def common_args(root, name, **extra):
    return dict(output_dir=str(root / name), per_device_train_batch_size=1, max_steps=2, report_to=[], use_cpu=True,
                dataloader_num_workers=0, save_strategy="no", seed=0, **extra)


def assert_recipe_trains(trainer):
    report = check_vision_pipeline(trainer)
    assert report["sequences"] >= 2 and report["images"] >= 1
    assert report["max_abs_diff"] < 1e-3
    assert abs(report["loss_packed"] - report["loss_alone"]) <= 1e-5 * report["loss_alone"]
    assert math.isfinite(trainer.train().training_loss)


def test_hf_trainer_recipe(packed):
    collator = VisionCollator(str(packed["folder"]))
    model = tiny_qwen_vl(collator.processor)
    trainer = transformers.Trainer(
        model=model, args=transformers.TrainingArguments(**common_args(packed["root"], "hf", remove_unused_columns=False)),
        train_dataset=datasets.load_dataset(str(packed["packed"]), split="train"), data_collator=collator)
    assert_recipe_trains(trainer)


def test_hf_trainer_default_drops_the_images(packed):
    collator = VisionCollator(str(packed["folder"]))
    trainer = transformers.Trainer(
        model=tiny_qwen_vl(collator.processor), args=transformers.TrainingArguments(**common_args(packed["root"], "hf-d")),
        train_dataset=datasets.load_dataset(str(packed["packed"]), split="train"), data_collator=collator)
    with pytest.raises(VisionRowError, match="remove_unused_columns=False"):
        check_vision_pipeline(trainer)


def test_trl_recipe(packed):
    """TRL refuses to pack vision datasets itself; packed rows go through its trainer with VisionCollator."""
    import trl

    collator = VisionCollator(str(packed["folder"]))
    args = trl.SFTConfig(**common_args(packed["root"], "trl", remove_unused_columns=False), max_length=None,
                         dataset_kwargs={"skip_prepare_dataset": True}, gradient_checkpointing=False)
    trainer = trl.SFTTrainer(model=tiny_qwen_vl(collator.processor), args=args, processing_class=collator.processor,
                             train_dataset=datasets.load_dataset(str(packed["packed"]), split="train"),
                             data_collator=collator)
    assert_recipe_trains(trainer)
