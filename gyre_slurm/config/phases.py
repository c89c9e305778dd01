"""Workload phases: how a workload's demand changes with the training step.

In agent RL the mix changes as training goes: responses and horizons lengthen, harder
tasks enter the mix, tails get heavier. A workload lists `phases`, each starting at a
step (`from_step`) and holding until the next one starts; a phase scales the
workload's run durations and trained tokens, may change the durations' spread
(`sigma`) and the agent's turns per run, and may grow them step by step within the
phase (`growth_per_step`). Steps before the first phase are the workload as written.

    workload:
      duration: {mean_s: 600, sigma: 0.5}
      phases:
        - {from_step: 0, growth_per_step: 0.05}         # runs lengthen 5% a step
        - {from_step: 12, duration_scale: 2.0, sigma: 1.0}  # long, heavy-tailed tasks

`shape_at(workload, step)` is the one place a step's shape is resolved: the simulator
samples from it, the elastic forecast expects from it, the runtime makes its
environments from it (`StepShape.env_params`). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from gyre_slurm.config.loader import MAX_SECONDS, FieldError, key


MAX_SIGMA = 5.0  # a lognormal sigma (duration.sigma, a phase's): mean 268,000 x median
MAX_DURATION_S = MAX_SECONDS  # a duration (mean_s, max_s, a trace's): 32 years, no job is longer


@dataclass(frozen=True, kw_only=True)
class PhaseConfig:
    """The workload from step `from_step` on, until the next phase starts."""

    from_step: int = key(0, "first training step of the phase (phases in increasing order)")
    duration_scale: float = key(1.0, "run durations x this (mean_s, max_s, a trace's values)")
    sigma: float | None = key(None, "log-normal sigma of durations here (null: the "
                                    "workload's)")
    tokens_scale: float = key(1.0, "trained tokens per run x this")
    turns: int | None = key(None, "agent turns per run (real runs: agent.max_turns and the "
                                  "env's turns); the simulator scales durations and tokens "
                                  "by turns / agent.max_turns")
    growth_per_step: float = key(0.0, "durations and tokens x (1 + this) per step into the "
                                      "phase")
    tokens_growth_per_step: float | None = key(
        None, "trained tokens x (1 + this) per step into the phase, when they grow at "
              "their own rate (null: growth_per_step)")

    def __post_init__(self) -> None:
        if self.from_step < 0:
            raise FieldError("from_step", f"must be >= 0, got {self.from_step}")
        for name in ("duration_scale", "tokens_scale"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if self.sigma is not None and not 0 <= self.sigma <= MAX_SIGMA:
            raise FieldError("sigma", f"must be in [0, {MAX_SIGMA:g}] (the spread of "
                             f"log durations; 5 puts the mean 268,000 times the median), "
                             f"got {self.sigma}")
        if self.turns is not None and self.turns < 1:
            raise FieldError("turns", f"must be >= 1, got {self.turns}")
        for name in ("growth_per_step", "tokens_growth_per_step"):
            value = getattr(self, name)
            if value is not None and not value > -1:
                raise FieldError(name, f"must be > -1 (a shrink of less than 100% a step), "
                                 f"got {value}")


@dataclass(frozen=True)
class StepShape:
    """What one step's runs look like, relative to the workload as written."""

    duration_scale: float = 1.0  # every factor multiplied in: scale, growth, turns
    sigma: float | None = None
    tokens_scale: float = 1.0
    turns: int | None = None

    def env_params(self, params: dict[str, Any], takes: Sequence[str] | None) -> dict[str, Any]:
        """An environment's parameters for this step: its tool time (`tool_mean_s`,
        `tool_max_s`) scaled, `tool_sigma` set, `turns` set, where the env takes them
        (`takes`: its parameter names; None: any)."""
        out = dict(params)

        def has(name: str) -> bool:
            return takes is None or name in takes

        if self.duration_scale != 1.0:
            for name in ("tool_mean_s", "tool_max_s"):
                if name in out:
                    out[name] = float(out[name]) * self.duration_scale
        if self.sigma is not None and has("tool_sigma"):
            out["tool_sigma"] = self.sigma
        if self.turns is not None and has("turns"):
            out["turns"] = self.turns
        return out


