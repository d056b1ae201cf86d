"""Shared-prefix rows are checked by what reads them, not trusted to the manifest: ``repack`` refuses
tree rows whatever the manifest says, and ``collate_tree`` (so ``check_pipeline`` too) refuses a row
whose trees break an invariant: a subtree reaching into the next record or past the row, positions
that are not depths, a trained branch head. Where these were trusted, a tree folder whose manifest
claimed the flat layout became a flat folder that verified, and a descendant reaching past its record
was caught only by a logits tolerance."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import packprep
from packprep.layout import IGNORE_INDEX as I
from packprep.prefix_tree import build_tree

from .conftest import needs_fixtures
from .test_bad_inputs import assert_clean_exit, assert_nothing_left, invoke

# two records' trees, side by side in one row (seq_lens [12, 7])
FIRST = build_tree([([1, 2, 3, 4, 5], [I, I, I, 4, 5]), ([1, 2, 3, 6, 7, 8, 9], [I, I, I, I, I, 8, 9]),
                    ([1, 2, 3, 6, 7, 10], [I, I, I, I, I, 10])])
SECOND = build_tree([([5, 6, 7], [I, 6, 7]), ([5, 6, 8], [I, I, 8]), ([9, 6], [9, 6])])


def row() -> dict:
    return {"input_ids": np.concatenate([FIRST.input_ids, SECOND.input_ids]),
            "labels": np.concatenate([FIRST.labels, SECOND.labels]),
            "position_ids": np.concatenate([FIRST.position_ids, SECOND.position_ids]),
            "tree_descendants": np.concatenate([FIRST.descendants, SECOND.descendants]),
            "seq_lens": np.array([len(FIRST), len(SECOND)])}


def _into_next_record(r):
    r["tree_descendants"][len(FIRST) - 1] = 3  # the first tree's last leaf reaches into the second record


def _past_the_row(r):
    r["tree_descendants"][-1] = 4


def _depth(r):
    r["position_ids"][3] = 7


def _head_trained(r):
    r["labels"][5] = r["input_ids"][5]  # the copy of the branch point heading the second branch


def _head_not_a_copy(r):
    r["input_ids"][5] = 99


BROKEN = {"a descendant reaches into the next record": (_into_next_record, "a subtree reaches past the row"),
          "a descendant reaches past the row": (_past_the_row, "a subtree reaches past the row"),
          "a position is not a depth": (_depth, "position_ids are not each token's depth"),
          "a branch head is trained": (_head_trained, "a root or branch head is trained"),
          "a branch head is not a copy": (_head_not_a_copy, "a branch head is not a copy of its branch point")}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_collate_tree_checks_the_tree_invariants_itself(name):
    pytest.importorskip("torch")
    from packprep.training import collate_tree
    from packprep.training.tree import TreeRowsError

    assert collate_tree(row())["tree_descendants"].shape == (1, len(FIRST) + len(SECOND))
    damage, message = BROKEN[name]
    broken = row()
    damage(broken)
    with pytest.raises(TreeRowsError, match=message):
        collate_tree(broken)


@pytest.fixture(scope="module")
def tree_folder(tmp_path_factory, template_folder):
    from .zoo_shapes import shape_records

    root = tmp_path_factory.mktemp("tree")
    data = root / "records.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in shape_records("reasoning_content", 6)), encoding="utf-8")
    packprep.pack([str(data)], str(root / "tree"), tokenizer=template_folder("qwen3"), max_len=1024, num_proc=1,
                  shared_prefix=True)
    return root / "tree"


def claim_flat(folder, drop_column: bool):
    """The manifest edited to say the flat layout of one sequence a record; ``drop_column``: the shards'
    tree column removed too."""
    path = folder / "packprep.json"
    manifest = json.loads(path.read_text())
    manifest["layout"] = "packprep"
    del manifest["config"]["shared_prefix"]
    manifest["counts"]["extra_sequences"] = 0  # as if each record were one sequence
    if drop_column:
        for entry in manifest["shards"]:
            shard = folder / entry["path"]
            table = pq.read_table(shard)
            pq.write_table(table.drop_columns(["tree_descendants"]), shard)
            entry["bytes"] = shard.stat().st_size
    path.write_text(json.dumps(manifest, indent=2))


@needs_fixtures
@pytest.mark.parametrize("drop_column", [False, True], ids=["manifest", "manifest-and-column"])
def test_repack_refuses_tree_rows_whose_manifest_claims_the_flat_layout(tree_folder, tmp_path, drop_column):
    folder = tmp_path / "forged"
    shutil.copytree(tree_folder, folder)
    assert int(pa.compute.sum(pq.read_table(next((folder / "data").glob("*.parquet"))).column("seq_lens")
                              .combine_chunks().flatten()).as_py()) > 0
    claim_flat(folder, drop_column)
    out = tmp_path / "out"
    result = invoke("repack", folder, "-o", out, "--num-proc", 1)
    assert_clean_exit(result, 3)
    assert ("holds shared-prefix rows (tree_descendants), whatever the manifest says" if not drop_column
            else "a sequence's position_ids do not count 0, 1, 2") in " ".join(result.output.split())
    assert_nothing_left(tmp_path, out)
