"""torchtune 0.6.1 on packprep's torchtune layout: its recipe's data setup, collator, model and loss.

Runs ``FullFinetuneRecipeSingleDevice._setup_data`` (which picks ``padded_collate_packed`` from
``packed: True``) on the exported folder, then the recipe's own ``_loss_step`` (its label shift
and ``CEWithChunkedOutputLoss``) with torchtune's own Llama-3 builder, and compares with each
sequence run alone. 
Its venv and run, from the repo root (what ``tests/stacks/run.sh torchtune`` does)::

    python3 -m venv .stack-venvs/torchtune && .stack-venvs/torchtune/bin/pip install torch==2.13.0
    .stack-venvs/torchtune/bin/pip install . pytest omegaconf
    .stack-venvs/torchtune/bin/pip install torchtune==0.6.1 torchao==0.15.0
    PYTHONPATH=. .stack-venvs/torchtune/bin/python -m pytest -m stacks tests/stacks/test_torchtune.py
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.stacks
torchtune = pytest.importorskip("torchtune")

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from packprep.layouts.torchtune import checkable  # noqa: E402
from packprep.training import PackingIsolationError, check_pipeline  # noqa: E402
from tests.stacks.conftest import MAX_LEN, ROWS, assert_same, canonical_rows, export, one_by_one, per_sequence  # noqa: E402

VOCAB = 1739  # examples/tokenizer


def tiny_llama3():
    """torchtune's own Llama-3 builder at hidden 64, 2 layers, every weight ~ N(0, 0.5), fp32."""
    from torchtune.models.llama3 import llama3

    torch.manual_seed(0)
    model = llama3(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                   max_seq_len=2 * MAX_LEN, intermediate_dim=128)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.float().eval()


def logits_of(model, tokens, **kwargs):
    """The model's logits; the recipe's chunked-output loss makes it return them in chunks."""
    out = model(tokens, **kwargs)
    return torch.cat(out, dim=1) if isinstance(out, list) else out


def recipe(model):
    """The single-device full-finetune recipe object, with just what _setup_data and _loss_step read."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    # `tune run full_finetune_single_device` runs this file by path; recipes/ is not importable
    path = Path(torchtune.__file__).parent.parent / "recipes" / "full_finetune_single_device.py"
    spec = importlib.util.spec_from_file_location("full_finetune_single_device", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    FullFinetuneRecipeSingleDevice = module.FullFinetuneRecipeSingleDevice

    r = object.__new__(FullFinetuneRecipeSingleDevice)
    r._tokenizer = type("Tok", (), {"pad_id": 0})()
    r._loss_fn = CEWithChunkedOutputLoss()
    r._model = model
    model.set_num_output_chunks(r._loss_fn.num_output_chunks)
    r.activations_handling_ctx = contextlib.nullcontext()
    r.ignore_labels_cache = torch.full((ROWS, 1), r._loss_fn.ignore_index)
    return r


def loader(r, folder, packed=True):
    cfg = OmegaConf.create({"_component_": "packprep.layouts.torchtune.packed_dataset", "source": str(folder), "packed": packed})
    return r._setup_data(cfg, shuffle=False, batch_size=ROWS, collate_fn="torchtune.data.padded_collate_sft")


def test_torchtune_recipe_packed_equals_one_by_one(canonical, tmp_path):
    from torchtune.data import padded_collate_packed

    folder = export(canonical, "torchtune", tmp_path / "tt")
    model = tiny_llama3()
    r = recipe(model)
    batch = next(iter(loader(r, folder)))
    assert set(batch) == {"tokens", "labels", "input_pos", "mask"}  # padded_collate_packed's output
    num_tokens = (batch["labels"] != r._loss_fn.ignore_index).sum()  # as the recipe's train() counts
    with torch.no_grad():
        logits = logits_of(model, batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
        packed_loss = (r._loss_step(dict(batch)) * num_tokens).item()
    rows = canonical_rows(canonical)
    packed_logits = per_sequence(logits, rows)
    ref_loss, ref_logits = one_by_one(rows, lambda ids: logits_of(model, ids)[0])
    diff = assert_same(packed_loss, packed_logits, ref_loss, ref_logits)
    print(f"torchtune: packed {packed_loss:.4f} vs one-by-one {ref_loss:.4f}, max logit diff {diff:.2e}")
    check_pipeline(*checkable(padded_collate_packed, model), canonical, layout="torchtune")  # the recipe's guard


def test_torchtune_without_packed_true_is_refused(canonical, tmp_path):
    """The recipe's default (no `packed: True`) would collate with padded_collate_sft: refused, and the guard
    names what that collator loses."""
    from torchtune.data import padded_collate_sft

    folder = export(canonical, "torchtune", tmp_path / "tt")
    model = tiny_llama3()
    with pytest.raises(ValueError, match="packed: True"):
        loader(recipe(model), folder, packed=False)
    with pytest.raises(PackingIsolationError, match="No position_ids"):
        check_pipeline(*checkable(padded_collate_sft, model), canonical, layout="torchtune")


def test_torchtune_packed_dataset_on_default_rows_is_detected(canonical):
    """torchtune's own PackedDataset over packprep's default rows merges each row's sequences."""
    from torchtune.data import padded_collate_packed
    from torchtune.datasets import PackedDataset

    rows = canonical_rows(canonical)
    samples = [{"tokens": r["input_ids"], "labels": r["labels"]} for r in rows]
    packs = PackedDataset(samples, max_seq_len=MAX_LEN)
    model = tiny_llama3()
    r = recipe(model)
    batch = padded_collate_packed([packs[i] for i in range(ROWS)])
    num_tokens = (batch["labels"] != r._loss_fn.ignore_index).sum()
    with torch.no_grad():
        packed_loss = (r._loss_step(dict(batch)) * num_tokens).item()
    ref_loss, _ = one_by_one(rows, lambda ids: logits_of(model, ids)[0])
    print(f"torchtune PackedDataset on default rows: {packed_loss:.4f} vs one-by-one {ref_loss:.4f}")
    assert abs(packed_loss - ref_loss) > 1e-3 * abs(ref_loss)
