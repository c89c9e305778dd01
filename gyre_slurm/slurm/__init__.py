"""Slurm integration: a real local multi-node Slurm cluster for tests and trials."""
