"""What a config value may be: the checks the sections share (each raises `FieldError`
or `ConfigError`, naming the key and the fix) and the limits past which a value means
nothing on any machine and breaks the runtime or the simulator (each with the fault it
once caused)."""

from __future__ import annotations

import math
from typing import Any

from gyre_slurm.config.loader import FieldError
from gyre_slurm.errors import ConfigError


def positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and math.isnan(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise FieldError(name, f"must be {bound}, got {value}")


def all_positive(section: Any, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    for name in names:
        positive(name, getattr(section, name), allow_zero=allow_zero)


# Upper limits where a value past them means nothing and breaks the arithmetic of the
# forecast and the simulator (a lognormal's grid of exp(mu +- 6 sigma) overflows; a rate
# table of one entry per concurrent run cannot be allocated): far above any real job.
MAX_RUNS_PER_NODE = 100_000
MAX_TEMPERATURE = 1e6  # the gateway's (gateway/openai.py): a call above it is refused
MAX_POLICY_INTERVAL_S = 3600.0  # scheduler.interval_s: a move waits up to one interval
# GPUs of one node, and processes of one node's training ranks: above any machine's (an
# HGX node has 8 GPUs, the largest 16). A rank count of 10**23 made each node agent
# build that many environments until it died, and the job ended with a traceback.
MAX_GPUS_PER_NODE = 64
# A sequence's tokens: the tiny model's positions follow it, and 10**23 made a config.json
# no trainer reads (Megatron's shapes are int32); vLLM's rotary cache grows with it.
MAX_MODEL_LEN = 1 << 24
MAX_NUM_NODES = 100_000  # nodes of one job: the largest machines have about 10,000
MAX_LOCAL_NODES = 254  # the local launcher's node i binds PREFIX(i + 1): one octet each
MAX_RANKS_PER_NODE = 256
# Runs of a whole job: the coordinator books every run of the job as it starts (about
# 350 bytes and 8 us each; runtime.book.StepBook), and so does the simulator (a row of
# its arrays each). 10**23 runs a step hung `gyre run` before it printed a line; this is
# above any real job (1,000 steps of 2,000 runs).
MAX_JOB_RUNS = 2_000_000
# The tiny model (model.path unset) is built from random weights in the coordinator's
# memory and copied to every rank and engine: for tests and CPU runs (its default has
# 0.15 M parameters), far below this. A model of millions of layers took the machine's
# memory before anything said why.
TINY_MAX_PARAMS = 1_000_000_000


def _num(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:,g}"


def at_least(name: str, value: float, limit: float, why: str) -> None:
    if not value >= limit:
        raise FieldError(name, f"must be >= {_num(limit)} ({why}), got {value:g}")


def at_most(name: str, value: float, limit: float, why: str) -> None:
    if value > limit:
        raise FieldError(name, f"must be <= {_num(limit)} ({why}), got {value:g}")


def check_role_python(section: str, python: str | None, image: str | None) -> None:
    if python is not None and not python.strip():
        raise ConfigError(f"{section}.python is empty: give an interpreter path, "
                          f"`env:<role>` (tools/role-env) or leave it unset")
    if python is not None and python.startswith("env:") and not python[4:].strip():
        raise ConfigError(f"{section}.python = {python!r}: name the role, e.g. env:vllm")
    if image is not None and not image.strip():
        raise ConfigError(f"{section}.container_image is empty: name an image or leave it unset")
