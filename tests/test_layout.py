"""The layout module: one row schema, one shard reader, layouts as adapters, export.

Literal rows in, exact columns out (torchtune-style) for each adapter; the JSON Schema file is the
one the module generates; export is cheap, atomic, refuses to overwrite, and verify reads back what
it can and refuses the rest by name.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pytest
from click.testing import CliRunner

import packprep
from packprep import layout as L
from packprep.cli import main
from packprep.errors import EXIT_CONFIG
from packprep.convert import export

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER, REPO

ROWS = [  # two packed rows, literal: 3 + 2 tokens, then 4 tokens
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1],
     "seq_lens": [3, 2], "source_index": [4, 0]},
    {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4], "position_ids": [0, 1, 2, 3],
     "seq_lens": [4], "source_index": [2]},
]


def canonical_table(rows=ROWS) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=L.ROW_SCHEMA)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("layout") / "packed"
    packprep.pack(str(EXAMPLE_CHATS), str(out), str(EXAMPLE_TOKENIZER), max_len=256, num_proc=1, shard_size="40KB")
    return out


def test_json_schema_file_is_generated_from_the_module():
    on_disk = json.loads((REPO / "packprep" / "schemas" / "packed_row.schema.json").read_text())
    assert on_disk == L.json_schema()
    assert list(on_disk["properties"]) == [c.name for c in L.COLUMNS] == L.ROW_SCHEMA.names


def test_trl_layout_renames_seq_lens_only():
    context = L.LayoutContext(max_len=8)
    out = L.get_layout("trl").to_layout(canonical_table(), context)
    assert out.column_names == ["input_ids", "labels", "position_ids", "seq_lengths", "source_index"]
    assert out.column("seq_lengths").to_pylist() == [[3, 2], [4]]
    assert out.column("input_ids").to_pylist() == [r["input_ids"] for r in ROWS]
    assert L.get_layout("trl").schema(context).names == out.column_names


@pytest.mark.parametrize("name", ["packprep", "hf"])
def test_canonical_layouts_are_the_rows_as_they_are(name):
    table = canonical_table()
    assert L.get_layout(name).to_layout(table, L.LayoutContext(max_len=8)).equals(table)


def test_unknown_layout_names_the_known_ones():
    with pytest.raises(L.LayoutError, match="unknown layout 'nope'.*packprep.*trl"):
        L.get_layout("nope")


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_reader_undoes_renames(tmp_path, suffix):
    import pyarrow.parquet as pq

    table = L.get_layout("trl").to_layout(canonical_table(), L.LayoutContext(max_len=8))
    path = tmp_path / f"shard.{suffix}"
    if suffix == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    reader = L.ShardReader(path, "trl")
    assert reader.schema.equals(L.ROW_SCHEMA)
    assert reader.num_rows == 2
    assert reader.read(["seq_lens"]).column("seq_lens").to_pylist() == [[3, 2], [4]]
    assert reader.row(1) == ROWS[1]
    assert pa.concat_tables(reader.tables()).equals(canonical_table())
    assert L.ShardReader(path).read().column_names[3] == "seq_lengths"  # stored names without the layout


def test_export_to_trl_and_back(packed, tmp_path):
    import datasets

    manifest = export(packed, "trl", tmp_path / "trl")
    assert manifest["layout"] == "trl" and manifest["exported_from"]["layout"] == "packprep"
    assert packprep.verify(tmp_path / "trl").ok
    loaded = datasets.load_dataset(str(tmp_path / "trl"), split="train")
    assert loaded.column_names == ["input_ids", "labels", "position_ids", "seq_lengths", "source_index"]
    original = datasets.load_dataset(str(packed), split="train")
    assert loaded["seq_lengths"] == original["seq_lens"] and loaded["input_ids"] == original["input_ids"]
    card = (tmp_path / "trl" / "README.md").read_text()
    assert "padding_free=True" in card and "check_pipeline" in card and "name: seq_lengths" in card
    back = export(tmp_path / "trl", "packprep", tmp_path / "back")
    assert back["tokens"] == manifest["tokens"] and packprep.verify(tmp_path / "back").ok
    assert datasets.load_dataset(str(tmp_path / "back"), split="train")["seq_lens"] == original["seq_lens"]


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [n for n in L.LAYOUTS if n != "packprep"])
def test_pack_with_layout_equals_pack_then_export(packed, tmp_path, name):
    """Written directly in the layout, by two workers, the files are those export makes of the
    packprep folder: bytes, manifest and card (but for the export's note of where it came from)."""
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "direct"), str(EXAMPLE_TOKENIZER), max_len=256,
                             num_proc=2, shard_size="40KB", layout=name)
    exported = export(packed, name, tmp_path / "exported")
    assert manifest["layout"] == name
    assert exported.pop("exported_from") and manifest == exported
    direct, made = _files(tmp_path / "direct"), _files(tmp_path / "exported")
    del made["packprep.json"], made["README.md"]
    assert {k: v for k, v in direct.items() if k not in ("packprep.json", "README.md")} == made
    assert len([k for k in direct if k.startswith("data/")]) > 1  # several shards (or the stack's files)
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == ["README.md", "data", "packprep.json",
                                                                        "rejects.jsonl"]


