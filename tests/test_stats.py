"""``packprep stats``: the what-if plan equals what ``pack`` then produces; reports render in 80 columns."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG, ConfigError
from packprep.packing import pack_lengths
from packprep.length_stats import (
    distribution,
    log_histogram,
    render_text,
    stats,
    stats_folder,
    what_if,
)

from .conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, fixture_tokenizer, needs_fixtures, slow_but

TOKENIZER = str(EXAMPLE_TOKENIZER)


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.fixture(scope="module")
def example_report() -> dict:
    return stats(str(EXAMPLE_CHATS), TOKENIZER, max_lens=(256, 512), strategies=("pad", "greedy", "random", "bfd"),
                 global_batch_size=16, epochs=2, num_proc=1)


# ---------------------------------------------------------------------------------------------
# the pure what-if
# ---------------------------------------------------------------------------------------------


def synthetic(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(5.5, 1.2, n)).astype(np.int64) + 1
    supervised = lengths // 2
    return lengths, supervised


@pytest.mark.parametrize("overlong", ["truncate", "drop", "split"])
def test_what_if_matches_the_packing_engine(overlong):
    lengths, supervised = synthetic()
    table = what_if(lengths, supervised, (256, 1024, 4096), ("pad", "greedy", "random", "bfd"),
                    overlong=overlong, global_batch_size=32, epochs=3)
    assert [(r["max_len"], r["strategy"]) for r in table] == [
        (m, s) for m in (256, 1024, 4096) for s in ("pad", "greedy", "random", "bfd")
    ]
    for r in table:
        m = r["max_len"]
        over = lengths > m
        assert r["overlong_samples"] == int(over.sum())
        if overlong == "truncate":
            kept = np.minimum(lengths, m)
            assert r["overlong_tokens_lost"] == int((lengths - kept).sum())
        elif overlong == "drop":
            kept = lengths[~over]
            assert r["overlong_tokens_lost"] == int(lengths[over].sum())
        else:
            kept = lengths
            assert r["overlong_tokens_lost"] == 0
        assert r["tokens"] == int(kept.sum())
        if overlong != "split":
            expected_rows = pack_lengths(kept, m, r["strategy"]).n_bins
            assert r["rows"] == expected_rows
        assert r["rows"] >= math.ceil(r["tokens"] / m)
        assert r["padding_tokens"] == r["rows"] * m - r["tokens"]
        assert r["efficiency"] == pytest.approx(r["tokens"] / (r["rows"] * m), abs=1e-6)
        assert r["optimizer_steps"] == math.ceil(r["rows"] / 32) * 3
        if r["strategy"] == "pad":
            assert r["samples_per_row"] == 1.0 and r["attention_vs_pad"] == 1.0
        if r["strategy"] in ("greedy", "bfd"):
            assert r["attention_vs_pad"] == 1.0  # packing whole samples never changes sum(len^2)
        if r["strategy"] == "random":
            assert r["attention_vs_pad"] <= 1.0
            assert r["rows"] == math.ceil(r["tokens"] / m)  # random fills every row but the last
    rows = {(r["max_len"], r["strategy"]): r["rows"] for r in table}
    assert rows[(1024, "greedy")] < rows[(1024, "pad")]


def test_truncation_rejects_samples_left_without_trained_tokens():
    lengths = np.array([10, 300, 300, 50])
    supervised = np.array([5, 100, 100, 20])
    within = {100: np.array([5, 0, 40, 20])}  # sample 1's answer starts after token 100
    (r,) = what_if(lengths, supervised, [100], ["greedy"], supervised_within=within)
    assert r["rejected"] == 1 and r["overlong_samples"] == 2
    assert r["tokens"] == 10 + 100 + 50
    assert r["overlong_tokens_lost"] == 300 + 200
    assert r["supervised_tokens"] == 5 + 40 + 20
    assert r["sequences"] == 3


def test_split_counts_the_masked_first_labels_of_pieces():
    lengths = np.array([250, 40])
    supervised = np.array([200, 30])
    masked = {100: np.array([2, 0])}  # sample 0 is trained at positions 100 and 200
    (pad, greedy, random_) = what_if(lengths, supervised, [100], ["pad", "greedy", "random"],
                                     overlong="split", split_masked=masked)
    assert pad["rows"] == 4 and pad["sequences"] == 4
    assert greedy["supervised_tokens"] == 228 and greedy["supervised_exact"]
    assert random_["rows"] == 3 and not random_["supervised_exact"]


def test_what_if_rejects_bad_plans():
    with pytest.raises(ConfigError, match="strategy"):
        what_if([10], None, [100], ["best"])
    with pytest.raises(ConfigError, match="max_len"):
        what_if([10], None, [1], ["pad"])
    with pytest.raises(ConfigError, match="samples_per_row"):
        what_if([10], None, [100], ["minibatch"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        what_if([10], None, [100], ["pad"], global_batch_size=0)
    with pytest.raises(ValueError):
        what_if([0, 5], None, [100], ["pad"])


def test_minibatch_pads_to_the_longest_row():
    (r,) = what_if([10, 300, 20, 20], None, [100], ["minibatch"], samples_per_row=2, overlong="split")
    assert r["rows"] == 2 and r["tokens"] == 350 and r["overlong_tokens_lost"] == 0
    width = (r["padding_tokens"] + r["tokens"]) / r["rows"]  # rows padded to the longest, not to max_len
    assert width >= 310 and 0 < r["efficiency"] <= 1.0


def test_log_histogram_and_distribution():
    values = np.array([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 40000])
    bins = log_histogram(values)
    assert sum(b["count"] for b in bins) == len(values)
    assert bins[0]["lo"] <= 1 and bins[-1]["hi"] > 40000
    assert all(a["hi"] == b["lo"] for a, b in zip(bins, bins[1:]))
    assert all(b["hi"] / b["lo"] <= 2.01 or b["lo"] < 4 for b in bins)  # log-scaled: at most a doubling
    assert log_histogram([]) == []
    d = distribution(values)
    assert (d["count"], d["min"], d["max"], d["p50"]) == (16, 1, 40000, 34)
    assert d["p99"] == 40000 and d["p90"] == 987


# ---------------------------------------------------------------------------------------------
# stats() on real data equals pack()
# ---------------------------------------------------------------------------------------------


def test_example_report(example_report):
    r = example_report
    assert r["kind"] == "inputs" and r["records"] == 404
    assert r["conversations"] + r["rejected"] == r["records"]
    assert r["rejected"] == sum(r["rejected_by_reason"].values()) > 0
    assert sum(b["count"] for b in r["histogram"]["bins"]) == r["conversations"]
    assert r["distribution"]["tokens"]["count"] == r["conversations"]
    assert r["distribution"]["turns"]["min"] >= 2
    assert r["over_max_len"]["256"] > r["over_max_len"]["512"]
    assert len(r["what_if"]["rows"]) == 8
    json.dumps(r)  # JSON-ready


@pytest.mark.parametrize(
    "strategy, overlong, partition_size",
    [
        ("greedy", "truncate", None),
        ("pad", "truncate", None),
        ("random", "truncate", None),
        ("bfd", "drop", None),
        ("greedy", "split", None),
        ("random", "truncate", 150),
    ],
)
def test_what_if_equals_pack(example_report, tmp_path, strategy, overlong, partition_size):
    if overlong == "truncate" and partition_size is None:
        report = example_report
    else:
        report = stats(str(EXAMPLE_CHATS), TOKENIZER, max_lens=(256,), strategies=(strategy,), num_proc=1,
                       overlong=overlong, partition_size=partition_size, global_batch_size=16, epochs=2)
    plan = next(r for r in report["what_if"]["rows"] if r["max_len"] == 256 and r["strategy"] == strategy)
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), TOKENIZER, num_proc=1, max_len=256,
                             strategy=strategy, overlong=overlong, partition_size=partition_size)
    assert plan["rows"] == manifest["rows"]
    assert plan["tokens"] == manifest["tokens"]["total"]
    assert plan["sequences"] == manifest["sequences"]
    assert plan["rejected"] + report["rejected"] == manifest["counts"]["rejected"]
    assert plan["efficiency"] == pytest.approx(manifest["efficiency"], abs=1e-6)
    if plan["supervised_exact"]:
        assert plan["supervised_tokens"] == manifest["tokens"]["supervised"]
    else:  # random cuts samples: each cut piece's first label became -100
        assert 0 <= plan["supervised_tokens"] - manifest["tokens"]["supervised"] <= plan["sequences"]

    folder = stats_folder(tmp_path / "out", global_batch_size=16, epochs=2)
    assert folder["rows"] == plan["rows"] and folder["optimizer_steps"] == plan["optimizer_steps"]
    assert folder["efficiency"] == pytest.approx(plan["efficiency"], abs=1e-6)
    assert folder["sequences"] == plan["sequences"]
    assert sum(b["count"] for b in folder["fill_histogram"]) == folder["rows"]


@needs_fixtures
def test_stats_equals_pack_on_fixture_data_with_llama3(tmp_path):
    """A slice of medicalgpt (long, mostly Chinese conversations) with the real llama3 tokenizer."""
    lines = (CONVERSATIONS / "medicalgpt_sharegpt_zh_1K_format.jsonl").read_text(encoding="utf-8").splitlines()
    data = tmp_path / "medical.jsonl"
    data.write_text("\n".join(lines[:60]) + "\n", encoding="utf-8")
    tokenizer = fixture_tokenizer("llama3")
    report = stats(str(data), tokenizer, max_lens=(1024, 4096), strategies=("pad", "greedy"), num_proc=1)
    assert report["over_max_len"]["1024"] > 0
    for strategy in ("pad", "greedy"):
        plan = next(r for r in report["what_if"]["rows"] if r["max_len"] == 1024 and r["strategy"] == strategy)
        manifest = packprep.pack(str(data), str(tmp_path / strategy), tokenizer, num_proc=1, max_len=1024,
                                 strategy=strategy)
        assert (plan["rows"], plan["tokens"], plan["supervised_tokens"], plan["sequences"]) == (
            manifest["rows"], manifest["tokens"]["total"], manifest["tokens"]["supervised"], manifest["sequences"]
        )
        assert plan["overlong_samples"] == manifest["counts"]["truncated"] + plan["rejected"]
    assert widest(render_text(report)) <= 80


def _medical_slice(tmp_path) -> Path:
    """30 medicalgpt conversations of 4 to 8 messages and 800 to 4,000 characters: some longer than
    512 tokens, none the hundreds of exact sequences of the longest ones."""
    lines = (CONVERSATIONS / "medicalgpt_sharegpt_zh_1K_format.jsonl").read_text(encoding="utf-8").splitlines()
    chosen = [line for line in lines if 4 <= len(json.loads(line)["conversations"]) <= 8 and 800 <= len(line) <= 4000]
    data = tmp_path / "medical.jsonl"
    data.write_text("\n".join(chosen[:30]) + "\n", encoding="utf-8")
    return data


@needs_fixtures
def test_every_turn_max_len_cuts_is_counted_where_stats_predicts(tmp_path, template_folder):
    """Qwen3 trains each medical turn in a sequence of its own (--turn-context exact); at --max-len 512
    some keep no trained token and are left out, others lose their tail. The turns and supervised
    tokens cut are in the summary, the manifest, the card, stats on the folder, and are what stats
    on the inputs predicts; the supervised tokens written and cut add up to those encoded."""
    data, folder = _medical_slice(tmp_path), template_folder("qwen3")
    args = [str(data), "--tokenizer", folder, "--max-len", "512", "--turn-context", "exact"]
    report = stats(str(data), folder, max_lens=(512,), strategies=("greedy",), num_proc=1, turn_context="exact")
    (plan,) = report["what_if"]["rows"]
    result = CliRunner().invoke(main, ["pack", *args, "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "packprep.json").read_text())
    counts = manifest["counts"]
    turns, cut = counts["turns_cut"], counts["supervised_cut"]
    assert (plan["turns_cut"], plan["supervised_cut"]) == (turns, cut) and turns > 0 and cut > turns
    assert manifest["tokens"]["supervised"] + cut == report["tokens"]["supervised"] == plan["supervised_tokens"] + cut
    line = f"--max-len 512: {turns:,} assistant turns left without a trained token, {cut:,} supervised tokens cut"
    assert line in result.output and line in (tmp_path / "out" / "README.md").read_text()
    assert line in " ".join(render_text(stats_folder(tmp_path / "out")).split())
    assert packprep.verify(str(tmp_path / "out")).ok


@needs_fixtures
@pytest.mark.parametrize("overlong", slow_but({"split"}, ["truncate", "split", "drop"]))
def test_stats_predicts_what_each_overlong_policy_cuts(tmp_path, overlong):
    """Llama 3 renders the medical conversations as one sequence each: truncation cuts the turns past
    --max-len, split the first label of each piece, drop nothing (it rejects the record, counted)."""
    data, tokenizer = _medical_slice(tmp_path), fixture_tokenizer("llama3")
    report = stats(str(data), tokenizer, max_lens=(512,), strategies=("greedy",), num_proc=1, overlong=overlong)
    (plan,) = report["what_if"]["rows"]
    manifest = packprep.pack(str(data), str(tmp_path / "out"), tokenizer, num_proc=1, max_len=512, overlong=overlong)
    counts = manifest["counts"]
    assert (plan["turns_cut"], plan["supervised_cut"]) == (counts["turns_cut"], counts["supervised_cut"])
    if overlong == "drop":
        assert counts["supervised_cut"] == 0 and counts["rejected_by_reason"]["overlong"] > 0
    else:
        assert counts["supervised_cut"] > 0
        assert manifest["tokens"]["supervised"] + counts["supervised_cut"] == report["tokens"]["supervised"]
    assert counts["turns_cut"] > 0 if overlong == "truncate" else True
    assert packprep.verify(str(tmp_path / "out")).ok


# ---------------------------------------------------------------------------------------------
# rendering and the command
# ---------------------------------------------------------------------------------------------


def test_render_text_fits_80_columns(example_report, tmp_path):
    text = render_text(example_report)
    assert widest(text) <= 80
    assert "what if" in text and "log-scaled" in text
    for strategy in ("pad", "greedy", "random", "bfd"):
        assert f" {strategy} " in text
    bars = [line for line in text.splitlines() if "│" in line]
    assert len(bars) == len(example_report["histogram"]["bins"])

    packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), TOKENIZER, num_proc=1, max_len=512)
    folder_text = render_text(stats_folder(tmp_path / "out"))
    assert widest(folder_text) <= 80
    assert "row fill" in folder_text and "sequences per row" in folder_text


def test_cli_stats(tmp_path):
    runner = CliRunner()
    args = ["stats", str(EXAMPLE_CHATS), "-t", TOKENIZER, "--max-len", "128", "--max-len", "512",
            "--global-batch-size", "8", "--num-proc", "1", "-q"]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "what if (global batch 8, 1 epoch" in result.output
    assert widest(result.output) <= 80

    as_json = runner.invoke(main, args + ["--json", "--strategy", "greedy"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert [(r["max_len"], r["strategy"]) for r in report["what_if"]["rows"]] == [(128, "greedy"), (512, "greedy")]

    packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), TOKENIZER, num_proc=1, max_len=512)
    folder = runner.invoke(main, ["stats", str(tmp_path / "out"), "--json"])
    assert folder.exit_code == 0, folder.output
    assert json.loads(folder.stdout)["rows"] == json.loads((tmp_path / "out" / "packprep.json").read_text())["rows"]


def test_cli_stats_errors():
    runner = CliRunner()
    missing = runner.invoke(main, ["stats", str(EXAMPLE_CHATS)])
    assert missing.exit_code == EXIT_CONFIG and "--tokenizer" in missing.output
    bad = runner.invoke(main, ["stats", str(EXAMPLE_CHATS), "-t", TOKENIZER, "--max-len", "1", "-q"])
    assert bad.exit_code == EXIT_CONFIG and "--max-len" in bad.output


def test_cli_stats_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    result = CliRunner().invoke(main, ["stats", str(EXAMPLE_CHATS), "-t", TOKENIZER, "--max-len", "256",
                                       "--max-len", "1024", "--num-proc", "1", "-q", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_stats_plot_without_matplotlib(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = CliRunner().invoke(main, ["stats", str(EXAMPLE_CHATS), "-t", TOKENIZER, "-q",
                                       "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == EXIT_CONFIG
    assert "packprep[plot]" in result.output
    assert not Path(tmp_path / "p.png").exists()


def test_stats_counts_sequences_where_a_conversation_makes_several(tmp_path, template_folder):
    """Under --turn-context exact a Qwen3 conversation of two replies is two sequences: the lengths are
    per sequence, said so, and the histogram's shares are of the sequences (they add up to 100%)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"},
        {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "then more " * i}]}) + "\n"
        for i in range(1, 5)))
    result = CliRunner().invoke(main, ["stats", str(chats), "-t", template_folder("qwen3"), "--max-len", "512",
                                       "-q", "--num-proc", "1"])
    assert result.exit_code == 0, result.output
    assert "per sequence (8 sequences of 4 conversations; turns per conversation):" in result.output
    histogram = result.output.split("tokens per sequence (log-scaled bins):\n")[1].split("  sequences longer")[0]
    shares = [float(line.rsplit(None, 1)[1].rstrip("%")) for line in histogram.splitlines()]
    assert abs(sum(shares) - 100) < 0.5
