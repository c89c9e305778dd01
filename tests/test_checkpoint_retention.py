"""Checkpoint retention: a job of days writes a checkpoint (model and optimizer state)
and, with `rollout.weight_sync: file`, a weights folder every step; all were kept, so a
long run filled its filesystem. `training.keep_checkpoints` (3) keeps the newest few and
the weights files the job may still read. Likewise the micro-batch files (stream/, every
token of every trajectory trained: gigabytes a step for long agent runs):
`training.keep_microbatch_steps` (2) keeps the newest steps' files, and each
micro-batch's event keeps what it trained."""

from __future__ import annotations

import json
from pathlib import Path

from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, gyre_run

from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.rundir import RunDir


def _fake_run(root: Path, versions: range, latest: int) -> Path:
    for v in versions:
        (root / "checkpoints" / f"step_{v:06d}").mkdir(parents=True)
        (root / "checkpoints" / f"step_{v:06d}" / "trainer.pt").write_bytes(b"x" * 100)
    for v in [0, *versions]:
        (root / "weights" / f"v{v:06d}").mkdir(parents=True)
    (root / "checkpoints" / "latest").write_text(f"step_{latest:06d}")
    return root


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_prune_keeps_the_newest_latest_and_the_weights_they_need(tmp_path):
    run = _fake_run(tmp_path / "a", range(1, 9), latest=8)
    (run / "weights" / ".old-v000002").mkdir()  # left by a prune a crash stopped
    removed = checkpoint.prune(run, keep=2)
    assert _names(run / "checkpoints") == ["latest", "step_000007", "step_000008"]
    # v6: two versions below the newest, what a server that began to start then reads
    assert _names(run / "weights") == ["v000000", "v000006", "v000007", "v000008"]
    assert sorted(removed) == [f"checkpoints/step_00000{v}" for v in range(1, 7)] + \
        [f"weights/v00000{v}" for v in range(1, 6)]
    # `latest` fell back to an older one (a resume found the newer ones bad): it stays,
    # with its weights; versions from the newest kept one on stay (the servers load them)
    run = _fake_run(tmp_path / "b", range(1, 9), latest=2)
    (run / "weights" / "v000009").mkdir()
    checkpoint.prune(run, keep=2)
    assert _names(run / "checkpoints") == ["latest", "step_000002", "step_000007",
                                           "step_000008"]
    assert _names(run / "weights") == ["v000000", "v000002", "v000006", "v000007",
                                       "v000008", "v000009"]


def test_prune_stream_removes_the_older_steps_files_only(tmp_path):
    rd = RunDir(tmp_path / "run")
    (rd.path / "stream").mkdir(parents=True)
    for step, index in [(0, 0), (0, 1), (1, 0), (2, 0), (2, 3)]:
        rd.stream_file(step, index).write_text("x")
    # a run dir from before the safetensors files: its JSON micro-batches go the same way
    (rd.path / "stream" / "step000001_mb00001.json").write_text("[]")
    for odd in ("notes.txt", "step000000_mb00000.safetensors.tmp", "stepXYZ_mb1.json",
                "step000000_mb00002.npz"):
        (rd.path / "stream" / odd).write_text("x")  # not a micro-batch file: stays
    assert rd.prune_stream(before_step=2) == 4
    assert _names(rd.path / "stream") == sorted([
        "notes.txt", "step000000_mb00000.safetensors.tmp", "stepXYZ_mb1.json",
        "step000000_mb00002.npz",
        "step000002_mb00000.safetensors", "step000002_mb00003.safetensors"])
    assert rd.prune_stream(before_step=2) == 0


def test_a_long_run_keeps_its_newest_checkpoints_and_resumes_from_them(tmp_path):
    run_dir = tmp_path / "run"
    proc = gyre_run(run_dir, *FAST, "workload.num_steps=5", "cluster.num_nodes=2",
                    "training.keep_checkpoints=2", "training.keep_microbatch_steps=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _names(run_dir / "checkpoints") == ["latest", "step_000004", "step_000005"]
    # (weights: v0, and from two versions below the newest checkpoint on)
    assert _names(run_dir / "weights") == ["v000000", "v000003", "v000004", "v000005"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    pruned = [e["removed"] for e in events if e["kind"] == "checkpoints_pruned"]
    assert pruned == [["checkpoints/step_000001"],
                      ["checkpoints/step_000002", "weights/v000001"],
                      ["checkpoints/step_000003", "weights/v000002"]], pruned
    # the last step's micro-batch files only; each older step's went as the next ended
    assert {name[:10] for name in _names(run_dir / "stream")} == {"step000004"}
    gone = [e["before_step"] for e in events if e["kind"] == "microbatches_pruned"]
    assert gone == [1, 2, 3, 4], gone
    proc = gyre_run(run_dir, "workload.num_steps=7", resume=True)  # two more steps
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _names(run_dir / "checkpoints") == ["latest", "step_000006", "step_000007"]
    assert {name[:10] for name in _names(run_dir / "stream")} == {"step000006"}
    check_run_dir(run_dir, num_steps=7)  # every run trained once, steps in order
