"""See the data before spending GPU hours: length statistics and what-if packing plans.

Four parts, each usable alone:

* plan (``whatif.py``): :func:`what_if`, pure: token lengths in, one row per (max_len, strategy)
  out, planned by pack's own planner and ``--overlong`` rule, so every number is what ``pack``
  would produce.
* collect (``collect.py``): encodes inputs through pack's own :class:`packprep.encode.Encoding`
  (same readers, chat template, labels and rejects) and keeps lengths and label counts; or reads a
  packed folder's ``seq_lens``.
* report (``report.py``): :func:`render_text` draws a report for a terminal (80 columns).
* plot (``plot.py``): :func:`plot` draws it with matplotlib (the ``plot`` extra).

:func:`stats` and :func:`stats_folder` (here) put the first two together into a JSON-ready report.

Definitions used in reports:

``tokens``
    Tokens of the rendered conversation (chat template applied, special tokens included).
``supervised``
    Tokens with a label, not counting position 0 (a packed sequence's first label is always -100).
``turns``
    Messages in the normalized conversation (a plain-text record counts as 1).
``attention_vs_pad``
    ``sum(len**2)`` over the packed sequences, relative to the same sum for ``pad``: the cost of
    varlen attention, which packing never raises (it lowers it only when it cuts samples).
``optimizer_steps``
    ``ceil(rows / global_batch_size) * epochs``: packing changes this number, so learning rate,
    warm-up and schedule lengths set in steps must follow it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..cost import CostModel, model_cost
from ..encode import Encoding
from ..ledger import Ledger, top_reasons
from ..engines import make_engine
from ..errors import ConfigError
from ..normalize import CHANGES
from ..settings import PackConfig, RunOptions, check_batches, check_model_config, check_steps, check_what_if
from ..vision.processor import has_image_processor
from ..vision.check import load_manifest as load_vision_manifest
from ..vision.summary import folder_report, stats_vision
from .collect import collect_folder, collect_inputs, distribution, log_histogram, turn_context_costs
from .mixture import mixture_what_if
from .plot import plot, require_matplotlib
from .report import render_text
from .whatif import DEFAULT_MAX_LENS, DEFAULT_STRATEGIES, what_if

__all__ = [
    "DEFAULT_MAX_LENS",
    "DEFAULT_STRATEGIES",
    "distribution",
    "is_packed_folder",
    "log_histogram",
    "plot",
    "render_text",
    "require_matplotlib",
    "stats",
    "stats_folder",
    "what_if",
]


def stats(
    inputs: str | Sequence[str],
    tokenizer: str | None = None,
    max_lens: Iterable[int] | None = None,
    strategies: Iterable[str] | None = None,
    global_batch_size: int = 64,
    epochs: int = 1,
    *,
    num_proc: int | None = None,
    progress: bool = False,
    dp_size: int | None = None,
    rows_per_step: int = 1,
    mix: str | None = None,
    validation_size: float | None = None,
    **settings,
) -> dict:
    """Length statistics and the what-if table for ``inputs``, tokenized as ``pack`` would.

    ``settings`` are the :class:`packprep.PackConfig` fields that shape reading and tokenizing
    (``format``, ``messages_field``, ``text_field``, ``train_on``, ``on_error``) and the what-if
    (``overlong``, ``seed``, ``samples_per_row``). ``max_lens`` and ``strategies`` default to
    :data:`DEFAULT_MAX_LENS` and :data:`DEFAULT_STRATEGIES`; ``mix``, ``validation_size`` as pack's (a
    ``mixture`` table; the what-if of the training split). Nothing is written. Returns a JSON-ready dict
    (``kind: "inputs"``) that :func:`render_text` and :func:`plot` draw; for a single packed output
    folder (holding ``packprep.json``), :func:`stats_folder`'s report.
    ``dp_size`` (with ``rows_per_step`` and the ``model_config`` setting) adds the predicted step
    efficiency over that many data-parallel ranks, shuffled and balanced (:func:`what_if`).
    """
    from ..mix import open_inputs

    run = RunOptions(num_proc=num_proc)
    paths = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if len(paths) == 1 and (vision := load_vision_manifest(paths[0])) is not None:
        return folder_report(vision)
    if len(paths) == 1 and is_packed_folder(paths[0]) and mix is None:
        return stats_folder(paths[0], global_batch_size=global_batch_size, epochs=epochs, dp_size=dp_size,
                            rows_per_step=rows_per_step, model_config=settings.get("model_config"))
    if not tokenizer:
        raise ConfigError("--tokenizer is required for input files (only a packed folder, holding "
                          "packprep.json, needs none)")
    if has_image_processor(tokenizer):  # conversations with images (docs/vision.md)
        return stats_vision([str(p) for p in paths], tokenizer, list(max_lens or DEFAULT_MAX_LENS), settings)
    max_lens, strategies = check_what_if(DEFAULT_MAX_LENS if max_lens is None else max_lens,
                                         DEFAULT_STRATEGIES if strategies is None else strategies, global_batch_size,
                                         epochs, settings.get("overlong", "truncate"), settings.get("samples_per_row"))
    check_steps(dp_size, rows_per_step)
    config = PackConfig.from_settings({**settings, "max_len": max(max_lens)}, "stats")
    sources, mixture = open_inputs([str(path) for path in paths], mix, validation_size)
    encoding = Encoding.open(sources, tokenizer, config, min(max_lens))
    tally = Ledger(config.on_error)
    engine = make_engine("local", run.num_proc)
    collected = collect_inputs(encoding, tally, max_lens, engine, progress)
    lengths, supervised, turns = collected.lengths, collected.supervised, collected.turns
    cost = config.cost()
    plan = dict(overlong=config.overlong, seed=config.seed, samples_per_row=config.samples_per_row,
                partition_size=config.partition_size, global_batch_size=global_batch_size, epochs=epochs,
                dp_size=dp_size, rows_per_step=rows_per_step, cost=cost)
    if mixture is None:
        mixed, table = None, what_if(lengths, supervised, max_lens, strategies, supervised_within=collected.within,
                                     split_masked=collected.masked, **plan)
    else:  # the training split the mixture makes at each max_len
        mixed, table = mixture_what_if(mixture, collected, tally, sources, list(max_lens), list(strategies), **plan)
    rejected = sum(tally.reasons.values())
    policies = turn_context_costs(encoding, tally, collected, engine, progress)
    return {
        "kind": "inputs",
        "inputs": [{"path": s.path, "format": tally.formats_seen(number, f), "records": s.records}
                   for number, (s, f) in enumerate(zip(sources, encoding.formats))],
        "tokenizer": tokenizer,
        "train_on": config.train_on,
        "records": len(tally.status),
        "conversations": int(len(turns)),
        "sequences": int(len(lengths)),
        "rejected": rejected,
        "rejected_by_reason": dict(sorted(tally.reasons.items())),
        "top_rejections": top_reasons(tally.reasons, tally.examples),
        "turns_not_located": tally.turns_not_located,
        "turn_context": {"policy": config.turn_context, **tally.context_counts(), "policies": policies},
        "normalized": {name: tally.changes.get(name, 0) for name in CHANGES},
        **_length_sections(lengths, supervised, turns, max_lens),
        "what_if": _what_if_section(config, global_batch_size, epochs, dp_size, rows_per_step, cost, table),
        **({"mixture": mixed} if mixture is not None else {}),
    }


def _length_sections(lengths, supervised, turns, max_lens) -> dict:
    """The report's token totals, distributions, histogram and over-max_len counts."""
    return {
        "tokens": {"total": int(lengths.sum()), "supervised": int(supervised.sum())},
        "distribution": {
            "tokens": distribution(lengths),
            "supervised": distribution(supervised),
            "turns": distribution(turns),
        },
        "histogram": {"of": "tokens", "bins": log_histogram(lengths)},
        "over_max_len": {str(m): int((lengths > m).sum()) for m in max_lens},
    }


