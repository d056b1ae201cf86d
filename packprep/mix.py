"""Step 4a': which sequences a run trains on, and how often: a mixture of sources and a validation split.

``pack --mix MIX.yaml`` names sources, each with a ``weight`` (a multiplier of its records) or a
``share`` (its fraction of the output's tokens); ``--validation-size`` holds records out. Both are
decided here, after tokenizing (a share needs token counts) and before packing, as a
:class:`Selection` of the token store's sequences: the validation records first (so no record, nor
a copy of one, is in both splits), then each source's copies. Every draw is seeded by ``--seed`` and
the source's position, and made on the store, which is the same for any ``--num-proc``: so is the
selection. The training sequences are listed in rounds (every record once, then the records with a
second copy, ...), and each round is packed on its own (:func:`plan_rounds`): a record's copies are
never in one row, at the cost of at most a part-filled row a round.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .normalize import FORMATS
from .packing import Bins
from .read import STDIN, Source, json_message, resolve_inputs
from .settings import check_choice, check_copies, check_mix_weight, check_validation_size

MIX_KEYS = ("path", "name", "weight", "share", "format", "messages_field")
SHARE_TOLERANCE = 1e-6
MIX_FILE_BYTES = 10_000_000  # a mixture file lists sources: more is not one
MIX_VALUES = 100_000  # values a mixture file may hold once its YAML aliases are expanded (an alias bomb: billions)


@dataclass
class MixSource:
    """One source of a mixture: a file, folder, pattern or Hub id, and how much of it to train on."""

    path: str
    name: str
    weight: float | None = None  # exactly one of weight and share
    share: float | None = None
    format: str | None = None
    messages_field: str | None = None
    origin: str | None = field(default=None, compare=False)  # where the mixture file says it, for messages

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path,
                **({"share": self.share} if self.share is not None else {"weight": self.weight})}


def load_mix(path: str | os.PathLike | None, inputs: list[str] = ()) -> list[MixSource]:
    """The sources of the mixture file ``path`` (YAML or JSON), after ``inputs`` at weight 1.

    A source's relative path is taken from the mixture file's folder where it exists there.
    """
    sources = [MixSource(spec, spec, weight=1.0) for spec in inputs]
    if path is None:
        return sources
    text = _read_mix(Path(path))
    try:
        data = json.loads(text) if str(path).endswith(".json") else _load_yaml(text)
    except Exception as exc:
        raise ConfigError(f"--mix {path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'} "
                          f"({_where(exc)})") from None
    if _values(data) > MIX_VALUES:
        raise ConfigError(f"--mix {path}: holds more than {MIX_VALUES:,} values once its aliases are expanded; a "
                          "mixture file lists sources (an alias bomb is refused)")
    entries = data.get("sources") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"--mix {path}: expected a list of sources (or a 'sources:' key holding one), "
                          "each with a 'path' and a 'weight' or a 'share'")
    base = Path(path).parent
    for number, entry in enumerate(entries, start=1):
        sources.append(_mix_source(entry, f"--mix {path}, source {number}", base))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--mix {path}: source name {twice[0]!r} is used twice; give each source its own 'name'")
    check_shares(sources, f"--mix {path}")
    return sources


def _read_mix(path: Path) -> str:
    """The mixture file's text: a regular file of at most ``MIX_FILE_BYTES`` (a FIFO or a device would
    block, or never end)."""
    try:
        if not path.is_file():
            raise ConfigError(f"--mix {path}: not a regular file; give a YAML or JSON file" if path.exists()
                              else f"--mix {path}: no such file")
        if path.stat().st_size > MIX_FILE_BYTES:
            raise ConfigError(f"--mix {path}: {path.stat().st_size:,} bytes; a mixture file lists sources "
                              f"(at most {MIX_FILE_BYTES:,} bytes)")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--mix {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--mix {path}: not UTF-8 text (byte {exc.start})") from None


def _load_yaml(text: str):
    import yaml

    return yaml.safe_load(text)


def _where(exc: Exception) -> str:
    """A parse error's line and column (YAML's problem mark, JSON's lineno), then what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {getattr(exc, 'problem', None) or exc}"
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}, column {exc.colno}: {json_message(exc.msg)}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _values(data, budget: int = MIX_VALUES + 1) -> int:
    """How many values ``data`` holds, counting a shared (aliased) one each time it appears; stops
    counting past ``budget``."""
    count, stack = 0, [data]
    while stack and count < budget:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def check_shares(sources: list[MixSource], where: str) -> None:
    """The shares' sum, checked when the mixture is read, before any input is: shares alone add up to 1;
    beside weighted sources (positional inputs among them) they leave those a part (below 1)."""
    shares = [s.share for s in sources if s.share is not None]
    if not shares:
        return
    total = sum(shares)
    if len(shares) == len(sources) and abs(total - 1) > SHARE_TOLERANCE:
        raise ConfigError(f"{where}: the shares add up to {total:g}; with no weighted source they must add up to 1")
    if len(shares) < len(sources) and total >= 1 - SHARE_TOLERANCE:
        raise ConfigError(f"{where}: the shares add up to {total:g}, leaving nothing for the weighted sources "
                          "(and the inputs given beside --mix); make them add up to less than 1")


