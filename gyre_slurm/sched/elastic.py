"""The elastic policy: move cells between rollout and training by the waterlevel.

Each call sees one observation and returns decisions; the only state kept between
calls is the start of the current release window (a time taken from observations).

Reclaim (train -> rollout), when runs queue for a server (L > R + h):
  1. cancel drains first: a rollout cell still draining towards training comes back free;
  2. then take elastic train cells, the longest-serving first; optionally keeping a
     *train reserve* (`train_reserve_s`): the cells training needs to clear its ready
     backlog in that time, so a demand jump at a new step cannot pull every movable
     cell out of training. The simulator says the reserve loses on every preset (runs
     are long: a run started late costs more than a backlog trained late), so it is
     off by default;
  3. with the forecast on, count only the queue expected to remain once a handoff
     could land (runs finishing meanwhile free their slots).
Release (rollout -> train), when R - L >= 1 + h has held for `confirm_s`:
  - with the forecast on, L is the expected demand one handoff from now (survival of
    the in-flight runs' durations), plus the next step's batch if it is about to open;
  - with the cost gate on, a cell goes only if training has at least its round-trip
    handoff cost of work for it, and never fewer cells than a training world needs;
  - the cell with the fewest active runs goes; its runs wait or migrate at their next
    call (`drain`). A run is never stopped.
"""

from __future__ import annotations

import math
from typing import Sequence

from gyre_slurm.config.schema import SchedulerConfig
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import CellObs, Decision, Layout, Observation
from gyre_slurm.sched.waterlevel import DurationModel, StepDurations, waterlevel


def floors_layout(num_cells: int, *, min_rollout: int, min_train: int) -> Layout:
    roles = [Role.ROLLOUT] * num_cells
    standalone = [False] * num_cells
    for i in range(min_rollout):
        standalone[i] = True
    for i in range(min_rollout, min_rollout + min_train):
        roles[i], standalone[i] = Role.TRAIN, True
    return Layout(roles=tuple(roles), standalone=tuple(standalone))


