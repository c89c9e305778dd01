"""`gyre traj`: build trajectories from call records, draw a run's tree, and convert
between the call store and JSONL.

    gyre traj build CALLS [--runs RUNS] [--max-per-run K] -o OUT.jsonl [--stats]
    gyre traj show RUN_DIR RUN_ID [--max-per-run K] [--dump | --plain] [--edges]
    gyre traj export RUN_DIR -o CALLS.jsonl
    gyre traj import CALLS.jsonl RUN_DIR [--writer-id ID]

CALLS is a JSONL file of call records or a run dir (its call store); RUNS a JSONL file of
run records or a directory of *.json / *.jsonl run records. A rejected run is reported
on stderr (and under "rejected" in --stats) and the other runs are still written. Exit
status: 0, or 1 when a run was rejected for bad or inconsistent records (not for a
failed/timeout status); 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from rich.console import Console

from gyre_slurm.common.fsio import check_output_file, existing_run_dir, make_folder
from gyre_slurm.errors import UserError
from gyre_slurm.traj.delta import CallDelta, check_run, decode_run
from gyre_slurm.traj.encode import DeltaEncoder
from gyre_slurm.traj.dump import dump_run, rich_tree, tree_lines
from gyre_slurm.traj.pack import pack, packing_stats
from gyre_slurm.traj.process import process, process_run
from gyre_slurm.traj.records import (
    Loaded, RecordError, RunRecord, collect_calls, collect_runs,
)
from gyre_slurm.traj.store import CallStoreWriter, load_store

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("traj", help="trajectories from model-call records")
    sub = parser.add_subparsers(dest="traj_command", metavar="TRAJ_COMMAND")
    sub.required = True
    _add_build(sub)
    _add_show(sub)
    exp = sub.add_parser("export", help="write a run dir's call store as JSONL call records")
    exp.add_argument("run_dir", metavar="RUN_DIR")
    exp.add_argument("-o", "--output", required=True, metavar="CALLS.jsonl")
    exp.set_defaults(func=run_export)
    imp = sub.add_parser("import", help="append JSONL call records to a run dir's call store")
    imp.add_argument("calls", metavar="CALLS.jsonl")
    imp.add_argument("run_dir", metavar="RUN_DIR")
    imp.add_argument("--writer-id", default="import", help="segment name (default: import)")
    imp.set_defaults(func=run_import)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _add_build(sub) -> None:
    p = sub.add_parser(
        "build", help="call records -> trajectories (one JSON per line)",
        description="Rebuild each run's calls into a prefix tree and write at most K "
        "trajectories per run (greedy max-coverage of trainable tokens; each trainable "
        "token trained once). advantage = the run's reward - the mean reward of the "
        "status-ok runs of its task_id (0.0 without --runs). Rejected runs go to stderr; "
        "exit status 1 when a run was rejected for bad or inconsistent records.")
    p.add_argument("calls", metavar="CALLS", help="CALLS.jsonl, or a run dir's call store")
    p.add_argument("--runs", metavar="RUNS", help="run records: RUNS.jsonl or a directory")
    p.add_argument("--max-per-run", type=_positive, default=5, metavar="K",
                   help="at most K trajectories per run (default 5)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                   help="trajectories, one JSON object per line ('-': stdout)")
    p.add_argument("--stats", action="store_true", help="print a JSON summary")
    p.add_argument("--vocab-size", type=_positive, help="ids must be below this")
    p.add_argument("--micro-batch-tokens", type=_positive, metavar="N",
                   help="also pack into micro-batches of N tokens and report it in --stats")
    p.set_defaults(func=run_build)


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="draw a run's prefix tree")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument("--max-per-run", type=_positive, default=5, metavar="K",
                   help="trajectories to select and mark (default 5)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dump", action="store_true",
                      help="plain tree, then each trajectory as aligned token/mask rows")
    mode.add_argument("--plain", action="store_true", help="plain-text tree")
    p.add_argument("--edges", action="store_true",
                   help="one line per tree edge (default: per chain between branch points)")
    p.add_argument("--width", type=_positive, default=100, help="row width for --dump")
    p.set_defaults(func=run_show)


def _read_lines(path: str) -> Iterator[str]:
    """The lines of a text file, streamed; an unreadable file is a UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def atomic_write_lines(path: str, lines: Iterable[str]) -> None:
    """Write `lines` to `path` via a temp file in the same directory and a rename."""
    if path == "-":
        sys.stdout.writelines(lines)
        return
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_calls(path: str, *, vocab_size: int | None = None) -> Loaded[CallDelta]:
    if os.path.isdir(path):
        if not os.path.isdir(os.path.join(path, "calls")):
            raise UserError(f"{path} has no calls/ directory: not a run dir")
        return load_store(path, vocab_size=vocab_size)
    encoder = DeltaEncoder()
    return collect_calls(_read_lines(path), file=path, vocab_size=vocab_size,
                         transform=encoder.encode)


