"""Reading a run dir and deriving what the monitor shows.

Inputs (written by the coordinator, see gyre_slurm/runtime/rundir.py):
  status.json   rewritten atomically ~1/s; may be missing (job not started): then
                `status` is None. If it cannot be read or parsed (garbled), the monitor
                never crashes: `StatusReader` keeps the last good status (or None) and
                `Snapshot.status_error` says what is wrong (path, line/column or size);
                the same for one whose fields are not of the types gyre writes
                (`status_error`: the first field that does not fit).
  events.jsonl  append-only; each line {"t": unix time, "kind": ...}. A torn last line is
                skipped (it is read again once complete); a corrupt line before it is
                skipped and reported in `Snapshot.problems` (path, line, byte offset),
                and so is an event whose fields are not of the types gyre writes
                (`event_error`: no kind, a time that is not a finite number, a
                handoff's cells that are not cell numbers, ...).
                Run dirs written before decisions carried unix `t` (they had seconds
                since the coordinator's start) are still read: `to_unix` maps those
                with t0 = status.t - status.elapsed_s (or the `finish` event's t -
                wall_s).

Derived figures (all from events unless said otherwise):
  role segments   per cell, (cell, t0, t1, label) seconds since the `start` event: the
                  layout roles, then per `handoff` its cells spend [t - total_s,
                  t - total_s + drain_s] draining and the rest of total_s loading.
  step ETA        (last `step` event - `start`) / steps seen x steps left.
  rollout rate    `run_end` events with status ok in the last 60 s (runs/min).
  train rate      tokens of `microbatch` events in the last 60 s / 60 (tokens/s).
  in-role         1 - (cell-seconds draining or loading) / (cell-seconds since start):
                  the share of node time not lost to handoffs (NOT GPU utilisation).
  train compute   sum of `microbatch` + `step` seconds / seconds since start: the share of
                  wall time the train world spent computing (0 when it is idle waiting
                  for trajectories or rebuilding).
  step metrics    the training signals of each step (loss, clip fraction, entropy, grad
                  norm, trainer/sampler mismatch by policy lag, staleness, reward spread,
                  lengths: gyre_slurm/train/metrics.py), from its `step` event; the same
                  figures are in metrics.jsonl and the TensorBoard files.
  rollout slots   mean over status.json waterlevel_history samples (those with a rollout
                  cell) of in_flight / (rollout_cells x the runs a cell serves,
                  rollout.runs_per_node x cluster.cell_nodes of the run dir's config.yaml):
                  how full the rollout cells' run slots were. The waterlevel itself is
                  (in_flight + queued) / the runs a cell serves: demand in cells.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre_slurm.common.fsio import BadLine, parse_jsonl
from gyre_slurm.common.values import is_finite_number, is_int, is_number
from gyre_slurm.errors import UserError

FAILURE_KINDS = ("agent_lost", "handoff_failed")
WINDOW_S = 60.0


# -- the shapes the monitor reads ----------------------------------------------------------
# The coordinator writes both files; a field of another type (a file edited by hand, or
# written by another version) would stop `gyre status` and `gyre report` with a
# traceback where they read it. Each check names the first field that does not fit: an
# event is then skipped and reported like a corrupt line, a status.json is treated like
# a garbled one (the last good status is kept).
def _list_of(check):
    def whole(v) -> bool:
        return isinstance(v, list) and all(check(x) for x in v)
    whole.item = check  # `_fields_error` names the first item that does not fit
    return whole


def _opt(check):
    return lambda v: v is None or check(v)


def _str(v) -> bool:
    return isinstance(v, str)


def _metric(v) -> bool:  # a step's training signal: a number or a table (lags)
    return v is None or isinstance(v, dict) or is_number(v)


# kind -> {field: (required, check, what it must be)}; every event has a kind and a time
EVENT_FIELDS: dict[str, dict[str, tuple[bool, Callable, str]]] = {
    "layout": {"roles": (True, _list_of(_str), "a list of role names")},
    "handoff": {"direction": (True, lambda v: isinstance(v, str) and "->" in v,
                              "'<from>-><to>'"),
                "cells": (True, _list_of(is_int), "a list of cell numbers"),
                "total_s": (False, is_finite_number, "seconds"),
                "drain_s": (False, is_finite_number, "seconds")},
    "handoff_cancelled": {"drain_s": (False, is_finite_number, "seconds")},
    "step": {"step": (True, is_int, "a step number"),
             "mean_reward": (False, is_number, "a number"),  # NaN: no reward to average
             "seconds": (False, is_finite_number, "seconds"),
             "trajectories": (False, is_finite_number, "a number"),
             "tokens": (False, is_finite_number, "a number"),
             "metrics": (False, lambda v: isinstance(v, dict) and all(
                 _metric(x) for x in v.values()), "an object of numbers")},
    "microbatch": {"tokens": (False, is_finite_number, "a number"),
                   "seconds": (False, is_finite_number, "seconds")},
    "run_end": {"status": (False, _opt(_str), "a string")},
    "finish": {"wall_s": (False, is_finite_number, "seconds")},
}


def _fields_error(obj: dict, fields: dict, where: str) -> str | None:
    for name, (required, check, what) in fields.items():
        if name not in obj:
            if required:
                return f"{where} has no {name!r}"
        elif not check(obj[name]):
            value, item = obj[name], getattr(check, "item", None)
            if item is not None and isinstance(value, list):
                i = next(i for i, x in enumerate(value) if not item(x))
                return f"{where}: {name}[{i}] does not fit ({what}): {value[i]!r:.60}"
            return f"{where}: {name!r} must be {what}, got {value!r:.40}"
    return None


def event_error(e: dict) -> str | None:
    """What is wrong with an event for the monitor, or None."""
    if not isinstance(e.get("kind"), str):
        return "an event without a kind"
    if not is_finite_number(e.get("t")):
        return f"a {e['kind']} event whose time is not a finite number"
    return _fields_error(e, EVENT_FIELDS.get(e["kind"], {}), f"a {e['kind']} event")


_SAMPLE = lambda v: isinstance(v, dict) and all(  # noqa: E731 (a waterlevel sample)
    is_finite_number(x) for k, x in v.items()
    if k in ("t", "waterlevel", "in_flight", "queued", "rollout_cells", "train_cells"))
STATUS_FIELDS: dict[str, tuple[bool, Callable, str]] = {
    "t": (False, is_finite_number, "a time"), "elapsed_s": (False, is_finite_number, "seconds"),
    "final": (False, lambda v: isinstance(v, bool), "true or false"),
    "policy": (False, _str, "a string"), "version": (False, is_int, "a whole number"),
    "num_steps": (False, _opt(is_int), "a whole number"),
    "cells": (False, lambda v: isinstance(v, list) and all(isinstance(c, dict) for c in v),
              "a list of cells"),
    "runs": (False, lambda v: isinstance(v, dict), "an object"),
    "train": (False, lambda v: isinstance(v, dict), "an object"),
    "rewards": (False, _list_of(lambda r: isinstance(r, dict) and is_int(r.get("step"))
                                and is_number(r.get("mean_reward"))),
        "a list of {step, mean_reward}"),
    "waterlevel": (False, _opt(_SAMPLE), "a waterlevel sample"),
    "waterlevel_history": (False, _list_of(_SAMPLE), "a list of waterlevel samples"),
}
CELL_FIELDS: dict[str, tuple[bool, Callable, str]] = {
    "cell": (True, is_int, "a cell number"), "nodes": (False, _list_of(_str), "a list of names"),
    "role": (False, _str, "a role name"), "target": (False, _opt(_str), "a role name"),
    "runs": (False, is_int, "a whole number"),
}


def status_error(data: dict) -> str | None:
    """What is wrong with status.json for the monitor, or None."""
    why = _fields_error(data, STATUS_FIELDS, "status.json")
    if why:  # the cells' own fields only once `cells` is a list of objects
        return why
    for i, c in enumerate(data.get("cells") or []):
        why = why or _fields_error(c, CELL_FIELDS, f"status.json cells[{i}]")
    return why


class EventTail:
    """Reads events.jsonl incrementally: whole lines only, from where it stopped.
    Corrupt lines are skipped and kept in `bad` (`BadLine`: path, line, byte offset)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.line = 1
        self.events: list[dict] = []
        self.bad: list[BadLine] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return self.events
        end = data.rfind(b"\n")
        if end < 0:
            return self.events
        self.events += parse_jsonl(data[:end + 1], path=str(self.path), start_line=self.line,
                                   start_offset=self.offset, on_bad=self.bad.append,
                                   check=event_error)
        self.line += data.count(b"\n", 0, end + 1)
        self.offset += end + 1
        return self.events


