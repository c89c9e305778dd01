"""The training side of the simulator: steps, micro-batches, and what is ready to train.

Step k trains the runs of batch k and produces policy version k + 1 (one optimizer
step per batch; micro-batches accumulate gradients). A run's tokens become trainable
when its whole group has finished (the group baseline of the advantage needs every
reward). Streaming trains ready groups as they come; otherwise a step starts only when
its whole batch is ready. Throughput of a training world of `nodes` nodes:
`node_tokens_per_s * usable * scaling_efficiency ** log2(usable)`, where `usable` counts
only whole model replicas of `min_replica_nodes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gyre_slurm.config.schema import TrainingConfig


def train_throughput(cfg: TrainingConfig, nodes: int) -> float:
    usable = (nodes // cfg.min_replica_nodes) * cfg.min_replica_nodes
    if usable <= 0:
        return 0.0
    return cfg.node_tokens_per_s * usable * cfg.scaling_efficiency ** math.log2(usable)


@dataclass
class Microbatch:
    end_s: float
    tokens: int
    world: frozenset[int]
    compute_s: float
    optimizer: bool = False  # the step's optimizer update, not a micro-batch


@dataclass
class StepLedger:
    """Token accounting per step."""

    total: np.ndarray  # tokens each step will train
    ready: np.ndarray  # trainable now, not yet trained
    trained: np.ndarray
    runs_left: np.ndarray  # runs of the batch not finished
    group_left: np.ndarray  # per group: members not finished
    group_tokens: np.ndarray  # per group: tokens of finished members
    trajectories: np.ndarray  # per step: trajectories trained (whole runs)
    done_tokens: int = 0  # tokens of all finished runs

    @classmethod
    def build(cls, *, tokens: np.ndarray, batch: np.ndarray, group: np.ndarray,
              num_steps: int, group_size: int) -> "StepLedger":
        num_groups = int(group.max()) + 1 if group.size else 0
        return cls(
            total=np.bincount(batch, weights=tokens, minlength=num_steps).astype(np.int64),
            ready=np.zeros(num_steps, dtype=np.int64),
            trained=np.zeros(num_steps, dtype=np.int64),
            runs_left=np.bincount(batch, minlength=num_steps).astype(np.int64),
            group_left=np.full(num_groups, group_size, dtype=np.int64),
            group_tokens=np.zeros(num_groups, dtype=np.int64),
            trajectories=np.zeros(num_steps, dtype=np.int64),
        )

    def run_finished(self, *, step: int, group: int, tokens: int, group_size: int) -> bool:
        """Record a finished run; True when its group became trainable."""
        self.runs_left[step] -= 1
        self.done_tokens += tokens
        self.group_left[group] -= 1
        self.group_tokens[group] += tokens
        if self.group_left[group] == 0:
            self.ready[step] += self.group_tokens[group]
            self.trajectories[step] += group_size
            return True
        return False

    def trainable(self, step: int, *, streaming: bool) -> int:
        if step >= self.total.size:
            return 0
        if streaming or self.runs_left[step] == 0 and self.ready[step] + self.trained[step] == self.total[step]:
            return int(self.ready[step])
        return 0

    def waiting(self, step: int, *, streaming: bool, in_progress: int) -> int:
        """Tokens of finished runs that cannot be trained yet."""
        return int(self.done_tokens - self.trained.sum() - in_progress
                   - self.trainable(step, streaming=streaming))
