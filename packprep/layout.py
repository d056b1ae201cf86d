"""The packed row, in one place: its schema, the one shard reader, and the layouts consumers load.

Canonical rows (``COLUMNS``) are what ``materialize`` makes and ``verify`` checks; every reader of
shards (write's checks, verify, inspect, stats, ``packprep.training``) goes through ``ShardReader``
here, and ``schemas/packed_row.schema.json`` is generated from ``COLUMNS`` (a test holds it equal).

A *layout* is what one training stack loads natively, made from canonical rows by a small adapter.
It is chosen at pack time (``--layout``) or afterwards (``packprep export DIR --to NAME OUT``, which
reads shards and never re-tokenizes). The manifest records it (``"layout"``).

How to add a layout: append ONE ``Layout(...)`` to ``LAYOUTS`` below (or call ``register``; a stack
with an adapter module of its own: one entry in ``packprep.layouts.STACKS``) with

* ``writes``: ``TABLE`` (Parquet/Arrow shards under ``data/``, as ``load_dataset(DIR)`` reads),
  ``SAVE_TO_DISK`` (an Arrow ``data/`` folder that ``datasets.load_from_disk(DIR/data)`` opens) or
  ``FILES`` (anything else: give ``write_files``, which gets ``convert``'s tables in order);
* ``renames`` (canonical column -> this stack's name) when renaming is all it takes: such a layout
  stays readable by verify/stats/inspect; or ``convert(table, context) -> pa.Table`` for anything
  more (padding, masks, extra columns): canonical ``pa.Table`` rows in, that stack's columns out,
  one row group at a time (also called on an empty table, for the schema); ``list_column`` gives
  a column's flat values and offsets as numpy, ``LayoutContext`` the row length and manifest;
* ``recipe``: the few lines of that stack's settings (markdown, first line the
  ``packprep.training.check_pipeline`` guard: ``guarded_recipe(...)``), shown in the dataset card;
  its fenced code blocks must appear verbatim in docs/training.md (a test checks);
* ``test``: the test that runs the stack's own code on such shards;

then add a literal-tensor test of the adapter (tiny hand-written rows in, exact columns out) and
a row to the README's table of stacks.

pyarrow is imported lazily, so that ``packprep.training`` can import this module without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from .errors import ConfigError, UnreadableLayout
from .layouts import FILES, SAVE_TO_DISK, STACKS, TABLE, guarded_recipe

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

IGNORE_INDEX = -100
VISION_LAYOUT = "packprep-vision"  # rows of conversations with images (packprep.vision.rows, docs/vision.md)
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Column:
    """One list column of a canonical packed row."""

    name: str
    dtype: str  # arrow value type: int32 | int64
    per: str  # "token": one value per token of the row; "sequence": one per packed sequence
    minimum: int
    description: str


COLUMNS: tuple[Column, ...] = (
    Column("input_ids", "int32", "token", 0, "Token ids of the packed sequences, concatenated; no padding (list<int32>)."),
    Column("labels", "int32", "token", IGNORE_INDEX,
           "Unshifted labels: equal to input_ids where trained, -100 elsewhere; the first label of every "
           "packed sequence is -100 (list<int32>)."),
    Column("position_ids", "int32", "token", 0,
           "Position of each token within its packed sequence; restarts at 0 (list<int32>)."),
    Column("seq_lens", "int32", "sequence", 1,
           "Lengths of the packed sequences, summing to the row length (list<int32>)."),
    Column("source_index", "int64", "sequence", 0,
           "For each packed sequence, the 0-based index of its input record across all inputs in order (list<int64>)."),
)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)


@lru_cache(maxsize=None)
def row_schema() -> "pa.Schema":
    """The Arrow schema of canonical shards."""
    import pyarrow as pa

    return pa.schema([pa.field(c.name, pa.list_(getattr(pa, c.dtype)())) for c in COLUMNS])


def __getattr__(name: str):  # ROW_SCHEMA without importing pyarrow at module import
    if name == "ROW_SCHEMA":
        return row_schema()
    raise AttributeError(name)


def json_schema() -> dict:
    """``schemas/packed_row.schema.json``, generated from ``COLUMNS``."""
    properties = {}
    for c in COLUMNS:
        items = {"type": "integer", "minimum": c.minimum}
        if c.dtype == "int32":
            items["maximum"] = INT32_MAX
        prop = {"type": "array", "items": items, "description": c.description}
        if c.per == "sequence":
            prop["minItems"] = 1
        properties[c.name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/packprep/packprep/schemas/packed_row.schema.json",
        "title": "One packed row of a packprep shard",
        "type": "object",
        "required": list(COLUMN_NAMES),
        "additionalProperties": False,
        "properties": properties,
    }


# ---------------------------------------------------------------------------------------------
# the one shard reader
# ---------------------------------------------------------------------------------------------


def shard_files(dir_or_files: str | os.PathLike | Sequence[str | os.PathLike], split: str = "train") -> list[str]:
    """Shard paths of an output folder (``DIR/data``: its ``split``'s shards, never the held-out
    ``validation-*`` ones in place of ``train``), a folder of shards, a file, or a list of files."""
    if isinstance(dir_or_files, (str, os.PathLike)):
        path = Path(dir_or_files)
        if path.is_dir():
            base = path / "data" if (path / "data").is_dir() else path
            pattern = f"{split}-*" if base != path else "*"
            files = sorted(str(p) for p in list(base.glob(f"{pattern}.parquet")) + list(base.glob(f"{pattern}.arrow")))
            if not files:
                raise FileNotFoundError(f"no *.parquet or *.arrow shards under {base}")
            return files
        return [str(path)]
    files = [os.fspath(f) for f in dir_or_files]
    if not files:
        raise ValueError("no shard files given")
    return files


class ShardReader:
    """One shard (Parquet, or Arrow IPC stream/file), read in its stored layout or as canonical rows.

    ``layout``: the folder's layout (the manifest's ``"layout"``); its renames are undone so that
    callers always see canonical column names. A layout that is more than renames cannot be read
    back (``LayoutError``). Arrow shards are memory-mapped (zero copy).
    """

    def __init__(self, path: str | os.PathLike, layout: "Layout | str | None" = None):
        self.path = Path(path)
        self.layout = readable_layout(layout, where=f"{self.path}: ") if layout is not None else None
        self._stored = {v: k for k, v in self.layout.renames.items()} if self.layout else {}
        self._opened = None  # the Parquet file, once opened

    def _parquet(self):
        import pyarrow.parquet as pq

        # read, not memory-mapped: a map keeps every page of the shard it touched resident in this
        # process, so reading a shard row group by row group would still end up holding all of it.
        # Opened once: a footer of many row groups takes milliseconds to parse.
        if self._opened is None:
            self._opened = pq.ParquetFile(self.path)
        return self._opened

    def _ipc(self):
        import pyarrow as pa

        source = pa.memory_map(str(self.path), "r")
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(self.path), "r"))

    @property
    def is_parquet(self) -> bool:
        return self.path.suffix == ".parquet"

    @property
    def schema(self) -> "pa.Schema":
        """The schema as canonical names (renames undone)."""
        schema = self._parquet().schema_arrow if self.is_parquet else self._ipc().schema
        return self._canonical_schema(schema)

    def _canonical_schema(self, schema):
        if not self._stored:
            return schema
        return _rename_schema(schema, self._stored)

    @property
    def num_rows(self) -> int:
        if self.is_parquet:
            return self._parquet().metadata.num_rows
        return sum(batch.num_rows for batch in _batches(self._ipc()))

    def _select(self, columns):
        if columns is None:
            return None
        wanted = {k: v for v, k in self._stored.items()}  # canonical -> stored
        return [wanted.get(c, c) for c in columns]

    def tables(self, columns: Sequence[str] | None = None, threads: bool = True,
               groups: Sequence[int] | None = None) -> Iterator["pa.Table"]:
        """The rows one row group (Parquet) or record batch (Arrow) at a time: bounded memory.
        ``threads``: decode a row group's columns on Arrow's thread pool (one thread a core).
        ``groups``: only these row groups (record batches), ascending."""
        import pyarrow as pa

        stored = self._select(columns)
        if self.is_parquet:
            parquet = self._parquet()
            for i in groups if groups is not None else range(parquet.num_row_groups):
                yield self._canonical(parquet.read_row_group(i, columns=stored, use_threads=threads))
        else:
            reader = self._ipc()
            for i, batch in enumerate(_batches(reader)):
                if groups is None or i in groups:
                    table = pa.Table.from_batches([batch], reader.schema)
                    yield self._canonical(table.select(stored) if stored is not None else table)

    @property
    def num_groups(self) -> int:
        """Row groups (Parquet) or record batches (Arrow)."""
        if self.is_parquet:
            return self._parquet().metadata.num_row_groups
        return sum(1 for _ in _batches(self._ipc()))

    def rows_before(self, group: int) -> int:
        """The rows in the row groups (record batches) before ``group``."""
        if self.is_parquet:
            metadata = self._parquet().metadata
            return sum(metadata.row_group(i).num_rows for i in range(group))
        return sum(batch.num_rows for _, batch in zip(range(group), _batches(self._ipc())))

    def read(self, columns: Sequence[str] | None = None) -> "pa.Table":
        """The whole shard (or some columns) as one table."""
        import pyarrow as pa

        if self.is_parquet:
            import pyarrow.parquet as pq

            return self._canonical(pq.read_table(self.path, columns=self._select(columns), memory_map=True))
        reader = self._ipc()
        table = pa.Table.from_batches(list(_batches(reader)), reader.schema)
        return self._canonical(table.select(self._select(columns)) if columns is not None else table)

    def row(self, index: int) -> dict:
        """Row ``index`` as a dict of Python lists, reading only the row group holding it."""
        if self.is_parquet:  # the row group's row counts are in the footer: read that group only
            parquet = self._parquet()
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if index < rows:
                    return self._canonical(parquet.read_row_group(group)).slice(index, 1).to_pylist()[0]
                index -= rows
            raise IndexError(f"{self.path} holds fewer rows")
        for table in self.tables():
            if index < table.num_rows:
                return table.slice(index, 1).to_pylist()[0]
            index -= table.num_rows
        raise IndexError(f"{self.path} holds fewer rows")

    def _canonical(self, table):
        if not self._stored:
            return table
        return table.rename_columns([self._stored.get(n, n) for n in table.column_names])


def _batches(reader) -> Iterator:
    if hasattr(reader, "num_record_batches"):  # IPC file
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _rename_schema(schema, mapping: Mapping[str, str]):
    import pyarrow as pa

    return pa.schema([f.with_name(mapping.get(f.name, f.name)) for f in schema], metadata=schema.metadata)


def list_column(table: "pa.Table", name: str):
    """(values, offsets) of a list column as numpy, offsets rebased to 0 (any slicing undone)."""
    import numpy as np
    import pyarrow as pa

    column = table.column(name)
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if len(array) == 0:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    offsets = np.asarray(array.offsets)
    values = np.asarray(array.values)[offsets[0] : offsets[-1]]
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):  # pragma: no cover
        raise TypeError(f"column {name!r} is {array.type}, expected a list column")
    return values, (offsets - offsets[0]).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------

DEFAULT_LAYOUT = "packprep"


class LayoutError(ConfigError):
    """A layout that does not exist, or a folder in a layout that cannot be read as packed rows."""


class UnreadableLayoutError(LayoutError, UnreadableLayout):
    """A folder in a layout that cannot be read back as packed rows: exit code 7, not a broken folder."""

    exit_code = UnreadableLayout.exit_code


@dataclass(frozen=True)
class LayoutContext:
    """What an adapter may need besides the rows: the row length and the source manifest."""

    max_len: int
    manifest: Mapping[str, Any] = field(default_factory=dict)
    pad_token_id: int = 0


@dataclass(frozen=True)
class Layout:
    name: str
    stack: str  # who loads it, in words
    writes: str  # TABLE | SAVE_TO_DISK | FILES
    recipe: str  # markdown; the first line runs packprep.training.check_pipeline
    test: str = ""  # the test that runs that stack's own code on such shards
    renames: Mapping[str, str] = field(default_factory=dict)  # canonical -> stored column name
    convert: Callable[["pa.Table", LayoutContext], "pa.Table"] | None = None
    write_files: Callable[[Iterator["pa.Table"], Path, LayoutContext], list[dict]] | None = None

    @property
    def readable(self) -> bool:
        """True when verify/stats/inspect/torch can read it back as canonical rows (renames only)."""
        return self.convert is None and self.write_files is None

    def to_layout(self, table: "pa.Table", context: LayoutContext) -> "pa.Table":
        """Canonical rows -> this layout's rows."""
        if self.convert is not None:
            return self.convert(table, context)
        if self.renames:
            return table.rename_columns([self.renames.get(n, n) for n in table.column_names])
        return table

    def shard_format(self, requested: str) -> str:
        """The format its shards are stored in: Arrow for a ``save_to_disk`` folder, else ``requested``."""
        return "arrow" if self.writes == SAVE_TO_DISK else requested

    def schema(self, context: LayoutContext) -> "pa.Schema":
        """The schema of this layout's tables (from converting an empty canonical table)."""
        return self.to_layout(row_schema().empty_table(), context).schema


