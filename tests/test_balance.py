"""Rows balanced by compute across data-parallel ranks (``--balance-dp``): the promise on the plan,
the cost model, the manifest, ``stats --dp-size`` and the sampler warning."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import packprep
from packprep.balance import balance_bins, step_efficiency
from packprep.cli import main
from packprep.cost import CostModel, model_cost
from packprep.errors import EXIT_CONFIG
from packprep.packing import Bins, order_bins, pack_lengths

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

COST = model_cost()  # the default shape (Llama-3.2-1B)


def long_tailed(n: int, max_len: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(6.6, 1.5, n)), 16, max_len).astype(np.int64)


def rank_costs(bins: Bins, lengths, dp: int, rows: int, sampler: str) -> np.ndarray:
    """(steps, dp) cost of each rank in each whole step, rows dealt as ``sampler`` deals them."""
    costs = COST.row_costs(bins.entry_lengths(lengths), bins.offsets)
    steps = len(costs) // (dp * rows)
    block = costs[: steps * dp * rows]
    if sampler == "distributed":  # row i to rank i % dp
        return block.reshape(steps, rows, dp).sum(axis=1)
    return block.reshape(steps, dp, rows).sum(axis=2)  # batch b of `rows` rows to rank b % dp


@pytest.mark.parametrize("max_len,n", [(16384, 6000), (32768, 6000)])
@pytest.mark.parametrize("dp,rows", [(4, 1), (8, 1), (4, 2)])
@pytest.mark.parametrize("sampler", ["distributed", "accelerate"])
def test_every_step_gives_the_ranks_equal_cost(max_len, n, dp, rows, sampler):
    """The promise: over long-tailed lengths, the ranks' costs in a step are within 3% of their mean
    in at least 90% of the steps, and the mean step efficiency is at least 0.99 (the steps outside
    hold a sequence too long for any other row of its tuple to match); the rows hold exactly the
    greedy rows' sequences, as many rows, none over max_len."""
    lengths = long_tailed(n, max_len)
    greedy = pack_lengths(lengths, max_len, "greedy")
    balanced = balance_bins(greedy, lengths, max_len, dp, rows, cost=COST, seed=3, sampler=sampler)
    ranks = rank_costs(balanced, lengths, dp, rows, sampler)
    spread = ranks.max(axis=1) / ranks.mean(axis=1)
    assert (spread <= 1.03).mean() >= 0.9
    assert np.mean(1 / spread) >= 0.99
    shuffled = order_bins(greedy, "shuffle", 3)
    assert np.mean(1 / spread) > step_efficiency(COST.row_costs(shuffled.entry_lengths(lengths), shuffled.offsets),
                                                 dp, rows, sampler) + 0.05
    assert balanced.n_bins == greedy.n_bins
    assert sorted(balanced.items.tolist()) == sorted(greedy.items.tolist()) == list(range(n))
    assert balanced.bin_lengths(lengths).max() <= max_len


def test_steps_are_in_seeded_random_order():
    """Same seed, same rows; another seed, another order; no length curriculum: the steps' cost does
    not follow their position."""
    lengths = long_tailed(8000, 16384)
    greedy = pack_lengths(lengths, 16384, "greedy")
    first = balance_bins(greedy, lengths, 16384, 4, cost=COST, seed=5)
    again = balance_bins(greedy, lengths, 16384, 4, cost=COST, seed=5)
    other = balance_bins(greedy, lengths, 16384, 4, cost=COST, seed=6)
    assert np.array_equal(first.items, again.items) and np.array_equal(first.offsets, again.offsets)
    assert not np.array_equal(first.items, other.items)
    step_cost = rank_costs(first, lengths, 4, 1, "distributed").sum(axis=1)
    position = np.arange(len(step_cost))
    rank_correlation = np.corrcoef(np.argsort(np.argsort(step_cost)), position)[0, 1]
    assert abs(rank_correlation) < 0.2


def test_a_tuple_is_repacked_by_moving_sequences():
    """Literal: greedy makes [6, 2, 2] and [2, 2, 2] (costs 44 and 12 under sum(len²)); two 2s move
    to the lighter row (36 and 20), the 6 cannot (no room); the heavier row goes to rank 0."""
    lengths = np.array([6, 2, 2, 2, 2, 2])
    greedy = pack_lengths(lengths, 10, "greedy")
    assert greedy.items.tolist() == [0, 1, 2, 3, 4, 5] and greedy.offsets.tolist() == [0, 3, 6]
    out = balance_bins(greedy, lengths, 10, 2, cost=CostModel(0.0, 1.0), seed=0)
    assert [sorted(out.items[out.offsets[b]:out.offsets[b + 1]].tolist()) for b in range(2)] == [[0], [1, 2, 3, 4, 5]]
    assert out.bin_lengths(lengths).tolist() == [6, 10]