def read_status_checked(run_dir: Path) -> tuple[dict | None, str | None]:
    """(status, None), (None, None) when status.json does not exist yet, or (None, what
    is wrong) when it cannot be read or is not a JSON object."""
    path = run_dir / "status.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: unreadable ({exc})"
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return None, f"{path}: garbled ({len(raw)} bytes): {exc}"
    if not isinstance(data, dict):
        return None, f"{path}: not a JSON object ({type(data).__name__})"
    if why := status_error(data):
        return None, f"{path}: not the shape gyre writes ({why})"
    return data, None


def read_status(run_dir: Path) -> dict | None:
    return read_status_checked(run_dir)[0]


class StatusReader:
    """Reads status.json again and again: a garbled read keeps the last good status
    (`error` says what is wrong with the file now)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.last_good: dict | None = None
        self.error: str | None = None

    def read(self) -> dict | None:
        data, self.error = read_status_checked(self.run_dir)
        if data is not None:
            self.last_good = data
        return self.last_good


@dataclass
class Snapshot:
    """One look at a run dir: status.json (or None) and all events so far."""

    run_dir: Path
    status: dict | None
    events: list[dict]
    now: float = field(default_factory=time.time)
    status_error: str | None = None  # status.json garbled now (`status`: the last good)
    problems: list[str] = field(default_factory=list)  # corrupt files met, for the user

    @property
    def start_t(self) -> float | None:
        return next((e["t"] for e in self.events if e["kind"] == "start"), None)

    @property
    def coord_t0(self) -> float | None:
        if self.status and "t" in self.status and "elapsed_s" in self.status:
            return self.status["t"] - self.status["elapsed_s"]
        fin = next((e for e in self.events if e["kind"] == "finish" and "wall_s" in e), None)
        if fin:
            return fin["t"] - fin["wall_s"]
        return self.events[0]["t"] if self.events else None

    def to_unix(self, event: dict) -> float:
        t = event["t"]
        if t < 1e8 and self.coord_t0 is not None:  # policy clock: seconds since t0
            return self.coord_t0 + t
        return t

    @property
    def end_t(self) -> float:
        if self.status and self.status.get("final") and "t" in self.status:
            return self.status["t"]  # (`t` is optional: status_error checked it is a time)
        if self.events and self.events[-1]["kind"] == "finish":
            return self.events[-1]["t"]
        return self.now

    def of_kind(self, *kinds: str) -> list[dict]:
        return [e for e in self.events if e["kind"] in kinds]


def role_segments(events: list[dict], *, end_t: float | None = None
                  ) -> tuple[list[tuple[int, float, float, str]], float]:
    """Per cell (cell, t0, t1, label), seconds since the first `start`, and the span.

    A later `layout` (a resumed run) ends every cell's segment at the last event before it
    (about when the old job stopped); the gap until the new layout has no segment."""
    start = next(e["t"] for e in events if e["kind"] == "start")
    if end_t is None:
        end_t = max(e["t"] for e in events if e["t"] > 1e8)
    role: dict[int, str] = {}
    since: dict[int, float] = {}
    segs = []
    prev_t = start
    for e in events:
        if e["kind"] == "layout" and e["t"] >= prev_t:
            for c in role:
                segs.append((c, since[c], max(since[c], prev_t - start), role[c]))
            role = dict(enumerate(e["roles"]))
            since = {c: max(0.0, e["t"] - start) for c in role}
        elif e["kind"] == "handoff" and e["t"] >= start:
            handoff_segments(e, start=start, role=role, since=since, out=segs)
        if e["t"] > 1e8:  # unix times only (decisions use the policy clock)
            prev_t = e["t"]
    for c in role:
        segs.append((c, since[c], end_t - start, role[c]))
    return segs, end_t - start


def handoff_segments(e: dict, *, start: float, role: dict, since: dict, out: list) -> None:
    """A handoff's cells: old role until it began, draining, loading, then the new role."""
    to = e["direction"].split("->")[1]
    t_end = e["t"] - start
    t_begin = max(0.0, t_end - e.get("total_s", 0.0))
    t_loaded = min(t_end, t_begin + e.get("drain_s", 0.0))
    for c in e["cells"]:
        out.append((c, since.get(c, 0.0), t_begin, role.get(c, "rollout")))
        out.append((c, t_begin, t_loaded, f"draining->{to}"))
        out.append((c, t_loaded, t_end, f"loading->{to}"))
        role[c], since[c] = to, t_end


