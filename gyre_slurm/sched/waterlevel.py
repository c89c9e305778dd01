"""The waterlevel (docs/scheduler.md) and the demand forecast behind it. Pure numpy.

- demand = runs in flight + runs allowed to start now
- waterlevel L = demand / capacity_per_cell: how many cells rollout needs now
- forecast: the expected demand a horizon H from now, from the survival function of the
  run-duration distribution: a run that has been going for `a` seconds is still going at
  `a + H` with probability S(a + H) / S(a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def waterlevel(*, runs_in_flight: int, runs_queued: int, cell_capacity: int) -> float:
    return (runs_in_flight + runs_queued) / cell_capacity


def rate_by_load(*, capacity: int, llm_fraction: float, half_load_runs: float) -> np.ndarray:
    """A run's speed on a cell holding n runs (n = 0..capacity), relative to a full cell:
    only the model-call share of a run's time slows down as the cell fills (the rollout
    model of the simulator, gyre_slurm/sim/rollout.py, which uses this)."""
    n = np.arange(capacity + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        rates = 1.0 / ((1 - llm_fraction) + llm_fraction * (n + half_load_runs)
                       / (capacity + half_load_runs))
    if capacity >= 1 and not np.isfinite(rates[0]):
        # All of a run's time on the model and no half-load point (llm_time_fraction 1,
        # half_load_runs 0): an empty cell's speed would be infinite, which advanced the
        # simulator's clocks to infinity and ended the next run at once. A run that
        # arrives on an empty cell is alone on it.
        rates[0] = rates[1]
    return rates


@dataclass(frozen=True)
class DurationModel:
    """Survival function of run durations, tabulated on a log grid for fast lookup."""

    grid_s: np.ndarray  # increasing durations
    survival: np.ndarray  # P(duration > grid_s[i])

    @classmethod
    def lognormal(cls, *, mean_s: float, sigma: float, max_s: float | None = None,
                  num_points: int = 512) -> "DurationModel":
        sigma = max(sigma, 1e-3)
        mu = math.log(mean_s) - sigma * sigma / 2
        lo, hi = math.exp(mu - 6 * sigma), math.exp(mu + 6 * sigma)
        if max_s is not None:
            hi = min(hi, max_s)
            lo = min(lo, max_s / 2)
        grid = np.geomspace(lo, hi, num_points)
        surv = np.array([0.5 * math.erfc((math.log(x) - mu) / (sigma * math.sqrt(2))) for x in grid])
        if max_s is not None:
            surv[-1] = 0.0  # nothing outlives the agent's time limit
        return cls(grid_s=grid, survival=surv)

    @classmethod
    def empirical(cls, durations_s: np.ndarray) -> "DurationModel":
        d = np.sort(np.asarray(durations_s, dtype=float))
        if d.size == 0:
            raise ValueError("an empirical duration model needs at least one duration")
        surv = 1.0 - np.arange(1, d.size + 1) / d.size
        return cls(grid_s=d, survival=surv)

    def sf(self, x_s: np.ndarray) -> np.ndarray:
        return np.interp(x_s, self.grid_s, self.survival, left=1.0, right=0.0)

    def expected_remaining_runs(self, elapsed_s: np.ndarray, horizon_s: float) -> float:
        """Expected count of the given in-flight runs still running `horizon_s` from now."""
        if elapsed_s.size == 0:
            return 0.0
        now = self.sf(elapsed_s)
        later = self.sf(elapsed_s + horizon_s)
        # Runs already past the model's support (slowed by load): assume half stay.
        ratio = np.where(now > 1e-9, later / np.maximum(now, 1e-9), 0.5)
        return float(ratio.sum())

    def mean_s(self) -> float:
        """The mean duration: the integral of the survival function (kept: the outlook
        asks for it at every decision)."""
        mean = self.__dict__.get("_mean_s")
        if mean is None:
            grid = np.concatenate(([0.0], self.grid_s))
            surv = np.concatenate(([1.0], self.survival))
            mean = float(np.sum((surv[1:] + surv[:-1]) * np.diff(grid)) / 2)
            object.__setattr__(self, "_mean_s", mean)  # not a field: frozen, as before
        return mean


@dataclass(frozen=True)
class StepDurations:
    """A duration model per training step (workload phases: durations change as training
    goes); a run in flight is expected from its own step's model."""

    models: tuple[DurationModel, ...]

    @classmethod
    def of(cls, model: "DurationModel | StepDurations") -> "StepDurations":
        return model if isinstance(model, StepDurations) else cls((model,))

    def at(self, step: int) -> DurationModel:
        return self.models[min(max(int(step), 0), len(self.models) - 1)]

    def expected_remaining_runs(self, elapsed_s: np.ndarray, horizon_s: float,
                                steps: np.ndarray | None = None) -> float:
        """Expected count of the in-flight runs (of steps `steps`, None: the first
        model's) still running `horizon_s` from now."""
        if steps is None or len(self.models) == 1:
            return self.models[0 if steps is None else 0].expected_remaining_runs(
                elapsed_s, horizon_s)
        total = 0.0
        for step in np.unique(steps):
            mine = steps == step
            total += self.at(step).expected_remaining_runs(elapsed_s[mine], horizon_s)
        return total
