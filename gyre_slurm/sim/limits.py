"""What the simulator takes on: a job it could not finish in any reasonable time is
refused up front, with what to change, rather than left to run for days or to exhaust
memory (a hostile or mistyped workload file: runs of 1e30 s, a throughput of 1e-30
tokens/s, a million steps).

- at most config.checks.MAX_JOB_RUNS runs (each is a row of the workload's arrays),
  refused as the config loads (the runtime books every run too);
- at most MAX_CELLS cells (a policy tick looks at every cell; 64 cells already take
  minutes), each serving at most MAX_CELL_RUNS runs at once;
- at most MAX_TICKS policy ticks: the job's makespan, at the least (all rollout work on
  full cells, or all tokens trained by the whole cluster and the optimizer steps), over
  `scheduler.interval_s`; and, for what no estimate foresees (a handoff of 1e30 s), a
  simulation still running at MAX_TICKS ticks stops with the same error.

The limits are far above every shipped preset (about 11,000 ticks, 16 cells and 12,288
runs at most) and the property tests' jobs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.errors import UserError
from gyre_slurm.sim.training import train_throughput

if TYPE_CHECKING:  # sim.workload imports this module (check_size)
    from gyre_slurm.sim.workload import Workload

MAX_CELLS = 1024
MAX_TICKS = 2_000_000
MAX_CELL_RUNS = 1_000_000  # runs one cell serves at once (a rate table holds one per load)


class TooLargeToSimulate(UserError):
    """The workload is beyond what the simulator takes on."""


def check_size(cfg: GyreConfig) -> None:
    """Runs and cells, before anything is allocated."""
    if cfg.cell_capacity > MAX_CELL_RUNS:
        raise TooLargeToSimulate(
            f"a cell serves {cfg.cell_capacity:,} runs at once (rollout.runs_per_node "
            f"{cfg.rollout.runs_per_node:,} x cluster.cell_nodes {cfg.cluster.cell_nodes:,}); "
            f"the simulator takes at most {MAX_CELL_RUNS:,}: use smaller cells")
    if cfg.cluster.num_cells > MAX_CELLS:
        raise TooLargeToSimulate(
            f"the cluster has {cfg.cluster.num_cells:,} cells (cluster.num_nodes "
            f"{cfg.cluster.num_nodes:,} / cell_nodes {cfg.cluster.cell_nodes}); the "
            f"simulator takes at most {MAX_CELLS:,}: use larger cells or a smaller cluster")


def check_job(cfg: GyreConfig, workload: Workload) -> None:
    """Everything up front, for a workload however it was made: runs and cells, the
    least makespan's ticks, the single costs."""
    check_size(cfg)
    check_ticks(cfg, least_makespan_s=max(
        float(workload.work_s.sum()) / (cfg.cell_capacity * cfg.cluster.num_cells),
        float(workload.tokens.sum()) / train_throughput(cfg.training, cfg.cluster.num_nodes)
        + workload.num_steps * cfg.training.optimizer_step_s))
    check_costs(cfg)


def check_costs(cfg: GyreConfig) -> None:
    """No single cost (a handoff phase, a weight sync, an optimizer step, a reprefill)
    longer than the whole time the simulator simulates."""
    limit = time_limit_s(cfg)
    costs = {f"handoff.{f.name}": getattr(cfg.handoff, f.name)
             for f in dataclasses.fields(cfg.handoff) if f.name.endswith("_s")}
    costs.update({"rollout.weight_sync_s": cfg.rollout.weight_sync_s,
                  "rollout.reprefill_s": cfg.rollout.reprefill_s,
                  "training.optimizer_step_s": cfg.training.optimizer_step_s})
    for name, value in costs.items():
        if not value <= limit:
            raise TooLargeToSimulate(
                f"{name} = {value:.3g} s is longer than the whole job the simulator "
                f"simulates ({limit:.3g} s: {MAX_TICKS:,} policy ticks at "
                f"scheduler.interval_s = {cfg.scheduler.interval_s:g} s): check its unit "
                f"(seconds), or raise scheduler.interval_s")


def check_ticks(cfg: GyreConfig, *, least_makespan_s: float) -> None:
    """The policy ticks the job needs at the least, within MAX_TICKS."""
    interval = cfg.scheduler.interval_s
    ticks = least_makespan_s / interval
    if not ticks <= MAX_TICKS:
        raise TooLargeToSimulate(
            f"the simulated job would take at least {least_makespan_s:.3g} s "
            f"({least_makespan_s / 86400:.3g} days): {ticks:.3g} policy ticks at "
            f"scheduler.interval_s = {interval:g} s, and the simulator takes at most "
            f"{MAX_TICKS:,}. Check the run durations (workload.duration, phases) and the "
            f"training throughput (training.node_tokens_per_s), or raise "
            f"scheduler.interval_s")


def time_limit_s(cfg: GyreConfig) -> float:
    """Simulated seconds a job may run: MAX_TICKS policy ticks."""
    return MAX_TICKS * cfg.scheduler.interval_s
