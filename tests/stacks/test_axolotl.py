"""Axolotl 0.19 on packprep's axolotl layout: its config validation, dataset loading, model loader,
trainer builder and collator.

Builds the trainer exactly as ``axolotl train`` does from the recipe's YAML keys (validate_config,
normalize_config, load_datasets, ModelLoader, HFCausalTrainerBuilder) on a tiny random Llama
saved to disk, and compares a collated batch's summed loss and logits with each sequence run
alone. 
Its venv and run, from the repo root (what ``tests/stacks/run.sh axolotl`` does)::

    python3 -m venv .stack-venvs/axolotl && .stack-venvs/axolotl/bin/pip install torch==2.13.0
    .stack-venvs/axolotl/bin/pip install . pytest omegaconf
    .stack-venvs/axolotl/bin/pip install axolotl==0.19.0
    PYTHONPATH=. .stack-venvs/axolotl/bin/python -m pytest -m stacks tests/stacks/test_axolotl.py
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.stacks
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # no telemetry calls from the test
pytest.importorskip("axolotl")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from packprep.training import check_pipeline  # noqa: E402
from tests.stacks.conftest import (  # noqa: E402
    MAX_LEN, ROWS, assert_same, canonical_rows, export, one_by_one, per_sequence,
)


def axolotl_trainer(model_dir, folder, out, **overrides):
    """The trainer `axolotl train config.yml` builds, for the recipe's keys plus ``overrides``."""
    from axolotl.common.datasets import load_datasets
    from axolotl.core.builders import HFCausalTrainerBuilder
    from axolotl.loaders import ModelLoader, load_tokenizer
    from axolotl.utils.config import normalize_config, validate_config
    from axolotl.utils.dict import DictDefault

    recipe = dict(datasets=[{"path": str(folder)}], skip_prepare_dataset=True, sample_packing=False, sequence_len=MAX_LEN)
    cfg = DictDefault(
        base_model=str(model_dir), micro_batch_size=ROWS, gradient_accumulation_steps=1, num_epochs=1,
        learning_rate=1e-5, optimizer="adamw_torch", output_dir=str(out), dataset_prepared_path=str(out / "prepared"),
        attn_implementation="sdpa", **{**recipe, **overrides},
    )
    cfg = validate_config(cfg)
    normalize_config(cfg)
    meta = load_datasets(cfg=cfg)
    tokenizer = load_tokenizer(cfg)
    model, _ = ModelLoader(cfg, tokenizer).load()
    builder = HFCausalTrainerBuilder(cfg, model, tokenizer)
    builder.train_dataset, builder.eval_dataset = meta.train_dataset, meta.eval_dataset
    return builder.build(meta.total_num_steps)


def summed(trainer, canonical):
    """A batch as its trainer collates it; the packed rows it holds (axolotl shuffles the rows it loads)."""
    examples = [trainer.train_dataset[i] for i in range(ROWS)]
    by_ids = {tuple(r["input_ids"]): r for r in canonical_rows(canonical, n=None)}
    rows = [by_ids[tuple(e["input_ids"])] for e in examples]
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    model = trainer.model.float().eval()
    with torch.no_grad():
        logits = model(**batch).logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum").item()
    ref_loss, ref_logits = one_by_one(rows, lambda ids: model(input_ids=ids, use_cache=False).logits[0])
    return rows, batch, loss, per_sequence(logits, rows), ref_loss, ref_logits


def test_axolotl_recipe_equals_one_by_one(canonical, model_dir, tmp_path):
    trainer = axolotl_trainer(model_dir, export(canonical, "axolotl", tmp_path / "ax"), tmp_path / "out")
    rows, batch, loss, logits, ref_loss, ref_logits = summed(trainer, canonical)
    assert "attention_mask" not in batch and torch.equal(batch["position_ids"][0, : len(rows[0]["position_ids"])],
                                                          torch.tensor(rows[0]["position_ids"]))
    diff = assert_same(loss, logits, ref_loss, ref_logits)
    print(f"axolotl: packed {loss:.4f} vs one-by-one {ref_loss:.4f}, max logit diff {diff:.2e}")
    check_pipeline(trainer, data=canonical, layout="axolotl")  # the recipe's guard


def test_axolotl_defaults_are_refused(canonical, model_dir, tmp_path):
    """Axolotl's defaults cannot take these rows and say so: without skip_prepare_dataset it does not
    take them as tokenized (no attention_mask) and fails; sample_packing: true wants its own lengths."""
    folder = export(canonical, "axolotl", tmp_path / "ax")
    with pytest.raises(AttributeError):
        axolotl_trainer(model_dir, folder, tmp_path / "out1", skip_prepare_dataset=False)
    with pytest.raises(ValueError, match="length"):
        axolotl_trainer(model_dir, folder, tmp_path / "out2", sample_packing=True)

