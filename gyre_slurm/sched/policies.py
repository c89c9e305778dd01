"""Policies by name, built from a config: what `gyre run` runs and what the simulator
compares. The coordinator and the simulator both build their policy here, so the runtime
never reaches into the simulator for it.

Names:
  elastic            the elastic policy as configured
  colocate           all cells roll out, then all train
  colocate-stream    ablation: colocate where a cell whose runs ended trains the step's
                     groups as they end (the published ablation's colocate + streaming)
  async-even         half the cells roll out (capped so training keeps a replica)
  async-split-R      a fixed split with R rollout cells
  elastic-nostream   ablation: elastic, whole-batch training
  elastic-nofloor    ablation: elastic without standalone floors
  elastic-naive      ablation: the waterlevel's working rule on the demand now (no
                     outlook, wait drain)
(`async` itself is the split a job configures, `run_policy`, or the best split the
simulator finds, `sim.runner.best_async`.)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from gyre_slurm.config.phases import StepShape, step_shape
from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.config.trace import load_trace
from gyre_slurm.errors import UserError
from gyre_slurm.sched.baselines import AsyncPolicy, ColocatePolicy
from gyre_slurm.sched.elastic import ElasticPolicy
from gyre_slurm.sched.observe import opening_observation
from gyre_slurm.sched.outlook import WorkloadPrior
from gyre_slurm.sched.types import Policy
from gyre_slurm.sched.waterlevel import DurationModel, StepDurations, rate_by_load


def run_policy(cfg: GyreConfig) -> Policy:
    """The policy a job runs: `scheduler.policy`; `async` at `scheduler.async_rollout_cells`."""
    if cfg.scheduler.policy == "async":
        return AsyncPolicy(rollout_cells=cfg.scheduler.async_rollout_cells,
                           streaming=cfg.scheduler.streaming)
    return named_policy(cfg, cfg.scheduler.policy)


def duration_model(cfg: GyreConfig, *, base_dir: Path | None = None) -> StepDurations:
    """The prior the elastic forecast uses, per step: the configured distribution (a
    trace: its empirical survival) shaped by each step's phase. The policy never sees
    the sampled durations themselves."""
    d = cfg.workload.duration
    trace = load_trace(d.trace_file, base_dir=base_dir) if d.dist == "trace" else None
    models: dict[StepShape, DurationModel] = {}
    per_step = []
    for step in range(cfg.workload.num_steps):
        shape = step_shape(cfg, step)
        key = StepShape(duration_scale=round(shape.duration_scale, 9), sigma=shape.sigma)
        if key not in models:
            scale = shape.duration_scale
            if trace is not None:
                models[key] = DurationModel.empirical(trace * scale)
            else:
                models[key] = DurationModel.lognormal(
                    mean_s=d.mean_s * scale, sigma=d.sigma if shape.sigma is None else shape.sigma,
                    max_s=None if d.max_s is None else d.max_s * scale)
        per_step.append(models[key])
    return StepDurations(tuple(per_step))


def make_elastic(cfg: GyreConfig, *, base_dir: Path | None = None, name: str = "elastic",
                 **changes) -> ElasticPolicy:
    sched = dataclasses.replace(cfg.scheduler, **changes)
    return ElasticPolicy(sched, prior=workload_prior(cfg, base_dir=base_dir,
                                                     streaming=sched.streaming), name=name,
                         opening=opening_observation(cfg))


def workload_prior(cfg: GyreConfig, *, base_dir: Path | None = None,
                   streaming: bool = True) -> WorkloadPrior:
    """What the elastic policy is told of the workload: the config's, step by step."""
    w = cfg.workload
    return WorkloadPrior(
        durations=duration_model(cfg, base_dir=base_dir),
        tokens_scale=tuple(step_shape(cfg, k).tokens_scale for k in range(w.num_steps)),
        runs_per_step=w.runs_per_step, group_size=w.group_size,
        staleness=cfg.training.max_staleness, streaming=streaming,
        scaling_efficiency=cfg.training.scaling_efficiency,
        optimizer_step_s=cfg.training.optimizer_step_s,
        rate_by_load=tuple(float(r) for r in rate_by_load(
            capacity=cfg.cell_capacity, llm_fraction=w.llm_time_fraction,
            half_load_runs=cfg.rollout.half_load_runs)),
        reprefill_s=cfg.rollout.reprefill_s,
        microbatch_tokens=cfg.training.microbatch_tokens)


def named_policy(cfg: GyreConfig, name: str, *, base_dir: Path | None = None) -> Policy:
    factories: dict[str, Callable[[], Policy]] = {
        "elastic": lambda: make_elastic(cfg, base_dir=base_dir),
        "colocate": ColocatePolicy,
        "colocate-stream": lambda: ColocatePolicy(streaming=True),
        "async-even": lambda: AsyncPolicy(name="async-even", rollout_cells=min(
            cfg.cluster.num_cells // 2, feasible_async_splits(cfg)[-1])),
        "elastic-nostream": lambda: make_elastic(cfg, base_dir=base_dir, streaming=False,
                                                 name="elastic-nostream"),
        "elastic-nofloor": lambda: make_elastic(cfg, base_dir=base_dir, min_rollout_cells=0,
                                                min_train_cells=0, name="elastic-nofloor"),
        "elastic-naive": lambda: make_elastic(cfg, base_dir=base_dir, forecast=False,
                                              drain="wait", name="elastic-naive"),
    }
    if name.startswith("async") and not feasible_async_splits(cfg):
        raise UserError(f"policy {name}: a model replica needs every one of the "
                        f"{cfg.cluster.num_cells} cells, so no fixed split leaves a cell to "
                        f"roll out; use colocate or elastic, or add nodes")
    if name.startswith("async-split-"):
        return AsyncPolicy(rollout_cells=int(name.rsplit("-", 1)[1]), name=name)
    if name not in factories:
        raise KeyError(name)
    return factories[name]()


def feasible_async_splits(cfg: GyreConfig) -> tuple[int, ...]:
    """Rollout-cell counts that leave training at least one whole model replica."""
    min_train = math.ceil(cfg.training.min_replica_nodes / cfg.cluster.cell_nodes)
    return tuple(range(1, cfg.cluster.num_cells - min_train + 1))
