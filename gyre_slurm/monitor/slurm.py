"""Finding a Slurm job's run dir.

The submit side runs `sbatch --comment=gyre_run_dir=PATH ...`; `scontrol show job -o JOBID`
prints the job as one line of `Key=Value` fields, among them `Comment=gyre_run_dir=PATH`.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from gyre_slurm.errors import UserError

COMMENT_KEY = "gyre_run_dir="


def parse_job_line(line: str) -> Path | None:
    """The run dir named in one `scontrol show job -o` line, or None if it names none.

    The Comment value runs up to the next ` Key=` field, so a path with spaces survives
    as long as no word of it looks like `Key=`."""
    start = line.find(" Comment=" + COMMENT_KEY)
    if start < 0:
        if not line.startswith("Comment=" + COMMENT_KEY):
            return None
        start = -1
    rest = line[start + len(" Comment=" + COMMENT_KEY):]
    words = rest.split(" ")
    kept = []
    for word in words:
        key = word.split("=", 1)[0]
        if kept and "=" in word and key and key[0].isupper() and key.replace(":", "").isalnum():
            break
        kept.append(word)
    path = " ".join(kept).strip()
    return Path(path) if path else None


def find_run_dir(jobid: str, *, timeout_s: float = 10.0) -> Path:
    """The run dir of Slurm job JOBID (from its Comment=gyre_run_dir=PATH)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UserError(f"job {jobid}: scontrol not found (is Slurm installed here?); "
                        "give the run dir instead")
    try:
        proc = subprocess.run([scontrol, "show", "job", "-o", jobid], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(f"job {jobid}: scontrol did not answer in {timeout_s:.0f}s (is "
                        f"SLURM_CONF set, is slurmctld up?)") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        msg = (proc.stderr or proc.stdout).strip() or f"exit {proc.returncode}"
        if "invalid job id" in msg.lower():
            raise UserError(f"job {jobid}: unknown to Slurm ({msg})")
        raise UserError(f"job {jobid}: scontrol could not ask Slurm (is SLURM_CONF set, "
                        f"is slurmctld up?): {msg[-1000:]}")
    path = parse_job_line(proc.stdout.strip().splitlines()[0])
    if path is None:
        raise UserError(f"job {jobid} has no Comment=gyre_run_dir=PATH; was it submitted "
                        "by gyre? give the run dir instead")
    return path
