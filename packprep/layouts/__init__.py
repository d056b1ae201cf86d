"""The layouts of training stacks that load packed rows their own way: one adapter module each.

``torchtune``, ``llamafactory``, ``axolotl`` and ``megatron`` are described here (``STACKS``, with
their recipes) and registered by ``packprep.layout``, which imports this package: the import goes one
way. The adapters import pyarrow, so they are loaded only when a conversion runs (``import packprep``
stays light).
"""

from __future__ import annotations

from importlib import import_module

TABLE, SAVE_TO_DISK, FILES = "table", "save_to_disk", "files"  # how a layout is stored: ``Layout.writes``


def guarded_recipe(call: str) -> str:
    return (f"First, always: `{call}` runs one packed row through exactly this setup and raises, naming the "
            "cause, if packed sequences would see each other (an attention mask, recomputed position ids, "
            "dropped columns, truncation, a KV cache).\n\n")


def _adapter(module: str, name: str):
    def call(*args):
        return getattr(import_module(f"{__name__}.{module}"), name)(*args)

    call.__name__ = f"{module}.{name}"
    return call


TORCHTUNE_RECIPE = guarded_recipe('check_pipeline(*checkable(padded_collate_packed, model), "packed/", layout="torchtune")') + """\
```yaml
# packprep export packed/ --to torchtune packed-tt/   (a full_finetune_* or lora_finetune_* recipe config)
dataset:
  _component_: packprep.layouts.torchtune.packed_dataset
  source: packed-tt/
  packed: True          # the recipe then collates with padded_collate_packed: seq_lens -> block-causal mask
tokenizer:
  max_seq_len: 2048     # = --max-len: every row is padded to it
```
```python
from torchtune.data import padded_collate_packed
from packprep.layouts.torchtune import checkable
from packprep.training import check_pipeline
check_pipeline(*checkable(padded_collate_packed, model), "packed/", layout="torchtune")  # your torchtune model
```
Rows are what torchtune's `PackedDataset` yields: `tokens`, `labels` (unshifted: the recipe shifts
them), `input_pos` and `seq_lens`, padded to `--max-len` with the padding as one more block. What
breaks packing here: leaving out `packed: True` (the recipe would collate with `padded_collate_sft`,
which drops `seq_lens` and `input_pos`; the component refuses to run without it), and torchtune's
own `PackedDataset` over packprep rows (it packs each row as ONE sequence)."""

LLAMAFACTORY_RECIPE = guarded_recipe('check_pipeline(collator, model, "packed/", layout="llamafactory")') + """\
```yaml
# packprep export packed/ --to llamafactory packed-lf/
stage: sft
tokenized_path: packed-lf/data   # load_from_disk; LLaMA-Factory then ignores its dataset arguments
dataset: packprep                # any name: its argument check wants one; unused with tokenized_path
neat_packing: true               # the 1-based sequence index in attention_mask -> block-diagonal attention
cutoff_len: 2048                 # = --max-len (rows are padded to it, rounded up to a multiple of 8)
```
```python
from llamafactory.data import SFTDataCollatorWith4DAttentionMask
from packprep.training import check_pipeline
collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8,
    block_diag_attn=True, neat_packing=True, attn_implementation=model.config._attn_implementation,
    compute_dtype=torch.float32, tokenizer=tokenizer)   # as llamafactory's run_sft builds it
check_pipeline(collator, model, "packed/", layout="llamafactory")
```
Rows are what its own neat packing writes: `input_ids`, `labels`, `position_ids` (restarting) and an
`attention_mask` holding each token's 1-based sequence number, padded to one length. What breaks
packing here: `neat_packing: false` (the default: the index mask is used as a plain padding mask,
so the sequences of a row see each other), and `tokenized_path` on a folder in another layout
(`load_from_disk` refuses it)."""

