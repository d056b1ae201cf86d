"""Megatron-Bridge 0.3.1 on packprep's megatron layout: its own packed dataset and collate_fn.

Its training step needs Transformer Engine and a GPU (THD attention), so the model here is a tiny
transformers Llama fed what Megatron's ``GPTSFTPackedDataset.collate_fn`` produces (``tokens``,
``position_ids`` restarting per sequence, ``labels``, ``loss_mask``) with Megatron's loss
(``sum(loss_mask * token_loss)``), compared with each sequence run alone.

Its venv and run, from the repo root (what ``tests/stacks/run.sh megatron`` does)::

    python3 -m venv .stack-venvs/megatron && .stack-venvs/megatron/bin/pip install torch==2.13.0
    .stack-venvs/megatron/bin/pip install . pytest omegaconf
    .stack-venvs/megatron/bin/pip install --no-deps megatron-bridge==0.3.1 && .stack-venvs/megatron/bin/pip install 'megatron-core>=0.15.0a0,<0.17' 'transformers<5' datasets accelerate 'hydra-core>1.3,<=1.3.2' pyyaml tqdm rich six regex
    PYTHONPATH=. .stack-venvs/megatron/bin/python -m pytest -m stacks tests/stacks/test_megatron.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.stacks
pytest.importorskip("megatron.core")


def _data_modules_without_transformer_engine():
    """``megatron.bridge``'s package __init__ imports its model bridge (AutoBridge), which needs
    Transformer Engine, a CUDA build. Its data modules need neither: register the package without
    running that __init__, so that importing them runs their real code on CPU."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None:
        pytest.skip("megatron-bridge is not installed")
    package = types.ModuleType("megatron.bridge")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("megatron.bridge", package)


_data_modules_without_transformer_engine()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from packprep.layouts.megatron import checkable, labels_after_eos  # noqa: E402
from packprep.training import PackingIsolationError, check_pipeline  # noqa: E402
from tests.conftest import EXAMPLE_TOKENIZER  # noqa: E402
from tests.stacks.conftest import (  # noqa: E402
    MAX_LEN, ROWS, assert_same, canonical_rows, export, one_by_one, per_sequence, sequences, tiny_llama,
)


def megatron_dataset(folder, **dataset_kwargs):
    """What the recipe's settings make Megatron-Bridge build: FinetuningDatasetBuilder on the exported .npy."""
    from megatron.bridge.data.builders.finetuning_dataset import FinetuningDatasetBuilder
    from megatron.bridge.data.datasets.packed_sequence import PackedSequenceSpecs
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(EXAMPLE_TOKENIZER)))
    specs = PackedSequenceSpecs(packed_sequence_size=MAX_LEN, packed_train_data_path=str(folder / "data" / "training.npy"),
                                packed_metadata_path=str(folder / "data" / "metadata.json"), pad_seq_to_mult=1)
    builder = FinetuningDatasetBuilder(dataset_root=folder / "data", tokenizer=tokenizer, seq_length=MAX_LEN,
                                       packed_sequence_specs=specs, dataset_kwargs=dataset_kwargs,
                                       do_validation=False, do_test=False)
    train, _, _ = builder.build()
    return train, tokenizer


def megatron_loss(model, batch, rows):
    """Megatron's masked summed loss, and per sequence the logits of its inputs (all tokens but its last)."""
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], use_cache=False).logits.float()
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none")
    loss = float((token_loss * batch["loss_mask"].reshape(-1)).sum())
    return loss, per_sequence(logits, rows, shorter_by=1)  # Megatron never inputs a sequence's last token


def test_megatron_packed_equals_one_by_one(canonical, tmp_path):
    folder = export(canonical, "megatron", tmp_path / "mg")
    dataset, tokenizer = megatron_dataset(folder, answer_only_loss=True)
    batch = dataset.collate_fn([dataset[i] for i in range(ROWS)])
    assert batch["cu_seqlens"].dtype == torch.int32  # THD boundaries for its attention kernel
    rows = canonical_rows(canonical)
    model = tiny_llama(1739)
    loss, logits = megatron_loss(model, batch, rows)
    # Megatron-Bridge zeroes the loss where the input token is eos: the reference drops those labels too
    eos = tokenizer.eos_id
    kept = [dict(r, labels=[x if i == 0 or r["input_ids"][i - 1] != eos else -100 for i, x in enumerate(r["labels"])])
            for r in rows]
    dropped = sum(np.count_nonzero(a != b) for r, k in zip(sequences(rows), sequences(kept)) for a, b in [(r[1], k[1])])
    import pyarrow as pa

    assert dropped == labels_after_eos(pa.Table.from_pylist(rows), eos)
    ref_loss, ref_logits = one_by_one(kept, lambda ids: model(input_ids=ids, use_cache=False).logits[0])
    diff = assert_same(loss, logits, ref_loss, [r[:-1] for r in ref_logits])
    print(f"megatron: packed {loss:.4f} vs one-by-one {ref_loss:.4f}, max logit diff {diff:.2e}, "
          f"{dropped} labels after eos dropped by its collate")
    check_pipeline(checkable(dataset), model, canonical, layout="megatron")  # the recipe's guard


def test_megatron_without_answer_only_loss_trains_prompts(canonical, tmp_path):
    """answer_only_loss=False ignores the loss_mask (trains every token but eos): detected."""
    folder = export(canonical, "megatron", tmp_path / "mg")
    dataset, _ = megatron_dataset(folder, answer_only_loss=False)
    batch = dataset.collate_fn([dataset[i] for i in range(ROWS)])
    rows = canonical_rows(canonical)
    model = tiny_llama(1739)
    loss, _ = megatron_loss(model, batch, rows)
    ref_loss, _ = one_by_one(rows, lambda ids: model(input_ids=ids, use_cache=False).logits[0])
    print(f"megatron with answer_only_loss=False: {loss:.4f} vs one-by-one {ref_loss:.4f}")
    assert abs(loss - ref_loss) > 1e-3 * abs(ref_loss)
    with pytest.raises(PackingIsolationError, match="labels"):
        check_pipeline(checkable(dataset), model, canonical, layout="megatron")


def test_megatron_refuses_packprep_default_folder(canonical):
    from megatron.bridge.data.datasets.packed_sequence import PackedSequenceSpecs

    with pytest.raises(AssertionError, match=".npy"):
        PackedSequenceSpecs(packed_sequence_size=MAX_LEN, packed_train_data_path=str(next((canonical / "data").iterdir())))
