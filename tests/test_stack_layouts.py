"""Literal-tensor tests of the torchtune, LLaMA-Factory, Axolotl and Megatron adapters.

Two hand-written canonical rows in, exact columns out. The stacks' own code runs on these layouts
in ``tests/stacks/`` (marker ``stacks``, separate venvs); these hold the conversions themselves
in ordinary CI.
"""

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from packprep.layouts import axolotl, llamafactory, megatron, torchtune

X = -100
ROWS = {
    # row 0: sequences of 3 and 2 tokens; row 1: one sequence of 4 (its first two untrained)
    "input_ids": [[10, 11, 12, 20, 21], [30, 31, 32, 33]],
    "labels": [[X, 11, 12, X, 21], [X, X, 32, 33]],
    "position_ids": [[0, 1, 2, 0, 1], [0, 1, 2, 3]],
    "seq_lens": [[3, 2], [4]],
    "source_index": [[0, 1], [2]],
}


def canonical(rows=ROWS) -> pa.Table:
    types = {"source_index": pa.list_(pa.int64())}
    return pa.table({k: pa.array(v, types.get(k, pa.list_(pa.int32()))) for k, v in rows.items()})


def context(max_len, pad_token_id=0, manifest=None):
    return SimpleNamespace(max_len=max_len, pad_token_id=pad_token_id, manifest=manifest or {})


def test_torchtune_pads_to_max_seq_len_like_packed_dataset():
    out = torchtune.convert(canonical(), context(6, pad_token_id=7)).to_pydict()
    assert out["tokens"] == [[10, 11, 12, 20, 21, 7], [30, 31, 32, 33, 7, 7]]
    assert out["labels"] == [[X, 11, 12, X, 21, X], [X, X, 32, 33, X, X]]  # unshifted: the recipe shifts
    assert out["input_pos"] == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]  # padding continues, as _pad_pack
    assert out["seq_lens"] == [[3, 2, 1], [4, 2]]  # padding is one more block
    assert out["source_index"] == [[0, 1], [2]]


def test_torchtune_full_row_gets_no_padding_block():
    out = torchtune.convert(canonical(), context(5)).to_pydict()
    assert out["seq_lens"] == [[3, 2], [4, 1]]
    assert out["input_pos"][0] == [0, 1, 2, 0, 1]


def test_torchtune_refuses_rows_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="torchtune .max_seq_len. stacks rows of 4 tokens"):
        torchtune.convert(canonical(), context(4))


def test_torchtune_component_refuses_without_packed_true(tmp_path):
    with pytest.raises(ValueError, match="packed: True"):
        torchtune.packed_dataset(None, source=str(tmp_path))


def test_llamafactory_neat_packing_rows():
    out = llamafactory.convert(canonical(), context(6, pad_token_id=7)).to_pydict()
    assert list(out) == ["input_ids", "attention_mask", "position_ids", "labels"]
    # width: --max-len rounded up to its collator's pad_to_multiple_of=8
    assert out["input_ids"] == [[10, 11, 12, 20, 21, 7, 7, 7], [30, 31, 32, 33, 7, 7, 7, 7]]
    assert out["attention_mask"] == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]  # 1-based sequence index
    assert out["position_ids"] == [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert out["labels"] == [[X, 11, 12, X, 21, X, X, X], [X, X, 32, 33, X, X, X, X]]


def test_llamafactory_width_is_a_multiple_of_8():
    assert [llamafactory.width(n) for n in (1, 8, 9, 2048, 2049)] == [8, 8, 16, 2048, 2056]


def test_megatron_rows_shift_the_loss_mask():
    rows = megatron.megatron_rows(canonical())
    assert rows == [
        # loss_mask[t]: is token t+1 of the same sequence trained; 0 at each sequence's last token
        {"input_ids": [10, 11, 12, 20, 21], "loss_mask": [1, 1, 0, 1, 0], "seq_start_id": [0, 3]},
        {"input_ids": [30, 31, 32, 33], "loss_mask": [0, 1, 1, 0], "seq_start_id": [0]},
    ]
    assert all(type(r["seq_start_id"]) is list for r in rows)  # Megatron appends with `+ [len]`


def test_megatron_mask_ends_sequences_even_if_a_first_label_were_trained():
    rows = dict(ROWS, labels=[[X, 11, 12, 20, 21], [X, X, 32, 33]])  # 20 starts sequence 2
    assert megatron.megatron_rows(canonical(rows))[0]["loss_mask"] == [1, 1, 0, 1, 0]


def test_megatron_counts_labels_its_collate_drops_after_eos():
    # Megatron-Bridge zeroes the loss where the INPUT token is eos: 12 -> 20 is not trained there
    assert megatron.labels_after_eos(canonical(), eos_id=11) == 1  # 11 -> 12 is trained
    assert megatron.labels_after_eos(canonical(), eos_id=12) == 0  # 12 ends its sequence
    assert megatron.labels_after_eos(canonical(), eos_id=99) == 0


def test_megatron_write_files(tmp_path):
    with pytest.warns(UserWarning, match="1 trained labels follow the eos token"):
        entries = megatron.write_files([megatron.convert(canonical())], tmp_path, context(6, manifest={"tokenizer": {"eos_token_id": 31}}))
    data = np.load(tmp_path / "data" / "training.npy", allow_pickle=True)
    assert list(data) == megatron.megatron_rows(canonical())
    assert entries[0]["path"] == "data/training.npy" and entries[0]["rows"] == 2 and entries[0]["tokens"] == 9
    import json

    meta = json.loads((tmp_path / "data" / "metadata.json").read_text())[0]
    assert meta["max_samples_per_bin"] == 2 and meta["dataset_max_seqlen"] == 4 and meta["min_packed_seqlen"] == 4


def test_axolotl_keeps_rows_without_mask_or_sequence_columns():
    out = axolotl.convert(canonical(), context(6)).to_pydict()
    # no attention_mask: axolotl's collator then passes none, and transformers splits at position_ids
    assert out == {k: ROWS[k] for k in ("input_ids", "labels", "position_ids")}


@pytest.mark.parametrize("adapter", [torchtune, llamafactory, axolotl])
def test_an_empty_row_group_converts_to_an_empty_table(adapter):
    empty = canonical().slice(0, 0)
    assert adapter.convert(empty, context(6)).num_rows == 0
