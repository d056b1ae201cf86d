"""The recipes, run through the real trainers on CPU: transformers' Trainer and TRL's SFTTrainer.

A tiny random Llama (hidden 64, 2 layers, 4 heads, init std 0.5 so that a leak shows, fp32, SDPA)
gets the batches each trainer builds itself (its dataset preparation, column removal, collator
and device move: ``get_train_dataloader`` + ``_prepare_inputs``) and its own ``compute_loss``; the
summed loss and logits of every packed sequence must equal the sequence run alone. The same
trainers with their default settings silently mix packed sequences: ``check_pipeline`` must say so,
naming the cause.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import packprep  # noqa: E402
from packprep.convert import export  # noqa: E402
from packprep.training import PackedDataset, PackingIsolationError, check_pipeline, collate_packed  # noqa: E402
from packprep.training.isolation import locate_sequences  # noqa: E402
from packprep.verification import read_manifest  # noqa: E402

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER  # noqa: E402

MAX_LEN = 256
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainers")
    packprep.pack(str(EXAMPLE_CHATS), str(root / "packed"), str(EXAMPLE_TOKENIZER), max_len=MAX_LEN, num_proc=1,
                  validation_size=0.1)
    export(root / "packed", "trl", root / "trl")
    return {"packprep": root / "packed", "trl": root / "trl", "root": root}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(EXAMPLE_TOKENIZER))


def tiny_llama(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * MAX_LEN, initializer_range=0.5,
        pad_token_id=tokenizer.pad_token_id,
    )
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def common_args(root, name):
    return dict(output_dir=str(root / name), per_device_train_batch_size=2, report_to=[], use_cpu=True,
                dataloader_num_workers=0, seed=0)


def assert_trainer_batches_exact(trainer, folder, batches=2):
    """The trainer's own batches and compute_loss give the one-by-one logits and summed loss."""
    model = trainer.model
    model.eval()
    loader = iter(trainer.get_train_dataloader())
    checked = 0
    for _ in range(batches):
        inputs = trainer._prepare_inputs(next(loader))
        ids = inputs["input_ids"][0].cpu().numpy()
        labels = inputs["labels"][0]
        with torch.no_grad():
            summed = float(trainer.compute_loss(model, dict(inputs), num_items_in_batch=1))  # sum over tokens
            logits = model(**inputs).logits[0].float()
            alone_sum, worst = 0.0, 0.0
            for a, n in locate_sequences(PackedDataset(folder), ids):
                one = model(input_ids=torch.as_tensor(ids[a : a + n])[None], use_cache=False).logits[0].float()
                worst = max(worst, float((logits[a : a + n] - one).abs().max()))
                alone_sum += float(torch.nn.functional.cross_entropy(one[:-1], labels[a + 1 : a + n],
                                                                     ignore_index=-100, reduction="sum"))
                checked += 1
        assert worst < 1e-3, worst
        assert abs(summed - alone_sum) <= 1e-5 * abs(alone_sum), (summed, alone_sum)
    assert checked > 2 * batches  # rows held several packed sequences


# ---------------------------------------------------------------------------------------------
# transformers' Trainer
# ---------------------------------------------------------------------------------------------


def assert_evaluates_on_validation(trainer, folder):
    """The trainer's own evaluation loop runs on every sequence of the validation split (each starts at
    position 0), to a finite loss."""
    manifest = read_manifest(folder)
    sequences = sum(int((batch["position_ids"] == 0).sum()) for batch in trainer.get_eval_dataloader())
    assert sequences == manifest["validation"]["sequences"] > 0
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0


def test_hf_trainer_recipe(folders, tokenizer):
    folder = folders["packprep"]
    trainer = transformers.Trainer(
        model=tiny_llama(tokenizer), args=transformers.TrainingArguments(**common_args(folders["root"], "hf")),
        train_dataset=datasets.load_dataset(str(folder), split="train"), data_collator=collate_packed,
        eval_dataset=datasets.load_dataset(str(folder), split="validation"),
    )
    report = check_pipeline(trainer, data=folder)
    assert report["max_abs_diff"] < 1e-3
    assert abs(report["loss_packed"] - report["loss_alone"]) <= 1e-5 * report["loss_alone"]
    assert_trainer_batches_exact(trainer, folder)
    assert_evaluates_on_validation(trainer, folder)


@pytest.mark.parametrize("collator, cause", [
    (None, "all-ones attention_mask"),  # the default: DataCollatorWithPadding of the tokenizer
    ("flattening", "recomputed"),  # transformers' documented packing collator
])
def test_hf_trainer_defaults_are_caught(folders, tokenizer, collator, cause):
    folder = folders["packprep"]
    args = transformers.TrainingArguments(**{**common_args(folders["root"], "hf-default"),
                                             "per_device_train_batch_size": 1})
    trainer = transformers.Trainer(
        model=tiny_llama(tokenizer), args=args, train_dataset=datasets.load_dataset(str(folder), split="train"),
        processing_class=tokenizer,
        data_collator=transformers.DataCollatorWithFlattening() if collator == "flattening" else None,
    )
    with pytest.raises(PackingIsolationError, match=cause):
        check_pipeline(trainer, data=folder)


