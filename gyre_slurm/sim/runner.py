"""Run the simulator for every policy of a comparison, and find async's best split.

Names in a comparison:
  elastic            the elastic policy as configured
  colocate           all cells roll out, then all train
  async              the best fixed split (searched), training one step behind
  async-even         half the cells roll out
  async-split-R      each other split that was tried
  elastic-nostream   ablation: elastic, whole-batch training
  elastic-nofloor    ablation: elastic without standalone floors
  elastic-naive      ablation: DESIGN 5's working rule (no forecast, no cost gate, wait drain)
  async-stream       ablation: async at its own best split, with streaming
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.sched.baselines import AsyncPolicy, ColocatePolicy
from gyre_slurm.sched.elastic import ElasticPolicy
from gyre_slurm.sched.types import Policy
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.engine import SimResult, Simulator
from gyre_slurm.sim.workload import Workload, duration_model, sample_workload

MAIN = ("elastic", "colocate", "async")
ABLATIONS = ("elastic-nostream", "elastic-nofloor", "elastic-naive", "async-stream")


def make_elastic(cfg: GyreConfig, *, base_dir: Path | None = None, name: str = "elastic",
                 **changes) -> ElasticPolicy:
    sched = dataclasses.replace(cfg.scheduler, **changes)
    return ElasticPolicy(sched, durations=duration_model(cfg, base_dir=base_dir), name=name,
                         work_horizon_s=cfg.workload.duration.mean_s / 4)


def named_policy(cfg: GyreConfig, name: str, *, base_dir: Path | None = None) -> Policy:
    factories: dict[str, Callable[[], Policy]] = {
        "elastic": lambda: make_elastic(cfg, base_dir=base_dir),
        "colocate": ColocatePolicy,
        "async-even": lambda: AsyncPolicy(name="async-even", rollout_cells=min(
            cfg.cluster.num_cells // 2, feasible_async_splits(cfg)[-1])),
        "elastic-nostream": lambda: make_elastic(cfg, base_dir=base_dir, streaming=False,
                                                 name="elastic-nostream"),
        "elastic-nofloor": lambda: make_elastic(cfg, base_dir=base_dir, min_rollout_cells=0,
                                                min_train_cells=0, name="elastic-nofloor"),
        "elastic-naive": lambda: make_elastic(cfg, base_dir=base_dir, forecast=False,
                                              cost_gate=False, drain="wait",
                                              name="elastic-naive"),
    }
    if name.startswith("async-split-"):
        return AsyncPolicy(rollout_cells=int(name.rsplit("-", 1)[1]), name=name)
    if name not in factories:
        raise KeyError(name)
    return factories[name]()


def simulate(cfg: GyreConfig, policy: Policy, workload: Workload) -> SimResult:
    return Simulator(cfg, policy, workload).run()


def feasible_async_splits(cfg: GyreConfig) -> tuple[int, ...]:
    """Rollout-cell counts that leave training at least one whole model replica."""
    min_train = math.ceil(cfg.training.min_replica_nodes / cfg.cluster.cell_nodes)
    return tuple(range(1, cfg.cluster.num_cells - min_train + 1))


def best_async(cfg: GyreConfig, workload: Workload, *, streaming: bool = False,
               name: str = "async") -> tuple[int, SimResult, dict[int, SimResult]]:
    """The split a careful user would tune to: the fastest of those tried. The makespan
    is close to unimodal in the split, so try a coarse grid, then its neighbours."""
    splits = cfg.sim.async_splits or feasible_async_splits(cfg)
    tried: dict[int, SimResult] = {}

    def run(r: int) -> SimResult:
        if r not in tried:
            tried[r] = simulate(cfg, AsyncPolicy(rollout_cells=r, streaming=streaming,
                                                 name=f"{name}-split-{r}"), workload)
        return tried[r]

    stride = max(1, len(splits) // 8)
    for r in splits[::stride]:
        run(r)
    best = min(tried, key=lambda r: tried[r].makespan_s)
    idx = splits.index(best)
    for r in splits[max(0, idx - stride):idx + stride + 1]:
        run(r)
    best = min(tried, key=lambda r: (tried[r].makespan_s, r))
    return best, dataclasses.replace(tried[best], policy=name), tried


def compare(cfg: GyreConfig, *, ablations: bool = True, base_dir: Path | None = None) -> dict:
    workload = sample_workload(cfg, base_dir=base_dir)
    bound = lower_bound(cfg, workload)
    results: dict[str, SimResult] = {}
    for name in ("elastic", "colocate", "async-even"):
        results[name] = simulate(cfg, named_policy(cfg, name, base_dir=base_dir), workload)
    split, results["async"], tried = best_async(cfg, workload)
    for r, res in sorted(tried.items()):
        results[f"async-split-{r}"] = res
    if ablations:
        for name in ABLATIONS[:3]:
            results[name] = simulate(cfg, named_policy(cfg, name, base_dir=base_dir), workload)
        _, results["async-stream"], _ = best_async(cfg, workload, streaming=True,
                                                   name="async-stream")
    return {"workload": workload, "bound": bound, "results": results,
            "best_async_split": split}
