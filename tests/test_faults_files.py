"""Faults in the run dir's files (the "faults" issue, items 4 and 5), injected for real
into the run dir of a real `gyre run` (local launcher), then read back by the real
readers or resumed with a real `gyre run --resume`.

How each fault is made:
- torn / corrupt files: bytes of the real files are cut off (`os.truncate`: a crash in
  the middle of a write) or overwritten in place (zeros, as a crash on a journaling file
  system leaves them, or garbage): call segments, runs.jsonl, events.jsonl, status.json,
  checkpoint files, `latest`, a weights file;
- disk full: a real tmpfs of a few MiB is mounted (we run as root: `mount -t tmpfs -o
  size=...`) over the run dir's `checkpoints/` or `calls/` before the run starts, so the
  kernel itself answers ENOSPC when it fills; "freeing space" is `mount -o remount,size=`
  (the files stay). Without the right to mount, these tests fail saying so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from runtime_checks import check_runs_trained_once, check_steps_in_order
from test_runtime_e2e import FAST, gyre_run
from traj_helpers import mk_call

from gyre_slurm.models import tiny
from gyre_slurm.monitor import model
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError
from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.coordinator import Coordinator
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.common.fsio import (
    DiskFull, append_jsonl, drop_torn_tail, read_jsonl, write_bytes_atomic,
)
from gyre_slurm.traj.store import CallStoreReader, CallStoreWriter, RunBuffer, load_store

ROOT = Path(__file__).resolve().parent.parent
# Two nodes (one rollout cell, one training cell): the faults here are in the run dir's
# files, not in the layout, and each run starts half the processes of four nodes.
TWO_STEPS = [*FAST, "workload.num_steps=2", "cluster.num_nodes=2"]


# -- helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real two-step run (a checkpoint after each step: step_000001, step_000002)."""
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    proc = gyre_run(run_dir, *TWO_STEPS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A copy of the finished run to break (the original stays whole for other tests)."""
    return Path(shutil.copytree(finished_run, tmp_path / "run", symlinks=True))


@contextmanager
def tmpfs(path: Path, size: str):
    """A real small file system at `path` (see the module docstring)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, (f"these tests inject a real disk full with a small tmpfs "
                                  f"and need the right to mount one: {proc.stderr}")
    try:
        yield lambda new_size: subprocess.run(
            ["mount", "-o", f"remount,size={new_size}", str(path)], check=True)
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def segment_of(run_dir: Path) -> Path:
    (seg,) = sorted((run_dir / "calls").glob("*.seg"))
    return seg


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def garble(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def line_offsets(path: Path) -> list[int]:
    data, offsets, pos = path.read_bytes(), [], 0
    while (end := data.find(b"\n", pos)) >= 0:
        offsets.append(pos)
        pos = end + 1
    return offsets


def check_resumed_run(run_dir: Path, *, num_steps: int) -> list[dict]:
    """tests/runtime_checks.check_run_dir, for a run that resumed from an older
    checkpoint than its last (so it trained a step again): every started run ended (or a
    later attempt did), every ok run's trajectories trained exactly once (the stream of
    steps past the checkpoint was dropped and trained again), the steps after the last
    resumed start run on from its version, and the last checkpoint verifies."""
    check_runs_trained_once(run_dir)
    events = list(read_jsonl(run_dir / "events.jsonl"))
    last = max(i for i, e in enumerate(events) if e["kind"] == "start")
    assert events[last]["resume"]
    steps = [e["step"] for e in events[last:] if e["kind"] == "step"]
    assert steps == list(range(events[last]["version"], num_steps))
    check_steps_in_order(events, num_steps=num_steps)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["final"] and status["version"] == num_steps
    choice = checkpoint.choose_checkpoint(run_dir)
    assert choice.chosen.version == num_steps and choice.chosen.checksummed
    return events


# -- 4. torn or corrupted files --------------------------------------------------------
def test_torn_and_corrupt_call_records_are_reported_with_their_offsets(run_copy, caplog):
    seg = segment_of(run_copy)
    before = load_store(run_copy)
    assert not before.errors
    records = CallStoreReader(run_copy).poll(final=True).calls
    (d1, _, off1), (d2, _, off2) = records[3], records[len(records) // 2]
    last, _, off_last = records[-1]
    runs_hit = {d1.run_id, d2.run_id, last.run_id}
    garble(seg, off1, b"\0" * 4)  # record header magic gone: whose record is unknown
    garble(seg, off2 + 40, b"\xff\xff")  # body bytes changed: CRC mismatch
    size = seg.stat().st_size
    assert size - off_last > 120  # cut after its run id: the torn record names its run
    os.truncate(seg, (off_last + size) // 2)  # the last record cut: a crash mid-write
    with caplog.at_level(logging.WARNING):
        # A live reader: the torn tail may still be being written, so it waits for it;
        # the corruption before it is reported now, with the segment and offset.
        buf = RunBuffer(run_copy)
        unknown = buf.poll()
    assert [(t.file, t.offset, t.reason) for t in unknown] == \
        [(str(seg), off1, "bad record header")]
    assert f"offset {off1}" in caplog.text and str(seg) in caplog.text
    taken = buf.take(d2.run_id)
    assert d2.run_id not in taken.runs
    assert [(e.where, e.reason.split(" (")[0]) for e in taken.errors] == \
        [(f"offset {off2}", "CRC mismatch")]
    # The whole store, read after the job: every fault named; the other runs untouched.
    after = load_store(run_copy)
    wheres = {(e.where, e.file) for e in after.errors}
    assert {(f"offset {o}", str(seg)) for o in (off1, off2, off_last)} == wheres
    assert any("torn record" in e.reason and e.run_id == last.run_id for e in after.errors)
    assert set(after.runs) == set(before.runs) - runs_hit
    for rid in after.runs:
        assert [c.call for c in after.runs[rid]] == [c.call for c in before.runs[rid]]


def test_a_corrupt_middle_line_is_reported_a_torn_last_line_skipped_quietly(run_copy,
                                                                            caplog, gyre):
    runs = run_copy / "runs" / "runs.jsonl"
    offsets = line_offsets(runs)
    good = list(read_jsonl(runs))
    garble(runs, offsets[2] + 5, b"\0" * 12)  # line 3, as a crash leaves a block of zeros
    with open(runs, "ab") as f:
        f.write(b'{"run_id": "s0009-p0')  # a writer killed mid-line
    bad = []
    with caplog.at_level(logging.DEBUG):
        got = list(read_jsonl(runs, on_bad=bad.append))
    assert got == good[:2] + good[3:]  # never the garbled one, never the torn one
    (b,) = bad
    assert (b.path, b.line, b.offset) == (str(runs), 3, offsets[2])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{b}: skipped"] and f"line 3 (byte offset {offsets[2]})" in str(b)
    # An append after a torn line starts a line of its own (it stays whole) ...
    append_jsonl(runs, {"run_id": "after"})
    assert list(read_jsonl(runs))[-1] == {"run_id": "after"}
    # ... and resume cuts a torn tail off before appending (`drop_torn_tail`).
    events = run_copy / "events.jsonl"
    size = events.stat().st_size
    with open(events, "ab") as f:
        f.write(b'{"kind": "st')
    assert drop_torn_tail(events) == (size, 12) and events.stat().st_size == size
    # The monitor: a corrupt events.jsonl line is skipped and said, with line and offset.
    ev_offsets = line_offsets(events)
    garble(events, ev_offsets[4], b"#")
    tail = model.EventTail(events)
    assert len(tail.poll()) == len(ev_offsets) - 1
    assert [(x.line, x.offset) for x in tail.bad] == [(5, ev_offsets[4])]
    out = gyre("status", str(run_copy), "--once").stdout
    assert "version 2/2" in out
    assert f"corrupt line skipped: {events}: line 5 (byte offset {ev_offsets[4]})" \
        in " ".join(out.split())


def test_a_garbled_status_json_never_crashes_the_monitor(run_copy, gyre):
    status = run_copy / "status.json"
    reader = model.StatusReader(run_copy)
    assert reader.read()["version"] == 2 and reader.error is None
    garble(status, 30, b"\0garbage\0")
    assert reader.read()["version"] == 2  # the live view keeps the last good status
    assert reader.error.startswith(f"{status}: garbled")
    snap = model.load(run_copy, status=reader)
    assert snap.status["version"] == 2 and "showing the last good status" in snap.problems[0]
    once = gyre("status", str(run_copy), "--once")  # a fresh look: no good status yet
    text = " ".join(once.stdout.split())
    assert f"warning: {status}: garbled" in text and "waiting for status.json" in text
    js = gyre("status", str(run_copy), "--json", check=False)
    assert js.returncode == 2 and f"{status}: garbled" in js.stderr
    assert "Traceback" not in once.stderr + js.stderr


def test_json_nested_too_deep_is_a_corrupt_line_or_a_garbled_status(run_copy, gyre):
    """A line (or status.json) nested past what Python decodes is garbled data like any
    other, skipped or reported: before, the RecursionError escaped every reader (resume,
    the monitor, gyre report)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    runs = run_copy / "runs" / "runs.jsonl"
    good = list(read_jsonl(runs))
    with open(runs, "ab") as f:
        f.write(deep + b"\n")
    append_jsonl(runs, {"run_id": "after"})
    bad = []
    assert list(read_jsonl(runs, on_bad=bad.append)) == good + [{"run_id": "after"}]
    assert len(bad) == 1 and "recursion" in bad[0].reason
    # an integer past Python's 4,300 digits: a plain ValueError, not a JSONDecodeError
    with open(runs, "ab") as f:
        f.write(b'{"run_id": "huge", "reward": 1' + b"0" * 5000 + b"}\n")
    append_jsonl(runs, {"run_id": "later"})
    bad = []
    assert [r["run_id"] for r in read_jsonl(runs, on_bad=bad.append)][-2:] == ["after", "later"]
    assert len(bad) == 2 and "4300 digits" in bad[1].reason
    (run_copy / "status.json").write_bytes(deep)
    js = gyre("status", str(run_copy), "--json", check=False)
    assert js.returncode == 2 and "garbled" in js.stderr and "Traceback" not in js.stderr


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip(path: Path) -> None:
    garble(path, path.stat().st_size // 2, b"\xa5\x5a")


def _garbage(path: Path) -> None:
    garble(path, 0, b"\x00{garbage")  # same size: only the checksum can tell


def _legacy_garbage(path: Path) -> None:
    (path.parent / "manifest.json").unlink()  # as written before manifests existed
    _garbage(path)


FAULTS = {  # what is broken -> (file, how, words the rejection must say)
    "trainer.pt truncated": ("step_000002/trainer.pt", _truncate,
                             "trainer.pt is {half} bytes, manifest.json says {size} "
                             "(truncated at byte offset {half})"),
    "trainer.pt missing": ("step_000002/trainer.pt", Path.unlink,
                           "trainer.pt is missing (listed in manifest.json)"),
    "trainer.pt bytes changed": ("step_000002/trainer.pt", _flip,
                                 "trainer.pt: sha256 differs from manifest.json"),
    "coordinator.json garbage": ("step_000002/coordinator.json", _garbage,
                                 "coordinator.json: sha256 differs from manifest.json"),
    "coordinator.json garbage, no manifest": ("step_000002/coordinator.json", _legacy_garbage,
                                              "coordinator.json is garbled ("),
    "manifest garbled": ("step_000002/manifest.json", _truncate, "manifest.json is garbled"),
    "weights truncated": ("../weights/v000002/model.safetensors", _truncate,
                          "is of policy version 2, whose weights are unusable: "
                          "{path}: {half} bytes but its header describes {size} "
                          "(truncated at byte offset {half})"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_checkpoint_that_does_not_verify_is_rejected_for_the_one_before(run_copy, fault):
    where, how, words = FAULTS[fault]
    path = (run_copy / "checkpoints" / where).resolve()
    size = path.stat().st_size
    how(path)
    words = words.format(path=path, size=size, half=size // 2)
    choice = checkpoint.choose_checkpoint(run_copy)
    assert choice.latest == "step_000002"
    assert choice.chosen.path.name == "step_000001" and choice.chosen.version == 1
    ((bad, why),) = choice.rejected
    assert bad.name == "step_000002" and words in why and str(path.parent) in why


def test_a_garbled_latest_falls_back_to_the_newest_checkpoint_that_verifies(run_copy):
    (run_copy / "checkpoints" / "latest").write_bytes(b"\x00\x00step_0")
    choice = checkpoint.choose_checkpoint(run_copy)
    assert choice.latest is None and "latest is garbled" in choice.latest_raw
    assert choice.chosen.path.name == "step_000002"


def test_a_truncated_weights_file_is_refused_before_loading(run_copy):
    weights = tiny.weights_dir(run_copy, 1)
    size = (weights / tiny.WEIGHTS_FILE).stat().st_size
    os.truncate(weights / tiny.WEIGHTS_FILE, size - 1000)
    m = tiny.new_model(run_copy / "model")
    with pytest.raises(tiny.CorruptWeights, match=f"{weights / tiny.WEIGHTS_FILE}: {size - 1000} "
                       f"bytes but its header describes {size} "
                       rf"\(truncated at byte offset {size - 1000}\)"):
        tiny.load_weights(m, weights)
    os.truncate(weights / tiny.WEIGHTS_FILE, 100)
    with pytest.raises(tiny.CorruptWeights, match="100 bytes, truncated at byte offset 100, "
                       "inside its [0-9]+-byte header"):
        tiny.load_weights(m, weights)


@pytest.mark.slow
def test_resume_falls_back_from_a_half_written_checkpoint_and_skips_garbled_records(
        run_copy):
    ckpt = run_copy / "checkpoints"
    os.truncate(ckpt / "step_000002" / "trainer.pt", 1_000_000)
    runs = run_copy / "runs" / "runs.jsonl"
    records = list(read_jsonl(runs))
    line = next(i for i, r in enumerate(records[:-1]) if r["step"] == 1)  # a replayed run
    lost = records[line]["run_id"]
    garble(runs, line_offsets(runs)[line] + 2, b"\0" * 16)
    with open(run_copy / "events.jsonl", "ab") as f:
        f.write(b'{"kind": "step", "t": 17')  # the old job died mid-line (24 bytes)
    old_secret = (run_copy / "secret").read_text()
    (run_copy / "secret").unlink()  # copied without it: the resumed job makes a new one
    proc = gyre_run(run_copy, resume=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_copy / "secret").read_text() != old_secret
    assert f"checkpoint {ckpt / 'step_000002'} rejected: {ckpt / 'step_000002'}/trainer.pt " \
           f"is 1000000 bytes, manifest.json says 2396241" in proc.stderr
    assert "falling back from step_000002 to step_000001" in proc.stderr
    assert f"{runs}: line {line + 1} (byte offset {line_offsets(runs)[line]})" in proc.stderr
    (fallback,) = events_of(run_copy, "resume_fallback")
    assert fallback["to"] == "step_000001" and fallback["latest"] == "step_000002"
    (rejected,) = events_of(run_copy, "checkpoint_rejected")
    assert rejected["path"] == str(ckpt / "step_000002") and "truncated" in rejected["reason"]
    (corrupt,) = events_of(run_copy, "corrupt_line")
    assert (corrupt["path"], corrupt["line"]) == (str(runs), line + 1)
    (torn,) = events_of(run_copy, "torn_tail_dropped")
    assert torn["path"] == str(run_copy / "events.jsonl") and torn["bytes"] == 24
    assert (ckpt / ".rejected-step_000002").is_dir()  # kept for a look, out of the way
    check_resumed_run(run_copy, num_steps=2)
    ended = {r["run_id"] for r in read_jsonl(runs)}
    assert lost not in ended and f"{lost}-a1" in ended  # its record unusable: it ran again


def test_resume_makes_a_missing_or_empty_secret_anew_and_the_state_private(tmp_path):
    """A run dir copied or cleaned without its secret, or with it emptied, or with looser
    modes: --resume makes a new secret (0600; every process holding one starts with the
    job) and puts back the owner-only modes. Before, a missing secret was a traceback and
    an empty one let `Authorization: Bearer ` through."""
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    Coordinator(cfg, run_dir).prepare_run_dir()
    secret = run_dir / "secret"
    first = secret.read_text()
    for damage in (secret.unlink, lambda: secret.write_text("\n")):
        damage()
        os.chmod(run_dir / "checkpoints", 0o755)
        Coordinator(cfg, run_dir, resume=True).prepare_run_dir()
        new = secret.read_text()
        assert len(new) == 64 and new != first and RunDir(run_dir).secret() == new
        assert secret.stat().st_mode & 0o777 == 0o600
        assert (run_dir / "checkpoints").stat().st_mode & 0o777 == 0o700
        first = new
    secret.write_text("")  # emptied under a running job: its processes refuse it plainly
    with pytest.raises(UserError, match="is empty: the job's processes cannot authenticate"):
        RunDir(run_dir).secret()


RUN_DIR_DAMAGE = {  # what is damaged -> (how, what the refusal says)
    "model dir": (lambda d: shutil.rmtree(d / "model"), "model: no config.json"),
    "model config": (lambda d: (d / "model" / "config.json").write_text("{["),
                     "config.json does not read as a model config"),
    "tokenizer": (lambda d: [f.unlink() for f in (d / "model").glob("tokenizer*")],
                  "no tokenizer (tokenizer.json or tokenizer_config.json)"),
    "v0 weights": (lambda d: os.truncate(tiny.weights_dir(d, 0) / tiny.WEIGHTS_FILE, 100),
                   "the policy's version 0 (the training ranks' initial weights)"),
}


@pytest.mark.parametrize("damage", list(RUN_DIR_DAMAGE))
def test_resume_of_a_run_dir_without_its_model_files_is_a_clear_error(run_copy, damage):
    """The run's model (config, tokenizer) and its version-0 weights are read by every
    engine, rank and the gateway: missing or garbled, --resume is refused (exit 2,
    naming the file and how to restore it) before anything starts. Before, an engine or
    rank failed with a traceback (an OSError from transformers, a JSONDecodeError, an
    engine start answered 500)."""
    how, words = RUN_DIR_DAMAGE[damage]
    how(run_copy)
    events = (run_copy / "events.jsonl").read_bytes()
    proc = gyre_run(run_copy, resume=True, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gyre run: error: --resume: " in proc.stderr and words in proc.stderr
    assert "restore it from the run dir's copy" in proc.stderr
    assert "Traceback" not in proc.stderr and "failed after" not in proc.stdout
    assert (run_copy / "events.jsonl").read_bytes() == events  # nothing started


def test_resume_with_no_checkpoint_that_verifies_is_a_clear_error(run_copy):
    ckpt = run_copy / "checkpoints"
    os.truncate(ckpt / "step_000002" / "trainer.pt", 10)
    (ckpt / "step_000001" / "coordinator.json").write_text("{}")
    proc = gyre_run(run_copy, resume=True, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"gyre run: error: --resume: no checkpoint in {ckpt} verifies:" in proc.stderr
    assert "step_000002: " in proc.stderr and "trainer.pt is 10 bytes" in proc.stderr
    assert "step_000001: " in proc.stderr and "coordinator.json is 2 bytes" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (ckpt / "latest").read_text() == "step_000002"  # nothing touched
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001", "step_000002"]


# -- 5. disk full ----------------------------------------------------------------------
@pytest.mark.slow
def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    """checkpoints/ on a 4 MiB tmpfs: step_000001 (2.3 MiB) fits, step_000002 does not."""
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "checkpoints", "4m") as resize:
        proc = gyre_run(run_dir, *TWO_STEPS)
        assert proc.returncode == 2, proc.stderr[-4000:]
        ckpt = run_dir / "checkpoints"
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith(f"gyre run: error: disk full: writing checkpoint step_000002 "
                              f"at {ckpt}/.tmp-step_000002")
        assert "needed about 2.3 MiB" in err and f"free on {ckpt} (tmpfs)" in err
        assert f"free space on {ckpt}, then continue with --resume" in err
        assert "checkpoints/latest still names step_000001 (untouched)" in err
        # The previous checkpoint whole and named by latest; nothing half-written left.
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001"]
        assert checkpoint.verify_checkpoint(ckpt / "step_000001", run_dir).version == 1
        (event,) = events_of(run_dir, "disk_full")
        assert event["needed"] > 2_000_000 and event["mount"] == str(ckpt)
        resize("16m")  # space freed
        resumed = gyre_run(run_dir, resume=True)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        check_resumed_run(run_dir, num_steps=2)


def test_disk_full_in_the_call_store_never_leaves_half_a_call(tmp_path):
    """The gateway's writer on a 16 KiB tmpfs: appends until the kernel says ENOSPC."""
    run_dir = tmp_path / "run"
    calls = [mk_call(0, [1, 2, 3], list(range(100 + i, 200 + i)), run_id=f"r{i}")
             for i in range(40)]
    with tmpfs(run_dir / "calls", "16k") as resize:
        (run_dir / "calls" / "note").write_bytes(b"old")  # a page of its own
        writer = CallStoreWriter(run_dir, "gateway-1", fsync_interval_s=0)
        stored = 0
        with pytest.raises(DiskFull) as info:
            for c in calls:
                writer.append(c)
                stored += 1
        seg = writer.path
        msg = str(info.value)
        assert msg.startswith(f"disk full: recording call 0 of run 'r{stored}' at {seg} "
                              f"([Errno 28] No space left on device): needed about")
        assert f"free on {run_dir / 'calls'} (tmpfs); free space on {run_dir / 'calls'}" in msg
        # Cut back to the last whole record: the segment holds exactly the calls stored.
        assert seg.stat().st_size == writer.num_bytes
        loaded = load_store(run_dir)
        assert not loaded.errors and sorted(loaded.runs) == sorted(f"r{i}" for i in range(stored))
        with pytest.raises(DiskFull):  # failed for good: no later call slips in
            writer.append(calls[-1])
        assert writer.error is info.value
        writer.close()
        # An atomic write on the full file system: the old file stays, no temp file left.
        with pytest.raises(DiskFull, match="disk full: writing note"):
            write_bytes_atomic(run_dir / "calls" / "note", b"x" * 20000)
        assert (run_dir / "calls" / "note").read_bytes() == b"old"
        assert sorted(p.name for p in (run_dir / "calls").iterdir()) == ["gateway-1.seg", "note"]
        # Space freed; a resumed job's writer (a new segment) records the rest.
        resize("1m")
        with CallStoreWriter(run_dir, "gateway-2") as again:
            for c in calls[stored:]:
                again.append(c)
        loaded = load_store(run_dir)
        assert not loaded.errors and len(loaded.runs) == len(calls)


@pytest.mark.slow
def test_disk_full_in_the_call_store_stops_the_run_and_resume_loses_nothing(tmp_path):
    """calls/ on a 4 KiB tmpfs: the gateway's segment fills during the first steps."""
    run_dir = tmp_path / "run"
    with tmpfs(run_dir / "calls", "4k") as resize:
        proc = gyre_run(run_dir, *TWO_STEPS, timeout_s=240)
        assert proc.returncode == 2, proc.stderr[-4000:]
        err = proc.stderr.strip().splitlines()[-1]
        seg = segment_of(run_dir)
        assert err.startswith("gyre run: error: disk full: recording call ")
        assert f"at {seg} ([Errno 28] No space left on device)" in err
        assert f"free space on {run_dir / 'calls'}" in err
        before = load_store(run_dir)
        assert not before.errors  # only whole calls in the segment
        records = list(read_jsonl(run_dir / "runs" / "runs.jsonl"))
        assert all(r["status"] == "ok" for r in records)  # no run failed for our disk
        resize("1m")
        resumed = gyre_run(run_dir, resume=True)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        check_resumed_run(run_dir, num_steps=2)
        after = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}
        assert {r["run_id"] for r in records} <= after
        kept = load_store(run_dir)
        for rid, calls in before.runs.items():  # every call recorded before is still there
            assert Counter(c.call for c in kept.runs[rid]) == Counter(c.call for c in calls)


@pytest.mark.parametrize("change, words", [
    ("workload.num_steps=1", "--set workload.num_steps=1: the run has trained 2 steps"),
    ("model.heads=2", "--resume cannot change model.heads (model.heads: 4 -> 2)"),
    ("workload.group_size=3", "--resume cannot change workload.group_size"),
])
def test_resume_refuses_a_change_the_run_dirs_state_cannot_take(run_copy, change, words):
    """`--set` on resume changes the run from there on (config.yaml is rewritten, which
    every process reads); but not what the recorded state was made of, nor fewer steps
    than were trained (the run would end at once, its config saying it had run fewer).
    Refused before anything starts; config.yaml untouched."""
    config = (run_copy / "config.yaml").read_bytes()
    proc = gyre_run(run_copy, change, resume=True, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "gyre run: error: " in proc.stderr and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert (run_copy / "config.yaml").read_bytes() == config


@pytest.mark.slow
def test_a_job_killed_while_it_makes_its_run_dir_starts_again_as_the_batch_script_would(
        tmp_path):
    """Preempted in its first seconds, a job had written config.yaml and not yet its
    model: the requeued job (config.yaml there: --resume) was refused for the missing
    model, every time. config.yaml is now written last: at the kill it is there only
    with the model and the first weights. What the batch script does next (resume if
    config.yaml is there, else start afresh) finishes the run; --resume of a run dir
    without it says to start it again."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir), "--set", "workload.num_steps=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (run_dir / "secret").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()  # the coordinator only: no node agent starts before the run dir is made
    proc.wait()
    if (run_dir / "config.yaml").exists():
        assert (run_dir / "model" / "config.json").is_file()
        assert (run_dir / "weights" / "v000000" / "model.safetensors").is_file()
        again = gyre_run(run_dir, resume=True)
    else:
        refused = gyre_run(run_dir, resume=True, timeout_s=60)
        assert refused.returncode == 2 and "its first start stopped before the run was " \
            "made" in refused.stderr, refused.stderr[-2000:]
        again = gyre_run(run_dir, "workload.num_steps=1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["final"]
