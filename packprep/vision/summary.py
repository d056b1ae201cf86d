"""The ``stats`` report of conversations with images: text and image tokens apart, images per record, and what
each ``--max-len`` costs (rows, efficiency, sequences cut before an image or refused), tokenized as
``pack`` would with the same processor. The report has ``kind: "vision"``; ``render`` draws it."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..encode import Encoding
from ..errors import Rejected
from ..ledger import Ledger, top_reasons
from ..packing import pack_lengths
from ..read import resolve_inputs
from ..settings import PackConfig
from .processor import ImageTokens, load_processor
from .rows import fit
from .run import encode_all

UNBOUNDED = 2**30  # no --max-len while encoding: each max_len of the table is applied after


def stats_vision(paths: list[str], tokenizer: str, max_lens: list[int], settings: dict) -> dict:
    config = PackConfig.from_settings({**settings, "max_len": UNBOUNDED}, "stats")
    sources = resolve_inputs(paths)
    encoding = Encoding.open(sources, tokenizer, config, min(max_lens))
    tokens = ImageTokens(load_processor(tokenizer))
    ledger = Ledger(config.on_error)
    sequences, tally = encode_all(encoding, tokens, ledger, config)
    lengths = np.array([len(s.seq.input_ids) for s in sequences], dtype=np.int64)
    image_tokens = np.array([sum(c for _, c, _ in s.seq.images) for s in sequences], dtype=np.int64)
    per_record = Counter(len(s.files) for s in {id(s.files): s for s in sequences}.values())
    return {
        "kind": "vision",
        "inputs": [{"path": s.path, "records": s.records} for s in sources],
        "tokenizer": tokenizer,
        "processor": tokens.family,
        "records": len(ledger.status),
        "rejected": sum(ledger.reasons.values()),
        "rejected_by_reason": dict(sorted(ledger.reasons.items())),
        "top_rejections": top_reasons(ledger.reasons, ledger.examples),
        "sequences": int(len(lengths)),
        "tokens": {"total": int(lengths.sum()), "text": int(lengths.sum() - image_tokens.sum()),
                   "image": int(image_tokens.sum()), "supervised": int(tally["supervised"])},
        "images": {"total": int(tally["images"]), "records_by_images": {str(k): v for k, v in sorted(per_record.items())}},
        "sequence_length": _distribution(lengths),
        "image_tokens_per_sequence": _distribution(image_tokens),
        "what_if": [_cost(sequences, lengths, max_len, config) for max_len in sorted(max_lens)],
    }


def _cost(sequences, lengths: np.ndarray, max_len: int, config) -> dict:
    """What packing at ``max_len`` gives: rows, efficiency, sequences cut before an image or refused."""
    kept, cut, refused = [], 0, 0
    for item, length in zip(sequences, lengths):
        try:
            seq, was_cut = fit(item.seq, max_len, config.overlong)
        except Rejected:
            refused += 1
            continue
        cut += was_cut
        kept.append(len(seq.input_ids))
    rows = pack_lengths(np.array(kept, dtype=np.int64), max_len, "greedy").n_bins if kept else 0
    total = int(sum(kept))
    return {"max_len": max_len, "rows": int(rows), "tokens": total, "truncated": int(cut), "refused": int(refused),
            "efficiency": round(total / (rows * max_len), 4) if rows else 0.0}


def _distribution(values: np.ndarray) -> dict:
    if not len(values):
        return {}
    return {"min": int(values.min()), "p50": int(np.percentile(values, 50)), "p90": int(np.percentile(values, 90)),
            "p99": int(np.percentile(values, 99)), "max": int(values.max()), "mean": round(float(values.mean()), 1)}


def render(report: dict) -> str:
    """The report for a terminal."""
    t, i = report["tokens"], report["images"]
    lines = [f"tokenizer: {report['tokenizer']} ({report['processor']})",
             f"{report['records']:,} records, {report['rejected']:,} rejected"
             + (" (" + ", ".join(f"{k} {v:,}" for k, v in report["rejected_by_reason"].items()) + ")"
                if report["rejected_by_reason"] else ""),
             f"tokens: {t['total']:,} = text {t['text']:,} + image {t['image']:,}; supervised {t['supervised']:,}",
             f"images: {i['total']:,}; records by images: "
             + ", ".join(f"{k}: {v:,}" for k, v in i["records_by_images"].items()),
             "sequence length: " + ", ".join(f"{k} {v:,}" for k, v in report["sequence_length"].items()),
             "", f"{'max_len':>8} {'rows':>8} {'efficiency':>10} {'truncated':>9} {'refused':>7}"]
    for row in report["what_if"]:
        lines.append(f"{row['max_len']:>8,} {row['rows']:>8,} {row['efficiency']:>10.2%} {row['truncated']:>9,} "
                     f"{row['refused']:>7,}")
    return "\n".join(lines) + "\n"


def folder_report(manifest: dict) -> dict:
    """``stats`` of a packed ``packprep-vision`` folder, from its manifest (``kind: "vision-packed"``)."""
    return {"kind": "vision-packed", "rows": manifest["rows"], "sequences": manifest["sequences"],
            "max_len": manifest["config"]["max_len"], "efficiency": manifest["efficiency"],
            "tokens": manifest["tokens"], "images": manifest["images"], "counts": manifest["counts"]}


def render_folder(report: dict) -> str:
    t, c = report["tokens"], report["counts"]
    return (f"{report['rows']:,} rows of {report['max_len']:,}, {report['sequences']:,} sequences, efficiency "
            f"{report['efficiency']:.2%}\ntokens: {t['total']:,} = text {t['text']:,} + image {t['image']:,}; "
            f"supervised {t['supervised']:,}\nimages: {report['images']['total']:,}; records: {c['records']:,} "
            f"({c['packed']:,} packed, {c['truncated']:,} truncated, {c['rejected']:,} rejected)\n")
