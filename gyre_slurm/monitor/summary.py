"""What `gyre run` prints on stdout: where to watch the job when it starts, and a short
summary when it ends (steps, runs ok/failed, handoffs, mean reward at the start and the
end, wall time, the run dir and how to draw the report).

Everything comes from the run dir (events.jsonl, runs/runs.jsonl, status.json), so the
summary of a resumed job covers all its lives. `summarize` is pure (records in, figures
out); `start_text` and `end_text` read the run dir and format.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from shlex import quote
from typing import Any, Iterable

from gyre_slurm.common.fsio import read_jsonl
from gyre_slurm.common.values import is_finite_number
from gyre_slurm.monitor.model import event_error, read_status_checked

REWARD_STEPS = 5  # the reward "at the start" and "at the end": mean of this many steps


def start_text(run_dir: Path, *, prog: str = "gyre", resume: bool = False) -> str:
    run_dir = Path(run_dir)
    how = "resuming from checkpoints/latest" if resume else "starting"
    return "\n".join([
        f"gyre run: {how}; run dir {run_dir}",
        f"  watch    {prog} status {quote(str(run_dir))}",
        f"  events   {run_dir / 'events.jsonl'}   logs {run_dir / 'logs'}/",
    ])


def summarize(events: Iterable[dict], runs: Iterable[dict], status: dict) -> dict[str, Any]:
    """The job's figures from its records: `events` (events.jsonl), `runs` (the run
    records, runs/runs.jsonl) and `status` (status.json, {} when missing)."""
    steps, handoffs = [], Counter()
    wall_s = started = last_t = None
    for e in events:
        kind, last_t = e.get("kind"), e.get("t", last_t)
        if kind == "step":
            steps.append(e)
        elif kind == "handoff":
            handoffs[e.get("direction", "?")] += 1
        elif kind == "start":
            started = e.get("t")
        elif kind == "finish":
            wall_s = e.get("wall_s")
    if wall_s is None and started is not None and last_t is not None:
        wall_s = last_t - started  # stopped or failed: up to its last event
    rewards = [s["mean_reward"] for s in steps if is_finite_number(s.get("mean_reward"))]
    ended = Counter(r.get("status", "?") for r in runs)
    return {
        "version": status.get("version", len(steps)), "num_steps": status.get("num_steps"),
        "runs": dict(ended), "handoffs": sum(handoffs.values()),
        "handoffs_by_direction": dict(handoffs), "wall_s": wall_s,
        "reward_first": _mean(rewards[:REWARD_STEPS]),
        "reward_last": _mean(rewards[-REWARD_STEPS:]), "reward_steps": len(rewards),
    }


def end_text(run_dir: Path, *, outcome: str, prog: str = "gyre") -> str:
    run_dir = Path(run_dir)
    status = read_status_checked(run_dir)[0] or {}  # missing, garbled or misshapen: {}
    s = summarize(read_jsonl(run_dir / "events.jsonl", check=event_error),
                  read_jsonl(run_dir / "runs" / "runs.jsonl", check=_run_record_error), status)
    runs = s["runs"]
    others = ", ".join(f"{n} {k}" for k, n in sorted(runs.items()) if k not in ("ok", "failed"))
    wall = f"{s['wall_s']:.0f} s" if s["wall_s"] is not None else "?"
    dirs = ", ".join(f"{n} {d}" for d, n in sorted(s["handoffs_by_direction"].items()))
    k = min(REWARD_STEPS, s["reward_steps"])
    reward = (f"{s['reward_first']:.3f} (first {k} steps) -> {s['reward_last']:.3f} "
              f"(last {k})" if s["reward_steps"] else "no step trained")
    report = run_dir / "report.png"
    return "\n".join([
        f"gyre run: {outcome} after {wall}",
        f"  steps    {s['version']}/{s['num_steps'] if s['num_steps'] is not None else '?'}",
        f"  runs     {runs.get('ok', 0)} ok, {runs.get('failed', 0)} failed"
        + (f", {others}" if others else ""),
        f"  handoffs {s['handoffs']}" + (f" ({dirs})" if dirs else ""),
        f"  reward   {reward}",
        f"  run dir  {run_dir}",
        f"  report   {prog} report {quote(str(run_dir))} -o {quote(str(report))}",
    ])


def _run_record_error(r: dict) -> str | None:
    if isinstance(r.get("status", "?"), str):
        return None
    return "a run record whose status is not a string"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
