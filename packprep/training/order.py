"""``check_order(loader_or_trainer, data)``: warn when a trainer would deal the rows of a folder packed
with ``--balance-dp`` in another order than the one they were balanced for (docs/balanced-packing.md).

Balanced rows give every step's ranks equal compute only if they are read in order: row ``i`` to
rank ``i % N`` (``DistributedSampler(shuffle=False)``, ``--balance-sampler distributed``), or batch
``b`` of ``R`` rows to rank ``b % N`` (accelerate, Trainer/TRL with ``train_sampling_strategy=
"sequential"``, ``--balance-sampler accelerate``). A shuffling sampler still trains correctly, on
unbalanced steps: hence a warning, not an error.
"""

from __future__ import annotations

import json
import os
import warnings

from torch.utils.data import DistributedSampler, RandomSampler


class BalanceOrderWarning(UserWarning):
    """The trainer's sampler does not read balanced rows in the order they were balanced for."""


def check_order(pipeline, data: str | os.PathLike) -> list[str]:
    """The ways ``pipeline`` (a DataLoader, a sampler or a transformers/TRL Trainer) would undo the
    order of the balanced rows in the packprep folder ``data``; each is also warned as a
    :class:`BalanceOrderWarning`. Empty where ``data`` was not packed with ``--balance-dp`` (or is not
    a folder holding ``packprep.json``)."""
    path = os.path.join(os.fspath(data), "packprep.json") if isinstance(data, (str, os.PathLike)) else ""
    if not os.path.isfile(path):  # shard files, or a folder of shards: no manifest says how they were packed
        return []
    with open(path, encoding="utf-8") as handle:
        balance = json.load(handle).get("balance")
    if not balance:
        return []
    dp, rows, order = balance["dp_size"], balance["rows_per_step"], balance["sampler"]
    if hasattr(pipeline, "args") and hasattr(pipeline, "train_dataset"):
        problems = _trainer_problems(pipeline.args, dp, rows, order)
    else:
        problems = _loader_problems(pipeline, dp, rows, order)
    for problem in problems:
        warnings.warn(f"{data} holds rows balanced for {dp} ranks x {rows} row(s) a step ({order} order), "
                      f"but {problem}: steps will not be balanced", BalanceOrderWarning, stacklevel=2)
    return problems


def _trainer_problems(args, dp: int, rows: int, order: str) -> list[str]:
    problems = []
    strategy = getattr(args, "train_sampling_strategy", None)
    if strategy != "sequential":
        problems.append(f"the Trainer samples rows with train_sampling_strategy={strategy!r} (set 'sequential')")
    if getattr(args, "world_size", dp) != dp:
        problems.append(f"the Trainer runs on {args.world_size} processes")
    if args.per_device_train_batch_size != rows:
        problems.append(f"per_device_train_batch_size is {args.per_device_train_batch_size}")
    if order != "accelerate" and rows > 1:
        problems.append("accelerate deals batches of consecutive rows (pack with --balance-sampler accelerate)")
    return problems


def _loader_problems(pipeline, dp: int, rows: int, order: str) -> list[str]:
    sampler = getattr(pipeline, "sampler", pipeline)
    problems = []
    if isinstance(sampler, RandomSampler):
        problems.append("its RandomSampler shuffles them")
    if isinstance(sampler, DistributedSampler):
        if sampler.shuffle:
            problems.append("its DistributedSampler shuffles them (pass shuffle=False)")
        if sampler.num_replicas != dp:
            problems.append(f"its DistributedSampler deals to {sampler.num_replicas} ranks")
        if order != "distributed" and rows > 1:
            problems.append("a DistributedSampler deals row i to rank i % N (pack with --balance-sampler distributed)")
    batch = getattr(pipeline, "batch_size", None)
    if batch is not None and batch != rows:
        problems.append(f"its batch size is {batch}")
    return problems
