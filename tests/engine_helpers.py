"""Test helper: embedded engine processes on loopback serving a tiny model."""

from __future__ import annotations

import contextlib
from pathlib import Path

from gyre_slurm.engines import start_engine, write_secret
from gyre_slurm.models import tiny

HOST = "127.0.0.1"
# An embedded engine serves in ~5 s on a quiet machine; a loaded CI box has taken over
# 60 s (the ready wait costs only when it fails).
START_S = 180


@contextlib.contextmanager
def tiny_engines(run_dir: Path, *, count: int = 1, max_positions: int = 512):
    """`count` engines on one tiny model (weights v0 = seed 0) under `run_dir`; yields
    {"urls", "secret", "model_dir"} and stops them on exit."""
    model_dir = tiny.make_model_dir(run_dir / "model", max_positions=max_positions)
    tiny.save_weights(tiny.new_model(model_dir, seed=0), tiny.weights_dir(run_dir, 0))
    secret = write_secret(run_dir / "engine.secret")
    procs = []
    try:
        for i in range(count):
            procs.append(start_engine(
                model_dir=model_dir, host=HOST, weights_dir=tiny.weights_dir(run_dir, 0),
                version=0, secret_file=run_dir / "engine.secret",
                log_path=run_dir / f"engine{i}.log", ready_timeout_s=START_S))
        yield {"urls": [p.base_url for p in procs], "secret": secret, "model_dir": model_dir}
    finally:
        for p in procs:
            p.stop(timeout_s=10)
