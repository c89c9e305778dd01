"""From the calls of many runs to trajectories: per-run checks, tree, K paths, advantages.

A run becomes training data only if all of its call records are valid and consistent
and, when run records are given, its run record exists and has status "ok". Every run
left out gets a `RecordError` saying why; the other runs are processed as usual.

Advantage (one float per trajectory, the same for all trajectories of a run):
reward(run) - mean reward of the *group*, the runs of the same task_id with status "ok"
in the run records (whether or not their calls were usable: the baseline is about the
task's outcomes). Without run records every advantage is 0.0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre_slurm.traj.delta import CallDelta, check_run
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.pack import DedupStats, dedup_stats
from gyre_slurm.traj.records import CallRecord, Loaded, RecordError, RunRecord
from gyre_slurm.traj.select import Selection, Trajectory, materialize, select_paths
from gyre_slurm.traj.tree import PrefixTree, build_tree


@dataclass(frozen=True, eq=False)
class RunResult:
    run_id: str
    tree: PrefixTree
    selection: Selection
    trajectories: list[Trajectory]
    stats: DedupStats


@dataclass(frozen=True, eq=False)
class BuildResult:
    runs: list[RunResult]
    rejected: list[RecordError]
    notes: list[str] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for r in self.runs for t in r.trajectories]

    def summary(self) -> dict[str, Any]:
        total = sum((r.stats for r in self.runs), DedupStats())
        rejected_runs = sorted({e.run_id for e in self.rejected if e.run_id is not None})
        return {
            "num_runs": len(self.runs), "num_trajectories": len(self.trajectories),
            "num_rejected_runs": len(rejected_runs), "dedup": total.to_json(),
            "rejected": [e.to_json() for e in self.rejected], "notes": self.notes,
        }


def group_advantages(runs: Mapping[str, RunRecord]) -> dict[str, float]:
    """reward - mean reward of the status-ok runs of the same task, per status-ok run."""
    groups: dict[str, list[float]] = defaultdict(list)
    for rec in runs.values():
        if rec.status == "ok":
            groups[rec.task_id].append(rec.reward)
    return {rid: rec.reward - sum(groups[rec.task_id]) / len(groups[rec.task_id])
            for rid, rec in runs.items() if rec.status == "ok"}


def process_run(deltas: Sequence[CallDelta], *, max_per_run: int,
                advantage: float = 0.0) -> RunResult:
    """One run's calls (consistent, in call order) to its trajectories."""
    tree = build_tree(deltas)
    selection = select_paths(tree, max_paths=max_per_run)
    trajs = materialize(tree, selection, advantage=advantage)
    return RunResult(tree.run_id, tree, selection, trajs, dedup_stats(deltas, tree, trajs))


def as_deltas(loaded: Loaded[CallRecord]) -> Loaded[CallDelta]:
    return Loaded({rid: encode_run(calls) for rid, calls in loaded.runs.items()},
                  loaded.errors)


def _status_errors(run_ids: set[str], runs: Mapping[str, RunRecord], *,
                   calls_file: str, runs_file: str) -> dict[str, RecordError]:
    """Runs left out for their run record: status not ok (every such run, with or without
    calls), no run record for a run with calls, or an ok run without calls."""
    bad = {}
    for rid, rec in runs.items():
        if rec.status != "ok":
            why = f": {rec.reason}" if rec.reason else " (no reason given)"
            bad[rid] = RecordError(runs_file, "", rid, None, f"run status {rec.status}{why}",
                                   kind="status")
        elif rid not in run_ids:
            bad[rid] = RecordError(calls_file, "", rid, None, "run has no calls")
    for rid in run_ids:
        if rid not in runs:
            bad[rid] = RecordError(runs_file, "", rid, None, "no run record")
    return bad


def process(loaded: Loaded[CallDelta], *, max_per_run: int = 5,
            runs: Mapping[str, RunRecord] | None = None, calls_file: str = "",
            runs_file: str = "") -> BuildResult:
    """Every good run of `loaded` to trajectories; `loaded.errors` and every run left out
    here end up in `rejected`."""
    rejected = list(loaded.errors)
    known_bad = {e.run_id for e in rejected}
    advantages: dict[str, float] = {}
    if runs is not None:
        status = _status_errors(set(loaded.runs), runs, calls_file=calls_file,
                                runs_file=runs_file)
        rejected += [e for rid, e in status.items() if rid not in known_bad]
        known_bad |= set(status)
        advantages = group_advantages(runs)
    results, notes = [], []
    for rid, deltas in loaded.runs.items():
        if rid in known_bad:
            continue
        problem = check_run(deltas)
        if problem is not None:
            rejected.append(RecordError(calls_file, "", rid, problem[0], problem[1]))
            continue
        result = process_run(deltas, max_per_run=max_per_run,
                             advantage=advantages.get(rid, 0.0))
        notes += [f"run {rid!r}: {n}" for n in result.tree.notes]
        results.append(result)
    return BuildResult(results, rejected, notes)
