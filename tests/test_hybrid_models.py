"""Hybrid models (Qwen3.5, Qwen3-Next, Mamba-2 hybrids, LFM2): packed sequences kept apart in every layer.

Tiny random models built from transformers' own configs (hidden 64, 2-4 layers so that each layer type
appears, init std 0.5 so that a leak shows, fp32, SDPA, CPU). With ``register_packed_layers`` every packed
sequence's logits (and gradients) equal the sequence run alone, through ``collate_packed`` and through
the Trainer and TRL recipes; with the boundaries withheld, ``check_pipeline`` names the leaking layer
type; a layer type packprep does not cover is refused before training.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import packprep  # noqa: E402
from packprep.convert import export  # noqa: E402
from packprep.training.hybrid import FALLBACK  # noqa: E402
from packprep.training import (PackedDataset, PackingIsolationError, check_pipeline, collate_packed,  # noqa: E402
                            register_packed_layers)

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER, slow_but  # noqa: E402
from .test_trainers import assert_trainer_batches_exact, common_args  # noqa: E402

ATOL = 1e-3  # fp32 rounding (the batched fallback sums in another order than a sequence alone); a leak is 11 to 20
torch.set_num_threads(min(2, torch.get_num_threads()))

# family -> (the layer type packprep reports, the tiny model's config)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
GDN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
           linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"], num_hidden_layers=2, **HEADS)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16, num_hidden_layers=2, **HEADS)
FAMILIES = {
    "qwen3_5": ("gated_deltanet", lambda **c: transformers.Qwen3_5TextConfig(**GDN, **c)),
    "qwen3_next": ("gated_deltanet", lambda **c: transformers.Qwen3NextConfig(
        **GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        **c)),
    "bamba": ("mamba2", lambda **c: transformers.BambaConfig(**MAMBA2, attn_layer_indices=[1], **c)),
    "nemotron_h": ("mamba2", lambda **c: transformers.NemotronHConfig(
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], head_dim=16, mamba_num_heads=4,
        mamba_head_dim=32, n_groups=1, ssm_state_size=16, chunk_size=16, **HEADS, **c)),
    "falcon_h1": ("mamba2", lambda **c: transformers.FalconH1Config(**MAMBA2, mamba_d_ssm=128, **c)),
    "lfm2": ("short_conv", lambda **c: transformers.Lfm2Config(
        num_hidden_layers=2, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False, **HEADS, **c)),
}


def tiny(family: str, vocab: int):
    torch.manual_seed(0)
    config = FAMILIES[family][1](vocab_size=vocab, hidden_size=64, intermediate_size=128, initializer_range=0.5,
                                 max_position_embeddings=512, pad_token_id=0, use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    try:
        used = register_packed_layers(model)
    except RuntimeError as exc:  # an older transformers' modeling code has no function packprep replaces
        assert f"transformers {transformers.__version__} has no" in str(exc)
        pytest.skip(str(exc))
    assert used == {FAMILIES[family][0]: FALLBACK}
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    packprep.pack(str(EXAMPLE_CHATS), str(root / "packed"), str(EXAMPLE_TOKENIZER), max_len=256, num_proc=1)
    export(root / "packed", "trl", root / "trl")
    return {"packprep": root / "packed", "trl": root / "trl", "root": root}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))


def test_collate_packed_emits_seq_idx():
    batch = collate_packed([{"input_ids": np.arange(5), "labels": np.arange(5), "seq_lens": [3, 2]},
                            {"input_ids": np.arange(2), "labels": np.arange(2), "seq_lens": [2]}])
    assert batch["seq_idx"].dtype == torch.int32
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2]]


# the fast lane keeps lfm2, the quickest; the others (qwen3_5's gated delta net, bamba's mamba2: a family a
# layer type) are marked slow, with the trainers (tens of seconds on 2 shared cores)
ONE_A_TYPE = slow_but({"lfm2"}, FAMILIES)


@pytest.mark.parametrize("family", ONE_A_TYPE)
def test_packed_equals_alone(family, folders, tokenizer):
    """Logits and gradients of two packed rows in one (1, T) batch equal each sequence's run alone."""
    model = tiny(family, len(tokenizer))
    data = PackedDataset(folders["packprep"])
    batch = collate_packed([data[0], data[1]])
    cu = batch["cu_seq_lens_q"].tolist()
    assert len(cu) >= 4  # three sequences or more: boundaries inside a row and between rows
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    out = model(**batch)
    packed_loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[1:], ignore_index=-100, reduction="sum")
    packed_grads = torch.autograd.grad(packed_loss, list(model.parameters()), allow_unused=True)
    alone_loss = 0.0
    for a, b in zip(cu[:-1], cu[1:]):
        one = model(input_ids=ids[a:b][None], use_cache=False).logits[0]
        torch.testing.assert_close(out.logits[0, a:b], one, atol=ATOL, rtol=0)
        alone_loss = alone_loss + torch.nn.functional.cross_entropy(one[:-1], labels[a + 1 : b], ignore_index=-100,
                                                                    reduction="sum")
    torch.testing.assert_close(packed_loss, alone_loss, atol=ATOL, rtol=1e-5)
    alone_grads = torch.autograd.grad(alone_loss, list(model.parameters()), allow_unused=True)
    for got, want in zip(packed_grads, alone_grads):
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_trainer_recipe(family, folders, tokenizer):
    """The recipe: register_packed_layers, collate_packed, check_pipeline, then the Trainer trains."""
    folder = folders["packprep"]
    args = transformers.TrainingArguments(**common_args(folders["root"], f"hf-{family}"), max_steps=2)
    trainer = transformers.Trainer(model=tiny(family, len(tokenizer)), args=args, data_collator=collate_packed,
                                   train_dataset=datasets.load_dataset(str(folder), split="train"))
    report = check_pipeline(trainer, data=folder)
    assert report["max_abs_diff"] < ATOL and report["sequences"] >= 2
    assert_trainer_batches_exact(trainer, folder)
    assert np.isfinite(trainer.train().training_loss)