LAYOUTS: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    if layout.writes not in (TABLE, SAVE_TO_DISK, FILES):
        raise ValueError(f"layout {layout.name}: writes must be {TABLE}, {SAVE_TO_DISK} or {FILES}")
    if layout.writes == FILES and layout.write_files is None:
        raise ValueError(f"layout {layout.name}: a {FILES} layout needs write_files")
    LAYOUTS[layout.name] = layout
    return layout


def get_layout(name: "str | Layout | None") -> Layout:
    """The layout called ``name`` (None: the canonical one), or a LayoutError listing the others."""
    if isinstance(name, Layout):
        return name
    if name == TREE_LAYOUT.name:  # written by --shared-prefix, never a --layout choice
        return TREE_LAYOUT
    layout = LAYOUTS.get(name or DEFAULT_LAYOUT)
    if layout is None and name == VISION_LAYOUT:  # docs/vision.md: verify and stats read it
        raise LayoutError("a packprep-vision folder (conversations with images) is read by verify and stats; "
                          "inspect, export and repack do not read it")
    if layout is None:
        raise LayoutError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def readable_layout(name: "str | Layout | None", where: str = "") -> Layout:
    """The layout, if its shards read back as packed rows; else a LayoutError saying what to do."""
    layout = get_layout(name)
    if not layout.readable:
        raise UnreadableLayoutError(
            f"{where}layout {layout.name!r} is written for {layout.stack} and cannot be read back as packed rows; "
            "verify, inspect or export the packprep-layout folder it was exported from (`pack --layout` "
            "checked its rows as it wrote them; pack without --layout for a folder to inspect)"
        )
    return layout


