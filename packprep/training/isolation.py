"""Guards that packed sequences stay isolated in the user's own stack, raising with the cause when not.

``check_pipeline(collate_fn_or_trainer, model, data)`` runs one real packed row of ``data`` through
the user's own collator (or Trainer: its prepared dataset, column removal, collator and model) and
compares every packed sequence's logits with the sequence run alone. ``check_isolation(model)``
checks the model alone, on two random sequences.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..layout import IGNORE_INDEX
from .collate import collate_packed
from .layers import describe, layer_type_of, stateful_layers
from .order import check_order
from .parity import PackingIsolationError, logits_of, model_dtype, tolerance
from .tree import TREE_COLUMN, refuse_context_parallel
from .tree_check import check_tree_batch


_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _attn_impl(model) -> str:
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or getattr(cfg, "attn_implementation", "?"))


def check_isolation(
    model,
    vocab_size: int | None = None,
    device=None,
    *,
    lengths: Sequence[int] = (24, 17),
    forward_kwargs: Mapping[str, Any] | None = None,
    via_collator: bool = False,
    atol: float | None = None,
    seed: int = 0,
) -> dict:
    """Check that packed sequences are isolated in ``model`` as configured; raise if not.

    Two random sequences (``lengths``) are run packed in one row (``position_ids`` restarting
    at 0, no attention mask) and each alone.  By default the packed call passes only
    ``input_ids`` and ``position_ids`` plus ``forward_kwargs``, so the model's own defaults
    (``config.use_cache``, the attention implementation) decide; with ``via_collator=True``
    the batch is exactly what :func:`collate_packed` emits (``use_cache=False``, varlen kwargs).
    The model is put in eval mode for the check (dropout off) and restored afterwards.

    Raises :class:`PackingIsolationError` naming the likely cause when a sequence's logits
    differ by more than ``atol`` (default 1e-3 in float32/float64, else
    ``max(0.25, 0.05 * max|logit|)``).  Returns the per-sequence max abs differences.
    """
    cfg = getattr(model, "config", None)
    if vocab_size is None:
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vocab_size = int(getattr(text_cfg, "vocab_size"))
    if device is None:
        device = next(model.parameters()).device
    dtype = model_dtype(model)
    probe = _Probe(model, device, vocab_size, lengths, seed, via_collator)
    extra = dict(forward_kwargs or {})
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            diffs, scale = probe.measure(extra)
            tol = tolerance(dtype, scale, atol)
            if max(diffs) <= tol:
                return {"max_abs_diff": diffs, "tolerance": tol, "attn_implementation": _attn_impl(model)}
            impl = _attn_impl(model)
            head = (
                f"packed sequences are NOT isolated: logits of a packed sequence differ from the same "
                f"sequence run alone by {max(diffs):.3g} (tolerance {tol:.3g}; attn_implementation="
                f"{impl!r}, dtype={dtype}). "
            )
            raise PackingIsolationError(head + _cause(probe, extra, tol, impl))
    finally:
        if was_training:
            model.train()


class _Probe:
    """Two random sequences run packed in one row and each alone through ``model``."""

    def __init__(self, model, device, vocab_size: int, lengths: Sequence[int], seed: int, via_collator: bool):
        self.model, self.device, self.lengths, self.via_collator = model, device, lengths, via_collator
        gen = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
        self.rows = [{"input_ids": s, "labels": s, "seq_lens": [len(s)]} for s in self.seqs]
        self.packed_row = {
            "input_ids": torch.cat(self.seqs),
            "labels": torch.cat(self.seqs),
            "seq_lens": [len(s) for s in self.seqs],
        }

    def run(self, batch: dict, kwargs: Mapping[str, Any]) -> torch.Tensor:
        out = _refusing_forward(self.model, _on({**batch, **kwargs}, self.device), "packed sequences are NOT isolated: ")
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0].float()

    @staticmethod
    def batch_for(row: dict, packing_kwargs: bool, collator: bool) -> dict:
        full = collate_packed([row])
        if collator:
            b = {k: v for k, v in full.items() if k not in ("labels", "num_supervised_tokens")}
        else:
            b = {"input_ids": full["input_ids"], "position_ids": full["position_ids"]}
            if packing_kwargs:
                b.update({k: full[k] for k in _PACKING_KEYS})
        return b

    def measure(self, kwargs: Mapping[str, Any], packing_kwargs: bool = False, collator: bool | None = None):
        """Each sequence's max abs logit difference, packed vs alone, and the largest logit seen."""
        collator = self.via_collator if collator is None else collator
        alone_kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
        packed = self.run(self.batch_for(self.packed_row, packing_kwargs, collator), kwargs)
        diffs, scale, start = [], 0.0, 0
        for row, s in zip(self.rows, self.seqs):
            alone = self.run(self.batch_for(row, packing_kwargs, collator), alone_kwargs)
            part = packed[start : start + len(s)]
            diffs.append(float((part - alone).abs().max()))
            scale = max(scale, float(alone.abs().max()))
            start += len(s)
        return diffs, scale


