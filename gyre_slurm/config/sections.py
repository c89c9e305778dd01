"""The sections of a config, one frozen keyword-only dataclass per concern.

Every field is declared with `key(default, "description")`: the description is the
field's metadata, printed by `gyre config keys`. Units are in the names (`_s` seconds,
`_tokens`, `num_` counts). A section's `__post_init__` checks its own values and raises
`FieldError(key, message)`; loading reports it with the key's full path. Checks that span
sections live in `schema.GyreConfig`; the checks and limits the sections share in
`checks`; the training side's sections in `training`, the agent's in `agents`.

One key per concept: the simulator and the runtime read the same keys (runs a node
serves, the policy's interval, training speed, the seed); a key that only one of them
reads says so in its description.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gyre_slurm.config.agents import ScaffoldConfig
from gyre_slurm.config.checks import (MAX_GPUS_PER_NODE, MAX_JOB_RUNS, MAX_MODEL_LEN,
                                      MAX_NUM_NODES, MAX_POLICY_INTERVAL_S,
                                      MAX_RUNS_PER_NODE, MAX_TEMPERATURE, TINY_MAX_PARAMS,
                                      all_positive, at_least, at_most, check_role_python,
                                      positive)
from gyre_slurm.config.loader import FieldError, key
from gyre_slurm.config.phases import MAX_DURATION_S, MAX_SIGMA, PhaseConfig, check_phases
from gyre_slurm.errors import ConfigError

PolicyName = Literal["elastic", "colocate", "async"]


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The allocation: its nodes, how they group into cells, how node agents start."""

    num_nodes: int = key(4, "nodes of the allocation (the Slurm job's nodes)")
    gpus_per_node: int = key(8, "GPUs of each node; 0: CPU only")
    cell_nodes: int = key(1, "nodes per cell, the unit that changes role; divides num_nodes")
    launcher: Literal["auto", "local", "slurm"] = key(
        "auto", "how node agents start: local processes (virtual nodes), one srun step "
                "(slurm), or auto (slurm inside a Slurm job, else local)")
    node_addr_prefix: str = key(
        "127.0.10.", "local launcher: virtual node i binds the loopback address PREFIX(i+1)")

    def __post_init__(self) -> None:
        positive("num_nodes", self.num_nodes)
        at_most("num_nodes", self.num_nodes, MAX_NUM_NODES, "nodes of one job")
        positive("gpus_per_node", self.gpus_per_node, allow_zero=True)
        at_most("gpus_per_node", self.gpus_per_node, MAX_GPUS_PER_NODE, "GPUs of one node")
        positive("cell_nodes", self.cell_nodes)
        if self.num_nodes % self.cell_nodes:
            raise FieldError(
                "cell_nodes", f"= {self.cell_nodes}: cluster.num_nodes ({self.num_nodes}) is "
                f"not a multiple of it; set cluster.cell_nodes to a divisor of num_nodes")
        m = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.", self.node_addr_prefix)
        if m is None or max(int(m[1]), int(m[2])) > 255:
            raise FieldError("node_addr_prefix", f"must be a loopback prefix 127.X.Y. (X, Y "
                             f"in 0..255, with the final dot), got {self.node_addr_prefix!r}")

    @property
    def num_cells(self) -> int:
        return self.num_nodes // self.cell_nodes


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The policy that moves cells between rollout and training (docs/scheduler.md)."""

    policy: PolicyName = key("elastic", "elastic (cells move by the waterlevel), colocate "
                                        "(all roll out, then all train) or async (a fixed split)")
    min_rollout_cells: int = key(1, "standalone floor: cells that always roll out")
    min_train_cells: int = key(1, "standalone floor: cells that always train")
    streaming: bool = key(True, "simulator: train each group as it arrives, not the whole "
                                "batch at once (the runtime always trains what is ready)")
    drain: Literal["auto", "wait", "migrate"] = key(
        "auto", "how a releasing cell's runs leave: migrate at their next call, wait for "
                "them to end, or auto: whichever the outlook expects to finish sooner "
                "(heavy tails: often wait)")
    forecast: bool = key(True, "elastic decides by the outlook of the steps ahead (false: "
                               "the waterlevel rule on the demand now)")
    horizon_steps: int = key(2, "steps the outlook looks ahead, beyond those allowed now, "
                                  "where demand changes within them (steps all alike: 1)")
    min_gain: float = key(0.02, "a move must finish the outlook's horizon this fraction of "
                                "its time sooner")
    lend_cells: int = key(4, "elastic lends at most this many spare rollout cells (and "
                             "half the cells) to training in a step's tail (no run waiting "
                             "to start, the next batch not yet allowed) and takes them back "
                             "when it is; 0: never. Only where a model replica is one cell, "
                             "on 4 cells or more, and where a new batch needs the cells back "
                             "(docs/scheduler.md)")
    hysteresis: float = key(0.5, "the waterlevel rule's h: release while R - L >= 1 + h, "
                                 "reclaim while L > R + h")
    confirm_s: float = key(60.0, "a release must stay the best move this long before a "
                                 "cell goes")
    min_dwell_s: float = key(300.0, "a cell stays at least this long in a role (anti-thrash)")
    async_rollout_cells: int | None = key(
        None, "policy async: the fixed number of rollout cells (null: half the cells)")
    interval_s: float = key(1.0, "how often the policy is asked for decisions (and at every "
                                 "step), in the runtime and in the simulator")

    def __post_init__(self) -> None:
        all_positive(self, ("min_rollout_cells", "min_train_cells", "hysteresis",
                             "confirm_s", "min_dwell_s", "min_gain", "lend_cells"),
                      allow_zero=True)
        positive("horizon_steps", self.horizon_steps)
        positive("interval_s", self.interval_s)
        at_most("interval_s", self.interval_s, MAX_POLICY_INTERVAL_S,
                 "seconds between the policy's looks: a cell may wait that long for a "
                 "move, and colocate for each of its two handoffs a step; seconds to a "
                 "minute suit any job")


@dataclass(frozen=True, kw_only=True)
class DurationConfig:
    """Run durations: wall time of one agent run at the reference load (a full cell)."""

    dist: Literal["lognormal", "trace"] = key("lognormal", "lognormal, or a trace file")
    mean_s: float = key(600.0, "mean run duration, seconds (also the forecast's prior)")
    sigma: float = key(0.8, "lognormal: sigma of the underlying normal")
    max_s: float | None = key(None, "the duration distribution's cap: longer runs end there")
    trace_file: str | None = key(None, "dist trace: one duration in seconds per line, # a "
                                       "comment (relative paths: to the config file)")

    def __post_init__(self) -> None:
        positive("mean_s", self.mean_s)
        positive("sigma", self.sigma, allow_zero=True)
        if self.max_s is not None:
            positive("max_s", self.max_s)
        for name in ("mean_s", "max_s"):
            if getattr(self, name) is not None:
                at_most(name, getattr(self, name), MAX_DURATION_S,
                         "seconds; about 32 years: check the unit")
        at_most("sigma", self.sigma, MAX_SIGMA, "the spread of log durations; 5 puts the "
                 "mean 268,000 times the median")
        if self.dist == "trace" and not self.trace_file:
            raise FieldError("trace_file", "is not set but dist is 'trace'; give a file "
                             "with one duration in seconds per line, or dist: lognormal")


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """The job: steps, prompts and runs; the shape of runs for the simulator and forecast."""

    num_steps: int = key(4, "optimizer steps of the job")
    prompts_per_step: int = key(8, "prompts (tasks) per step")
    group_size: int = key(4, "runs per prompt (the GRPO group)")
    duration: DurationConfig = key(factory=DurationConfig, help="run durations")
    tokens_mean: float = key(
        20_000.0, "simulator: tokens of a run's prefix tree (its selected trajectories, each "
                  "shared prefix once) at mean duration: what tree packing computes")
    rows_reread: float = key(
        1.0, "simulator: tokens rows packing computes per tree token (a run's trajectories "
             "each re-read their shared prefix); 1.0: linear runs (tools/bench_tree.py "
             "measures it)")
    tokens_follow_duration: bool = key(
        True, "simulator: a run's tokens grow with its duration (false: every run "
              "tokens_mean)")
    tokens_max: float = key(1_000_000.0, "simulator: the most tokens a run costs the trainer")
    llm_time_fraction: float = key(0.5, "simulator: share of a run's time spent waiting on "
                                        "the model")
    phases: tuple[PhaseConfig, ...] = key(
        (), "how demand changes with the step (config/phases.py): each phase, from its "
            "from_step on, scales durations and tokens, sets sigma and turns, grows per step")

    def __post_init__(self) -> None:
        all_positive(self, ("num_steps", "prompts_per_step", "group_size", "tokens_mean",
                             "tokens_max"))
        at_least("tokens_max", self.tokens_max, 1.0, "a run trains at least one token")
        if not self.rows_reread >= 1.0:
            raise FieldError("rows_reread", f"must be >= 1 (rows never compute fewer tokens "
                             f"than the tree), got {self.rows_reread}")
        if not 0.0 <= self.llm_time_fraction <= 1.0:
            raise FieldError("llm_time_fraction",
                             f"must be in [0, 1], got {self.llm_time_fraction}")
        check_phases(self.phases, num_steps=self.num_steps, trace=self.duration.dist == "trace")
        runs = self.num_steps * self.runs_per_step
        if runs > MAX_JOB_RUNS:
            raise FieldError("num_steps", f"x prompts_per_step x group_size = "
                             f"{self.num_steps:,} x {self.prompts_per_step:,} x "
                             f"{self.group_size:,} = {runs:,} runs; a job (and a simulation) "
                             f"books every run of the job as it starts, at most "
                             f"{MAX_JOB_RUNS:,}: run fewer steps or smaller ones (a "
                             f"simulation's figures are per step and per job alike)")

    @property
    def runs_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


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
    for param in params:
        if param not in takes:
            raise FieldError("env_params", f"has {param!r}, which environment {name!r} does "
                             f"not take; its parameters: {', '.join(takes) or 'none'}")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """An agent run: its environment and the built-in agent loop's sampling."""

    env: str = key("learnable", "the environment (gyre_slurm.envs): learnable, longhorizon, "
                                "shell, or one registered with register_env")
    env_params: dict[str, float | int | bool | str] = key(
        factory=dict, help="the environment's parameters (names checked against it)")
    max_turns: int = key(2, "model calls per run at most")
    context_budget_tokens: int = key(1024, "the agent compacts its history past this size")
    max_tokens: int = key(16, "tokens generated per call at most")
    temperature: float = key(1.0, "sampling temperature")
    run_timeout_s: float = key(300.0, "a run still going after this is ended as a timeout")
    scaffold: ScaffoldConfig = key(factory=ScaffoldConfig, help=ScaffoldConfig.__doc__)
    scaffold_per_task: dict[str, ScaffoldConfig] = key(
        factory=dict, help="task id pattern (fnmatch, e.g. shell/count-lines/*) -> the "
                           "scaffold of those tasks (the first match; else `scaffold`)")

    def __post_init__(self) -> None:
        all_positive(self, ("max_turns", "context_budget_tokens", "max_tokens",
                             "run_timeout_s"))
        positive("temperature", self.temperature, allow_zero=True)
        at_most("temperature", self.temperature, MAX_TEMPERATURE,
                 "the gateway refuses a call above it, so every run would fail")
        _check_env(self.env, self.env_params)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model: a Hugging Face model directory (`path`), or the tiny model a run makes
    for itself (gyre_slurm.models.tiny) from the other keys."""

    path: str | None = key(None, "a Hugging Face model directory both roles start from "
                                 "(config.json, tokenizer, safetensors: one file or shards "
                                 "with their index), on a filesystem every node sees; null: "
                                 "the tiny model the keys below describe")
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = key(
        "llama", "architecture of the tiny model (docs/models.md): llama, qwen2 (q/k/v "
                 "biases), qwen3 (q/k norms), qwen3_moe (qwen3 with a mixture of experts)")
    hidden_size: int = key(64, "hidden size")
    layers: int = key(2, "transformer layers")
    heads: int = key(4, "attention heads (vLLM on CPU needs a head size of 32, 64, ...)")
    experts: int = key(8, "qwen3_moe: experts in every layer")
    experts_per_token: int = key(2, "qwen3_moe: experts routed per token (top-k)")

    def __post_init__(self) -> None:
        if self.path is not None and not self.path.strip():
            raise FieldError("path", "is empty: name a Hugging Face model directory, or "
                             "leave it unset for the tiny model")
        all_positive(self, ("hidden_size", "layers", "heads", "experts", "experts_per_token"))
        if self.experts_per_token > self.experts:
            raise FieldError("experts_per_token", f"= {self.experts_per_token} exceeds "
                             f"model.experts = {self.experts}")
        if self.hidden_size % self.heads:
            raise FieldError("heads", f"= {self.heads} must divide "
                             f"model.hidden_size = {self.hidden_size}")
        if self.path is None:
            n = self.tiny_params()
            if n > TINY_MAX_PARAMS:
                raise FieldError("layers", f"= {self.layers}, model.hidden_size = "
                                 f"{self.hidden_size}" + (f", model.experts = {self.experts}"
                                                          if self.family == "qwen3_moe" else "")
                                 + f": the tiny model would have {n:,} parameters; it is made "
                                 f"from random weights in the coordinator's memory, for tests "
                                 f"and CPU runs, at most {TINY_MAX_PARAMS:,}: make it smaller, "
                                 f"or give a real model with model.path")

    def tiny_params(self) -> int:
        """Parameters of the tiny model these keys make (models.tiny.make_model_dir: a
        vocabulary of at most 512, an MLP of twice the hidden size, experts of half)."""
        from gyre_slurm.models.shape import ModelShape

        h = self.hidden_size
        moe = self.family == "qwen3_moe"
        return ModelShape(family=self.family, vocab_size=512, hidden_size=h,
                          ffn_hidden_size=2 * h, num_layers=self.layers, num_heads=self.heads,
                          num_kv_heads=self.heads, head_dim=h // self.heads,
                          num_experts=self.experts if moe else 0,
                          moe_top_k=self.experts_per_token if moe else 0,
                          moe_ffn_hidden_size=max(1, h // 2) if moe else 0,
                          ).num_params()["total"]


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Rollout servers: how many runs they take, the engine, and their speed model."""

    runs_per_node: int = key(4, "concurrent runs one node serves at good throughput (a hard "
                                "cap); a cell serves runs_per_node x cluster.cell_nodes")
    half_load_runs: float = key(4.0, "simulator: decode throughput per cell ~ n / (n + this)")
    reprefill_s: float = key(30.0, "simulator: extra time a migrated run pays on its new cell")
    weight_sync_s: float = key(10.0, "simulator: serving cells stall this long to load each "
                                     "new policy")
    call_interval_s: float = key(30.0, "mean time between a run's model calls: the simulator "
                                       "draws calls from it; the elastic policy expects a "
                                       "migrating run to leave at its next call (the "
                                       "runtime measures it once runs have called)")
    engine: Literal["embedded", "vllm"] = key("embedded", "the rollout engine")
    python: str | None = key(None, "the engine's interpreter: a path, env:<role> "
                                   "(tools/role-env), or null (gyre's own)")
    container_image: str | None = key(None, "run the engine in this image (srun "
                                            "--container-image, pyxis)")
    tensor_parallel: int | None = key(None, "GPUs per server (null: all of a node's GPUs)")
    max_model_len: int = key(2048, "vLLM --max-model-len")
    release: Literal["auto", "sleep", "pause", "stop"] = key(
        "auto", "how a server frees its node at a handoff to training: auto = sleep on "
                "GPUs, pause on CPU (vLLM has no sleep mode there)")
    standby: Literal["auto", "always", "never"] = key(
        "auto", "always | never: cells that open in training (beyond the standalone "
                "floor) start their servers too and release them at once, so that a "
                "cell's first move to rollout resumes a released server (seconds) instead "
                "of starting one (minutes on GPUs); auto = always with scheduler.policy "
                "elastic where servers sleep (GPUs), never on CPU (docs/runtime.md)")
    engine_args: tuple[str, ...] = key((), "extra command-line arguments for vLLM")
    weight_sync: Literal["stream", "file"] = key(
        "file", "how each new policy reaches the servers (docs/weight-sync.md): stream, the "
                "training ranks send their shards straight to the servers' workers in "
                "buckets (gloo on CPU, NCCL on GPUs), no rank holding the whole model; file, "
                "training rank 0 gathers the model into RUN_DIR/weights/vN, which every "
                "server reads")
    weight_bucket_mb: float = key(64.0, "stream: tensors per bucket, MB in the wire dtype (a "
                                        "rank's memory grows by about one bucket in a sync)")
    weight_sync_timeout_s: float = key(
        60.0, "stream: a send or receive silent this long fails the round (the hung server "
              "is restarted, the others are sent the policy again)")

    def __post_init__(self) -> None:
        positive("runs_per_node", self.runs_per_node)
        at_most("runs_per_node", self.runs_per_node, MAX_RUNS_PER_NODE,
                 "concurrent runs one node serves; vLLM serves hundreds")
        all_positive(self, ("half_load_runs", "reprefill_s", "weight_sync_s"),
                      allow_zero=True)
        all_positive(self, ("call_interval_s", "max_model_len", "weight_bucket_mb",
                             "weight_sync_timeout_s"))
        at_most("max_model_len", self.max_model_len, MAX_MODEL_LEN,
                 "tokens of one sequence; the longest contexts are about 10 M")
        at_most("weight_bucket_mb", self.weight_bucket_mb, 1 << 20,
                 "1 TiB: a bucket over the model's size holds all of it; 1e30 passed its "
                 "size to vLLM's server as an integer past 64 bits, and no sync started")
        at_least("weight_bucket_mb", self.weight_bucket_mb, 0.001,
                  "a bucket holds at least one tensor whatever its size; under 1 KB the "
                  "first weight sync would fail mid-job")
        if self.tensor_parallel is not None:
            positive("tensor_parallel", self.tensor_parallel)
            at_most("tensor_parallel", self.tensor_parallel, MAX_GPUS_PER_NODE,
                     "a server runs inside one node")
        check_role_python("rollout", self.python, self.container_image)
        if self.engine == "embedded" and (self.engine_args or self.release == "sleep"):
            raise ConfigError("rollout.engine_args and rollout.release: sleep apply to "
                              "rollout.engine: vllm (the embedded engine frees its model when "
                              "released, or stops with release: stop)")
        if self.standby == "always" and self.release == "stop":
            raise ConfigError("rollout.standby: always keeps a released server on each cell "
                              "that opens in training, which rollout.release: stop would stop "
                              "at once; set rollout.standby: auto or never, or another "
                              "release")


