"""What a policy sees (observations) and what it says (decisions). Pure data.

The coordinator and the simulator both build an `Observation` from their state, call
`policy.decide(obs)`, and execute the returned `Decision`s. A decision names one cell,
the role it should head to, a cause (a short machine-readable word) and a reason (a
sentence for `events.jsonl` and the monitor).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, Protocol, Sequence

import numpy as np

from gyre_slurm.sched.cells import Role

Cause = Literal["release", "reclaim", "cancel_drain", "phase", "split"]


@dataclass(frozen=True)
class CellObs:
    cell_id: int
    role: Role
    target: Role | None
    standalone: bool
    active_runs: int  # runs whose calls this cell serves now
    since_s: float  # when the cell entered its current role

    @property
    def heading(self) -> Role:
        return self.target if self.target is not None else self.role


@dataclass(frozen=True)
class Observation:
    now_s: float
    cells: tuple[CellObs, ...]
    cell_capacity: int  # concurrent runs one rollout cell serves
    runs_in_flight: int
    runs_queued: int  # allowed to start now (batch and staleness), waiting for a slot
    runs_future: int  # planned but not yet allowed (their step's policy is not trained)
    run_elapsed_s: np.ndarray  # elapsed wall time of every run in flight
    train_ready_tokens: float  # tokens ready to train in the step being trained, not trained
    train_waiting_tokens: float  # tokens of finished runs not yet trainable (groups, later steps)
    train_tokens_per_cell_s: float  # training throughput of one cell (measured or configured)
    min_train_cells: int  # cells a training world needs at least (a model replica)
    tokens_per_run: float  # mean trained tokens per run (measured or configured)
    policy_version: int
    steps_done: int
    num_steps: int
    handoff_to_train_s: float  # measured (or configured) cost of a rollout -> train handoff
    handoff_to_rollout_s: float
    step_runs_left: int = 0  # runs of the step being trained that have not finished
    run_steps: np.ndarray | None = None  # the step of every run in flight (as run_elapsed_s)
    # Mean time between a run's model calls (measured, or configured): a run migrating off
    # a cell leaves at its next call, so a migrate drain lasts its runs' longest wait.
    call_interval_s: float = 0.0

    def as_record(self) -> dict:
        """What the policy saw, for the decision log (`observed`, on the first decision
        a tick carries out): JSON numbers and lists; `from_record` reads it back, so a
        decision can be replayed offline against the same observation."""
        rec = {k: getattr(self, k) for k in SCALARS}
        rec = {k: v.item() if isinstance(v, np.generic) else v for k, v in rec.items()}
        rec["cells"] = [[c.cell_id, c.role.value, c.target.value if c.target else None,
                         c.standalone, c.active_runs, round(c.since_s, 3)] for c in self.cells]
        rec["run_elapsed_s"] = [round(float(x), 3) for x in self.run_elapsed_s]
        rec["run_steps"] = None if self.run_steps is None else [int(x) for x in self.run_steps]
        return rec

    @classmethod
    def from_record(cls, rec: dict) -> "Observation":
        cells = tuple(CellObs(i, Role(role), Role(target) if target else None, standalone,
                              runs, since) for i, role, target, standalone, runs, since
                      in rec["cells"])
        steps = rec.get("run_steps")
        return cls(cells=cells, run_elapsed_s=np.asarray(rec["run_elapsed_s"], dtype=float),
                   run_steps=None if steps is None else np.asarray(steps, dtype=np.int64),
                   **{k: rec[k] for k in SCALARS})

    def count(self, role: Role, *, target: Role | None = None) -> int:
        return sum(1 for c in self.cells if c.role is role and (target is None or c.target is target))

    def heading_to(self, role: Role) -> list[CellObs]:
        return [c for c in self.cells if c.heading is role]

    def join_wait_s(self, microbatch_tokens: float) -> float:
        """A cell joins a training world between micro-batches: while one trains, half
        of one at the world's present speed (its whole replicas), expected; 0 with no
        world that trains."""
        train = self.count(Role.TRAIN)
        usable = train // max(1, self.min_train_cells) * self.min_train_cells
        if microbatch_tokens <= 0 or usable <= 0 or not self.train_tokens_per_cell_s > 0:
            return 0.0
        return 0.5 * microbatch_tokens / (self.train_tokens_per_cell_s * usable)


# Every field of an Observation but its cells and per-run arrays: a number each.
SCALARS = tuple(f.name for f in fields(Observation)
                if f.name not in ("cells", "run_elapsed_s", "run_steps"))


@dataclass(frozen=True)
class Decision:
    cell_id: int
    to_role: Role  # ROLLOUT or TRAIN: where the cell should end up
    cause: Cause
    reason: str
    drain: Literal["wait", "migrate"] = "wait"  # how a releasing rollout cell's runs leave
    expected: dict = field(default_factory=dict)  # what the move was expected to gain and
    #                                               cost (the elastic outlook; the log)

    def as_event(self, now_s: float) -> dict:
        event = {"t": now_s, "kind": "decision", "cell": self.cell_id, "to": self.to_role.value,
                 "cause": self.cause, "reason": self.reason, "drain": self.drain}
        if self.expected:
            event["expected"] = self.expected
        return event


@dataclass(frozen=True)
class Layout:
    """How a policy wants the cells to start: roles and which cells never move."""

    roles: tuple[Role, ...]
    standalone: tuple[bool, ...]
    extra: dict = field(default_factory=dict)


class Policy(Protocol):
    name: str
    streaming: bool  # train groups as they arrive (else the whole batch at once)
    max_staleness: int | None  # a tighter bound than the config's, or None

    def initial_layout(self, num_cells: int) -> Layout: ...

    def decide(self, obs: Observation) -> Sequence[Decision]: ...
