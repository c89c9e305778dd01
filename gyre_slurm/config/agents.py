"""Config sections of the agents' side: the gateway agents call, and who may call it.

    gateway:
      default_max_tokens: null      # a request naming no max_tokens gets the room left
                                    # in the context, capped by this when set
      external:                     # runs the coordinator did not start (off by default)
        enabled: false
        prefix: ext-                # their run ids start with this
        max_runs: 64                # live at once; more are refused (429)
        idle_timeout_s: 600         # a run with no call this long ends and is freed
        max_run_s: 7200             # a run ends this long after its first call

With `external.enabled`, the coordinator writes `RUN_DIR/external_key` (mode 0600): a
client holding it may call `/runs/<prefix><anything>/v1/...`. Those runs are recorded
under `RUN_DIR/external/calls/` (never trained) and never count as the job's runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gyre_slurm.config.checks import at_most
from gyre_slurm.config.loader import FieldError, key

JOB_RUN_ID = re.compile(r"s\d")  # the job's run ids: s0000-p000-g00[-aN]
PREFIX = re.compile(r"[A-Za-z0-9_.:@+-]{1,40}")


@dataclass(frozen=True, kw_only=True)
class ExternalRunsConfig:
    """Runs the coordinator did not start (a user's own agents against the job's policy)."""

    enabled: bool = key(False, "accept runs the coordinator did not start (false: refuse "
                               "every such run)")
    prefix: str = key("ext-", "external run ids start with it; the job's never do")
    max_runs: int = key(64, "live external runs at once (a registration beyond: 429)")
    idle_timeout_s: float = key(600.0, "an external run with no call this long ends")
    max_run_s: float = key(7200.0, "an external run ends this long after it registered")

    def __post_init__(self) -> None:
        if not PREFIX.fullmatch(self.prefix) or JOB_RUN_ID.match(self.prefix):
            raise FieldError("prefix", f"= {self.prefix!r}: use 1-40 of A-Z a-z 0-9 _ . : @ + - "
                             "not starting like the job's run ids (s0000-...), e.g. ext-")
        for name in ("max_runs", "idle_timeout_s", "max_run_s"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """The OpenAI-compatible gateway in front of the rollout servers."""

    default_max_tokens: int | None = key(
        None, "max_tokens of a request naming none (null: the room left in the context)")
    external: ExternalRunsConfig = key(factory=ExternalRunsConfig,
                                       help=ExternalRunsConfig.__doc__)
    max_calls_per_run: int = key(
        2000, "model calls (choices) a run of a scaffold or a verifiers environment may "
              "make; past it the gateway answers 429 (the built-in loop stops at "
              "agent.max_turns)")

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise FieldError("default_max_tokens", f"must be >= 1 or null, got "
                             f"{self.default_max_tokens}")
        if self.max_calls_per_run < 1:
            raise FieldError("max_calls_per_run", f"must be >= 1, got {self.max_calls_per_run}")
        at_most("max_calls_per_run", self.max_calls_per_run, 2**31 - 1,
                "the call store's call numbers are int32")


SCAFFOLD_TYPES = ("builtin", "command", "mini-swe-agent")


@dataclass(frozen=True, kw_only=True)
class ScaffoldConfig:
    """Which agent drives a run: gyre's built-in loop, or an external program (any
    scaffold that speaks the OpenAI API), started per run in a sandbox of its own with
    the run's own gateway URL and key, its commands run in the task's sandbox through
    the gateway, and the reward from the environment's check once it has ended."""

    type: Literal["builtin", "command", "mini-swe-agent"] = key(
        "builtin", "builtin (gyre's agent loop), command (any program), or mini-swe-agent "
                   "(the shipped example)")
    command: tuple[str, ...] = key((), "type command: the program and its arguments (the "
                                       "task is in $GYRE_TASK and ~/TASK.md)")
    python: str | None = key(None, "the scaffold's interpreter: a path or env:<role> (type "
                                   "mini-swe-agent: default env:minisweagent); it also runs "
                                   "the sandbox's gateway relay")
    env_vars: dict[str, str] = key(factory=dict,
                                   help="extra environment variables of the scaffold")
    workdir: str | None = key(None, "a host folder with the scaffold's own files, shown "
                                    "read-only at /opt/scaffold and its working directory "
                                    "(null: its private writable home)")
    timeout_s: float = key(600.0, "the scaffold is stopped (its whole sandbox) after this")
    step_limit: int = key(20, "type mini-swe-agent: model calls per run at most")
    isolation: Literal["bwrap", "none"] = key(
        "bwrap", "bwrap (its own sandbox: no network but the run's gateway, no run dir, no "
                 "secret) or none (trusted programs only)")
    memory_mb: int = key(4096, "address space per process of the scaffold")
    nproc: int = key(512, "processes and threads of the scaffold's sandbox")
    disk_mb: int = key(1024, "what the scaffold's home (RUN_DIR/scaffolds/<run_id>, on the "
                             "shared filesystem) may hold; past it the scaffold is stopped")
    keep_homes: Literal["all", "failed", "none"] = key(
        "failed", "whose homes stay once their run has ended: all, failed (those of runs "
                  "that did not end ok, to see what went wrong), or none; a run's log "
                  "(RUN_DIR/logs/scaffold-<run_id>.log) always stays")

    def __post_init__(self) -> None:
        if self.type not in SCAFFOLD_TYPES:
            raise FieldError("type", f"= {self.type!r}: use one of {', '.join(SCAFFOLD_TYPES)}")
        if self.type == "command" and not self.command:
            raise FieldError("command", "is empty but type is command: give the program and "
                             "its arguments, e.g. [python3, my_agent.py]")
        if self.type != "command" and self.command:
            raise FieldError("command", f"is set but type is {self.type!r}: set type: command")
        if self.isolation not in ("bwrap", "none"):
            raise FieldError("isolation", f"= {self.isolation!r}: use bwrap or none")
        if self.keep_homes not in ("all", "failed", "none"):
            raise FieldError("keep_homes", f"= {self.keep_homes!r}: use all, failed or none")
        for name in ("timeout_s", "step_limit", "memory_mb", "nproc", "disk_mb"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        # prlimit takes 64-bit limits: past them it refused to start every scaffold
        at_most("memory_mb", self.memory_mb, 1 << 30, "MiB: 1 PiB")
        at_most("nproc", self.nproc, 1 << 22, "Linux's largest pid_max")
        at_most("disk_mb", self.disk_mb, 1 << 30, "MiB: 1 PiB")
        if self.python is not None and not self.python.strip():
            raise FieldError("python", "is empty: give an interpreter path, env:<role>, or null")
        bad = [k for k in self.env_vars if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
               or k in RESERVED_ENV]
        if bad:
            raise FieldError("env_vars", f"has {bad[0]!r}: not a variable name, or one gyre "
                             f"sets ({', '.join(RESERVED_ENV)})")

    @property
    def external(self) -> bool:
        return self.type != "builtin"


RESERVED_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "GYRE_RUN_ID", "GYRE_EXEC_URL", "GYRE_TASK")
