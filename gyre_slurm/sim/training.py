"""The training side of the simulator: micro-batches and training throughput.

Step k trains the runs of batch k and produces policy version k + 1 (one optimizer
step per batch; micro-batches accumulate gradients). What is ready to train is the
runtime's own ledger (`gyre_slurm.sched.ledger.WorkLedger`): a run's tokens become
trainable when its whole group has finished; streaming trains ready groups as they
come, otherwise a step starts only when its whole batch is ready. Throughput of a training world of `nodes` nodes:
`TrainingConfig.throughput` (`node_tokens_per_s * usable * scaling_efficiency **
log2(usable)`, `usable` counting only whole model replicas of `min_replica_nodes`), the
one model the config check and the scheduler's prior use too.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre_slurm.config.schema import TrainingConfig


def train_throughput(cfg: TrainingConfig, nodes: int) -> float:
    return cfg.throughput(nodes)


@dataclass
class Microbatch:
    end_s: float
    tokens: int
    world: frozenset[int]
    compute_s: float
    optimizer: bool = False  # the step's optimizer update, not a micro-batch