def segments(snap: Snapshot) -> tuple[list[tuple[int, float, float, str]], float]:
    if snap.start_t is None or not snap.of_kind("layout") or snap.end_t < snap.start_t:
        return [], 0.0
    return role_segments(snap.events, end_t=snap.end_t)


ROLE_CHARS = {"rollout": "R", "train": "T", "failed": "X"}  # a strip's characters; "-" moving


def role_strip(segs: list, cell: int, *, span_end_s: float, width: int = 40,
               step_s: float = 1.0) -> str:
    """The cell's role over the last `width` x `step_s` seconds: R, T, - (handoff), X
    (failed), ' '. Each character is the role at its instant, except that a handoff or a
    failure anywhere in the `step_s` before it shows: one shorter than a character is
    still on the strip."""
    since = span_end_s - width * step_s
    mine = [s for s in segs if s[0] == cell and s[2] >= since]
    out = []
    for i in range(width):
        t = span_end_s - (width - 1 - i) * step_s
        label = next((s[3] for s in mine if s[1] <= t < s[2] + 1e-9), None)
        if t < 0:
            out.append(" ")
            continue
        brief = [s[3] for s in mine if s[1] < t and s[2] > t - step_s
                 and ("->" in s[3] or s[3] == "failed")]
        if brief and label not in brief:
            label = "failed" if "failed" in brief else brief[0]
        out.append(" " if label is None else ROLE_CHARS.get(label, "-"))
    return "".join(out)


