"""`gyre run` with an external scaffold: mini-swe-agent (unmodified, its own role
environment) drives every run of the shell tasks, in its sandbox, locally and as one
Slurm job on the local cluster (`configs/tiny-mini-swe-agent.yaml`). Every run ends ok
with its reward from the task's tests, every ok run's calls are trained exactly once,
and nothing of the job's secret reaches a scaffold's files."""

import os
import subprocess
import sys

import pytest

from gyre_slurm.common.fsio import read_jsonl
from runtime_checks import check_runs_trained_once, check_steps_in_order
from test_runtime_e2e import ROOT
from test_slurm_e2e import sbatch, wait_done

pytestmark = pytest.mark.slow
CONFIG = ROOT / "configs" / "tiny-mini-swe-agent.yaml"
STEPS = 2


def check_scaffold_runs(run_dir, *, homes_kept: bool):
    # (not check_run_dir's metrics: a tiny model scores every run of a group alike, so
    # advantages, and the gradient, are zero; what matters here is that each run is
    # trained once)
    check_runs_trained_once(run_dir)
    events = list(read_jsonl(run_dir / "events.jsonl"))
    check_steps_in_order(events, num_steps=STEPS)
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    assert len(records) == STEPS * 2 * 2
    for r in records:  # mini-swe-agent ran, made its calls, and the tests paid
        assert r["scaffold"]["status"] == "ok" and r["scaffold"]["exit_code"] == 0, r
        assert 1 <= r["num_calls"] <= 3 and 0.0 <= r["reward"] <= 1.0, r
        assert set(r["tests"]) and all(isinstance(v, bool) for v in r["tests"].values())
        log = (run_dir / "logs" / f"scaffold-{r['run_id']}.log")
        assert log.exists()
    homes = sorted(p.name for p in (run_dir / "scaffolds").iterdir())
    if not homes_kept:  # agent.scaffold.keep_homes: failed (the default): every run was ok
        assert homes == [], homes
        return events
    assert homes == sorted(r["run_id"] for r in records)
    secret = (run_dir / "secret").read_bytes().strip()
    for path in (run_dir / "scaffolds").rglob("*"):  # its homes: config, trajectory, task
        assert not path.is_file() or secret not in path.read_bytes(), path
    assert len(list((run_dir / "scaffolds").rglob("mini.traj.json"))) == len(records)
    return events


def test_gyre_run_with_mini_swe_agent_locally(tmp_path, minisweagent_python):
    run_dir = tmp_path / "run"
    proc = gyre_run_config(run_dir, "agent.scaffold.keep_homes=all")
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_scaffold_runs(run_dir, homes_kept=True)


def gyre_run_config(run_dir, *sets):
    args = [sys.executable, "-m", "gyre_slurm", "run", str(CONFIG), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=900)


def test_gyre_run_with_mini_swe_agent_under_slurm(slurm_cluster, tmp_path, minisweagent_python):
    run_dir = tmp_path / "run"
    job = sbatch(slurm_cluster, f"--output={tmp_path}/job-%j.out",
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(CONFIG), str(run_dir))
    state, _ = wait_done(slurm_cluster, job, timeout_s=900)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    events = check_scaffold_runs(run_dir, homes_kept=False)  # the default: ok runs' go
    assert sorted(e["node"] for e in events if e["kind"] == "agent_registered") == [0, 1, 2, 3]
