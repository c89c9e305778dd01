"""Lower bounds on the makespan of a workload, whatever the policy.

- work bound: every run occupies 1/cap of a cell for its duration at best (a full cell
  runs at the reference rate 1, the least cell-time per run). Training X tokens on a
  world of w cells takes X / thr(w) wall seconds and w X / thr(w) cell-seconds; thr is
  concave in w (scaling efficiency <= 1), so by Jensen a world of constant width is
  the cheapest way to train X tokens in a given time; a run may also alternate between
  two widths (the cheap narrow one and the fast wide one). The makespan M therefore
  obeys, for the best mix of widths: X a <= M and rollout + X b <= N M, with a and b
  the mix's wall and cell-seconds per token; the bound is the least such M over every
  mix (the frontier of the widths' (a, b) points). The optimizer steps are serial with
  training (n of them add n x optimizer_step_s to its wall time) and hold the training
  world, at least one model replica's cells (n x that x optimizer_step_s cell-seconds);
  rollout goes on meanwhile, so they are not added to the makespan whole (until session
  32 they were: the bound was up to n x optimizer_step_s x (1 - replica cells / N) too
  high, and a policy could finish below it, tests/test_sim_engine.py).
- critical path: step k trains batch k, whose runs may start only once step
  k - s - 1 has finished (staleness bound s). Even alone on a cell a run takes
  work / rate(1); step k ends no sooner than its last run plus the training of that
  run's group on the fastest world, nor sooner than step k - 1 plus the whole batch
  trained on it; each plus the optimizer step.

- staged: the two joined, step by step (what a workload whose demand changes needs:
  its early steps may be bound by work and its late ones by their tails). Step k is
  trained no sooner than the work bound of steps 0..k (all their runs ended and their
  tokens trained, with k + 1 optimizer steps), nor than its critical path from the
  staged finish of the steps before; and the runs of steps k.. start no sooner than
  step k - s - 1 is trained, so the job ends no sooner than that plus the work bound of
  steps k.. alone.

- tail speed (session 53): the critical path lets a step's longest run go at rate_max,
  alone on its cell, while the work bound counts every rollout cell full; both at once
  cannot be. A cell holding n runs does n rate(n) <= cap work a second: a run at speed
  rate(n) costs its cell cap - n rate(n) of a full cell's work, at least l(r) for speed
  r, l the lower convex hull of the points (rate(n), cap - n rate(n)), (1, 0) and (0, 0)
  (a run queued or moving goes at 0 and costs nothing). Over a stay of D seconds doing
  work w, convexity makes the least cost D l(w / D). Along one chain of steps k, k + s +
  1, ... ending at the last step, one step's runs start only once the one before is
  trained, so their longest runs never share a time: the job takes at least the chain
  (each step's longest run's D, its group's training and the optimizer step), and the
  cells' time at least the work bound with those costs added to rollout; the bound is
  the least makespan over every choice of the D's (a convex trade, exact on the
  Lagrangian frontier). terminalbench-122b-growing: 215,784 -> 218,927 s; no other
  preset moved.

The bound is the largest of these (staged >= critical path). Handoff costs are not
counted: they depend on the policy, and a bound must hold for all of them.
"""

from __future__ import annotations

import numpy as np

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.sched.observe import min_train_cells
from gyre_slurm.sched.waterlevel import rate_by_load
from gyre_slurm.sim.rollout import RolloutCells
from gyre_slurm.sim.training import train_throughput
from gyre_slurm.sim.workload import Workload


def best_node_throughput(cfg: GyreConfig) -> float:
    """The highest trained tokens/s per node any training world reaches."""
    smallest = min_train_cells(cfg) * cfg.cluster.cell_nodes
    return train_throughput(cfg.training, smallest) / smallest


def lower_bound(cfg: GyreConfig, w: Workload, *, staleness: int | None = None) -> dict:
    cap = cfg.cell_capacity
    rollout_cell_s = float(w.work_s.sum()) / cap
    train_cell_s = float(w.tokens.sum()) / (best_node_throughput(cfg) * cfg.cluster.cell_nodes)
    work = work_bound(cfg, rollout_cell_s=rollout_cell_s, tokens=float(w.tokens.sum()),
                      steps=w.num_steps)
    s = cfg.training.max_staleness if staleness is None else staleness
    path = critical_path(cfg, w, staleness=s)
    staged = staged_bound(cfg, w, staleness=s)
    tail = tail_speed_bound(cfg, w, staleness=s)
    return {"lower_bound_s": max(work, path, staged, tail), "work_bound_s": work,
            "critical_path_s": path, "staged_bound_s": staged, "tail_speed_bound_s": tail,
            "rollout_cell_s": rollout_cell_s, "train_cell_s": train_cell_s}