def load_runs(path: str) -> tuple[dict[str, RunRecord], list[RecordError]]:
    files = [path]
    if os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).iterdir() if p.suffix in (".json", ".jsonl"))
    runs: dict[str, RunRecord] = {}
    errors: list[RecordError] = []
    for file in files:
        lines = _read_lines(file)
        if file.endswith(".json") and file != path:
            lines = iter([" ".join(line.strip() for line in lines)])
        got, errs = collect_runs(lines, file=file)
        for rid in got.keys() & runs.keys():
            errors.append(RecordError(file, "", rid, None, "duplicate run record"))
        runs.update(got)
        errors += errs
    return runs, errors


def _report(errors: Iterable[RecordError], command: str) -> None:
    for err in errors:
        print(f"gyre traj {command}: rejected: {err}", file=sys.stderr)


def _check_output(path: str) -> None:
    if path != "-":  # before the calls are read: a path it cannot write fails at once
        check_output_file(path)


def run_build(args: argparse.Namespace) -> int:
    _check_output(args.output)
    loaded = load_calls(args.calls, vocab_size=args.vocab_size)
    runs = None
    if args.runs:
        runs, run_errors = load_runs(args.runs)
        bad = {e.run_id for e in run_errors if e.run_id is not None}
        runs = {rid: rec for rid, rec in runs.items() if rid not in bad}
        loaded = Loaded(loaded.runs, run_errors + loaded.errors)
    result = process(loaded, max_per_run=args.max_per_run, runs=runs, calls_file=args.calls,
                     runs_file=args.runs or "")
    rejected = result.rejected
    atomic_write_lines(args.output, (json.dumps(t.to_json(), separators=(",", ":")) + "\n"
                                     for t in result.trajectories))
    _report(rejected, "build")
    for note in result.notes:
        log.info("%s", note)
    if args.stats:
        summary = result.summary()
        if args.micro_batch_tokens:
            batches = pack(result.trajectories, max_tokens=args.micro_batch_tokens)
            summary["packing"] = packing_stats(batches, max_tokens=args.micro_batch_tokens)
        out = sys.stderr if args.output == "-" else sys.stdout
        print(json.dumps(summary, indent=2), file=out)
    return 1 if any(e.kind == "record" for e in rejected) else 0


def run_show(args: argparse.Namespace) -> int:
    existing_run_dir(args.run_dir)
    loaded = load_store(args.run_dir)
    deltas = loaded.runs.get(args.run_id)
    if deltas is None:
        mine = [e for e in loaded.errors if e.run_id == args.run_id]
        if mine:
            _report(mine, "show")
            return 1
        known = ", ".join(sorted(loaded.runs)[:10]) or "none"
        raise UserError(f"no calls of run {args.run_id!r} in {args.run_dir}/calls "
                        f"(runs there: {known})")
    problem = check_run(deltas)
    if problem is not None:
        raise UserError(f"run {args.run_id!r} call {problem[0]}: {problem[1]}")
    result = process_run(deltas, max_per_run=args.max_per_run)
    if args.dump:
        sys.stdout.write(dump_run(result.tree, result.selection, result.trajectories,
                                  width=args.width))
    elif args.plain:
        print("\n".join(tree_lines(result.tree, result.selection, collapse=not args.edges)))
    else:
        Console().print(rich_tree(result.tree, result.selection, collapse=not args.edges))
    return 0


def _export_lines(loaded: Loaded[CallDelta], run_dir: str) -> Iterator[str]:
    """JSONL call records, one run at a time; inconsistent runs go to loaded.errors."""
    for rid, deltas in loaded.runs.items():
        problem = check_run(deltas)
        if problem is not None:
            loaded.errors.append(RecordError(run_dir, "", rid, problem[0], problem[1]))
            continue
        for rec in decode_run(deltas):
            yield json.dumps(rec.to_json(), separators=(",", ":")) + "\n"


def run_export(args: argparse.Namespace) -> int:
    existing_run_dir(args.run_dir)
    _check_output(args.output)
    loaded = load_store(args.run_dir)
    atomic_write_lines(args.output, _export_lines(loaded, args.run_dir))
    _report(loaded.errors, "export")
    return 1 if loaded.errors else 0


def run_import(args: argparse.Namespace) -> int:
    make_folder(args.run_dir, what="run dir", purpose="the call store")  # new or existing
    loaded = collect_calls(_read_lines(args.calls), file=args.calls)
    with CallStoreWriter(args.run_dir, args.writer_id, fsync_interval_s=None) as writer:
        for calls in loaded.runs.values():
            for rec in calls:
                writer.append(rec)
            writer.forget(calls[0].run_id)
    _report(loaded.errors, "import")
    return 1 if loaded.errors else 0
