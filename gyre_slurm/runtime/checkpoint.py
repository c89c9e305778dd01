"""Checkpoints and resume.

A checkpoint is taken right after an optimizer step, at the only moment nothing of the
next step has been trained: `checkpoints/.tmp-step_NNNNNN/` receives the trainer state
(model, optimizer, version, RNG: written by the world's rank 0) and `coordinator.json`
(the policy version and the config's name), then is renamed to `step_NNNNNN`, and
`checkpoints/latest` is rewritten last. A reader never sees a half checkpoint.

Resume (`gyre run CONFIG --run-dir DIR --resume`) starts from `latest`:
- the policy version and the trainer state come from the checkpoint; the rollout
  servers load `weights/v<version>` (`rollout.weight_sync: file`), or the training
  ranks, having loaded the state, stream it to them (`stream`: no weights file);
- every run recorded in `runs/runs.jsonl` of a step not yet trained is replayed into
  the ledger, its trajectories rebuilt from the call store (nothing recorded is lost,
  no trained run is trained again);
- a run that was started (`runs/started.jsonl`) but has no record was interrupted: it
  restarts as a new attempt (`<run_id>-a<N>`); its partial calls are never trained.

Verification: before the rename, `manifest.json` records every file of the checkpoint
(relative path, size, sha256). On resume a checkpoint is used only if its manifest
verifies, its `coordinator.json` names a version, its trainer state is there and the
weights of that version are whole (`tiny.verify_weights`; not for a checkpoint of a
streamed run, which writes none: a streamed run resumes with `stream`). If `latest` is
missing,
garbled or names a checkpoint that does not verify, resume falls back to the newest
checkpoint that verifies: each rejected one is reported (a `checkpoint_rejected` event
and a warning on stderr, with the reason) and moved aside to `checkpoints/.rejected-
<name>`; `latest` is rewritten to the one used (`resume_fallback` event). If none
verifies, resume stops with an error naming each checkpoint and what is wrong with it.
A checkpoint written before manifests existed is checked for the rest and used.

Disk full while checkpointing: the half-written `.tmp-step_N` is removed, `latest` keeps
naming the previous checkpoint (untouched), and the job stops with `DiskFull` (what,
where, about how much is needed: the previous checkpoint's size, and the free space on
that file system). Free space, then `--resume`.

Torn tails: on resume, a torn last line of events.jsonl, runs/runs.jsonl and
runs/started.jsonl (a crash mid-write) is cut off before anything is appended (a
`torn_tail_dropped` event); a corrupt line in the middle of runs.jsonl or started.jsonl
is skipped and reported (a `corrupt_line` event naming the file, line and byte offset,
and a warning): its run, never recorded as far as resume can tell, runs again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from gyre_slurm.errors import UserError
from gyre_slurm.models import tiny
from gyre_slurm.runtime.book import StepBook, run_id_of
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.common.fsio import (
    BadLine, DiskFull, drop_torn_tail, free_bytes, fsync_dir, is_disk_full, loads_json,
    read_jsonl, write_bytes_atomic, write_json_atomic,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STATE_NAMES = ("trainer.pt", "trainer")
STEP_NAME = re.compile(r"^step_(\d{6,})$")
WEIGHTS_NAME = re.compile(r"^v(\d{6,})$")
WEIGHTS_MARGIN = 2  # weights of versions this close below the newest checkpoint stay
LOW_SPACE_BYTES = 16 << 20  # a checkpoint write that failed with less left: disk full


# -- writing ---------------------------------------------------------------------------
async def save(*, rd: RunDir, world: TrainWorld, version: int, config_name: str,
               node: int | None = None, weight_sync: str = "file", keep: int = 0) -> None:
    """Checkpoint policy `version`, the state `world` trains (`node`: the member that
    writes a replicated trainer's state; default the world's first). `weight_sync`:
    the run's rollout.weight_sync (streamed: no weights file goes with the state).
    `keep` > 0: then only the newest `keep` checkpoints stay (`prune`)."""
    name = f"step_{version:06d}"
    final = rd.checkpoints / name
    tmp = rd.checkpoints / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.monotonic()
    try:
        tmp.mkdir(parents=True)
        await world.save(tmp / world.state_name, node=node)
        if not (tmp / world.state_name).exists():  # never commit one without it
            raise RuntimeError(f"the trainer wrote no {world.state_name} into {tmp}")
        write_json_atomic(tmp / "coordinator.json", {"version": version, "name": config_name,
                                                     "t": time.time(),
                                                     "weight_sync": weight_sync})
        manifest = await asyncio.to_thread(write_manifest, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(rd.checkpoints)
        write_bytes_atomic(rd.checkpoints / "latest", name.encode())
    except Exception as exc:
        free = free_bytes(rd.checkpoints)  # before cleaning up: what the failed write left
        shutil.rmtree(tmp, ignore_errors=True)
        raise _explain_save_failure(rd, name, tmp, exc, free) from exc
    rd.event("checkpoint", version=version, path=str(final),
             seconds=time.monotonic() - t0, bytes=manifest_bytes(manifest))
    if keep > 0:
        removed = await asyncio.to_thread(prune, rd.path, keep=keep)
        if removed:
            rd.event("checkpoints_pruned", kept=keep, removed=removed)


def prune(run_dir: Path, *, keep: int) -> list[str]:
    """Keep the newest `keep` checkpoints (never the one `latest` names) and the weights
    files the job may still read: the initial ones (v0), those of the kept checkpoints
    (a resume loads them) and every version from WEIGHTS_MARGIN before the newest kept
    checkpoint's on (what the servers load now, and what a server that began to start
    a step or two ago may still be reading). Each goes by an atomic rename to
    `.old-NAME` first, so a crash part-way leaves nothing a resume could take for whole
    (`.old-*` left by one is removed by the next prune). The names removed."""
    checkpoints, weights = Path(run_dir) / "checkpoints", Path(run_dir) / "weights"
    steps = _steps_newest_first(checkpoints)
    latest = _read_latest_name(checkpoints)
    kept = list(steps[:keep]) + [p for p in steps[keep:] if p.name == latest]
    doomed = [p for p in steps[keep:] if p.name != latest]
    versions = {int(p.name[5:]) for p in kept}
    if versions and weights.is_dir():
        newest = max(versions)
        doomed += [p for p in weights.glob("v*") if WEIGHTS_NAME.match(p.name)
                   and (v := int(p.name[1:])) != 0 and v not in versions
                   and v < newest - WEIGHTS_MARGIN]
    removed = []
    for path in doomed:
        aside = path.with_name(f".old-{path.name}")
        try:
            os.replace(path, aside)
        except OSError:
            continue
        removed.append(f"{path.parent.name}/{path.name}")
    for folder in (checkpoints, weights):
        for aside in folder.glob(".old-*"):
            shutil.rmtree(aside, ignore_errors=True)
    return removed


def _explain_save_failure(rd: RunDir, name: str, tmp: Path, exc: Exception,
                          free: int | None) -> Exception:
    """A disk-full failure becomes `DiskFull`: by its errno or text, or, since the
    trainer's error may have lost both on the way (torch.save says "unexpected pos"),
    by the free space the failed write left (under LOW_SPACE_BYTES)."""
    previous = _read_latest_name(rd.checkpoints)
    needed = None
    if previous is not None:
        try:
            needed = manifest_bytes(loads_json((rd.checkpoints / previous / MANIFEST)
                                               .read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    if not (is_disk_full(exc) or (free is not None and free < LOW_SPACE_BYTES)):
        return exc
    keep = (f"checkpoints/latest still names {previous} (untouched)" if previous
            else "no earlier checkpoint exists")
    err = DiskFull(what=f"writing checkpoint {name}", path=tmp, needed=needed, cause=exc,
                   after=f", then continue with --resume; {keep}")
    try:
        rd.event("disk_full", what=f"checkpoint {name}", path=str(tmp), needed=needed,
                 free=err.free, mount=err.mount, error=str(exc)[:500])
    except (OSError, DiskFull):
        pass  # the events file may be on the same full file system
    return err


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt: Path) -> dict:
    """`ckpt/manifest.json`: every file under `ckpt` with its size and sha256."""
    files = {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(ckpt)}
    manifest = {"format": 1, "files": files}
    write_json_atomic(ckpt / MANIFEST, manifest)
    return manifest


def manifest_bytes(manifest: dict) -> int:
    return sum(int(f["size"]) for f in manifest["files"].values())


# -- verifying -------------------------------------------------------------------------
class CheckpointInvalid(UserError):
    """A checkpoint that must not be resumed from; the message says what is wrong."""


@dataclass(frozen=True)
class Verified:
    path: Path
    version: int
    state: Path  # trainer.pt, or a trainer/ directory
    checksummed: bool  # False: written before manifests (not checksummed)


def verify_checkpoint(ckpt: Path, run_dir: Path) -> Verified:
    """Check a checkpoint dir completely (see the module docstring) or raise
    `CheckpointInvalid` naming the file and what is wrong."""
    if not ckpt.is_dir():
        raise CheckpointInvalid(f"{ckpt} does not exist")
    checksummed = _verify_manifest(ckpt)
    meta_path = ckpt / "coordinator.json"
    try:
        meta = loads_json(meta_path.read_bytes())
        version = int(meta["version"])
    except FileNotFoundError:
        raise CheckpointInvalid(f"{meta_path} is missing") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointInvalid(f"{meta_path} is garbled ({type(exc).__name__}: "
                                f"{str(exc)[:120]})") from None
    state = [ckpt / n for n in STATE_NAMES if (ckpt / n).exists()]
    if not state:
        raise CheckpointInvalid(f"{ckpt} holds no trainer state ({' or '.join(STATE_NAMES)})")
    if state[0].is_file() and state[0].stat().st_size == 0:
        raise CheckpointInvalid(f"{state[0]} is empty")
    if meta.get("weight_sync") != "stream":  # streamed: the servers get the weights
        try:                                   # from the trainer state
            tiny.verify_weights(tiny.weights_dir(run_dir, version))
        except tiny.CorruptWeights as exc:
            raise CheckpointInvalid(f"{ckpt} is of policy version {version}, whose weights "
                                    f"are unusable: {exc}") from None
    return Verified(ckpt, version, state[0], checksummed)


def _verify_manifest(ckpt: Path) -> bool:
    path = ckpt / MANIFEST
    if not path.exists():
        return False
    try:
        files = loads_json(path.read_bytes())["files"]
        listed = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointInvalid(f"{path} is garbled ({type(exc).__name__}: "
                                f"{str(exc)[:120]})") from None
    for name, (size, digest) in sorted(listed.items()):
        f = ckpt / name
        if not f.is_file():
            raise CheckpointInvalid(f"{f} is missing (listed in {MANIFEST})")
        got = f.stat().st_size
        if got != size:
            raise CheckpointInvalid(f"{f} is {got} bytes, {MANIFEST} says {size}"
                                    + (f" (truncated at byte offset {got})" if got < size else ""))
        if _sha256(f) != digest:
            raise CheckpointInvalid(f"{f}: sha256 differs from {MANIFEST} (corrupt content)")
    return True


def _steps_newest_first(checkpoints: Path) -> list[Path]:
    return sorted((p for p in checkpoints.glob("step_*") if STEP_NAME.match(p.name)),
                  key=lambda p: int(p.name[5:]), reverse=True)


def _read_latest_name(checkpoints: Path) -> str | None:
    try:
        name = (checkpoints / "latest").read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_NAME.match(name) else None


@dataclass
class Choice:
    chosen: Verified | None
    latest: str | None  # what `latest` named (None: missing or garbled)
    latest_raw: str | None  # why `latest` itself is bad, if it is
    rejected: list[tuple[Path, str]]


def choose_checkpoint(run_dir: Path) -> Choice:
    """The checkpoint to resume from: `latest` if it verifies, else the newest one that
    does. Reads only; `load_for_resume` reports and acts."""
    checkpoints = Path(run_dir) / "checkpoints"
    latest_file = checkpoints / "latest"
    latest = _read_latest_name(checkpoints)
    latest_raw = None
    if latest is None and latest_file.exists():
        raw = latest_file.read_bytes()[:80]
        latest_raw = f"{latest_file} is garbled ({raw!r}): it names no step_NNNNNN"
    steps = _steps_newest_first(checkpoints)
    order = ([checkpoints / latest] if latest else []) + \
        [p for p in steps if p.name != latest]
    rejected = []
    for ckpt in order:
        try:
            return Choice(verify_checkpoint(ckpt, Path(run_dir)), latest, latest_raw, rejected)
        except CheckpointInvalid as exc:
            rejected.append((ckpt, str(exc)))
    return Choice(None, latest, latest_raw, rejected)


# -- resuming --------------------------------------------------------------------------
@dataclass(frozen=True)
class Resume:
    """Where a resumed job starts: the policy version, and the trainer state of the
    checkpoint that holds it (None: nothing trained yet, the initial weights)."""

    version: int
    state: Path | None


def load_for_resume(rd: RunDir) -> Resume:
    if not (rd.path / "config.yaml").is_file():
        raise UserError(f"--resume: {rd.path} is not a run dir (no config.yaml)")
    _drop_torn_tails(rd)
    choice = choose_checkpoint(rd.path)
    for path, why in choice.rejected:
        log.warning("--resume: checkpoint %s rejected: %s", path, why)
        rd.event("checkpoint_rejected", path=str(path), reason=why)
    if choice.latest_raw:
        log.warning("--resume: %s", choice.latest_raw)
        rd.event("checkpoint_rejected", path=str(rd.checkpoints / "latest"),
                 reason=choice.latest_raw)
    if choice.chosen is None:
        if not choice.rejected and not choice.latest_raw:
            _drop_uncommitted_stream(rd, 0)
            return Resume(0, None)  # nothing trained yet: from v0, replaying finished runs
        lines = [f"  {p.name}: {why}" for p, why in choice.rejected]
        lines += [f"  latest: {choice.latest_raw}"] if choice.latest_raw else []
        raise UserError(
            f"--resume: no checkpoint in {rd.checkpoints} verifies:\n" + "\n".join(lines)
            + "\nrestore a good checkpoint there, or remove checkpoints/ to train again from "
              "policy version 0 (every recorded run is replayed)")
    ok = choice.chosen
    if choice.rejected or choice.latest_raw or choice.latest != ok.path.name:
        for path, _ in choice.rejected:
            _move_aside(path)
        write_bytes_atomic(rd.checkpoints / "latest", ok.path.name.encode())
        log.warning("--resume: falling back from %s to %s (policy version %d)",
                    choice.latest or "a missing or garbled `latest`", ok.path.name, ok.version)
        rd.event("resume_fallback", latest=choice.latest, to=ok.path.name, version=ok.version,
                 rejected=[{"path": str(p), "reason": why} for p, why in choice.rejected])
    if not ok.checksummed:
        log.info("--resume: %s has no %s (written before manifests): files not checksummed",
                 ok.path, MANIFEST)
    rd.event("resume", checkpoint=str(ok.path), version=ok.version, checksummed=ok.checksummed)
    _drop_uncommitted_stream(rd, ok.version)
    return Resume(ok.version, ok.state)


def _move_aside(path: Path) -> None:
    """Keep a rejected checkpoint for inspection, out of resume's way."""
    if not path.is_dir():
        return
    aside = path.with_name(f".rejected-{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    log.warning("--resume: moved the rejected %s to %s", path, aside)


def _drop_torn_tails(rd: RunDir) -> None:
    """A crash may have cut a line short; the resumed job appends after it, so it goes."""
    for path in (rd.events_file, rd.runs_file, rd.path / "runs" / "started.jsonl"):
        cut = drop_torn_tail(path)
        if cut is not None:
            offset, num_bytes = cut
            log.info("--resume: %s: dropped a torn last line at byte offset %d (%d bytes)",
                     path, offset, num_bytes)
            rd.event("torn_tail_dropped", path=str(path), offset=offset, bytes=num_bytes)


def _drop_uncommitted_stream(rd: RunDir, version: int) -> None:
    """Micro-batches of steps the checkpoint does not hold were never applied to the
    weights: they are trained again, so their old files go (the stream dir then lists
    exactly what the committed steps trained)."""
    for step, _, path in rd.stream_files():
        if step >= version:
            path.unlink()


async def replay_runs(*, book: StepBook, rd: RunDir,
                      finish: Callable[[str, dict], Awaitable[None]]) -> None:
    """Feed the ledger what the previous coordinator recorded (see module docstring):
    `finish(run_id, record)` ends a recorded run as the rollout manager does."""
    ended = {rec["run_id"]: rec for rec in _records(rd, rd.runs_file)}
    started = {rec["run_id"] for rec in _records(rd, rd.path / "runs" / "started.jsonl")}
    for step in range(book.version, book.num_steps):
        for slot, rid in enumerate(list(book.steps[step].runs)):
            prompt, member = divmod(slot, book.group_size)
            attempt = 0
            while run_id_of(step, prompt, member, attempt + 1) in started | set(ended):
                attempt += 1
            rid = _to_attempt(book, rid, attempt)
            if rid in ended:
                book.start(rid)
                await finish(rid, ended[rid])
            elif rid in started:
                book.restart(rid)


def _records(rd: RunDir, path: Path):
    """The run records of a JSON-lines file; corrupt lines are reported and skipped."""
    def report(bad: BadLine) -> None:
        rd.event("corrupt_line", **bad.to_json())

    for number, rec in enumerate(read_jsonl(path, on_bad=report), 1):
        if isinstance(rec.get("run_id"), str):
            yield rec
        else:
            why = f"a record without a run_id: {json.dumps(rec)[:80]}"
            log.warning("%s: record %d skipped: %s", path, number, why)
            rd.event("corrupt_line", path=str(path), record=number, reason=why)


def _to_attempt(book: StepBook, rid: str, attempt: int) -> str:
    while book.runs[rid].attempt < attempt:
        rid = book.restart(rid)
    return rid
