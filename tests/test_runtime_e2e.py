"""The whole runtime on this machine: `gyre run` with 4 virtual nodes, real node agents,
real engine processes, the real gateway and agent loop, real gloo process groups.

Checks come from the run dir's records (runs/started.jsonl, runs/runs.jsonl, the call
store, stream/ micro-batches, events.jsonl), not from the coordinator's counters.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.types import Observation
from runtime_checks import check_run_dir, trained_trajectories

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

FAST = [
    "workload.num_steps=3", "workload.prompts_per_step=2", "workload.group_size=4",
    "rollout.runs_per_node=4", "agent.max_tokens=8",
    "agent.env_params={tool_mean_s: 0.4, tool_sigma: 1.0, tool_max_s: 3.0}",
    "scheduler.confirm_s=0.3", "scheduler.min_dwell_s=0.5", "workload.duration.mean_s=0.4",
]
# The plain waterlevel rule (no forecast, no hysteresis) on a fast tick: cells move both
# ways within a short run. With the migrate drain: the rule cancels a wait drain as soon
# as a queue forms (the runtime carries cancel_drain out), and a wait drain may outlast
# the job.
WATERLEVEL = ["scheduler.forecast=false", "scheduler.hysteresis=0", "scheduler.interval_s=0.2",
              "scheduler.drain=migrate"]
# Training paced to about 1.5 s a step on one cell: with WATERLEVEL, every step then has a
# time when no run may start (staleness 1: step k + 2 waits for step k's training), so the
# rollout cells empty and one is released, and the next batch queues and reclaims one.
# Unpaced, the tiny model trained a step in milliseconds and whether a queue ever formed
# after a release depended on timing: on a loaded machine a run moved one cell once, one way.
PACED = ["trainer.pace=true", "training.node_tokens_per_s=200"]


def gyre_run(run_dir: Path, *extra: str, resume: bool = False, timeout_s: float = 300,
             config: str = "tiny.yaml"):
    args = [sys.executable, "-m", "gyre_slurm", "run"]
    args += ["--run-dir", str(run_dir), "--resume"] if resume else \
        [str(ROOT / "configs" / config), "--run-dir", str(run_dir)]
    for item in extra:
        args += ["--set", item]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GYRE_PROG", None)  # as `gyre` names itself (tools/gyre sets it)
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def mode_run(tmp_path_factory):
    """A finished 3-step run of each policy, made once (checked by several tests)."""
    runs: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def get(policy: str) -> tuple[Path, subprocess.CompletedProcess]:
        if policy not in runs:
            run_dir = tmp_path_factory.mktemp("modes") / policy
            # async trains with truncated IS capped at 1: the loss setting must reach
            # the ranks (checked by check_tis_capped_at_one)
            loss = ["loss.kind=tis", "loss.is_cap=1.0"] if policy == "async" else []
            # tree packing is the default; colocate keeps rows packing in use end to end
            packing = ["training.packing=rows"] if policy == "colocate" else []
            runs[policy] = run_dir, gyre_run(run_dir, *FAST, f"scheduler.policy={policy}",
                                             *loss, *packing)
        return runs[policy]

    return get


@pytest.mark.parametrize("policy", ["elastic", "colocate", "async"])
def test_each_mode_completes_with_nothing_lost_or_repeated(mode_run, policy):
    run_dir, proc = mode_run(policy)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    handoffs = [e for e in events if e["kind"] == "handoff"]
    if policy == "async":
        assert handoffs == []
        check_tis_capped_at_one(events)
    if policy == "colocate":
        directions = {e["direction"] for e in handoffs}
        assert directions == {"rollout->train", "train->rollout"}
        assert all(len(e["cells"]) == 4 for e in handoffs)  # every cell switches together
    for e in handoffs:  # every phase is timed
        assert e["total_s"] >= 0 and "rebuild_s" in e and "drain_s" in e
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    status = json.loads((run_dir / "status.json").read_text())
    assert status["runs"]["trained"] == len(records) and status["runs"]["ok"] == 0
    check_summary(proc.stdout, run_dir, events, records)
    # trainer.warm_up auto: the local launcher's ranks do not warm up as they start (the
    # virtual nodes share the host's cores with the engines the layout waits for)
    assert not [p for p in (run_dir / "logs").glob("trainer-*.log")
                if "warmed up in" in p.read_text()]
    if policy == "colocate":  # every cell trains step 0, sampled by the policy it trains
        step0 = next(read_jsonl(run_dir / "metrics.jsonl"))
        assert step0["step"] == 0 and step0["train/ratio_mean"] == pytest.approx(1.0, abs=0.01)


def check_tis_capped_at_one(events: list[dict]) -> None:
    """Every micro-batch trained with tis, C = 1: nothing clipped, every weight
    min(ratio, 1); once stale tokens (ratio != 1) trained, the weights fall short of
    the ratios (ppo_clip's weight is the ratio itself)."""
    stats = [e["stats"] for e in events if e["kind"] == "microbatch"]
    assert stats and all(s["clipped"] == 0 and s["dropped"] == 0 for s in stats)
    assert all(s["weight_sum"] <= s["tokens"] + 1e-6 for s in stats)
    stale = sum(s["tokens"] - s["by_lag"].get("0", {}).get("tokens", 0) for s in stats)
    if stale:
        assert sum(s["weight_sum"] for s in stats) < sum(s["ratio_sum"] for s in stats)
        assert sum(s["truncated"] for s in stats) > 0


def check_summary(stdout: str, run_dir: Path, events: list[dict], records: list[dict]):
    """What `gyre run` printed: where to watch it at the start, then its summary, each
    figure as the run dir's records have it."""
    lines = stdout.splitlines()
    assert lines[0] == f"gyre run: starting; run dir {run_dir}", stdout
    assert lines[1].split() == ["watch", "gyre", "status", str(run_dir)]
    assert f"{run_dir / 'events.jsonl'}" in lines[2]
    end = lines.index(next(ln for ln in lines if ln.startswith("gyre run: finished after ")))
    steps = [e for e in events if e["kind"] == "step"]
    rewards = [e["mean_reward"] for e in steps]
    k = min(5, len(rewards))
    directions = Counter(e["direction"] for e in events if e["kind"] == "handoff")
    handoffs = f"{sum(directions.values())}" + (" (" + ", ".join(
        f"{n} {d}" for d, n in sorted(directions.items())) + ")" if directions else "")
    wall = next(e["wall_s"] for e in events if e["kind"] == "finish")
    assert lines[end:] == [
        f"gyre run: finished after {wall:.0f} s",
        f"  steps    {len(steps)}/{len(steps)}",
        f"  runs     {len(records)} ok, 0 failed",
        f"  handoffs {handoffs}",
        f"  reward   {sum(rewards[:k]) / k:.3f} (first {k} steps) -> "
        f"{sum(rewards[-k:]) / k:.3f} (last {k})",
        f"  run dir  {run_dir}",
        f"  report   gyre report {run_dir} -o {run_dir / 'report.png'}"], stdout


def test_elastic_moves_cells_both_ways(tmp_path):
    # Runs of ~1 s against a ~1 s handoff: the forecast would rightly see most queues
    # drain before a reclaimed cell could serve, so it is off here, with no hysteresis
    # and a fast policy tick, so that both directions happen in a short run (WATERLEVEL);
    # training is PACED, so the next batch (8 runs) queues on the one cell left (4 slots).
    run_dir = tmp_path / "elastic"
    proc = gyre_run(run_dir, *FAST, "workload.num_steps=8", *WATERLEVEL, *PACED,
                    "agent.env_params={tool_mean_s: 1.0, tool_sigma: 0.5, tool_max_s: 3.0}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=8)
    directions = Counter(e["direction"] for e in events if e["kind"] == "handoff")
    assert directions["rollout->train"] >= 1 and directions["train->rollout"] >= 1, directions
    decisions = [e for e in events if e["kind"] == "decision"]
    assert decisions and all(d["reason"] for d in decisions)
    # The first decision of each tick says what the policy saw: the observation itself,
    # which reads back (a decision can be replayed offline against it).
    seen = [Observation.from_record(d["observed"]) for d in decisions if "observed" in d]
    assert seen and len(seen) <= len(decisions)
    for d, obs in zip([d for d in decisions if "observed" in d], seen):
        assert obs.now_s == pytest.approx(d["t_run_s"], abs=1.0)
        assert len(obs.cells) == 4 and len(obs.run_elapsed_s) == obs.runs_in_flight
    # The handoff costs the policy is told: the config's until a cell has moved that way,
    # then the median of the last 10 transits measured (`sched.observe.HandoffTimes`).
    prior = load_config(run_dir / "config.yaml", []).handoff
    transits = {"train": [], "rollout": []}
    told = 0
    for e in events:
        if e["kind"] == "handoff" and not e.get("resumed"):
            to = e["direction"].split("->")[1]
            transits[to].append(e["total_s"] - (e["drain_s"] if to == "train" else 0.0))
        elif e["kind"] == "decision" and "observed" in e:
            got = e["observed"]
            for to, key, conf in (("train", "handoff_to_train_s", prior.to_train_s),
                                  ("rollout", "handoff_to_rollout_s", prior.to_rollout_s)):
                want = statistics.median(transits[to][-10:]) if transits[to] else conf
                assert got[key] == pytest.approx(want, rel=1e-6), (to, transits[to], got[key])
                told += bool(transits[to])
    assert told, "no decision came after a measured handoff"


# configs/bench-modes-phases.yaml in small: training-bound steps, then runs ten times
# longer from step 2, so the opening puts elastic cells in training and the phase change
# moves some of them to rollout.
PHASES = ["cluster.num_nodes=4", "workload.num_steps=4", "workload.prompts_per_step=4",
          "workload.phases=[{from_step: 0, duration_scale: 0.05}, "
          "{from_step: 2, duration_scale: 0.5}]"]


def test_cells_that_open_in_training_keep_a_released_server(tmp_path):
    """rollout.standby: always (auto on GPUs; on CPU auto is never, and a cell's first
    move to rollout starts its server then): the cells that open in training, beyond
    the standalone floor, start a server at the layout and release it, so their first
    move to rollout resumes it and no server process starts after the job's start."""
    run_dir = tmp_path / "standby"
    proc = gyre_run(run_dir, *PHASES, "rollout.standby=always",
                    config="bench-modes-phases.yaml", timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=4)
    layout = next(e for e in events if e["kind"] == "layout")
    floor = 1  # scheduler.min_train_cells: the standalone training cell (cell 1)
    opened = [c for c, role in enumerate(layout["roles"]) if role == "train" and c != floor]
    assert opened and layout["standby_cells"] == opened, layout
    moved = {c for e in events if e["kind"] == "handoff" and e["direction"] == "train->rollout"
             for c in e["cells"]}
    assert moved & set(opened), (opened, moved)  # a standby server was resumed
    spawned = [e for e in events if e["kind"] == "engine_spawned"]
    assert sorted(e["cell"] for e in spawned if e.get("standby")) == opened, spawned
    others = [c for c in range(len(layout["roles"])) if c != floor]  # the floor serves none
    assert sorted(e["cell"] for e in spawned) == others, spawned
    start = next(e["t"] for e in events if e["kind"] == "start")
    assert all(e["t"] <= start for e in spawned), spawned  # none after the start


@pytest.mark.parametrize("config", ["tiny.yaml", "tiny-vllm-megatron.yaml"])
def test_killed_and_resumed_run_loses_and_repeats_nothing(tmp_path, config):
    """SIGKILL of the whole job mid-step, then --resume (with the real engines too: the
    Megatron state comes back from its dist_checkpointing checkpoint, resharded, and the
    servers are sent its policy by the streamed weight sync: no weights file but v0)."""
    run_dir = tmp_path / "resume"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / config),
            "--run-dir", str(run_dir)]
    # killed after v1: two steps resumed (3 steps, not 4 with the kill after v2: the
    # same paths, one step less of each life)
    for item in FAST + ["workload.num_steps=3"]:
        args += ["--set", item]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 400
        while time.time() < deadline:  # until the checkpoint of version 1 is durable
            latest = run_dir / "checkpoints" / "latest"
            if latest.exists() and int(latest.read_text().strip().split("_")[-1]) >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run never checkpointed version 1")
        time.sleep(0.7)  # let it get into the middle of the next step
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    for e in read_jsonl(run_dir / "events.jsonl"):  # the job's other processes die with it
        if e["kind"] == "agent_registered":
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    before = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    resumed = gyre_run(run_dir, resume=True, timeout_s=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    after = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
    assert before <= after  # nothing recorded before the kill is lost
    assert any(e["kind"] == "resume" for e in events)
    steps = [e["step"] for e in events if e["kind"] == "step"]
    resume_at = next(e["version"] for e in events if e["kind"] == "resume")
    assert resume_at >= 1
    assert sorted(set(steps)) == list(range(3))
    if config == "tiny-vllm-megatron.yaml":  # streamed: no weights file but v0 to resume
        resumed_at = next(e["t"] for e in events if e["kind"] == "resume")  # from: the
        joins = [e for e in events if e["kind"] == "weights_streamed"  # servers were sent
                 and e["why"] == "join" and e["t"] > resumed_at]  # the checkpoint's policy
        assert joins and joins[0]["version"] == resume_at and not joins[0]["failed"], joins


def test_gyre_status_reads_a_run_dir(mode_run, tmp_path, gyre):
    run_dir, proc = mode_run("async")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = gyre("status", str(run_dir), "--once").stdout
    assert "version 3/3" in out and "cell 0 [node1]" in out
    data = json.loads(gyre("status", str(run_dir), "--json").stdout)
    assert data["version"] == 3 and len(data["cells"]) == 4
    missing = gyre("status", str(tmp_path / "nope"), check=False)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    again = gyre("run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir), check=False)
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_long_horizon_runs_compact_into_branches_that_all_train(tmp_path):
    run_dir = tmp_path / "lh"
    proc = gyre_run(run_dir, "workload.num_steps=2", "workload.prompts_per_step=2",
                    "workload.group_size=2", "agent.env=longhorizon", "agent.max_turns=12",
                    "agent.env_params={median_turns: 6, max_turns: 12, tool_mean_s: 0.1, "
                    "tool_max_s: 0.5, result_tokens: 60}",
                    "agent.context_budget_tokens=400", "scheduler.confirm_s=0.3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_run_dir(run_dir, num_steps=2)
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    assert any(r["num_compactions"] > 0 for r in records)
    per_run = Counter(rid for rid, _ in trained_trajectories(run_dir))
    assert max(per_run.values()) > 1  # compaction made real branches
    assert max(per_run.values()) <= 5  # K