def layout_names() -> tuple[str, ...]:
    return tuple(LAYOUTS)


LOOP_RECIPE = guarded_recipe('check_pipeline(collate_packed, model, "packed/")') + """\
```python
from torch.utils.data import DataLoader
from packprep.training import PackedDataset, check_pipeline, collate_packed, register_varlen_attention
model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=register_varlen_attention() or "sdpa")
check_pipeline(collate_packed, model, "packed/")   # first: raises, naming the cause, on any leak
loader = DataLoader(PackedDataset("packed/"), batch_size=1, shuffle=True, collate_fn=collate_packed)
for batch in loader:   # (1, T) input_ids/labels/position_ids, cu_seq_lens_*, max_length_*, use_cache=False
    model(**batch).loss.backward()
```
Per-token loss across gradient accumulation: `collate_packed(rows, count=True)` adds
`num_supervised_tokens` (pop it and pass the step's total as `num_items_in_batch=`)."""

HF_RECIPE = guarded_recipe('check_pipeline(trainer, data="packed/")') + """\
```python
from datasets import load_dataset
from transformers import Trainer, TrainingArguments
from packprep.training import check_pipeline, collate_packed
trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", per_device_train_batch_size=4),
                  train_dataset=load_dataset("packed/", split="train"), data_collator=collate_packed)
check_pipeline(trainer, data="packed/")   # first: runs a batch through this trainer's own path
trainer.train()
```
With `--validation-size`, add `eval_dataset=load_dataset("packed/", split="validation")`: packed the same
way, and no record in both splits. `collate_packed` concatenates the batch's rows into one `(1, T)` row with restarted `position_ids`,
no `attention_mask` and `use_cache=False`. What breaks packing here: the default collator (a
tokenizer's `DataCollatorWithPadding` adds an all-ones `attention_mask`), `DataCollatorWithFlattening`
(recomputes `position_ids` per packed row, merging its sequences), and `use_cache=True`
(`TrainingArguments.use_cache` must keep its default False, which the Trainer copies into
`model.config`: a KV cache switches transformers' packed-sequence detection off)."""

