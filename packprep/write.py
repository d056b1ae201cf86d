"""Step 6: write shards into a temporary folder and move it into place only when it is complete.

A run that fails or is killed never leaves a partial folder at the output path: work happens in a
hidden sibling ``.NAME.packprep-tmp-PID`` that is renamed at the end (a rename within one folder is
atomic), and stale siblings of dead runs are removed by the next run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .errors import ConfigError, OutputError, check_utf8
from .interrupts import COMMITTED, boundary, stops_held
from .layout import DEFAULT_LAYOUT, FILES, IGNORE_INDEX, ROW_SCHEMA, LayoutContext, ShardReader, get_layout
from .materialize import Segments, TokenStore, materialize
from .join import join_pieces

SHARD_FORMATS = ("parquet", "arrow")
BYTES_PER_TOKEN = 12  # input_ids + labels + position_ids, int32 each
BYTES_PER_SEQUENCE = 12  # seq_lens int32 + source_index int64
ROW_GROUP_TOKENS = 1 << 19  # ~6 MB uncompressed: a writer's memory grows with its row group (~200 B a token)
# A writer (a piece's, or a check's) holds a row group, the Parquet writer's or reader's encoding
# and compression buffers: measured ~68 MiB PSS a writer on 16 cores at 512k-token row groups
# (12 writers: the tree 1,229 MiB with a 409 MiB driver), once Arrow's process-wide state is made
# before the fork (:func:`_arrow_ready`) and the check decodes on one thread (~104 MiB with Arrow's
# thread a core, ~115 without the warm-up). The parallel writers get at most WRITERS_MEMORY between
# them: 16 writers.
WRITER_BYTES = 80 << 20
PIECES = ".pieces"  # the pieces' folder, beside data/ in the staging folder
WRITERS_MEMORY = 5 << 28  # 1.25 GiB


def parse_size(text: str | int) -> int:
    """'500MB', '2GB', '64KiB' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not match:
        raise ConfigError(f"--shard-size {text!r}: use a size such as 500MB or 2GB")
    number, unit = float(match.group(1)), match.group(2).rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    return max(1, int(number * scale[unit]))


class OutputFolder:
    """The output path, guarded: refused if it exists without ``overwrite``, or where it is, holds or
    lies inside a path the run reads (``reads``: files and folders as typed); written atomically."""

    def __init__(self, path: str | os.PathLike, overwrite: bool = False, reads=(), option: str = "--output"):
        self.named, self.option = os.fsdecode(path), option  # as the user typed it, for messages
        self.final = _through_links(Path(path).absolute())
        self.overwrite = overwrite
        self.reads = list(reads)
        self.tmp = self.final.parent / f".{self.final.name}.packprep-tmp-{os.getpid()}"

    def check(self) -> None:
        """Fail before any work if the output cannot be written, or if writing it would replace or
        change a file or folder the run reads (with or without ``overwrite``)."""
        check_utf8(str(self.final), self.option)
        refuse_reads(self.option, self.named, self.final, self.reads)
        if self.final.exists() and not self.overwrite:
            raise ConfigError(f"{self.named} already exists; pass --overwrite to replace it, or choose another --output")
        if self.final.exists() and not self.final.is_dir():
            raise ConfigError(f"{self.named} exists and is not a folder")
        parent = self.final.parent
        while not parent.exists():  # missing parents are created when writing starts, like mkdir -p
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{parent} is a file, not a folder; choose another --output")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{parent} is not writable; choose another --output")
        boundary("checked")

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """Yield the temporary folder; remove it if the block fails."""
        self.check()
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_siblings()
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            self.tmp.mkdir()
            (self.tmp / "data").mkdir()
            boundary("staged")
            yield self.tmp
        except OSError as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise _output_error(exc, self.final) from exc
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def commit(self) -> None:
        """Move the finished temporary folder into place (replacing the old one under overwrite), with
        Ctrl-C held back: a stop lands before (nothing at the path) or after (the folder complete)."""
        boundary("commit")
        old = None
        try:
            with stops_held():
                if self.final.exists():
                    if not self.overwrite:
                        raise ConfigError(f"{self.named} appeared while packing; pass --overwrite to replace it")
                    old = self.final.parent / f".{self.final.name}.packprep-old-{os.getpid()}"
                    os.rename(self.final, old)
                os.rename(self.tmp, self.final)
                COMMITTED.append(self.final)
        finally:  # a stop held back lands as the block ends: the replaced folder goes all the same
            if old is not None and self.final in COMMITTED:
                shutil.rmtree(old, ignore_errors=True)
        boundary("committed")

    def _remove_stale_siblings(self) -> None:
        pattern = re.compile(rf"^\.{re.escape(self.final.name)}\.packprep-(?:tmp|old)-(\d+)$")
        for sibling in self.final.parent.iterdir():
            match = pattern.match(sibling.name)
            if match and not _pid_alive(int(match.group(1))):
                shutil.rmtree(sibling, ignore_errors=True)


