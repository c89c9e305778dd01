"""Checks of a finished run dir from its records (shared by the runtime and Slurm
end-to-end tests): not from the coordinator's counters."""

import json
from collections import Counter
from pathlib import Path

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.monitor.model import LIFE_STARTS, trained_microbatches
from gyre_slurm.runtime.metrics import read_metrics
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.traj import mbfile
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.records import token_digest
from gyre_slurm.traj.store import load_store


def trained_trajectories(run_dir: Path) -> Counter:
    """(run_id, token digest) of every trajectory a standing micro-batch trained, from
    its `microbatch` event (the files of older steps are gone:
    training.keep_microbatch_steps)."""
    seen = Counter()
    for e in trained_microbatches(list(read_jsonl(run_dir / "events.jsonl"))):
        assert len(e["runs"]) == len(e["digests"]) == len(e["lengths"]), e
        for rid, digest in zip(e["runs"], e["digests"]):
            seen[(rid, digest)] += 1
    return seen


def processed_trajectories(run_dir: Path) -> dict[tuple[str, str], list]:
    """(run_id, token digest) -> token ids of every trajectory, rebuilt independently
    from the call store for every ok run, with the run's K (training.max_per_run)."""
    max_per_run = run_config(run_dir).get("training", {}).get("max_per_run", 5)
    ok = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl") if r["status"] == "ok"}
    loaded = load_store(run_dir)
    out = {}
    for rid in ok:
        for t in process_run(loaded.runs[rid], max_per_run=max_per_run).trajectories:
            out[(rid, token_digest(t.token_ids))] = t.token_ids.tolist()
    return out


def check_runs_trained_once(run_dir: Path, processed: dict | None = None) -> None:
    """Every run that started ended for a reason of its own (none was killed by a
    handoff; only a job kill leaves a run without a record, and then a later attempt of
    it ran), all ok, and every ok run's trajectories were trained exactly once
    (`processed`: `processed_trajectories(run_dir)`, where the caller has it)."""
    records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
    started = [r["run_id"] for r in read_jsonl(run_dir / "runs" / "started.jsonl")]
    ended = {r["run_id"]: r for r in records}
    assert set(ended) <= set(started)
    for rid in set(started) - set(ended):
        base = rid.split("-a")[0]
        assert any(e.startswith(base + "-a") and e > rid for e in ended), rid
    assert all(r["status"] == "ok" for r in records), [r for r in records if r["status"] != "ok"]
    processed = processed_trajectories(run_dir) if processed is None else processed
    trained = trained_trajectories(run_dir)
    assert trained == Counter(processed.keys())  # each processed trajectory once
    assert max(trained.values()) == 1


def check_steps_in_order(events: list[dict], *, num_steps: int) -> None:
    """Each life of the job (its lives begin at "start" events, and a life that resumed
    from a checkpoint at the "resume" event before that) finished steps in order from the
    version it started at, which is at most where the life before it got to (a job
    stopped after a step's event but before its checkpoint was durable redoes that step;
    one stopped before its first checkpoint starts again at version 0, with no "resume"
    event), and the last life reached `num_steps`."""
    next_step = 0
    for e in events:
        if e["kind"] in LIFE_STARTS:
            assert e["version"] <= next_step, (e, next_step)
            next_step = e["version"]
        elif e["kind"] == "step":
            assert e["step"] == next_step, (e, next_step)
            next_step += 1
    assert next_step == num_steps