def test_check_pipeline_makes_the_trainers_own_batch(folders, tokenizer):
    """The Trainer's default collator with no processing_class cannot stack rows of different lengths: train()
    fails on its first batch, and so must the check (it makes a batch of per_device_train_batch_size rows);
    with collate_packed, those rows are one (1, T) row and every sequence of all of them is compared."""
    folder = folders["packprep"]
    args = transformers.TrainingArguments(**{**common_args(folders["root"], "hf-batch"), "per_device_train_batch_size": 4})
    train = datasets.load_dataset(str(folder), split="train")
    trainer = transformers.Trainer(model=tiny_llama(tokenizer), args=args, train_dataset=train)
    with pytest.raises(PackingIsolationError, match="its data_collator fails on 4 rows"):
        check_pipeline(trainer, data=folder)
    with pytest.raises(ValueError, match="expected sequence of length"):  # what train() meets
        next(iter(trainer.get_train_dataloader()))
    trainer = transformers.Trainer(model=tiny_llama(tokenizer), args=args, train_dataset=train,
                                   data_collator=collate_packed)
    report = check_pipeline(trainer, data=folder)
    first = next(i for i in range(len(train)) if len(train[i]["seq_lens"]) >= 2)
    assert report["sequences"] == sum(len(train[i]["seq_lens"]) for i in range(first, first + 4))
    assert report["max_abs_diff"] < 1e-3


def test_check_pipeline_names_a_kv_cache(folders, tokenizer, capsys):
    """A plain loop whose model keeps use_cache=True (the config default) and a collator without use_cache;
    a failing check prints nothing, a passing one a line."""
    model = tiny_llama(tokenizer)
    assert model.config.use_cache

    def collate_without_use_cache(rows):
        batch = collate_packed(rows)
        batch.pop("use_cache")
        return batch

    with pytest.raises(PackingIsolationError, match="KV cache"):
        check_pipeline(collate_without_use_cache, model, folders["packprep"])
    assert capsys.readouterr().out == ""
    result = check_pipeline(collate_packed, model, folders["packprep"])
    assert result["max_abs_diff"] < 1e-3
    said = capsys.readouterr().out.splitlines()
    assert said == [f"check_pipeline: ok, {result['sequences']} packed sequences ({result['tokens']:,} tokens) equal "
                    f"the same run alone (max logit difference {result['max_abs_diff']:.2g}, tolerance 0.001)"]
    check_pipeline(collate_packed, model, folders["packprep"], quiet=True)
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------
# TRL's SFTTrainer
# ---------------------------------------------------------------------------------------------


def sft_trainer(folders, tokenizer, layout="trl", evaluate=False, **config):
    import trl  # the test extra installs it: CI runs the TRL recipe

    args = trl.SFTConfig(**{**common_args(folders["root"], f"trl-{layout}"), **config})
    return trl.SFTTrainer(model=tiny_llama(tokenizer), args=args, processing_class=tokenizer,
                          train_dataset=datasets.load_dataset(str(folders[layout]), split="train"),
                          eval_dataset=datasets.load_dataset(str(folders[layout]), split="validation")
                          if evaluate else None)


def test_trl_recipe(folders, tokenizer):
    trainer = sft_trainer(folders, tokenizer, evaluate=True, padding_free=True, max_length=None,
                          dataset_kwargs={"skip_prepare_dataset": True})
    report = check_pipeline(trainer, data=folders["trl"])
    assert report["max_abs_diff"] < 1e-3
    assert abs(report["loss_packed"] - report["loss_alone"]) <= 1e-5 * report["loss_alone"]
    assert_trainer_batches_exact(trainer, folders["trl"])
    assert_evaluates_on_validation(trainer, folders["trl"])


@pytest.mark.parametrize("layout, config, cause", [
    ("trl", {}, "all-ones attention_mask"),  # SFTConfig's defaults
    ("packprep", {"padding_free": True, "max_length": None}, "recomputed"),  # no seq_lengths column
    ("trl", {"max_length": 100}, "truncation"),  # TRL's max_length below the rows' length
    ("trl", {"packing": True, "max_length": 1024}, "recomputed"),  # TRL re-packs: each row becomes one sequence
])
def test_trl_defaults_are_caught(folders, tokenizer, layout, config, cause):
    trainer = sft_trainer(folders, tokenizer, layout, **config)
    with pytest.raises(PackingIsolationError, match=cause):
        check_pipeline(trainer, data=folders[layout])


def test_check_pipeline_on_rows_of_one_sequence(folders, tokenizer):
    """--strategy pad: nothing to mix, but truncation and labels are still checked on a real row."""
    folder = folders["root"] / "pad"
    packprep.pack(str(EXAMPLE_CHATS), str(folder), str(EXAMPLE_TOKENIZER), max_len=MAX_LEN, num_proc=1,
                  strategy="pad")
    model = tiny_llama(tokenizer)
    assert check_pipeline(collate_packed, model, folder)["sequences"] == 1

    def cut(rows):
        return collate_packed([{k: v[:10] if k != "seq_lens" else [10] for k, v in row.items()} for row in rows])

    with pytest.raises(PackingIsolationError, match="truncation"):
        check_pipeline(cut, model, folder)