def step_progress(snap: Snapshot) -> dict:
    """Steps done (status version, else step events), of how many, and the ETA."""
    steps = snap.of_kind("step")
    done = snap.status.get("version", len(steps)) if snap.status else len(steps)
    total = snap.status.get("num_steps") if snap.status else None
    eta_s = None
    start = snap.start_t
    if total and steps and done < total and start is not None:
        # Mean wall time per step since start: steps that streamed in a burst do not
        # make the rest look instant.
        eta_s = (steps[-1]["t"] - start) / len(steps) * (total - done)
    return {"done": done, "total": total, "eta_s": eta_s}


def throughput(snap: Snapshot, *, window_s: float = WINDOW_S) -> dict:
    """Rollout runs/min and training tokens/s over the last `window_s` of the run."""
    end = snap.end_t
    since = end - window_s
    if snap.start_t is not None:
        window_s = max(1e-9, min(window_s, end - snap.start_t))
        since = end - window_s
    ok = [e for e in snap.of_kind("run_end") if e.get("status") == "ok" and e["t"] >= since]
    tokens = sum(e.get("tokens", 0) for e in snap.of_kind("microbatch") if e["t"] >= since)
    return {"window_s": window_s, "runs_per_min": len(ok) * 60.0 / window_s,
            "tokens_per_s": tokens / window_s}


