"""The waterlevel's working rule on the demand now (`scheduler.forecast: false`): the
`elastic-naive` ablation, and the predictable rule the fault tests drive.

Reclaim (train -> rollout) when runs queue for a server (L > R + h): cancel drains
first (a rollout cell still draining towards training comes back free), then take
elastic train cells, the longest-serving first. Release (rollout -> train) while
R - L >= 1 + h has held for `confirm_s`: the cells with the fewest active runs go; their
runs wait or migrate at their next call (`drain`; auto is wait here).
"""

from __future__ import annotations

import math

from gyre_slurm.config.schema import SchedulerConfig
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import CellObs, Decision, Observation
from gyre_slurm.sched.waterlevel import waterlevel


class WaterlevelRule:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self._release_since: float | None = None

    def decide(self, obs: Observation) -> list[Decision]:
        if obs.runs_queued > 0:
            self._release_since = None
            return self.reclaim(obs)
        return self.release(obs)

    def reclaim(self, obs: Observation) -> list[Decision]:
        cap, h = obs.cell_capacity, self.cfg.hysteresis
        rollout_side = len(obs.heading_to(Role.ROLLOUT))
        level = waterlevel(runs_in_flight=obs.runs_in_flight, runs_queued=obs.runs_queued,
                           cell_capacity=cap)
        if level <= rollout_side + h and rollout_side > 0:
            return []
        queue = obs.runs_queued
        need = math.ceil(queue / cap - h) if queue > h * cap else 0
        if rollout_side == 0:
            need = max(need, 1)  # queued runs and no server at all: hysteresis cannot wait
        out = []
        for cell in draining_to_train(obs)[:max(0, need)]:
            out.append(Decision(cell.cell_id, Role.ROLLOUT, "cancel_drain",
                                f"{obs.runs_queued} runs queue (L={level:.2f}); "
                                f"cell {cell.cell_id} stops draining and keeps serving"))
        need -= len(out)
        for cell in takeable_train_cells(obs, self.cfg.min_dwell_s)[:max(0, need)]:
            out.append(Decision(cell.cell_id, Role.ROLLOUT, "reclaim",
                                f"{obs.runs_queued} runs queue for a server "
                                f"(L={level:.2f} > R={rollout_side} + h={h})"))
        return out

    def release(self, obs: Observation) -> list[Decision]:
        cap, h = obs.cell_capacity, self.cfg.hysteresis
        rollout_side = len(obs.heading_to(Role.ROLLOUT))
        level = waterlevel(runs_in_flight=obs.runs_in_flight, runs_queued=0, cell_capacity=cap)
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
        chosen = releasable_cells(obs, self.cfg.min_dwell_s)[:max(0, num)]
        if not chosen:
            return []
        self._release_since = None
        drain = "wait" if self.cfg.drain == "auto" else self.cfg.drain
        return [Decision(c.cell_id, Role.TRAIN, "release",
                         f"rollout needs {level:.2f} cells, has {rollout_side} "
                         f"(spare {spare:.2f} >= 1 + h={h} for {self.cfg.confirm_s:g}s); "
                         f"cell {c.cell_id} has {c.active_runs} runs", drain=drain)
                for c in chosen]


def dwelled(cell: CellObs, obs: Observation, min_dwell_s: float) -> bool:
    return obs.now_s - cell.since_s >= min_dwell_s


def draining_to_train(obs: Observation) -> list[CellObs]:
    return [c for c in obs.cells if c.role is Role.DRAINING and c.target is Role.TRAIN]


def releasable_cells(obs: Observation, min_dwell_s: float) -> list[CellObs]:
    """Elastic rollout cells that may leave now, the least loaded first."""
    out = [c for c in obs.cells if c.role is Role.ROLLOUT and not c.standalone
           and dwelled(c, obs, min_dwell_s)]
    out.sort(key=lambda c: (c.active_runs, -c.cell_id))
    return out


def takeable_train_cells(obs: Observation, min_dwell_s: float) -> list[CellObs]:
    """Elastic train cells that may leave now, the longest-serving first."""
    movable = [c for c in obs.cells if c.role is Role.TRAIN and not c.standalone
               and dwelled(c, obs, min_dwell_s)]
    movable.sort(key=lambda c: (c.since_s, -c.cell_id))
    return movable


def free_slots(obs: Observation, leaving: set[int]) -> int:
    """Free slots of the rollout cells that stay when the cells `leaving` go."""
    return sum(obs.cell_capacity - c.active_runs for c in obs.cells
               if c.role is Role.ROLLOUT and c.cell_id not in leaving)
