"""``packprep repack``: the stored sequences packed again equal ``pack`` from the inputs, byte for byte;
what was cut at the old length is refused, or taken as stored only when asked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import packprep
from packprep.cli import main
from packprep.errors import EXIT_CONFIG, ConfigError
from packprep.packing import STRATEGIES
from packprep.pipeline import repack

from .conftest import CONVERSATIONS, EXAMPLE_TOKENIZER, needs_fixtures


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """The example tokenizer with a template that writes tool calls. The example's own writes content only,
    so each glaive tool call would be text in its trained turn alone and its record several sequences,
    which repack refuses (their order within the record is not stored); here each record is one."""
    folder = tmp_path_factory.mktemp("repack") / "tokenizer"
    shutil.copytree(EXAMPLE_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
        "{% for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function.name + ' ' + (call.function.arguments"
        " if call.function.arguments is string else call.function.arguments | tojson) + '</tool_call>' }}{% endfor %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


INPUTS = [str(CONVERSATIONS / "llamafactory_glaive_toolcall_en_demo.json"),
          str(CONVERSATIONS / "fastchat_dummy_conversation.json")]
BASE_LEN = 16384  # longer than every fixture conversation here: nothing is cut at it


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def without_record(files: dict[str, bytes]) -> list[dict]:
    entries = [json.loads(line) for line in files["rejects.jsonl"].decode().splitlines()]
    return [{k: v for k, v in entry.items() if k not in ("record", "line")} for entry in entries]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("repack") / "base"
    manifest = packprep.pack(INPUTS, str(out), tokenizer, max_len=BASE_LEN, num_proc=1)
    assert manifest["counts"]["truncated"] == 0
    return out


@needs_fixtures
@pytest.mark.parametrize("max_len", [BASE_LEN, 1024])  # 1024 truncates some sequences: as pack does at 1024
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_repack_equals_pack_byte_for_byte(tokenizer, base, tmp_path, strategy, max_len):
    settings = dict(max_len=max_len, strategy=strategy, seed=7, row_order="input" if strategy == "bfd" else "shuffle",
                    samples_per_row=4 if strategy == "minibatch" else None)
    packed, repacked = tmp_path / "packed", tmp_path / "repacked"
    manifest = packprep.pack(INPUTS, str(packed), tokenizer, num_proc=1, **settings)
    if max_len == 1024:
        assert manifest["counts"]["truncated"] > 0  # the case where repack cuts what it reads
    repack(base, repacked, num_proc=1, **settings)
    ours, theirs = files(repacked), files(packed)
    if max_len == 1024:  # a record dropped here is listed without the copy of it pack shows (repack has none)
        ours["rejects.jsonl"], theirs["rejects.jsonl"] = without_record(ours), without_record(theirs)
    assert ours == theirs


@needs_fixtures
@pytest.mark.parametrize("overlong, shard_format", [("truncate", "parquet"), ("drop", "arrow")])
def test_repack_on_several_workers_equals_pack(tokenizer, tmp_path, overlong, shard_format):
    """Both passes over the stored shards run on the workers, a run of row groups (record batches) a
    task, each task writing its records' tokens into its own byte ranges of the token files: with many
    shards (many tasks), two workers, and records cut or dropped at the new length, still pack's bytes."""
    common = dict(overlong=overlong, shard_format=shard_format, shard_size="40KB", num_proc=2)
    old = packprep.pack(INPUTS, str(tmp_path / "old"), tokenizer, max_len=BASE_LEN, **common)
    assert len(old["shards"]) >= 8
    packed = packprep.pack(INPUTS, str(tmp_path / "packed"), tokenizer, max_len=1024, strategy="bfd", **common)
    assert packed["counts"]["truncated" if overlong == "truncate" else "rejected"] > 0
    repack(tmp_path / "old", tmp_path / "repacked", max_len=1024, strategy="bfd", num_proc=2)
    ours, theirs = files(tmp_path / "repacked"), files(tmp_path / "packed")
    ours["rejects.jsonl"], theirs["rejects.jsonl"] = without_record(ours), without_record(theirs)
    if overlong == "drop":  # the normalizing changes of the records dropped here are not stored: repack counts them
        for folder in (ours, theirs):
            manifest = json.loads(folder.pop("packprep.json"))
            del manifest["counts"]["normalized"]
            folder["packprep.json"] = manifest
            del folder["README.md"]  # the card shows them too
    assert ours == theirs


@needs_fixtures
def test_repack_into_and_from_another_layout_equals_pack(tokenizer, base, tmp_path):
    packprep.pack(INPUTS, str(tmp_path / "packed"), tokenizer, max_len=2048, layout="trl", num_proc=1)
    repack(base, tmp_path / "repacked", max_len=2048, layout="trl", num_proc=1)
    assert files(tmp_path / "repacked") == files(tmp_path / "packed")
    repack(tmp_path / "repacked", tmp_path / "again", num_proc=1)  # every setting, the layout too, is the folder's
    assert files(tmp_path / "again") == files(tmp_path / "packed")
    packprep.pack(INPUTS, str(tmp_path / "packed-bfd"), tokenizer, max_len=2048, strategy="bfd", num_proc=1)
    repack(tmp_path / "packed", tmp_path / "from-trl", strategy="bfd", layout="packprep", num_proc=1)  # trl read back
    assert files(tmp_path / "from-trl") == files(tmp_path / "packed-bfd")


