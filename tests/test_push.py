"""packprep push: through the real huggingface_hub client, against a loopback stand-in Hub.

The Hub cannot be reached from the test machine; ``tests/hub_server.py`` implements the endpoints the
client calls (whoami, create repo, repo info, tree, preupload, LFS batch + basic PUT, NDJSON commit)
and keeps what it receives. Network traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import packprep.hub_upload as push_module
from packprep.card import length_histograms, render_card
from packprep.cli import main
from packprep.errors import EXIT_PUSH, EXIT_VERIFY, PushError, VerifyError
from packprep.hub_upload import push

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOKEN = "hf_alice_write"

pytestmark = pytest.mark.skipif(
    not (EXAMPLES / "tokenizer" / "tokenizer.json").is_file() or not (EXAMPLES / "chats.jsonl").is_file(),
    reason="examples/tokenizer and examples/chats.jsonl are needed (python examples/make_example.py)",
)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A packed folder: the bundled example, several shards, with rejects.jsonl."""
    import packprep

    out = tmp_path_factory.mktemp("push") / "packed"
    packprep.pack(str(EXAMPLES / "chats.jsonl"), str(out), tokenizer=str(EXAMPLES / "tokenizer"),
                  max_len=512, shard_size="128KB", num_proc=1)
    assert len(list((out / "data").glob("*.parquet"))) >= 3 and (out / "rejects.jsonl").is_file()
    return out


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in Hub, with HF_ENDPOINT pointed at it and no ambient credentials."""
    from huggingface_hub import constants
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    server = HubServer(tokens={TOKEN: "alice", "hf_bob": "bob"}, orgs={"alice": ["team"]})
    server.add_repo("bob/shared", files={"README.md": b"bob's data\n"})  # public, owned by bob
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)  # read from HF_ENDPOINT at import, as a user's is
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))  # "not logged in"
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # tokenizer tests may set it; a push needs the net
        # hf_xet is installed and HF_HUB_DISABLE_XET unset: push finds that this Hub takes no Xet uploads
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
        yield server


def local_files(folder: Path) -> dict[str, bytes]:
    """What a push of ``folder`` puts on the Hub: every file, the card, manifest and rejects with the
    packer's local paths cut to their names (test_what_is_pushed_holds_no_local_path)."""
    manifest = json.loads((folder / "packprep.json").read_text())
    return {p.relative_to(folder).as_posix(): push_module.published(folder, p.name, manifest) if p.parent == folder
            else p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def shard_sha256s(folder: Path) -> set[str]:
    return {shard["sha256"] for shard in json.loads((folder / "packprep.json").read_text())["shards"]}


def cli(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


# ---------------------------------------------------------------------- what arrives


def test_push_sends_the_folder_byte_for_byte(packed, hub):
    result = push(packed, "alice/chat-packed", token=TOKEN)

    remote = hub.files("alice/chat-packed")
    remote.pop(".gitattributes")  # the Hub's own initial file
    assert remote == local_files(packed)
    assert sorted(hub.uploads) == sorted(shard_sha256s(packed))  # each shard went up once, as LFS
    assert hub.commit_count("alice/chat-packed") == 2  # the repo's initial commit + one push commit
    assert result == result.commits[-1] and result.startswith(f"{hub.url}/datasets/alice/chat-packed/commit/")
    assert hub.repos[("dataset", "alice/chat-packed")].private is False


def test_what_is_pushed_holds_no_local_path(packed, hub):
    """The folder records inputs and tokenizer as the user named them (here absolute paths); the Hub
    gets their names only."""
    manifest = json.loads((packed / "packprep.json").read_text())
    assert manifest["inputs"][0]["named"] == str(EXAMPLES / "chats.jsonl")
    assert manifest["tokenizer"]["name_or_path"] == str(EXAMPLES / "tokenizer")
    push(packed, "alice/no-paths", token=TOKEN)

    remote = hub.files("alice/no-paths")
    for name in ("README.md", "packprep.json", "rejects.jsonl"):
        text = remote[name].decode()
        for private in (str(EXAMPLES.parent), str(packed.parent), "/tmp/", "/work/", "/home/"):
            assert private not in text, f"{name} holds {private}"
    pushed = json.loads(remote["packprep.json"])
    assert pushed["inputs"][0]["path"] == pushed["inputs"][0]["named"] == "chats.jsonl"
    assert pushed["inputs"][0]["sha256"] == manifest["inputs"][0]["sha256"]
    assert pushed["tokenizer"]["name_or_path"] == "tokenizer"
    assert all(json.loads(line)["file"] == "chats.jsonl" for line in remote["rejects.jsonl"].decode().splitlines())


def test_second_push_of_an_unchanged_folder_uploads_nothing(packed, hub):
    push(packed, "alice/chat-packed", token=TOKEN)
    uploads, commits = list(hub.uploads), list(hub.commits)

    again = push(packed, "alice/chat-packed", token=TOKEN)

    assert hub.uploads == uploads and hub.commits == commits  # no shard, no empty commit
    assert again.uploaded == [] and again.commits == [] and len(again.unchanged) == len(local_files(packed))
    assert again.startswith(f"{hub.url}/datasets/alice/chat-packed/commit/")


def test_changed_card_alone_is_sent_alone(packed, hub, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(packed, folder)
    push(folder, "alice/chat-packed", token=TOKEN)
    uploads = list(hub.uploads)
    (folder / "README.md").write_text((folder / "README.md").read_text() + "\nEdited by hand.\n")

    result = push(folder, "alice/chat-packed", token=TOKEN)

    assert result.uploaded == ["README.md"] and hub.uploads == uploads
    assert hub.files("alice/chat-packed")["README.md"] == (folder / "README.md").read_bytes()


def test_large_folder_goes_in_several_commits_and_an_interrupted_push_resumes(packed, hub, monkeypatch):
    monkeypatch.setattr(push_module, "MAX_COMMIT_FILES", 2)
    shards = len(shard_sha256s(packed))
    assert shards >= 4
    hub.add_repo("alice/big")
    hub.fail_commits_after = 2  # the third commit fails, as a dropped connection would

    with pytest.raises(PushError, match="2 commit.s. were made.*run the same push again"):
        push(packed, "alice/big", token=TOKEN)
    partial = hub.files("alice/big")
    assert "packprep.json" not in partial  # the manifest only arrives with the last commit
    assert sum(path.startswith("data/") for path in partial) == 4

    hub.fail_commits_after = None
    result = push(packed, "alice/big", token=TOKEN)

    assert len(hub.uploads) == len(set(hub.uploads)) == shards  # nothing already there was sent again
    assert all(len(paths) <= 2 and all(p.startswith("data/") for p in paths) for _, _, paths in hub.commits[:-1])
    assert "packprep.json" in hub.commits[-1][2] and "README.md" in hub.commits[-1][2]
    assert len(result.commits) == -(-(shards - 4) // 2) + 1
    remote = hub.files("alice/big")
    remote.pop(".gitattributes")
    assert remote == local_files(packed)


def test_stale_shards_of_an_earlier_push_are_deleted(packed, hub):
    from huggingface_hub import CommitOperationAdd, HfApi, constants

    hub.add_repo("alice/chat-packed", files={"LICENSE": b"CC-BY-4.0\n"})
    with pytest.MonkeyPatch.context() as patch:  # the client alone, as this Hub wants it
        patch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        HfApi(endpoint=hub.url, token=TOKEN).create_commit(
            "alice/chat-packed", [CommitOperationAdd("data/train-00000-of-00099.parquet", b"old shard"),
                                  CommitOperationAdd("rejects.jsonl", b"{}\n")],
            commit_message="an older push", repo_type="dataset")

    result = push(packed, "alice/chat-packed", token=TOKEN)
    assert constants.HF_HUB_DISABLE_XET is False  # turned off for the push alone

    remote = hub.files("alice/chat-packed")
    assert "data/train-00000-of-00099.parquet" not in remote and result.deleted == ["data/train-00000-of-00099.parquet"]
    assert remote["LICENSE"] == b"CC-BY-4.0\n"  # files packprep does not own are left alone
    assert remote["rejects.jsonl"] == local_files(packed)["rejects.jsonl"]


def test_push_to_an_existing_branch_and_private_repo(packed, hub):
    hub.add_repo("team/chat", branches=("dev",))
    push(packed, "team/chat", revision="dev", token=TOKEN)
    assert "packprep.json" in hub.files("team/chat", "dev") and "packprep.json" not in hub.files("team/chat")

    push(packed, "secret", private=True, token=TOKEN)  # no namespace: the token's user
    assert hub.repos[("dataset", "alice/secret")].private is True


# ---------------------------------------------------------------------- the CLI, and each error


def test_cli_push(packed, hub):
    result = cli("push", str(packed), "alice/cli-packed", "--token", TOKEN, "-m", "first")
    assert result.exit_code == 0, result.output
    assert f"pushed {len(local_files(packed))} file(s) to dataset alice/cli-packed (main) in 1 commit(s)" in result.output
    assert f"commit: {hub.url}/datasets/alice/cli-packed/commit/" in result.output
    assert hub.repos[("dataset", "alice/cli-packed")].commits[hub.repos[("dataset", "alice/cli-packed")]
                                                               .branches["main"]].message == "first"

    again = cli("push", str(packed), "alice/cli-packed", env={"HF_TOKEN": TOKEN})  # token from HF_TOKEN
    assert again.exit_code == 0 and "up to date" in again.output


def test_no_token(packed, hub):
    result = cli("push", str(packed), "alice/x")
    assert result.exit_code == EXIT_PUSH
    assert "no Hugging Face token" in result.output and "HF_TOKEN" in result.output
    assert hub.requests == []


def test_invalid_token(packed, hub):
    result = cli("push", str(packed), "alice/x", "--token", "hf_wrong")
    assert result.exit_code == EXIT_PUSH
    assert "rejected the token (401" in result.output
    assert ("dataset", "alice/x") not in hub.repos


@pytest.mark.parametrize("repo_id", ["bob/shared", "bob/new"])
def test_repo_owned_by_someone_else(packed, hub, repo_id):
    result = cli("push", str(packed), repo_id, "--token", TOKEN)
    assert result.exit_code == EXIT_PUSH
    assert f"the token of 'alice' may not write to dataset {repo_id}, which belongs to 'bob'" in result.output
    assert ("dataset", "bob/new") not in hub.repos and hub.uploads == []
    bobs = hub.files("bob/shared")
    assert set(bobs) == {".gitattributes", "README.md"} and bobs["README.md"] == b"bob's data\n"


def test_no_network(packed, hub, monkeypatch):
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    result = cli("push", str(packed), "alice/x", "--token", TOKEN)
    assert result.exit_code == EXIT_PUSH
    assert f"cannot reach the Hub at {closed}" in result.output


def test_offline_mode_is_reported(packed, hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = cli("push", str(packed), "alice/x", "--token", TOKEN)
    assert result.exit_code == EXIT_PUSH and "HF_HUB_OFFLINE" in result.output


def test_missing_revision(packed, hub):
    hub.add_repo("alice/chat")
    result = cli("push", str(packed), "alice/chat", "--token", TOKEN, "--revision", "nope")
    assert result.exit_code == EXIT_PUSH
    assert "branch 'nope' does not exist in dataset alice/chat" in result.output
    assert hub.uploads == [] and hub.commits == []

    result = cli("push", str(packed), "alice/brand-new", "--token", TOKEN, "--revision", "nope")
    assert result.exit_code == EXIT_PUSH and "branch 'nope' does not exist" in result.output
    assert ("dataset", "alice/brand-new") not in hub.repos  # nothing created for a push that cannot land


def test_bad_repo_id_is_a_usage_error(packed, hub):
    result = cli("push", str(packed), "alice/x/y", "--token", TOKEN)
    assert result.exit_code == 2 and "is not a Hub repo id" in result.output and hub.requests == []


def test_folder_failing_verify_is_refused(packed, hub, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(packed, folder)
    shard = sorted((folder / "data").glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:-20] + b"\0" * 20)

    result = cli("push", str(folder), "alice/x", "--token", TOKEN)

    assert result.exit_code == EXIT_VERIFY
    assert "fails verification" in result.output and "[shard_file]" in result.output
    assert hub.requests == []  # refused before any network call
    with pytest.raises(VerifyError):
        push(folder, "alice/x", token=TOKEN)


# ---------------------------------------------------------------------- the dataset card


def test_card_metadata_is_what_the_hub_and_datasets_read(packed, tmp_path):
    import pyarrow.parquet as pq
    from datasets import load_dataset
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    card = DatasetCard((packed / "README.md").read_text())
    assert {"packed", "sft"} <= set(card.data.tags)
    configs = MetadataConfigs.from_dataset_card_data(card.data)
    assert configs["default"]["data_files"] == [{"split": "train", "path": "data/train-*.parquet"}]
    info = DatasetInfosDict.from_dataset_card_data(card.data)["default"]
    shard = sorted((packed / "data").glob("*.parquet"))[0]
    assert info.features.arrow_schema.remove_metadata() == pq.read_schema(shard).remove_metadata()
    manifest = json.loads((packed / "packprep.json").read_text())
    assert info.splits["train"].num_examples == manifest["rows"]

    rows = load_dataset(str(packed), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(rows) == manifest["rows"] and rows.features == info.features


def test_card_length_histogram(packed):
    import numpy as np
    import pyarrow.parquet as pq

    manifest = json.loads((packed / "packprep.json").read_text())
    table = pq.read_table(packed / "data")
    row_lengths = np.array([len(ids) for ids in table.column("input_ids").to_pylist()])
    seq_lengths = np.concatenate([np.array(s) for s in table.column("seq_lens").to_pylist()])
    hist = length_histograms(row_lengths, seq_lengths, manifest["config"]["max_len"])
    assert sum(hist["rows"]) + hist["rows_over"] == manifest["rows"]
    assert sum(hist["sequences"]) + hist["sequences_over"] == manifest["sequences"]
    assert hist["edges"][0] == 0 and hist["edges"][-1] == manifest["config"]["max_len"]

    card = render_card({**manifest, "length_histograms": hist})
    assert "## Lengths" in card and "Tokens per packed row" in card and "#" * 40 in card
    assert manifest["length_histograms"] == hist  # pack records them
    plain = render_card({k: v for k, v in manifest.items() if k != "length_histograms"})  # still renders
    assert "## Lengths" in plain and "longest row" in plain


def test_a_stack_layout_is_pushed_with_its_files_checked(packed, hub, tmp_path, monkeypatch):
    """A folder exported to a stack's own format (rows verify cannot read back) is pushed, its
    files checked against its manifest; a changed file is still refused."""
    from packprep import layout as L
    from packprep.convert import export

    padded = L.Layout("padded-test", "a test stack", L.TABLE, "recipe",
                      convert=lambda table, context: table.drop_columns(["seq_lens"]))
    monkeypatch.setitem(L.LAYOUTS, padded.name, padded)
    folder = tmp_path / "padded"
    export(packed, "padded-test", folder)
    push(folder, "alice/padded", token=TOKEN)
    assert hub.files("alice/padded")["packprep.json"] == local_files(folder)["packprep.json"]
    shard = next((folder / "data").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes() + b"x")
    with pytest.raises(VerifyError, match="sha256"):
        push(folder, "alice/padded", token=TOKEN)
