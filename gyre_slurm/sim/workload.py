"""Sampling a workload: every run of every step, its duration and its trained tokens.

Runs are ordered by step, then group (prompt), then member. A run's duration is its
wall time at the reference load (a full cell); its prefix tree's tokens grow with its
duration (`tokens_mean` at the mean duration; every run `tokens_mean` with
`tokens_follow_duration: false`). The tokens a run costs the trainer are those it
computes: the tree's tokens with `training.packing: tree`, `workload.rows_reread` times
as many with `rows`; at most `tokens_max`.
Deterministic for a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gyre_slurm.config.schema import DurationConfig, GyreConfig
from gyre_slurm.config.trace import load_trace


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
                     *, base_dir: Path | None = None) -> np.ndarray:
    if cfg.dist == "trace":
        trace = load_trace(cfg.trace_file, base_dir=base_dir)
        out = rng.choice(trace, size=num, replace=True)
    else:
        mu = math.log(cfg.mean_s) - cfg.sigma ** 2 / 2
        out = rng.lognormal(mean=mu, sigma=cfg.sigma, size=num)
    if cfg.max_s is not None:
        out = np.minimum(out, cfg.max_s)
    return out.astype(np.float64)


def sample_workload(cfg: GyreConfig, *, base_dir: Path | None = None) -> Workload:
    w = cfg.workload
    rng = np.random.default_rng(cfg.sim.seed)
    num = w.num_steps * w.runs_per_step
    work = sample_durations(w.duration, num, rng, base_dir=base_dir)
    mean = w.duration.mean_s
    scale = work / mean if w.tokens_follow_duration else np.ones_like(work)
    computed = w.tokens_mean * computed_per_tree_token(cfg) * scale
    tokens = np.minimum(w.tokens_max, np.maximum(1.0, computed))
    index = np.arange(num)
    return Workload(
        work_s=work, tokens=np.rint(tokens).astype(np.int64),
        batch=index // w.runs_per_step, group=index // w.group_size,
        num_steps=w.num_steps, runs_per_step=w.runs_per_step, group_size=w.group_size,
    )


def computed_per_tree_token(cfg: GyreConfig) -> float:
    """Tokens the trainer computes per token of a run's prefix tree (its packing)."""
    return 1.0 if cfg.training.packing == "tree" else cfg.workload.rows_reread
