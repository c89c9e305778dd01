"""The outlook behind every elastic decision: a fluid model of the next few steps.

Given what is known now (runs in flight with their ages, runs queued and still to be
allowed, tokens waiting for training, the workload's per-step prior) and a layout
*plan* (how many cells roll out and train from when on), `finish_s` predicts when the
last step of the horizon is trained. The policy compares plans: staying, moving m
cells to the other side. The handoff costs are inside the plans (a moving cell serves neither side while
it moves), so a move is worth making only when what it gains on one side outweighs
what it costs the other over the horizon: a cell reclaimed for a queue that training
needs more is refused.

The model, per step k of the horizon (every quantity an expectation from the prior):
- rollout is a fluid of run slots S(t) = cap x rollout cells(t): the work of runs in
  flight (their expected remaining time) and of the runs not yet started, in step
  order, each step's new runs no sooner than the step is allowed (A_k: now, or when
  step k - s - 1 is trained), in cohorts as slots free up; step k's rollout ends when
  fewer than n / (n + 1) of all its n runs (in flight and in every cohort) are expected
  still running, no sooner than any cohort's own longest run;
- training trains step k at tokens/s thr(train cells(t)) (whole replicas only, with the
  scaling efficiency per doubling); it ends at
  TE_k = max(TE_{k-1} + tokens_k, F_k + a group's tokens) in trained tokens (streaming;
  without streaming the step starts at max(TE_{k-1}, F_k)), plus the optimizer step.
Pure numpy, no clock, no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from gyre_slurm.sched.survival import alive_curve, longest_of, migrate_wait_s, residual_tail
from gyre_slurm.sched.types import Observation
from gyre_slurm.sched.waterlevel import DurationModel, StepDurations


class Capacity:
    """A piecewise-constant rate over time, from `t0` on; changes are added as deltas of
    a count, converted to a rate by `rate_of(count)`."""

    def __init__(self, t0: float, count: float, rate_of: Callable[[float], float]):
        self.rate_of = rate_of
        self.times = [t0]
        self.counts = [count]
        self._rates: list[float] | None = None

    def change(self, t: float, delta: float) -> None:
        i = bisect.bisect_right(self.times, t)
        if i > 0 and self.times[i - 1] == t:
            i -= 1
        else:
            self.times.insert(i, t)
            self.counts.insert(i, self.counts[i - 1] if i > 0 else self.counts[0])
        for j in range(i, len(self.counts)):
            self.counts[j] = max(0.0, self.counts[j] + delta)
        self._rates = None

    def copy(self) -> "Capacity":
        out = Capacity(self.times[0], self.counts[0], self.rate_of)
        out.times, out.counts = list(self.times), list(self.counts)
        return out

    def counts_at(self, ts: np.ndarray) -> np.ndarray:
        idx = np.maximum(np.searchsorted(self.times, ts, side="right") - 1, 0)
        return np.asarray(self.counts)[idx]

    def count_at(self, t: float) -> float:
        return self.counts[max(0, bisect.bisect_right(self.times, t) - 1)]

    def rates(self) -> list[float]:
        if self._rates is None:
            self._rates = [self.rate_of(c) for c in self.counts]
        return self._rates

    def solve(self, t0: float, amount: float) -> float:
        """The time by which `amount` has been served from `t0` on (inf: never)."""
        if amount <= 0:
            return t0
        rates = self.rates()
        i = max(0, bisect.bisect_right(self.times, t0) - 1)
        t = max(t0, self.times[0])
        while True:
            end = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            rate = rates[i]
            if rate > 0 and t + amount / rate <= end:
                return t + amount / rate
            if end == math.inf:
                return math.inf
            amount -= rate * (end - t)
            t, i = end, i + 1


@dataclass(frozen=True)
class StepOutlook:
    step: int
    allowed: bool  # its runs may start now
    inflight: int  # its runs in flight
    inflight_work_s: float  # their expected remaining time (run-seconds)
    inflight_tail_s: float  # when the last of them is expected to end (from now)
    new_runs: int  # its runs not started yet
    mean_s: float  # a run's expected duration
    longest_s: float  # the expected longest of its new runs
    tokens: float  # tokens left to train in this step
    group_tokens: float  # tokens of one group (the last one trains after its last run)
    run_tokens: float = 0.0  # tokens of one of its runs not finished yet
    # Tokens of its finished runs whose groups are still open (the step being trained):
    # trainable only when their groups' last runs end, so they arrive with the runs
    # still to end, not now.
    waiting_tokens: float = 0.0
    model: DurationModel | None = None  # durations of its new runs
    alive_xs: np.ndarray | None = None  # its runs in flight: expected number still
    alive: np.ndarray | None = None  # running at now + x (reference seconds)


@dataclass
class Outlook:
    now_s: float
    steps: list[StepOutlook]
    staleness: int
    streaming: bool
    cap: int  # run slots per rollout cell
    optimizer_step_s: float
    train_rate: Callable[[float], float]  # tokens/s of a world of that many cells
    speed: Callable[[float], float] = lambda load: 1.0  # a run's speed at a cell's load
    concurrency: int = 0  # runs a staleness window holds (0: those known now)
    trained_before: dict[int, float] = field(default_factory=dict)  # TE of steps before
    lend: tuple[float, float, int, float, float] | None = None  # (to train, to rollout)
    #   handoff seconds, cells at most, the mean time between a run's calls (a lent cell's
    #   runs migrate at their next), and the wait to join the training world between
    #   micro-batches: spare rollout cells train in steps' tails (the policy lends them)
    steps_after: int = 0  # steps of the job after the horizon's last
    hidden: int = 0  # steps at the end of `steps` past the horizon: simulated only for
    #                  the lending in their tails (the horizon's last step trains then)

    def _speed(self, runs: float, cells: float) -> float:
        """A run's speed when `runs` share `cells` rollout cells (lighter cells decode
        faster; a full cell is the reference the durations are given at)."""
        if cells <= 0 or runs <= 0:
            return 1.0
        return self.speed(min(self.cap, runs / cells))

    def _start_new(self, s: StepOutlook, rollout: Capacity, allowed: float,
                   window: float) -> float:
        """Start a step's new runs as run slots free up (from when it is allowed), in
        cohorts of at most a quarter of the slots (at least 1/48 of the runs): each starts
        once its runs fit beside those in flight then (the runs in flight now, earlier
        steps' and this step's earlier cohorts). Returns when its last run should end."""
        if math.isinf(allowed):
            return math.inf
        least = max(1.0, rollout.count_at(allowed) * self.cap)
        part = min(s.new_runs, max(1.0, s.new_runs / 48.0, min(s.new_runs / 4.0, least / 4.0)))
        parts = max(1, int(math.ceil(s.new_runs / part - 1e-9)))
        part = s.new_runs / parts
        span = (1.0 + s.new_runs / least) * s.mean_s + s.longest_s

        def grid(span: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Times over the span, the run slots and the runs in flight at each."""
            ts = allowed + linspace(0.0, span, 64)
            return ts, rollout.counts_at(ts) * self.cap, occupancy(self, ts)

        ts, slots, occ = grid(span)
        longest = longest_of(s.model, max(1, int(round(part))))
        end, start = allowed, allowed
        fits = min(part, max(slots.max(), 1.0) - 0.5)  # room a cohort needs
        after = ts >= start
        added = None  # (start, speed, its runs in flight on ts): cohorts often start together
        for _ in range(parts):
            room = (slots - occ >= fits) & after
            hit = room.argmax()  # the first point with room (0 if none)
            for _ in range(4):  # not within the span: look twice as far, up to 16x
                if room[hit]:
                    break
                # (the fluid from the span's end alone started every run left there at
                # once: with a queue many times the run slots, 3 cells of 2 slots,
                # a step's rollout was expected in a fifth of its time)
                span *= 2.0
                ts, slots, occ = grid(span)
                after = ts >= start
                added = None
                room = (slots - occ >= fits) & after
                hit = room.argmax()
            if room[hit]:
                start = float(ts[hit])
            else:  # not within 16 spans: the fluid of run slots
                start = rollout.solve(ts[-1], part * s.mean_s)
            if math.isinf(start):
                return math.inf
            speed = self._speed(window, rollout.count_at(start))
            self.cohorts.append((s.step, start, part, s.model, speed))
            if added is None or added[0] != start or added[1] != speed:
                after = ts >= start
                added = (start, speed, np.where(
                    after, part * s.model.sf(np.maximum(ts - start, 0.0) * speed), 0.0))
            occ = occ + added[2]
            end = max(end, start + longest / speed)
        return end

    def _last_end(self, s: StepOutlook, end: float) -> float:
        """When a step's last run is expected to end: once fewer than n / (n + 1) of its
        n runs (in flight now and in every cohort started) are expected still running.
        `end`, the latest of each cohort's own longest run, is a floor: the longest of a
        step's 12 runs outlasts the longest of each of its 4 cohorts of 3 (at sigma 1.5,
        8 cells of 2 slots, every decision expected the horizon trained a quarter sooner
        than it was)."""
        mine = [c for c in self.cohorts if c[0] == s.step]
        n = s.inflight + sum(c[2] for c in mine)
        if not mine or n <= 1 or not math.isfinite(end):
            return end
        target = n / (n + 1)
        lo = max(c[1] for c in mine)  # after the last cohort starts, fewer and fewer run
        slow = min(c[4] for c in mine)
        hi = max(end, lo + longest_of(s.model, int(math.ceil(n))) / slow)
        for _ in range(6):
            ts = linspace(lo, hi, 48)
            alive = occupancy(self, ts, step=s.step)
            below = np.flatnonzero(alive < target)
            if below.size:
                i = int(below[0])
                if i == 0:
                    return end
                a0, a1 = alive[i - 1], alive[i]
                frac = (a0 - target) / max(a0 - a1, 1e-12)
                return max(end, float(ts[i - 1] + frac * (ts[i] - ts[i - 1])))
            lo, hi = hi, lo + 2.0 * (hi - lo)
        return max(end, hi)

    def finish_s(self, rollout: Capacity, train: Capacity) -> tuple[float, list[float], list[float]]:
        """When the horizon's last step is trained under this plan; and per step, the
        rollout end F_k and the training end TE_k. Steps are trained in order, each as
        soon as the step it allows is rolled out: with `lend`, the rollout cells that
        step's tail leaves spare train meanwhile (`_lend`)."""
        te: dict[int, float] = dict(self.trained_before)
        self.cohorts: list[tuple[int, float, float, DurationModel, float]] = []
        self.lent_cell_s = 0.0  # cell-seconds lent cells train (expected)
        if self.lend is not None:  # lending changes the capacities: the plan's own stay
            rollout, train = rollout.copy(), train.copy()
        rollout_end: list[float] = []
        train_end: list[float] = []
        active = sum(s.inflight + (s.new_runs if s.allowed else 0) for s in self.steps)
        now_speed = self._speed(active, rollout.count_at(self.now_s))
        self.now_speed = now_speed
        window = self.concurrency or active
        n = len(self.steps)
        for i, s in enumerate(self.steps):
            while len(train_end) < i - self.staleness:  # the steps allowing this one
                self._train_next(train, rollout_end, train_end, te)
            allowed = self.now_s if s.allowed else te.get(s.step - self.staleness - 1, self.now_s)
            end = self.now_s + s.inflight_tail_s / now_speed
            if s.new_runs and s.model is not None:
                end = max(end, self._start_new(s, rollout, allowed, window))
                end = self._last_end(s, end)
            rollout_end.append(end)
            j = i - self.staleness  # its training end allows the step after this one
            final = i + 1 == n and self.steps_after == 0  # the job's last: lent for good
            if self.lend is not None and j >= len(train_end) and (final or not (
                    i + 1 < n and self.steps[i + 1].allowed)):
                while len(train_end) < j:
                    self._train_next(train, rollout_end, train_end, te)
                self._lend(i, rollout, train, rollout_end, train_end, te, final=final)
        while len(train_end) < n:
            self._train_next(train, rollout_end, train_end, te)
        shown = n - self.hidden
        return train_end[shown - 1], rollout_end[:shown], train_end[:shown]

    def _train_next(self, train: Capacity, rollout_end: list[float], train_end: list[float],
                    te: dict[int, float]) -> float:
        """Train the next step of the horizon (its rollout end is known)."""
        j = len(train_end)
        s, end = self.steps[j], rollout_end[j]
        prev_te = train_end[-1] if train_end else self.now_s
        if self.streaming:
            t = _streamed_end(self, s, train, prev_te, end)
        else:
            t = train.solve(max(prev_te, end), s.tokens)
        train_end.append(t + self.optimizer_step_s)
        te[s.step] = train_end[-1]
        return train_end[-1]

    def _lend(self, i: int, rollout: Capacity, train: Capacity, rollout_end: list[float],
              train_end: list[float], te: dict[int, float], *, final: bool) -> None:
        """Step i's tail: once its last runs have started and until the step after it is
        allowed (when the step `staleness` before it is trained), the rollout cells its
        runs in flight leave spare (all but one, `lend[2]` at most) train, arriving once
        their runs have migrated (each at its next model call, `lend[3]` apart on
        average: a cell of the mean load then) and a handoff later; they go back when
        that step is trained and serve rollout again a handoff later. A cell that would
        arrive after that is not lent. In the job's last step (`final`) they train to
        the end."""
        h_t, h_r, most, call_s, join_s = self.lend
        s = self.steps[i]
        starts = [c[1] for c in self.cohorts if c[0] == s.step]
        lo = max([self.now_s] + starts)
        hi = rollout_end[i]
        if not lo < hi < math.inf:
            self._train_next(train, rollout_end, train_end, te)
            return
        ts = linspace(lo, hi, 16)
        cells = rollout.counts_at(ts)
        occ = occupancy(self, ts)
        spare = np.minimum(np.floor(cells - occ / self.cap + 1e-9), cells - 1)
        # A cell is lent only to a training world that trains (a whole replica: the
        # lending rule's own precondition); a plan with no training side lends nothing
        # (without floors, elastic-nofloor, plans with no training cell were credited
        # lent cells that never came: deepswe-122b-curriculum 26% slower than elastic).
        trains = np.array([train.rate_of(c) > 0 for c in train.counts_at(ts)])
        spare = np.where(trains, spare, 0.0)
        spare = np.maximum.accumulate(np.clip(spare, 0, most))
        steps = np.diff(np.concatenate(([0.0], spare)))
        load = occ / np.maximum(cells, 1)
        wait = np.array([migrate_wait_s(call_s, max(1, int(x))) for x in load])
        # (when lent, cells, when they arrive in training)
        lent = [(float(t), float(d), float(t + w + h_t + join_s))
                for t, d, w in zip(ts, steps, wait) if d > 0]
        for t, d, at in lent:
            rollout.change(t, -d)
            train.change(at, +d)
        until = self._train_next(train, rollout_end, train_end, te)
        while final and len(train_end) < len(self.steps):
            until = self._train_next(train, rollout_end, train_end, te)
        kept = 0.0
        for t, d, at in lent:
            if at >= until:  # too late to train any of it: not lent
                rollout.change(t, +d)
                train.change(at, -d)
            else:
                kept += d
        if kept and not final:
            train.change(until, -kept)
            rollout.change(until + h_r, +kept)
        self.lent_cell_s += sum((until - at) * d for t, d, at in lent if at < until)


