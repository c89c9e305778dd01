"""Environments for agent runs: the interface (`base`), `learnable` (a short task the
tiny model learns by RL in minutes), `longhorizon` (many turns, heavy-tailed tool
times, growing contexts) and `shell` (coding tasks solved with shell commands in a
sandbox, `sandbox`). See `base` for the protocol and docs/environments.md."""

from gyre_slurm.envs.base import (
    Environment, StepResult, TaskSpec, env_names, make_env, register_env, tasks_for_step)

__all__ = ["Environment", "StepResult", "TaskSpec", "env_names", "make_env",
           "register_env", "tasks_for_step"]