def test_pieces_of_split_samples_keep_their_place_in_the_sample():
    """Under --overlong split the rows hold pieces (sample, start, length): balancing moves pieces, the
    set of (sample, start, length) stays that of greedy."""
    from packprep.plan import plan_bins

    lengths = long_tailed(3000, 40000)
    greedy = plan_bins(lengths, 8192, "greedy", overlong="split")
    out = balance_bins(greedy, lengths, 8192, 4, cost=COST, seed=0)

    def pieces(bins):
        return sorted(zip(bins.items.tolist(), bins.starts.tolist(), bins.lengths.tolist()))

    assert greedy.starts is not None and pieces(out) == pieces(greedy)
    assert out.bin_lengths(lengths).max() <= 8192
    assert step_efficiency(COST.row_costs(out.lengths, out.offsets), 4) >= 0.99


def test_leftover_rows_end_the_order():
    """Rows that fill no whole tuple come last; every row is still there once."""
    lengths = long_tailed(500, 4096)
    greedy = pack_lengths(lengths, 4096, "greedy")
    out = balance_bins(greedy, lengths, 4096, 8, 3, cost=COST, seed=0)
    assert greedy.n_bins % 8 and out.n_bins == greedy.n_bins
    assert sorted(out.items.tolist()) == list(range(500))


def test_cost_model_from_a_model_config(tmp_path):
    """FLOPs of a tiny shape, by hand: hidden 4, 1 layer, 2 heads of 2, 1 key/value head, MLP 8,
    vocabulary 10. Multiply-adds a token: q 16 + k, v 2*8 + o 16 + MLP 96 + head 40 = 184, times 6;
    per squared length 7 * 1 layer * 4 (query width)."""
    config = {"hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 8, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cost = model_cost(tmp_path)
    assert (cost.per_token, cost.per_square, cost.per_sequence) == (1104.0, 28.0, 0.0)
    assert cost.row_costs([3, 1, 2], [0, 2, 3]).tolist() == [1104 * 4 + 28 * 10, 1104 * 2 + 28 * 4]
    assert cost.attention_share([1]) == pytest.approx(28 / 1132)


def test_pack_records_balance_in_the_manifest(tmp_path):
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), str(EXAMPLE_TOKENIZER), num_proc=1,
                             max_len=1024, balance_dp=2, seed=4)
    plain = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "plain"), str(EXAMPLE_TOKENIZER), num_proc=1,
                          max_len=1024, seed=4)
    balance = manifest["balance"]
    assert (balance["dp_size"], balance["rows_per_step"], balance["sampler"]) == (2, 1, "distributed")
    assert balance["steps"] == manifest["rows"] // 2
    assert balance["step_efficiency"] >= 0.97 and balance["cost_model"]["source"] == "default"
    assert manifest["rows"] == plain["rows"] and manifest["tokens"] == plain["tokens"]
    assert "balance" not in plain and manifest["config"]["balance_dp"] == 2
    card = (tmp_path / "out" / "README.md").read_text()
    assert "## Balanced for 2 data-parallel ranks" in card and "DistributedSampler(shuffle=False)" in card
    assert "Balanced for" not in (tmp_path / "plain" / "README.md").read_text()
    from packprep.training import PackedDataset

    def sequences(folder):
        data = PackedDataset(folder)
        out = []
        for row in (data[i] for i in range(len(data))):
            bounds = np.cumsum(row["seq_lens"])[:-1]
            out += [(ids.tobytes(), labels.tobytes()) for ids, labels in
                    zip(np.split(row["input_ids"], bounds), np.split(row["labels"], bounds))]
        return sorted(out)

    assert len(sequences(tmp_path / "out")) == manifest["sequences"]
    assert sequences(tmp_path / "out") == sequences(tmp_path / "plain")
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "out")]).exit_code == 0
    folder = json.loads(CliRunner().invoke(main, ["stats", str(tmp_path / "out"), "--dp-size", "2", "--json"]).stdout)
    assert folder["steps"] == balance  # the folder's rows, read back, give what pack predicted
    plain_steps = json.loads(CliRunner().invoke(main, ["stats", str(tmp_path / "plain"), "--dp-size", "2",
                                                       "--json"]).stdout)["steps"]
    assert plain_steps["step_efficiency"] < balance["step_efficiency"]


