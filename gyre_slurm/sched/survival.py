"""What a run-duration model says about runs: those in flight at their ages (how many
are expected still running how far ahead, their remaining work and expected end), the
longest of fresh ones, and how long a cell's runs take to leave it when they migrate.
Pure numpy; the outlook and the elastic policy both use it."""

from __future__ import annotations

import numpy as np

from gyre_slurm.sched.waterlevel import DurationModel


def alive_curve(model: DurationModel, elapsed_s: np.ndarray, *, points: int = 32,
                xs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Runs in flight at these ages: the expected number still running x reference
    seconds from now, on a grid of x (starting at 0; `xs`: this grid)."""
    weight = 1.0
    if elapsed_s.size > 1024:  # many runs: their ages' quantiles stand for them
        weight = elapsed_s.size / 1024
        elapsed_s = np.quantile(elapsed_s, (np.arange(1024) + 0.5) / 1024)
    now = np.maximum(model.sf(elapsed_s), 1e-12)
    if xs is None:
        hi = max(float(model.grid_s[-1]), float(elapsed_s.max()) * 2.0, 1.0)
        xs = np.concatenate(([0.0], np.geomspace(hi * 1e-4, hi, points)))
    later = model.sf(elapsed_s[None, :] + xs[:, None])
    # Past the model's support (a run slowed by load): expect it to end within its age.
    stale = now <= 1e-9
    ratio = np.where(stale[None, :], (xs[:, None] < elapsed_s[None, :]).astype(float),
                     later / now[None, :])
    return xs, ratio.sum(axis=1) * weight


def mixed_alive_curve(models: list[DurationModel], ages: list[np.ndarray], *,
                      points: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """`alive_curve` of runs of several steps in flight, each step's runs by its own
    duration model (with workload phases, a new step's runs may be 60x longer than the
    last one's), summed on one grid."""
    if len(models) == 1:
        return alive_curve(models[0], ages[0], points=points)
    hi = max(max(float(m.grid_s[-1]) for m in models),
             max(float(a.max()) for a in ages) * 2.0, 1.0)
    xs = np.concatenate(([0.0], np.geomspace(hi * 1e-4, hi, points)))
    return xs, sum(alive_curve(m, a, xs=xs)[1] for m, a in zip(models, ages))


def residual_tail(model: DurationModel, elapsed_s: np.ndarray, *, points: int = 32,
                  alive_target: float | None = None,
                  curve: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float]:
    """Of runs in flight at these ages: their expected total remaining time, and their
    expected end: the time by which fewer than `alive_target` of them are expected still
    to run (default n / (n + 1) of n runs: the longest of them, as `longest_of`)."""
    n = elapsed_s.size
    if n == 0:
        return 0.0, 0.0
    target = n / (n + 1) if alive_target is None else alive_target
    xs, alive = curve if curve is not None else alive_curve(model, elapsed_s, points=points)
    hi = float(xs[-1])
    work = float(np.sum((alive[1:] + alive[:-1]) * np.diff(xs)) / 2)
    below = np.flatnonzero(alive < target)
    if not below.size:
        return work, hi
    i = int(below[0])
    if i == 0:
        return work, 0.0
    a0, a1 = alive[i - 1], alive[i]  # interpolate the crossing between grid points
    frac = (a0 - target) / max(a0 - a1, 1e-12)
    return work, float(xs[i - 1] + frac * (xs[i] - xs[i - 1]))


def longest_of(model: DurationModel, num: int) -> float:
    """The expected longest of `num` fresh runs (the quantile 1 - 1/(num + 1))."""
    if num <= 0:
        return 0.0
    q = 1.0 / (num + 1)
    surv = model.survival
    i = int(np.searchsorted(-surv, -q))  # first grid point with S <= q
    return float(model.grid_s[min(i, len(model.grid_s) - 1)])


def migrate_wait_s(call_interval_s: float, runs: int) -> float:
    """How long a cell's `runs` take to leave it when they migrate: each at its next
    model call, the gaps between calls taken as exponential (memoryless: a run's wait
    from now is a whole gap), so the last of n leaves after H_n mean gaps."""
    return call_interval_s * sum(1.0 / i for i in range(1, max(0, runs) + 1))
