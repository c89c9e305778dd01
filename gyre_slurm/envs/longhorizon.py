from gyre_slurm.envs.base import register_env  # noqa: F401