TRL_RECIPE = guarded_recipe('check_pipeline(trainer, data="packed/")') + """\
```python
import torch
from datasets import load_dataset
from trl import SFTConfig, SFTTrainer
from packprep.training import check_pipeline
args = SFTConfig(output_dir="out", padding_free=True, max_length=None, per_device_train_batch_size=4,
                 dataset_kwargs={"skip_prepare_dataset": True},
                 use_cpu=not torch.cuda.is_available())   # TRL turns bf16 on, which without use_cpu needs a GPU
trainer = SFTTrainer(model=model, args=args, train_dataset=load_dataset("packed/", split="train"),
                     processing_class=tokenizer)
check_pipeline(trainer, data="packed/")   # first: runs a batch through this trainer's own path
trainer.train()
```
With `--validation-size`, add `eval_dataset=load_dataset("packed/", split="validation")`: packed the same
way, and no record in both splits. Rows carry `seq_lengths`, which TRL's padding-free collator turns into restarted `position_ids`
(and `cu_seq_lens_*`); `remove_unused_columns` keeps it. What breaks packing here:
`padding_free=False` (the default: an all-ones `attention_mask`, the row is one sequence),
`max_length` (default 1024: rows are cut, and TRL refuses it with `padding_free`), `packing=True`
(re-packs each row as ONE sequence), a custom `data_collator`, `use_cache=True` (keep
`SFTConfig.use_cache` False, its default: a KV cache switches packed-sequence detection off), and a
row layout without `seq_lengths` (`--layout packprep`: TRL then numbers each row 0..n-1, merging
its sequences)."""