LEVELS = np.array([0.25, 0.5, 0.75, 0.9, 0.97])


def _streamed_end(outlook: "Outlook", s: StepOutlook, train: Capacity, prev_te: float,
                  end: float) -> float:
    """When step k is trained, streaming: no sooner than its tokens arrive. A group's
    tokens arrive when its last run ends (the group baseline needs every reward): runs in
    flight one by one, or, where finished runs of the step wait in open groups
    (`waiting_tokens`), with those tokens by groups of the runs in flight spread evenly
    over the open groups (their groups are not observed); new runs by groups of the
    step, started with their cohorts. At each level q of the step's tokens arrived, the
    rest trains after that time; nothing trains before its first group has ended."""
    now = outlook.now_s
    todo = (s.inflight + s.new_runs) * s.run_tokens + s.waiting_tokens
    t = train.solve(max(prev_te, now), s.tokens)
    if todo <= 0 or not now < end < math.inf:
        return max(t, train.solve(max(prev_te, end), min(s.group_tokens, s.tokens)))
    ts = linspace(now, end, 24)
    arrived = np.zeros_like(ts)
    if s.inflight:
        ended = 1.0 - occupancy(outlook, ts, step=s.step, new=False) / s.inflight
        if s.waiting_tokens > 0:
            # The open groups: their finished runs' tokens and those in flight arrive when
            # a group's last run ends; m of a group's runs in flight have all ended
            # with probability ended^m (the in-flight runs spread evenly over the groups).
            open_runs = s.inflight + s.waiting_tokens / max(s.run_tokens, 1e-9)
            size = max(1.0, s.group_tokens / max(s.run_tokens, 1e-9))
            m = max(1.0, s.inflight / max(1.0, open_runs / size))
            arrived += open_runs * s.run_tokens * np.clip(ended, 0.0, 1.0) ** m
        else:
            arrived += s.inflight * s.run_tokens * ended
    cohorts = [c for c in getattr(outlook, "cohorts", ()) if c[0] == s.step]
    if cohorts and s.model is not None:
        # A cohort's runs start together: a group of g of them has ended with prob F^g.
        g = max(1.0, min(s.group_tokens / max(s.run_tokens, 1e-9), s.new_runs))
        last, term = None, None  # cohorts often start together: the same term again
        for cohort in cohorts:
            if not _same_cohort(cohort, last):
                _, start, count, model, speed = last = cohort
                age = np.maximum(ts - start, 0.0) * speed
                ended = np.where(ts > start, 1.0 - model.sf(age), 0.0) ** g
                term = count * ended * s.run_tokens
            arrived += term
    arrived = np.maximum.accumulate(arrived)
    first = min(todo, s.group_tokens if cohorts else s.run_tokens)
    levels = np.concatenate(([first / todo], LEVELS))
    at = np.interp(levels * arrived[-1], arrived, ts)
    for i, (level, when) in enumerate(zip(levels.tolist(), at.tolist())):  # as floats
        left = todo if i == 0 else (1.0 - level) * todo
        t = max(t, train.solve(max(prev_te, float(when)), left))
    return max(t, train.solve(max(prev_te, end), min(s.group_tokens, s.tokens)))