@needs_fixtures
def test_repack_of_a_mixture_that_leaves_records_out_equals_pack(tokenizer, tmp_path):
    """Records a weight below 1 leaves out are in no shard: repack counts them unsampled, as pack did."""
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([{"path": INPUTS[0], "weight": 0.5}, {"path": INPUTS[1], "share": 0.3}]))
    packprep.pack([], str(tmp_path / "old"), tokenizer, max_len=BASE_LEN, num_proc=1, mix=str(mix))
    assert json.loads((tmp_path / "old" / "packprep.json").read_text())["counts"]["unsampled"] > 0
    packprep.pack([], str(tmp_path / "packed"), tokenizer, max_len=BASE_LEN, strategy="bfd", num_proc=1, mix=str(mix))
    repack(tmp_path / "old", tmp_path / "repacked", strategy="bfd", num_proc=1)
    assert files(tmp_path / "repacked") == files(tmp_path / "packed")


def test_repack_of_a_mixture_and_validation_split_equals_pack(tokenizer, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([{"path": INPUTS[0], "weight": 1.5}, {"path": INPUTS[1], "share": 0.4}]))
    common = dict(mix=str(mix), validation_size=0.1, seed=5)
    packprep.pack([], str(tmp_path / "old"), tokenizer, max_len=BASE_LEN, num_proc=1, **common)
    packprep.pack([], str(tmp_path / "packed"), tokenizer, max_len=8192, strategy="bfd", num_proc=1, **common)
    repack(tmp_path / "old", tmp_path / "repacked", max_len=8192, strategy="bfd", num_proc=1)
    assert files(tmp_path / "repacked") == files(tmp_path / "packed")
    with pytest.raises(ConfigError, match="drawn with seed 5"):
        repack(tmp_path / "old", tmp_path / "other-seed", seed=6)
    with pytest.raises(ConfigError, match="would be cut at max_len 1024.*accept_truncated=True"):  # shares drawn
        repack(tmp_path / "old", tmp_path / "shorter", max_len=1024)                      # from other lengths
    with pytest.raises(ConfigError, match="megatron.? writes files of its own, with no validation split"):
        repack(tmp_path / "old", tmp_path / "megatron", layout="megatron")  # before any pass over the shards
    assert not (tmp_path / "megatron").exists()


@needs_fixtures
def test_a_mixture_repacked_shorter_keeps_its_records_copies_and_split_when_asked(tokenizer, tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([{"path": INPUTS[0], "weight": 2}, {"path": INPUTS[1], "share": 0.3}]))
    old = packprep.pack([], str(tmp_path / "old"), tokenizer, max_len=BASE_LEN, num_proc=1, mix=str(mix),
                        validation_size=0.1)
    result = CliRunner().invoke(main, ["repack", str(tmp_path / "old"), "-o", str(tmp_path / "short"), "--max-len",
                                       "256", "--accept-truncated", "-q", "--num-proc", "1"])
    assert result.exit_code == 0, result.output
    assert "validation split kept as" in result.output and "not what pack would write" in result.output
    short = json.loads((tmp_path / "short" / "packprep.json").read_text())
    assert short["repacked_from"]["selection_as_stored"] is True and short["counts"]["truncated"] > 0
    held = lambda manifest: {(m["input"], i) for m in manifest["validation"]["members"] for i in m["indices"]}  # noqa: E731
    rejects = [json.loads(line) for line in (tmp_path / "short" / "rejects.jsonl").read_text().splitlines()]
    dropped = {r["source_index"] for r in rejects if r["code"] == "overlong"}
    starts = [0, old["inputs"][0]["records"]]
    lost = held(old) - held(short)  # held out before, and now dropped: nothing left to train on at 256
    assert held(short) <= held(old) and {starts[i] + j for i, j in lost} <= dropped
    kept = short["counts"]["records"] - short["counts"]["rejected"] - short["counts"]["unsampled"]
    assert kept <= old["counts"]["records"] - old["counts"]["rejected"] - old["counts"]["unsampled"]
    assert packprep.verify(tmp_path / "short").ok


@needs_fixtures
def test_repack_refuses_truncated_sequences_at_a_longer_length(tokenizer, tmp_path):
    short = tmp_path / "short"
    manifest = packprep.pack(INPUTS, str(short), tokenizer, max_len=512, num_proc=1)
    truncated = manifest["counts"]["truncated"]
    assert truncated > 0
    result = CliRunner().invoke(main, ["repack", str(short), "-o", str(tmp_path / "long"), "--max-len", "2048", "-q"])
    assert result.exit_code == EXIT_CONFIG, result.output
    assert f"{truncated:,} sequences were truncated" in result.output and "--accept-truncated" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "long").exists()

    result = CliRunner().invoke(main, ["repack", str(short), "-o", str(tmp_path / "long"), "--max-len", "2048",
                                       "--accept-truncated", "-q"])
    assert result.exit_code == 0, result.output
    assert "not what pack would write" in result.output
    repacked = json.loads((tmp_path / "long" / "packprep.json").read_text())
    assert repacked["repacked_from"]["truncated_as_stored"] == truncated
    assert repacked["counts"]["truncated"] == truncated  # still counted as truncated, not as whole
    assert packprep.verify(tmp_path / "long").ok


@needs_fixtures
def test_repack_refuses_split_sequences(tokenizer, tmp_path):
    split = tmp_path / "split"
    manifest = packprep.pack(INPUTS, str(split), tokenizer, max_len=512, overlong="split", num_proc=1)
    assert manifest["counts"]["split"] > 0
    with pytest.raises(ConfigError, match="split into pieces"):
        repack(split, tmp_path / "out", max_len=1024)
    assert not (tmp_path / "out").exists()


def test_repack_refuses_what_it_cannot_change(tokenizer, tmp_path):
    out = tmp_path / "out"
    packprep.pack(str(EXAMPLE_TOKENIZER.parent / "chats.jsonl"), str(out), tokenizer, max_len=1024, num_proc=1)
    with pytest.raises(ConfigError, match="cannot change train_on"):
        repack(out, tmp_path / "again", train_on="all")