def _through_links(path: Path) -> Path:
    """The output path with its symbolic links followed: a link to a folder is written through (the
    folder it names is replaced under --overwrite, the link kept); a loop or a dangling link is a
    ConfigError now, before any work, not a failed rename after it."""
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11 raises RuntimeError on a loop, later ones OSError
        raise ConfigError(f"{path}: the path goes through a symbolic link loop; choose another --output") from exc
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; remove the "
                          "link or choose another --output")
    return resolved


def refuse_reads(option: str, named: str, final: Path, reads) -> None:
    """A ConfigError where the output ``final`` (links followed; ``named`` as given to ``option``) is,
    holds or lies inside one of ``reads``, the paths the run reads as given (None, or missing: skipped)."""
    for read in reads:
        relation = _relation(final, os.fsdecode(read)) if read is not None and os.path.lexists(read) else None
        if relation:
            raise ConfigError(f"{option} {named} {relation} {os.fsdecode(read)}, which this run reads; writing it "
                              "would replace or change an input: choose an output apart from the inputs")


def _relation(output: Path, read: str) -> str | None:
    """How the output folder (links followed) stands to a path the run reads, as the link itself and as
    what it names: ``is``, ``holds`` (replacing the output deletes it) or ``is inside``; None: apart."""
    path, forms = Path(os.path.abspath(read)), []
    for form in (lambda: path.parent.resolve() / path.name, path.resolve):
        try:
            forms.append(form())
        except (RuntimeError, OSError):  # a link loop: nothing is read through it
            pass
    for form in forms:
        if output == form:
            return "is"
        if output in form.parents:
            return "holds"
        if form in output.parents:
            return "is inside"
    return None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _output_error(exc: OSError, where: Path) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError(f"disk full while writing {where}; free space or choose another --output")
    return OutputError(f"cannot write {where}: {exc.strerror or exc}")


def plan_shards(row_lengths: np.ndarray, row_sequences: np.ndarray, shard_bytes: int) -> list[tuple[int, int]]:
    """Cut rows into shards of at most ``shard_bytes`` (uncompressed estimate; a row larger than that
    is a shard of its own); deterministic. One search a shard, not a Python int a row."""
    ends = np.cumsum(row_lengths * BYTES_PER_TOKEN + row_sequences * BYTES_PER_SEQUENCE)  # bytes up to each row
    shards, start, before = [], 0, 0
    while True:
        stop = max(start + 1, int(np.searchsorted(ends, before + shard_bytes, side="right")))
        if stop >= len(ends):
            shards.append((start, len(ends)))
            return shards
        shards.append((start, stop))
        start, before = stop, int(ends[stop - 1])


def shard_name(index: int, count: int, shard_format: str, split: str = "train") -> str:
    return f"data/{split}-{index:05d}-of-{count:05d}.{shard_format}"


def prepare_shards(folder: Path, store: TokenStore, segments: Segments, max_len: int, shard_format: str = "parquet",
                   shard_bytes: int = 500_000_000, split: str = "train", layout: str = DEFAULT_LAYOUT,
                   check=None) -> tuple["ShardJob", list[tuple[int, int]]]:
    """The write stage's context and the shards' rows ``(first, stop)``, planned from the rows' lengths,
    with the pieces' folder made; ``packprep.pipeline.write_shards`` runs the stages on an engine."""
    _arrow_ready()
    plan = plan_shards(segments.row_lengths(), np.diff(segments.offsets), shard_bytes)
    (folder / PIECES).mkdir()
    return ShardJob(folder, store, segments, max_len, shard_format, plan, split, layout, check), plan


def finish_shards(job: "ShardJob", entries: list[dict]) -> None:
    """After the joins: the pieces' folder goes, and an Arrow ``data/`` gets its dataset state."""
    (job.folder / PIECES).rmdir()
    if job.shard_format == "arrow" and job.split == "train" and not job.files:  # load_from_disk(DIR/data): train
        write_arrow_dataset_state(job.folder / "data", entries, job.schema)