register(Layout(
    "packprep", "a plain varlen loop (packprep.training) and transformers' Trainer with collate_packed", TABLE,
    LOOP_RECIPE + "\n\nWith transformers' `Trainer` (the same rows, no export needed):\n\n" + HF_RECIPE.split("\n\n", 1)[1],
    test="tests/test_torch_packed.py, tests/test_trainers.py::test_hf_trainer_recipe",
))
register(Layout(
    "hf", "transformers' Trainer with packprep.training.collate_packed", TABLE, HF_RECIPE,
    test="tests/test_trainers.py::test_hf_trainer_recipe",
))
register(Layout(
    "trl", "TRL's SFTTrainer with padding_free=True", TABLE, TRL_RECIPE,
    test="tests/test_trainers.py::test_trl_recipe", renames={"seq_lens": "seq_lengths"},
))

for _stack in STACKS:  # torchtune, llamafactory, megatron, axolotl: packprep/layouts/
    register(Layout(**_stack))


# shared-prefix rows (--turn-context exact --shared-prefix; packprep.prefix_tree): canonical columns,
# with position_ids counting depth in the tree, plus one column of their own
TREE_COLUMN = Column("tree_descendants", "int32", "token", 0,
                     "Tokens after this one, in its row, that lie below it in its record's prefix tree: token q "
                     "attends to token k iff k <= q <= k + tree_descendants[k] (list<int32>).")


@lru_cache(maxsize=None)
def tree_row_schema() -> "pa.Schema":
    """The Arrow schema of shared-prefix shards: the canonical columns and ``tree_descendants``."""
    import pyarrow as pa

    return row_schema().append(pa.field(TREE_COLUMN.name, pa.list_(pa.int32())))


class _TreeLayout(Layout):
    def schema(self, context: LayoutContext) -> "pa.Schema":
        return tree_row_schema()


TREE_LAYOUT = _TreeLayout(
    "packprep-tree", "packprep.training.collate_tree with register_tree_attention (FlexAttention)", TABLE,
    guarded_recipe('check_pipeline(trainer, data="packed/")') + """\
```python
from datasets import load_dataset
from transformers import Trainer, TrainingArguments
from packprep.training import check_pipeline, collate_tree, register_tree_attention
model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=register_tree_attention())
trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", remove_unused_columns=False),
                  train_dataset=load_dataset("packed/", split="train"), data_collator=collate_tree)
check_pipeline(trainer, data="packed/")   # first: runs a shared-prefix row through this trainer's own path
trainer.train()
```
Rows are shared-prefix rows: each record's exact sequences as one prefix tree, depth first, with
`tree_descendants`. Read as ordinary packed rows, each branch would attend to its siblings: every
other collator, `packprep export` and the stack layouts refuse them.""",
    test="tests/test_shared_prefix.py",
)
