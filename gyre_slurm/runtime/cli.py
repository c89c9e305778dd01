"""`gyre run CONFIG --run-dir DIR [--resume]` and `gyre status RUN_DIR --once [--json]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from gyre_slurm.config.cli import add_set_argument
from gyre_slurm.config.presets import resolve
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import UserError


def register(subparsers) -> None:
    p = subparsers.add_parser("run", help="run the job (local launcher: virtual nodes)")
    p.add_argument("config", nargs="?", help="a config file (not needed with --resume)")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--resume", action="store_true", help="continue the run dir from `latest`")
    add_set_argument(p)
    p.set_defaults(func=run)
    s = subparsers.add_parser("status", help="show a run's status.json")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--once", action="store_true", help="print once and exit (default)")
    s.add_argument("--json", action="store_true", help="print status.json as JSON")
    s.set_defaults(func=status)


def run(args: argparse.Namespace) -> int:
    from gyre_slurm.runtime.coordinator import Coordinator

    if args.resume:
        cfg_path = args.run_dir / "config.yaml"
        if not cfg_path.is_file():
            raise UserError(f"--resume: {args.run_dir} has no config.yaml; is it a run dir?")
        cfg = load_config(cfg_path, args.overrides)
    else:
        if args.config is None:
            raise UserError("give a CONFIG (e.g. configs/tiny.yaml), or --resume a run dir")
        if (args.run_dir / "config.yaml").exists():
            raise UserError(f"{args.run_dir} already holds a run; use --resume to continue "
                            "it, or another --run-dir")
        cfg = load_config(resolve(args.config), args.overrides)
    return asyncio.run(_run_until_signal(Coordinator(cfg, args.run_dir, resume=args.resume)))


async def _run_until_signal(coordinator) -> int:
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


def status(args: argparse.Namespace) -> int:
    path = args.run_dir / "status.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: is {args.run_dir} a run dir, and has it "
                        "started?") from None
    except ValueError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    age = time.time() - data.get("t", 0)
    print(f"{args.run_dir}: policy {data['policy']}, version {data['version']}/"
          f"{data['num_steps']}, {data['elapsed_s']:.0f}s elapsed, status {age:.0f}s old"
          f"{' (final)' if data.get('final') else ''}")
    runs = data["runs"]
    print("runs: " + ", ".join(f"{k} {v}" for k, v in runs.items()))
    train = data["train"]
    print(f"train world: generation {train['generation']}, nodes {train['members']}, "
          f"{train['ready_tokens']} tokens ready")
    for cell in data["cells"]:
        target = f" -> {cell['target']}" if cell["target"] else ""
        print(f"  cell {cell['cell']} [{','.join(cell['nodes'])}]: {cell['role']}{target}, "
              f"{cell['runs']} runs")
    for r in data.get("rewards", [])[-5:]:
        print(f"  step {r['step']}: mean reward {r['mean_reward']:.3f} ({r['runs_ok']} ok runs)")
    return 0
