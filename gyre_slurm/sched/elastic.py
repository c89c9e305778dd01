"""The elastic policy: move a cell only when the move pays, over the steps ahead.

Each decision compares layout plans on the outlook (`gyre_slurm/sched/outlook.py`: a
fluid model of the steps allowed now and `horizon_steps` more, from the runs in flight
with their ages, the runs queued and still to come, the tokens waiting for training and
the workload's per-step prior, phases included): stay; reclaim m train cells for rollout
(cancelling drains first: free); or release m rollout cells to training, draining by
waiting for their runs or by migrating them at their next call, whichever the outlook
expects to finish sooner (`scheduler.drain: auto`). A plan's costs are in it: a moving
cell serves neither side for its handoff, a reclaimed cell's training stops, a wait
drain holds a cell until its runs' expected tail, a migrated run is re-prefilled and
slowed on a busier cell. The best plan is made only if it finishes the horizon at
least `min_gain` (a fraction of the time left in it) sooner than staying; a release only
once it has been the best plan for `confirm_s`; no cell moves within `min_dwell_s` of
its last move.

Weighing both sides over the steps ahead, not the queue now, is what stops the
back-and-forth of few cells and training-bound steps: a new batch's queue adds its
runs' rollout *and* their training to the outlook, so a cell goes to rollout only if
rollout, not training, is what the horizon waits for; after a failure the outlook is
recomputed for the cells left, not reacted to.

With `scheduler.forecast: false` the policy is the waterlevel's working rule on the demand now
(`gyre_slurm/sched/rule.py`): the `elastic-naive` ablation.

Every decision carries, in `expected`, what the outlook expected of it (the decision
log: `events.jsonl` holds it with the decision): the horizon's end with the move and
staying, each step's rollout and training end both ways, and the cell-seconds its
handoffs cost. Its reason says the same in a sentence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gyre_slurm.config.schema import SchedulerConfig
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.lend import TailLending
from gyre_slurm.sched.outlook import Capacity, Outlook, StepOutlook, WorkloadPrior, build_outlook
from gyre_slurm.sched.rule import (WaterlevelRule, draining_to_train, free_slots, releasable_cells,
                                   takeable_train_cells)
from gyre_slurm.sched.survival import (longest_of, migrate_wait_s, mixed_alive_curve,
                                       residual_tail)
from gyre_slurm.sched.types import CellObs, Decision, Layout, Observation
from gyre_slurm.sched.waterlevel import DurationModel, StepDurations

__all__ = ["ElasticPolicy", "WorkloadPrior", "floors_layout"]


def floors_layout(num_cells: int, *, min_rollout: int, min_train: int) -> Layout:
    roles = [Role.ROLLOUT] * num_cells
    standalone = [False] * num_cells
    for i in range(min_rollout):
        standalone[i] = True
    for i in range(min_rollout, min_rollout + min_train):
        roles[i], standalone[i] = Role.TRAIN, True
    return Layout(roles=tuple(roles), standalone=tuple(standalone))


@dataclass
class Plan:
    kind: str  # stay, reclaim, release
    cells: list[CellObs]
    drain: str = "wait"
    cancel: int = 0  # of `cells`, how many are drains cancelled (reclaim)
    finish_s: float = math.inf
    rollout_end: list[float] | None = None
    train_end: list[float] | None = None

    @property
    def rank(self) -> tuple[int, float]:
        """Plans compare by this: the horizon's step ends (rollout and training) that it
        never reaches, fewest first (a layout that cannot train, or cannot roll out, a
        step is stuck), then when it finishes (all reached) or reaches its last end. A
        cluster whose every cell a model replica needs must hand them all to training
        and back: each such move reaches one more end."""
        ends = (self.rollout_end or []) + (self.train_end or [])
        never = sum(1 for t in ends if math.isinf(t)) if ends else 1
        reached = [t for t in ends if math.isfinite(t)]
        return never, self.finish_s if not never else max(reached, default=math.inf)


class ElasticPolicy:
    max_staleness = None

    def __init__(self, cfg: SchedulerConfig, *, prior: WorkloadPrior | None = None,
                 durations: DurationModel | StepDurations | None = None, name: str = "elastic",
                 opening: Observation | None = None):
        """`opening`: the job as it starts (no runs yet; rates from the config), for the
        outlook to choose the starting layout; None: start on the floors."""
        if prior is None and durations is not None:
            prior = WorkloadPrior(durations=StepDurations.of(durations), streaming=cfg.streaming)
        if cfg.forecast and prior is None:
            raise ValueError("the elastic outlook needs a workload prior (durations)")
        self.cfg, self.prior, self.name, self.opening = cfg, prior, name, opening
        self.streaming = cfg.streaming
        self.naive = WaterlevelRule(cfg)
        self._release_since: float | None = None  # a release has been the best plan since
        self._tails: dict[float, float] = {}  # per decision: expected tail of n runs
        self._alive = None  # per decision: (model, curve) of every run in flight
        self._key: tuple | None = None  # the state the last plan was made in
        self._planned_at = -math.inf
        self._drains: dict[int, str] = {}  # cell draining towards training -> wait or migrate
        self.lending = TailLending(cfg.lend_cells, window=prior.window if prior else 0)
        self._lend_refused_at = -math.inf

    def initial_layout(self, num_cells: int) -> Layout:
        """The floors, plus the elastic cells the outlook would have train from the start
        (moving them later would cost a handoff and, with runs placed on them, a drain)."""
        floors = floors_layout(num_cells, min_rollout=self.cfg.min_rollout_cells,
                               min_train=self.cfg.min_train_cells)
        if self.opening is None or not self.cfg.forecast:
            return floors
        cells = tuple(CellObs(i, role, None, alone, 0, -math.inf)
                      for i, (role, alone) in enumerate(zip(floors.roles, floors.standalone)))
        obs = dataclasses.replace(self.opening, cells=cells, handoff_to_train_s=0.0,
                                  handoff_to_rollout_s=0.0)  # no cell has a role to leave
        # Weighed without the lending credit: the opening's cells move before any tail
        # (credited, the benchmark's replayed workload started on the floors, released 6
        # cells 4.5 s in and ended 9 s later).
        outlook = self.outlook(obs, lending=False)
        if not outlook.steps:
            return floors
        stay = self.evaluate(outlook, obs, Plan("stay", []))
        best, later = stay, stay
        out = releasable_cells(obs, 0.0)
        training = floors.roles.count(Role.TRAIN)
        for m in range(1, len(out) + 1):
            if not _whole(training + m, obs.min_train_cells):
                continue
            plan = self.evaluate(outlook, obs, Plan("release", out[:m]))
            if plan.rank < best.rank:
                best = plan
            plan = self.after_first_runs(outlook, obs, out[:m])
            if plan.rank < later.rank:
                later = plan
        # The gain is weighed against the time the horizon takes as it is; where staying
        # on the floors never finishes it (a floor smaller than a model replica), against
        # starting there and moving later (min_gain x inf refused every opening).
        left = max(stay.finish_s if math.isfinite(stay.finish_s) else later.finish_s, 1e-9)
        if best is stay or best.rank > later.rank or (
                best.rank[0] == later.rank[0]
                and later.finish_s - best.finish_s < self.cfg.min_gain * left):
            return floors  # start on the floors: decide() moves cells once runs are placed
        roles = list(floors.roles)
        for c in best.cells:
            roles[c.cell_id] = Role.TRAIN
        return Layout(roles=tuple(roles), standalone=floors.standalone,
                      extra={"opening": {"train_cells": len(best.cells),
                                         "finish_s": _r(best.finish_s),
                                         "finish_on_floors_s": _r(stay.finish_s)}})

    def after_first_runs(self, outlook: Outlook, obs: Observation,
                         cells: list[CellObs]) -> Plan:
        """The opening plan of starting these cells in rollout and moving them to
        training once their first runs have ended (a wait drain), as `decide` would: no
        sooner than the cells have dwelt `min_dwell_s` in their first role and the
        release has held `confirm_s`."""
        roll, train = self.layout_now(obs, outlook)
        first = max(longest_of(self.prior.durations.at(0), obs.cell_capacity),
                    self.cfg.min_dwell_s) + self.cfg.confirm_s
        busy = dataclasses.replace(obs, runs_in_flight=1)  # training will be under way then
        for _ in cells:
            roll.change(first, -1)
            train.change(first + self.opening.handoff_to_train_s + self.join_wait(busy), +1)
        plan = Plan("release", cells)
        plan.finish_s, plan.rollout_end, plan.train_end = outlook.finish_s(roll, train)
        return plan

    def decide(self, obs: Observation) -> Sequence[Decision]:
        if not self.cfg.forecast:
            return self.naive.decide(obs)
        for c in obs.cells:  # drains that ended
            if c.role is not Role.DRAINING:
                self._drains.pop(c.cell_id, None)
        moves = self.lending.returns(obs) or self.lend(obs)
        if moves or (self.lending.lent and obs.runs_future > 0):
            if moves:
                self._key, self._release_since = None, None
            return moves  # cells lent to a step's tail: the base layout holds meanwhile
        key = self.state_key(obs)
        if key == self._key and obs.now_s - self._planned_at < self.cfg.confirm_s:
            return []  # nothing changed that could change the plan: staying still holds
        self._key, self._planned_at, self._tails, self._alive = key, obs.now_s, {}, None
        outlook = self.outlook(obs)
        if not outlook.steps:
            return []
        stay = self.evaluate(outlook, obs, Plan("stay", []))
        best = self.best_plan(outlook, obs, stay)
        worth = best is not stay and (best.rank[0] < stay.rank[0] or best.rank[0] == 0 and
                                      self.gains_enough(obs, stay, best.finish_s))
        if not worth or best.kind == "reclaim":
            self._release_since = None
        if not worth:
            return []
        if best.kind != "reclaim":
            if self._release_since is None:
                self._release_since = obs.now_s
            if obs.now_s - self._release_since < self.cfg.confirm_s:
                return []  # confirm it at the next plan
            self._release_since = None
        self._key = None
        return self.decisions(obs, outlook, stay, best)

    def gains_enough(self, obs: Observation, stay: Plan, finish_s: float) -> bool:
        """Whether finishing at `finish_s` rather than as staying would is worth a move:
        sooner by `min_gain` of the time staying leaves (a move, a lend alike)."""
        left = max(stay.finish_s - obs.now_s, 1e-9)
        return stay.finish_s - finish_s >= self.cfg.min_gain * left

    def outlook(self, obs: Observation, *, lending: bool = True) -> Outlook:
        """The horizon's outlook; with `lending`, crediting the lending to come in the
        steps' tails (`Outlook._lend`: a cell is credited only where it arrives before
        the step it trains is trained, so only where training is behind).

        The credit does not depend on whether tokens are ready now. It used to be given
        only where training had had tokens ready within `min_dwell_s`, and that proxy
        came and went between consecutive decisions: in the real-run benchmark
        (session 40) elastic reclaimed a cell at 200.1 s with the credit (the last
        micro-batch had taken the ready tokens at 197.6 s) and released another at
        201.6 s without it, the layout it had just chosen expected to finish step 7 at
        334.6 s, then at 402.7 s. The jobs the proxy was for (a few runs a step on 3-8
        cells, where training keeps up and a lend never came) are no longer credited
        lending at all (`TailLending.cells`: none where a staleness window's runs fit),
        and a lend itself still needs tokens ready (`TailLending.candidate`).

        Without streaming, no credit: training takes a step whole once it is rolled out,
        so no tokens are ever ready in a tail and nothing is lent (terminalbench-122b
        elastic-nostream: 8,743 tail checks found no tokens ready, none found any); the
        credit held one training cell for lending that never came (makespan 1.57x
        elastic's, against 1.32x with the old proxy)."""
        return build_outlook(obs, self.prior, horizon_steps=self.cfg.horizon_steps,
                             streaming=self.streaming,
                             lend_cells=max(0, self.lending.cells(obs) - len(self.lending.lent))
                             if lending and self.streaming else 0)

    def lend(self, obs: Observation) -> list[Decision]:
        """Lend the spare rollout cells to training for this step's tail
        (`TailLending.candidates`: every one spare now, together), if the outlook
        expects the horizon trained sooner with lending than without, by `min_gain` of
        what is left, as any move must (lends of 0.1% moved cells and migrated runs for
        nothing)."""
        cells = self.lending.candidates(obs, self.cfg.min_dwell_s)
        if not cells or obs.now_s - self._lend_refused_at < self.cfg.confirm_s:
            return []
        self._tails, self._alive = {}, None
        with_lending = self.outlook(obs)
        if not with_lending.steps:
            return []
        lend = self.evaluate(with_lending, obs, Plan("stay", []))
        lent_cell_s = with_lending.lent_cell_s
        without = self.outlook(obs, lending=False)
        stay = self.evaluate(without, obs, Plan("stay", []))
        # Against the best move the base layout has without lending, not only staying: a
        # lend in the opening, before the cells may move, was expected to gain 245 s
        # over a stay that the base plan's release 3 s later beats by 56 s; the lent
        # cells then held the base layout (the benchmark's workload: 348.6 s, against
        # 300.9 s without lending).
        base = self.best_plan(without, obs, stay)
        if base is not stay and base.finish_s <= lend.finish_s:
            self._lend_refused_at = obs.now_s
            return []
        gain = stay.finish_s - lend.finish_s
        if not (gain > 0 and self.gains_enough(obs, stay, lend.finish_s)):
            self._lend_refused_at = obs.now_s
            return []
        for cell in cells:
            self.lending.lent[cell.cell_id] = obs.now_s
            self._drains[cell.cell_id] = "migrate"
        cost = len(cells) * (obs.handoff_to_train_s + obs.handoff_to_rollout_s)
        backlog = self.lending.backlog_s(obs)
        runs = sum(c.active_runs for c in cells)
        expected = {
            "plan": "lend", "cells": len(cells), "drain": "migrate", "migrated_runs": runs,
            "finish_s": _r(lend.finish_s), "finish_without_lending_s": _r(stay.finish_s),
            "gain_s": _r(gain), "lent_cell_s": _r(lent_cell_s), "handoff_cell_s": _r(cost),
            "backlog_s": _r(backlog),
            "best_move_without_lending": None if base is stay else
            {"plan": base.kind, "cells": len(base.cells), "finish_s": _r(base.finish_s)},
            "train_end_s": [_r(x) for x in lend.train_end or []],
            "train_end_without_lending_s": [_r(x) for x in stay.train_end or []],
        }
        reason = (f"lend {len(cells)} cell(s) to training for this step's tail: no run "
                  f"queued, the next batch not yet allowed, {_r(backlog)} s of training "
                  f"ready; {runs} run(s) migrate to free slots; expected trained at "
                  f"{_r(lend.finish_s)} s vs {_r(stay.finish_s)} s without lending (gains "
                  f"{_r(gain)} s); costs {_r(cost)} cell-s in handoffs there and back")
        return [Decision(cell.cell_id, Role.TRAIN, "release", reason, drain="migrate",
                         expected=expected) for cell in cells]

    def best_plan(self, outlook: Outlook, obs: Observation, stay: Plan) -> Plan:
        best = stay
        for family in self.candidates(obs, outlook):
            for plan in family:  # more cells, while each more is better
                self.evaluate(outlook, obs, plan)
                if plan.rank < best.rank:
                    best = plan
                elif plan.finish_s < math.inf and len(plan.cells) >= obs.min_train_cells:
                    break
        return best

    def state_key(self, obs: Observation) -> tuple:
        """What the plan depends on most: a new key re-plans at once (else every
        `confirm_s`: runs ending change the outlook only gradually)."""
        return (obs.policy_version, tuple((c.role, c.target) for c in obs.cells),
                obs.runs_queued > 0, obs.train_ready_tokens > 0)

    def speed(self, load: float) -> float:
        return self.prior.speed(load)

    # -- plans -------------------------------------------------------------------------
    def candidates(self, obs: Observation, outlook: Outlook) -> list[list[Plan]]:
        """Families of plans, each by growing numbers of cells."""
        dwell = self.cfg.min_dwell_s
        lent = self.lending.lent  # lent for the job's last tail: not taken back
        cancel = [c for c in draining_to_train(obs) if c.cell_id not in lent]
        back = cancel + [c for c in takeable_train_cells(obs, dwell) if c.cell_id not in lent]
        training = len(obs.heading_to(Role.TRAIN))
        # Down to whole replicas, or to the standalone floor alone: a floor smaller than a
        # replica (scheduler.min_train_cells 1, a 2-cell replica) trains nothing by
        # itself, but it cannot move, so taking every other cell must stay possible (on 2
        # cells the job deadlocked with both training and a run queued).
        floor = sum(1 for c in obs.cells if c.standalone and c.role is Role.TRAIN)
        families = [[Plan("reclaim", back[:m], cancel=min(m, len(cancel)))
                     for m in _counts(len(back), obs.min_train_cells)
                     if _whole(training - m, obs.min_train_cells) or training - m == floor]]
        out = releasable_cells(obs, dwell)
        drains = ("wait", "migrate") if self.cfg.drain == "auto" else (self.cfg.drain,)
        for drain in drains:  # idle cells leave alike either way: tried once
            families.append([Plan("release", out[:m], drain=drain)
                             for m in _counts(len(out), obs.min_train_cells)
                             if _whole(training + m, obs.min_train_cells)
                             and (drain != "migrate" or len(drains) == 1
                             or _can_migrate(obs, out[:m]))])
        return families

    def evaluate(self, outlook: Outlook, obs: Observation, plan: Plan) -> Plan:
        roll, train = self.layout_now(obs, outlook)
        now, h_t, h_r = obs.now_s, obs.handoff_to_train_s, obs.handoff_to_rollout_s
        if plan.kind == "reclaim":
            for i, c in enumerate(plan.cells):
                if i < plan.cancel:  # still serving: it only stops leaving
                    roll.change(now, +1)
                    train.change(self.arrival(obs, outlook, c), -1)
                else:
                    train.change(now, -1)
                    roll.change(now + h_r, +1)
        if plan.kind == "release":
            slots = self.slot_wait_s(obs, plan.cells) if plan.drain == "migrate" else 0.0
            for c in plan.cells:
                roll.change(now, -1)
                arrival = self.drain_eta(obs, outlook, c, plan.drain, slots) + h_t \
                    + self.join_wait(obs)
                train.change(arrival, +1)
            if plan.drain == "migrate":
                outlook = self.migrated(obs, outlook, plan.cells)
        plan.finish_s, plan.rollout_end, plan.train_end = outlook.finish_s(roll, train)
        return plan

    def arrival(self, obs: Observation, outlook: Outlook, c: CellObs) -> float:
        """When a cell heading to training gets there."""
        if c.role is Role.TRAIN:
            return obs.now_s
        if c.role is Role.LOADING:
            return max(obs.now_s, c.since_s + obs.handoff_to_train_s) + self.join_wait(obs)
        drain = self._drains.get(c.cell_id, "wait")
        slots = 0.0
        if drain == "migrate":
            slots = self.slot_wait_s(obs, [d for d in draining_to_train(obs)
                                           if self._drains.get(d.cell_id) == "migrate"])
        return self.drain_eta(obs, outlook, c, drain, slots) + obs.handoff_to_train_s \
            + self.join_wait(obs)

    def join_wait(self, obs: Observation) -> float:
        """What a cell moving to training waits to join its world (`join_wait_s`), while
        the world has anything to train."""
        if not (obs.train_ready_tokens or obs.train_waiting_tokens or obs.runs_in_flight):
            return 0.0
        return obs.join_wait_s(self.prior.microbatch_tokens)

    def layout_now(self, obs: Observation, outlook: Outlook) -> tuple[Capacity, Capacity]:
        """The cells on each side now, and when the ones moving arrive."""
        now, h_r = obs.now_s, obs.handoff_to_rollout_s
        cap = obs.cell_capacity
        roll_at: dict[float, int] = {}
        train_at: dict[float, int] = {}
        for c in obs.cells:
            if c.role is Role.ROLLOUT:
                roll_at[now] = roll_at.get(now, 0) + 1
            elif c.heading is Role.ROLLOUT and c.role in (Role.LOADING, Role.DRAINING):
                t = max(now, c.since_s + h_r) if c.role is Role.LOADING else now + h_r
                roll_at[t] = roll_at.get(t, 0) + 1
            elif c.heading is Role.TRAIN:
                t = self.arrival(obs, outlook, c)
                train_at[t] = train_at.get(t, 0) + 1
        roll = Capacity(now, 0, lambda c: c * cap)
        train = Capacity(now, 0, outlook.train_rate)
        for side, deltas in ((roll, roll_at), (train, train_at)):
            for t in sorted(deltas):
                side.change(t, deltas[t])
        return roll, train

    def drain_eta(self, obs: Observation, outlook: Outlook, cell: CellObs, drain: str,
                  slot_wait_s: float = 0.0) -> float:
        """When a cell leaving rollout has no runs left: at once if it has none, after
        its runs' next calls if they migrate (and, where the cells that stay lack free
        slots for them all, once enough runs have ended to free them: `slot_wait_s`),
        after its runs' expected tail if it waits; a migrating cell's own runs end by
        its tail at the latest."""
        if cell.active_runs == 0:
            return obs.now_s
        tail = self.cell_tail_s(obs, cell.active_runs)
        if drain == "migrate":  # each run leaves at its next call, or ends first
            wait = migrate_wait_s(obs.call_interval_s, cell.active_runs) \
                if obs.call_interval_s > 0 else 0.0
            return obs.now_s + min(max(wait, slot_wait_s), tail)
        return obs.now_s + tail

    def slot_wait_s(self, obs: Observation, cells: list[CellObs]) -> float:
        """How long the runs of `cells`, migrating, wait for free slots on the rollout
        cells that stay (a run moves only to a free slot, the queued runs first): until as
        many runs in flight as they lack have ended, expected."""
        moving = sum(c.active_runs for c in cells)
        free = free_slots(obs, {c.cell_id for c in cells}) - obs.runs_queued
        lack = moving - free  # the queued runs take the slots that free first
        n = len(obs.run_elapsed_s)
        if lack <= 0 or n == 0:
            return 0.0
        if lack >= n:
            return math.inf
        self.cell_tail_s(obs, 1)  # the curve of every run in flight (once per decision)
        model, curve = self._alive
        return residual_tail(model, np.asarray(obs.run_elapsed_s, dtype=float), curve=curve,
                             alive_target=n - lack)[1]  # the curve counts runs

    def cell_tail_s(self, obs: Observation, runs: int) -> float:
        """The expected longest remaining time of `runs` of the runs in flight, drawn at
        random (a cell's runs are a sample of them)."""
        elapsed = np.asarray(obs.run_elapsed_s, dtype=float)
        if elapsed.size == 0:
            return 0.0
        if self._alive is None:  # once per decision: all runs in flight, each by its step
            steps = obs.run_steps if obs.run_steps is not None else np.zeros(elapsed.size, int)
            kinds = np.unique(steps)
            models = [self.prior.durations.at(int(k)) for k in kinds]
            self._alive = (models[0], mixed_alive_curve(
                models, [elapsed[steps == k] for k in kinds]))
        key = round(runs, 3)
        if key not in self._tails:
            model, curve = self._alive
            frac = min(1.0, runs / elapsed.size)
            _, self._tails[key] = residual_tail(model, elapsed, curve=curve,
                                                alive_target=runs / (runs + 1) / max(frac, 1e-9))
        return self._tails[key]

    def migrated(self, obs: Observation, outlook: Outlook, cells: list[CellObs]) -> Outlook:
        """The outlook once the cells' runs move: each re-prefilled, and slowed from its
        light draining cell to a busier one (the run speed by load of the prior). The
        moved runs are a sample of those in flight: of step k, its share of them."""
        moved = sum(c.active_runs for c in cells)
        total = sum(s.inflight for s in outlook.steps)
        if not moved or not total:
            return outlook
        staying = [c for c in obs.cells if c.role is Role.ROLLOUT and c not in cells]
        dest = (sum(c.active_runs for c in staying) + moved) / max(1, len(staying))
        slow = self.speed(moved / len(cells)) / self.speed(min(dest, obs.cell_capacity))
        steps = []
        for s in outlook.steps:
            mine = moved * s.inflight / total
            if mine > 0:
                model = self.prior.durations.at(s.step)
                elapsed = np.asarray(obs.run_elapsed_s, dtype=float)
                run_steps = obs.run_steps if obs.run_steps is not None else np.full(
                    elapsed.size, outlook.steps[0].step)
                ages = elapsed[run_steps == s.step]
                curve = (s.alive_xs, s.alive) if s.alive is not None else None
                _, tail = residual_tail(model, ages, curve=curve,
                                        alive_target=mine / (mine + 1) * s.inflight / mine)
                s = _with_tail(s, max(s.inflight_tail_s, tail * slow + self.prior.reprefill_s))
            steps.append(s)
        return dataclasses.replace(outlook, steps=steps)

    # -- the decisions and their log ---------------------------------------------------
    def decisions(self, obs: Observation, outlook: Outlook, stay: Plan, best: Plan) -> list[Decision]:
        first, last = outlook.steps[0].step, outlook.steps[-1 - outlook.hidden].step
        gain = stay.finish_s - best.finish_s
        to_rollout = best.kind == "reclaim"
        h = obs.handoff_to_rollout_s if to_rollout else obs.handoff_to_train_s
        transit = (len(best.cells) - best.cancel) * h
        expected = {
            "plan": best.kind, "cells": len(best.cells), "drain": best.drain,
            "horizon_steps": [first, last],
            "finish_s": _r(best.finish_s), "finish_staying_s": _r(stay.finish_s),
            "gain_s": _r(gain), "handoff_cell_s": _r(transit),
            "rollout_end_s": [_r(x) for x in best.rollout_end or []],
            "rollout_end_staying_s": [_r(x) for x in stay.rollout_end or []],
            "train_end_s": [_r(x) for x in best.train_end or []],
            "train_end_staying_s": [_r(x) for x in stay.train_end or []],
        }
        side = _side_effects(stay, best, first)
        what = {"reclaim": f"reclaim {len(best.cells)} cell(s) for rollout",
                "release": f"release {len(best.cells)} cell(s) to training ({best.drain} "
                           f"drain)"}[best.kind]
        staying = (f"{_r(stay.finish_s)} s staying (gains {_r(gain)} s)"
                   if math.isfinite(stay.finish_s) else "never staying")
        if math.isfinite(best.finish_s):
            outcome = f"expected trained at {_r(best.finish_s)} s vs {staying}"
        else:  # the horizon needs a later move too: this one reaches more of it
            outcome = (f"not all trained without a later move, but {best.rank[0]} step "
                       f"end(s) unreached vs {stay.rank[0]} staying")
        reason = (f"{what}: steps {first}-{last} {outcome}; {side}; "
                  f"costs {_r(transit)} cell-s in handoffs")
        out = []
        for i, c in enumerate(best.cells):
            if to_rollout:
                cause = "cancel_drain" if i < best.cancel else "reclaim"
                out.append(Decision(c.cell_id, Role.ROLLOUT, cause, reason, expected=expected))
            else:
                self._drains[c.cell_id] = best.drain
                out.append(Decision(c.cell_id, Role.TRAIN, "release", reason, drain=best.drain,
                                    expected=expected))
        return out


def _side_effects(stay: Plan, best: Plan, first: int) -> str:
    parts = []
    for label, a, b in (("rollout", stay.rollout_end, best.rollout_end),
                        ("training", stay.train_end, best.train_end)):
        if not a or not b:
            continue
        pairs = list(enumerate(zip(a, b)))
        never = [i for i, (x, y) in pairs if math.isinf(x) != math.isinf(y)]
        if never:  # one of the two never ends that step
            i = never[0]
            word = "ends" if math.isinf(a[i]) else "never ends"
            parts.append(f"{label} of step {first + i} {word} (staying: "
                         f"{'never' if math.isinf(a[i]) else _r(a[i])})")
            continue
        diffs = [(i, y - x) for i, (x, y) in pairs
                 if math.isfinite(y - x) and abs(y - x) >= 0.5]
        if diffs:
            i, d = max(diffs, key=lambda t: abs(t[1]))
            word = "later" if d > 0 else "sooner"
            parts.append(f"{label} of step {first + i} ends {_r(abs(d))} s {word}")
    return ", ".join(parts) or "no step end moves by more than a second"


def _can_migrate(obs: Observation, cells: list[CellObs]) -> bool:
    """Migrating these cells' runs is a plan of its own where they have runs. Where the
    rollout cells that stay lack free slots for them all (beside the runs queued), a run
    moves only once a slot is free, and the others wait on their cell meanwhile
    (`slot_wait_s`): until session 39 such a drain was not tried, and nl2repo-2.4t
    (four-cell replicas: a release is four cells of runs) held its released cells for
    their runs' whole tail, 1.244 of the bound where migrating gives 1.200."""
    return sum(c.active_runs for c in cells) > 0


def _whole(cells: int, replica: int) -> bool:
    """A training side of this many cells wastes none: each is in a whole model replica
    (a cell beyond them would be held in training and add no throughput)."""
    return replica <= 1 or cells % replica == 0


def _counts(n: int, replica: int) -> list[int]:
    """Numbers of cells worth trying to move: 1..8, whole replicas, doublings."""
    if n <= 0:
        return []
    out = set(range(1, min(n, 8) + 1))
    out.update(k * replica for k in range(1, 9) if k * replica <= n)
    m = 16
    while m < n:
        out.add(m)
        m *= 2
    out.add(n)
    return sorted(out)


def _with_tail(s: StepOutlook, tail: float) -> StepOutlook:
    return dataclasses.replace(s, inflight_tail_s=tail)


def _r(x: float) -> float | None:
    """Seconds for the log: one decimal; None (JSON null) for never."""
    return round(float(x), 1) if math.isfinite(x) else None