def occupancy(outlook: "Outlook", times: np.ndarray, *, step: int | None = None,
              new: bool = True) -> np.ndarray:
    """The expected runs in flight at these times (of one step, or all), from the runs in
    flight now (by their survival) and the new runs' cohorts started so far."""
    occ = np.zeros_like(times, dtype=float)
    speed_now = getattr(outlook, "now_speed", 1.0)
    for s in outlook.steps:
        if s.inflight and s.alive is not None and step in (None, s.step):
            occ += np.interp((times - outlook.now_s) * speed_now, s.alive_xs, s.alive,
                             right=0.0)
    last, term = None, None  # cohorts often start together: the same term again
    for cohort in getattr(outlook, "cohorts", ()) if new else ():
        if step in (None, cohort[0]):
            if not _same_cohort(cohort, last):
                _, start, count, model, speed = last = cohort
                age = np.maximum(times - start, 0.0) * speed
                term = np.where(times >= start, count * model.sf(age), 0.0)
            occ += term
    return occ


def _same_cohort(a: tuple, b: tuple | None) -> bool:
    """Cohorts (step, start, runs, model, speed) whose runs in flight are the same curve."""
    return b is not None and a[1] == b[1] and a[2] == b[2] and a[3] is b[3] and a[4] == b[4]