def work_bound(cfg: GyreConfig, *, rollout_cell_s: float, tokens: float,
               steps: int = 0) -> float:
    """The least makespan M for which some mix of training widths trains `tokens`, with
    `steps` optimizer steps, within M wall seconds and, with rollout, within the cells'
    N M cell-seconds. Training at width w costs a_w = 1 / thr(w) wall and b_w = w / thr(w)
    cell-seconds per token; a run may alternate between widths, so any mix on the
    frontier of the points (a_w, b_w) is allowed. An optimizer step takes
    optimizer_step_s of training's wall time and holds at least the smallest training
    world (one model replica's cells) for it: M = min over the frontier of
    max(tokens a + steps opt, (rollout + tokens b + steps opt replica_cells) / N)."""
    num_cells = cfg.cluster.num_cells
    opt_wall = steps * cfg.training.optimizer_step_s
    opt_cell_s = opt_wall * min_train_cells(cfg)
    frontier = _lower_left_hull([(1.0 / thr, width / thr)
                                 for width, thr in _throughputs(cfg) if thr > 0])

    def cost(a: float, b: float) -> float:
        return max(tokens * a + opt_wall, (rollout_cell_s + tokens * b + opt_cell_s) / num_cells)

    best = min(cost(a, b) for a, b in frontier)
    for (a1, b1), (a2, b2) in zip(frontier, frontier[1:]):
        # Both terms are linear along the segment: the least max is at a crossing.
        f1, f2 = tokens * (a2 - a1), tokens * (b2 - b1) / num_cells
        g0 = tokens * a1 + opt_wall - (rollout_cell_s + tokens * b1 + opt_cell_s) / num_cells
        if f1 != f2:
            lam = -g0 / (f1 - f2)
            if 0.0 < lam < 1.0:
                best = min(best, cost(a1 + lam * (a2 - a1), b1 + lam * (b2 - b1)))
    return best


def fastest_throughput(cfg: GyreConfig) -> float:
    """The most tokens/s any training world trains: the widest one unless scaling
    efficiency is below 0.5 a doubling, where a wider world trains fewer tokens/s."""
    return max(thr for _width, thr in _throughputs(cfg))


def _throughputs(cfg: GyreConfig) -> list[tuple[int, float]]:
    """(width in cells, trained tokens/s) of every training world the cells can make."""
    return [(width, train_throughput(cfg.training, width * cfg.cluster.cell_nodes))
            for width in range(1, cfg.cluster.num_cells + 1)]


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of the points, in order of the first coordinate."""
    hull: list[tuple[float, float]] = []
    for p in sorted(set(points)):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def _lower_left_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no mix of others beats on both coordinates, in order of a (the lower
    convex hull, cut where b stops falling as a rises)."""
    hull = _lower_hull(points)
    out = [hull[0]]
    for p in hull[1:]:
        if p[1] < out[-1][1]:
            out.append(p)
        else:
            break
    return out