def _cause(probe: _Probe, extra: dict, tol: float, impl) -> str:
    """Why the packed sequences were not isolated: tried in turn, the likeliest cause first."""
    cfg = getattr(probe.model, "config", None)
    via_collator, lengths = probe.via_collator, probe.lengths
    if extra.get("attention_mask") is not None:
        return (
            "An attention_mask was passed next to packed position_ids: transformers (SDPA/eager) "
            "then skips its packed-sequence detection and flash-attention treats the row as ONE "
            "sequence. Pass no attention_mask with packed rows (packprep.training.collate_packed never does)."
        )
    if extra.get("use_cache", getattr(cfg, "use_cache", False)) and not via_collator:
        no_cache = dict(extra, use_cache=False)
        d2, _ = probe.measure(no_cache)
        if max(d2) <= tol:
            return (
                "use_cache is True (model.config.use_cache defaults to True, also in training): "
                "transformers creates a KV cache and then skips its packed-sequence detection "
                "for SDPA/eager attention, so packed sequences attend across their boundaries. "
                "Pass use_cache=False in every forward (packprep.training collators do) or set "
                "model.config.use_cache = False."
            )
    spans = list(zip(np.cumsum([0, *lengths[:-1]]).tolist(), list(lengths)))
    packed_call = {**probe.batch_for(probe.packed_row, False, via_collator), **extra}
    alone_extra = {k: v for k, v in extra.items() if k != "attention_mask"}
    cause = _layer_cause(probe.model, _on(packed_call, probe.device),
                         [_on({**probe.batch_for(r, False, via_collator), **alone_extra}, probe.device)
                          for r in probe.rows],
                         spans)
    if cause is not None:
        return cause
    d3, _ = probe.measure(dict(extra, use_cache=False), packing_kwargs=True, collator=False)
    if max(d3) <= tol and not via_collator:
        return (
            f"attention implementation {impl!r} ignores restarted position_ids; it isolates "
            "sequences only when given cu_seq_lens_q/k and max_length_q/k. Feed batches "
            "from packprep.training.collate_packed."
        )
    return (
        f"attention implementation {impl!r} ignores both position_ids and cu_seq_lens in this "
        "model (SDPA/eager read restarted position_ids only where the model passes them to its "
        "mask; GraniteMoeHybrid does not). Use one that reads cu_seq_lens: 'flash_attention_2' "
        "or packprep.training.register_varlen_attention()."
    )


