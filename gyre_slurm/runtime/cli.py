"""`gyre run CONFIG --run-dir DIR [--resume]`. (`gyre status` lives in gyre_slurm/monitor.)"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING

from gyre_slurm.config.cli import add_set_argument
from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError
from gyre_slurm.monitor import summary

if TYPE_CHECKING:
    from gyre_slurm.runtime.coordinator import Coordinator

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the job (local launcher: virtual nodes)")
    p.add_argument("config", nargs="?", help="a config file (not needed with --resume)")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--resume", action="store_true", help="continue the run dir from `latest`")
    add_set_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gyre_slurm.runtime.coordinator import Coordinator
    from gyre_slurm.common.fsio import make_folder

    if args.resume:
        cfg_path = args.run_dir / "config.yaml"
        if not cfg_path.is_file():
            started = (args.run_dir / "secret").exists() or (args.run_dir / "calls").is_dir()
            raise UserError(
                f"--resume: {args.run_dir} has no config.yaml: "
                + ("its first start stopped before the run was made (config.yaml is "
                   "written last, nothing was trained): start it again with its CONFIG, "
                   f"gyre run CONFIG --run-dir {quote(str(args.run_dir))}" if started
                   else "is it a run dir?"))
        cfg = load_config(cfg_path, args.overrides)
    else:
        if args.config is None:
            raise UserError("give a CONFIG (e.g. configs/tiny.yaml), or --resume a run dir")
        if (args.run_dir / "config.yaml").exists():
            raise UserError(f"{args.run_dir} already holds a run; use --resume to continue "
                            "it, or another --run-dir")
        cfg = load_config(resolve(args.config), args.overrides)
        make_folder(args.run_dir, purpose="the run (a new one, or a run dir with "
                    "--resume)")  # before anything starts
    coordinator = Coordinator(cfg, args.run_dir, resume=args.resume)
    prog = os.environ.get("GYRE_PROG") or "gyre"  # tools/gyre names itself
    print(summary.start_text(args.run_dir, prog=prog, resume=args.resume), flush=True)
    outcome = "failed"
    try:
        rc = asyncio.run(_run_until_signal(coordinator))
        outcome = {0: "finished", 143: "stopped (continue with --resume)"}.get(
            rc, f"ended (exit code {rc})")
        return rc
    finally:
        if not coordinator.refused:  # a refusal's error says why; the events are older
            _print_summary(args.run_dir, outcome=outcome, prog=prog)


def _print_summary(run_dir: Path, *, outcome: str, prog: str) -> None:
    """The job's summary on stdout; never hides what ended the job."""
    if not (run_dir / "events.jsonl").exists():
        return
    try:
        print(summary.end_text(run_dir, outcome=outcome, prog=prog), flush=True)
    except Exception:  # noqa: BLE001 - a summary must not mask the job's own error
        log.exception("could not summarize %s", run_dir)


async def _run_until_signal(coordinator: Coordinator) -> int:
    """SIGTERM/SIGINT stop the job cleanly: node agents and engines are shut down and
    what was recorded stays recorded (`--resume` continues from `latest`). USR2 (Slurm's
    preemption / time-limit warning, `--signal=B:USR2@N`) does the same, then requeues
    the job, which resumes from `latest` (see `gyre_slurm.slurm.requeue`)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[int] = []

    def stop(sig: int) -> None:
        received.append(sig)
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await coordinator.run()
    except asyncio.CancelledError:
        if received and received[0] == signal.SIGUSR2:
            from gyre_slurm.slurm.requeue import requeue_self

            return requeue_self(coordinator.rd)
        print("gyre run: stopped by a signal; continue with --resume", file=sys.stderr)
        return 143

