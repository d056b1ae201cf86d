"""``--engine ray``: same bytes as the local engine with one partition; verified output with several.

Starts one local Ray instance (2 CPUs) for the module; skipped when Ray is not installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import packprep
from packprep.errors import ConfigError
from packprep.verification import verify

from .conftest import EXAMPLE_CHATS, EXAMPLE_TOKENIZER

TOKENIZER = str(EXAMPLE_TOKENIZER)
SETTINGS = {"max_len": 512, "seed": 3}


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local_output(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("local") / "packed"
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(out), TOKENIZER, num_proc=1, **SETTINGS)
    return out, manifest


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_one_partition_equals_local_byte_for_byte(ray_instance, local_output, tmp_path):
    local, local_manifest = local_output
    out = tmp_path / "packed"
    manifest = packprep.pack(str(EXAMPLE_CHATS), str(out), TOKENIZER, num_proc=2, engine="ray", **SETTINGS)
    assert verify(out).ok
    assert manifest == local_manifest
    assert manifest["partitions"] == 1
    # rejections made on the actors (e.g. no assistant turn) come back with their codes
    assert manifest["counts"]["rejected_by_reason"].get("no_assistant_turn")
    # every file: shards, packprep.json, README.md, rejects.jsonl
    assert _files(out) == _files(local)


def test_one_explicit_partition_larger_than_the_data(ray_instance, local_output, tmp_path):
    local, local_manifest = local_output
    out = tmp_path / "packed"
    manifest = packprep.pack(
        str(EXAMPLE_CHATS), str(out), TOKENIZER, num_proc=2, engine="ray", partition_size=1_000_000, **SETTINGS
    )
    assert verify(out).ok
    assert manifest["partitions"] == 1
    # the manifest records the setting (config.partition_size); everything else is identical
    assert manifest["config"].pop("partition_size") == 1_000_000
    expected = json.loads(json.dumps(local_manifest))
    assert expected["config"].pop("partition_size") is None
    assert {k: v for k, v in manifest.items() if k != "config"} == {
        k: v for k, v in expected.items() if k != "config"
    }
    assert manifest["config"] == expected["config"]
    files, local_files = _files(out), _files(local)
    assert files.pop("packprep.json") != local_files.pop("packprep.json")
    files.pop("README.md"), local_files.pop("README.md")  # the card renders the config
    assert files == local_files  # shards and rejects.jsonl


def test_several_partitions_verify_and_cost_rows(ray_instance, local_output, tmp_path):
    _, local_manifest = local_output
    out = tmp_path / "packed"
    manifest = packprep.pack(
        str(EXAMPLE_CHATS), str(out), TOKENIZER, num_proc=2, engine="ray", partition_size=64, **SETTINGS
    )
    report = verify(out)
    assert report.ok, report.failures[:3]
    assert manifest["partitions"] == -(-manifest["sequences"] // 64) > 1
    assert manifest["rows"] >= local_manifest["rows"]
    assert manifest["efficiency"] <= local_manifest["efficiency"]
    assert manifest["counts"] == local_manifest["counts"]
    assert manifest["tokens"] == local_manifest["tokens"]


def test_missing_ray_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    monkeypatch.setitem(sys.modules, "ray.data", None)
    with pytest.raises(ConfigError, match=r"pip install 'packprep\[ray\]'"):
        packprep.pack(str(EXAMPLE_CHATS), str(tmp_path / "out"), TOKENIZER, num_proc=1, engine="ray", **SETTINGS)
    assert not (tmp_path / "out").exists()
