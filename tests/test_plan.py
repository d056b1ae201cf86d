"""The strategy table and the planner: what each record promises holds, and one entry is a strategy."""

from __future__ import annotations

import numpy as np
import pytest

import packprep
from packprep.errors import ConfigError
from packprep.packing import STRATEGIES, STRATEGY_TABLE, Bins, Strategy, pack_lengths
from packprep.plan import DROPPED, EMPTIED, TRUNCATED, WHOLE, cut_cost, overlong_fates, plan_bins
from packprep.settings import check_strategy
from packprep.length_stats import what_if
from packprep.verification import verify

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

LENGTHS = np.random.default_rng(0).integers(1, 300, 500)


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_record_says_what_its_kernel_does(name):
    strategy = STRATEGY_TABLE[name]
    fitting = np.minimum(LENGTHS, 100)
    packed = fitting if strategy.items_must_fit else LENGTHS
    bins = pack_lengths(packed, 100, name, seed=1, samples_per_row=3)
    rows = bins.bin_lengths(packed)
    if strategy.rows_may_exceed_max_len:
        assert rows.max() > 100  # these lengths do not fit three to a row
    else:
        assert rows.max() <= 100
    assert (bins.starts is not None) == strategy.cuts_samples
    if strategy.needs_samples_per_row:
        with pytest.raises(ValueError, match="samples_per_row"):
            pack_lengths(fitting, 100, name)
        with pytest.raises(ConfigError, match="samples_per_row"):
            check_strategy(name)
    if strategy.items_must_fit:
        with pytest.raises(ValueError, match="longer than max_len"):
            pack_lengths(LENGTHS, 100, name)
    assert sum(s.baseline for s in STRATEGY_TABLE.values()) == 1


def test_unknown_strategy_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match="greedy, bfd, random, pad, minibatch"):
        check_strategy("ffd")


def test_overlong_fates():
    lengths = [5, 10, 11, 30]
    within = [5, 10, 3, 0]
    assert overlong_fates(lengths, 10, "truncate", within).tolist() == [WHOLE, WHOLE, TRUNCATED, EMPTIED]
    assert overlong_fates(lengths, 10, "truncate").tolist() == [WHOLE, WHOLE, TRUNCATED, TRUNCATED]
    assert overlong_fates(lengths, 10, "drop", within).tolist() == [WHOLE, WHOLE, DROPPED, DROPPED]
    assert overlong_fates(lengths, 10, "split", within).tolist() == [WHOLE] * 4


@pytest.mark.parametrize("name", ["greedy", "random", "minibatch"])
def test_split_cuts_only_where_rows_must_fit(name):
    lengths = np.array([25, 3, 9, 10])
    bins = plan_bins(lengths, 10, name, overlong="split", samples_per_row=2)
    entries = bins.entry_lengths(lengths)
    if STRATEGY_TABLE[name].rows_may_exceed_max_len:
        assert bins.starts is None and sorted(entries.tolist()) == sorted(lengths.tolist())
    else:
        assert entries.max() <= 10 and entries.sum() == lengths.sum()


def test_partitions_pack_each_run_on_its_own():
    bins = plan_bins(LENGTHS, 400, "greedy", partition_size=100)
    for first in range(0, len(LENGTHS), 100):
        part = plan_bins(LENGTHS[first : first + 100], 400, "greedy")
        mine = [b for b in range(bins.n_bins) if first <= bins.items[bins.offsets[b]] < first + 100]
        assert [sorted((bins.items[bins.offsets[b] : bins.offsets[b + 1]] - first).tolist()) for b in mine] == [
            sorted(part.items[part.offsets[b] : part.offsets[b + 1]].tolist()) for b in range(part.n_bins)
        ]


def test_a_strategy_is_one_table_entry(monkeypatch, tmp_path):
    """A new strategy registered in the table alone packs, verifies and is planned by stats."""

    def pack_reversed(lengths, max_len, seed, samples_per_row):  # one sample a row, last sample first
        n = len(lengths)
        return Bins(items=np.arange(n, dtype=np.int64)[::-1].copy(), offsets=np.arange(n + 1, dtype=np.int64))

    monkeypatch.setitem(STRATEGY_TABLE, "reversed", Strategy("reversed", pack_reversed, "one sample a row, reversed"))
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), str(EXAMPLE_TOKENIZER), max_len=512,
                             strategy="reversed", row_order="length", num_proc=1)
    assert verify(tmp_path / "out").ok
    report = packprep.stats(str(EXAMPLE_CHATS), str(EXAMPLE_TOKENIZER), max_lens=[512], strategies=["reversed"],
                            num_proc=1)
    (row,) = report["what_if"]["rows"]
    assert row["rows"] == manifest["rows"] == manifest["sequences"]
    assert row["tokens"] == manifest["tokens"]["total"]
    assert what_if([3, 4], None, [8], ["reversed"])[0]["rows"] == 2


def test_cut_cost_counts_the_turns_and_tokens_max_len_leaves_untrained():
    """A turn is a run of trained labels; position 0 never counts (a packed sequence's first label)."""
    I = -100
    labels = [9, I, I, 3, 4, I, I, 7, I, 8, 8, 8]  # turns at 3-4, 7, 9-11 (the 9 at position 0 is never trained)
    assert cut_cost(labels, 12) == (0, 0)  # it fits
    assert cut_cost(labels, 8) == (1, 3)  # truncated to 8: the turn at 9-11 is lost, 7 kept
    assert cut_cost(labels, 4) == (2, 5)  # 4 of the first turn is cut, the turn keeps 3
    assert cut_cost(labels, 7) == (2, 4)  # the turn at 7 is lost with its one token
    assert cut_cost([I] * 12, 4) == (0, 0)
    # --overlong split: each piece's first label becomes -100; only a one-token turn there is lost
    assert cut_cost(labels, 7, pieces=True) == (1, 1)  # the turn at 7
    assert cut_cost(labels, 3, pieces=True) == (0, 2)  # labels at 3 and 9: their turns keep 4 and 10-11
