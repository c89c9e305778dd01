"""The duration trace a workload names (`workload.duration.trace_file`): one run's wall
time in seconds per line (# starts a comment). Read by the simulator (to sample
durations) and by the elastic policy's forecast (its empirical survival), so it lives
beside the config that names it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gyre_slurm.config.phases import MAX_DURATION_S
from gyre_slurm.errors import ConfigError


MAX_TRACE_BYTES = 256 << 20  # some 20 million durations: far more than a trace needs


def load_trace(path: str | None, *, base_dir: Path | None = None) -> np.ndarray:
    p = Path(path or "")
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    what = f"workload.duration.trace_file {p}"
    try:
        if not p.is_file():  # a folder, a device or a pipe (/dev/zero would never end)
            raise ConfigError(f"{what}: not a regular file" if p.exists()
                              else f"{what}: no such file")
        size = p.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise ConfigError(f"{what}: {size:,} bytes; a trace of one duration per line "
                              f"takes at most {MAX_TRACE_BYTES:,}: sample it down")
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{what}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what}: not UTF-8 text (byte {exc.start}); expected one "
                          f"duration in seconds per line") from None
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        for word in line.split("#", 1)[0].split():  # "#" starts a comment
            try:
                value = float(word)
            except ValueError:
                raise ConfigError(f"{p}: line {number}: {word[:40]!r} is not a number; "
                                  f"expected one duration in seconds per line (# starts a "
                                  f"comment)") from None
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{p}: line {number}: {word[:40]!r}: durations must be positive "
                                  f"numbers of seconds")
            if value > MAX_DURATION_S:
                raise ConfigError(f"{p}: line {number}: a duration of {value:.3g} s; durations "
                                  f"are seconds, at most {MAX_DURATION_S:g} (about 32 years): "
                                  f"check the unit")
            values.append(value)
    if not values:
        raise ConfigError(f"{p}: no durations in it; expected one duration in seconds per line")
    return np.asarray(values, dtype=np.float64)