class ElasticPolicy:
    max_staleness = None

    def __init__(self, cfg: SchedulerConfig, *, durations: DurationModel | None = None,
                 name: str = "elastic", work_horizon_s: float = 1800.0):
        if cfg.forecast and durations is None:
            raise ValueError("the elastic forecast needs a duration model")
        self.cfg = cfg
        self.name = name
        self.streaming = cfg.streaming
        self.durations = StepDurations.of(durations) if durations is not None else None
        self.work_horizon_s = work_horizon_s  # how far ahead the release gate counts work
        self._release_since: float | None = None

    def initial_layout(self, num_cells: int) -> Layout:
        return floors_layout(num_cells, min_rollout=self.cfg.min_rollout_cells,
                             min_train=self.cfg.min_train_cells)

    def decide(self, obs: Observation) -> Sequence[Decision]:
        if obs.runs_queued > 0:
            self._release_since = None
            return self._reclaim(obs)
        return self._release(obs)

    # -- reclaim ---------------------------------------------------------------------
    def _reclaim(self, obs: Observation) -> list[Decision]:
        cap, h = obs.cell_capacity, self.cfg.hysteresis
        rollout_side = len(obs.heading_to(Role.ROLLOUT))
        level = waterlevel(runs_in_flight=obs.runs_in_flight, runs_queued=obs.runs_queued,
                           cell_capacity=cap)
        if level <= rollout_side + h and rollout_side > 0:
            return []
        queue = obs.runs_queued
        if self.cfg.forecast:
            # Slots that free up before a reclaimed cell could start serving.
            incoming = len([c for c in obs.cells if c.target is Role.ROLLOUT])
            finishing = obs.runs_in_flight - self.durations.expected_remaining_runs(
                obs.run_elapsed_s, obs.handoff_to_rollout_s, obs.run_steps)
            queue = queue - finishing - incoming * cap
        need = math.ceil(queue / cap - h) if queue > h * cap else 0
        if rollout_side == 0:
            need = max(need, 1)  # queued runs and no server at all: hysteresis cannot wait
        if need <= 0:
            return []
        out = []
        for cell in self._draining_to_train(obs)[:need]:
            out.append(Decision(cell.cell_id, Role.ROLLOUT, "cancel_drain",
                                f"{obs.runs_queued} runs queue (L={level:.2f}); "
                                f"cell {cell.cell_id} stops draining and keeps serving"))
        need -= len(out)
        for cell in self._takeable_train_cells(obs)[:need]:
            out.append(Decision(cell.cell_id, Role.ROLLOUT, "reclaim",
                                f"{obs.runs_queued} runs queue for a server "
                                f"(L={level:.2f} > R={rollout_side} + h={h})"))
        return out

    def _draining_to_train(self, obs: Observation) -> list[CellObs]:
        return [c for c in obs.cells if c.role is Role.DRAINING and c.target is Role.TRAIN]

    def _takeable_train_cells(self, obs: Observation) -> list[CellObs]:
        train = [c for c in obs.cells if c.role is Role.TRAIN]
        movable = [c for c in train if not c.standalone and self._dwelled(c, obs)]
        keep = self._train_reserve(obs)
        num_staying = len(train) + len([c for c in obs.cells if c.role is Role.LOADING
                                        and c.target is Role.TRAIN])
        allowed = max(0, num_staying - keep)
        # Leaving a training world too small to train is worse than taking all of it.
        if 0 < num_staying - allowed < obs.min_train_cells and keep == 0:
            allowed = num_staying
        movable.sort(key=lambda c: (c.since_s, -c.cell_id))
        return movable[:allowed]

    def _train_reserve(self, obs: Observation) -> int:
        if self.cfg.train_reserve_s is None or obs.train_ready_tokens <= 0:
            return 0
        rate = obs.train_tokens_per_cell_s * self.cfg.train_reserve_s
        cells = math.ceil(obs.train_ready_tokens / rate)
        return max(cells, obs.min_train_cells)

    # -- release ---------------------------------------------------------------------
    def _release(self, obs: Observation) -> list[Decision]:
        cap, h = obs.cell_capacity, self.cfg.hysteresis
        rollout_side = len(obs.heading_to(Role.ROLLOUT))
        level = self._expected_level(obs) if self.cfg.forecast else waterlevel(
            runs_in_flight=obs.runs_in_flight, runs_queued=0, cell_capacity=cap)
        spare = rollout_side - level
        # With no rollout demand at all, an idle cell is spare whatever the hysteresis
        # (else a small cluster could hold trainable work and never train it).
        threshold = 1 + h if obs.runs_in_flight + obs.runs_queued else 1
        if spare < threshold:
            self._release_since = None
            return []
        if self._release_since is None:
            self._release_since = obs.now_s
        if obs.now_s - self._release_since < self.cfg.confirm_s:
            return []
        num = math.floor(spare - (threshold - 1))
        if self.cfg.cost_gate:
            num = min(num, self._worth_releasing(obs))
        candidates = [c for c in obs.cells if c.role is Role.ROLLOUT and not c.standalone
                      and self._dwelled(c, obs)]
        candidates.sort(key=lambda c: (c.active_runs, -c.cell_id))
        chosen = candidates[:max(0, num)]
        if not chosen:
            return []
        self._release_since = None
        return [Decision(c.cell_id, Role.TRAIN, "release",
                         f"rollout needs {level:.2f} cells, has {rollout_side} "
                         f"(spare {spare:.2f} >= 1 + h={h} for {self.cfg.confirm_s:g}s); "
                         f"cell {c.cell_id} has {c.active_runs} runs",
                         drain=self.cfg.drain)
                for c in chosen]

    def _expected_level(self, obs: Observation) -> float:
        horizon = obs.handoff_to_train_s + obs.handoff_to_rollout_s
        in_flight = self.durations.expected_remaining_runs(obs.run_elapsed_s, horizon,
                                                           obs.run_steps)
        demand = in_flight + obs.runs_queued
        # The next step's batch opens once the current step is trained: if that happens
        # within the horizon, its runs are demand now.
        training = obs.count(Role.TRAIN)
        throughput = obs.train_tokens_per_cell_s * training
        if (obs.step_runs_left == 0 and obs.runs_future > 0 and training >= obs.min_train_cells
                and obs.train_ready_tokens < throughput * horizon):
            demand += obs.runs_future
        return demand / obs.cell_capacity

    def _worth_releasing(self, obs: Observation) -> int:
        """How many more train cells the training work in sight pays for."""
        tokens = obs.train_ready_tokens + obs.train_waiting_tokens
        if self.durations is not None:
            horizon = self.work_horizon_s
            finishing = obs.runs_in_flight - self.durations.expected_remaining_runs(
                obs.run_elapsed_s, horizon, obs.run_steps)
            tokens += finishing * obs.tokens_per_run
        work_cell_s = tokens / obs.train_tokens_per_cell_s
        round_trip_s = obs.handoff_to_train_s + obs.handoff_to_rollout_s
        training = len(obs.heading_to(Role.TRAIN))
        num = max(0, math.floor(work_cell_s / max(round_trip_s, 1e-9)) - training)
        if training + num < obs.min_train_cells and (num > 0 or tokens > 0):
            # A partial world trains nothing, and work nobody can train blocks every
            # later step: however small the work, training gets a whole world.
            num = obs.min_train_cells - training
        return num

    def _dwelled(self, cell: CellObs, obs: Observation) -> bool:
        return obs.now_s - cell.since_s >= self.cfg.min_dwell_s
