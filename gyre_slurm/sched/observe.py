"""The one place an `Observation` is built: the coordinator and the simulator each say
what they see (cells and their runs, runs in flight, measured rates) and hand over
their `WorkLedger`; everything the policy derives from the config or the ledger is
computed here, the same way for both. Pure: no I/O, no clock (time is passed in)."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from gyre_slurm.config.phases import step_shape
from gyre_slurm.config.schema import GyreConfig, HandoffConfig
from gyre_slurm.sched.cells import CellTable
from gyre_slurm.sched.ledger import WorkLedger
from gyre_slurm.sched.types import CellObs, Observation


@dataclass(frozen=True, kw_only=True)
class RunsNow:
    """The runs as the observer sees them now."""

    in_flight: int
    queued: int  # allowed to start (batch and staleness), waiting for a slot
    future: int  # planned, not yet allowed
    elapsed_s: np.ndarray  # of every run in flight
    steps: np.ndarray  # the step of every run in flight (as elapsed_s)


def min_train_cells(cfg: GyreConfig) -> int:
    """Cells a training world needs at least: one model replica."""
    return math.ceil(cfg.training.min_replica_nodes / cfg.cluster.cell_nodes)


class HandoffTimes:
    """Measured handoff transits, per direction: the seconds a moving cell served neither
    side (the engine's release and the world's rebuild; the wait for the micro-batch
    under way, the rebuild and the servers' start or resume), its drain not counted (the
    policy expects drains itself). A multi-cell handoff counts once: its cells move
    together. `costs(prior)` is what the policy is told: each direction's median of its
    last `keep`, the prior's until one has been measured. The coordinator and the
    simulator keep one each."""

    def __init__(self, keep: int = 10):
        self.seconds = {to: deque(maxlen=keep) for to in ("train", "rollout")}

    def add(self, to: str, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.seconds[to].append(float(seconds))

    def costs(self, prior: HandoffConfig) -> tuple[float, float]:
        """(to_train_s, to_rollout_s)."""
        train, rollout = self.seconds["train"], self.seconds["rollout"]
        return (statistics.median(train) if train else prior.to_train_s,
                statistics.median(rollout) if rollout else prior.to_rollout_s)


def build_observation(*, cfg: GyreConfig, now_s: float, table: CellTable,
                      cell_runs: Mapping[int, int], runs: RunsNow, ledger: WorkLedger,
                      version: int, streaming: bool, train_tokens_per_cell_s: float,
                      tokens_per_run: float, handoff: tuple[float, float],
                      call_interval_s: float | None = None) -> Observation:
    """`cell_runs`: runs each cell serves now; `version`: the step being trained;
    `handoff`: the costs the policy is told, (to_train_s, to_rollout_s): measured
    (`HandoffTimes.costs`), the config's until measured; `call_interval_s`: the mean
    time between a run's model calls, measured (None: the configured
    `rollout.call_interval_s`)."""
    cells = tuple(CellObs(c.cell_id, c.role, c.target, c.standalone,
                          int(cell_runs.get(c.cell_id, 0)), c.since_s) for c in table.cells)
    return Observation(
        now_s=now_s, cells=cells, cell_capacity=cfg.cell_capacity,
        runs_in_flight=runs.in_flight, runs_queued=runs.queued, runs_future=runs.future,
        run_elapsed_s=runs.elapsed_s,
        train_ready_tokens=float(ledger.trainable(version, streaming=streaming)),
        train_waiting_tokens=float(ledger.waiting(version, streaming=streaming)),
        train_tokens_per_cell_s=train_tokens_per_cell_s,
        min_train_cells=min_train_cells(cfg),
        tokens_per_run=tokens_per_run,
        policy_version=version, steps_done=version, num_steps=ledger.num_steps,
        handoff_to_train_s=float(handoff[0]), handoff_to_rollout_s=float(handoff[1]),
        step_runs_left=ledger.step_runs_left(version),
        run_steps=runs.steps,
        call_interval_s=cfg.rollout.call_interval_s if call_interval_s is None
        else float(call_interval_s),
    )


def prior_tokens_per_cell_s(cfg: GyreConfig) -> float:
    """Trained tokens/s per cell of a smallest training world, as configured
    (`training.node_tokens_per_s`): what the policy assumes until the trainer has
    measured its own."""
    t, nodes = cfg.training, cfg.cluster.cell_nodes
    cells = min_train_cells(cfg)
    return t.throughput(cells * nodes) / cells


def computed_per_tree_token(cfg: GyreConfig) -> float:
    """Tokens the trainer computes per token of a run's prefix tree (its packing)."""
    return 1.0 if cfg.training.packing == "tree" else cfg.workload.rows_reread


def prior_tokens_per_run(cfg: GyreConfig, step: int = 0) -> float:
    """A run's trained tokens at `step`, as configured (`workload.tokens_mean`, its
    phase's scale, times what the packing computes): what the policy assumes until
    trajectories have come."""
    return (cfg.workload.tokens_mean * computed_per_tree_token(cfg)
            * step_shape(cfg, step).tokens_scale)


def opening_observation(cfg: GyreConfig) -> Observation:
    """The job as it starts, from the config alone (its cells are filled in by the
    policy): every run of the first steps allowed and queued, nothing to train yet,
    training at the configured pace per cell of a smallest world, each run's trained
    tokens as configured (`workload.tokens_mean`, times what the packing computes)."""
    w, t = cfg.workload, cfg.training
    allowed = min(w.num_steps, t.max_staleness + 1) * w.runs_per_step
    return Observation(
        now_s=0.0, cells=(), cell_capacity=cfg.cell_capacity, runs_in_flight=0,
        runs_queued=allowed, runs_future=w.num_steps * w.runs_per_step - allowed,
        run_elapsed_s=np.zeros(0), train_ready_tokens=0.0, train_waiting_tokens=0.0,
        train_tokens_per_cell_s=prior_tokens_per_cell_s(cfg),
        min_train_cells=min_train_cells(cfg),
        tokens_per_run=prior_tokens_per_run(cfg, 0),
        policy_version=0, steps_done=0, num_steps=w.num_steps,
        handoff_to_train_s=cfg.handoff.to_train_s, handoff_to_rollout_s=cfg.handoff.to_rollout_s,
        run_steps=np.zeros(0, dtype=np.int64), call_interval_s=cfg.rollout.call_interval_s)
