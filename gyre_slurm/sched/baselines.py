"""The two layouts users run today, as policies of the same interface.

- `ColocatePolicy`: every cell rolls out the step's batch, then every cell trains it,
  then every cell rolls out again (synchronous: staleness 0, no streaming). With
  `streaming=True` ("colocate with streaming", the published ablation's middle rung): a
  cell whose runs have all ended, with none left to start, trains the step's groups as
  they end, and every cell rolls out again once the step is trained.
- `AsyncPolicy`: a fixed split, `rollout_cells` roll out and the rest train, one step
  behind (the config's staleness bound); never moves a cell. `streaming=True` gives the
  "async with streaming" ablation.
"""

from __future__ import annotations

from typing import Sequence

from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import Decision, Layout, Observation


class ColocatePolicy:
    max_staleness = 0

    def __init__(self, *, streaming: bool = False, name: str | None = None):
        self.streaming = streaming
        self.name = name or ("colocate-stream" if streaming else "colocate")

    def initial_layout(self, num_cells: int) -> Layout:
        return Layout(roles=(Role.ROLLOUT,) * num_cells, standalone=(False,) * num_cells)

    def decide(self, obs: Observation) -> Sequence[Decision]:
        if self.streaming:
            return self._streamed(obs)
        if any(c.target is not None for c in obs.cells):
            return []  # a phase change is under way
        live = [c for c in obs.cells if c.role is not Role.FAILED]
        if all(c.role is Role.ROLLOUT for c in live):
            if obs.runs_in_flight == 0 and obs.runs_queued == 0 and obs.train_ready_tokens > 0:
                return [Decision(c.cell_id, Role.TRAIN, "phase",
                                 f"step {obs.steps_done}: rollout done, every cell trains")
                        for c in live]
        elif all(c.role is Role.TRAIN for c in live):
            if obs.train_ready_tokens == 0 and obs.runs_queued > 0:
                return [Decision(c.cell_id, Role.ROLLOUT, "phase",
                                 f"step {obs.steps_done}: trained, every cell rolls out")
                        for c in live]
        return []

    def _streamed(self, obs: Observation) -> list[Decision]:
        live = [c for c in obs.cells if c.role is not Role.FAILED]
        if obs.runs_queued == 0:  # the step's runs all started: idle cells train its groups
            return [Decision(c.cell_id, Role.TRAIN, "phase",
                             f"step {obs.steps_done}: cell {c.cell_id}'s runs ended, it "
                             f"trains the step's groups as they end")
                    for c in live if c.role is Role.ROLLOUT and c.active_runs == 0
                    and (obs.runs_in_flight > 0 or obs.train_ready_tokens > 0
                         or obs.train_waiting_tokens > 0)]
        # Runs wait to start only once the step is trained (staleness 0): all roll out.
        return [Decision(c.cell_id, Role.ROLLOUT, "phase",
                         f"step {obs.steps_done}: trained, every cell rolls out")
                for c in live if c.role is Role.TRAIN]


class AsyncPolicy:
    max_staleness = None

    def __init__(self, *, rollout_cells: int | None = None, streaming: bool = False,
                 name: str = "async"):
        self.rollout_cells = rollout_cells
        self.streaming = streaming
        self.name = name

    def split(self, num_cells: int) -> int:
        if self.rollout_cells is None:
            return max(1, num_cells // 2)
        if not 0 < self.rollout_cells < num_cells:
            raise ValueError(f"async split needs 1..{num_cells - 1} rollout cells, "
                             f"got {self.rollout_cells}")
        return self.rollout_cells

    def initial_layout(self, num_cells: int) -> Layout:
        num_rollout = self.split(num_cells)
        roles = (Role.ROLLOUT,) * num_rollout + (Role.TRAIN,) * (num_cells - num_rollout)
        return Layout(roles=roles, standalone=(True,) * num_cells)

    def decide(self, obs: Observation) -> Sequence[Decision]:
        return []
