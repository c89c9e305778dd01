"""The `gyre` command. Each subcommand lives in its own module, which exposes
`register(subparsers)`; this file only wires them together."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from gyre_slurm.errors import JobFailed, UserError

# Modules that add a subcommand. Import is cheap: none imports an engine at module level.
SUBCOMMAND_MODULES = (
    "gyre_slurm.config.cli",
    "gyre_slurm.sim.cli",
    "gyre_slurm.traj.cli",
    "gyre_slurm.runtime.cli",
    "gyre_slurm.slurm.cli",
    "gyre_slurm.monitor.cli",
    "gyre_slurm.models.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre", description="Elastic RL of LLM agents on Slurm clusters."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Text from a run dir (an event's error, a task id) may hold what no encoding takes
    # (a lone surrogate from a JSON escape): printed escaped, as stderr does, not a crash
    # of `gyre status` on one odd line.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"gyre {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except JobFailed as exc:
        logging.getLogger("gyre_slurm").debug("the job failed", exc_info=True)
        print(f"gyre {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


def run_tool(main_fn, *args) -> None:
    """The `__main__` of a script under tools/: `main_fn(*args)`, its UserError printed as
    `NAME: error: ...` with exit status 2 (as gyre's), not a traceback. Exits."""
    import os

    name = os.path.basename(sys.argv[0]) or "tool"
    try:
        rc = main_fn(*args)
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        rc = 2
    except BrokenPipeError:
        rc = 0
    raise SystemExit(int(rc or 0))
