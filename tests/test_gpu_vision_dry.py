"""``benchmarks/gpu_vision.py`` end to end on CPU in its tiny shape, so that the GPU run works the first time:
the three modes train on the same conversations to equal losses, and one packed row's logits equal its
conversations' alone (the same row with its text position row dropped does not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO, needs_vision_transformers

needs_vision_transformers()


def test_gpu_vision_runs_on_cpu(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_vision.json"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_vision.py"), "--shape", "tiny", "--sequences", "6",
               "--max-len", "1024", "--max-seq", "400", "--max-pixels", "20000", "--batch", "2", "--warmup", "1",
               "--no-checkpointing", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["packed_attention"] in ("sdpa", "packprep_varlen", "flash_attention_2")
    assert report["exactness"]["max_abs_diff"] < 1e-3 < report["exactness"]["max_abs_diff_without_text_row"]
    losses = [report[mode]["mean_loss"] for mode in ("packed", "grouped", "padded")]
    assert max(losses) - min(losses) < 1e-2 * max(losses)
    assert len({report[mode]["supervised_tokens"] for mode in ("packed", "grouped", "padded")}) == 1
