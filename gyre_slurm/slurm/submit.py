"""Submitting the job from Python or `gyre submit`, through submitit.

    gyre submit CONFIG [--nodes N] [--run-dir DIR] [--time T] [--partition P]
                [--gpus-per-node G] [--sbatch-arg ARG ...]

    from gyre_slurm.slurm import submit_job
    job = submit_job("configs/tiny.yaml", run_dir="runs/x", partition="gpu")
    job.job_id, job.run_dir, job.state, job.status(), job.cancel()

The config is checked first (a typo fails here, not on a queue hours later); the run
dir is made absolute and its logs/ created; the job's comment names the run dir, which
is how `gyre status JOBID` finds it.

submitit writes the batch file (the same directives as `sbatch/gyre.sbatch`: whole nodes,
one task per node, the USR2 warning to the batch shell, requeue), submits it and tracks
the job. The job itself is `sbatch/gyre.sbatch`, the script users submit by hand: the
batch file's setup hands the batch shell to it (`exec`), so the shell that receives
Slurm's USR2 (`--signal=B:USR2@300`) is the script's, with its traps, and a submitted job
checks, runs, stops, requeues and resumes exactly as a hand-submitted one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import loads_json, make_folder
from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError

GYRE_ROOT = Path(os.environ.get("GYRE_ROOT") or Path(__file__).resolve().parents[2])
SBATCH_FILE = GYRE_ROOT / "sbatch" / "gyre.sbatch"  # the job runs GYRE_ROOT/tools/gyre
DEFAULT_TIME = "72:00:00"  # as sbatch/gyre.sbatch
WARNING_S = 300  # USR2 this long before the time limit, as sbatch/gyre.sbatch


@dataclass
class SubmittedJob:
    """A submitted gyre job: its Slurm job (a `submitit.Job`) and its run dir."""

    job: Any
    run_dir: Path

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def state(self) -> str:
        """Slurm's state of the job (submitit's view: PENDING, RUNNING, COMPLETED, ...)."""
        return self.job.state

    def status(self) -> dict | None:
        """The run's status.json (what `gyre status` shows), or None before it exists."""
        try:
            return loads_json((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def cancel(self) -> None:
        self.job.cancel(check=False)


# sbatch options gyre's flags set (the flag to use instead).
GYRE_FLAGS = {"nodes": "--nodes (it must agree with the config's cluster.num_nodes)",
              "time": "--time", "partition": "--partition", "gpus-per-node": "--gpus-per-node",
              "job-name": "--run-dir (the job is named gyre-<the run dir's name>)"}
# sbatch options the job needs as gyre sets them (why).
GYRE_OWNED = {
    "comment": "gyre status finds the run dir by the job's comment",
    "output": "the job's log is RUN_DIR/logs/slurm-%j.out", "error": "the log takes stderr too",
    "open-mode": "the log is appended to across requeues",
    "chdir": "the job runs from the gyre checkout", "export": "the job needs GYRE_ROOT",
    "signal": "the job checkpoints on USR2 300 s before its time limit",
    "requeue": "a preempted job is requeued and resumes",
    "no-requeue": "a preempted job is requeued and resumes",
    "ntasks-per-node": "the job runs one task per node", "exclusive": "cells are whole nodes",
    "wrap": "the job is sbatch/gyre.sbatch", "array": "a run dir holds one job",
}
# Exact sbatch options that are also prefixes of the ones above (sbatch takes a prefix).
SBATCH_OPTIONS_PREFIXING = {"gpus", "ntasks", "time", "nodes"}


def check_slurm_text(what: str, value: str) -> None:
    """A value written into the batch file: a newline (or another control character) would
    end its #SBATCH line and make the rest a shell command, so it is refused."""
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise UserError(f"{what} {value!r} holds the control character {bad!r}: Slurm's "
                        f"batch file takes one line per option; remove it")


TIME_FORMS = ("MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES "
              "or DAYS-HOURS:MINUTES:SECONDS (e.g. 72:00:00 or 3-00)")


def parse_time_limit(value: str) -> float:
    """Seconds of a Slurm time limit as sbatch's --time and squeue's %l write it
    (`minutes`, `minutes:seconds`, `hours:minutes:seconds`, `days-hours`,
    `days-hours:minutes`, `days-hours:minutes:seconds`; `unlimited` or `infinite` is
    infinity), or a UserError that gives the forms."""
    text = value.strip().lower()
    if text in ("unlimited", "infinite"):
        return float("inf")
    days, dash, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = rest.split(":")
    if not (days.isdigit() and all(p.isdigit() for p in parts) and len(parts) <= 3):
        raise UserError(f"--time {value!r} is not a Slurm time limit: give {TIME_FORMS}")
    nums = [int(p) for p in parts]
    if dash:  # days-hours[:minutes[:seconds]]
        return float(int(days) * 86400 + sum(n * u for n, u in zip(nums, (3600, 60, 1))))
    units = {1: (60,), 2: (60, 1), 3: (3600, 60, 1)}[len(nums)]  # m, m:s, h:m:s
    return float(sum(n * u for n, u in zip(nums, units)))


def time_limit_s(value: str) -> float:
    """`parse_time_limit`, refusing a limit that the job's USR2 warning (WARNING_S before
    it) would reach at once: the job would checkpoint and requeue as soon as it started."""
    seconds = parse_time_limit(value)
    if seconds <= WARNING_S:
        raise UserError(f"--time {value!r} is {seconds:.0f} s: the job is told to checkpoint "
                        f"and requeue {WARNING_S} s before its limit, so give a limit longer "
                        f"than {WARNING_S // 60} minutes")
    return seconds


def sbatch_parameters(*, config: Path, run_dir: Path, nodes: int, time_limit: str | None,
                      partition: str | None, gpus_per_node: int | None,
                      extra: list[str]) -> dict[str, Any]:
    """submitit's parameters of the batch file (pure: no Slurm needed)."""
    for what, value in (("the config path", str(config)), ("the run dir", str(run_dir)),
                        ("--time", time_limit or ""), ("--partition", partition or ""),
                        ("GYRE_ROOT", str(GYRE_ROOT))):
        check_slurm_text(what, value)
    if "," in str(GYRE_ROOT):
        raise UserError(f"GYRE_ROOT {str(GYRE_ROOT)!r} holds a comma, which sbatch's "
                        f"--export cannot pass; use a checkout whose path has none")
    job = [str(SBATCH_FILE), str(config), str(run_dir)]
    log_dir = str(run_dir).replace("%", "%%")  # a literal % in Slurm's file name pattern
    params: dict[str, Any] = {
        "job_name": f"gyre-{run_dir.name}", "nodes": nodes, "ntasks_per_node": 1,
        "exclusive": True, "time": time_limit or DEFAULT_TIME,
        "comment": f"gyre_run_dir={run_dir}", "stderr_to_stdout": True, "use_srun": False,
        "setup": [f"exec bash {shlex.join(job)}"],  # the batch shell becomes the script
        "additional_parameters": {
            "signal": f"B:USR2@{WARNING_S}", "requeue": True,
            "output": f"{log_dir}/logs/slurm-%j.out", "chdir": str(GYRE_ROOT),
            "export": f"ALL,GYRE_ROOT={GYRE_ROOT}", **sbatch_flags(extra)},
    }
    if partition:
        params["partition"] = partition
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    return params


def sbatch_flags(args: list[str]) -> dict[str, Any]:
    """`--qos=high`, `--hold`... as submitit's additional parameters. Refused: what is not
    a long option, a control character (it would end the #SBATCH line), an option gyre
    sets itself (its own flag, or why the job needs gyre's value), one given twice."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg[2:].partition("=")
        if not arg.startswith("--") or not re.fullmatch(r"[a-z][a-z0-9-]*", key):
            raise UserError(f"--sbatch-arg {arg!r}: give one long sbatch option, as "
                            f"--sbatch-arg=--qos=high or --sbatch-arg=--hold")
        check_slurm_text(f"--sbatch-arg --{key}", value)
        owned = [o for o in (*GYRE_FLAGS, *GYRE_OWNED) if o == key or (
            o.startswith(key) and key not in SBATCH_OPTIONS_PREFIXING)]
        if owned:
            o = owned[0]
            raise UserError(
                f"--sbatch-arg {arg!r}: gyre sets --{o} itself; use {GYRE_FLAGS[o]}"
                if o in GYRE_FLAGS else
                f"--sbatch-arg {arg!r}: gyre sets --{o} itself and the job needs its value "
                f"({GYRE_OWNED[o]})")
        if key in out:
            raise UserError(f"--sbatch-arg --{key} is given twice; give it once")
        out[key] = value if sep else True
    return out


def submit_job(config: str | Path, *, run_dir: str | Path | None = None,
               nodes: int | None = None, time_limit: str | None = None,
               partition: str | None = None, gpus_per_node: int | None = None,
               extra: list[str] | None = None) -> SubmittedJob:
    """Check the config, make the run dir, submit the job (see the module docstring)."""
    if not SBATCH_FILE.is_file():
        raise UserError(f"{SBATCH_FILE} not found: gyre submit runs from a gyre checkout "
                        "(set GYRE_ROOT to one), whose sbatch/ and tools/ the job uses")
    path = resolve(str(config)).resolve()
    if not path.is_file():
        raise UserError(f"{config} is not a regular file: the job reads its config when it "
                        f"starts (and again on a requeue), so give a file on a filesystem "
                        f"the nodes see")
    cfg = load_config(path)
    if nodes is not None and nodes < 1:
        raise UserError(f"--nodes {nodes}: give a number of nodes >= 1 (or leave it out: "
                        f"the config's cluster.num_nodes, {cfg.cluster.num_nodes})")
    if gpus_per_node is not None and gpus_per_node < 0:
        raise UserError(f"--gpus-per-node {gpus_per_node}: give 0 or more GPUs (or leave "
                        f"it out: the partition's default)")
    if time_limit is not None:
        time_limit_s(time_limit)  # before the run dir is made
    nodes = nodes or cfg.cluster.num_nodes
    if nodes != cfg.cluster.num_nodes:
        raise UserError(f"--nodes {nodes} but the config's cluster.num_nodes is "
                        f"{cfg.cluster.num_nodes}; make them agree")
    run_dir = Path(run_dir or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    if (run_dir / "config.yaml").exists():
        raise UserError(f"{run_dir} already holds a run; choose another --run-dir")
    make_folder(run_dir)
    make_folder(run_dir / "logs", what="the run dir's logs folder")
    params = sbatch_parameters(config=path, run_dir=run_dir, nodes=nodes,
                               time_limit=time_limit, partition=partition,
                               gpus_per_node=gpus_per_node, extra=list(extra or []))
    executor = slurm_executor(run_dir / "logs" / "submitit", params)
    job = submit_or_explain(executor, BatchScript(
        script=str(SBATCH_FILE), config=str(path), run_dir=str(run_dir)))
    return SubmittedJob(job=job, run_dir=run_dir)


def slurm_executor(folder: Path, params: dict[str, Any]):
    """A `submitit.SlurmExecutor` with `params`; their mistakes are the user's to fix."""
    submitit = _import_submitit()
    try:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    except RuntimeError as exc:  # no srun: not on a Slurm cluster
        raise UserError(f"{exc}: run gyre submit where Slurm's clients are (a login "
                        f"node), or use `gyre run` locally") from None
    try:
        executor.update_parameters(**params)
    except ValueError as exc:
        raise UserError(f"a Slurm parameter is not valid: {exc}") from None
    return executor


def _import_submitit():
    """submitit, its log going where gyre's goes (stderr: gyre's stdout is its output,
    e.g. `--json`) instead of its own handlers, which also write to stdout. The jobs it
    starts configure submitit's log as usual (the variable is not passed on)."""
    import importlib
    import sys

    if "submitit" in sys.modules:
        return sys.modules["submitit"]
    before = os.environ.get("SUBMITIT_LOG_LEVEL")
    os.environ["SUBMITIT_LOG_LEVEL"] = "NOCONFIG"
    try:
        return importlib.import_module("submitit")
    finally:
        if before is None:
            del os.environ["SUBMITIT_LOG_LEVEL"]
        else:
            os.environ["SUBMITIT_LOG_LEVEL"] = before


def submit_or_explain(executor, fn, *args):
    """`executor.submit(fn, *args)`; sbatch's refusal is the user's to fix."""
    with sbatch_refusal_is_a_user_error():
        return executor.submit(fn, *args)


@contextlib.contextmanager
def sbatch_refusal_is_a_user_error():
    """submitit's error for an sbatch that refused the job (a bad option, no controller)
    becomes a UserError that quotes sbatch."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    try:
        yield
    except (FailedJobError, FailedSubmissionError) as exc:
        raise UserError(f"sbatch refused the job: {str(exc).strip()[-2000:]}") from None


@dataclass(frozen=True)
class BatchScript:
    """submitit's job function for a gyre job. In a Slurm job it is never reached: the
    batch file's setup hands the batch shell to `script` (exec), so that the USR2 Slurm
    sends the batch shell reaches the script's trap. Called anywhere else (submitit's
    local or debug executors), it runs the script in place of this process."""

    script: str
    config: str
    run_dir: str

    def __call__(self) -> None:
        os.execv("/bin/bash", ["bash", self.script, self.config, self.run_dir])