def check_phases(phases: Sequence[PhaseConfig], *, num_steps: int, trace: bool) -> None:
    """Cross-field checks (the workload section's); raises FieldError('phases', ...)."""
    last = -1
    for i, p in enumerate(phases):
        if p.from_step <= last:
            raise FieldError("phases", f"[{i}].from_step = {p.from_step} does not follow "
                             f"the previous phase's {last}: list phases in increasing "
                             f"from_step order, one phase per start step")
        if p.from_step >= num_steps:
            raise FieldError("phases", f"[{i}].from_step = {p.from_step} is past the last "
                             f"step ({num_steps - 1}, workload.num_steps = {num_steps}): "
                             f"it would never apply; remove it or add steps")
        if trace and p.sigma is not None:
            raise FieldError("phases", f"[{i}].sigma applies to log-normal durations; "
                             f"with duration.dist: trace scale the trace with "
                             f"duration_scale instead")
        last = p.from_step
        end = phases[i + 1].from_step - 1 if i + 1 < len(phases) else num_steps - 1
        _check_growth(i, p, steps_into=end - p.from_step)


# A phase may scale a step's durations or tokens to at most this factor of the workload's,
# and down to its inverse: past it the figures stop meaning anything (the simulator would
# tick through centuries, a float overflow at 1e308 aside).
MAX_FACTOR = 1e6


def _check_growth(i: int, p: PhaseConfig, *, steps_into: int) -> None:
    """The phase's duration and token factors, at its last step, within MAX_FACTOR
    either way (in logs: a growth of 1e300 a step must not overflow on the way)."""
    tokens_growth = p.growth_per_step if p.tokens_growth_per_step is None \
        else p.tokens_growth_per_step
    for what, scale, growth, names in (
            ("durations", p.duration_scale, p.growth_per_step,
             "duration_scale, growth_per_step"),
            ("tokens", p.tokens_scale, tokens_growth,
             "tokens_scale, growth_per_step, tokens_growth_per_step")):
        log_factor = math.log(scale) + steps_into * math.log1p(growth)
        if abs(log_factor) > math.log(MAX_FACTOR):
            raise FieldError("phases", (
                f"[{i}]: {what} reach x{math.exp(min(log_factor, 700.0)):.3g} the "
                f"workload's by the phase's last step, {p.from_step + steps_into} "
                f"({names}); a phase may scale them between x{1 / MAX_FACTOR:g} and "
                f"x{MAX_FACTOR:g}: lower the growth or end the phase sooner"))


def shape_at(phases: Sequence[PhaseConfig], step: int, *, base_turns: int) -> StepShape:
    """The shape of step `step`'s runs: the last phase starting at or before it."""
    phase = None
    for p in phases:
        if p.from_step <= step:
            phase = p
    if phase is None:
        return StepShape()
    into = step - phase.from_step
    grow = (1.0 + phase.growth_per_step) ** into
    tokens_growth = phase.growth_per_step if phase.tokens_growth_per_step is None \
        else phase.tokens_growth_per_step
    turns = phase.turns / base_turns if phase.turns is not None else 1.0
    return StepShape(duration_scale=phase.duration_scale * grow * turns, sigma=phase.sigma,
                     tokens_scale=phase.tokens_scale * (1.0 + tokens_growth) ** into * turns,
                     turns=phase.turns)


def step_shape(cfg, step: int) -> StepShape:
    """`shape_at` for a whole config (a GyreConfig: turns are relative to
    agent.max_turns)."""
    return shape_at(cfg.workload.phases, step, base_turns=cfg.agent.max_turns)
