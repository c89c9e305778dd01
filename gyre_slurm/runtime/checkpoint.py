"""Checkpoints and resume.

A checkpoint is taken right after an optimizer step, at the only moment nothing of the
next step has been trained: `checkpoints/.tmp-step_NNNNNN/` receives the trainer state
(model, optimizer, version, RNG: written by the world's rank 0) and `coordinator.json`
(the policy version and the config's name), then is renamed to `step_NNNNNN`, and
`checkpoints/latest` is rewritten last. A reader never sees a half checkpoint.

Resume (`gyre run CONFIG --run-dir DIR --resume`) starts from `latest`:
- the policy version and the trainer state come from the checkpoint; the rollout
  servers load `weights/v<version>`;
- every run recorded in `runs/runs.jsonl` of a step not yet trained is replayed into
  the ledger, its trajectories rebuilt from the call store (nothing recorded is lost,
  no trained run is trained again);
- a run that was started (`runs/started.jsonl`) but has no record was interrupted: it
  restarts as a new attempt (`<run_id>-a<N>`); its partial calls are never trained.
"""

from __future__ import annotations

import os
import shutil
import time

from gyre_slurm.errors import UserError
from gyre_slurm.models import tiny
from gyre_slurm.runtime.book import run_id_of
from gyre_slurm.runtime.fsio import read_jsonl, write_json_atomic


async def save(coord) -> None:
    version = coord.book.version
    name = f"step_{version:06d}"
    final = coord.rd.checkpoints / name
    tmp = coord.rd.checkpoints / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    await coord.world.save(tmp / coord.world.state_name)
    write_json_atomic(tmp / "coordinator.json", {"version": version, "name": coord.cfg.name,
                                                 "t": time.time()})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    coord.rd.set_latest(name)
    coord.rd.event("checkpoint", version=version, path=str(final),
                   seconds=time.monotonic() - t0)


def load_for_resume(coord) -> int:
    rd = coord.rd
    if not (rd.path / "config.yaml").is_file():
        raise UserError(f"--resume: {rd.path} is not a run dir (no config.yaml)")
    latest = rd.latest_checkpoint()
    if latest is None:
        coord.resume_state = None
        _drop_uncommitted_stream(rd, 0)
        return 0  # nothing trained yet: start from v0, replaying finished runs
    meta = _read_json(latest / "coordinator.json")
    version = int(meta["version"])
    if not tiny.weights_dir(rd.path, version).is_dir():
        raise UserError(f"--resume: checkpoint {latest} names policy version {version} but "
                        f"{tiny.weights_dir(rd.path, version)} is missing")
    state = [latest / name for name in ("trainer.pt", "trainer") if (latest / name).exists()]
    if not state:
        raise UserError(f"--resume: checkpoint {latest} holds no trainer state "
                        f"(trainer.pt or trainer/)")
    coord.resume_state = state[0]
    rd.event("resume", checkpoint=str(latest), version=version)
    _drop_uncommitted_stream(rd, version)
    return version


def _drop_uncommitted_stream(rd, version: int) -> None:
    """Micro-batches of steps the checkpoint does not hold were never applied to the
    weights: they are trained again, so their old files go (the stream dir then lists
    exactly what the committed steps trained)."""
    for path in (rd.path / "stream").glob("step*_mb*.json"):
        if int(path.name[4:10]) >= version:
            path.unlink()


def replay_runs(coord) -> None:
    """Feed the ledger what the previous coordinator recorded (see module docstring)."""
    book, rd = coord.book, coord.rd
    ended = {}
    for rec in read_jsonl(rd.runs_file):
        ended[rec["run_id"]] = rec
    started = {rec["run_id"] for rec in read_jsonl(rd.path / "runs" / "started.jsonl")}
    for step in range(book.version, book.num_steps):
        for slot, rid in enumerate(list(book.steps[step].runs)):
            prompt, member = divmod(slot, book.group_size)
            attempt = 0
            while run_id_of(step, prompt, member, attempt + 1) in started | set(ended):
                attempt += 1
            rid = _to_attempt(book, rid, attempt)
            if rid in ended:
                book.start(rid)
                coord.rollouts.finish(rid, ended[rid])
            elif rid in started:
                book.restart(rid)


def _to_attempt(book, rid: str, attempt: int) -> str:
    while book.runs[rid].attempt < attempt:
        rid = book.restart(rid)
    return rid


def _read_json(path):
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--resume: cannot read {path}: {exc}") from exc
