"""`gyre run` with the streamed weight sync (rollout.weight_sync: stream), for real: node
agents, rank processes, embedded engines, gloo transfer groups. A cell released to
rollout mid-run gets the current policy before it serves; with colocate (no training
world between phases) the weights come from a world stood up for it; a server that
hangs in a sync, and a training cell lost in one, do not wedge the job. Nothing is
written under weights/ but the initial policy."""

import os
from collections import Counter
from pathlib import Path

import pytest

import faults
from runtime_checks import check_run_dir
from test_faults_nodes import finish, kill_node, start_run, stopped_rank
from test_runtime_e2e import FAST, PACED, WATERLEVEL, gyre_run

pytestmark = pytest.mark.slow
STREAM = ["rollout.weight_sync=stream"]


def streamed(events: list[dict], why: str | None = None) -> list[dict]:
    return [e for e in events if e["kind"] == "weights_streamed"
            and (why is None or e["why"] == why)]


def check_policy_files(run_dir: Path) -> None:
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000000"]


def check_joins_got_the_current_policy(events: list[dict]) -> list[dict]:
    """Every join round sent the current policy (that of the last step before it: a
    step and its publish happen under the world lock, which a join takes too)."""
    current, joins = 0, []
    for e in events:
        if e["kind"] == "step":
            current = e["version"]
        elif e["kind"] == "weights_streamed" and e["why"] == "join":
            assert e["version"] == current and e["servers"] and not e["failed"], e
            joins.append(e)
    return joins


def check_served_policy_is_the_trainers(events: list[dict]) -> None:
    """Tokens sampled under the policy the trainer then held (lag 0) have the trainer's
    log-probabilities: the streamed weights are the trained ones."""
    lag0 = [e["metrics"]["mismatch/lag0/abs_max"] for e in events if e["kind"] == "step"
            and "mismatch/lag0/abs_max" in e.get("metrics", {})]
    assert lag0 and max(lag0) < 1e-3, lag0


def test_elastic_streams_every_policy_and_a_released_cell_gets_the_current_one(tmp_path):
    # PACED: unpaced, on a loaded 2-core machine, the one release came in the job's tail
    # and no cell ever came back (CI: rollout->train 1)
    run_dir = tmp_path / "elastic"
    proc = gyre_run(run_dir, *FAST, *STREAM, "workload.num_steps=6", *WATERLEVEL, *PACED,
                    "rollout.weight_bucket_mb=0.2",
                    "agent.env_params={tool_mean_s: 1.0, tool_sigma: 0.5, tool_max_s: 3.0}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=6)
    handoffs = [e for e in events if e["kind"] == "handoff"]
    directions = Counter(e["direction"] for e in handoffs)
    assert directions["rollout->train"] >= 1 and directions["train->rollout"] >= 1, directions
    published = [e["version"] for e in streamed(events, "publish")]
    assert published == list(range(1, 7))  # every step's policy reached the servers
    assert all(not e["failed"] for e in streamed(events))
    joins = check_joins_got_the_current_policy(events)
    for h in (e for e in handoffs if e["direction"] == "train->rollout"):
        cells = {f"cell{c}-" for c in h["cells"]}
        joined = [j for j in joins if j["t"] < h["t"] and
                  any(s.startswith(tuple(cells)) for s in j["servers"])]
        assert joined, (h, joins)  # before the handoff ended, i.e. before it served
    check_served_policy_is_the_trainers(events)
    check_policy_files(run_dir)
    groups = [e for e in events if e["kind"] == "wsync_group"]
    assert [g["generation"] for g in groups] == list(range(1, len(groups) + 1))


def test_colocate_streams_from_a_world_stood_up_between_phases(tmp_path):
    run_dir = tmp_path / "colocate"
    proc = gyre_run(run_dir, *FAST, *STREAM, "scheduler.policy=colocate")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    sources = [e for e in events if e["kind"] == "wsync_source_world"]
    joins = check_joins_got_the_current_policy(events)
    assert len(sources) == len(joins) >= 2  # every switch back to rollout
    assert [e["version"] for e in streamed(events, "publish")] == []  # nobody serves then
    check_policy_files(run_dir)


def test_a_server_that_hangs_in_a_sync_is_replaced_and_the_others_get_the_policy(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    stop_file = tmp_path / "stop-in-update"
    os.environ["GYRE_TEST_ENGINE_STOP_IN_UPDATE_FILE"] = str(stop_file)
    try:
        # enough steps (~1 s each) to outlast the hung server's restart
        proc = start_run(run_dir, *STREAM, "workload.num_steps=14",
                         "rollout.weight_sync_timeout_s=3")
    finally:
        del os.environ["GYRE_TEST_ENGINE_STOP_IN_UPDATE_FILE"]
    try:
        faults.wait_for(lambda: faults.events(run_dir, "step"), timeout_s=120,
                        what="a first step")
        stop_file.write_text("")
        hung = faults.wait_for(
            lambda: [e for e in faults.events(run_dir, "weights_streamed")
                     if any("hung" in why for why in e["failed"].values())],
            timeout_s=90, what="a round with a hung server")[0]
        (sid,) = hung["failed"]
        restarted = faults.wait_for(
            lambda: faults.events(run_dir, "engine_restarted", server=sid), timeout_s=120,
            what=f"{sid} restarted")
    finally:
        finish(proc, run_dir)
    events = check_run_dir(run_dir, num_steps=14)
    later = [e for e in streamed(events) if e["t"] > hung["t"]]
    if hung["retry"]:  # the group closed on the others: they were sent it again
        assert later[0]["attempt"] == 1 and set(later[0]["servers"]) == set(hung["retry"])
    assert restarted[0]["t"] > hung["t"]
    assert any(sid in e["servers"] and e["why"] == "join" for e in later)
    check_joins_got_the_current_policy(events)


def test_a_training_cell_lost_in_a_sync_fails_it_loudly_and_it_is_sent_again(tmp_path):
    run_dir = tmp_path / "run"
    # small buckets: both training nodes send; node 2's rank stops before its 2nd send
    proc = start_run(run_dir, *STREAM, "workload.num_steps=5",
                     "rollout.weight_bucket_mb=0.05", "rollout.weight_sync_timeout_s=5",
                     failpoint="wsync_send:2:2")
    try:
        ranks = faults.wait_for(lambda: stopped_rank(run_dir, 2), timeout_s=150,
                                what="node 2's rank at its failpoint")
        killed_at = kill_node(run_dir, 2, ranks)
        faults.wait_event(run_dir, "cell_failed", cell=2, timeout_s=30)
    finally:
        finish(proc, run_dir)
    events = check_run_dir(run_dir, num_steps=5)
    broken = [e for e in streamed(events) if e.get("pending") and e["t"] >= killed_at - 30]
    assert broken, streamed(events)
    # the first round after it that reaches the half-loaded servers sends them the
    # version they missed (a join round for another cell may come first: both hold the
    # world lock, whichever takes it first)
    later = [e for e in streamed(events) if e["t"] > broken[0]["t"]]
    again = [e for e in later if set(broken[0]["pending"]) <= set(e["servers"])]
    assert again, later
    assert again[0]["version"] == broken[0]["version"] and not again[0]["failed"], again[0]
    assert any(e["kind"] == "world_rebuilt" and 2 in e["lost"] for e in events)
