"""Mixtures (``pack --mix``) and the validation split (``--validation-size``), read back from the output."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG
from packprep.mix import plan_rounds

from .conftest import CONVERSATIONS, EXAMPLE_CHATS, EXAMPLE_TOKENIZER, needs_fixtures

TOKENIZER = str(EXAMPLE_TOKENIZER)
FILES = {"fastchat": "fastchat_dummy_conversation.json", "glaive": "llamafactory_glaive_toolcall_en_demo.json",
         "medical": "medicalgpt_sharegpt_zh_1K_format.jsonl"}


def mix_file(tmp_path: Path, sources: list[dict], name: str = "mix.yaml") -> str:
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump({"sources": sources}) if name.endswith(".yaml") else json.dumps(sources))
    return str(path)


def split_rows(folder: Path, split: str = "train") -> list[dict]:
    rows = []
    for shard in sorted((folder / "data").glob(f"{split}-*.parquet")):
        rows += pq.read_table(shard, columns=["seq_lens", "source_index"]).to_pylist()
    return rows


def source_tokens(folder: Path, manifest: dict) -> Counter:
    """Train tokens of each mixture source, counted from the shards."""
    starts = np.cumsum([0] + [i["records"] for i in manifest["inputs"]])
    group = {file: n for n, s in enumerate(manifest["mixture"]["sources"]) for file in s["inputs"]}
    tokens = Counter()
    for row in split_rows(folder):
        for length, record in zip(row["seq_lens"], row["source_index"]):
            tokens[group[int(np.searchsorted(starts, record, side="right") - 1)]] += length
    return tokens


@needs_fixtures
@pytest.mark.parametrize("asked", [
    {"fastchat": 0.5, "glaive": 0.3, "medical": 0.2},
    {"fastchat": 0.1, "glaive": 0.6, "medical": 0.3},
    {"fastchat": None, "glaive": 0.25, "medical": 0.25},  # None: weight 1, the shares fill the rest
])
def test_shares_are_realized_within_one_percent(tmp_path, asked):
    sources = [{"path": str(CONVERSATIONS / FILES[name]), "name": name,
                **({"weight": 1} if share is None else {"share": share})} for name, share in asked.items()]
    out = tmp_path / "out"
    manifest = packprep.pack([], str(out), TOKENIZER, max_len=2048, mix=mix_file(tmp_path, sources), num_proc=1)
    tokens = source_tokens(out, manifest)
    total = sum(tokens.values())
    for number, (name, share) in enumerate(asked.items()):
        row = manifest["mixture"]["sources"][number]
        assert row["train_tokens"] == tokens[number]
        assert row["realized_share"] == pytest.approx(tokens[number] / total, abs=1e-6)
        if share is not None:
            assert abs(tokens[number] / total - share) <= 0.01 * share, (name, tokens[number] / total, share)
    assert packprep.verify(out).ok


@needs_fixtures
def test_weights_repeat_and_sample_exact_record_counts(tmp_path):
    weights = [0, 0.5, 1, 2.5]
    path = str(CONVERSATIONS / FILES["fastchat"])  # 500 records, all accepted
    sources = [{"path": path, "name": f"w{w}", "weight": w} for w in weights]
    out = tmp_path / "out"
    manifest = packprep.pack([], str(out), TOKENIZER, max_len=1024, mix=mix_file(tmp_path, sources, "mix.json"),
                             num_proc=1)
    per_source = Counter()
    for row in split_rows(out):
        assert len(set(row["source_index"])) == len(row["source_index"]), "a copy shares a row with its twin"
        per_source.update(record // 500 for record in row["source_index"])
    expected = [0, 250, 500, 1250]
    assert [per_source[n] for n in range(4)] == expected
    assert [s["train_sequences"] for s in manifest["mixture"]["sources"]] == expected
    assert [s["train_records"] for s in manifest["mixture"]["sources"]] == [0, 250, 500, 500]
    assert manifest["counts"]["unsampled"] == 500 + 250
    assert manifest["counts"]["packed"] + manifest["counts"]["unsampled"] == 2000
    assert packprep.verify(out).ok


def test_weight_fraction_rounds_half_up(tmp_path):
    """7 records at weight 0.5 keep round-half-up(3.5) = 4; 1.5 gives 7 + 4: each record once, 4 twice."""
    data = tmp_path / "seven.jsonl"
    data.write_text("".join(EXAMPLE_CHATS.read_text().splitlines(keepends=True)[:7]))
    sources = [{"path": str(data), "name": f"w{w}", "weight": w} for w in (0.5, 1.5)]
    out = tmp_path / "out"
    manifest = packprep.pack([], str(out), TOKENIZER, max_len=2048, mix=mix_file(tmp_path, sources), num_proc=1)
    assert [i["records"] for i in manifest["inputs"]] == [7, 7]
    rows = manifest["mixture"]["sources"]
    assert [(s["train_records"], s["train_sequences"]) for s in rows] == [(4, 4), (7, 11)]
    copies = Counter(r for row in split_rows(out) for r in row["source_index"])
    assert sorted(copies[r] for r in range(7) if copies[r]) == [1, 1, 1, 1]
    assert sorted(copies[r] for r in range(7, 14)) == [1, 1, 1, 2, 2, 2, 2]


@needs_fixtures
def test_validation_split_is_disjoint_and_loads(tmp_path):
    datasets = pytest.importorskip("datasets")
    sources = [{"path": str(CONVERSATIONS / FILES["fastchat"]), "name": "fastchat", "weight": 2},
               {"path": str(CONVERSATIONS / FILES["glaive"]), "name": "glaive", "weight": 1}]
    out = tmp_path / "out"
    manifest = packprep.pack([], str(out), TOKENIZER, max_len=2048, mix=mix_file(tmp_path, sources),
                             validation_size=40, num_proc=1)
    train = {r for row in split_rows(out) for r in row["source_index"]}
    held = {r for row in split_rows(out, "validation") for r in row["source_index"]}
    assert len(held) == 40  # exactly N records (a glaive record whose tool calls the template does not write is
    assert not train & held  # several sequences, all of them held out)
    starts = np.cumsum([0] + [i["records"] for i in manifest["inputs"]])
    listed = {int(starts[m["input"]]) + i for m in manifest["validation"]["members"] for i in m["indices"]}
    assert listed == held
    # in proportion to the sources' accepted records (500 and 299 of 799): 25 and 15
    assert [s["validation_records"] for s in manifest["mixture"]["sources"]] == [25, 15]
    loaded = datasets.load_dataset(str(out))
    assert set(loaded) == {"train", "validation"}
    assert loaded["validation"].num_rows == manifest["validation"]["rows"]
    assert loaded["train"].num_rows == manifest["rows"]
    assert "data/validation-*.parquet" in (out / "README.md").read_text()
    assert packprep.verify(out).ok


@needs_fixtures
def test_validation_alone_and_any_num_proc_give_the_same_bytes(tmp_path):
    inputs = [str(CONVERSATIONS / FILES["glaive"]), str(CONVERSATIONS / FILES["fastchat"])]
    outs = [tmp_path / f"out{n}" for n in (1, 2)]
    for n, out in zip((1, 2), outs):
        packprep.pack(inputs, str(out), TOKENIZER, max_len=1024, validation_size=0.05, seed=3, num_proc=n)
    for path in sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file()):
        assert (outs[0] / path).read_bytes() == (outs[1] / path).read_bytes(), path


@needs_fixtures
def test_verify_finds_a_record_in_both_splits(tmp_path):
    out = tmp_path / "out"
    manifest = packprep.pack([str(CONVERSATIONS / FILES["glaive"])], str(out), TOKENIZER, max_len=1024,
                             validation_size=0.1, num_proc=1)
    member = manifest["validation"]["members"][0]
    train_record = next(r for row in split_rows(out) for r in row["source_index"])
    member["indices"][0] = train_record  # the manifest now claims a training record is held out
    (out / "packprep.json").write_text(json.dumps(manifest))
    report = packprep.verify(out)
    assert not report.ok and any(f.check == "split" for f in report.failures)


def test_each_round_is_planned_on_its_own_so_copies_never_share_a_row():
    from packprep.plan import plan_bins

    lengths = np.array([2, 9, 9], np.int32)
    rounds = [np.array([0, 1, 2]), np.array([0])]  # sequence 0 twice: greedy over all puts the copies in one row
    alone = plan_bins(lengths[np.concatenate(rounds)], 10, "greedy")
    twins = np.concatenate(rounds)[alone.items]
    assert any(len(set(twins[a:b])) < b - a for a, b in zip(alone.offsets[:-1], alone.offsets[1:]))
    bins = plan_rounds(lengths, rounds, lambda chosen: plan_bins(chosen, 10, "greedy"))
    rows = [sorted(bins.items[a:b].tolist()) for a, b in zip(bins.offsets[:-1], bins.offsets[1:])]
    assert sorted(rows) == [[0], [0], [1], [2]]


@pytest.mark.parametrize("sources, message", [
    ([{"path": "x.jsonl", "weight": 1, "share": 0.5}], "not both"),
    ([{"path": "x.jsonl", "wieght": 1}], "unknown key(s) wieght"),
    ([{"path": "x.jsonl", "weight": -1}], "weight must be between 0 and 1,000, not -1"),
    ([{"path": "x.jsonl", "share": 0.5}, {"path": "y.jsonl", "share": 0.4}], "add up to 0.9"),
    ([{"weight": 1}], "needs a 'path'"),
    ([{"path": "x.jsonl", "weight": 0}], "leaves no record to train on"),
])
def test_bad_mixture_files_are_refused_in_one_line(tmp_path, sources, message):
    for name in ("x.jsonl", "y.jsonl"):
        (tmp_path / name).write_text('{"messages": [{"role": "user", "content": "a"}, '
                                     '{"role": "assistant", "content": "b"}]}\n')
    result = CliRunner().invoke(main, ["pack", "--mix", mix_file(tmp_path, sources), "-t", TOKENIZER,
                                       "-o", str(tmp_path / "out"), "-q", "--num-proc", "1"])
    assert result.exit_code == EXIT_CONFIG, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shares, inputs, message", [
    ((0.5, 0.3), [], "the shares add up to 0.8; with no weighted source they must add up to 1"),
    ((0.6, 0.4), [str(EXAMPLE_CHATS)], "the shares add up to 1, leaving nothing for the weighted sources"),
])
def test_shares_are_checked_before_any_input_is_read(tmp_path, shares, inputs, message):
    """The sum of the shares is known from the file: refused before the tokenizer is loaded or an input read
    (the tokenizer named here does not exist, and the inputs are not JSON)."""
    for name in ("x.jsonl", "y.jsonl"):
        (tmp_path / name).write_text("not json\n")
    mix = mix_file(tmp_path, [{"path": "x.jsonl", "share": shares[0]}, {"path": "y.jsonl", "share": shares[1]}])
    with pytest.raises(packprep.errors.ConfigError, match=message):
        packprep.pack(inputs, tmp_path / "out", tokenizer=str(tmp_path / "no-tokenizer"), mix=mix)
    with pytest.raises(packprep.errors.ConfigError, match=message):
        packprep.stats(inputs, tokenizer=str(tmp_path / "no-tokenizer"), mix=mix)


@needs_fixtures
def test_stats_shows_the_mixture_pack_makes(tmp_path):
    sources = [{"path": str(CONVERSATIONS / FILES["fastchat"]), "name": "fastchat", "weight": 2.5},
               {"path": str(CONVERSATIONS / FILES["glaive"]), "name": "glaive", "share": 0.4}]
    mix = mix_file(tmp_path, sources)
    report = packprep.stats([], TOKENIZER, [512, 1024], ["greedy"], mix=mix, validation_size=0.05, num_proc=1)
    manifest = packprep.pack([], str(tmp_path / "out"), TOKENIZER, max_len=1024, mix=mix, validation_size=0.05,
                             num_proc=1)
    keys = ("train_sequences", "validation_records", "train_tokens", "realized_share")
    assert [{k: s[k] for k in keys} for s in report["mixture"]["sources"]] == \
        [{k: s[k] for k in keys} for s in manifest["mixture"]["sources"]]
    at_1024 = next(row for row in report["what_if"]["rows"] if row["max_len"] == 1024)
    assert at_1024["tokens"] == manifest["tokens"]["total"]
    # pack plans each round of copies on its own (a part-filled row a round at most); the what-if all at once
    assert 0 <= manifest["rows"] - at_1024["rows"] <= 4
    text = CliRunner().invoke(main, ["stats", "--mix", mix, "-t", TOKENIZER, "--validation-size", "0.05", "-q",
                                     "--num-proc", "1", "--max-len", "1024"]).output
    assert "mixture (training split at max_len 1,024" in text and "share 0.4" in text


def test_a_source_has_its_own_format_and_messages_field(tmp_path):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    (tmp_path / "plain.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (tmp_path / "odd.jsonl").write_text("".join(json.dumps({"dialog": chat, "n": n}) + "\n" for n in range(3)))
    sources = [{"path": "plain.jsonl", "weight": 1},  # relative to the mixture file's folder
               {"path": "odd.jsonl", "weight": 1, "format": "openai", "messages_field": "dialog"}]
    manifest = packprep.pack([], str(tmp_path / "out"), TOKENIZER, max_len=256, mix=mix_file(tmp_path, sources),
                             num_proc=1)
    assert manifest["counts"]["packed"] == 4 and manifest["counts"]["rejected"] == 0
    assert [s["train_sequences"] for s in manifest["mixture"]["sources"]] == [1, 3]


@needs_fixtures
def test_packed_dataset_reads_train_unless_asked_for_validation(tmp_path):
    pytest.importorskip("torch")
    from packprep.training import PackedDataset

    out = tmp_path / "out"
    manifest = packprep.pack([str(CONVERSATIONS / FILES["glaive"])], str(out), TOKENIZER, max_len=1024,
                             validation_size=0.1, num_proc=1)
    assert len(PackedDataset(out)) == manifest["rows"]
    assert len(PackedDataset(out, split="validation")) == manifest["validation"]["rows"]
