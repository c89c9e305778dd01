"""`gyre submit CONFIG [--nodes N] [--run-dir DIR] [--time T] [--partition P]
[--gpus-per-node G] [--sbatch-arg ARG ...]`: submit `sbatch/gyre.sbatch` for a config.

The config is checked first (a typo fails here, not on a queue hours later); the run
dir is made absolute and its logs/ created (Slurm writes the job's output there); the
job's comment names the run dir, which is how `gyre status JOBID` finds it. Prints the
job id and the run dir.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError

GYRE_ROOT = Path(os.environ.get("GYRE_ROOT") or Path(__file__).resolve().parents[2])
SBATCH_FILE = GYRE_ROOT / "sbatch" / "gyre.sbatch"  # the job runs GYRE_ROOT/tools/gyre


def sbatch_command(*, config: Path, run_dir: Path, nodes: int, time_limit: str | None,
                   partition: str | None, gpus_per_node: int | None,
                   extra: list[str]) -> list[str]:
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", f"--job-name=gyre-{run_dir.name}",
           f"--output={run_dir}/logs/slurm-%j.out", f"--comment=gyre_run_dir={run_dir}",
           f"--chdir={GYRE_ROOT}", f"--export=ALL,GYRE_ROOT={GYRE_ROOT}"]
    if time_limit:
        cmd.append(f"--time={time_limit}")
    if partition:
        cmd.append(f"--partition={partition}")
    if gpus_per_node:
        cmd.append(f"--gpus-per-node={gpus_per_node}")
    return cmd + list(extra) + [str(SBATCH_FILE), str(config), str(run_dir)]


def submit(*, config: str, run_dir: Path | None, nodes: int | None, time_limit: str | None,
           partition: str | None, gpus_per_node: int | None,
           extra: list[str]) -> tuple[str, Path]:
    if not SBATCH_FILE.is_file():
        raise UserError(f"{SBATCH_FILE} not found: gyre submit runs from a gyre checkout "
                        "(set GYRE_ROOT to one), whose sbatch/ and tools/ the job uses")
    path = resolve(config).resolve()
    cfg = load_config(path)
    nodes = nodes or cfg.cluster.num_nodes
    if nodes != cfg.cluster.num_nodes:
        raise UserError(f"--nodes {nodes} but the config's cluster.num_nodes is "
                        f"{cfg.cluster.num_nodes}; make them agree")
    run_dir = (run_dir or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (run_dir / "config.yaml").exists():
        raise UserError(f"{run_dir} already holds a run; choose another --run-dir")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cmd = sbatch_command(config=path, run_dir=run_dir, nodes=nodes, time_limit=time_limit,
                         partition=partition, gpus_per_node=gpus_per_node, extra=extra)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError("sbatch is not on PATH: run gyre submit where Slurm's clients are "
                        "(a login node), or use `gyre run` locally") from None
    if proc.returncode != 0:
        raise UserError(f"sbatch refused the job: {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    return job_id, run_dir
