"""Re-lay a packed folder out for one training stack (``packprep export DIR --to NAME OUT``).

Cheap: reads the shards one row group at a time and converts them with the layout's adapter
(``packprep.layout``); nothing is re-tokenized or re-packed. Written like ``pack`` writes: into a
hidden sibling folder renamed into place at the end, never over an existing folder without
``overwrite``. The new folder's manifest says its layout and where it came from, and its dataset
card carries that layout's recipe. The source is verified first: a stack's own format (padded rows,
``.npy`` files) cannot be read back by ``verify``, which then only checks its files' hashes.
``pack --layout NAME`` writes the layout directly (its writers convert each row group with the same
``Layout.to_layout``), without this re-read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .card import render_card
from .errors import ConfigError
from .layout import FILES, TREE_LAYOUT, LayoutContext, ShardReader, get_layout, readable_layout
from .read import file_sha256
from .write import OutputFolder, shard_name, shard_writer, write_arrow_dataset_state


def export(folder: str | os.PathLike, to: str, output: str | os.PathLike, *, overwrite: bool = False) -> dict:
    """Write the rows of the packed ``folder`` in layout ``to`` at ``output``; return the new manifest."""
    from .verification import read_manifest

    from .errors import VerifyError
    from .verification import verify

    layout = get_layout(to)
    source = Path(folder).absolute()
    manifest = read_manifest(source)
    readable_layout(manifest.get("layout"), where=f"{source}: ")
    if manifest.get("layout") == TREE_LAYOUT.name:
        raise ConfigError(f"{source}: shared-prefix rows (--shared-prefix) are not exported: {layout.stack} would "
                          "read each as ordinary packed sequences, every branch of a record's prefix tree attending "
                          "to its siblings. Train them with packprep.training.collate_tree and "
                          "register_tree_attention(), or pack without --shared-prefix for this stack")
    target = OutputFolder(output, overwrite, reads=[folder], option="OUTPUT")
    target.check()
    report = verify(source)  # a stack's own format cannot be verified afterwards: its source is, now
    if not report.ok:
        raise VerifyError(f"{folder} fails verification, so it is not exported: {report.failures[0]}")
    with target.staging() as tmp:
        exported = export_into(source, manifest, tmp, layout)
        exported["exported_from"] = {"path": str(source), "layout": manifest.get("layout", "packprep")}
        _write_manifest(tmp, exported)
        target.commit()
    return exported


def export_into(source: Path, manifest: dict, tmp: Path, layout) -> dict:
    """Write ``source``'s rows in ``layout`` into the empty staging folder ``tmp``; return its manifest."""
    layout = get_layout(layout)
    context = LayoutContext(max_len=int(manifest["config"]["max_len"]), manifest=manifest)
    (tmp / "data").mkdir(exist_ok=True)
    config = dict(manifest["config"])
    validation = manifest.get("validation")
    if layout.writes == FILES:
        if validation:
            raise ConfigError(f"layout {layout.name} writes files of its own, with no validation split; pack without "
                              "--validation-size for it, or export to a layout of tables")
        readers = [ShardReader(source / shard["path"], manifest.get("layout")) for shard in manifest["shards"]]
        tables = (layout.to_layout(table, context) for reader in readers for table in reader.tables())
        shards = layout.write_files(tables, tmp, context)
    else:
        fmt = layout.shard_format(config["shard_format"])
        config["shard_format"] = fmt
        schema = layout.schema(context)
        shards = _export_shards(source, manifest, manifest["shards"], tmp, layout, context, fmt, "train")
        if validation:
            validation = {**validation, "shards": _export_shards(source, manifest, validation["shards"], tmp, layout,
                                                                 context, fmt, "validation")}
        if fmt == "arrow":
            write_arrow_dataset_state(tmp / "data", shards, schema)
    if (source / "rejects.jsonl").is_file():
        shutil.copyfile(source / "rejects.jsonl", tmp / "rejects.jsonl")
    exported = {**manifest, "config": config, "layout": layout.name, "shards": shards}
    if validation:
        exported["validation"] = validation
    exported.pop("exported_from", None)
    _write_manifest(tmp, exported)
    if layout.readable:
        from .verification import verify

        report = verify(tmp, check_hashes=False)
        if not report.ok:  # a packprep bug: refuse to publish it
            raise RuntimeError(f"exported output failed verification: {report.failures[:3]}")
    return exported


def _export_shards(source: Path, manifest: dict, entries: list[dict], tmp: Path, layout, context, fmt: str,
                   split: str) -> list[dict]:
    """Write one split's shards in ``layout``; return their manifest entries."""
    shards = []
    for index, entry in enumerate(entries):
        name = shard_name(index, len(entries), fmt, split)
        reader = ShardReader(source / entry["path"], manifest.get("layout"))
        with shard_writer(tmp / name, fmt, layout.schema(context)) as write:
            for table in reader.tables():
                write(layout.to_layout(table, context))
        shards.append({**entry, "path": name, "bytes": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)})
    return shards


def _write_manifest(folder: Path, manifest: dict) -> None:
    (folder / "packprep.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (folder / "README.md").write_text(render_card(manifest))