def tail_speed_bound(cfg: GyreConfig, w: Workload, *, staleness: int) -> float:
    """The least makespan where the longest runs of a chain of steps go faster than a
    full cell's rate only at the cost of their cells' work (module docstring)."""
    cap, n = cfg.cell_capacity, w.num_steps
    rates = rate_by_load(capacity=cap, llm_fraction=cfg.workload.llm_time_fraction,
                         half_load_runs=cfg.rollout.half_load_runs)
    points = [(0.0, 0.0)] + [(float(rates[k]), cap - k * float(rates[k]))
                             for k in range(1, cap + 1)]
    # (speed, cost a second) at the hull's vertices from speed 1 (a full cell, no cost) up
    speeds = [(r, cost / cap) for r, cost in _lower_hull(points) if r >= 1.0 - 1e-12]
    full, opt_s = fastest_throughput(cfg), cfg.training.optimizer_step_s
    fixed, works = 0.0, []
    for k in range((n - 1) % (staleness + 1), n, staleness + 1):
        work, train_s = _longest_run(w, k, full)
        fixed, works = fixed + train_s + opt_s, works + [work]
    rollout, tokens = float(w.work_s.sum()) / cap, float(w.tokens.sum())

    def frontier(price: float) -> tuple[float, float]:
        """(the chain's length, the cell-seconds its speed costs) where each run takes
        the speed that minimises its stay plus `price` x its cost."""
        chain = extra = 0.0
        for work in works:
            r, c = min(speeds, key=lambda v: work / v[0] * (1.0 + price * v[1]))
            chain, extra = chain + work / r, extra + work / r * c
        return fixed + chain, extra

    def cells(extra: float) -> float:
        return work_bound(cfg, rollout_cell_s=rollout + extra, tokens=tokens, steps=n)

    # the chain grows and the cells' bound falls as the price rises: the least
    # max(chain, cells) is where they cross, on the segment between two prices' choices.
    # At an infinite price every run takes speed 1 (a full cell), which costs nothing.
    (f_lo, x_lo), f_hi = frontier(0.0), fixed + sum(works)
    if f_lo >= cells(x_lo):
        return f_lo
    if f_hi <= cells(0.0):
        return cells(0.0)
    lo, hi = 0.0, 1.0
    for _ in range(200):  # a price high enough that every run takes speed 1
        f, x = frontier(hi)
        if f >= cells(x):
            break
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        f, x = frontier(mid)
        lo, hi = (mid, hi) if f < cells(x) else (lo, mid)
    (f_lo, x_lo), (f_hi, x_hi) = frontier(lo), frontier(hi)
    a, b = 0.0, 1.0  # a mix of the two choices: f rises and cells falls with t
    for _ in range(100):
        t = (a + b) / 2.0
        if f_lo + t * (f_hi - f_lo) < cells(x_lo + t * (x_hi - x_lo)):
            a = t
        else:
            b = t
    return f_lo + a * (f_hi - f_lo)  # below the crossing: still a bound


def critical_path(cfg: GyreConfig, w: Workload, *, staleness: int) -> float:
    return float(_step_finishes(cfg, w, staleness=staleness)[-1])


def staged_bound(cfg: GyreConfig, w: Workload, *, staleness: int) -> float:
    """The critical path where each step also waits for the work bound of the steps up
    to it; and the job, for the work of the steps whose runs start after each step."""
    n = w.num_steps
    cap = cfg.cell_capacity
    work = np.bincount(w.batch, weights=w.work_s, minlength=n) / cap
    tokens = np.bincount(w.batch, weights=w.tokens, minlength=n)
    done_by = [work_bound(cfg, rollout_cell_s=float(work[:k + 1].sum()),
                          tokens=float(tokens[:k + 1].sum()), steps=k + 1)
               for k in range(n)]
    finish = _step_finishes(cfg, w, staleness=staleness, floor=done_by)
    end = float(finish[-1])
    for k in range(staleness + 1, n):  # steps k.. start once step k - s - 1 is trained
        rest = work_bound(cfg, rollout_cell_s=float(work[k:].sum()),
                          tokens=float(tokens[k:].sum()), steps=n - k)
        end = max(end, float(finish[k - staleness - 1]) + rest)
    return end


def _longest_run(w: Workload, step: int, full: float) -> tuple[float, float]:
    """Step `step`'s longest run: its work, and its group's training on a world that
    trains `full` tokens/s (what follows it on the critical path)."""
    sel = slice(step * w.runs_per_step, (step + 1) * w.runs_per_step)
    last = int(np.argmax(w.work_s[sel])) + step * w.runs_per_step
    return float(w.work_s[last]), float(w.tokens[w.group == w.group[last]].sum()) / full


def _step_finishes(cfg: GyreConfig, w: Workload, *, staleness: int,
                   floor: list[float] | None = None) -> np.ndarray:
    """When each step is trained at the earliest along the critical path (no sooner
    than `floor[k]` either, where given)."""
    cells = RolloutCells(num_cells=1, capacity=cfg.cell_capacity,
                         llm_fraction=cfg.workload.llm_time_fraction,
                         half_load_runs=cfg.rollout.half_load_runs, num_runs=0)
    rate = cells.rate_max
    full = fastest_throughput(cfg)
    opt_s = cfg.training.optimizer_step_s
    finish = np.zeros(w.num_steps)
    for k in range(w.num_steps):
        sel = slice(k * w.runs_per_step, (k + 1) * w.runs_per_step)
        work, train_s = _longest_run(w, k, full)
        start = finish[k - staleness - 1] if k - staleness - 1 >= 0 else 0.0
        prev = finish[k - 1] if k >= 1 else 0.0
        tail = max(prev, start + work / rate) + train_s
        whole = prev + float(w.tokens[sel].sum()) / full
        finish[k] = max(tail, whole) + opt_s
        if floor is not None:
            finish[k] = max(finish[k], floor[k])
    return finish