def test_cli_refuses_what_cannot_be_balanced(tmp_path):
    runner = CliRunner()
    base = ["pack", str(EXAMPLE_CHATS), "-t", str(EXAMPLE_TOKENIZER), "-o", str(tmp_path / "o"), "-q"]
    cases = [
        (["--balance-dp", "4", "--strategy", "random"], "greedy, bfd"),
        (["--balance-dp", "4", "--row-order", "length"], "--row-order"),
        (["--rows-per-step", "2"], "only with --balance-dp"),
        (["--balance-dp", "0"], "--balance-dp must be between 1 and"),
    ]
    for extra, message in cases:
        result = runner.invoke(main, base + extra)
        assert result.exit_code == EXIT_CONFIG and message in result.output, (extra, result.output)
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 8}')
    result = runner.invoke(main, base + ["--balance-dp", "2", "--model-config", str(bad)])
    assert result.exit_code == EXIT_CONFIG and "num_hidden_layers" in result.output and str(bad) in result.output
    assert not (tmp_path / "o").exists()


def test_stats_predicts_step_efficiency():
    args = ["stats", str(EXAMPLE_CHATS), "-t", str(EXAMPLE_TOKENIZER), "--max-len", "512", "--max-len", "2048",
            "--dp-size", "4", "--num-proc", "1", "-q"]
    runner = CliRunner()
    text = runner.invoke(main, args)
    assert text.exit_code == 0, text.output
    assert "step efficiency over 4 data-parallel ranks" in text.output
    assert max(len(line) for line in text.output.splitlines()) <= 80
    report = json.loads(runner.invoke(main, args + ["--json"]).stdout)
    rows = {(r["max_len"], r["strategy"]): r for r in report["what_if"]["rows"]}
    greedy = rows[(2048, "greedy")]
    assert greedy["step_efficiency_balanced"] > greedy["step_efficiency"]
    assert rows[(2048, "random")]["step_efficiency_balanced"] is None
    assert 0 < greedy["attention_share"] < 1 and report["what_if"]["dp_size"] == 4


def test_check_order_warns_on_a_sampler_that_undoes_the_order(tmp_path):
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    from packprep.training import BalanceOrderWarning, PackedDataset, check_order

    packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), str(EXAMPLE_TOKENIZER), num_proc=1, max_len=512,
                  balance_dp=2)
    data = PackedDataset(tmp_path / "out")
    in_order = DataLoader(data, batch_size=1, sampler=DistributedSampler(data, 2, 0, shuffle=False))
    with pytest.warns(BalanceOrderWarning, match="shuffles"):
        assert check_order(DataLoader(data, batch_size=1, shuffle=True), tmp_path / "out")
    with pytest.warns(BalanceOrderWarning, match="shuffle=False"):
        check_order(DataLoader(data, batch_size=1, sampler=DistributedSampler(data, 2, 0)), tmp_path / "out")
    with pytest.warns(BalanceOrderWarning, match="4 ranks"):
        check_order(DataLoader(data, batch_size=1, sampler=DistributedSampler(data, 4, 0, shuffle=False)),
                    tmp_path / "out")
    assert check_order(in_order, tmp_path / "out") == []


@pytest.mark.slow
def test_check_order_reads_a_trainers_sampling(tmp_path):
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from packprep.training import BalanceOrderWarning, check_order

    packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), str(EXAMPLE_TOKENIZER), num_proc=1, max_len=512,
                  balance_dp=1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))

    def trainer(**args):
        return transformers.Trainer(
            model=model, train_dataset=datasets.load_dataset(str(tmp_path / "out"), split="train"),
            args=transformers.TrainingArguments(output_dir=str(tmp_path / "t"), report_to=[], **args))

    with pytest.warns(BalanceOrderWarning, match="train_sampling_strategy='random'"):
        assert len(check_order(trainer(per_device_train_batch_size=1), tmp_path / "out")) == 1
    with pytest.warns(BalanceOrderWarning, match="per_device_train_batch_size is 2"):
        check_order(trainer(per_device_train_batch_size=2, train_sampling_strategy="sequential"), tmp_path / "out")
    in_order = trainer(per_device_train_batch_size=1, train_sampling_strategy="sequential")
    assert check_order(in_order, tmp_path / "out") == []