def _mix_source(entry, where: str, base: Path) -> MixSource:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"].strip():
        raise ConfigError(f"{where}: needs a 'path' (a file, folder, pattern or Hub id)")
    unknown = sorted(map(str, set(entry) - set(MIX_KEYS)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(MIX_KEYS)})")
    for key in ("name", "messages_field"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise ConfigError(f"{where}: {key} must be text, not {str(entry[key])[:60]}")
    if "weight" in entry and "share" in entry:
        raise ConfigError(f"{where}: give a 'weight' or a 'share', not both")
    local = str(base / entry["path"])  # a file, folder or pattern beside the mixture file
    beside = not os.path.isabs(entry["path"]) and (os.path.exists(local) or glob.glob(local))
    path = local if beside else entry["path"]
    source = MixSource(path, str(entry.get("name") or entry["path"]), format=entry.get("format"),
                       messages_field=entry.get("messages_field"),
                       origin=f"{where}: path {entry['path']!r} (read from the mixture file's folder, "
                       f"{os.path.abspath(base)}, else the current one)")
    if source.format is not None:
        check_choice(f"{where}: format", source.format, FORMATS)
    if "share" in entry:
        source.share = _number(entry["share"], "share", where)
        if not 0 < source.share < 1 + SHARE_TOLERANCE:
            raise ConfigError(f"{where}: share must be above 0 and at most 1, not {source.share}")
    else:
        source.weight = check_mix_weight(where, entry.get("weight", 1))
    return source


def _number(value, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a number, not {value!r}")
    return float(value)


def open_inputs(inputs: list[str], mix: str | None, validation_size: float | None) -> tuple[list[Source], "Mixture | None"]:
    """The input files of a run, and its mixture where it has one (``--mix`` or ``--validation-size``)."""
    if mix is None and not validation_size:
        return resolve_inputs(inputs), None
    check_validation_size(validation_size)
    sources = load_mix(mix, inputs)
    if not sources:
        raise ConfigError("no input given: pass input files, or --mix with a mixture file")
    files, groups = resolve_mix(sources)
    return files, Mixture(sources, groups, validation_size)


def resolve_mix(mix: list[MixSource]) -> tuple[list[Source], list[int]]:
    """The input files of every source, in order, and the source each file belongs to."""
    files, groups = [], []
    if sum(source.path in STDIN for source in mix) > 1:
        raise ConfigError("standard input ('-') is given twice; it can be read once: give it once")
    for number, source in enumerate(mix):
        try:
            found_all = resolve_inputs([source.path])
        except ConfigError as exc:
            if source.origin is None:
                raise
            raise ConfigError(f"{source.origin}: {exc}") from None
        for found in found_all:
            found.format, found.messages_field = source.format, source.messages_field
            files.append(found)
            groups.append(number)
    return files, groups


@dataclass
class Selection:
    """What each split packs, as token-store sequence numbers: ``train`` in rounds (every record with a
    copy once, ascending; then those with a second; ...: ``round_starts``), ``validation`` ascending;
    ``unsampled``: the accepted sequences neither packs."""

    train: np.ndarray
    validation: np.ndarray
    unsampled: np.ndarray
    round_starts: np.ndarray  # int64, rounds + 1: where each round of ``train`` starts

    def rounds(self, split: str = "train") -> list[np.ndarray]:
        """The split's sequences in rounds, none twice in a round (validation: one round)."""
        if split != "train":
            return [self.validation]
        return [self.train[a:b] for a, b in zip(self.round_starts[:-1], self.round_starts[1:])]

    @classmethod
    def from_copies(cls, copies: np.ndarray, held_out: np.ndarray) -> "Selection":
        """The selection of ``copies`` (per sequence, in training) and ``held_out`` (a mask)."""
        rounds = [np.flatnonzero(copies > r) for r in range(int(copies.max(initial=0)))]
        train = np.concatenate(rounds) if rounds else np.zeros(0, np.int64)
        starts = np.concatenate([[0], np.cumsum([len(r) for r in rounds])]).astype(np.int64)
        return cls(train.astype(np.int64), np.flatnonzero(held_out).astype(np.int64),
                   np.flatnonzero((copies == 0) & ~held_out).astype(np.int64), starts)

    def copies(self, sequences: int) -> np.ndarray:
        return np.bincount(self.train, minlength=sequences)


def plan_selection(mix: list[MixSource], group_of: np.ndarray, lengths: np.ndarray, seed: int,
                   validation_size: float | None) -> Selection:
    """The selection of the store's sequences (``group_of``: each one's mixture source; ``lengths``: its
    tokens): validation first, then the weights, then the shares (whose targets the weights fix)."""
    from .split import hold_out

    held_out = hold_out(group_of, len(mix), validation_size, seed)
    copies = np.zeros(len(lengths), np.int64)
    fixed_tokens = 0
    for number, source in enumerate(mix):
        if source.weight is not None:
            members = np.flatnonzero((group_of == number) & ~held_out)
            copies[members] = _weighted(len(members), source.weight, _rng(seed, number))
            fixed_tokens += int((copies[members] * lengths[members]).sum())
    shares = [(n, s) for n, s in enumerate(mix) if s.share is not None]
    if shares:
        total = _share_total(mix, shares, group_of, held_out, lengths, fixed_tokens)
        for number, source in shares:
            members = np.flatnonzero((group_of == number) & ~held_out)
            if not len(members) or not lengths[members].sum():
                raise ConfigError(f"mixture source {source.name!r} has no records left to reach its share")
            check_copies(source.name, int(source.share * total // max(1, int(lengths[members].sum()))) + 1)
            copies[members] = _to_tokens(lengths[members], source.share * total, _rng(seed, number))
    return Selection.from_copies(copies, held_out)


def plan_by_record(mix: list[MixSource], records: np.ndarray, group_of: np.ndarray, lengths: np.ndarray, seed: int,
                   validation_size: float | None) -> Selection:
    """:func:`plan_selection` drawn over records (``records``: each sequence's input record, ascending), so
    that every sequence of a record (``--turn-context exact`` gives several) lands in the same split with
    the same copies; with one sequence a record, it is ``plan_selection`` itself."""
    unique, first, sequence_of = np.unique(records, return_index=True, return_inverse=True)
    tokens = np.bincount(sequence_of, weights=lengths, minlength=len(unique)).astype(np.int64)
    drawn = plan_selection(mix, group_of[first], tokens, seed, validation_size)
    held = np.zeros(len(unique), bool)
    held[drawn.validation] = True
    return Selection.from_copies(drawn.copies(len(unique))[sequence_of], held[sequence_of])


def _rng(seed: int, number: int) -> np.random.Generator:
    return np.random.default_rng([seed, 0x6D6978, number])  # "mix"


def _weighted(records: int, weight: float, rng: np.random.Generator) -> np.ndarray:
    """Copies of each record: the integer part of ``weight`` each, one more for a seeded sample of
    round-half-up(fraction x records) of them (0.5 of 7 records: 4)."""
    whole = int(weight)
    extra = min(records, int(math.floor((weight - whole) * records + 0.5)))
    copies = np.full(records, whole, np.int64)
    copies[rng.choice(records, extra, replace=False)] += 1
    return copies


def _share_total(mix, shares, group_of, held_out, lengths, fixed_tokens: int) -> float:
    """The output's tokens that the shares are fractions of. With weighted sources, what makes their
    tokens the rest (1 - sum of shares); with shares alone (adding up to 1), the sources' own total."""
    total_share = sum(s.share for _, s in shares)  # its range checked as the mixture was read (check_shares)
    if len(shares) == len(mix):
        return float(lengths[~held_out].sum())
    if fixed_tokens == 0:
        raise ConfigError("the mixture's weighted sources give no tokens, so its shares have nothing to be a share "
                          "of; give a source a weight above 0, or give every source a share")
    return fixed_tokens / (1 - total_share)


def _to_tokens(lengths: np.ndarray, target: float, rng: np.random.Generator) -> np.ndarray:
    """Copies of each record whose tokens come nearest ``target``: whole passes over the records, a seeded
    random prefix of them that stays within the rest, then the one other record that best fills the gap."""
    tokens = int(lengths.sum())
    whole = int(target // tokens)
    copies = np.full(len(lengths), whole, np.int64)
    rest = target - whole * tokens
    order = rng.permutation(len(lengths))
    running = np.cumsum(lengths[order])
    take = int(np.searchsorted(running, rest, side="right"))
    copies[order[:take]] += 1
    gap = rest - (int(running[take - 1]) if take else 0)
    if take < len(order):
        others = order[take:]
        best = others[int(np.argmin(np.abs(lengths[others] - gap)))]
        if abs(int(lengths[best]) - gap) < gap:
            copies[best] += 1
    return copies


def plan_rounds(lengths: np.ndarray, rounds: list[np.ndarray], plan) -> Bins:
    """The bins of each round (store sequences, none twice in a round) planned on its own by ``plan``
    (lengths -> Bins), in round order, over store sequences: a copy is never in a row with its twin."""
    parts = [plan(lengths[members]) for members in rounds]
    items = np.concatenate([members[part.items] for members, part in zip(rounds, parts)] or [np.zeros(0, np.int64)])
    sizes = np.concatenate([np.diff(part.offsets) for part in parts] or [np.zeros(0, np.int64)])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if not parts or parts[0].starts is None:
        return Bins(items, offsets)
    return Bins(items, offsets, np.concatenate([p.starts for p in parts]), np.concatenate([p.lengths for p in parts]))


@dataclass
class Mixture:
    """A run's mixture (its sources, and the source of each input file), validation size and, once the
    store is made, its selection."""

    sources: list[MixSource]
    groups: list[int]
    validation_size: float | None = None
    selection: Selection | None = None
    accepted: list[int] | None = None  # each source's accepted sequences where the store holds fewer (repack's)

    def select(self, records: np.ndarray, input_records: list[int], lengths: np.ndarray, seed: int) -> Selection:
        """Plan the selection of the store's sequences (``records``: each one's input record number)."""
        self.selection = plan_by_record(self.sources, records, self.group_of(records, input_records), lengths, seed,
                                        self.validation_size)
        if not len(self.selection.train):
            raise ConfigError("the mixture leaves no record to train on (every weight is 0, or its sources have "
                              "no accepted record); give a source a weight above 0")
        return self.selection

    def group_of(self, records: np.ndarray, input_records: list[int]) -> np.ndarray:
        starts = input_starts(input_records)
        return np.asarray(self.groups, np.int64)[np.searchsorted(starts, records, side="right") - 1]

    def table(self, records: np.ndarray, lengths: np.ndarray, inputs: list[dict]) -> dict:
        """The manifest's ``mixture``: each source as asked for and as realized in ``train``."""
        group_of = self.group_of(records, [entry["records"] for entry in inputs])
        copies = self.selection.copies(len(records))
        held = np.zeros(len(records), bool)
        held[self.selection.validation] = True
        tokens = np.bincount(group_of, copies * lengths.astype(np.int64), minlength=len(self.sources))
        total = max(1, int(tokens.sum()))
        rows = []
        for number, source in enumerate(self.sources):
            mine = group_of == number
            files = [n for n, group in enumerate(self.groups) if group == number]
            rows.append({
                **source.describe(), "inputs": files, "sha256": [inputs[n]["sha256"] for n in files],
                "records": sum(inputs[n]["records"] for n in files),
                "sequences": int(mine.sum()) if self.accepted is None else self.accepted[number],
                "validation_records": len(np.unique(records[mine & held])),
                "train_records": len(np.unique(records[mine & (copies > 0)])),
                "train_sequences": int(copies[mine].sum()), "train_tokens": int(tokens[number]),
                "realized_share": round(int(tokens[number]) / total, 6),
            })
        return {"seed_dependent": self.seed_dependent, "sources": rows}

    @property
    def seed_dependent(self) -> bool:
        """Whether ``--seed`` chose records (a sample, a share, a validation split)."""
        return bool(self.validation_size) or any(
            s.share is not None or s.weight != int(s.weight) for s in self.sources)


def input_starts(input_records: list[int]) -> np.ndarray:
    """The first input record number of each input file (and the total at the end)."""
    return np.concatenate([[0], np.cumsum(np.asarray(input_records, np.int64))]).astype(np.int64)
