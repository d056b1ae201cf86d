"""``verify`` of a ``packprep-vision`` folder: the rows hold together, every image resolves, its sha256 is
the one recorded, and the model's processor, run on the image itself, gives the tokens and grid that
the row says. Never raises on bad data: every failure is reported (verification.Failure)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..errors import Rejected
from ..layout import IGNORE_INDEX, VISION_LAYOUT
from ..verification import Failure, Report
from .images import ImageFile, open_image, resolve
from .processor import ImageTokens, load_processor, rope_index


def verify_vision(folder: str | Path, manifest: dict, check_hashes: bool = True) -> Report:
    folder, report = Path(folder), Report()
    try:
        tokens = ImageTokens(load_processor(manifest["tokenizer"]))
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported, never raised
        report.failures.append(Failure("processor", f"cannot load the processor {manifest['tokenizer']}: {exc}"))
        return report
    starts = np.cumsum([0] + [i["records"] for i in manifest["inputs"]])
    folders = [os.path.dirname(os.path.abspath(i["path"])) for i in manifest["inputs"]]
    seen = set()
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            report.failures.append(Failure("files", "listed in the manifest but missing", shard["file"]))
            continue
        if check_hashes and hashlib.sha256(path.read_bytes()).hexdigest() != shard["sha256"]:
            report.failures.append(Failure("files", "sha256 differs from the manifest's", shard["file"]))
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist()):
            where = (shard["file"], number)
            base = [folders[int(np.searchsorted(starts, s, side="right")) - 1] for s in row["source_index"]]
            _check_row(row, tokens, manifest["config"]["max_len"], base, report, where)
            seen.update(row["source_index"])
            report.rows += 1
            report.sequences += len(row["seq_lens"])
            report.tokens += len(row["input_ids"])
    kept = manifest["counts"]["packed"] + manifest["counts"]["truncated"]
    if len(seen) != kept:
        report.failures.append(Failure("coverage", f"{len(seen)} records in the rows, the manifest counts {kept}"))
    return report


def _check_row(row: dict, tokens: ImageTokens, max_len: int, base: list[str], report: Report, where) -> None:
    def fail(check: str, message: str) -> None:
        report.failures.append(Failure(check, message, where[0], where[1]))

    ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
    lengths = row["seq_lens"]
    if sum(lengths) != len(ids) or len(labels) != len(ids) or len(ids) > max_len:
        return fail("lengths", f"seq_lens sum {sum(lengths)}, {len(ids)} tokens, max_len {max_len}")
    starts = np.cumsum([0] + lengths[:-1])
    expected = np.concatenate([np.arange(n) for n in lengths])
    if not np.array_equal(np.array(row["position_ids"]), expected) or (labels[starts] != IGNORE_INDEX).any():
        fail("positions", "position_ids do not restart at 0 each sequence, or a sequence's first label is trained")
    is_image = np.isin(ids, tokens.token_ids)
    if (labels[is_image] != IGNORE_INDEX).any():
        fail("labels", "an image token is trained")
    for n, (start, length) in enumerate(zip(starts, lengths)):
        mine = [i for i in row["images"] if i["seq"] == n]
        if int(is_image[start:start + length].sum()) != sum(i["length"] for i in mine):
            fail("images", f"sequence {n}: its image tokens are not its images' tokens")
        for image in mine:
            _check_image(image, tokens, base[n], fail)
        if "mrope_position_ids" in row:
            got = np.array(row["mrope_position_ids"])[:, start:start + length]
            want = rope_index(ids[start:start + length], [tuple(i["grid"]) for i in mine], tokens.token_ids,
                              tokens.merge_size)
            if not np.array_equal(got, want):
                fail("mrope", f"sequence {n}: mrope_position_ids are not its rope index")


def _check_image(image: dict, tokens: ImageTokens, base_dir: str, fail) -> None:
    """The image resolves, its bytes are the recorded ones, the processor gives its tokens and grid."""
    try:
        if image["data"] is not None:
            found = ImageFile(image["source"], image["data"], hashlib.sha256(image["data"]).hexdigest())
        elif image["source"].startswith("bytes:"):
            return  # bytes the input held, not embedded: the input itself is their only copy
        else:
            found = resolve(image["source"], base_dir)
        if found.sha256 != image["sha256"]:
            return fail("images", f"{image['source']}: sha256 {found.sha256[:12]}... is not the recorded "
                        f"{image['sha256'][:12]}... (the file changed since packing)")
        expansion = tokens.run(open_image(found))
    except Rejected as exc:
        return fail("images", f"{image['source']}: {exc}")
    if expansion.tokens != image["length"] or list(expansion.grid) != list(image["grid"]):
        fail("images", f"{image['source']}: the processor gives {expansion.tokens} tokens, grid "
             f"{list(expansion.grid)}; the row says {image['length']}, {image['grid']}")


def load_manifest(folder: str | Path) -> dict | None:
    """The folder's manifest when it is a vision one, else None."""
    path = Path(folder) / "packprep.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("layout") == VISION_LAYOUT else None
