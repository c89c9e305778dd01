"""Faults injected for real into real runs: a node agent SIGKILLed, a rollout engine
SIGKILLed or SIGSTOPped, the coordinator SIGKILLed under Slurm. Each run must still
finish every step with nothing lost and nothing trained twice (`check_run_dir`).

Rules under test: gyre_slurm/runtime/recovery.py (docstring); sbatch/gyre.sbatch (end).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import faults
from gyre_slurm.runtime.book import StepBook
from gyre_slurm.runtime.fsio import read_jsonl
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT

# async: cells 0 and 1 roll out, 2 and 3 train, and no cell ever moves, so a fault is
# the only thing that changes the layout.
ASYNC = FAST + ["scheduler.policy=async",
                "runtime.env_params={tool_mean_s: 1.0, tool_sigma: 0.3, tool_max_s: 3.0}"]


def start_run(run_dir: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    for item in ASYNC + list(extra):
        args += ["--set", item]
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen(args, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, run_dir: Path, *, timeout_s: float = 240) -> None:
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (run_dir.parent / f"{run_dir.name}.log").read_text()
    assert proc.returncode == 0, log[-4000:]


def running_runs(run_dir: Path) -> bool:
    return faults.status(run_dir).get("runs", {}).get("running", 0) > 0


# -- the ledger's rewind (pure) ----------------------------------------------------------
def traj(run_id: str, n: int) -> dict:
    return {"run_id": run_id, "token_ids": [1] * n, "loss_mask": [1] * n}


def test_a_rewound_step_trains_the_same_microbatches_again_in_order():
    book = StepBook(num_steps=1, prompts_per_step=1, group_size=3, staleness=0)
    runs = list(book.runs)
    for i, rid in enumerate(runs):
        book.start(rid)
        book.finish(rid, status="ok", reward=float(i), trajectories=[traj(rid, 4)])
    first = book.next_microbatch(max_tokens=4)
    book.trained(first, index=1)
    second = book.next_microbatch(max_tokens=4)  # handed out, its training failed
    assert book.rewind_step(unfinished=(2, second)) == 2
    assert not book.step_complete()
    assert book.steps[0].trained == 0 and book.steps[0].trained_tokens == 0
    assert book.next_redo() == (1, first)
    book.trained(first, index=1)
    assert book.next_redo() == (2, second)
    book.trained(second, index=2)
    assert book.next_redo() is None
    third = book.next_microbatch(max_tokens=4)
    book.trained(third, index=3)
    assert book.step_complete() and book.steps[0].trained_tokens == 12


# -- 1. a node agent killed ---------------------------------------------------------------
@pytest.mark.slow
def test_killed_node_agents_fail_their_cells_and_the_job_finishes(tmp_path):
    """SIGKILL a rollout node's agent, then a training node's agent, mid-run: each cell is
    marked failed within seconds, runs continue on the other rollout cell, the world is
    rebuilt from the survivor, the step's micro-batches are trained again, and every step
    is trained with nothing lost or repeated."""
    run_dir = tmp_path / "run"
    num_steps = 6
    proc = start_run(run_dir, f"workload.num_steps={num_steps}")
    try:
        faults.wait_for(lambda: running_runs(run_dir), timeout_s=90, what="runs running")
        killed_at = time.time()
        assert faults.kill(faults.agent_pid(run_dir, 1))
        failed = faults.wait_event(run_dir, "cell_failed", cell=1, timeout_s=20)
        assert failed["t"] - killed_at < 8, failed  # agent_lost_s is 5 s
        assert failed["was"] == "rollout"
        # the training node, once the step under way has trained something
        faults.wait_event(run_dir, "microbatch", after=time.time(), timeout_s=60)
        killed_at = time.time()
        assert faults.kill(faults.agent_pid(run_dir, 3))
        failed = faults.wait_event(run_dir, "cell_failed", cell=3, timeout_s=20)
        assert failed["t"] - killed_at < 8, failed
        rebuilt = faults.wait_event(run_dir, "world_rebuilt", timeout_s=30)
        assert rebuilt["lost"] == [3] and rebuilt["members"] == [2], rebuilt
    finally:
        finish(proc, run_dir)
    events = check_run_dir(run_dir, num_steps=num_steps)
    status = faults.status(run_dir)
    assert [c["role"] for c in status["cells"]] == ["rollout", "failed", "train", "failed"]
    after = [e for e in events if e["kind"] == "microbatch" and e["t"] > rebuilt["t"]]
    assert after and all(e["members"] == [2] for e in after)
    # the step under way restarted from its checkpoint and trained its micro-batches again
    assert rebuilt["restored_from"] is None or "checkpoints/step_" in rebuilt["restored_from"]
    lost = [e for e in events if e["kind"] == "agent_lost"]
    assert sorted(e["node"] for e in lost) == [1, 3]
    # runs interrupted by the loss (if a call was in flight) restarted as new attempts
    for e in (e for e in events if e["kind"] == "run_restarted"):
        assert e["new_run_id"].startswith(e["run_id"].split("-a")[0] + "-a")


# -- 2. a rollout engine crashed or hung ---------------------------------------------------
@pytest.mark.slow
def test_crashed_and_hung_engines_are_restarted_on_their_cells(tmp_path):
    """SIGKILL node 0's engine, then SIGSTOP node 1's: the coordinator's health check
    finds each, the node agent kills what is left and starts a new engine on the same
    cell after a backoff, and the job finishes with every cell still serving."""
    run_dir = tmp_path / "run"
    num_steps = 10  # the job outlasts both restarts (~6 s to notice a hang, ~5 s to restart)
    proc = start_run(run_dir, f"workload.num_steps={num_steps}")
    try:
        faults.wait_for(lambda: running_runs(run_dir), timeout_s=90, what="runs running")
        crashed = faults.engine_pid(run_dir, 0)
        assert faults.kill(crashed)
        restarted = faults.wait_event(run_dir, "engine_restarted", cell=0, timeout_s=30)
        assert restarted["exit_code"] == -signal.SIGKILL
        assert faults.engine_pid(run_dir, 0) != crashed
        hung = faults.engine_pid(run_dir, 1)
        assert faults.kill(hung, signal.SIGSTOP)
        stopped_at = time.time()
        restarted = faults.wait_event(run_dir, "engine_restarted", cell=1, timeout_s=30)
        assert restarted["t"] - stopped_at < 25, restarted
        assert not faults.alive(hung)
    finally:
        finish(proc, run_dir)
    events = check_run_dir(run_dir, num_steps=num_steps)
    unhealthy = [e for e in events if e["kind"] == "engine_unhealthy"]
    assert {e["cell"] for e in unhealthy} == {0, 1}
    status = faults.status(run_dir)
    assert [c["role"] for c in status["cells"]] == ["rollout", "rollout", "train", "train"]
    assert not [e for e in events if e["kind"] == "cell_failed"]


# -- 3. the coordinator killed under Slurm -------------------------------------------------
@pytest.mark.slow
def test_a_killed_coordinator_is_requeued_by_the_batch_script(slurm_cluster, tmp_path):
    from test_slurm_e2e import sbatch, small_config, wait_done, wait_version

    run_dir = tmp_path / "run"
    job = sbatch(slurm_cluster, f"--output={tmp_path}/job-%j.out",
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(small_config(tmp_path)),
                 str(run_dir))
    wait_version(run_dir, 2)
    time.sleep(0.7)  # into the next step
    pid = faults.coordinator_pid(run_dir)
    before = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    segments = {p.name: p.stat().st_size for p in (run_dir / "calls").glob("*.seg")}
    assert faults.kill(pid)
    state, restarts = wait_done(slurm_cluster, job)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert state == "COMPLETED" and restarts >= 1, (state, restarts, log[-3000:])
    assert "died by signal 9" in log
    events = check_run_dir(run_dir, num_steps=4)
    requeue = [e for e in events if e["kind"] == "requeue"]
    assert requeue and requeue[0]["cause"] == "coordinator died by signal 9"
    resume = next(e for e in events if e["kind"] == "resume")
    assert resume["version"] >= 2
    after = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    assert before <= after  # no finished run lost
    # every call recorded before the kill is still there (segments are append-only)
    assert segments and all((run_dir / "calls" / name).stat().st_size >= size
                            for name, size in segments.items())