def linspace(start: float, stop: float, num: int) -> np.ndarray:
    """`np.linspace(start, stop, num)`, the same floats (its arithmetic, step by step),
    without its generality's overhead: the outlook makes tens of thousands of grids."""
    step = (stop - start) / (num - 1) if num > 1 else 0.0
    if step == 0 or not math.isfinite(step):  # numpy's special cases
        return np.linspace(start, stop, num)
    y = _ARANGE.get(num)
    if y is None:
        y = _ARANGE[num] = np.arange(num, dtype=float)
    y = y * step
    y += start
    y[-1] = stop
    return y


_ARANGE: dict[int, np.ndarray] = {}
SPEED_CACHE = 4096  # WorkloadPrior.speed's memo, entries at most


def train_rate_fn(cell_tokens_s: float, *, min_cells: int, efficiency: float) -> Callable[[float], float]:
    """Tokens/s of a training world of c cells: whole replicas of `min_cells` only,
    `efficiency` kept per doubling beyond one replica."""
    cache: dict[int, float] = {}

    def rate(c: float) -> float:
        usable = int(c + 1e-9) // max(1, min_cells) * max(1, min_cells)
        if usable not in cache:
            cache[usable] = 0.0 if usable <= 0 else (
                cell_tokens_s * usable * efficiency ** math.log2(usable / max(1, min_cells)))
        return cache[usable]
    return rate


