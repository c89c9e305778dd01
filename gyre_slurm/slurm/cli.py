"""`gyre submit`: see `gyre_slurm.slurm.submit`."""

from __future__ import annotations

import argparse
from pathlib import Path
from shlex import quote


def register(subparsers) -> None:
    p = subparsers.add_parser("submit", help="submit the job to Slurm (submitit; the job is "
                                             "sbatch/gyre.sbatch)")
    p.add_argument("config", help="a config file, or the name of a preset")
    p.add_argument("--nodes", type=int, help="nodes to hold (default: cluster.num_nodes)")
    p.add_argument("--run-dir", type=Path, help="default: runs/<name>-<date>")
    p.add_argument("--time", dest="time_limit", help="Slurm time limit, e.g. 72:00:00")
    p.add_argument("--partition")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="another sbatch option (repeatable), e.g. --sbatch-arg=--qos=high; "
                        "the options gyre sets itself are refused")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gyre_slurm.slurm.submit import submit_job

    job = submit_job(args.config, run_dir=args.run_dir, nodes=args.nodes,
                     time_limit=args.time_limit, partition=args.partition,
                     gpus_per_node=args.gpus_per_node, extra=args.sbatch_arg)
    print(f"submitted job {job.job_id}; run dir {job.run_dir}")
    print(f"watch it: gyre status {job.job_id}    (or gyre status {quote(str(job.run_dir))})")
    return 0
