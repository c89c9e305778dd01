"""tools/bench_modes.py end to end on short runs (the local launcher): every mode runs,
is measured from its run dir, checked for identical training semantics, simulated on the
replayed workload, and drawn. The figures themselves are the benchmark's, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

QUICK = ["workload.prompts_per_step=2", "workload.group_size=4",
         "workload.duration.mean_s=1.0", "workload.duration.max_s=3.0",
         "agent.env_params.tool_mean_s=1.0", "agent.env_params.tool_max_s=3.0",
         "rollout.runs_per_node=2",
         "trainer.pace=true", "training.node_tokens_per_s=2000", "scheduler.interval_s=0.2"]


def test_bench_modes_runs_measures_checks_and_simulates(tmp_path):
    args = [sys.executable, str(ROOT / "tools" / "bench_modes.py"), "--launcher", "local",
            "--steps", "2", "--modes", "elastic,colocate", "--async-splits", "1",
            "--out", str(tmp_path)]
    for item in QUICK:
        args += ["--set", item]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["modes"] == ["elastic", "colocate", "async-1"]
    assert out["semantics_problems"] == []
    for label in out["modes"]:
        m, p = out["measured"][label], out["predicted"][label]
        assert m["steps"] == 2 and m["trajectories_per_step"] == [8, 8]
        assert 0 < m["busy_fraction"] <= 1 and m["span_s"] > 0
        assert m["max_lag"] <= (0 if label == "colocate" else 1)
        assert p["makespan_s"] > 0 and 0 < p["busy_fraction"] <= 1
    # colocate moves every cell twice a step (the last step's return is not needed)
    assert out["measured"]["colocate"]["cells_moved"] >= 4 * 3
    assert out["measured"]["async-1"]["handoffs"] == 0
    assert (tmp_path / "bench-modes.png").stat().st_size > 10_000
    assert "| elastic |" in proc.stdout


def test_bench_modes_refuses_a_mode_it_does_not_know(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_modes.py"), "--launcher",
                           "local", "--modes", "elastic,fastest", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "unknown mode 'fastest'" in proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--modes", "elastic", "--async-splits", "99"],
     "scheduler.async_rollout_cells must be between 1 and 3"),
    (["--config", "/nonexistent/bench.yaml"], "cannot read config file /nonexistent/bench.yaml"),
    (["--set", "workload.num_steps=-1"], "workload.num_steps must be > 0"),
])
def test_bench_modes_checks_every_mode_before_the_first_runs(tmp_path, extra, message):
    """A mode whose config is wrong (a split past the cells) is refused before any mode
    runs, not after the others' half hour; a clear error, no traceback, nothing run."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_modes.py"), "--launcher",
                           "local", "--out", str(tmp_path / "out"), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_bench_modes_stopped_by_sigterm_stops_its_run(tmp_path):
    """SIGTERM to the tool (a timeout, its own job cancelled) stops the run under way,
    here a local `gyre run` (on Slurm: scancel of the job), and exits 130 with a line
    that says so; nothing of the run is left running."""
    import signal
    import time

    args = [sys.executable, str(ROOT / "tools" / "bench_modes.py"), "--launcher", "local",
            "--steps", "50", "--modes", "elastic", "--out", str(tmp_path)]
    for item in QUICK:
        args += ["--set", item]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    events = tmp_path / "elastic" / "run" / "events.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and '"kind": "step"' not in (
            events.read_text() if events.exists() else ""):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    assert events.exists(), "the run never trained a step"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted; the job under way was cancelled" in err
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