@dataclass(frozen=True)
class WorkloadPrior:
    """What the policy knows of the workload ahead, from the config (each observation
    brings the measured rest: throughput, tokens per run, handoff costs)."""

    durations: StepDurations
    tokens_scale: tuple[float, ...] = (1.0,)  # per step, relative to the workload's
    runs_per_step: int = 0  # 0: unknown (the outlook then sees only the runs allowed now)
    group_size: int = 1
    staleness: int = 1
    streaming: bool = True
    scaling_efficiency: float = 1.0  # training throughput kept per doubling
    optimizer_step_s: float = 0.0
    rate_by_load: tuple[float, ...] = ()  # a run's speed on a cell by its load (empty: 1)
    reprefill_s: float = 0.0  # a migrated run's extra time
    microbatch_tokens: float = 0.0  # a cell joins the training world between micro-batches

    _speeds: dict[float, float] = field(default_factory=dict, init=False, repr=False,
                                        compare=False)  # speed by load, as asked

    @property
    def window(self) -> int:
        """Runs a staleness window holds (a step's runs x (staleness + 1)); 0: unknown."""
        return self.runs_per_step * (self.staleness + 1) if self.runs_per_step > 0 else 0

    def speed(self, load: float) -> float:
        """A run's speed on a cell of this load, relative to a full cell."""
        if len(self.rate_by_load) < 2:
            return 1.0
        out = self._speeds.get(load)
        if out is None:  # the outlook asks for the same few loads again and again
            if len(self._speeds) >= SPEED_CACHE:  # loads are floats: a coordinator that
                self._speeds.clear()  # runs for days must not keep every one it saw
            out = self._speeds[load] = float(
                np.interp(load, np.arange(len(self.rate_by_load)), self.rate_by_load))
        return out

    def shifts(self, ref: int, step: int, *, factor: float = 1.25) -> bool:
        """The balance of the work changes between steps `ref` and `step`: a run's duration
        per trained token differs by more than `factor` (a phase change; runs that grow
        in both alike keep the balance, and the split that suits it)."""
        d = self.durations.at(step).mean_s() / max(self.durations.at(ref).mean_s(), 1e-12)
        return abs(math.log(max(d / self.tokens_ratio(step, ref), 1e-12))) > math.log(factor)

    def alike(self, ref: int, step: int) -> bool:
        """Steps `ref` and `step` have the same shape: one duration model (the prior
        builds one per distinct shape) and the same tokens per run."""
        return (self.durations.at(step) is self.durations.at(ref)
                and self.tokens_ratio(step, ref) == 1.0)

    def tokens_ratio(self, step: int, ref: int) -> float:
        ts = self.tokens_scale
        at = lambda k: ts[min(max(k, 0), len(ts) - 1)]  # noqa: E731
        return at(step) / at(ref)