def _what_if_section(config, global_batch_size: int, epochs: int, dp_size: int | None, rows_per_step: int,
                     cost: CostModel, table: list) -> dict:
    """The what-if table with the settings it was computed under."""
    return {
        "global_batch_size": int(global_batch_size),
        "epochs": int(epochs),
        "overlong": config.overlong,
        "seed": config.seed,
        **({"dp_size": int(dp_size), "rows_per_step": int(rows_per_step),
            "cost_model": cost.as_dict()} if dp_size else {}),
        "rows": table,
    }


def is_packed_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / "packprep.json").is_file()


def stats_folder(folder: str | os.PathLike, global_batch_size: int = 64, epochs: int = 1, *,
                 dp_size: int | None = None, rows_per_step: int = 1, model_config: str | None = None) -> dict:
    """Rows, sequences per row, efficiency and fill of a packed output folder (``kind: "packed"``).

    Read from ``packprep.json`` and the shards' ``seq_lens`` column (token columns are not read).
    ``dp_size`` adds ``steps``: the predicted step efficiency of the rows read in order and shuffled
    (:func:`packprep.balance.balance_summary`), in the order the folder was balanced for, if it was.
    """
    from ..verification import read_manifest

    check_batches(global_batch_size, epochs)
    check_steps(dp_size, rows_per_step)
    folder = Path(folder)
    manifest = read_manifest(folder)
    max_len = int(manifest["config"]["max_len"])
    row_lengths, per_row, seq_lengths = collect_folder(folder, manifest)
    rows = int(len(row_lengths))
    tokens = int(row_lengths.sum())
    width = max(max_len, int(row_lengths.max()) if rows else 0)
    fill = np.minimum(row_lengths * 10 // max(1, max_len), 10) if rows else np.zeros(0, np.int64)
    fill_counts = np.bincount(fill, minlength=11)
    fill_bins = [{"lo": k / 10, "hi": (k + 1) / 10, "count": int(fill_counts[k])} for k in range(10)]
    fill_bins[-1]["count"] += int(fill_counts[10:].sum())  # exactly full rows (and over-long ones)
    return {
        "kind": "packed",
        "folder": str(folder),
        "tokenizer": manifest.get("tokenizer", {}).get("name_or_path"),
        "config": manifest["config"],
        "records": manifest.get("counts", {}).get("records"),
        "counts": manifest.get("counts", {}),
        "rows": rows,
        "sequences": int(len(seq_lengths)),
        "tokens": {"total": tokens, "supervised": manifest.get("tokens", {}).get("supervised")},
        # rows may exceed max_len (minibatch): then the fill of rows padded to the longest, never above 1
        "row_width": width,
        "efficiency": round(tokens / (rows * width), 6) if rows else 0.0,
        "padding_tokens": rows * width - tokens,
        "optimizer_steps": -(-rows // int(global_batch_size)) * int(epochs),
        "global_batch_size": int(global_batch_size),
        "epochs": int(epochs),
        "distribution": {
            "row_tokens": distribution(row_lengths),
            "sequences_per_row": distribution(per_row),
            "sequence_tokens": distribution(seq_lengths),
        },
        "histogram": {"of": "sequence tokens", "bins": log_histogram(seq_lengths)},
        "fill_histogram": fill_bins,
        **({"steps": _folder_steps(manifest, seq_lengths, per_row, dp_size, rows_per_step, model_config)}
           if dp_size else {}),
    }


def _folder_steps(manifest, seq_lengths, per_row, dp_size, rows_per_step, model_config) -> dict:
    from ..balance import balance_summary

    offsets = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)
    sampler = (manifest.get("balance") or {}).get("sampler", "distributed")
    recorded = (manifest.get("balance") or {}).get("cost_model")
    if model_config is not None:
        check_model_config(model_config)
    cost = CostModel(**recorded) if recorded and model_config is None else model_cost(
        model_config or manifest["config"].get("model_config"))
    return balance_summary(seq_lengths, offsets, dp_size, rows_per_step, sampler, cost, manifest["config"]["seed"])