def check_metrics(run_dir: Path, events: list[dict], *, num_steps: int) -> None:
    """metrics.jsonl has each step once (the last life's line), equal to its step
    event's metrics; the trainer's per-lag token counts match the coordinator's lag
    histogram; TensorBoard's own reader finds the same scalars, each step once (a
    resumed run's first life purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = read_metrics(run_dir)
    assert [m["step"] for m in lines] == list(range(num_steps))
    last = {e["step"]: e for e in events if e["kind"] == "step"}
    for m in lines:
        e = last[m["step"]]
        assert {k: v for k, v in m.items() if k not in ("step", "version", "t")} == e["metrics"]
        assert m["train/tokens"] == e["tokens"] and m["train/trajectories"] == e["trajectories"]
        by_lag = {k.split("/")[1][3:]: v for k, v in m.items()
                  if k.startswith("mismatch/lag") and k.endswith("/tokens")}
        assert by_lag == m["staleness/lag_hist"] and sum(by_lag.values()) == e["tokens"]
        assert 0 <= m["mismatch/abs_mean"] <= m["mismatch/abs_max"] and m["mismatch/kl_k3"] >= 0
        # Every advantage is zero when each group's runs earned the same reward (a random
        # tiny model on the shell tasks often scores 0 everywhere): no gradient then.
        assert m["train/entropy"] > 0 and m["train/grad_norm"] >= 0
        if m["reward/zero_spread_frac"] not in (None, 1):
            assert m["train/grad_norm"] > 0
        assert 0 <= m["train/clip_frac"] <= 1
        assert abs(m["reward/mean"] - e["mean_reward"]) < 1e-9
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert "staleness/lag" in acc.Tags()["histograms"]
    for tag in ("train/loss", "mismatch/abs_mean", "mismatch/kl_k3", "reward/mean"):
        scalars = acc.Scalars(tag)
        assert [s.step for s in scalars] == list(range(num_steps)), (tag, scalars)
        for s, m in zip(scalars, lines):
            assert abs(s.value - m[tag]) <= 1e-6 * max(1.0, abs(m[tag])), (tag, s, m[tag])


def check_packing(run_dir: Path, events: list[dict], processed: dict | None = None) -> None:
    """Every micro-batch computed what its packing says (config.yaml's
    training.packing): tree, each run's prefix tree once (its tree tokens, no padding),
    a run never split across micro-batches; rows, every trajectory whole. The batches
    are rebuilt from the call store by their events' digests."""
    from gyre_slurm.traj.treepack import tree_tokens

    packing = run_config(run_dir).get("training", {}).get("packing", "tree")
    ids = processed_trajectories(run_dir) if processed is None else processed
    seen_runs: dict[str, tuple[int, int]] = {}
    for e in trained_microbatches(events):
        batch = [{"run_id": rid, "token_ids": ids[(rid, d)]}
                 for rid, d in zip(e["runs"], e["digests"])]
        assert [len(t["token_ids"]) for t in batch] == e["lengths"], e
        rows = sum(e["lengths"])
        fed, pad = e["stats"]["fed_tokens"], e["stats"]["pad_tokens"]
        if packing == "tree":
            assert (fed, pad) == (tree_tokens(batch), 0), e
            for rid in {t["run_id"] for t in batch}:  # whole runs: one micro-batch each
                assert seen_runs.setdefault(rid, (e["step"], e["index"])) == (
                    e["step"], e["index"]), (rid, e)
        else:
            assert fed - pad == rows, e


def check_stream_files(run_dir: Path, events: list[dict], *, num_steps: int) -> None:
    """The micro-batch files left are those of the newest training.keep_microbatch_steps
    steps (every one where 0), one for each of their standing micro-batches, each
    holding what its event says it trained."""
    keep = run_config(run_dir).get("training", {}).get("keep_microbatch_steps", 2)
    standing = {(e["step"], e["index"]): e for e in trained_microbatches(events)}
    files = {(step, index): p for step, index, p in RunDir(run_dir).stream_files()}
    kept = {k for k in standing if keep == 0 or k[0] >= num_steps - keep}
    assert set(files) == kept, (sorted(files), sorted(kept))
    for key, path in files.items():
        batch = mbfile.read(path)
        assert [t["run_id"] for t in batch] == standing[key]["runs"], key
        assert [token_digest(t["token_ids"]) for t in batch] == standing[key]["digests"], key


def run_config(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text()) or {}


def check_run_dir(run_dir: Path, *, num_steps: int) -> list[dict]:
    processed = processed_trajectories(run_dir)  # the call store, read and processed once
    check_runs_trained_once(run_dir, processed)
    events = list(read_jsonl(run_dir / "events.jsonl"))
    check_packing(run_dir, events, processed)
    check_stream_files(run_dir, events, num_steps=num_steps)
    check_steps_in_order(events, num_steps=num_steps)
    check_metrics(run_dir, events, num_steps=num_steps)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["final"] and status["version"] == num_steps
    latest = (run_dir / "checkpoints" / "latest").read_text()
    state = run_dir / "checkpoints" / latest
    assert (state / "trainer.pt").is_file() or (state / "trainer").is_dir()
    assert oct((run_dir / "secret").stat().st_mode & 0o777) == "0o600"
    return events