def busy(snap: Snapshot, segs: list, span_s: float) -> dict:
    """In-role share of cell-seconds and train compute share of wall time (see module doc)."""
    if not segs or span_s <= 0:
        return {"in_role": None, "train_compute": None}
    total = sum(t1 - t0 for _, t0, t1, _ in segs)
    moving = sum(t1 - t0 for _, t0, t1, lab in segs if "->" in lab)
    compute = sum(e.get("seconds", 0.0) for e in snap.of_kind("microbatch", "step"))
    return {"in_role": 1 - moving / total if total > 0 else None,
            "train_compute": min(1.0, compute / span_s)}


def cell_capacity(run_dir: Path) -> int | None:
    """Runs a rollout cell serves (`GyreConfig.cell_capacity`), from the run dir's config."""
    from gyre_slurm.common.yamltext import read_yaml

    try:
        cfg = read_yaml(run_dir / "config.yaml", what="the run dir's config.yaml")
        if "runtime" in cfg:  # a run dir of the older config layout
            return int(cfg["runtime"]["runs_per_cell"])
        return int(cfg["rollout"]["runs_per_node"]) * int(cfg["cluster"]["cell_nodes"])
    except (OSError, ValueError, TypeError, KeyError, UserError):
        return None


def rollout_occupancy(status: dict | None, per_cell: int | None) -> float | None:
    samples = [w for w in (status or {}).get("waterlevel_history", [])
               if w.get("rollout_cells")]
    if not samples or not per_cell:
        return None
    return sum(min(1.0, w.get("in_flight", 0) / (w["rollout_cells"] * per_cell))
               for w in samples) / len(samples)


def failures(snap: Snapshot) -> list[dict]:
    return [e for e in snap.events if e["kind"] in FAILURE_KINDS
            or (e["kind"] == "run_end" and e.get("status") not in ("ok", None))]


def step_rates(events: list[dict]) -> list[dict]:
    """Per step: trajectories/s and tokens/s over the time since the previous step."""
    start = next((e["t"] for e in events if e["kind"] == "start"), None)
    out, prev = [], start
    for e in (e for e in events if e["kind"] == "step"):
        dt = e["t"] - prev if prev is not None else None
        if dt and dt > 0:
            out.append({"step": e["step"], "trajectories_per_s": e.get("trajectories", 0) / dt,
                        "tokens_per_s": e.get("tokens", 0) / dt, "seconds": dt})
        prev = e["t"]
    return out


def step_metrics(events: list[dict]) -> list[dict]:
    """Each step's training signals (`train.metrics.step_metrics`, carried by its `step`
    event) with "step" added, in step order; a step trained twice (a resumed run) keeps
    its last event."""
    by_step = {e["step"]: e["metrics"] for e in events
               if e["kind"] == "step" and isinstance(e.get("metrics"), dict)}
    return [{"step": k, **by_step[k]} for k in sorted(by_step)]


LIFE_STARTS = ("resume", "start")  # events that carry the version a life starts from


def trained_microbatches(events: list[dict]) -> list[dict]:
    """The `microbatch` events whose training stands, in the order trained: those of
    the steps each life committed (a life that starts at version V, resumed or started
    again from 0, trains the steps >= V again, so their earlier events go), and of a
    micro-batch trained again (its step rewound) the last. What the run trained, once
    each, after its micro-batch files are gone (training.keep_microbatch_steps)."""
    out: list[dict] = []
    for e in events:
        if e["kind"] in LIFE_STARTS:
            out = [m for m in out if m["step"] < e["version"]]
        elif e["kind"] == "microbatch":
            out.append(e)
    last: dict[tuple[int, int], dict] = {}
    for e in out:
        last.pop((e["step"], e["index"]), None)
        last[(e["step"], e["index"])] = e
    return list(last.values())


def load(run_dir: Path, tail: EventTail | None = None,
         status: StatusReader | None = None) -> Snapshot:
    tail = tail or EventTail(run_dir / "events.jsonl")
    status = status or StatusReader(run_dir)
    current = status.read()
    events = list(tail.poll())
    problems = [f"{status.error}" + ("; showing the last good status" if current else "")
                ] if status.error else []
    problems += [f"corrupt line skipped: {b}" for b in tail.bad]
    return Snapshot(run_dir=run_dir, status=current, events=events,
                    status_error=status.error, problems=problems)