def build_outlook(obs: Observation, p: WorkloadPrior, *, horizon_steps: int,
                  streaming: bool, lend_cells: int = 0) -> Outlook:
    """The outlook of an observation: the steps allowed now and `horizon_steps` more,
    each with its runs in flight (their survival), its runs queued or still to come (the
    queued ones are the latest allowed: runs start in order) and its tokens to train."""
    v = obs.policy_version
    rps = p.runs_per_step
    if rps > 0:
        allowed_end = obs.num_steps * rps - obs.runs_future  # run index past the allowed
        last_allowed = max(v, math.ceil(allowed_end / rps) - 1)
    else:
        allowed_end, last_allowed = 0, v
    last = min(obs.num_steps - 1, last_allowed + horizon_steps)
    # Steps alike over the whole horizon (a stretch of the workload whose demand does not
    # change): the step after those allowed shows the balance the later ones would
    # repeat, so look no further. Each step more only added the fluid model's error to
    # the gains: nl2repo-2.4t (4-cell replicas, 400 s handoffs) moved a replica every
    # 1,800 s for gains a tenth of a step long (1.202 of the bound over seeds 0-4 with
    # 2 steps, 1.163 with 1). Demand that changes keeps `horizon_steps`: the steps
    # after the next are what a move must be ready for (growth of 3-15% a step made up
    # to 11% slower with 1).
    if last > last_allowed + 1 and all(p.alike(v, k) for k in range(v + 1, last + 1)):
        last = last_allowed + 1
    # A phase that changes the balance of the work starts within the horizon, after the
    # steps allowed now: plan for this phase; its steps will be planned for when near.
    # A phase change is a change from one step to the next (`abrupt`) that leaves step k
    # unlike step v: demand that grows step by step keeps the whole horizon, each step
    # with its own shape (growth of 10% a step in durations and 25% in tokens used to cut
    # it to the allowed steps alone after two steps, and the policy moved a cell to
    # training for the step allowed now and back for the next batch, 12% behind the best
    # fixed split).
    abrupt = [False] + [p.shifts(k - 1, k) for k in range(v + 1, last + 1)]
    shift = next((k for k in range(last_allowed + 1, last + 1)
                  if p.shifts(v, k) and any(abrupt[:k - v + 1])), None)
    if shift is not None:
        last = shift - 1
    # Lending in the tail of the step after the horizon trains its last step: simulate it.
    hidden = 1 if lend_cells > 0 and shift is None and last + 1 < obs.num_steps else 0
    run_steps = obs.run_steps if obs.run_steps is not None else np.full(
        obs.runs_in_flight, v, dtype=np.int64)
    elapsed = np.asarray(obs.run_elapsed_s, dtype=float)
    tok_v = obs.tokens_per_run
    steps, finished_later = [], 0.0
    for k in range(v, last + 1 + hidden):
        model = p.durations.at(k)
        mine = run_steps == k
        inflight = int(mine.sum())
        curve = alive_curve(model, elapsed[mine]) if inflight else (None, None)
        work, tail = residual_tail(model, elapsed[mine], curve=curve if inflight else None)
        tok = tok_v * p.tokens_ratio(k, v)
        if rps > 0 and k <= last_allowed:
            lo, hi = k * rps, (k + 1) * rps
            queued_lo = allowed_end - obs.runs_queued
            new = max(0, min(hi, allowed_end) - max(lo, queued_lo))
            if k > v:
                finished_later += max(0, rps - inflight - new) * tok
        elif rps > 0:
            new = rps
        else:
            new = obs.runs_queued
        tokens = (rps * tok if k > v and rps > 0 else (inflight + new) * tok)
        steps.append(StepOutlook(
            step=k, allowed=k <= last_allowed, inflight=inflight, inflight_work_s=work,
            inflight_tail_s=tail, new_runs=new, mean_s=model.mean_s(),
            longest_s=longest_of(model, new), tokens=tokens,
            group_tokens=max(1, p.group_size) * tok, run_tokens=tok, model=model,
            alive_xs=curve[0], alive=curve[1]))
    if steps:  # step v: what is ready or finished but not trainable is its own
        waiting = max(0.0, obs.train_waiting_tokens - finished_later)
        steps[0] = dataclasses.replace(steps[0], waiting_tokens=waiting,
                                       tokens=steps[0].tokens + obs.train_ready_tokens + waiting)
    return Outlook(now_s=obs.now_s, steps=steps, staleness=p.staleness,
                   streaming=streaming, cap=obs.cell_capacity,
                   optimizer_step_s=p.optimizer_step_s, speed=p.speed,
                   concurrency=p.window,
                   train_rate=train_rate_fn(obs.train_tokens_per_cell_s,
                                            min_cells=obs.min_train_cells,
                                            efficiency=p.scaling_efficiency),
                   # A lent cell joins between micro-batches, as a moved one: where one
                   # held a whole step, lending credited without the wait kept a third
                   # rollout cell of 4 idle for lending that never came, 8% behind the
                   # best fixed split (docs/scheduler.md, "A wider draw").
                   lend=(obs.handoff_to_train_s, obs.handoff_to_rollout_s, lend_cells,
                         obs.call_interval_s, obs.join_wait_s(p.microbatch_tokens))
                   if lend_cells > 0 else None,
                   steps_after=obs.num_steps - 1 - last - hidden, hidden=hidden)
