"""``check_pipeline`` for shared-prefix rows (``pack --shared-prefix``): the batch the user's pipeline
makes of a stored tree row must reach the tree attention as stored, and every root-to-leaf path's
logits must equal the path run alone as one plain sequence.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..layout import IGNORE_INDEX
from .parity import PackingIsolationError, logits_of, model_dtype, tolerance
from .tree import TREE_ATTENTION_NAME, TREE_COLUMN, TreeRowsError, check_tree_row, collate_tree, refuse_model


def check_tree_batch(model, batch: Mapping[str, Any], truth: Mapping[str, Any], dropped: Sequence[str],
                     atol: float | None = None, max_paths: int = 16) -> dict:
    """``check_pipeline`` for a shared-prefix row: the batch the user's pipeline made from it must
    carry the row's columns as stored, reach the tree attention, and give each root-to-leaf path's
    logits equal to that path run alone as one plain sequence (the first ``max_paths`` paths)."""
    from ..prefix_tree import TreeRow, paths_indices

    head = "shared-prefix rows are NOT read as trees in this pipeline: "
    if batch.get(TREE_COLUMN) is None:
        lost = (f" The stack dropped the columns {list(dropped)} before the collator: pass "
                "TrainingArguments(remove_unused_columns=False)." if dropped else "")
        raise PackingIsolationError(
            head + "the batch carries no tree_descendants, so the row is read as ordinary packed sequences and every "
            "branch attends to its siblings. Collate with packprep.training.collate_tree." + lost)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != TREE_ATTENTION_NAME:
        raise PackingIsolationError(head + f"attn_implementation is {impl!r}, which ignores tree_descendants; load the "
                                    "model with attn_implementation=register_tree_attention()")
    refuse_model(model)
    device = next(model.parameters()).device
    n = len(truth["input_ids"])
    for name in ("input_ids", "labels", "position_ids", TREE_COLUMN):
        if not np.array_equal(_flat(batch[name][0])[:n], _flat(truth[name])):
            raise PackingIsolationError(head + f"the batch's {name} are not the stored row's; feed rows as they are stored")
    try:  # the stored row's invariants, checked here: a logits tolerance cannot tell a thin leak
        check_tree_row(truth)
    except TreeRowsError as exc:
        raise PackingIsolationError(head + str(exc)) from None
    row = TreeRow(*(np.asarray(truth[c]) for c in ("input_ids", "labels", "position_ids", TREE_COLUMN)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
            logits = logits_of(model(**moved))
            diffs, largest = [], 0.0
            for chain in paths_indices(row)[:max_paths]:
                m = len(chain)
                alone = collate_tree({"input_ids": row.input_ids[chain], "labels": np.full(m, IGNORE_INDEX),
                                      "position_ids": np.arange(m), TREE_COLUMN: np.arange(m)[::-1].copy()})
                one = logits_of(model(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                       for k, v in alone.items() if k != "labels"}))
                diffs.append(float((logits[torch.as_tensor(chain, device=device)] - one).abs().max()))
                largest = max(largest, float(one.abs().max()))
    finally:
        if was_training:
            model.train()
    tol = tolerance(model_dtype(model), largest, atol)
    if max(diffs) > tol:
        raise PackingIsolationError(head + f"a path's logits differ from the path run alone by {max(diffs):.3g} "
                                    f"(tolerance {tol:.3g})")
    return {"max_abs_diff": max(diffs), "tolerance": tol, "paths": len(diffs), "tokens": n}


def _flat(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)
