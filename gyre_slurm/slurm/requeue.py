"""Requeue after preemption or before the time limit (submitit's rule).

On USR2 the coordinator has already stopped cleanly (agents and engines down; every
call, run record and checkpoint on disk). Only the coordinator requeues, with
`scontrol requeue $SLURM_JOB_ID`, and only while the job's restart count
(`SLURM_RESTART_COUNT`) is below `GYRE_MAX_REQUEUES` (default 10): a countdown that
bounds endless requeues after repeated timeouts. The requeued batch script sees the run
dir's config.yaml and runs `gyre run --resume`.

A coordinator killed by a signal (SIGKILL, the OOM killer, a segfault) cannot requeue:
the batch script (sbatch/gyre.sbatch) sees its child end with rc 128+N, and when it did
not pass that signal on itself, it requeues the job with the same countdown
(SLURM_RESTART_COUNT below GYRE_MAX_REQUEUES) and writes the `requeue` event (cause
"coordinator died by signal N"). Nothing is lost: calls, run records and checkpoints are
written as they happen, and the resumed job restarts interrupted runs as new attempts.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)


def requeue_self(rd, *, env: dict | None = None) -> int:
    env = dict(os.environ if env is None else env)
    job = env.get("SLURM_JOB_ID")
    if not job:
        print("gyre run: USR2 outside a Slurm job: stopped; continue with --resume",
              file=sys.stderr)
        return 143
    restarts = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    limit = int(env.get("GYRE_MAX_REQUEUES", "10"))
    if restarts >= limit:
        rd.event("requeue_refused", job=job, restarts=restarts, limit=limit)
        print(f"gyre run: job {job} was requeued {restarts} times (GYRE_MAX_REQUEUES="
              f"{limit}): not again; continue with --resume", file=sys.stderr)
        return 143
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                          timeout=60)
    rd.event("requeue", job=job, restarts=restarts, rc=proc.returncode,
             stderr=proc.stderr.strip()[-500:])
    if proc.returncode != 0:
        print(f"gyre run: scontrol requeue {job} failed: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"gyre run: job {job} requeued (restart {restarts + 1}); it resumes from latest",
          file=sys.stderr)
    return 0