def writers(workers: int) -> int:
    """How many of ``workers`` may write at once: each holds a row group and its buffers."""
    return max(1, min(workers, WRITERS_MEMORY // WRITER_BYTES))


def _arrow_ready() -> None:
    """Have Arrow set up its process-wide state here, before the writers fork: its first array and
    first Parquet write allocate ~60 MiB (the compute function registry, the codec), which forked
    writers then share instead of each making a copy of its own."""
    row = {"input_ids": [0, 0], "labels": [0, 0], "position_ids": [0, 1], "seq_lens": [2], "source_index": [0]}
    table = pa.Table.from_pylist([row], schema=ROW_SCHEMA)
    pc.sum(pc.not_equal(pc.list_flatten(table.column("labels")), IGNORE_INDEX))
    sink = pa.BufferOutputStream()
    with shard_writer(sink, "parquet") as write:
        write(table)
    pq.read_table(pa.BufferReader(sink.getvalue()))


def shard_pieces(plan: list[tuple[int, int]], rows_per_group: int, per_shard: int) -> list[tuple[int, int, int, int]]:
    """The write tasks ``(shard, piece, first row, stop row)``: each shard whole (``per_shard`` 1),
    else cut into at most ``per_shard`` runs of whole row groups."""
    pieces = []
    for index, (first, last) in enumerate(plan):
        groups = -(-(last - first) // rows_per_group)
        step = -(-groups // min(groups, per_shard)) * rows_per_group
        pieces += [(index, number, lo, min(last, lo + step)) for number, lo in enumerate(range(first, last, step))]
    return pieces


class ShardJob:
    """What writing any shard needs: the write stage's context (the token store's index, the pieces,
    the layout the rows are written in, and ``check``: see :func:`write_piece`)."""

    def __init__(self, folder, store, segments, max_len, shard_format, plan, split="train", layout=DEFAULT_LAYOUT,
                 check=None):
        self.folder, self.store, self.segments, self.split, self.check = folder, store, segments, split, check
        self.rows_per_group = max(1, ROW_GROUP_TOKENS // max(1, max_len))
        self.firsts, self.count = [first for first, _ in plan], len(plan)
        self.layout, self.context = layout, LayoutContext(max_len=max_len)  # a name: a Layout holds closures
        chosen = get_layout(layout)
        self.files = chosen.writes == FILES  # its pieces are rows for its write_files, never joined into shards
        self.shard_format = "arrow" if self.files else chosen.shard_format(shard_format)
        self.schema = chosen.schema(self.context)

    def piece_path(self, index: int, number: int) -> Path:
        return self.folder / PIECES / f"{self.split}-{index:05d}-{number:05d}.{self.shard_format}"

    def shard_path(self, index: int) -> str:
        return shard_name(index, self.count, self.shard_format, self.split)


def write_piece(job: ShardJob, piece: tuple[int, int, int, int]) -> tuple[int, int, object]:
    """The write stage: write rows ``[lo, hi)`` as piece ``number`` of shard ``index``, a row group
    at a time, in the job's layout: each row group is made as canonical rows, checked with
    ``job.check(check so far, rows, shard, first row)`` where given (a layout whose rows cannot be
    read back), then converted (``Layout.to_layout``). Return its tokens, supervised tokens and check."""
    index, number, lo, hi = piece
    supervised = tokens = 0
    checked, layout = None, get_layout(job.layout)
    with shard_writer(job.piece_path(index, number), job.shard_format, job.schema) as write:
        for start in range(lo, hi, job.rows_per_group):  # one row group in memory at a time
            table = materialize(job.store, job.segments.select(start, min(hi, start + job.rows_per_group)))
            labels = pc.list_flatten(table.column("labels"))
            supervised += pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0
            tokens += len(labels)
            if job.check is not None:
                checked = job.check(checked, table, job.shard_path(index), start - job.firsts[index])
            write(layout.to_layout(table, job.context))
    return tokens, supervised, checked


def write_files(job: ShardJob, pieces: list[tuple[int, int, int, int]], context: LayoutContext) -> list[dict]:
    """For a layout of files of its own: its ``write_files`` gets the pieces' converted rows, in
    order (here: its files are one whole); the pieces go. Return the files' manifest entries."""
    paths = [job.piece_path(index, number) for index, number, _, _ in pieces]
    entries = get_layout(job.layout).write_files((table for path in paths for table in ShardReader(path).tables()),
                                                 job.folder, context)
    for path in paths:
        path.unlink()
    return entries


def join_shard(job: ShardJob, shard: tuple[int, int, int, int, int, int]) -> dict:
    """The join stage: join shard ``index``'s pieces into it; return its manifest entry."""
    index, first, last, pieces, tokens, supervised = shard
    name = job.shard_path(index)
    path = job.folder / name
    sha256 = join_pieces([job.piece_path(index, number) for number in range(pieces)], path, job.shard_format)
    return {"path": name, "rows": last - first, "tokens": tokens, "supervised_tokens": supervised,
            "bytes": path.stat().st_size, "sha256": sha256}


@contextmanager
def shard_writer(path: Path | pa.NativeFile, shard_format: str, schema: pa.Schema = ROW_SCHEMA):
    """A function writing tables of ``schema`` to one shard (``export`` writes other layouts' schemas)."""
    if shard_format == "parquet":
        # no dictionary pages: token ids have too many distinct values for them to pay; without
        # them the fixture shards are 22% smaller and written 20% faster
        writer = pq.ParquetWriter(path, schema, compression="zstd", write_statistics=False, use_dictionary=False)
        try:
            yield lambda table: writer.write_table(table, row_group_size=table.num_rows)
        finally:
            writer.close()
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            yield writer.write_table


def write_arrow_dataset_state(data_dir: Path, entries: list[dict], schema: pa.Schema = ROW_SCHEMA) -> None:
    """Make ``data/`` loadable with ``datasets.load_from_disk`` (memory-mapped, no copy)."""
    import json

    from datasets import Features

    features = Features.from_arrow_schema(schema)
    state = {
        "_data_files": [{"filename": Path(e["path"]).name} for e in entries],
        "_fingerprint": hashlib.sha256("".join(e["sha256"] for e in entries).encode()).hexdigest()[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (data_dir / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    info = {"features": features.to_dict(), "splits": {"train": {"name": "train", "num_examples": sum(e["rows"] for e in entries)}}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