def _on(batch: Mapping[str, Any], device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def locate_sequences(dataset, input_ids) -> list[tuple[int, int]]:
    """(start, length) of every packed sequence in ``input_ids``, a concatenation of whole rows of
    ``dataset`` (a ``PackedDataset``), found from the rows themselves, not from any batch metadata."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    rows = {np.asarray(dataset[i]["input_ids"], np.int64).tobytes(): i for i in range(len(dataset))}
    lengths = sorted({len(dataset[i]["input_ids"]) for i in range(len(dataset))})
    out, at = [], 0
    while at < len(input_ids):
        index = next((rows[key] for n in lengths if (key := input_ids[at : at + n].tobytes()) in rows), None)
        if index is None:
            if (input_ids[at:] == input_ids[-1]).all():  # padding at the end
                break
            raise ValueError(f"tokens from {at} on are not a row of {dataset.files[0]}...")
        for n in dataset[index]["seq_lens"].tolist():
            out.append((at, n))
            at += n
    return out


def _is_trainer(obj) -> bool:
    return hasattr(obj, "data_collator") and hasattr(obj, "train_dataset") and hasattr(obj, "model")


def _truth(data) -> tuple[Any, list[dict]]:
    """The folder's rows: canonical (the truth) and as ``datasets.load_dataset`` yields them (stored names)."""
    from ..layout import ShardReader
    from .data import PackedDataset

    dataset = PackedDataset(data)
    return dataset, [ShardReader(path) for path in dataset.files]


def _stored_row(readers, dataset, index: int) -> dict:
    k = int(np.searchsorted(dataset._starts, index, side="right") - 1)
    return readers[k].row(index - int(dataset._starts[k]))


def _as_layout(row: dict, name: str, data) -> dict:
    """One canonical row as layout ``name`` writes it."""
    import pyarrow as pa

    from ..layout import LayoutContext, get_layout, row_schema
    from ..verification import read_manifest

    manifest = read_manifest(data)
    context = LayoutContext(max_len=int(manifest["config"]["max_len"]), manifest=manifest)
    return get_layout(name).to_layout(pa.Table.from_pylist([row], schema=row_schema()), context).to_pylist()[0]


def _pick(dataset, trainer, max_rows: int) -> tuple[int, list[tuple[int, int]]]:
    """Where the check starts: a row of two or more sequences when there is one among the first
    ``max_rows`` (else a row of one: truncation, labels and the attention path are still checked).
    Without a trainer, (its index, []); with one, (the index in its prepared dataset, [(index of the
    truth row in ``dataset``, index in the prepared dataset)] for it and the rows after it that make a
    batch of ``per_device_train_batch_size``)."""
    if trainer is None:
        found = [i for i in range(min(len(dataset), max_rows)) if len(dataset[i]["seq_lens"]) >= 2]
        return (found or [0])[0], []
    prepared = trainer.train_dataset
    if not hasattr(prepared, "select"):
        raise TypeError("check_pipeline(trainer) needs a map-style train_dataset; for a streaming one, pass "
                        "check_pipeline(trainer.data_collator, trainer.model, data)")
    rows = [dataset[index]["input_ids"] for index in range(min(len(dataset), max_rows * 4))]
    whole = {row.tobytes(): index for index, row in enumerate(rows)}

    def truth_of(i: int) -> tuple[int | None, bool]:
        """(the truth row of prepared row ``i``, whether it is that row whole)"""
        ids = np.asarray(prepared[i]["input_ids"], dtype=rows[0].dtype)
        index = whole.get(ids.tobytes())
        if index is not None:
            return index, True
        # a row the trainer cut (the row it starts), or joined to others (the row it starts with)
        return next((k for k, row in enumerate(rows) if np.array_equal(row[: len(ids)], ids[: len(row)])), None), False

    first = None
    for i in range(min(len(prepared), max_rows)):
        if (index := truth_of(i)[0]) is not None:
            first = i if first is None else first
            if len(dataset[index]["seq_lens"]) >= 2:
                first = i
                break
    if first is None:
        raise ValueError("none of the trainer's first rows is a row of the given folder: pass the folder the "
                         "trainer's train_dataset was loaded from")
    size = max(1, int(getattr(trainer.args, "per_device_train_batch_size", 1) or 1))
    batch = [(truth_of(first)[0], first)]
    for i in range(first + 1, min(len(prepared), first + size) if truth_of(first)[1] else first + 1):
        index, is_whole = truth_of(i)
        if not is_whole:  # rows the trainer rewrote are checked one at a time, against the row they start with
            break
        batch.append((index, i))
    return first, batch


def check_pipeline(pipeline, model=None, data: str | os.PathLike | None = None, *, atol: float | None = None,
                   max_rows: int = 256, layout: str | None = None, quiet: bool = False) -> dict:
    """:func:`check_rows`, and on a pass one line saying what was checked (``quiet``: none), so that a
    script's log shows the guard ran."""
    result = check_rows(pipeline, model, data, atol=atol, max_rows=max_rows, layout=layout)
    if not quiet:
        what = (f"{result['paths']} root-to-leaf paths" if "paths" in result
                else f"{result['sequences']} packed sequences")
        print(f"check_pipeline: ok, {what} ({result['tokens']:,} tokens) equal the same run alone "
              f"(max logit difference {result['max_abs_diff']:.2g}, tolerance {result['tolerance']:.2g})")
    return result


def check_rows(pipeline, model=None, data: str | os.PathLike | None = None, *, atol: float | None = None,
               max_rows: int = 256, layout: str | None = None) -> dict:
    """Run packed rows of ``data`` through the user's own pipeline and model; raise on any leak.

    ``pipeline``: the collate function given to the DataLoader (``collate_packed``, a transformers
    ``DataCollator``...), or a transformers/TRL ``Trainer``, whose own path is then used: its
    prepared ``train_dataset`` (TRL truncates there), its column removal
    (``remove_unused_columns``), its ``data_collator`` and ``_prepare_inputs``, and its model, on one
    batch of ``per_device_train_batch_size`` rows, as ``train()`` makes its batches: a collator that
    cannot batch the rows (the Trainer's default with no ``processing_class``) is refused here.
    ``model``: the model as configured for training (default: the trainer's).
    ``data``: the packprep output folder the rows come from; it says where each sequence starts.
    ``layout``: the layout the pipeline reads when it is a stack's own (``torchtune``,
    ``llamafactory``...): the row of ``data`` is converted to it first, as ``packprep export`` does.

    Each packed sequence's logits in the batch must equal the sequence's logits run alone (tolerance
    ``atol``: 1e-3 in float32, else bf16 rounding), and no label may ask a sequence to predict the
    next one's first token. On a leak, raises :class:`PackingIsolationError` naming the cause: merged or
    recomputed position ids, an attention mask, a KV cache, truncation, dropped columns, labels.
    Returns a dict: ``max_abs_diff`` (the largest logit difference) and ``tolerance``; ``sequences`` and
    ``tokens`` checked; ``loss_packed`` and ``loss_alone`` (the summed loss of the batch packed and of its
    sequences run one by one); shared-prefix rows: ``paths`` and ``tokens``.
    For a trainer and a folder packed with ``--balance-dp``, also warns (:func:`check_order`) when
    the trainer's sampler would not read the rows in the order they were balanced for.
    """
    trainer = pipeline if _is_trainer(pipeline) else None
    if model is None:
        if trainer is None:
            raise TypeError("check_pipeline(collate_fn, model, data): pass the model")
        model = trainer.model
    if data is None:
        raise TypeError("check_pipeline needs data=: the packprep output folder the rows come from")
    if trainer is not None:
        check_order(trainer, data)
    dataset, readers = _truth(data)
    index, batch_rows = _pick(dataset, trainer, max_rows)
    truth_index = index if trainer is None else batch_rows[0][0]
    if TREE_COLUMN in dataset[truth_index]:  # shared-prefix rows: read as trees, or refused
        refuse_context_parallel(trainer)
        batch, dropped = _made(pipeline, trainer, _stored_row(readers, dataset, truth_index), index)
        return check_tree_batch(model, batch, dataset[truth_index], dropped, atol)
    if trainer is None:
        truth = dataset[index]
        stored = _stored_row(readers, dataset, index)
        if layout is not None:
            stored = _as_layout(stored, layout, data)
        return _compare(model, pipeline([stored]), truth, [], atol)
    # the trainer's own path for one batch of per_device_train_batch_size rows: its prepared dataset,
    # its column removal, its collator, its device move
    picked = [i for _, i in batch_rows]
    examples = list(trainer._remove_unused_columns(trainer.train_dataset.select(picked), "check_pipeline"))
    for (index, _), example in zip(batch_rows, examples):
        if len(example["input_ids"]) < len(dataset[index]["input_ids"]):
            raise PackingIsolationError(_HEAD + _truncated(len(dataset[index]["input_ids"]), len(example["input_ids"])))
    dropped = [name for name in _stored_row(readers, dataset, batch_rows[0][0]) if name not in examples[0]]
    try:
        collated = trainer.data_collator(examples)
    except Exception as exc:  # what train() would raise on its first batch
        raise PackingIsolationError(
            f"this trainer cannot make a batch of the packed rows: its data_collator fails on {len(examples)} rows "
            f"(per_device_train_batch_size={len(examples)}), as train() would on its first batch: "
            f"{type(exc).__name__}: {exc}. Pass data_collator=packprep.training.collate_packed (transformers "
            "Trainer), or the `trl` layout with padding_free=True (TRL)." + (
                f" The stack dropped the columns {dropped} before the collator." if dropped else "")) from exc
    batch = trainer._prepare_inputs(collated)
    return _compare(model, batch, _joined(dataset, batch_rows, batch), dropped, atol)


def _joined(dataset, batch_rows, batch) -> dict:
    """The truth for a batch: its first row's, or, where the collator concatenated the batch's rows into
    one (``collate_packed``, TRL's padding-free collator), theirs one after the other."""
    rows = [dataset[index] for index, _ in batch_rows]
    if batch["input_ids"].shape[0] > 1 or len(rows) == 1:
        return rows[0]
    return {name: np.concatenate([row[name] for row in rows]) for name in ("input_ids", "labels", "seq_lens")}


_HEAD = "packed sequences are NOT isolated in this pipeline: "


def _truncated(row: int, got: int) -> str:
    return (f"truncation: the row of {row} tokens reached the model as {got} tokens, cutting {row - got} tokens and "
            "sequences off (TRL: max_length defaults to 1024; set max_length=None, or at least the folder's max_len)")


def _made(pipeline, trainer, stored: dict, picked: int) -> tuple[dict, list[str]]:
    """The batch the pipeline makes of one stored shared-prefix row, and the columns its stack dropped first."""
    if trainer is None:
        return pipeline([stored]), []
    # the trainer's own path: its prepared dataset, its column removal, its collator, its device move
    example = trainer._remove_unused_columns(trainer.train_dataset.select([picked]), "check_pipeline")[0]
    dropped = [name for name in stored if name not in example]
    return trainer._prepare_inputs(trainer.data_collator([example])), dropped


def _compare(model, batch: Mapping[str, Any], truth: Mapping[str, np.ndarray], dropped: Sequence[str], atol) -> dict:
    device = next(model.parameters()).device
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    ids = np.asarray(truth["input_ids"], dtype=np.int64)
    labels = np.asarray(truth["labels"], dtype=np.int64)
    seq_lens = np.asarray(truth["seq_lens"], dtype=np.int64)
    starts = np.cumsum(seq_lens) - seq_lens
    got_ids = batch["input_ids"][0].cpu().numpy()
    n = min(len(ids), len(got_ids))
    head = _HEAD
    if not np.array_equal(got_ids[:n], ids[:n]):
        raise PackingIsolationError(head + "the batch's input_ids are not the packed row's (the collator reordered "
                                    "or rewrote the tokens); feed rows as they are stored")
    if len(got_ids) < len(ids):
        raise PackingIsolationError(head + _truncated(len(ids), len(got_ids)))
    dtype = model_dtype(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = logits_of(_refusing_forward(model, batch, head))
            alone = [logits_of(model(input_ids=torch.as_tensor(ids[a : a + m], device=device)[None],
                                   position_ids=torch.arange(m, device=device)[None], use_cache=False))
                     for a, m in zip(starts.tolist(), seq_lens.tolist())]
            diffs = [float((logits[a : a + m] - one).abs().max()) for a, m, one in zip(starts, seq_lens, alone)]
            tol = tolerance(dtype, max(float(one.abs().max()) for one in alone), atol)
            if max(diffs) > tol:
                cause = _leak_cause(model, batch, starts, len(ids), dropped, tol, alone)
                raise PackingIsolationError(
                    head + f"logits of a packed sequence differ from the same sequence run alone by {max(diffs):.3g} "
                    f"(tolerance {tol:.3g}; attn_implementation={_attn_impl(model)!r}, dtype={dtype}). " + cause
                )
    finally:
        if was_training:
            model.train()
    got_labels = batch["labels"][0].cpu().numpy()[: len(ids)] if "labels" in batch else labels
    bad = starts[1:][got_labels[starts[1:]] != IGNORE_INDEX]
    if len(bad):
        raise PackingIsolationError(
            head + f"labels: the label at token {int(bad[0])}, the first token of a packed sequence, is not -100, so "
            "the loss asks the previous sequence's last token to predict it; keep the shards' labels"
        )
    if not np.array_equal(got_labels, labels):
        raise PackingIsolationError(
            head + "labels: the batch's labels differ from the shards' (rebuilt from input_ids?): untrained tokens "
            "(prompts, padding) would be trained; keep the shards' labels column"
        )
    loss = lambda out, a, m: torch.nn.functional.cross_entropy(  # noqa: E731
        out[:-1].float(), torch.as_tensor(labels[a + 1 : a + m], device=out.device), ignore_index=IGNORE_INDEX,
        reduction="sum")
    packed_loss = sum(float(loss(logits[a : a + m], a, m)) for a, m in zip(starts, seq_lens))
    alone_loss = sum(float(loss(one, a, m)) for a, m, one in zip(starts, seq_lens, alone))
    return {"max_abs_diff": max(diffs), "tolerance": tol, "sequences": len(seq_lens), "tokens": len(ids),
            "loss_packed": packed_loss, "loss_alone": alone_loss}


def _leak_cause(model, batch, starts, n_tokens, dropped, tol, alone) -> str:
    """Why the batch leaks, named from what it carries (and, for the KV cache, by re-running without one)."""
    boundary = f"the row's sequences start at tokens {starts.tolist()}"
    lost = f" The stack dropped the columns {dropped} before the collator (remove_unused_columns)." if dropped else ""
    mask = batch.get("attention_mask")
    if mask is not None and mask.dim() == 2 and bool((mask[0, :n_tokens] > 1).any()):
        return ("A 2-D attention_mask numbering the row's sequences came with the batch: transformers reads it as "
                "a padding mask (non-zero: attend), so the sequences see each other. LLaMA-Factory turns it into "
                "a block-diagonal mask only with neat_packing: true." + lost)
    if mask is not None and bool((mask[0, :n_tokens] != 0).all()):
        return ("An all-ones attention_mask came with the batch: transformers' SDPA/eager path then skips its "
                "packed-sequence detection and flash-attention treats the row as ONE sequence. Use a collator "
                "that emits no attention_mask: packprep.training.collate_packed, or TRL with padding_free=True "
                "(a tokenizer's default DataCollatorWithPadding, and TRL without padding_free, add one)." + lost)
    positions = batch.get("position_ids")
    if positions is None:
        return ("No position_ids reached the model, so it numbers the row 0..n-1 as ONE sequence (" + boundary +
                ")." + lost + " Pass restarted position_ids: collate_packed, or TRL's padding-free collator with "
                "the `trl` layout's seq_lengths column.")
    restarts = np.flatnonzero(positions[0, :n_tokens].cpu().numpy() == 0)
    if not np.array_equal(restarts, starts):
        return (f"The batch's position_ids restart at tokens {restarts.tolist()}, but {boundary}: they were "
                "recomputed for the row as if it were one sequence (DataCollatorWithFlattening numbers each packed "
                "row 0..n-1; TRL does so when the seq_lengths column is missing)." + lost +
                " Use collate_packed, or the `trl` layout with TRL's padding_free=True.")
    if batch.get("use_cache") is not False and getattr(getattr(model, "config", None), "use_cache", False):
        retry = logits_of(model(**{**batch, "use_cache": False}))
        if max(float((retry[a : a + len(one)] - one).abs().max()) for a, one in zip(starts, alone)) <= tol:
            return ("A KV cache: use_cache is True (model.config.use_cache defaults to True, also in training), and "
                    "transformers skips its packed-sequence detection when a cache exists. Set "
                    "model.config.use_cache = False or pass use_cache=False (collate_packed does).")
    ids, device = batch["input_ids"][0], batch["input_ids"].device
    spans = list(zip(starts.tolist(), np.diff(np.append(starts, n_tokens)).tolist()))
    alone_calls = [{"input_ids": ids[a : a + m][None], "position_ids": torch.arange(m, device=device)[None],
                    "use_cache": False} for a, m in spans]
    layer = _layer_cause(model, batch, alone_calls, spans)
    if layer:
        return layer
    return (f"The attention implementation {_attn_impl(model)!r} ignores the restarted position_ids and the "
            "cu_seq_lens: use 'sdpa', 'eager', 'flash_attention_2' or packprep.training.register_varlen_attention().")


def _refusing_forward(model, batch, head: str):
    """``model(**batch)``; transformers' refusal of sequence boundaries (no kernel) said as packprep's."""
    try:
        return model(**batch)
    except ValueError as exc:
        if "packed sequences" not in str(exc):
            raise
        kinds = sorted({describe(module) for _, module in stateful_layers(model)})
        raise PackingIsolationError(
            head + f"transformers refuses the batch's sequence boundaries in the model's {', '.join(kinds)} layers "
            f"({exc}). Call packprep.training.register_packed_layers(model) before training: it keeps these layers' "
            "packed sequences apart without the kernel (exact, transformers' torch functions on the whole row) or with "
            "flash-linear-attention on a GPU.") from exc


def _decoder_parts(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of the parts of every decoder layer (attention, recurrent mixer, MLP...), in order."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        return []
    name, layers = next(((n, m) for n, m in lists if len(m) == getattr(text, "num_hidden_layers", -1)),
                        max(lists, key=lambda item: len(item[1])))
    return [(f"{name}.{i}.{child}", part) for i, layer in enumerate(layers) for child, part in layer.named_children()]


def _first_leaking_part(model, packed: Mapping[str, Any], alone: Sequence[Mapping[str, Any]], spans):
    """The first decoder-layer part whose output differs between the packed row and its sequences alone:
    its inputs were still equal, so the part itself mixes the sequences."""
    parts = _decoder_parts(model)
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(key):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.dim() >= 3 and out.shape[0] == 1:
                seen.setdefault(key, []).append(out.detach()[0].float())
        return hook

    handles = [part.register_forward_hook(keep(key)) for key, part in parts]
    try:
        model(**packed)
        packed_out = dict(seen)
        seen.clear()
        for call in alone:
            model(**call)
    finally:
        for handle in handles:
            handle.remove()
    strict = model_dtype(model) in (torch.float32, torch.float64)
    for key, (out, *_) in packed_out.items():  # in the order the parts ran
        outs = seen.get(key, [])
        for (a, m), one in zip(spans, outs if len(outs) == len(spans) else []):
            scale = max(1.0, float(one.abs().max()))
            if float((out[a : a + m] - one).abs().max()) > (1e-3 if strict else 0.05) * scale:
                return key, dict(parts)[key]
    return None


def _layer_cause(model, packed, alone, spans) -> str | None:
    """The message naming the recurrent/convolutional layer type that mixes the packed sequences, if one does."""
    found = _first_leaking_part(model, packed, alone, spans)
    inside = stateful_layers(found[1]) if found else []
    if not inside:
        return None
    layer = inside[0][1]
    what = (f"The first layer whose output differs is {found[0]}, a {describe(layer)} layer, not the attention: it "
            "carries state from each token to the next, so a packed sequence starts from the previous one's state "
            "(restarted position_ids and varlen attention do not reset it). ")
    if layer_type_of(layer) is None:
        return what + ("packprep has no implementation that restarts this layer type at each packed sequence: train "
                       "this model on padded rows (packprep.training.collate_padded, `packprep pack --strategy pad`).")
    return what + ("Call packprep.training.register_packed_layers(model) before training, and feed batches that carry "
                   "the boundaries (collate_packed, or TRL's padding_free=True: cu_seq_lens_q and seq_idx).")
