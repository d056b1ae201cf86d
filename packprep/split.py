"""The validation split (``--validation-size``): which records are held out, and the manifest's record of it.

Held out per mixture source in proportion to its records (largest remainders, so that a count of
``N`` is exactly ``N``), by a seeded draw on the token store; before any weight repeats a record
(mix.py), so that no record nor a copy of one is in both splits. Rejected records are not candidates.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError


def hold_out(group_of: np.ndarray, groups: int, size: float | None, seed: int) -> np.ndarray:
    """A mask of the sequences held out for validation (``group_of``: each sequence's source)."""
    held = np.zeros(len(group_of), bool)
    if not size:
        return held
    counts = np.bincount(group_of, minlength=groups)
    wanted = int(round(size * len(group_of))) if size < 1 else int(size)
    if wanted >= len(group_of):
        raise ConfigError(f"--validation-size {size:g} holds out {wanted:,} of the {len(group_of):,} records that "
                          "can be packed, leaving none to train on")
    for group, take in enumerate(_apportion(counts, wanted)):
        members = np.flatnonzero(group_of == group)
        rng = np.random.default_rng([seed, 0x76616C, group])  # "val"
        held[members[rng.choice(len(members), take, replace=False)]] = True
    return held


def _apportion(counts: np.ndarray, wanted: int) -> list[int]:
    """``wanted`` split over the groups in proportion to ``counts``: floors, then one more to the
    largest remainders (the earlier group first on a tie)."""
    exact = counts * wanted / max(1, counts.sum())
    shares = np.floor(exact).astype(np.int64)
    order = sorted(range(len(counts)), key=lambda g: (-(exact[g] - shares[g]), g))
    for group in order[: wanted - int(shares.sum())]:
        shares[group] += 1
    return np.minimum(shares, counts).tolist()


def membership(records: np.ndarray, input_starts: np.ndarray) -> list[dict]:
    """The held-out records (ascending input record numbers) as ``{"input": i, "indices": [...]}`` per
    input file: its position in the manifest's ``inputs`` and the records' indices in it."""
    inputs = np.searchsorted(input_starts, records, side="right") - 1
    return [{"input": int(i), "indices": (records[inputs == i] - input_starts[i]).tolist()}
            for i in np.unique(inputs).tolist()]


def members_to_records(members: list[dict], input_starts: np.ndarray) -> np.ndarray:
    """The input record numbers a manifest's ``validation.members`` names."""
    parts = [np.asarray(m["indices"], np.int64) + int(input_starts[m["input"]]) for m in members]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
