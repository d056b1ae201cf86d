"""The whole job, as one library call: read → normalize → tokenize → pack → materialize → write.

``packprep.pack(...)`` is what the CLI runs and what a notebook calls. It returns the manifest
(the dict written to ``packprep.json``). :func:`repack` packs a packed folder's stored sequences
again (its step: ``repack.py``). This is the one module that runs the steps' stages on an engine.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np

from . import __version__
from .balance import balance_bins, balance_summary
from .cost import CostModel
from .card import length_histograms, render_card
from .encode import Encoding
from .ledger import Ledger, top_reasons
from .engines import TASKS_PER_WORKER, Engine, LocalEngine, make_engine, runs_per_item
from .errors import ConfigError, InputError
from .fates import FATES, PACKED, REJECTED, SPLIT, UNSAMPLED
from .vision.check import load_manifest as load_vision_manifest, verify_vision
from .vision.processor import has_image_processor
from .vision.run import check_settings, pack_vision
from .layout import DEFAULT_LAYOUT, FILES, TREE_LAYOUT, LayoutContext, get_layout, readable_layout
from .materialize import PackSink, Segments, TokenStore
from .normalize import CHANGES
from .packing import STRATEGY_TABLE, Bins, lower_bound, order_bins
from .plan import plan_bins
from .progress import Progress
from .mix import Mixture, Selection, input_starts, open_inputs, plan_rounds
from .json_scan import scan_json_chunk
from .parts import Part, PartPlan
from .read import Source, file_sha256
from .settings import PackConfig, RunOptions, repack_config  # PackConfig also as packprep.pipeline.PackConfig, as before
from .repack import (Stored, StoredShards, check_cuts, check_stored, check_target, folder_mixture, place,
                     read_lengths, rebuild_ledger, repacked_from, write_tokens)
from .split import membership
from .tokenization import tokenizer_fingerprint
from .verification import (Report, ShardCheck, ShardContext, check_footers, check_part, check_rows, check_tasks,
                           join_checks, joined_check, read_manifest, verify)
from .write import (OutputFolder, finish_shards, join_shard, parse_size, prepare_shards, shard_pieces, write_files,
                    write_piece, writers)


def pack(
    inputs: str | list[str],
    output: str,
    tokenizer: str,
    *,
    overwrite: bool = False,
    num_proc: int | None = None,
    progress: bool = False,
    engine: str = "local",
    ray_address: str | None = None,
    layout: str = DEFAULT_LAYOUT,
    mix: str | None = None,
    validation_size: float | None = None,
    **settings,
) -> dict:
    """Pack conversations from ``inputs`` into shards at ``output``; return the manifest.

    ``settings`` are the fields of :class:`PackConfig` (``max_len``, ``strategy``, ``seed``, ...).
    ``layout``: the training stack the shards are laid out for (``packprep.layout``); the writers
    make canonical rows, check them and write them converted to it, once.
    A tokenizer folder that also holds an image processor packs conversations with images
    (``packprep.vision``; ``embed_images=True`` stores each image's bytes in its row).
    ``mix``: a mixture file (YAML or JSON) of sources with weights or shares, beside ``inputs`` at
    weight 1; ``validation_size``: a fraction, or a number of records, held out as the
    ``validation`` split (``packprep.mix``, ``packprep.split``).
    Output is identical for any ``num_proc`` (default: all cores). ``engine="ray"`` runs the
    stages on a Ray cluster (``ray_address``, or a local instance; inputs and ``output`` on a file
    system every node sees) and gives the same bytes as ``"local"``.
    """
    embed_images = settings.pop("embed_images", False)
    config = PackConfig.from_settings(settings)
    run = RunOptions(engine, num_proc, ray_address)
    if has_image_processor(tokenizer):  # conversations with images: the model's processor (docs/vision.md)
        check_settings(config, layout, bool(mix or validation_size))
        folder = OutputFolder(output, overwrite)
        folder.check()
        sources = open_inputs([inputs] if isinstance(inputs, str) else list(inputs), None, None)[0]
        runner = make_engine("local", run.num_proc)
        try:
            return pack_vision(sources, tokenizer, config, folder, embed_images=embed_images, engine=runner)
        finally:
            runner.close()
    layout = _split_layout(layout, bool(validation_size), config.shared_prefix)
    sources, mixture = open_inputs([inputs] if isinstance(inputs, str) else list(inputs), mix, validation_size)
    folder = OutputFolder(output, overwrite)
    folder.check()
    runner = make_engine(run.engine, run.num_proc, run.ray_address)
    try:
        encoding = Encoding.open(sources, tokenizer, config)
        return _pack_into(folder, encoding, config, layout, runner, progress, mixture)
    finally:
        runner.close()


def repack(folder, output, *, overwrite: bool = False, num_proc: int | None = None, progress: bool = False,
           layout: str | None = None, accept_truncated: bool = False, **settings) -> dict:
    """Pack the sequences stored in the packed ``folder`` into ``output`` with ``settings`` changed
    (``max_len``, ``strategy``, ``seed``, ``row_order``, ``samples_per_row``; None keeps the folder's);
    return the new manifest. ``layout``: None keeps the folder's. ``accept_truncated``: pack sequences
    cut at the old ``max_len`` as they are stored. No tokenizer, no inputs (``packprep/repack.py``):
    both passes over the stored shards run on ``num_proc`` local workers (default: all cores), then
    ``pack``'s own last step, so that the output is ``pack``'s, byte for byte."""
    run = RunOptions(num_proc=num_proc)
    source = Path(folder).absolute()
    old = read_manifest(source)
    readable_layout(old.get("layout"), where=f"{source}: ")
    if old.get("layout") == TREE_LAYOUT.name:
        raise ConfigError(f"{source}: shared-prefix rows cannot be repacked (each is a record's prefix tree, which "
                          "repack's sequences do not describe); pack again from the inputs")
    damage = check_footers(source).failures
    if damage:
        raise InputError(f"{source} is damaged, so repack cannot rebuild its sequences: "
                         f"{'; '.join(map(str, damage[:3]))}{'; ...' if len(damage) > 3 else ''}. Run packprep verify "
                         f"{source} for the full report, or pack again from the inputs")
    recorded = (old.get("balance") or {}).get("cost_model")  # the config it was read from may be elsewhere now
    config = repack_config(old["config"], settings, CostModel(**recorded) if recorded else None)
    layout = _split_layout(layout or old.get("layout") or DEFAULT_LAYOUT, bool(old.get("validation")))
    target = OutputFolder(output, overwrite)
    check_target(source, target)
    engine = make_engine("local", run.num_proc)
    try:
        shards = StoredShards.open(source, old, config)
        runs = runs_per_item(len(shards.paths), engine.workers)
        tasks = shards.tasks(runs)
        with Progress(progress, len(tasks), "read lengths", "tasks") as bar:
            found = list(_counted(engine.map(read_lengths, shards, tasks), bar))
        check_stored(source, old, found)
        stored = Stored.join(shards, found)
        mixture = folder_mixture(old)
        accepted = check_cuts(source, old, config, stored, mixture, accept_truncated)
        with target.staging() as tmp, ThreadPoolExecutor(1) as background:
            fates = stored.fates(config)
            (tmp / "token-cache").mkdir()
            placement, store = place(tmp / "token-cache", shards, stored, fates, config.max_len,
                                     old["counts"]["records"], TASKS_PER_WORKER * engine.workers)
            tasks = placement.tasks(runs)
            with Progress(progress, len(tasks), "read tokens", "tasks") as bar:
                for tokens in engine.map(write_tokens, placement, tasks):
                    bar.update(1, tokens)
            del placement  # its arrays, before pack's stages
            ledger = rebuild_ledger(tmp, source, old, config, stored, fates)
            if mixture is not None:
                mixture.selection = Selection.from_copies(stored.copies, stored.held)
            described = {"inputs": old["inputs"], "tokenizer": old["tokenizer"]}
            manifest = write_output(tmp, store, ledger, config, engine, progress, background, lambda: described,
                                    mixture, repacked_from(source, old) if accepted else None, layout)
            target.commit()
            return manifest
    finally:
        engine.close()


def _split_layout(name, validation: bool, shared_prefix: bool = False):
    """The layout, refused before any work where a validation split is wanted and it writes files of its own,
    or where shared-prefix rows are wanted in a stack's layout (which would read them as ordinary rows)."""
    if shared_prefix:
        if get_layout(name).name != DEFAULT_LAYOUT:
            raise ConfigError(f"--shared-prefix writes rows that only packprep.training.collate_tree reads; "
                              f"--layout {name} would hand them to a stack that reads each as ordinary packed "
                              "sequences, every branch attending to its siblings: pack without --layout")
        return TREE_LAYOUT
    layout = get_layout(name)
    if validation and layout.writes == FILES:
        raise ConfigError(f"--layout {layout.name} writes files of its own, with no validation split: pack "
                          "without --validation-size for it, or choose a layout of tables")
    return layout


def _counted(results, bar: Progress):
    """``results``, each counted on ``bar`` as it comes."""
    for result in results:
        bar.update(1)
        yield result


def _pack_into(folder: OutputFolder, encoding: Encoding, config: PackConfig, layout, engine: Engine,
               progress: bool, mixture: Mixture | None = None) -> dict:
    with folder.staging() as tmp, ThreadPoolExecutor(1) as background:
        # the inputs' sha256 for the manifest, read beside the workers instead of after them
        hashes = background.submit(lambda: [file_sha256(s.path) if os.path.isfile(s.path) else None
                                        for s in encoding.sources])
        ledger = Ledger(config.on_error, tmp / "rejects.jsonl")
        cache = tmp / "token-cache"  # tokens spill to disk, a file pair a part: memory does not grow with the data
        cache.mkdir()
        with ledger, Progress(progress, None, "read+tokenize", "conv") as bar:
            spills = []
            sink = partial(PackSink, cache, config.max_len, config.overlong, shared_prefix=config.shared_prefix)
            for result in encoding.run(engine, plan_parts(encoding.sources, engine), ledger, sink):
                spills.append(result.payload)
                bar.update(result.records, result.tokens)
            store = TokenStore.from_spills(cache, spills, _rejected(ledger))
            del spills
        if len(store) == 0:
            raise InputError(_nothing_to_pack(ledger, encoding.sources))
        if mixture is not None:
            mixture.select(store.source_index(np.arange(len(store))), [s.records for s in encoding.sources],
                           store.lengths, config.seed)
        manifest = write_output(tmp, store, ledger, config, engine, progress, background,
                                lambda: _described(encoding, ledger, hashes.result()), mixture, layout=layout)
        folder.commit()
        return manifest


def write_output(tmp, store: TokenStore, ledger: Ledger, config: PackConfig, engine: Engine, progress: bool,
                 background, described, mixture: Mixture | None = None, extra: dict | None = None,
                 layout=DEFAULT_LAYOUT) -> dict:
    """Pack the store's sequences (the mixture's selection, else each once) into ``tmp`` in ``layout``;
    write the manifest and card and verify them; return the manifest. ``described()``: its inputs and
    tokenizer. ``pack`` and ``repack`` both end here, so that the same store gives the same bytes;
    ``extra``: keys added to the manifest. Verified once: each row group as its writer makes it, or
    each shard read back where the layout's rows can be (``check_shards``), then the totals."""
    layout = get_layout(layout)
    info = described() if layout.writes == FILES else None  # its files are written here: with the tokenizer
    selection = None if mixture is None else mixture.selection
    validation = checked_validation = None
    if selection is not None:
        np.frombuffer(ledger.status, dtype=np.uint8)[store.source_index(selection.unsampled)] = UNSAMPLED
        if len(selection.validation):  # first: the token cache is removed once train is written
            validation, checked_validation = _write_split(tmp, store, ledger, config, engine, progress,
                                                          selection.rounds("validation"), layout)
    with Progress(progress, len(store), "pack", "seq") as bar:
        segments = _segments(_pack(store, config, ledger, None if selection is None else selection.rounds()), store)
        bar.update(len(store))
    with Progress(progress, segments.offsets.size - 1, "write", "rows") as bar:
        check = _check_context(tmp, config, layout, len(ledger.status))
        # the token cache is removed beside the shards' joins and checks, once no piece needs it
        removal, cache_dir = [], store.cache_dir
        shards, checked, supervised = write_shards(
            tmp, store, segments, config.max_len, config.shard_format, parse_size(config.shard_size), bar,
            engine, check, lambda: removal.append(background.submit(shutil.rmtree, cache_dir)),
            layout=layout.name, files=LayoutContext(config.max_len, info),
        )
    removal[0].result()
    sequences = len(store)
    records = store.source_index(np.arange(sequences)) if mixture is not None else None
    lengths = store.lengths if mixture is not None else None
    del store  # the manifest and verify hold arrays of their own: free these first
    manifest = _manifest(config, info or described(), ledger, sequences, segments, shards, supervised)
    del segments
    if mixture is not None:
        # records, not sequences (a record may be several), from the ledger: repack's store holds only the records the folder packed
        manifest["counts"]["unsampled"] = int((np.frombuffer(ledger.status, dtype=np.uint8) == UNSAMPLED).sum())
        manifest["mixture"] = mixture.table(records, lengths, manifest["inputs"])
    if validation is not None:
        manifest["validation"] = {**validation, "size": mixture.validation_size, "members": membership(
            np.unique(records[selection.validation]), input_starts([i["records"] for i in manifest["inputs"]]))}
    if layout.writes != FILES:
        manifest["config"]["shard_format"] = layout.shard_format(config.shard_format)
    manifest["layout"] = layout.name
    manifest.update(extra or {})
    (tmp / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (tmp / "README.md").write_text(render_card(manifest))
    report = verify(tmp, check_hashes=False, checked=checked, checked_validation=checked_validation)
    if not report.ok:  # a packprep bug, never a data problem: refuse to publish it
        raise RuntimeError(f"packed output failed verification: {report.failures[:3]}")
    return manifest


def _write_split(tmp, store: TokenStore, ledger: Ledger, config: PackConfig, engine: Engine, progress: bool,
                 rounds: list[np.ndarray], layout, split: str = "validation") -> tuple[dict, list]:
    """Pack and write the sequences ``rounds`` as ``split``'s shards; return its manifest entry and its
    shards' checks (made as train's are: on the engine's workers)."""
    segments = _segments(_pack(store, config, ledger, rounds), store)
    check = _check_context(tmp, config, layout, len(ledger.status))
    with Progress(progress, segments.offsets.size - 1, f"write {split}", "rows") as bar:
        shards, checked, _ = write_shards(tmp, store, segments, config.max_len, config.shard_format,
                                          parse_size(config.shard_size), bar, engine, check, split=split,
                                          layout=layout.name)
    return {"rows": int(segments.offsets.size - 1), "sequences": int(len(segments.item)),
            "tokens": {"total": sum(s["tokens"] for s in shards), "supervised": sum(s["supervised_tokens"] for s in shards)},
            "shards": shards}, checked


def _check_context(tmp, config: PackConfig, layout, records: int) -> ShardContext:
    return ShardContext(tmp, layout.name, config.max_len, STRATEGY_TABLE[config.strategy].rows_may_exceed_max_len,
                        False, records)


def _described(encoding: Encoding, ledger: Ledger, hashes: list) -> dict:
    """The manifest's ``inputs`` and ``tokenizer``: what was read, and how it was tokenized."""
    return {
        "inputs": [
            {"path": s.path, "named": s.named or s.path, "name": os.path.basename(s.path.rstrip("/\\")) or s.path,
             "kind": s.kind, "format": ledger.formats_seen(number, f), "records": s.records,
             "bytes": os.path.getsize(s.path) if os.path.isfile(s.path) else None,
             "sha256": sha256}
            for number, (s, f, sha256) in enumerate(zip(encoding.sources, encoding.formats, hashes))
        ],
        "tokenizer": {**tokenizer_fingerprint(encoding.tokenizer, encoding.tokenizer_name),
                      "backend": encoding.encoder.backends_summary, "rendering": encoding.encoder.template.name},
    }


def _nothing_to_pack(ledger: Ledger, sources: list[Source]) -> str:
    """The message for a run in which no record survived: nothing is written."""
    where = ", ".join(source.path for source in sources[:3]) + (", ..." if len(sources) > 3 else "")
    if not ledger.status:
        return f"{where}: the inputs hold no records; nothing was written"
    reasons = "; ".join(top_reasons(ledger.reasons, ledger.examples))
    return (
        f"{where}: all {len(ledger.status):,} records were rejected ({reasons}); nothing was written. "
        "Check --format, --messages-field and the tokenizer's chat template"
    )


def _rejected(ledger: Ledger) -> np.ndarray:
    """The numbers of the records that are not sequences (every other record is one or more, in order)."""
    return np.flatnonzero(np.frombuffer(ledger.status, dtype=np.uint8) == REJECTED)


def _pack(store: TokenStore, config: PackConfig, ledger: Ledger, rounds: list[np.ndarray] | None = None) -> Bins:
    """The ordered bins of the store's sequences, or of a selection's ``rounds`` (store sequences, each
    round planned on its own: a copy never shares a row with its twin)."""
    lengths = store.lengths
    plan = partial(plan_bins, max_len=config.max_len, strategy=config.strategy, seed=config.seed,
                   samples_per_row=config.samples_per_row, overlong=config.overlong,
                   partition_size=config.partition_size)
    bins = plan(lengths) if rounds is None else plan_rounds(lengths, rounds, plan)
    if bins.lengths is not None:  # pieces exist: mark the records that were cut
        cut = bins.lengths < lengths[bins.items]
        for source_index in np.unique(store.source_index(bins.items[cut])).tolist():
            if ledger.status[source_index] == PACKED:  # a truncated record that is also cut stays truncated
                ledger.status[source_index] = SPLIT
    if config.balance_dp:
        return balance_bins(bins, lengths, config.max_len, config.balance_dp, config.rows_per_step,
                            cost=config.cost(), seed=config.seed, sampler=config.balance_sampler)
    del lengths  # the planner's arrays are the driver's peak: free what is done before the next
    return order_bins(bins, config.row_order, config.seed)


def _segments(bins: Bins, store: TokenStore) -> Segments:
    """The pieces of the ordered bins; a whole sequence's length is its length in the store."""
    lengths = bins.lengths if bins.lengths is not None else store.lengths[bins.items]
    return Segments(bins.items, bins.starts, lengths, bins.offsets)


def _recorded(config: PackConfig) -> dict:
    """The config as the manifest records it: ``shared_prefix`` only where on (flat rows' manifests
    stay as they were)."""
    recorded = asdict(config)
    if not recorded["shared_prefix"]:
        del recorded["shared_prefix"]
    return recorded


def _manifest(config, described: dict, ledger, sequences: int, segments, shards, supervised: int) -> dict:
    status = np.bincount(np.frombuffer(ledger.status, dtype=np.uint8), minlength=len(FATES))
    fates = {fate: int(status[code]) for code, fate in enumerate(FATES)}
    row_lengths = segments.row_lengths()
    tokens = int(row_lengths.sum())
    rows = int(len(row_lengths))
    bound = lower_bound(row_lengths, config.max_len) if tokens else 0
    return {
        "packprep_version": __version__,
        "config": _recorded(config),
        **described,
        "counts": {
            "records": len(ledger.status),
            **fates,
            "rejected_by_reason": dict(sorted(ledger.reasons.items())),
            "top_rejections": top_reasons(ledger.reasons, ledger.examples, names_only=True),
            "turns_not_located": ledger.turns_not_located,
            **ledger.context_counts(),
            "normalized": {name: ledger.changes.get(name, 0) for name in CHANGES},
        },
        "tokens": {"total": tokens, "supervised": supervised},
        "rows": rows,
        "sequences": int(len(segments.item)),
        "max_row_len": int(row_lengths.max()) if rows else 0,
        "rows_may_exceed_max_len": STRATEGY_TABLE[config.strategy].rows_may_exceed_max_len,
        "efficiency": round(tokens / (rows * config.max_len), 6) if rows else 0.0,
        "lower_bound_rows": int(bound),
        "partitions": -(-sequences // config.partition_size) if config.partition_size and sequences else 1,
        "length_histograms": length_histograms(row_lengths, segments.length, config.max_len),
        "shards": shards,
        **({"balance": balance_summary(segments.length, segments.offsets, config.balance_dp, config.rows_per_step,
                                       config.balance_sampler, config.cost(), config.seed)}
           if config.balance_dp else {}),
    }




# ---------------------------------------------------------------------------------------------
# the stages of the steps, on an engine: the steps plan their tasks and do them, this runs them
# ---------------------------------------------------------------------------------------------

def plan_parts(sources: list[Source], engine: Engine) -> list[Part]:
    """The parts the encode stage reads (:class:`packprep.parts.PartPlan`), its JSON arrays scanned in
    chunks on ``engine``, all in one stage."""
    plan = PartPlan.start(sources, engine.workers)
    scans = plan.scans
    found = engine.map(scan_json_chunk, None, scans) if len(scans) > 1 else (scan_json_chunk(None, c) for c in scans)
    return plan.parts(list(found))


def write_shards(folder, store: TokenStore, segments: Segments, max_len: int, shard_format: str = "parquet",
                 shard_bytes: int = 500_000_000, progress=None, engine: Engine | None = None,
                 check: ShardContext | None = None, tokens_done=None, split: str = "train", layout: str = DEFAULT_LAYOUT,
                 files: LayoutContext | None = None) -> tuple[list[dict], list, int]:
    """Write all rows of ``segments`` as shards under ``folder/data``, in ``layout``; return their
    manifest entries, with ``check`` each shard's check, and the supervised tokens written.

    Three stages of ``engine``'s workers (default: this process): where the shards are too few to
    keep every worker busy, each is cut into pieces of whole row groups, written side by side
    (:func:`packprep.write.write_piece`, which converts each row group to the layout); each shard's
    pieces are joined into it (``join_shard``); with ``check``, the shards are read back and checked,
    a run of row groups a task (:func:`check_shards`), or, where the layout's rows cannot be read
    back, each row group is checked by its writer before it is converted. A layout of files of its
    own gets its pieces' rows here (``write.write_files``, with ``files``: its context) instead of
    joins. A joined shard is byte for byte what one writer makes (``packprep.join``), so the bytes
    depend neither on the engine nor on the number of workers. ``tokens_done`` is called once every
    piece is written: the token store is not read after that. Memory: each writer holds one row
    group and its Parquet buffers (``packprep.write.writers``).
    """
    engine = engine or LocalEngine()
    made = check is not None and not get_layout(layout).readable  # checked as made, before converting
    job, plan = prepare_shards(folder, store, segments, max_len, shard_format, shard_bytes, split, layout,
                               partial(check_rows, check) if made else None)
    workers = writers(engine.workers)
    pieces = shard_pieces(plan, job.rows_per_group, runs_per_item(len(plan), workers))
    written = np.zeros((len(plan), 3), np.int64)  # a shard's pieces, tokens, supervised tokens
    parts = [[] for _ in plan]
    for (index, _, lo, hi), (*counts, part) in zip(pieces, engine.map(write_piece, job, pieces, workers=workers)):
        written[index] += (1, *counts)
        parts[index].append(part)
        if progress is not None:
            progress.update(hi - lo, counts[0])
    if tokens_done is not None:
        tokens_done()
    shards = [(index, first, last, *map(int, written[index])) for index, (first, last) in enumerate(plan)]
    if job.files:
        entries = write_files(job, pieces, files or LayoutContext(max_len))
    else:
        entries = list(engine.map(join_shard, job, shards, workers=workers))
    if made:
        checks = [joined_check(p, {"path": job.shard_path(i), "rows": last - first})
                  for i, (p, (first, last)) in enumerate(zip(parts, plan))]
    else:
        checks = [None] * len(entries) if check is None else check_shards(check, entries, engine, workers)
    finish_shards(job, entries)
    return entries, checks, int(written[:, 2].sum())


def check_shards(context: ShardContext, shards: list[dict], engine: Engine, workers: int | None = None) -> list[ShardCheck]:
    """Each shard's check, in order; where the shards are too few to keep every worker busy, a task
    checks a run of a shard's row groups (``engines.runs_per_item``). (No more workers than tasks: a
    single one runs here, unforked.)"""
    workers = min(engine.workers, workers or engine.workers)
    tasks = check_tasks(context, shards, runs_per_item(len(shards), workers))
    parts = [part for _, part in tasks]
    return join_checks(shards, tasks, engine.map(check_part, context, parts, workers=max(1, min(workers, len(parts)))))


def verify_folder(folder, num_proc: int | None = None, engine: Engine | None = None, **options) -> Report:
    """:func:`packprep.verification.verify` with the shards checked on ``engine`` (default: a local one of
    ``num_proc`` workers, all cores by default, closed after); the report is the same with any."""
    vision = load_vision_manifest(folder)
    if vision is not None:  # conversations with images: their rows and images (docs/vision.md)
        return verify_vision(folder, vision, options.get("check_hashes", True))
    runner = engine or make_engine("local", RunOptions(num_proc=num_proc).num_proc)
    try:
        return verify(folder, checker=partial(check_shards, engine=runner), **options)
    finally:
        if engine is None:
            runner.close()
