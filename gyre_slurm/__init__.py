"""gyre_slurm: elastic RL of LLM agents on hour-long tasks, on Slurm clusters."""

__version__ = "0.1.0"
