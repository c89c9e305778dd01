#!/usr/bin/env python3
"""An experiment (figures, not the product's policy): how far lending cells to training
within each step's tail goes against the lower bound, beside the elastic policy.

    tools/gyre-env python tools/sim_lend.py [PRESET ...] [--floats 1,2,3,4]

The lending policy: a fixed training floor (the config's `min_train_cells`, never
moved); every other cell rolls out, and while no run waits to start (the staleness
bound holds the next batch back, or every batch has started), a rollout cell whose runs
fit in the free slots of the others is lent to training (its runs migrate at their next call) if
training has at least a handoff's worth of ready tokens, one cell at a time, at most
`floats` at once. Lent cells come back (a drain still under way is cancelled) as soon as
runs queue again. No forecast: it is the waterlevel rule cut down to the tail.

It is here because docs/scheduler.md ("Against the lower bound") cites it: on three
presets it beats elastic, whose outlook holds one layout for the whole job; on the
others it loses, by far where the demand changes or a replica spans several cells.
Each row is one simulation of the preset's own workload (deterministic).
"""

from __future__ import annotations

import sys

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.lend import TailLending
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sched.types import Decision, Layout, Observation
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.runner import simulate
from gyre_slurm.sim.workload import sample_workload

PRESETS = ("terminalbench-122b", "deepswe-122b", "nl2repo-122b", "nl2repo-2.4t",
           "terminalbench-122b-growing", "deepswe-122b-curriculum")


class _Unbounded(TailLending):
    """The product's lending rule (`sched/lend.py`), less its bounds: any replica size,
    up to `most` cells whatever the cluster's size; no outlook deciding."""

    def cells(self, obs: Observation) -> int:
        return self.most


class TailLendPolicy:
    max_staleness = None
    streaming = True

    def __init__(self, *, floor: int, floats: int):
        self.floor, self.floats = floor, floats
        self.name = f"lend-{floor}+{floats}"
        self.lending = _Unbounded(floats)

    def initial_layout(self, num_cells: int) -> Layout:
        roll = num_cells - self.floor
        return Layout(roles=(Role.ROLLOUT,) * roll + (Role.TRAIN,) * self.floor,
                      standalone=(False,) * roll + (True,) * self.floor)

    def decide(self, obs: Observation) -> list[Decision]:
        back = self.lending.returns(obs)  # runs queue: every lent cell comes back
        if back or obs.runs_queued > 0:
            return back
        cell = self.lending.candidate(obs)
        if cell is None:
            return []
        self.lending.lent[cell.cell_id] = obs.now_s
        return [Decision(cell.cell_id, Role.TRAIN, "release",
                         f"step's tail: {self.lending.backlog_s(obs):.0f} s of training "
                         f"ready, cell {cell.cell_id}'s {cell.active_runs} runs fit elsewhere",
                         drain="migrate")]


def main(argv: list[str]) -> None:
    floats = [2, 3, 4]
    if "--floats" in argv:
        i = argv.index("--floats")
        floats = [int(x) for x in argv[i + 1].split(",")]
        argv = argv[:i] + argv[i + 2:]
    print("| preset | elastic / bound (handoffs) | "
          + " | ".join(f"lend, up to {f} (handoffs)" for f in floats) + " |")
    print("|---|---|" + "---|" * len(floats))
    for name in argv or PRESETS:
        cfg = load_config(preset_path(name))
        w = sample_workload(cfg)
        bound = lower_bound(cfg, w)["lower_bound_s"]
        floor = max(cfg.scheduler.min_train_cells, 1)
        cols = []
        for policy in [named_policy(cfg, "elastic")] + [
                TailLendPolicy(floor=floor, floats=f) for f in floats]:
            res = simulate(cfg, policy, w)
            cols.append(f"{res.makespan_s / bound:.3f} ({res.handoffs})")
        print(f"| {name} | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main, sys.argv[1:])
