from gyre_slurm.config.schema import GyreConfig, load_config

__all__ = ["GyreConfig", "load_config"]
