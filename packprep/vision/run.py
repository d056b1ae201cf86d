"""``pack`` with a processor folder: read -> extract images -> normalize -> prepare -> encode -> fit ->
pack -> rows -> shards, in one process, every record packed, truncated or rejected with its reason.

Called by pipeline.pack when the tokenizer folder holds an image processor (processor.has_image_processor).
The records' fates, reasons and rejects.jsonl are the text path's (ledger.Ledger); the manifest says
``"layout": "packprep-vision"`` and counts text and image tokens apart.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .. import __version__
from ..encode import Encoding
from ..errors import ConfigError, InputError, Rejected
from ..fates import FATES, PACKED, TRUNCATED
from ..layout import DEFAULT_LAYOUT, IGNORE_INDEX
from ..ledger import Ledger, top_reasons
from ..normalize import Conversation, detect_format, normalize
from ..tokenization import Encoded
from ..read import Record, Source, file_sha256, read_records
from ..write import OutputFolder, parse_size, shard_name
from .encode import VisionEncoder, VisionSequence, prepare
from .images import ImageFile
from .processor import ImageTokens, describe, load_processor
from .records import extract
from .rows import LAYOUT, Sequence, fit, plan, row, table

if TYPE_CHECKING:  # pragma: no cover
    from ..engines import Engine

BATCH = 64  # conversations a tokenizer call
NOT_FOR_IMAGES = {"random": "it cuts sequences, and an image is never cut",
                  "pad": "it pads, which images do not need", "minibatch": "it fixes sequences a row"}


def check_settings(config, layout: str, mixed: bool) -> None:
    """What a run with images does not do yet, refused before any work."""
    if config.strategy in NOT_FOR_IMAGES:
        raise ConfigError(f"--strategy {config.strategy} is not for conversations with images: "
                          f"{NOT_FOR_IMAGES[config.strategy]}; use greedy or bfd")
    for name, value in (("--shared-prefix", config.shared_prefix), ("--balance-dp", config.balance_dp),
                        ("--mix / --validation-size", mixed)):
        if value:
            raise ConfigError(f"{name} is not available for conversations with images (a processor folder)")
    if layout not in (None, DEFAULT_LAYOUT, LAYOUT):
        raise ConfigError(f"--layout {layout} is not available for conversations with images: their rows are "
                          f"{LAYOUT} (docs/vision.md)")


def pack_vision(sources: list[Source], tokenizer: str, config, folder: OutputFolder, *, embed_images: bool = False,
                engine: "Engine | None" = None) -> dict:
    """Pack ``sources`` with the processor of ``tokenizer`` into ``folder``; return the manifest."""
    encoding = Encoding.open(sources, tokenizer, config)
    tokens = ImageTokens(load_processor(tokenizer))
    with folder.staging() as tmp:
        ledger = Ledger(config.on_error, tmp / "rejects.jsonl")
        with ledger:
            sequences, stats = encode_all(encoding, tokens, ledger, config, engine, embed_images)
            for entry in ledger.entries:
                ledger.write(entry)
        if not sequences:
            reasons = "; ".join(top_reasons(ledger.reasons, ledger.examples))
            raise InputError(f"all {len(ledger.status):,} records were rejected ({reasons}); nothing was written")
        lengths = np.array([len(s.seq.input_ids) for s in sequences], dtype=np.int32)
        bins = plan(lengths, config.max_len, config.strategy, config.row_order, config.seed)
        shards = _write(tmp, sequences, bins, tokens, embed_images, parse_size(config.shard_size))
        manifest = _manifest(config, encoding, tokens, ledger, sequences, bins, lengths, shards, stats, embed_images)
        (tmp / "packprep.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        folder.commit()
    return manifest


def encode_all(encoding: Encoding, tokens: ImageTokens, ledger: Ledger, config, engine: "Engine | None" = None,
               embed: bool = False) -> tuple[list[Sequence], Counter]:
    """Every record encoded, BATCH records a task, on ``engine`` (pipeline.py's; None: here); the
    results are merged in input order, so the output is the same on any engine."""
    sequences: list[Sequence] = []
    stats: Counter = Counter()
    records: dict[int, Record] = {}
    context = (encoding, tokens, config, embed)
    chunks = _chunks(encoding, ledger, records)
    done = (engine.map(_encode_chunk, context, chunks) if engine is not None
            else (_encode_chunk(context, chunk) for chunk in chunks))
    for results in done:
        for number, outcome in results:
            record = records.pop(number)
            if isinstance(outcome, Rejected):
                ledger.reject(record, number, str(outcome), outcome.code)
            else:
                _keep(number, outcome, ledger, sequences, stats)
    return sequences, stats


def _chunks(encoding: Encoding, ledger: Ledger, records: dict) -> Iterator[list]:
    """The records, numbered by ``ledger``, BATCH a task (``records`` keeps each until its result)."""
    chunk = []
    for index, source in enumerate(encoding.sources):
        base_dir = os.path.dirname(os.path.abspath(source.path))
        for record in read_records(source):
            number = ledger.add()
            records[number] = record
            chunk.append((number, record, index, base_dir))
            if len(chunk) == BATCH:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


@dataclass
class Kept:
    """A record that stays: its sequences fitted to --max-len (and whether each was cut)."""

    fitted: list[tuple[VisionSequence, bool]]
    files: list[ImageFile]
    grids: list[tuple[int, ...]]
    conversation: Conversation
    encoded: Encoded


def _encode_chunk(context: tuple, chunk: list) -> list[tuple[int, Kept | Rejected]]:
    """The encode task: prepare, encode and fit a chunk of records (in a worker, or here)."""
    encoding, tokens, config, embed = context
    out, ready = [], []
    for number, record, index, base_dir in chunk:
        try:
            ready.append((number, _prepared(record, encoding.fields[index], encoding.formats[index], encoding,
                                            base_dir, tokens)))
        except Rejected as exc:
            out.append((number, exc))
    with encoding.encoder.one_thread():
        results = VisionEncoder(encoding.encoder, tokens).encode([p for _, p in ready])
    for (number, prepared), result in zip(ready, results):
        try:
            if isinstance(result, Rejected):
                raise result
            fitted = [fit(seq, config.max_len, config.overlong) for seq in result.sequences]
        except Rejected as exc:
            out.append((number, exc))
            continue
        files = prepared.files if embed else [replace(f, data=b"") for f in prepared.files]
        out.append((number, Kept(fitted, files, [e.grid for e in prepared.expansions], prepared.conversation,
                                 result.encoded)))
    return sorted(out, key=lambda item: item[0])


def _prepared(record: Record, fields, fallback: str, encoding: Encoding, base_dir: str, tokens: ImageTokens):
    if record.error is not None:
        raise Rejected(record.error, record.code)
    data, references = extract(record.data) if isinstance(record.data, dict) else (record.data, [])
    fmt = detect_format(data, fields) or fallback
    return prepare(normalize(data, fmt, fields, encoding.policy), references, base_dir, tokens)


def _keep(number: int, kept: Kept, ledger: Ledger, sequences: list, stats: Counter) -> None:
    """Count a record that stays and add its sequences."""
    ledger.keep(kept.conversation, kept.encoded)
    if any(cut for _, cut in kept.fitted):
        ledger.status[number] = TRUNCATED
    for seq, _ in kept.fitted:
        sequences.append(Sequence(seq, number, kept.files, kept.grids))
        image_tokens = sum(count for _, count, _ in seq.images)
        stats["image_tokens"] += image_tokens
        stats["text_tokens"] += len(seq.input_ids) - image_tokens
        stats["supervised"] += int((seq.labels[1:] != IGNORE_INDEX).sum())
    images = len(kept.files)
    stats["images"] += images
    stats[f"records_with_{min(images, 4)}{'+' if images >= 4 else ''}_images"] += 1


def _write(tmp, sequences: list[Sequence], bins, tokens: ImageTokens, embed: bool, shard_bytes: int) -> list[dict]:
    """Parquet shards of whole rows, each about ``shard_bytes`` (of tokens, four bytes each)."""
    import pyarrow.parquet as pq

    row_tokens = sum(len(s.seq.input_ids) for s in sequences) / max(1, bins.n_bins)
    rows_per_shard = max(1, int(shard_bytes // (row_tokens * 4 * (7 if tokens.mrope else 4) + 1)))
    groups = [list(range(b, min(b + rows_per_shard, bins.n_bins))) for b in range(0, bins.n_bins, rows_per_shard)]
    shards = []
    for index, group in enumerate(groups):
        rows = [row([sequences[i] for i in bins.items[bins.offsets[b]:bins.offsets[b + 1]]], tokens, embed)
                for b in group]
        name = shard_name(index, len(groups), "parquet")
        pq.write_table(table(rows, tokens.mrope), tmp / name)
        shards.append({"file": name, "rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
                       "sha256": file_sha256(str(tmp / name))})
    return shards


def _manifest(config, encoding: Encoding, tokens: ImageTokens, ledger: Ledger, sequences, bins, lengths, shards,
              stats: Counter, embed: bool) -> dict:
    status = np.bincount(np.frombuffer(bytes(ledger.status), dtype=np.uint8), minlength=len(FATES))
    row_lengths = np.add.reduceat(lengths[bins.items], bins.offsets[:-1]) if bins.n_bins else np.zeros(0)
    total = int(lengths.sum())
    kept = int(status[PACKED] + status[TRUNCATED])
    return {
        "packprep_version": __version__,
        "layout": LAYOUT,
        "config": {k: v for k, v in asdict(config).items() if not k.startswith("_")},
        "embed_images": embed,
        "inputs": [{"path": s.path, "name": os.path.basename(s.path), "kind": s.kind, "records": s.records}
                   for s in encoding.sources],
        "tokenizer": encoding.tokenizer_name,
        "processor": describe(tokens.processor),
        "counts": {"records": len(ledger.status), **{fate: int(status[code]) for code, fate in enumerate(FATES)},
                   "rejected_by_reason": dict(sorted(ledger.reasons.items())),
                   "top_rejections": top_reasons(ledger.reasons, ledger.examples, names_only=True)},
        "tokens": {"total": total, "text": int(stats["text_tokens"]), "image": int(stats["image_tokens"]),
                   "supervised": int(stats["supervised"])},
        "images": {"total": int(stats["images"]), "per_record": round(stats["images"] / kept, 4) if kept else 0.0,
                   "records_by_images": {k[len("records_with_"):-len("_images")]: v for k, v in sorted(stats.items())
                                         if k.startswith("records_with_")}},
        "rows": int(bins.n_bins),
        "sequences": len(sequences),
        "max_row_len": int(row_lengths.max()) if len(row_lengths) else 0,
        "efficiency": round(total / (bins.n_bins * config.max_len), 6) if bins.n_bins else 0.0,
        "shards": shards,
    }
