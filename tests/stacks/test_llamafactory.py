"""LLaMA-Factory on packprep's llamafactory layout: its own get_dataset, collator and model loader.

Wires the pieces exactly as its ``run_sft`` does (``get_train_args`` -> ``load_tokenizer`` ->
``get_dataset`` with ``tokenized_path`` -> ``load_model`` -> ``SFTDataCollatorWith4DAttentionMask``)
on a tiny random Llama saved to disk, and compares with each sequence run alone.

Its venv and run, from the repo root (what ``tests/stacks/run.sh llamafactory`` does)::

    python3 -m venv .stack-venvs/llamafactory && .stack-venvs/llamafactory/bin/pip install torch==2.13.0
    .stack-venvs/llamafactory/bin/pip install . pytest omegaconf
    .stack-venvs/llamafactory/bin/pip install llamafactory==0.9.5 torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
    PYTHONPATH=. .stack-venvs/llamafactory/bin/python -m pytest -m stacks tests/stacks/test_llamafactory.py
"""

from __future__ import annotations


import pytest

pytestmark = pytest.mark.stacks
llamafactory = pytest.importorskip("llamafactory")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from packprep.training import PackingIsolationError, check_pipeline  # noqa: E402

from tests.stacks.conftest import MAX_LEN, ROWS, assert_same, canonical_rows, export, one_by_one, per_sequence  # noqa: E402


def run_sft_pieces(model_dir, tokenized_path, out, neat_packing):
    """What llamafactory.train.sft.workflow.run_sft builds before the trainer: dataset, model, collator."""
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    model_args, data_args, training_args, finetuning_args, _ = get_train_args(
        dict(model_name_or_path=str(model_dir), stage="sft", do_train=True, finetuning_type="full",
             tokenized_path=str(tokenized_path), dataset="packprep", neat_packing=neat_packing, cutoff_len=MAX_LEN,
             template="empty", output_dir=str(out), per_device_train_batch_size=ROWS, report_to="none",
             use_cpu=True)
    )
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    dataset = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)["train_dataset"]
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, training_args.do_train)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=-100,
        block_diag_attn=model_args.block_diag_attn, neat_packing=data_args.neat_packing,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype, **tokenizer_module,
    )
    return dataset, model.float().eval(), collator


def packed_loss_and_logits(model, batch, rows):
    with torch.no_grad():
        logits = model(**batch).logits.float()
    labels = batch["labels"]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum").item()
    return loss, per_sequence(logits, rows)


def test_llamafactory_neat_packing_equals_one_by_one(canonical, model_dir, tmp_path):
    dataset, model, collator = run_sft_pieces(model_dir, export(canonical, "llamafactory", tmp_path / "lf"),
                                              tmp_path / "out", neat_packing=True)
    rows = canonical_rows(canonical)
    batch = collator([dataset[i] for i in range(ROWS)])
    loss, logits = packed_loss_and_logits(model, batch, rows)
    ref_loss, ref_logits = one_by_one(rows, lambda ids: model(input_ids=ids, use_cache=False).logits[0])
    diff = assert_same(loss, logits, ref_loss, ref_logits)
    print(f"llamafactory: packed {loss:.4f} vs one-by-one {ref_loss:.4f}, max logit diff {diff:.2e}")
    check_pipeline(collator, model, canonical, layout="llamafactory")  # the recipe's guard passes


def test_llamafactory_without_neat_packing_leaks(canonical, model_dir, tmp_path):
    """Its default (no neat_packing) feeds the index mask as a plain 2-D mask: detected."""
    dataset, model, collator = run_sft_pieces(model_dir, export(canonical, "llamafactory", tmp_path / "lf"),
                                              tmp_path / "out", neat_packing=False)
    rows = canonical_rows(canonical)
    loss, _ = packed_loss_and_logits(model, collator([dataset[i] for i in range(ROWS)]), rows)
    ref_loss, _ = one_by_one(rows, lambda ids: model(input_ids=ids, use_cache=False).logits[0])
    print(f"llamafactory without neat_packing: {loss:.4f} vs one-by-one {ref_loss:.4f}")
    assert abs(loss - ref_loss) > 1e-3 * abs(ref_loss)
    with pytest.raises(PackingIsolationError, match="neat_packing: true"):
        check_pipeline(collator, model, canonical, layout="llamafactory")


def test_llamafactory_refuses_packprep_default_folder(canonical, model_dir, tmp_path):
    """tokenized_path on packprep's default layout: load_from_disk refuses it, loudly."""
    with pytest.raises(Exception, match="(?i)directory|dataset|not found|neither"):
        run_sft_pieces(model_dir, canonical, tmp_path / "out", neat_packing=True)
