"""Run the simulator for every policy of a comparison, and find async's best split.

The policies are built by name in `gyre_slurm.sched.policies`. Names in a comparison:
  elastic            the elastic policy as configured
  colocate           all cells roll out, then all train
  async              the best fixed split (searched), training one step behind
  async-even         half the cells roll out
  async-split-R      each other split that was tried
  elastic-nostream   ablation: elastic, whole-batch training
  elastic-nofloor    ablation: elastic without standalone floors
  elastic-naive      ablation: the waterlevel's working rule on the demand now (no outlook)
  colocate-stream    ablation: colocate whose idle cells train the step's groups as they end
  async-stream       ablation: async at its own best split, with streaming
  async-stream-even  ablation: async at the even split, with streaming
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.sched.baselines import AsyncPolicy
from gyre_slurm.sched.policies import feasible_async_splits, named_policy
from gyre_slurm.sched.types import Policy
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.engine import SimResult, Simulator
from gyre_slurm.sim.workload import Workload, sample_workload

MAIN = ("elastic", "colocate", "async")
ABLATIONS = ("elastic-nostream", "elastic-nofloor", "elastic-naive", "colocate-stream",
             "async-stream")


def simulate(cfg: GyreConfig, policy: Policy, workload: Workload) -> SimResult:
    return Simulator(cfg, policy, workload).run()


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
    """Every policy of the comparison on one sampled workload. Where a model replica
    needs every cell there is no fixed split: the async rows are left out and
    `best_async_split` is None."""
    workload = sample_workload(cfg, base_dir=base_dir)
    bound = lower_bound(cfg, workload)
    has_split = bool(feasible_async_splits(cfg))
    results: dict[str, SimResult] = {}
    for name in ("elastic", "colocate", "async-even") if has_split else ("elastic", "colocate"):
        results[name] = simulate(cfg, named_policy(cfg, name, base_dir=base_dir), workload)
    split = None
    if has_split:
        split, results["async"], tried = best_async(cfg, workload)
        for r, res in sorted(tried.items()):
            results[f"async-split-{r}"] = res
    if ablations:
        for name in ABLATIONS[:-1]:
            results[name] = simulate(cfg, named_policy(cfg, name, base_dir=base_dir), workload)
    if ablations and has_split:
        _, results["async-stream"], _ = best_async(cfg, workload, streaming=True,
                                                   name="async-stream")
        even = named_policy(cfg, "async-even", base_dir=base_dir)
        results["async-stream-even"] = simulate(cfg, AsyncPolicy(
            rollout_cells=even.rollout_cells, streaming=True, name="async-stream-even"), workload)
    return {"workload": workload, "bound": bound, "results": results,
            "best_async_split": split}
