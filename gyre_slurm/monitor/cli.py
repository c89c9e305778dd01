"""`gyre status RUN_DIR|JOBID [--once] [--json] [--refresh-s S]` and
`gyre report RUN_DIR -o OUT.png`.

`status` with neither --once nor --json is a live view (rich Live, redrawn every
--refresh-s; `q` or Ctrl-C quits) when stdout is a terminal, else one frame. --once
prints one frame (plain text when stdout is not a terminal); --json prints status.json.
A run dir that does not exist is an error (exit 2); one that exists but has no
status.json yet shows "waiting for status.json", or is an error for --json. A garbled
status.json never stops the view: it keeps the last good one (live) and prints a warning
naming the file and what is wrong; --json is then an error (exit 2) saying so. An
all-digits argument is a Slurm job id (see monitor/slurm.py).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from gyre_slurm.common.fsio import existing_run_dir
from gyre_slurm.errors import UserError


MIN_REFRESH_S, MAX_REFRESH_S = 0.1, 3600.0


def refresh_s(text: str) -> float:
    """--refresh-s: seconds between redraws, a finite number in [MIN, MAX]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not MIN_REFRESH_S <= value <= MAX_REFRESH_S:  # nan fails both comparisons
        raise argparse.ArgumentTypeError(
            f"{text} s: give {MIN_REFRESH_S}-{MAX_REFRESH_S:g} s between redraws")
    return value


def register(subparsers) -> None:
    s = subparsers.add_parser("status", help="watch a run (live), or print it once")
    s.add_argument("target", metavar="RUN_DIR|JOBID", help="a run dir, or a Slurm job id")
    s.add_argument("--once", action="store_true", help="print one frame and exit")
    s.add_argument("--json", action="store_true", help="print status.json as JSON")
    s.add_argument("--refresh-s", type=refresh_s, default=1.0,
                   help=f"live redraw period, {MIN_REFRESH_S}-{MAX_REFRESH_S:g} s")
    s.set_defaults(func=status)
    r = subparsers.add_parser("report", help="draw a run's timeline, waterlevel, rewards")
    r.add_argument("run_dir", type=Path)
    r.add_argument("-o", "--out", type=Path, default=Path("report.png"))
    r.set_defaults(func=report)


def resolve_target(target: str) -> Path:
    from gyre_slurm.monitor.slurm import find_run_dir

    if not target.strip():
        raise UserError("give a run dir or a Slurm job id (the argument is empty)")
    is_job = target.isascii() and target.isdigit()
    return existing_run_dir(find_run_dir(target) if is_job else Path(target))


def status(args: argparse.Namespace) -> int:
    from gyre_slurm.monitor import model

    run_dir = resolve_target(args.target)
    if args.json:
        path = run_dir / "status.json"
        if not path.is_file():
            raise UserError(f"{path} does not exist: has the run started?")
        data, error = model.read_status_checked(run_dir)
        if data is None:
            raise UserError(error or f"{path} does not exist: has the run started?")
        json.dump(data, sys.stdout, indent=1)
        print()
        return 0
    console = make_console()
    tail = model.EventTail(run_dir / "events.jsonl")
    if args.once or not console.is_terminal:  # a pipe or a file gets one frame
        console.print(framed(model.load(run_dir, tail)))
        return 0
    return live(console, run_dir, tail, refresh_s=args.refresh_s)


def framed(snap):
    """The view's frame, then a warning line per corrupt file met (a garbled
    status.json, a corrupt events.jsonl line): said, never silently used."""
    from rich.console import Group
    from rich.text import Text

    from gyre_slurm.monitor import view

    if not snap.problems:
        return view.frame(snap)
    return Group(view.frame(snap), *(Text(f"warning: {p}", style="bold red")
                                     for p in snap.problems[-5:]))


def make_console():
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=int(os.environ.get("COLUMNS", "140")))  # FORCE_COLOR=1: colours


def live(console, run_dir: Path, tail, *, refresh_s: float) -> int:
    from rich.live import Live

    from gyre_slurm.monitor import model

    reader = model.StatusReader(run_dir)  # keeps the last good status.json

    def draw():
        return framed(model.load(run_dir, tail, reader))

    try:
        with keys() as read_key, Live(draw(), console=console, screen=True,
                                      auto_refresh=False) as lv:
            while True:
                deadline = time.monotonic() + refresh_s
                while (left := deadline - time.monotonic()) > 0:
                    if read_key(left) in ("q", "Q"):
                        return 0
                lv.update(draw(), refresh=True)
    except KeyboardInterrupt:
        return 0


@contextmanager
def keys():
    """A reader of single key presses (cbreak mode) when stdin is a terminal."""
    if not sys.stdin.isatty():
        yield lambda timeout_s: time.sleep(timeout_s)
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read_key(timeout_s: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    try:
        yield read_key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def report(args: argparse.Namespace) -> int:
    from gyre_slurm.common.fsio import make_folder
    from gyre_slurm.monitor.report import write_report
    from gyre_slurm.sim.report import check_plot_path

    existing_run_dir(args.run_dir)
    # The image's name and folder before the run dir is read (the folder is made, as
    # before, where it is missing).
    check_plot_path(str(make_folder(args.out.parent, what=f"-o {args.out}: its folder",
                                    purpose="the image") / args.out.name), option="-o")
    write_report(args.run_dir, args.out)
    print(args.out)
    return 0