@pytest.mark.parametrize("name", ["trl", "llamafactory"])
def test_a_validation_split_is_written_in_the_layout_too(tmp_path, name):
    """Both splits go straight to the layout, and are checked: those of llamafactory as they are made."""
    settings = dict(max_len=256, shard_size="40KB", validation_size=0.1)
    packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "packed"), str(EXAMPLE_TOKENIZER), num_proc=1, **settings)
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "direct"), str(EXAMPLE_TOKENIZER), num_proc=2,
                             layout=name, **settings)
    exported = export(tmp_path / "packed", name, tmp_path / "exported")
    assert exported.pop("exported_from") and manifest == exported
    assert manifest["validation"]["shards"] and manifest["validation"]["shards"][0]["path"].startswith("data/validation-")


def test_export_refuses_to_overwrite_and_leaves_nothing_half_written(packed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    result = CliRunner().invoke(main, ["export", str(packed), "--to", "trl", str(out)])
    assert result.exit_code == EXIT_CONFIG and "--overwrite" in result.output
    assert [p.name for p in out.iterdir()] == ["keep"]
    result = CliRunner().invoke(main, ["export", str(packed), "--to", "trl", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "packprep.json").read_text())["layout"] == "trl"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    result = CliRunner().invoke(main, ["export", str(packed), "--to", "nope", str(tmp_path / "x")])
    assert result.exit_code == 2 and "nope" in result.output


def test_verify_refuses_a_layout_it_cannot_read(packed, tmp_path, monkeypatch):
    """A stack's own format (padded rows, other files) is refused by name, never misread: exit 7 when
    its files match the manifest (it is not broken, only not readable as rows), a failure when not."""
    padded = L.Layout("padded-test", "a test stack", L.TABLE, "recipe",
                      convert=lambda table, context: table.drop_columns(["seq_lens"]))
    monkeypatch.setitem(L.LAYOUTS, padded.name, padded)
    export(packed, "padded-test", tmp_path / "padded")
    with pytest.raises(L.UnreadableLayoutError, match="padded-test.*exported from") as raised:
        packprep.verify(tmp_path / "padded")
    assert raised.value.exit_code == 7
    shard = tmp_path / "padded" / json.loads((tmp_path / "padded" / "packprep.json").read_text())["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes() + b"x")  # its files are still checked
    assert [f.check for f in packprep.verify(tmp_path / "padded").failures] == ["shard_file", "layout"]
    with pytest.raises(L.LayoutError):
        export(tmp_path / "padded", "trl", tmp_path / "again")


def test_import_packprep_stays_light():
    code = "import packprep, sys; assert not {'numba', 'pyarrow', 'torch', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_every_recipe_starts_with_the_guard_and_is_in_the_docs():
    import re

    readme, recipes = (REPO / "README.md").read_text(), (REPO / "docs" / "training.md").read_text()
    for layout in L.LAYOUTS.values():
        assert layout.recipe.startswith("First, always: `check_pipeline("), layout.name
        blocks = re.findall(r"```\w*\n.*?```", layout.recipe, re.S)
        assert blocks, layout.name
        for block in blocks:
            assert block in recipes, f"{layout.name}: recipe block missing from docs/training.md"
        assert f"`{layout.name}`" in readme


def test_export_refuses_a_source_that_fails_verify(packed, tmp_path):
    import shutil

    from packprep.errors import VerifyError

    source = tmp_path / "source"
    shutil.copytree(packed, source)
    shard = next((source / "data").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(VerifyError, match="not exported.*sha256"):
        export(source, "trl", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pack_cli_takes_a_layout(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(EXAMPLE_CHATS), "-t", str(EXAMPLE_TOKENIZER), "--max-len", "256",
                                       "-o", str(out), "--layout", "hf", "--num-proc", "1", "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "packprep.json").read_text())["layout"] == "hf"
    assert "data_collator=collate_packed" in (out / "README.md").read_text()
    assert "--layout" in CliRunner().invoke(main, ["pack", "--help"]).output