AXOLOTL_RECIPE = guarded_recipe('check_pipeline(trainer, data="packed/", layout="axolotl")') + """\
```yaml
# packprep export packed/ --to axolotl packed-ax/
datasets:
  - path: packed-ax/        # pre-tokenized rows: input_ids, labels, position_ids, no attention_mask
skip_prepare_dataset: true  # hand the rows over as they are (no position_ids rewrite, no length filter)
sample_packing: false       # its own packing: would treat every packed row as ONE sequence
sequence_len: 2048          # = --max-len
```
Axolotl's collator then pads `labels` with -100 and `position_ids` with a new `0, 1, ...`, adds
no `attention_mask` (the rows have none), and axolotl turns `use_cache` off: transformers splits
every row at its restarted `position_ids` (SDPA, eager and flash-attention 2). Axolotl's defaults
refuse these rows loudly: without `skip_prepare_dataset` it does not take rows without an
`attention_mask` as tokenized (an error), and `sample_packing: true` wants a `length` column (an
error; it would also rewrite `position_ids` to `0..n-1` per row, one sequence a row). Do not add an
`attention_mask`: an all-ones mask switches transformers' splitting off."""


MEGATRON_RECIPE = guarded_recipe('check_pipeline(checkable(dataset), hf_model, "packed/", layout="megatron")') + """\
```python
# packprep export packed/ --to megatron packed-mg/   ->  packed-mg/data/training.npy, metadata.json
from megatron.bridge.data.datasets.packed_sequence import PackedSequenceSpecs
cfg.dataset.packed_sequence_specs = PackedSequenceSpecs(
    packed_sequence_size=2048,                                   # = --max-len
    packed_train_data_path="packed-mg/data/training.npy",        # used as is: nothing is re-packed
    packed_metadata_path="packed-mg/data/metadata.json",
    pad_seq_to_mult=1)                                           # no context parallelism (see below)
cfg.dataset.dataset_root = "packed-mg/data"
cfg.dataset.do_validation = cfg.dataset.do_test = False          # (or export a validation folder too)
cfg.dataset.dataset_kwargs = {"answer_only_loss": True}          # the default: use the shifted loss_mask
cfg.train.micro_batch_size = 1                                   # Megatron's rule for packed data
```
```python
from megatron.bridge.data.datasets.sft import create_sft_dataset
from packprep.layouts.megatron import checkable
from packprep.training import check_pipeline
dataset = create_sft_dataset(Path("packed-mg/data/training.npy"), tokenizer=tokenizer, seq_length=2048)
check_pipeline(checkable(dataset), hf_model, "packed/", layout="megatron")   # hf_model: the checkpoint in transformers
```
Each row of `training.npy` is what Megatron-Bridge's own packer writes: `input_ids`, `seq_start_id`
and a `loss_mask` already shifted by one (`loss_mask[t]`: is token `t + 1` trained). Its
`collate_fn` cuts every sequence into inputs `[:-1]` and targets `[1:]`, restarts `position_ids`
and passes `cu_seqlens` to the THD attention kernel. The guard runs that collate and a transformers
model of the same checkpoint (Megatron's own model needs Transformer Engine and a GPU). What breaks
here: `answer_only_loss: false` (trains every token but eos, prompts included), `pad_seq_to_mult > 1`
(context parallelism: it assumes sequences padded with eos that these rows do not have). One
difference no setting removes: megatron-bridge 0.3.1 zeroes the loss wherever the INPUT token is the
tokenizer's eos, so a template that trains a token after its end-of-turn (ChatML's
`<|im_end|>\\n` when `<|im_end|>` is eos) loses it there; `packprep export` counts and warns."""

# the fields of each stack's ``packprep.layout.Layout``, in the order the registry lists them
STACKS = (
    dict(name="torchtune", stack="torchtune's recipes (packed: True)", writes=TABLE, recipe=TORCHTUNE_RECIPE,
         test="tests/stacks/test_torchtune.py", convert=_adapter("torchtune", "convert")),
    dict(name="llamafactory", stack="LLaMA-Factory's tokenized_path with neat_packing", writes=SAVE_TO_DISK,
         recipe=LLAMAFACTORY_RECIPE, test="tests/stacks/test_llamafactory.py",
         convert=_adapter("llamafactory", "convert")),
    dict(name="megatron", stack="Megatron-Bridge / NeMo packed SFT (.npy)", writes=FILES, recipe=MEGATRON_RECIPE,
         test="tests/stacks/test_megatron.py", convert=_adapter("megatron", "convert"),
         write_files=_adapter("megatron", "write_files")),
    dict(name="axolotl", stack="Axolotl, pre-tokenized with skip_prepare_dataset", writes=TABLE,
         recipe=AXOLOTL_RECIPE, test="tests/stacks/test_axolotl.py", convert=_adapter("axolotl", "convert")),
)
