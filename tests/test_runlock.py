"""One coordinator per run dir (gyre_slurm/runtime/runlock.py): the lock file's rules in
process (a held lock, a stale one of each kind, a holder that finds its lock taken
over), then two real `gyre run`s on one run dir."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gyre_slurm.runtime import runlock
from gyre_slurm.runtime.runlock import LOCK_FILE, RunDirBusy, RunLock

ROOT = Path(__file__).resolve().parent.parent


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(run_dir: Path, *, age_s: float = 0.0, **holder) -> Path:
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps(holder))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


@pytest.fixture
def lock(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    made = []

    def make(**kw):
        made.append(RunLock(tmp_path, **kw))
        return made[-1]

    yield make
    for held in made:
        held.release()


def test_a_lock_is_taken_held_and_removed(lock, tmp_path):
    first = lock()
    first.acquire()
    held = json.loads((tmp_path / LOCK_FILE).read_text())
    assert held["pid"] == os.getpid() and held["token"] == first.me["token"]
    with pytest.raises(RunDirBusy) as err:
        lock().acquire()  # this very process again: alive, on this host
    assert f"is in use by another coordinator (pid {os.getpid()} on " in str(err.value)
    assert f"or remove {tmp_path / LOCK_FILE}" in str(err.value)
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    lock().acquire()


@pytest.mark.parametrize("holder, age_s, taken", [
    ({"host": "elsewhere", "pid": 1, "job": "77"}, 5, False),  # alive elsewhere
    ({"host": "elsewhere", "pid": 1, "job": "77"}, runlock.STALE_S + 5, True),  # silent
    ({"host": "elsewhere", "pid": 1, "job": "41"}, 5, True),  # our own job, requeued
    ({}, 5, False),  # unreadable (its writer died mid-write), touched lately
    ({}, runlock.STALE_S + 5, True),
])
def test_a_lock_found_in_place_is_taken_over_only_when_stale(lock, tmp_path, monkeypatch,
                                                             holder, age_s, taken):
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    plant(tmp_path, age_s=age_s, **holder)
    mine = lock()
    if taken:
        mine.acquire()
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == mine.me["token"]
    else:
        with pytest.raises(RunDirBusy, match="is in use by another coordinator"):
            mine.acquire()


def test_a_run_dir_where_no_lock_can_be_made_is_a_clear_error(lock, tmp_path):
    """A run dir on a read-only mount (or another user's): --resume ended with an OSError
    traceback at the lock."""
    from gyre_slurm.errors import UserError

    mine = RunLock(tmp_path / "missing")
    with pytest.raises(UserError, match=r"cannot make .*coordinator.lock \(No such file or "
                                        r"directory\): the run dir must be a folder this user"):
        mine.acquire()


def test_a_lock_of_a_dead_pid_on_this_host_is_taken_over_at_once(lock, tmp_path):
    import socket

    plant(tmp_path, host=socket.gethostname(), pid=dead_pid(), job=None)
    lock().acquire()


def test_a_holder_whose_lock_was_taken_over_is_told(lock, tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "TOUCH_S", 0.05)
    told = threading.Event()
    mine = lock(on_lost=lambda why: told.set())
    mine.acquire()
    plant(tmp_path, host="elsewhere", pid=1, job="9", token="theirs")
    assert told.wait(5)
    mine.release()  # not ours any more: left in place
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs"


@pytest.mark.slow
def test_a_second_gyre_run_on_a_running_run_dir_is_refused(tmp_path):
    """A `gyre run --resume` by hand while the job runs (in a Slurm job: while it waits
    to be requeued too) is refused, touching nothing; the running job ends normally and
    removes its lock."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SLURM_JOB_ID", None)
    first = subprocess.Popen([sys.executable, "-m", "gyre_slurm", "run",
                              str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir),
                              "--set", "workload.num_steps=3"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "events.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        events = (run_dir / "events.jsonl").read_bytes()
        second = subprocess.run([sys.executable, "-m", "gyre_slurm", "run", "--resume",
                                 "--run-dir", str(run_dir)], env=env, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"{run_dir} is in use by another coordinator (pid {first.pid} on " \
            in second.stderr
        assert "Traceback" not in second.stderr
        assert (run_dir / "events.jsonl").read_bytes()[:len(events)] == events
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert not (run_dir / LOCK_FILE).exists()
