"""The environment interface that agent runs drive, a registry, and task sampling.

Protocol (async, because a tool call takes wall time):

    env = make_env("learnable", **params)          # any registered name
    first = await env.reset(task_id=..., seed=..., run_seed=...)  # the first observation
    res = await env.step(action)                    # StepResult(observation, reward, done, info)
    ...                                             # until res.done
    await env.close()

`run_seed` (optional, None = unseeded) seeds what an env draws that is not part of the
task (tool latency, noise), so that a workload replays exactly: the runtime passes
`run_seed_of(config seed, run id)` (the same for a run in every layout and attempt).

`env.system_prompt` (a string, set by `reset` for the task) is the system message an
agent puts first. `step` after `done` raises `RuntimeError`. The reward of a step is
the reward earned by that step; environments here pay only on the last step, so the
run's reward is the `reward` of the final `StepResult`. It must be a finite number
(`run_reward`): a run whose env pays NaN, an infinity, a string or None fails with
that said, rather than making its whole group's advantages NaN.

`info` is a dict of JSON-able facts about the step (each env documents its keys).
`close` releases what the env holds (files, processes); a closed env may be `reset`
again. The runtime makes one env per run (`make_env(rt.env, **rt.env_params)`), drives
it with the agent loop (`gyre_slurm.agents.loop`: the action is the model's reply
text, the observation the next user message) and closes it when the run ends.

To plug in an environment: a class with `name`, `system_prompt`, `reset`, `step` and
`close`, registered with `register_env(name, factory, task_names=None)`, where
`factory(**params)` returns a fresh instance (one instance serves one run at a time)
and `task_names(params) -> list[str]`, if given, names the env's tasks. See
docs/environments.md.

Tasks: `tasks_for_step(env_name, step=, num_prompts=, seed=, env_params=)` gives the
prompts of a training step as `TaskSpec(task_id, seed)`; it is a pure function of its
arguments (blake2b of (env, seed, step, index), not Python's salted `hash`), so every
process that asks gets the same list. `task_id` is "<env>/<task seed>", or, for an env
registered with `task_names`, "<env>/<name>/<task seed>" with name =
sorted(names)[task seed % len(names)]; with `pool_size` the task seeds are drawn from
0..pool_size-1 (so tasks repeat across steps; pool_size = len(names) gives each named
task one seed).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gyre_slurm.errors import UserError


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def run_reward(value: Any, *, env_name: str) -> float:
    """A run's final reward as a float, or ValueError saying what is wrong with it. Any
    real number passes (a bool, numpy's and torch's scalars: what `float` takes); a
    string is refused even where `float` would read it (a reward of "0.5" is an env's
    mistake), and so are NaN, the infinities and integers past a float's range: one such
    reward makes the mean, and so every advantage, of its group NaN."""
    if not isinstance(value, (str, bytes)):  # float() reads "0.5" and b"0.5"
        try:
            reward = float(value)
        except (TypeError, ValueError, OverflowError, RuntimeError):  # torch: RuntimeError
            pass
        else:
            if math.isfinite(reward):
                return reward
    raise ValueError(f"environment {env_name!r} paid the reward {value!r:.60} "
                     f"({type(value).__name__}): a run's reward must be a finite number")


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    seed: int


@runtime_checkable
class Environment(Protocol):
    name: str
    system_prompt: str

    async def reset(self, *, task_id: str, seed: int, run_seed: int | None = None) -> str: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


_REGISTRY: dict[str, Callable[..., Environment]] = {}
_TASK_NAMES: dict[str, Callable[[dict[str, Any]], list[str]]] = {}


def register_env(name: str, factory: Callable[..., Environment], *,
                 task_names: Callable[[dict[str, Any]], list[str]] | None = None) -> None:
    """Register `factory(**params) -> Environment` under `name` (a later one replaces it).
    `task_names(params)`, when given, lists the env's named tasks for `tasks_for_step`."""
    _REGISTRY[name] = factory
    _TASK_NAMES.pop(name, None)
    if task_names is not None:
        _TASK_NAMES[name] = task_names


def env_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def env_param_names(name: str) -> list[str] | None:
    """The parameters environment `name`'s factory takes (None: any, or not knowable);
    `UserError` for an unknown name."""
    import inspect

    _load_builtin()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UserError(f"unknown environment {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return [k for k, v in sig.parameters.items() if v.kind is not v.VAR_POSITIONAL]


def make_env(name: str, **params: Any) -> Environment:
    """A fresh environment; `UserError` for an unknown name or parameter."""
    _load_builtin()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UserError(f"unknown environment {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    try:
        return factory(**params)
    except TypeError as exc:
        raise UserError(f"bad parameters for environment {name!r}: {exc}") from exc


def env_params_for_run(name: str, params: dict[str, Any], *, run_dir) -> dict[str, Any]:
    """The parameters the runtime makes `name` with: `params`, plus
    `base_dir=RUN_DIR/sandboxes` for an environment whose factory takes a `base_dir`
    (per-run working directories live on the run's filesystem) unless `params` sets it."""
    from pathlib import Path

    out = dict(params)
    if name in env_names() and "base_dir" not in out and "base_dir" in (env_param_names(name) or ()):
        out["base_dir"] = str(Path(run_dir) / "sandboxes")
    return out


def _load_builtin() -> None:
    # Imported here: the built-in environments register themselves on import.
    from gyre_slurm.envs import learnable, longhorizon, shell, verifiers_env  # noqa: F401


def stable_int(*parts: object, bits: int = 31) -> int:
    """A deterministic non-negative integer from `parts` (same in every process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (1 << bits)


def tasks_for_step(env_name: str, *, step: int, num_prompts: int, seed: int,
                   pool_size: int | None = None,
                   env_params: dict[str, Any] | None = None) -> list[TaskSpec]:
    """The `num_prompts` tasks of training step `step` (deterministic). `env_params`
    (the env's parameters) reach its `task_names`, e.g. a custom tasks folder."""
    if num_prompts < 0 or step < 0:
        raise UserError("step and num_prompts must be >= 0")
    if pool_size is not None and pool_size < 1:
        raise UserError("pool_size must be >= 1")
    _load_builtin()
    names = None
    if env_name in _TASK_NAMES:
        names = sorted(_TASK_NAMES[env_name](dict(env_params or {})))
        if not names:
            raise UserError(f"environment {env_name!r} has no tasks (params {env_params})")
    out = []
    for i in range(num_prompts):
        task_seed = stable_int(env_name, seed, step, i)
        if pool_size is not None:
            task_seed %= pool_size
        prefix = env_name if names is None else f"{env_name}/{names[task_seed % len(names)]}"
        out.append(TaskSpec(task_id=f"{prefix}/{task_seed}", seed=task_seed))
    return out


def run_seed_of(seed: int, run_id: str) -> int:
    """A run's seed for its env's own randomness: a pure function of the config seed and
    the run id without its attempt suffix (blake2b, not Python's salted `hash`)."""
    base = run_id.split("-a")[0]
    digest = hashlib.blake2b(f"run/{seed}/{base}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
