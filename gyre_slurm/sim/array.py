"""A simulator sweep as a Slurm job array (submitit): one array task per value.

    gyre sim --preset NAME --sweep cell_nodes=1,2,4 --slurm [--slurm-arg partition=cpu]

    from gyre_slurm.sim.array import sweep_on_slurm
    points = sweep_on_slurm(path, name="small", key="cluster.cell_nodes", values=["1", "2"],
                            folder=Path("runs/sim-sweeps"))

Each task runs `sim.cli.sweep_point` (the comparison at one value, as `gyre sim --json`
reports it) and submitit brings its result back; the points come back in the order of
`values`. The folder holds the array's batch file, logs and results (shared with the
nodes). A task that failed is an error naming its value and its log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import make_folder
from gyre_slurm.common.yamltext import load_yaml
from gyre_slurm.errors import UserError
from gyre_slurm.slurm.submit import (check_slurm_text, sbatch_refusal_is_a_user_error,
                                     slurm_executor)

NESTED = ("additional_parameters", "setup", "srun_args")  # submitit's dict/list parameters
DEFAULTS: dict[str, Any] = {"time": 60, "ntasks_per_node": 1, "cpus_per_task": 1,
                            "job_name": "gyre-sim-sweep"}


def slurm_parameters(args: list[str]) -> dict[str, Any]:
    """`partition=cpu`, `time=30` (minutes), ... as submitit parameters."""
    params = dict(DEFAULTS)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--slurm-arg {arg!r}: expected KEY=VALUE, e.g. partition=cpu")
        value = load_yaml(value, what=f"--slurm-arg {arg!r}") if value.strip() else ""
        if isinstance(value, (dict, list)) and key.strip() not in NESTED:
            raise UserError(f"--slurm-arg {arg!r}: {key.strip()} takes one value, not a "
                            f"{type(value).__name__}")
        _check_text(f"--slurm-arg {key.strip()}", value)
        params[key.strip()] = value
    return params


def _check_text(what: str, value: Any) -> None:
    """Every string in `value` is written into the batch file: no control characters."""
    if isinstance(value, str):
        check_slurm_text(what, value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(what, str(k))
            _check_text(what, v)
    elif isinstance(value, list):
        for v in value:
            _check_text(what, v)


def sweep_on_slurm(path: Path, *, name: str, key: str, values: list[str],
                   overrides: list[str], ablations: bool, folder: Path,
                   slurm_args: list[str] | None = None) -> list[dict]:
    check_slurm_text("--slurm-dir", str(Path(folder).resolve()))
    make_folder(folder, what="--slurm-dir", purpose="the sweep's scripts, logs and results")
    executor = slurm_executor(Path(folder).resolve(), slurm_parameters(list(slurm_args or [])))
    path = Path(path).resolve()
    n = len(values)
    with sbatch_refusal_is_a_user_error():
        jobs = executor.map_array(_point, [path] * n, [name] * n, [key] * n, values,
                                  [list(overrides)] * n, [ablations] * n)
    points = []
    for value, job in zip(values, jobs):
        try:
            points.append(job.result())
        except Exception as exc:  # noqa: BLE001 - the task's own error, named
            raise UserError(f"the sweep's point {key}={value} (Slurm job {job.job_id}) "
                            f"failed: {str(exc).strip()[-2000:]}; its log: "
                            f"{job.paths.stdout}") from None
    return points


def _point(path: Path, name: str, key: str, value: str, overrides: list[str],
           ablations: bool) -> dict:
    from gyre_slurm.sim.cli import sweep_point  # sim.cli imports this module

    return sweep_point(path, name=name, key=key, value=value, overrides=overrides,
                       ablations=ablations)
