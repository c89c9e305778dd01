"""One coordinator per run dir: `RUN_DIR/coordinator.lock`.

Two coordinators on one run dir (a `gyre run --resume` by hand while the Slurm job still
runs, or waits to be requeued; the same command started twice) would both append to the
call store and the events, and write the same checkpoints. The lock is a file created
with O_EXCL (atomic on Lustre and any local filesystem; flock is not: Lustre mounts
without `-o flock` refuse it), holding who holds it: host, pid, Slurm job id, a random
token. Its holder touches it every `TOUCH_S` from a thread of its own (the event loop
may be busy for seconds) and removes it when the job ends.

A lock found in place is taken over, never waited for, when it is stale:
- its job id is this process's SLURM_JOB_ID: a requeued job's earlier run (Slurm keeps
  the id; the killed coordinator never removed its lock);
- it names this host and a pid that is gone (a coordinator killed with SIGKILL);
- it was not touched for `STALE_S` (its holder is gone from another host, or frozen).
Else the run is refused (exit 2) naming the holder and how to go on. A holder that finds
its lock taken over (it was frozen longer than `STALE_S`) is told through `on_lost`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gyre_slurm.common.fsio import write_bytes_atomic
from gyre_slurm.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = "coordinator.lock"
TOUCH_S = 10.0
STALE_S = 120.0


class RunDirBusy(UserError):
    """Another coordinator holds the run dir."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class RunLock:
    def __init__(self, run_dir: Path, *, on_lost: Callable[[str], None] | None = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.on_lost = on_lost
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "job": os.environ.get("SLURM_JOB_ID"), "token": secrets.token_hex(8),
                   "since": round(time.time(), 3)}
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    # -- taking it ---------------------------------------------------------------------
    def acquire(self) -> None:
        body = json.dumps(self.me).encode()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder, age = self._holder()
            why = self._stale(holder, age)
            if why is None:
                raise RunDirBusy(self._busy_message(holder, age)) from None
            log.warning("run dir lock %s: taking it over (%s)", self.path, why)
            write_bytes_atomic(self.path, body)
            time.sleep(0.2)  # a contender that took it over at the same moment shows now
            if self._holder()[0].get("token") != self.me["token"]:
                raise RunDirBusy(self._busy_message(*self._holder())) from None
        except OSError as exc:  # read-only, no permission, no such folder
            raise UserError(f"cannot make {self.path} ({exc.strerror}): the run dir must be "
                            f"a folder this user can write on a filesystem mounted "
                            f"read-write (the job writes its calls, events and "
                            f"checkpoints there)") from None
        else:
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
        self._keeper = threading.Thread(target=self._keep, name="run-lock", daemon=True)
        self._keeper.start()

    def _holder(self) -> tuple[dict, float]:
        """What the lock says (empty if unreadable: its writer died mid-write) and how
        long ago it was last touched."""
        try:
            age = time.time() - self.path.stat().st_mtime
            holder = json.loads(self.path.read_bytes() or b"{}")
        except FileNotFoundError:
            return {}, float("inf")
        except (OSError, ValueError):
            return {}, age
        return (holder if isinstance(holder, dict) else {}), age

    def _stale(self, holder: dict, age: float) -> str | None:
        """Why a lock found in place may be taken over; None: it is held."""
        if age > STALE_S:
            return f"not touched for {age:.0f} s"
        job = holder.get("job")
        if job and job == self.me["job"]:
            return f"left by an earlier run of Slurm job {job} (requeued)"
        pid = holder.get("pid")
        if holder.get("host") == self.me["host"] and isinstance(pid, int) and \
                not _pid_alive(pid):
            return f"its coordinator (pid {pid} on this host) is gone"
        return None

    def _busy_message(self, holder: dict, age: float) -> str:
        job = holder.get("job")
        who = (f"pid {holder.get('pid')} on {holder.get('host')}"
               + (f", Slurm job {job}" if job else "")) if holder else "an unreadable lock"
        wait = max(0.0, STALE_S - age)
        return (f"{self.path.parent} is in use by another coordinator ({who}; its lock "
                f"{self.path.name} was touched {age:.0f} s ago): two would write the same "
                f"calls, events and checkpoints. Wait for that job to end"
                + (f" (scancel {job})" if job else "") + "; if it is gone, the lock is "
                f"taken over {wait:.0f} s from now, or remove {self.path}")

    # -- holding it --------------------------------------------------------------------
    def _keep(self) -> None:
        while not self._stop.wait(TOUCH_S):
            holder, _ = self._holder()
            if holder.get("token") != self.me["token"]:
                why = (f"the run dir's lock {self.path} was taken over by "
                       f"{holder.get('host')} pid {holder.get('pid')} (this coordinator "
                       f"did not touch it for {STALE_S:.0f} s): stopping")
                log.error(why)
                if self.on_lost is not None:
                    self.on_lost(why)
                return
            try:
                os.utime(self.path)
            except OSError as exc:  # a filesystem hiccup: the next touch may pass
                log.warning("run dir lock %s: cannot touch it: %s", self.path, exc)

    def release(self) -> None:
        """Stop touching it and remove it, if it is still ours."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        if self._holder()[0].get("token") == self.me["token"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
