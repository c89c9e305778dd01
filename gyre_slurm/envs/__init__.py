"""Environments for agent runs: the interface (`base`), `learnable` (a short task the
tiny model learns by RL in minutes) and `longhorizon` (many turns, heavy-tailed tool
times, growing contexts). See `base` for the protocol."""

from gyre_slurm.envs.base import (
    Environment, StepResult, TaskSpec, env_names, make_env, register_env, tasks_for_step)

__all__ = ["Environment", "StepResult", "TaskSpec", "env_names", "make_env",
           "register_env", "tasks_for_step"]
