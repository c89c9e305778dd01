#!/usr/bin/env python3
"""Benchmark of the scheduler and the simulator (figures, not a test).

  tools/gyre-python tools/bench_scheduler.py        (or: PYTHONPATH=. python3 tools/...)

1. One elastic decision at 1,024 cells and 20,000 runs in flight (target < 250 ms: the
   outlook weighs a few dozen plans over the steps ahead; at this scale the policy ticks
   every few seconds), with no queue and with 3,000 runs queued. Median of repeats.
2. Simulating the nl2repo-2.4t preset end to end: the elastic policy alone, and the whole
   `gyre sim` comparison (every policy, async split search, ablations). Target < 30 s.
Run it pinned to one core (taskset -c 0) for the one-core figures.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import SchedulerConfig, load_config
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.elastic import ElasticPolicy
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sched.types import CellObs, Observation
from gyre_slurm.sched.waterlevel import DurationModel
from gyre_slurm.sim.runner import compare, simulate
from gyre_slurm.sim.workload import sample_workload


def big_observation(*, num_cells: int, num_runs: int, queued: int, seed: int = 0) -> Observation:
    rng = np.random.default_rng(seed)
    cap = 32
    roles = rng.choice([Role.ROLLOUT, Role.TRAIN], size=num_cells, p=[0.7, 0.3])
    loads = np.zeros(num_cells, dtype=int)
    rollout = np.flatnonzero(roles == Role.ROLLOUT)
    np.add.at(loads, rng.choice(rollout, size=num_runs), 1)
    cells = tuple(CellObs(i, Role(roles[i]), None, i < 8, int(loads[i]), since_s=0.0)
                  for i in range(num_cells))
    return Observation(
        now_s=1e5, cells=cells, cell_capacity=cap, runs_in_flight=num_runs, runs_queued=queued,
        runs_future=5000, run_elapsed_s=rng.uniform(0, 14_000, size=num_runs),
        train_ready_tokens=5e8, train_waiting_tokens=1e8, train_tokens_per_cell_s=3e4,
        min_train_cells=1, tokens_per_run=1.7e6, policy_version=3, steps_done=3,
        num_steps=24, handoff_to_train_s=170.0, handoff_to_rollout_s=170.0, step_runs_left=100)


def time_decisions(obs: Observation, *, repeats: int = 200) -> tuple[float, int]:
    policy = ElasticPolicy(SchedulerConfig(confirm_s=0, min_dwell_s=0),
                           durations=DurationModel.lognormal(mean_s=6948, sigma=0.33))
    times, num = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        num = len(policy.decide(obs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), num


def main() -> None:
    for label, queued in (("release check", 0), ("reclaim, 3,000 runs queued", 3000)):
        obs = big_observation(num_cells=1024, num_runs=20_000, queued=queued)
        median, num = time_decisions(obs)
        print(f"decision at 1,024 cells / 20,000 runs ({label}): median {median * 1e3:.2f} ms "
              f"({num} decisions) [target < 250 ms]")
    cfg = load_config(preset_path("nl2repo-2.4t"))
    t0 = time.perf_counter()
    workload = sample_workload(cfg)
    res = simulate(cfg, named_policy(cfg, "elastic"), workload)
    one = time.perf_counter() - t0
    print(f"nl2repo-2.4t, elastic alone ({workload.num_runs} runs, {cfg.workload.num_steps} "
          f"steps, {cfg.cluster.num_cells} cells): {one:.2f} s "
          f"(makespan {res.makespan_s / 3600:.2f} h) [target < 30 s]")
    t0 = time.perf_counter()
    out = compare(cfg)
    whole = time.perf_counter() - t0
    print(f"nl2repo-2.4t, whole comparison ({len(out['results'])} simulations): {whole:.2f} s "
          f"[target < 30 s]")


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
