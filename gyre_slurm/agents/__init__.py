"""Agent scaffolds that drive an environment through an OpenAI-compatible endpoint;
`loop.run_agent` is the one here (see its module docstring for the protocol)."""

from gyre_slurm.agents.loop import RunResult, run_agent

__all__ = ["RunResult", "run_agent"]