@pytest.mark.slow
def test_trl_recipe_qwen3_5(folders, tokenizer):
    trl = pytest.importorskip("trl")
    args = trl.SFTConfig(**common_args(folders["root"], "trl-qwen3_5"), padding_free=True, max_length=None,
                         dataset_kwargs={"skip_prepare_dataset": True})
    trainer = trl.SFTTrainer(model=tiny("qwen3_5", len(tokenizer)), args=args, processing_class=tokenizer,
                             train_dataset=datasets.load_dataset(str(folders["trl"]), split="train"))
    assert check_pipeline(trainer, data=folders["trl"])["max_abs_diff"] < ATOL
    assert_trainer_batches_exact(trainer, folders["trl"])


@pytest.mark.parametrize("family", ONE_A_TYPE)
def test_check_pipeline_names_the_leaking_layer(family, folders, tokenizer):
    """Boundaries withheld (position_ids restart, no cu_seq_lens/seq_idx): attention is isolated, the
    recurrent or convolutional layer is not, and check_pipeline says which one."""
    def without_boundaries(rows):
        batch = collate_packed(rows)
        return {k: v for k, v in batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                             "max_length_k", "seq_idx")}

    layer_type = FAMILIES[family][0]
    with pytest.raises(PackingIsolationError, match=f"{layer_type}.*not the attention") as caught:
        check_pipeline(without_boundaries, tiny(family, len(tokenizer)), folders["packprep"])
    assert "attention implementation" not in str(caught.value)


def test_transformers_refusal_is_named(folders, tokenizer):
    """Without register_packed_layers, transformers' CPU fallback refuses the boundaries; packprep names the layer."""
    torch.manual_seed(0)
    try:
        config = transformers.GraniteMoeHybridConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            initializer_range=0.5, layer_types=["linear_attention", "full_attention"], mamba_n_heads=4,
            mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16, num_local_experts=0,
            shared_intermediate_size=128, **HEADS)
    except ValueError as exc:  # transformers 4's config names its layer types mamba/attention
        pytest.skip(f"transformers {transformers.__version__}: {exc}")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(PackingIsolationError, match="'mamba2'.*GraniteMoeHybridMambaLayer.*register_packed_layers"):
        check_pipeline(collate_packed, model, folders["packprep"])


def test_uncovered_layer_type_is_refused():
    """A stateful layer type packprep has no implementation for: refused before training, named."""
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, state_size=8)
    model = transformers.MambaForCausalLM(config)
    with pytest.raises(PackingIsolationError, match=r"backbone\.layers\.0 \(MambaBlock\).*padded rows"):
        register_packed_layers(model)
