"""The config schema: frozen dataclasses, one per section of the YAML file.

A config file (and a simulator preset, which is the same thing) has the sections
`cluster`, `scheduler`, `workload`, `rollout`, `training`, `handoff`, `sim`, `runtime`,
`trainer` and `gateway` (`config.agents`). Every
field has a default; a file names only what it changes. Units are in the names
(`_s` seconds, `_tokens`, `num_` counts). Checks that span fields live in
`GyreConfig.__post_init__` and say which key to change.

Every check runs when a config is loaded (`gyre config`, `gyre run`, `gyre submit`, the
sbatch script's first step), so a bad config is refused before any process starts. A
section's own check raises `FieldError(key, message)`, reported with the key's full path
(e.g. `cluster.num_nodes must be > 0, got 0`); cross-section checks raise `ConfigError`
naming every key involved and the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gyre_slurm.config.agents import GatewayConfig
from gyre_slurm.config.loader import FieldError, apply_overrides, from_dict, load_yaml_file
from gyre_slurm.config.phases import PhaseConfig, check_phases
from gyre_slurm.errors import ConfigError

PolicyName = Literal["elastic", "colocate", "async"]
NAME = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9_.+-]{0,99}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and math.isnan(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise FieldError(name, f"must be {bound}, got {value}")


@dataclass(frozen=True)
class ClusterConfig:
    num_nodes: int = 4
    gpus_per_node: int = 8
    cell_nodes: int = 1  # nodes per cell: the unit that changes role

    def __post_init__(self) -> None:
        _positive("num_nodes", self.num_nodes)
        _positive("gpus_per_node", self.gpus_per_node, allow_zero=True)  # 0: CPU only
        _positive("cell_nodes", self.cell_nodes)
        if self.num_nodes % self.cell_nodes:
            raise FieldError(
                "cell_nodes", f"= {self.cell_nodes}: cluster.num_nodes ({self.num_nodes}) is "
                f"not a multiple of it; set cluster.cell_nodes to a divisor of num_nodes")

    @property
    def num_cells(self) -> int:
        return self.num_nodes // self.cell_nodes


@dataclass(frozen=True)
class SchedulerConfig:
    policy: PolicyName = "elastic"
    min_rollout_cells: int = 1  # standalone floor: cells that always roll out
    min_train_cells: int = 1  # standalone floor: cells that always train
    streaming: bool = True  # train each group as it arrives, not the whole batch
    drain: Literal["wait", "migrate"] = "migrate"  # how a releasing cell's runs leave
    hysteresis: float = 0.5  # h in DESIGN 5: release while R - L >= 1 + h
    confirm_s: float = 60.0  # a release condition must hold this long
    forecast: bool = True  # use expected demand after the handoff, not demand now
    cost_gate: bool = True  # move a cell only if the work it gains exceeds the cost
    min_dwell_s: float = 300.0  # a cell stays at least this long in a role (anti-thrash)
    train_reserve_s: float | None = None  # reclaim keeps the train cells that clear the
    #                                       ready backlog in this time (None: no reserve)
    async_rollout_cells: int | None = None  # async: fixed rollout cells (None: even split)

    def __post_init__(self) -> None:
        _positive("min_rollout_cells", self.min_rollout_cells, allow_zero=True)
        _positive("min_train_cells", self.min_train_cells, allow_zero=True)
        _positive("hysteresis", self.hysteresis, allow_zero=True)
        _positive("confirm_s", self.confirm_s, allow_zero=True)
        _positive("min_dwell_s", self.min_dwell_s, allow_zero=True)
        if self.train_reserve_s is not None:
            _positive("train_reserve_s", self.train_reserve_s, allow_zero=True)


@dataclass(frozen=True)
class DurationConfig:
    """Run durations (wall time of one agent run at the reference load, seconds)."""

    dist: Literal["lognormal", "trace"] = "lognormal"
    mean_s: float = 600.0
    sigma: float = 0.8  # of the underlying normal
    max_s: float | None = None  # the agent's time limit: longer runs end there
    trace_file: str | None = None  # dist=trace: one duration in seconds per line

    def __post_init__(self) -> None:
        _positive("mean_s", self.mean_s)
        _positive("sigma", self.sigma, allow_zero=True)
        if self.max_s is not None:
            _positive("max_s", self.max_s)
        if self.dist == "trace" and not self.trace_file:
            raise FieldError("trace_file", "is not set but dist is 'trace'; give a file "
                             "with one duration in seconds per line, or dist: lognormal")


@dataclass(frozen=True)
class WorkloadConfig:
    num_steps: int = 4
    prompts_per_step: int = 8
    group_size: int = 4  # runs per prompt (the GRPO group)
    duration: DurationConfig = field(default_factory=DurationConfig)
    tokens_mean: float = 20_000.0  # tokens of a run's prefix tree (its selected
    #   trajectories, each shared prefix once) at mean duration: what tree packing computes
    rows_reread: float = 1.0  # tokens rows packing computes per tree token (a run's
    #   trajectories each re-read their shared prefix); 1.0: linear runs (see
    #   tools/bench_tree.py for measured values)
    tokens_follow_duration: bool = True  # False: every run trains tokens_mean tokens
    tokens_max: float = 1_000_000.0  # the most tokens a run costs the trainer
    llm_time_fraction: float = 0.5  # share of a run's time spent waiting on the model
    # How demand changes with the step (gyre_slurm/config/phases.py): each phase, from its
    # from_step on, scales durations and tokens, sets sigma and turns, grows per step.
    phases: tuple[PhaseConfig, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_steps", "prompts_per_step", "group_size", "tokens_mean", "tokens_max"):
            _positive(name, getattr(self, name))
        if not self.rows_reread >= 1.0:
            raise FieldError("rows_reread", f"must be >= 1 (rows never compute fewer tokens "
                             f"than the tree), got {self.rows_reread}")
        if not 0.0 <= self.llm_time_fraction <= 1.0:
            raise FieldError("llm_time_fraction",
                             f"must be in [0, 1], got {self.llm_time_fraction}")
        check_phases(self.phases, num_steps=self.num_steps, trace=self.duration.dist == "trace")

    @property
    def runs_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def _check_role_python(section: str, python: str | None, image: str | None) -> None:
    if python is not None and not python.strip():
        raise ConfigError(f"{section}.python is empty: give an interpreter path, "
                         f"`env:<role>` (tools/role-env) or leave it unset")
    if python is not None and python.startswith("env:") and not python[4:].strip():
        raise ConfigError(f"{section}.python = {python!r}: name the role, e.g. env:vllm")
    if image is not None and not image.strip():
        raise ConfigError(f"{section}.container_image is empty: name an image or leave it unset")


@dataclass(frozen=True)
class RolloutConfig:
    runs_per_node: int = 4  # concurrent runs a node serves at good throughput (a hard cap)
    half_load_runs: float = 4.0  # decode throughput per cell ~ n / (n + half_load_runs)
    reprefill_s: float = 30.0  # extra time a migrated run pays on its new cell
    weight_sync_s: float = 10.0  # rollout cells stall this long to load a new policy
    call_interval_s: float = 30.0  # mean time between a run's model calls (migration waits)
    # The real rollout servers (`gyre run`):
    engine: Literal["embedded", "vllm"] = "embedded"
    python: str | None = None  # the engine's interpreter: a path, `env:vllm`, None = gyre's
    container_image: str | None = None  # run the engine with srun --container-image (pyxis)
    tensor_parallel: int | None = None  # GPUs per server (None: all of a node's GPUs)
    max_model_len: int = 2048  # vLLM --max-model-len
    release: Literal["auto", "sleep", "pause", "stop"] = "auto"  # how a server frees its
    # GPUs at a handoff to training: auto = sleep on GPUs, pause on CPU (no sleep mode)
    engine_args: tuple[str, ...] = ()  # extra command-line arguments for vLLM

    def __post_init__(self) -> None:
        _positive("runs_per_node", self.runs_per_node)
        _positive("half_load_runs", self.half_load_runs, allow_zero=True)
        _positive("reprefill_s", self.reprefill_s, allow_zero=True)
        _positive("weight_sync_s", self.weight_sync_s, allow_zero=True)
        _positive("call_interval_s", self.call_interval_s)
        _positive("max_model_len", self.max_model_len)
        if self.tensor_parallel is not None:
            _positive("tensor_parallel", self.tensor_parallel)
        _check_role_python("rollout", self.python, self.container_image)
        if self.engine == "embedded" and (self.engine_args or self.release == "sleep"):
            raise ConfigError("rollout.engine_args and rollout.release: sleep apply to "
                             "rollout.engine: vllm (the embedded engine frees its model when "
                             "released, or stops with release: stop)")


@dataclass(frozen=True)
class TrainerConfig:
    """The real trainer (`gyre run`): which backend, its parallelism, its environment."""

    backend: Literal["torch", "megatron"] = "torch"
    python: str | None = None  # the ranks' interpreter: a path, `env:megatron`, None = gyre's
    container_image: str | None = None  # run the ranks with srun --container-image (pyxis)
    tensor_parallel: int = 1  # Megatron TP inside a replica
    pipeline_parallel: int = 1  # Megatron PP inside a replica
    ranks_per_node: int | None = None  # training processes per node (None: megatron one
    # per GPU, or 1 without GPUs; torch 1). The torch backend with one rank per node, its
    # own Python and no container runs inside the node agent; otherwise ranks are
    # processes of their own.
    grad_clip: float = 1.0
    # Benchmarks on machines whose virtual nodes share CPU cores (the local cluster):
    # hold each micro-batch until it has taken (tokens computed) / (nodes x this) seconds,
    # the pace of nodes that each bring their own accelerators. The real training still
    # runs; None (default): no holding.
    pace_node_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        _positive("tensor_parallel", self.tensor_parallel)
        if self.pace_node_tokens_per_s is not None:
            _positive("pace_node_tokens_per_s", self.pace_node_tokens_per_s)
        _positive("pipeline_parallel", self.pipeline_parallel)
        _positive("grad_clip", self.grad_clip)
        if self.ranks_per_node is not None:
            _positive("ranks_per_node", self.ranks_per_node)
        _check_role_python("trainer", self.python, self.container_image)
        if self.backend == "torch" and self.tensor_parallel * self.pipeline_parallel > 1:
            raise ConfigError("trainer.tensor_parallel / pipeline_parallel > 1 need "
                             "trainer.backend: megatron (the torch backend is data parallel)")
        if self.backend == "megatron" and self.python is None and self.container_image is None:
            raise ConfigError("trainer.backend: megatron runs in its own environment "
                             "(megatron-core needs Python >= 3.12): set trainer.python "
                             "(e.g. env:megatron, built by tools/role-env megatron) or "
                             "trainer.container_image")

    @property
    def replica_ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@dataclass(frozen=True)
class TrainingConfig:
    node_tokens_per_s: float = 2_000.0  # trained tokens/s of one node
    scaling_efficiency: float = 0.95  # throughput kept per doubling of training nodes
    min_replica_nodes: int = 1  # a model replica needs this many nodes to train at all
    max_staleness: int = 1  # a trajectory may lag the trained policy by this many versions
    optimizer_step_s: float = 5.0  # fixed cost per optimizer step
    microbatch_tokens: float = 100_000.0  # token budget of a micro-batch (tokens computed)
    packing: Literal["tree", "rows"] = "tree"  # how a micro-batch is fed to the trainer:
    #   tree: each run's prefix tree once, with a tree attention mask (docs/tree-training.md);
    #   rows: each trajectory whole, right-padded
    # The policy loss and its off-policy correction (formulas: gyre_slurm/train/loss.py,
    # docs/off-policy.md). ppo_clip: PPO's clip of the trainer/sampler ratio; tis:
    # truncated importance sampling (weight min(ratio, is_cap)); masked_is: tokens (or
    # sequences, is_mask_level) whose ratio leaves [is_band_low, is_band_high] dropped;
    # decoupled: PPO clip against the proximal policy (the weights at the step's start)
    # times the behaviour weight min(proximal/sampler, is_cap); gspo: the clip of the
    # sequence's geometric-mean ratio (gspo_clip_eps_*).
    loss: Literal["ppo_clip", "tis", "masked_is", "decoupled", "gspo"] = "ppo_clip"
    clip_eps_low: float = 0.2  # PPO clip range below 1 (ppo_clip, decoupled)
    clip_eps_high: float = 0.2  # PPO clip range above 1 (DAPO's clip-higher: e.g. 0.28)
    is_cap: float = 2.0  # C: the largest importance weight (tis, decoupled)
    is_band_low: float = 0.5  # masked_is keeps ratios >= this
    is_band_high: float = 2.0  # masked_is keeps ratios <= this
    is_mask_level: Literal["token", "sequence"] = "token"  # masked_is: what one ratio drops
    gspo_clip_eps_low: float = 3e-4  # GSPO's clip range of the sequence ratio (paper:
    gspo_clip_eps_high: float = 4e-4  # 3e-4 / 4e-4)

    def __post_init__(self) -> None:
        _positive("node_tokens_per_s", self.node_tokens_per_s)
        self._check_loss()
        if not 0.0 < self.scaling_efficiency <= 1.0:
            raise FieldError("scaling_efficiency",
                             f"must be in (0, 1], got {self.scaling_efficiency}")
        _positive("min_replica_nodes", self.min_replica_nodes)
        _positive("max_staleness", self.max_staleness, allow_zero=True)
        _positive("optimizer_step_s", self.optimizer_step_s, allow_zero=True)
        _positive("microbatch_tokens", self.microbatch_tokens)

    @property
    def loss_settings(self) -> dict:
        """The loss and its constants, as `gyre_slurm.train.loss.LossSettings` takes them."""
        return {"name": self.loss, **{k: getattr(self, k) for k in (
            "clip_eps_low", "clip_eps_high", "is_cap", "is_band_low", "is_band_high",
            "is_mask_level", "gspo_clip_eps_low", "gspo_clip_eps_high")}}

    def _check_loss(self) -> None:
        for name in ("clip_eps_low", "gspo_clip_eps_low"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise FieldError(name, f"must be in (0, 1) (the ratio is clipped at 1 - it), "
                                 f"got {getattr(self, name)}")
        for name in ("clip_eps_high", "gspo_clip_eps_high", "is_cap"):
            _positive(name, getattr(self, name))
        if self.is_cap < 1.0:
            raise FieldError("is_cap", f"= {self.is_cap} would down-weight on-policy tokens "
                             "(ratio 1): use a cap >= 1 (2 to 10 are usual)")
        if not 0.0 <= self.is_band_low <= 1.0 <= self.is_band_high:
            raise FieldError("is_band_low", f"and is_band_high must hold 1 (on-policy tokens "
                             f"are never dropped): 0 <= low <= 1 <= high, got "
                             f"[{self.is_band_low}, {self.is_band_high}]")


@dataclass(frozen=True)
class HandoffConfig:
    """Seconds per phase of a handoff (the coordinator measures these in real runs)."""

    engine_release_s: float = 10.0  # rollout engine frees the GPUs (sleep or stop)
    group_rebuild_s: float = 5.0  # torch.distributed + parallel state rebuilt
    train_state_load_s: float = 20.0  # new train member receives weights + optimizer
    weight_load_s: float = 10.0  # rollout engine loads the current policy
    engine_start_s: float = 20.0  # rollout engine starts or wakes

    def __post_init__(self) -> None:
        for name in ("engine_release_s", "group_rebuild_s", "train_state_load_s",
                     "weight_load_s", "engine_start_s"):
            _positive(name, getattr(self, name), allow_zero=True)

    @property
    def to_train_s(self) -> float:
        return self.engine_release_s + self.group_rebuild_s + self.train_state_load_s

    @property
    def to_rollout_s(self) -> float:
        return self.group_rebuild_s + self.weight_load_s + self.engine_start_s


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    policy_interval_s: float = 10.0  # how often the policy is asked (plus on each step)
    async_splits: tuple[int, ...] | None = None  # rollout-cell counts to try (None: all)

    def __post_init__(self) -> None:
        _positive("policy_interval_s", self.policy_interval_s)


def _check_env(name: str, params: dict) -> None:
    """The environment exists and takes these parameters (names only: its values are
    checked when the runtime makes one, and making one may need the compute node)."""
    from gyre_slurm.envs.base import env_names, env_param_names

    names = env_names()
    if name not in names:
        raise FieldError("env", f"= {name!r} is not an environment; use one of "
                         f"{', '.join(names)}")
    takes = env_param_names(name)
    if takes is None:
        return
    for key in params:
        if key not in takes:
            raise FieldError("env_params", f"has {key!r}, which environment {name!r} does "
                             f"not take; its parameters: {', '.join(takes) or 'none'}")


@dataclass(frozen=True)
class RuntimeConfig:
    """The real runtime (`gyre run`): launcher, engines, agents, trainer settings."""

    launcher: Literal["auto", "local", "slurm"] = "auto"  # auto: slurm inside a job
    node_addr_prefix: str = "127.0.10."  # virtual node i binds PREFIX(i+1)
    env: str = "learnable"  # an environment name (gyre_slurm.envs)
    env_params: dict[str, float | int | bool | str] = field(default_factory=dict)
    max_turns: int = 2
    context_budget_tokens: int = 1024
    max_tokens: int = 16
    temperature: float = 1.0
    runs_per_cell: int = 16  # concurrent runs one rollout cell serves
    max_per_run: int = 5  # K: trajectories kept per run
    lr: float = 1e-3
    model_hidden_size: int = 64
    model_layers: int = 2
    model_heads: int = 4  # attention heads (vLLM on CPU needs a head size of 32, 64, ...)
    model_family: Literal["llama", "qwen2"] = "llama"  # the tiny model made for the run
    heartbeat_s: float = 0.5
    agent_lost_s: float = 5.0  # a node agent silent this long is lost
    status_interval_s: float = 1.0
    policy_interval_s: float = 1.0
    checkpoint_every_steps: int = 1
    run_timeout_s: float = 300.0
    # Fault handling (gyre_slurm/runtime/recovery.py): a rollout engine is asked GET
    # /health every engine_check_s (timeout engine_health_timeout_s); after
    # engine_strikes failed checks in a row it is restarted on its cell, at most
    # max_engine_restarts times (then the cell fails). A run interrupted by its server
    # restarts after run_restart_backoff_s, at most max_run_attempts attempts in all.
    engine_check_s: float = 2.0
    engine_health_timeout_s: float = 5.0  # a busy vLLM-CPU server can take seconds
    engine_strikes: int = 3
    max_engine_restarts: int = 3
    max_run_attempts: int = 4
    run_restart_backoff_s: float = 1.0
    # An engine that does not release (handoff to training) or resume (back to rollout)
    # within this is killed; the cell's next rollout starts new engines.
    engine_handoff_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "context_budget_tokens", "max_tokens", "runs_per_cell",
                     "max_per_run", "lr", "heartbeat_s", "agent_lost_s",
                     "status_interval_s", "policy_interval_s", "checkpoint_every_steps",
                     "run_timeout_s", "model_hidden_size", "model_layers", "model_heads",
                     "engine_check_s", "engine_health_timeout_s", "engine_strikes",
                     "max_run_attempts", "engine_handoff_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("temperature", self.temperature, allow_zero=True)
        _positive("max_engine_restarts", self.max_engine_restarts, allow_zero=True)
        _positive("run_restart_backoff_s", self.run_restart_backoff_s, allow_zero=True)
        if self.model_hidden_size % self.model_heads:
            raise FieldError("model_heads", f"= {self.model_heads} must divide "
                             f"runtime.model_hidden_size = {self.model_hidden_size}")
        if self.agent_lost_s < 2 * self.heartbeat_s:
            raise FieldError("agent_lost_s", f"= {self.agent_lost_s:g} s is under two "
                             f"heartbeats (runtime.heartbeat_s = {self.heartbeat_s:g} s): "
                             f"healthy node agents would be declared lost; set it to at "
                             f"least {2 * self.heartbeat_s:g}")
        m = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.", self.node_addr_prefix)
        if m is None or max(int(m[1]), int(m[2])) > 255:
            raise FieldError("node_addr_prefix", f"must be a loopback prefix 127.X.Y. (X, Y "
                             f"in 0..255, with the final dot), got {self.node_addr_prefix!r}")
        _check_env(self.env, self.env_params)


@dataclass(frozen=True)
class GyreConfig:
    name: str = "unnamed"
    description: str = ""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ConfigError(f"name = {self.name!r}: it names run dirs and Slurm jobs; use "
                              f"1-100 of A-Z a-z 0-9 _ . + - (not starting with . or -)")
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
        min_train = math.ceil(self.training.min_replica_nodes / self.cluster.cell_nodes)
        if min_train > num_cells - sched.min_rollout_cells:
            raise ConfigError(
                f"a training replica needs {min_train} cells (training.min_replica_nodes = "
                f"{self.training.min_replica_nodes}, cluster.cell_nodes = "
                f"{self.cluster.cell_nodes}) but only {num_cells - sched.min_rollout_cells} "
                f"cells can ever train; lower scheduler.min_rollout_cells or add nodes"
            )
        most = num_cells - min_train
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
        rt = self.runtime
        if rt.launcher == "local" and self.cluster.num_nodes > 254:
            raise ConfigError(f"cluster.num_nodes = {self.cluster.num_nodes}: the local "
                              f"launcher gives each node one address {rt.node_addr_prefix}N "
                              f"(N up to 254); use fewer nodes or runtime.launcher: slurm")
        if self.rollout.engine == "vllm" and rt.max_tokens >= self.rollout.max_model_len:
            raise ConfigError(f"runtime.max_tokens = {rt.max_tokens} leaves no room for a "
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
        head = self.runtime.model_hidden_size // self.runtime.model_heads
        if self.rollout.engine == "vllm" and not gpus and head not in (
                32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ConfigError(
                f"vLLM's CPU attention takes head sizes 32, 64, 80, ... only; the run's model "
                f"has {head} (runtime.model_hidden_size {self.runtime.model_hidden_size} / "
                f"model_heads {self.runtime.model_heads}): set runtime.model_heads to "
                f"{max(1, self.runtime.model_hidden_size // 32)}")
        tp = self.rollout.tensor_parallel
        if tp is not None and gpus and (tp > gpus or gpus % tp):
            raise ConfigError(f"rollout.tensor_parallel = {tp} must divide "
                              f"cluster.gpus_per_node = {gpus} (servers run inside a node)")

    @property
    def release_mode(self) -> str:
        """How a rollout server frees its node at a handoff to training: `rollout.release`,
        with auto = sleep on GPUs, pause on CPU (vLLM has no sleep mode there)."""
        if self.rollout.release != "auto":
            return self.rollout.release
        return "sleep" if self.cluster.gpus_per_node else "pause"

    @property
    def servers_per_node(self) -> int:
        """Rollout servers on each node of a rollout cell."""
        gpus, tp = self.cluster.gpus_per_node, self.rollout.tensor_parallel
        return 1 if not gpus or tp is None else gpus // tp

    @property
    def cell_capacity(self) -> int:
        """Concurrent runs one cell serves (the hard cap of the rollout model)."""
        return self.rollout.runs_per_node * self.cluster.cell_nodes


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                *, base: dict | None = None) -> GyreConfig:
    """Load a config file (or `base` data), apply `--set` overrides, check strictly."""
    data = dict(base or {})
    if path is not None:
        data = load_yaml_file(path)
    data = apply_overrides(data, list(overrides or []))
    return from_dict(GyreConfig, data)
