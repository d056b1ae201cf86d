"""``benchmarks/gpu_balance.py`` end to end on CPU: two gloo ranks, a tiny Llama, the fixture
conversations when they are beside the repo, so that the four-GPU run works the first time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import FIXTURES, REPO


def test_gpu_balance_runs_on_two_cpu_ranks(tmp_path):
    pytest.importorskip("transformers")
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not beside this python")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "BENCH_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(REPO / "benchmarks" / "gpu_balance.py"),
               "--tiny", "--max-len", "256", "--steps", "6", "--calibration-repeats", "1",
               "--fixtures-npz", str(tmp_path / "fixtures.npz"), "--fixtures-dir", str(FIXTURES)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_balance.json").read_text())
    assert report["world_size"] == 2 and report["max_len"] == 256 and report["attention"] in ("sdpa", "eager")
    assert report["same_sequences"] and report["loss_check"]["equal"]
    for run in (report["greedy_shuffled"], report["balanced"]):
        assert run["timed_steps"] >= 1 and run["tokens_per_s"] > 0
    assert report["predicted"]["balanced"] >= report["predicted"]["greedy_shuffled"]
    assert report["cost_model"]["per_token"] > 0
    assert "Balanced / greedy tokens/s" in (tmp_path / "out" / "gpu_balance.md").read_text()
