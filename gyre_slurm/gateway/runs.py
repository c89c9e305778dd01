"""Who may call which run: per-run keys, the run lifecycle, and the external mode.

Pure bookkeeping (no I/O; the clock is passed in), used by the gateway on its event
loop thread.

- A run the coordinator starts is `open`ed: it gets its own random key, valid only on
  its own URL (`/runs/<run_id>/...`) and only until `end` (the run's end, timeout or
  restart), which revokes it. The job secret is never a gateway key.
- External mode (off unless `ExternalPolicy` is given): a client holding the external
  key may call `/runs/<prefix><anything>/...`; the first call registers that run.
  External runs never take a job run's id (their ids carry `prefix`, which job ids
  never do), at most `max_runs` are live at once (more: refused), and each ends, and
  is freed, when it asks (`POST /runs/<id>/end`), after `idle_timeout_s` without a call,
  or `max_run_s` after it began (a call in flight finishes first). An ended external
  id is not reused while it is among the last `TOMBSTONES` ended (its call numbers
  would repeat). Memory: bounded by `max_runs` live runs and the tombstones.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

KEY_PREFIX = "gyre-run-"
TOMBSTONES = 65_536


@dataclass(frozen=True)
class ExternalPolicy:
    """Runs the coordinator did not start: who (the key), which ids, how many, how long."""

    key: str
    prefix: str = "ext-"
    max_runs: int = 64
    idle_timeout_s: float = 600.0
    max_run_s: float = 7200.0

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("the external key must be at least 16 characters")
        if self.max_runs < 1 or self.idle_timeout_s <= 0 or self.max_run_s <= 0:
            raise ValueError("max_runs, idle_timeout_s and max_run_s must be > 0")


@dataclass
class RunState:
    run_id: str
    key: bytes | None  # b"Bearer <key>" (a job run); None: external (the external key)
    external: bool
    t_open: float
    t_last: float
    in_flight: int = 0
    server_errors: int = 0  # calls failed by a rollout server (502/503)
    ending: bool = False  # an external run past its time: ends when its calls are done
    max_calls: int | None = None  # model calls (choices) it may make, recorded or in flight
    reserved: int = 0  # choices of its calls in flight


class Refused(Exception):
    """A request the registry refuses: `status` (401, 409, 429) and a message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class RunRegistry:
    external: ExternalPolicy | None = None
    runs: dict[str, RunState] = field(default_factory=dict)
    ended: OrderedDict = field(default_factory=OrderedDict)  # external tombstones

    def open(self, run_id: str, *, now: float, max_calls: int | None = None) -> str:
        """A job run starts: its new key (replacing any earlier one of that id); at most
        `max_calls` model calls (None: no limit here)."""
        if self.is_external_id(run_id):
            raise ValueError(f"run id {run_id!r} carries the external prefix "
                             f"{self.external.prefix!r}")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        self.runs[run_id] = RunState(run_id, f"Bearer {key}".encode(), False, now, now,
                                     max_calls=max_calls)
        return key

    def end(self, run_id: str) -> RunState | None:
        state = self.runs.pop(run_id, None)
        if state is not None and state.external:
            self.ended[run_id] = None
            while len(self.ended) > TOMBSTONES:
                self.ended.popitem(last=False)
        return state

    def is_external_id(self, run_id: str) -> bool:
        return self.external is not None and run_id.startswith(self.external.prefix)

    def admit(self, run_id: str, auth: bytes, *, now: float) -> RunState:
        """The run a request to `run_id` with header `auth` (raw bytes) may use, or
        `Refused`. Registers an external run on its first call."""
        state = self.runs.get(run_id)
        if state is not None and state.key is not None \
                and hmac.compare_digest(auth, state.key):
            return state
        ext = self.external
        if ext is None or not hmac.compare_digest(auth, f"Bearer {ext.key}".encode()):
            raise Refused(401, "missing or wrong API key for this run ('Authorization: "
                          "Bearer <the run's key>')")
        if not self.is_external_id(run_id):
            raise Refused(401, f"the external key opens only runs whose id starts with "
                          f"{ext.prefix!r}, not {run_id!r}")
        if state is not None:
            if state.ending:
                raise Refused(409, f"external run {run_id!r} is ending (idle or past its "
                              f"{ext.max_run_s:g} s); use a new run id")
            return state
        if run_id in self.ended:
            raise Refused(409, f"external run {run_id!r} has ended; use a new run id")
        live = sum(1 for s in self.runs.values() if s.external)
        if live >= ext.max_runs:
            raise Refused(429, f"{live} external runs are live, the most allowed "
                          f"(max_runs); end one (POST /runs/<id>/end) or wait for one "
                          f"to time out after {ext.idle_timeout_s:g} s idle")
        state = RunState(run_id, None, True, now, now)
        self.runs[run_id] = state
        return state

    def expired(self, now: float) -> list[str]:
        """External runs to end now: idle (no call in flight, none for
        `idle_timeout_s`) or past `max_run_s`, with no call in flight (those past their
        time with calls in flight are marked `ending`: no new call is admitted). A call
        that runs longer than the idle timeout does not make its run idle."""
        ext, out = self.external, []
        if ext is None:
            return out
        for s in self.runs.values():
            if not s.external:
                continue
            idle = s.in_flight == 0 and now - s.t_last > ext.idle_timeout_s
            if now - s.t_open > ext.max_run_s or idle:
                s.ending = True
            if s.ending and s.in_flight == 0:
                out.append(s.run_id)
        return out

    def stats(self) -> dict[str, int]:
        ext = sum(1 for s in self.runs.values() if s.external)
        return {"job_runs": len(self.runs) - ext, "external_runs": ext,
                "ended_external": len(self.ended)}