@dataclass(frozen=True, kw_only=True)
class HandoffConfig:
    """Seconds per phase of a handoff: the simulator's costs and the policy's prior. The
    runtime measures the real ones into events.jsonl and, once a cell has moved each
    way, tells the policy those (the median of the last 10 transits) instead."""

    engine_release_s: float = key(10.0, "a rollout engine frees the GPUs (sleep or stop)")
    group_rebuild_s: float = key(5.0, "torch.distributed and parallel state rebuilt")
    train_state_load_s: float = key(20.0, "a new training member receives weights and "
                                          "optimizer state")
    weight_load_s: float = key(10.0, "a returning rollout engine loads the current policy")
    engine_start_s: float = key(20.0, "a rollout engine starts or wakes")

    def __post_init__(self) -> None:
        all_positive(self, ("engine_release_s", "group_rebuild_s", "train_state_load_s",
                             "weight_load_s", "engine_start_s"), allow_zero=True)

    @property
    def to_train_s(self) -> float:
        return self.engine_release_s + self.group_rebuild_s + self.train_state_load_s

    @property
    def to_rollout_s(self) -> float:
        return self.group_rebuild_s + self.weight_load_s + self.engine_start_s


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Faults the job survives (gyre_slurm/runtime/recovery.py): how they are detected
    and how often they are retried."""

    heartbeat_s: float = key(0.5, "a node agent sends a heartbeat this often")
    agent_lost_s: float = key(5.0, "a node agent silent this long is lost (its cell fails)")
    engine_check_s: float = key(2.0, "a rollout engine's health is checked this often")
    engine_health_timeout_s: float = key(5.0, "a health check not answered in this fails "
                                              "(a busy vLLM-CPU server can take seconds)")
    engine_strikes: int = key(3, "failed health checks in a row that restart an engine")
    engine_start_grace_s: float = key(
        60.0, "a new engine's health checks that time out are no strikes for this long, "
              "until it first answers a generation (its first calls are slow on a loaded "
              "node); refused connections still are")
    max_engine_restarts: int = key(3, "engine restarts per server before its cell fails")
    max_run_attempts: int = key(4, "attempts of a run interrupted by its server, in all")
    run_restart_backoff_s: float = key(1.0, "an interrupted run restarts after this")
    engine_handoff_timeout_s: float = key(
        120.0, "an engine that does not release or resume within this is killed; the "
               "cell's next rollout starts new engines")
    agent_register_s: float = key(
        300.0, "every node agent registers within this after the launch, or the job "
               "stops naming the nodes that did not (srun of hundreds of nodes importing "
               "Python from a shared filesystem can take minutes)")
    max_skipped_steps: int = key(
        3, "steps in a row that train nothing before the job stops: a non-finite gradient "
           "norm skipped the update (the model has diverged), or no run of the step ended "
           "ok (a broken agent or environment, a run timeout too short); 0: never stop")

    def __post_init__(self) -> None:
        all_positive(self, ("heartbeat_s", "agent_lost_s", "engine_check_s",
                             "engine_health_timeout_s", "engine_strikes", "max_run_attempts",
                             "engine_handoff_timeout_s", "agent_register_s"))
        all_positive(self, ("max_engine_restarts", "run_restart_backoff_s",
                             "engine_start_grace_s", "max_skipped_steps"), allow_zero=True)
        if self.agent_lost_s < 2 * self.heartbeat_s:
            raise FieldError("agent_lost_s", f"= {self.agent_lost_s:g} s is under two "
                             f"heartbeats (faults.heartbeat_s = {self.heartbeat_s:g} s): "
                             f"healthy node agents would be declared lost; set it to at "
                             f"least {2 * self.heartbeat_s:g}")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """What the job writes for `gyre status` and `gyre report`."""

    status_interval_s: float = key(1.0, "status.json is rewritten this often")

    def __post_init__(self) -> None:
        positive("status_interval_s", self.status_interval_s)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """The simulator's own settings (`gyre sim`)."""

    async_splits: tuple[int, ...] | None = key(
        None, "async: the rollout-cell counts to try for the best split (null: all)")
