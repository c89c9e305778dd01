"""The training side's sections: what is trained and how fast (`training`), the
optimizer, the policy loss, and the trainer that runs it (`trainer`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from gyre_slurm.config.checks import (MAX_RANKS_PER_NODE, all_positive, at_least, at_most,
                                      check_role_python, positive)
from gyre_slurm.config.loader import FieldError, key
from gyre_slurm.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What is trained and how fast: batches, staleness, checkpoints, training speed."""

    max_staleness: int = key(1, "a trajectory may lag the trained policy by this many "
                                "versions")
    microbatch_tokens: float = key(100_000.0, "token budget of a micro-batch (tokens "
                                              "computed)")
    packing: Literal["tree", "rows"] = key(
        "tree", "how a micro-batch is fed to the trainer: tree, each run's prefix tree once "
                "with a tree attention mask (docs/tree-training.md); rows, each trajectory "
                "whole, right-padded")
    max_per_run: int = key(5, "K: trajectories kept per run (the prefix tree's paths)")
    checkpoint_every_steps: int = key(1, "a checkpoint after every this many steps")
    keep_checkpoints: int = key(
        3, "the newest this many checkpoints stay (and the weights files of their "
           "versions); older ones are removed once a newer one is written; 0: every one")
    keep_microbatch_steps: int = key(
        2, "the micro-batch files (stream/) of the newest this many trained steps stay; "
           "older ones are removed as each step ends (each holds every token of its "
           "trajectories: gigabytes a step for long agent runs; the `microbatch` events "
           "keep what each trained, runs and token digests); 0: every one")
    node_tokens_per_s: float = key(
        2_000.0, "trained tokens/s of one node: the simulator's speed and the policy's "
                 "prior (with trainer.pace, also the pace real training is held to)")
    scaling_efficiency: float = key(0.95, "simulator: throughput kept per doubling of "
                                          "training nodes")
    min_replica_nodes: int = key(1, "a model replica needs this many nodes to train at all")
    optimizer_step_s: float = key(5.0, "simulator: fixed cost of each optimizer step")

    def __post_init__(self) -> None:
        all_positive(self, ("node_tokens_per_s", "min_replica_nodes", "microbatch_tokens",
                             "max_per_run", "checkpoint_every_steps"))
        at_least("microbatch_tokens", self.microbatch_tokens, 1.0,
                  "a micro-batch holds whole tokens; below one, none would ever train")
        if not 0.0 < self.scaling_efficiency <= 1.0:
            raise FieldError("scaling_efficiency",
                             f"must be in (0, 1], got {self.scaling_efficiency}")
        all_positive(self, ("max_staleness", "optimizer_step_s", "keep_checkpoints",
                            "keep_microbatch_steps"), allow_zero=True)

    def throughput(self, nodes: int) -> float:
        """Trained tokens/s of a world of `nodes` nodes, as the simulator and the
        scheduler's prior model it: `node_tokens_per_s * usable * scaling_efficiency **
        log2(usable)`, `usable` counting only whole model replicas (0 when none fits)."""
        usable = (nodes // self.min_replica_nodes) * self.min_replica_nodes
        if usable <= 0:
            return 0.0
        return self.node_tokens_per_s * usable * self.scaling_efficiency ** math.log2(usable)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW, one step per batch."""

    lr: float = key(1e-3, "learning rate")
    grad_clip: float = key(1.0, "gradients are clipped to this global norm")

    def __post_init__(self) -> None:
        all_positive(self, ("lr", "grad_clip"))


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy loss and its off-policy correction (formulas: gyre_slurm/train/loss.py,
    docs/off-policy.md)."""

    kind: Literal["ppo_clip", "tis", "masked_is", "decoupled", "gspo"] = key(
        "ppo_clip", "ppo_clip: PPO's clip of the trainer/sampler ratio; tis: truncated "
                    "importance sampling (weight min(ratio, is_cap)); masked_is: tokens (or "
                    "sequences) whose ratio leaves [is_band_low, is_band_high] dropped; "
                    "decoupled: PPO clip against the proximal policy (the weights at the "
                    "step's start) times the behaviour weight min(proximal/sampler, is_cap); "
                    "gspo: the clip of the sequence's geometric-mean ratio")
    clip_eps_low: float = key(0.2, "PPO clip range below 1 (ppo_clip, decoupled)")
    clip_eps_high: float = key(0.2, "PPO clip range above 1 (ppo_clip, decoupled; DAPO's "
                                    "clip-higher: e.g. 0.28)")
    is_cap: float = key(2.0, "C: the largest importance weight (tis, decoupled)")
    is_band_low: float = key(0.5, "masked_is keeps ratios >= this")
    is_band_high: float = key(2.0, "masked_is keeps ratios <= this")
    is_mask_level: Literal["token", "sequence"] = key(
        "token", "masked_is: whether one ratio out of the band drops a token or its sequence")
    gspo_clip_eps_low: float = key(3e-4, "gspo: clip range of the sequence ratio below 1 "
                                         "(paper: 3e-4)")
    gspo_clip_eps_high: float = key(4e-4, "gspo: clip range of the sequence ratio above 1 "
                                          "(paper: 4e-4)")

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "gspo_clip_eps_low"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise FieldError(name, f"must be in (0, 1) (the ratio is clipped at 1 - it), "
                                 f"got {getattr(self, name)}")
        all_positive(self, ("clip_eps_high", "gspo_clip_eps_high", "is_cap"))
        if self.is_cap < 1.0:
            raise FieldError("is_cap", f"= {self.is_cap} would down-weight on-policy tokens "
                             "(ratio 1): use a cap >= 1 (2 to 10 are usual)")
        if not 0.0 <= self.is_band_low <= 1.0 <= self.is_band_high:
            raise FieldError("is_band_low", f"and is_band_high must hold 1 (on-policy tokens "
                             f"are never dropped): 0 <= low <= 1 <= high, got "
                             f"[{self.is_band_low}, {self.is_band_high}]")

    @property
    def settings(self) -> dict:
        """The loss and its constants, as `gyre_slurm.train.loss.LossSettings` takes them."""
        out = dataclasses.asdict(self)
        return {"name": out.pop("kind"), **out}


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The real trainer (`gyre run`): its backend, parallelism and environment."""

    backend: Literal["torch", "megatron"] = key("torch", "torch (data parallel, gloo on CPU) "
                                                         "or megatron (TP x PP x DP)")
    python: str | None = key(None, "the ranks' interpreter: a path, env:<role> "
                                   "(tools/role-env), or null (gyre's own)")
    container_image: str | None = key(None, "run the ranks in this image (srun "
                                            "--container-image, pyxis)")
    tensor_parallel: int = key(1, "Megatron tensor parallelism inside a replica")
    pipeline_parallel: int = key(1, "Megatron pipeline parallelism inside a replica")
    expert_parallel: int = key(1, "Megatron expert parallelism (MoE models): the experts "
                                  "split over this many ranks; each world's size must be a "
                                  "multiple of expert_parallel x pipeline_parallel")
    precision: Literal["fp32", "bf16"] = key(
        "fp32", "megatron: parameters in fp32, or bf16 with fp32 master weights and moments")
    distributed_optimizer: bool = key(
        False, "megatron: Megatron's distributed optimizer (optimizer state sharded over the "
               "data-parallel ranks, resharded at every handoff)")
    ranks_per_node: int | None = key(
        None, "training processes per node (null: megatron one per GPU, or 1 without GPUs; "
              "torch 1)")
    warm_up: Literal["auto", "always", "never"] = key(
        "auto", "a training rank pays its first build's one-time costs (the torch trainer: "
                "the model built once on the meta device) as it starts, not at its first "
                "join; auto: not with the local launcher, whose virtual nodes share the "
                "host's cores (there the warm-ups slow the engine starts the layout waits "
                "for)")
    pace: bool = key(False, "hold each micro-batch to training.node_tokens_per_s per node: "
                            "benchmarks whose virtual nodes share CPU cores get the pace of "
                            "nodes with their own accelerators (the training still runs)")

    def __post_init__(self) -> None:
        all_positive(self, ("tensor_parallel", "pipeline_parallel", "expert_parallel"))
        if self.ranks_per_node is not None:
            positive("ranks_per_node", self.ranks_per_node)
            at_most("ranks_per_node", self.ranks_per_node, MAX_RANKS_PER_NODE,
                     "processes on one node")
        check_role_python("trainer", self.python, self.container_image)
        if self.backend == "torch" and self.tensor_parallel * self.pipeline_parallel > 1:
            raise ConfigError("trainer.tensor_parallel / pipeline_parallel > 1 need "
                              "trainer.backend: megatron (the torch backend is data parallel)")
        if self.backend == "torch" and (self.expert_parallel > 1 or self.precision != "fp32"
                                        or self.distributed_optimizer):
            raise ConfigError("trainer.expert_parallel > 1, precision: bf16 and "
                              "distributed_optimizer need trainer.backend: megatron (the "
                              "torch backend trains fp32 replicas with plain AdamW)")
        if self.backend == "megatron" and self.python is None and self.container_image is None:
            raise ConfigError("trainer.backend: megatron runs in its own environment "
                              "(megatron-core needs Python >= 3.12): set trainer.python "
                              "(e.g. env:megatron, built by tools/role-env megatron) or "
                              "trainer.container_image")

    @property
    def replica_ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel
