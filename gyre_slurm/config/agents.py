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

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise FieldError("default_max_tokens", f"must be >= 1 or null, got "
                             f"{self.default_max_tokens}")
