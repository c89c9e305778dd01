"""The duration trace a workload names (`workload.duration.trace_file`): one run's wall
time in seconds per line. Read by the simulator (to sample durations) and by the elastic
policy's forecast (its empirical survival), so it lives beside the config that names it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gyre_slurm.errors import ConfigError


def load_trace(path: str | None, *, base_dir: Path | None = None) -> np.ndarray:
    p = Path(path or "")
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    try:
        lines = p.read_text().split()
    except OSError as exc:
        raise ConfigError(f"workload.duration.trace_file {p}: {exc.strerror}") from exc
    try:
        values = np.array([float(x) for x in lines], dtype=np.float64)
    except ValueError as exc:
        raise ConfigError(f"{p}: expected one duration in seconds per line ({exc})") from exc
    if values.size == 0 or np.any(values <= 0) or not np.all(np.isfinite(values)):
        raise ConfigError(f"{p}: durations must be positive numbers, at least one")
    return values
