"""The config schema: `GyreConfig`, its sections (`sections.py`) and the checks that span
them.

A config file (and a simulator preset, which is the same thing) has top-level `name`,
`description` and `seed`, and the sections `cluster`, `scheduler`, `workload`, `agent`,
`model`, `rollout`, `training`, `optimizer`, `loss`, `trainer`, `handoff`, `faults`,
`monitor`, `sim` and `gateway` (`config.agents`). Every field has a default and a description (`gyre config keys`
prints them); a file names only what it changes.

Every check runs when a config is loaded (`gyre config`, `gyre run`, `gyre submit`, the
sbatch script's first step), so a bad config is refused before any process starts. A
section's own check raises `FieldError(key, message)`, reported with the key's full path
(e.g. `cluster.num_nodes must be > 0, got 0`); cross-section checks raise `ConfigError`
naming every key involved and the fix. A key of an older layout (`RENAMED`) is refused
with the key that replaced it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gyre_slurm.config.agents import GatewayConfig
from gyre_slurm.config.loader import apply_overrides, from_dict, key, load_yaml_file, to_dict
from gyre_slurm.config.checks import MAX_LOCAL_NODES
from gyre_slurm.config.sections import (AgentConfig, ClusterConfig, DurationConfig,
                                        FaultsConfig, HandoffConfig, ModelConfig,
                                        MonitorConfig, PolicyName, RolloutConfig,
                                        SchedulerConfig, SimConfig, WorkloadConfig)
from gyre_slurm.config.training import (LossConfig, OptimizerConfig, TrainerConfig,
                                        TrainingConfig)
from gyre_slurm.errors import ConfigError

__all__ = ["AgentConfig", "ClusterConfig", "DurationConfig", "FaultsConfig", "GatewayConfig", "GyreConfig",
           "HandoffConfig", "LossConfig", "ModelConfig", "MonitorConfig", "OptimizerConfig",
           "PolicyName", "RENAMED", "RolloutConfig", "SchedulerConfig", "SimConfig",
           "TrainerConfig", "TrainingConfig", "WorkloadConfig", "load_config"]

NAME = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9_.+-]{0,99}")

# Keys of the older layout -> what replaced them (a key path, or a sentence).
RENAMED: dict[str, str] = {
    **{f"runtime.{k}": f"cluster.{k}" for k in ("launcher", "node_addr_prefix")},
    **{f"runtime.{k}": f"agent.{k}" for k in (
        "env", "env_params", "max_turns", "context_budget_tokens", "max_tokens",
        "temperature", "run_timeout_s")},
    **{f"runtime.model_{k}": f"model.{k}" for k in ("hidden_size", "layers", "heads",
                                                    "family")},
    **{f"runtime.{k}": f"faults.{k}" for k in (
        "heartbeat_s", "agent_lost_s", "engine_check_s", "engine_health_timeout_s",
        "engine_strikes", "max_engine_restarts", "max_run_attempts", "run_restart_backoff_s",
        "engine_handoff_timeout_s")},
    "runtime.runs_per_cell": "rollout.runs_per_node (runs one node serves; a cell serves "
                             "runs_per_node x cluster.cell_nodes)",
    "runtime.max_per_run": "training.max_per_run",
    "runtime.checkpoint_every_steps": "training.checkpoint_every_steps",
    "runtime.lr": "optimizer.lr",
    "runtime.clip_eps": "loss.clip_eps_low and loss.clip_eps_high",
    "training.loss": "loss.kind",
    **{f"training.{k}": f"loss.{k}" for k in (
        "clip_eps_low", "clip_eps_high", "is_cap", "is_band_low", "is_band_high",
        "is_mask_level", "gspo_clip_eps_low", "gspo_clip_eps_high")},
    "runtime.status_interval_s": "monitor.status_interval_s",
    "runtime.policy_interval_s": "scheduler.interval_s (the runtime's and the simulator's)",
    "sim.policy_interval_s": "scheduler.interval_s (the runtime's and the simulator's)",
    "sim.seed": "seed (top level: the simulator's and the runtime's)",
    "trainer.grad_clip": "optimizer.grad_clip",
    "trainer.pace_node_tokens_per_s": "trainer.pace: true, with the pace in "
                                      "training.node_tokens_per_s",
    "scheduler.cost_gate": "scheduler.min_gain (elastic weighs what every move gains "
                           "against what it costs; no gate to turn off)",
    "scheduler.train_reserve_s": "scheduler.horizon_steps (elastic keeps the train cells "
                                 "the outlook of the steps ahead needs)",
    "runtime": "split by concern: its keys are now in cluster, agent, model, rollout, "
               "training, optimizer, faults, monitor and scheduler",
}


@dataclass(frozen=True, kw_only=True)
class GyreConfig:
    """A whole config: what `gyre run`, `gyre sim` and `gyre submit` read."""

    RENAMED: ClassVar[dict[str, str]] = RENAMED  # the loader refuses these, naming the new key

    name: str = key("unnamed", "names the run's Slurm job and default run dir")
    description: str = key("", "one line on what this config is for")
    seed: int = key(0, "seeds the workload sample, the simulator, the model's first weights "
                       "and every run's environment")
    cluster: ClusterConfig = key(factory=ClusterConfig, help=ClusterConfig.__doc__)
    scheduler: SchedulerConfig = key(factory=SchedulerConfig, help=SchedulerConfig.__doc__)
    workload: WorkloadConfig = key(factory=WorkloadConfig, help=WorkloadConfig.__doc__)
    agent: AgentConfig = key(factory=AgentConfig, help=AgentConfig.__doc__)
    model: ModelConfig = key(factory=ModelConfig, help=ModelConfig.__doc__)
    rollout: RolloutConfig = key(factory=RolloutConfig, help=RolloutConfig.__doc__)
    training: TrainingConfig = key(factory=TrainingConfig, help=TrainingConfig.__doc__)
    optimizer: OptimizerConfig = key(factory=OptimizerConfig, help=OptimizerConfig.__doc__)
    loss: LossConfig = key(factory=LossConfig, help=LossConfig.__doc__)
    trainer: TrainerConfig = key(factory=TrainerConfig, help=TrainerConfig.__doc__)
    handoff: HandoffConfig = key(factory=HandoffConfig, help=HandoffConfig.__doc__)
    faults: FaultsConfig = key(factory=FaultsConfig, help=FaultsConfig.__doc__)
    monitor: MonitorConfig = key(factory=MonitorConfig, help=MonitorConfig.__doc__)
    sim: SimConfig = key(factory=SimConfig, help=SimConfig.__doc__)
    gateway: GatewayConfig = key(factory=GatewayConfig, help=GatewayConfig.__doc__)

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ConfigError(f"name = {self.name!r}: it names run dirs and Slurm jobs; use "
                              f"1-100 of A-Z a-z 0-9 _ . + - (not starting with . or -)")
        if not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"seed = {self.seed}: seeds are whole numbers from 0 to "
                              f"2**63 - 1")
        self._check_engines()
        self._check_cells()
        self._check_runtime()

    def _check_cells(self) -> None:
        num_cells = self.cluster.num_cells
        sched = self.scheduler
        floors = sched.min_rollout_cells + sched.min_train_cells
        if floors > num_cells:
            raise ConfigError(
                f"scheduler.min_rollout_cells + scheduler.min_train_cells = {floors} but the "
                f"cluster has only {num_cells} cells ({self.cluster.num_nodes} nodes / "
                f"cell_nodes {self.cluster.cell_nodes}); lower the floors or add nodes"
            )
        if self.training.min_replica_nodes > self.cluster.num_nodes:
            raise ConfigError(
                f"training.min_replica_nodes = {self.training.min_replica_nodes} exceeds "
                f"cluster.num_nodes = {self.cluster.num_nodes}: the model cannot train"
            )
        t, nodes = self.training, self.cluster.num_nodes
        if not t.throughput(nodes) > 0:
            raise ConfigError(
                f"training.node_tokens_per_s = {t.node_tokens_per_s:g} with "
                f"scaling_efficiency = {t.scaling_efficiency:g} kept per doubling of nodes "
                f"gives {nodes} nodes a throughput of 0 tokens/s (a float underflow): the "
                f"scheduler's forecast and the simulator divide by it; raise them")
        min_train = math.ceil(self.training.min_replica_nodes / self.cluster.cell_nodes)
        if min_train > num_cells - sched.min_rollout_cells:
            raise ConfigError(
                f"a training replica needs {min_train} cells (training.min_replica_nodes = "
                f"{self.training.min_replica_nodes}, cluster.cell_nodes = "
                f"{self.cluster.cell_nodes}) but only {num_cells - sched.min_rollout_cells} "
                f"cells can ever train; lower scheduler.min_rollout_cells or add nodes"
            )
        most = num_cells - min_train
        if sched.policy == "async" and most < 1:
            raise ConfigError(
                f"scheduler.policy async holds a fixed split, but a training replica needs "
                f"{min_train} cells (training.min_replica_nodes = "
                f"{self.training.min_replica_nodes}, cluster.cell_nodes = "
                f"{self.cluster.cell_nodes}) and the cluster has {num_cells}: no cell is "
                f"left to roll out beside it. Use colocate or elastic, or add nodes")
        if sched.async_rollout_cells is not None and not 0 < sched.async_rollout_cells <= most:
            raise ConfigError(
                f"scheduler.async_rollout_cells must be between 1 and {most} (the cluster has "
                f"{num_cells} cells and a training replica needs {min_train}), "
                f"got {sched.async_rollout_cells}"
            )
        bad = [r for r in self.sim.async_splits or () if not 0 < r <= most]
        if bad:
            raise ConfigError(f"sim.async_splits has {bad[0]}: each split must be between 1 "
                              f"and {most} rollout cells (the cluster has {num_cells} cells "
                              f"and a training replica needs {min_train})")

    def _check_runtime(self) -> None:
        cl = self.cluster
        if cl.launcher == "local" and cl.num_nodes > MAX_LOCAL_NODES:
            raise ConfigError(f"cluster.num_nodes = {cl.num_nodes}: the local "
                              f"launcher gives each node one address {cl.node_addr_prefix}N "
                              f"(N up to {MAX_LOCAL_NODES}); use fewer nodes or "
                              f"cluster.launcher: slurm")
        max_tokens = self.agent.max_tokens
        if self.rollout.engine == "vllm" and max_tokens >= self.rollout.max_model_len:
            raise ConfigError(f"agent.max_tokens = {max_tokens} leaves no room for a "
                              f"prompt within rollout.max_model_len = "
                              f"{self.rollout.max_model_len}; lower it or raise max_model_len")

    @property
    def ranks_per_node(self) -> int:
        """Training processes per node (the torch backend: 1 unless asked for more)."""
        if self.trainer.ranks_per_node is not None:
            return self.trainer.ranks_per_node
        return 1 if self.trainer.backend == "torch" else max(1, self.cluster.gpus_per_node)

    @property
    def replica_nodes(self) -> int:
        """Nodes one model replica (TP x PP ranks) spans."""
        return math.ceil(self.trainer.replica_ranks / self.ranks_per_node)

    def _check_engines(self) -> None:
        gpus, tr = self.cluster.gpus_per_node, self.trainer
        if gpus and tr.ranks_per_node is not None and tr.ranks_per_node > gpus:
            raise ConfigError(f"trainer.ranks_per_node = {tr.ranks_per_node} exceeds "
                              f"cluster.gpus_per_node = {gpus}: one rank per GPU at most")
        rpn = self.ranks_per_node
        if tr.replica_ranks > rpn and tr.replica_ranks % rpn:
            raise ConfigError(
                f"a replica of trainer.tensor_parallel x pipeline_parallel = "
                f"{tr.replica_ranks} ranks must fill whole nodes of {rpn} ranks "
                f"(trainer.ranks_per_node); change the parallelism or ranks_per_node")
        if tr.replica_ranks < rpn and rpn % tr.replica_ranks:
            raise ConfigError(
                f"{rpn} ranks per node do not split into replicas of {tr.replica_ranks} "
                f"(tensor_parallel x pipeline_parallel); change one of them")
        if self.training.min_replica_nodes < self.replica_nodes:
            raise ConfigError(
                f"a replica of {tr.replica_ranks} ranks (trainer.tensor_parallel x "
                f"pipeline_parallel) spans {self.replica_nodes} nodes of {rpn} ranks, but "
                f"training.min_replica_nodes = {self.training.min_replica_nodes}: set it to "
                f"{self.replica_nodes} (or a multiple)")
        cell, whole = self.cluster.cell_nodes, self.replica_nodes
        if (cell % whole if whole <= cell else whole % cell):
            raise ConfigError(
                f"a replica of trainer.tensor_parallel x pipeline_parallel = "
                f"{tr.replica_ranks} ranks spans {whole} nodes of {rpn} ranks, which does not "
                f"tile cells of cluster.cell_nodes = {cell} (a cell must hold whole replicas, "
                f"or a replica whole cells); change the parallelism or cluster.cell_nodes")
        if self.training.min_replica_nodes % self.replica_nodes:
            raise ConfigError(
                f"training.min_replica_nodes = {self.training.min_replica_nodes} must be a "
                f"multiple of the {self.replica_nodes} nodes a replica spans")
        self._check_experts()
        model = self.model
        head = model.hidden_size // model.heads
        if self.rollout.engine == "vllm" and not gpus and model.path is None and head not in (
                32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ConfigError(
                f"vLLM's CPU attention takes head sizes 32, 64, 80, ... only; the run's model "
                f"has {head} (model.hidden_size {model.hidden_size} / "
                f"heads {model.heads}): set model.heads to "
                f"{max(1, model.hidden_size // 32)}")
        tp = self.rollout.tensor_parallel
        if tp is not None and gpus and (tp > gpus or gpus % tp):
            raise ConfigError(f"rollout.tensor_parallel = {tp} must divide "
                              f"cluster.gpus_per_node = {gpus} (servers run inside a node)")

    def _check_experts(self) -> None:
        from gyre_slurm.train.layout import expert_parallel_fits, world_unit

        tr, model = self.trainer, self.model
        if tr.expert_parallel == 1:
            return
        per_cell = self.cluster.cell_nodes * self.ranks_per_node
        if model.path is not None:  # the model's experts are checked at the run's start
            pass
        elif model.family != "qwen3_moe":
            raise ConfigError(f"trainer.expert_parallel = {tr.expert_parallel} splits the "
                              f"experts of a mixture-of-experts model; model.family "
                              f"{model.family} has none (use qwen3_moe, or expert_parallel 1)")
        elif model.experts % tr.expert_parallel:
            raise ConfigError(f"trainer.expert_parallel = {tr.expert_parallel} must divide "
                              f"model.experts = {model.experts}")
        if not expert_parallel_fits(tr.expert_parallel, ranks_per_cell=per_cell,
                                    tp=tr.tensor_parallel, pp=tr.pipeline_parallel):
            unit = world_unit(ranks_per_cell=per_cell, tp=tr.tensor_parallel,
                              pp=tr.pipeline_parallel)
            raise ConfigError(
                f"training worlds are multiples of {unit} ranks (a cell's, or a replica's), "
                f"which trainer.expert_parallel {tr.expert_parallel} x pipeline_parallel "
                f"{tr.pipeline_parallel} does not divide; lower expert_parallel or raise "
                f"trainer.ranks_per_node / cluster.cell_nodes")

    @property
    def release_mode(self) -> str:
        """How a rollout server frees its node at a handoff to training: `rollout.release`,
        with auto = sleep on GPUs, pause on CPU (vLLM has no sleep mode there)."""
        if self.rollout.release != "auto":
            return self.rollout.release
        return "sleep" if self.cluster.gpus_per_node else "pause"

    @property
    def standby_engines(self) -> bool:
        """Whether the cells that open in training get released servers at the start
        (`rollout.standby`). auto: with the elastic policy where servers sleep (GPUs):
        there a cold start takes minutes and a wake seconds. Not on CPU: the nodes of a
        local cluster share its cores, and the standby starts slowed the layout by what
        they saved later (docs/bench-modes.md, session 42)."""
        if self.rollout.standby != "auto":
            return self.rollout.standby == "always"
        return self.scheduler.policy == "elastic" and self.release_mode == "sleep"

    @property
    def servers_per_node(self) -> int:
        """Rollout servers on each node of a rollout cell."""
        gpus, tp = self.cluster.gpus_per_node, self.rollout.tensor_parallel
        return 1 if not gpus or tp is None else gpus // tp

    @property
    def cell_capacity(self) -> int:
        """Concurrent runs one cell serves (the hard cap of the rollout model)."""
        return self.rollout.runs_per_node * self.cluster.cell_nodes


# What a resumed run may not change with `--set`: what its run dir's state was made of
# (the model's weights and tokenizer, the run ids of every recorded call and trajectory,
# the trainer state's format and layout). Everything else (the learning rate, the steps
# to run, the scheduler, faults, the launcher) may change on resume.
FIXED_ON_RESUME = ("model.", "workload.prompts_per_step", "workload.group_size",
                   "trainer.backend", "trainer.precision", "trainer.tensor_parallel",
                   "trainer.pipeline_parallel", "trainer.expert_parallel",
                   "trainer.distributed_optimizer")


def changed_keys(old: GyreConfig, new: GyreConfig) -> dict[str, tuple[Any, Any]]:
    """Key path -> (old, new) for every value that differs (lists compared whole)."""
    out: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and path.count(".") < 8:
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out[path] = (a, b)

    walk(to_dict(old), to_dict(new), "")
    return out


def check_resume_changes(changes: dict[str, tuple[Any, Any]]) -> None:
    """Refuse a `--set` on resume that changes what the run dir's state was made of."""
    fixed = [k for k in changes if any(k == f or (f.endswith(".") and k.startswith(f))
                                       for f in FIXED_ON_RESUME)]
    if fixed:
        said = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in fixed[:6])
        raise ConfigError(
            f"--resume cannot change {', '.join(fixed[:6])} ({said}): the run dir's model, "
            f"recorded runs and trainer state were made with the old value; drop the "
            f"--set, or start a new run (another --run-dir)")


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                *, base: dict | None = None) -> GyreConfig:
    """Load a config file (or `base` data), apply `--set` overrides, check strictly."""
    data = dict(base or {})
    if path is not None:
        data = load_yaml_file(path)
    data = apply_overrides(data, list(overrides or []))
    return from_dict(GyreConfig, data)
