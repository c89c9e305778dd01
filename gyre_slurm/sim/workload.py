"""Sampling a workload: every run of every step, its duration and its trained tokens.

Runs are ordered by step, then group (prompt), then member. A run's duration is its
wall time at the reference load (a full cell); its prefix tree's tokens grow with its
duration (`tokens_mean` at the mean duration; every run `tokens_mean` with
`tokens_follow_duration: false`). The tokens a run costs the trainer are those it
computes: the tree's tokens with `training.packing: tree`, `workload.rows_reread` times
as many with `rows`; at most `tokens_max`. A step's runs follow its phase
(`workload.phases`: durations and tokens scaled, sigma changed).
Deterministic for a seed: each run's draw (a standard normal, or a trace index) is
the same whatever the phases, so a phase changes a run's size, not which run it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre_slurm.config.phases import StepShape, step_shape
from gyre_slurm.config.schema import DurationConfig, GyreConfig
from gyre_slurm.config.trace import load_trace
from gyre_slurm.sched.observe import computed_per_tree_token
from gyre_slurm.sim.limits import check_size


@dataclass(frozen=True)
class Workload:
    work_s: np.ndarray  # float64 per run: duration at the reference load
    tokens: np.ndarray  # int64 per run: tokens the trainer computes for this run
    batch: np.ndarray  # int64 per run: the step that trains it
    group: np.ndarray  # int64 per run: global group (prompt) index
    num_steps: int
    runs_per_step: int
    group_size: int

    @property
    def num_runs(self) -> int:
        return int(self.work_s.size)


def sample_durations(cfg: DurationConfig, num: int, rng: np.random.Generator,
                     *, base_dir: Path | None = None,
                     shapes: list[StepShape] | None = None) -> np.ndarray:
    """`num` durations; with `shapes` (one per run), each run's draw is scaled and
    spread by its step's shape."""
    if cfg.dist == "trace":
        trace = load_trace(cfg.trace_file, base_dir=base_dir)
        out = rng.choice(trace, size=num, replace=True)
        scale = np.ones(num) if shapes is None else np.array([s.duration_scale for s in shapes])
        out = out * scale
    else:
        z = rng.standard_normal(num)
        if shapes is None:
            sigma, scale = np.full(num, cfg.sigma), np.ones(num)
        else:
            sigma = np.array([cfg.sigma if s.sigma is None else s.sigma for s in shapes])
            scale = np.array([s.duration_scale for s in shapes])
        mu = np.log(cfg.mean_s * scale) - sigma ** 2 / 2
        out = np.exp(mu + sigma * z)
    if cfg.max_s is not None:
        cap = cfg.max_s * (1.0 if shapes is None else scale)
        out = np.minimum(out, cap)
    return out.astype(np.float64)


def sample_workload(cfg: GyreConfig, *, base_dir: Path | None = None) -> Workload:
    check_size(cfg)
    w = cfg.workload
    rng = np.random.default_rng(cfg.seed)
    num = w.num_steps * w.runs_per_step
    index = np.arange(num)
    batch = index // w.runs_per_step
    per_step = [step_shape(cfg, k) for k in range(w.num_steps)]
    shapes = [per_step[k] for k in batch] if w.phases else None
    work = sample_durations(w.duration, num, rng, base_dir=base_dir, shapes=shapes)
    d_scale = np.array([per_step[k].duration_scale for k in batch])
    t_scale = np.array([per_step[k].tokens_scale for k in batch])
    # A run of its step's mean duration trains its step's mean tokens.
    scale = work / (w.duration.mean_s * d_scale) if w.tokens_follow_duration else np.ones(num)
    computed = w.tokens_mean * computed_per_tree_token(cfg) * t_scale * scale
    tokens = np.minimum(w.tokens_max, np.maximum(1.0, computed))
    return Workload(
        work_s=work, tokens=np.rint(tokens).astype(np.int64),
        batch=batch, group=index // w.group_size,
        num_steps=w.num_steps, runs_per_step=w.runs_per_step, group_size=w.group_size,
    )

