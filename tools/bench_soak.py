#!/usr/bin/env python3
"""Soak benchmark (figures, not a test): the tiny job under a random fault every few
minutes, then an account of every recorded call.

    tools/gyre-env python tools/bench_soak.py [--minutes 30] [--every-s 150] [--steps 250]
        [--seed 0] [--out DIR] [--set KEY=VALUE ...]

Runs `gyre run configs/tiny.yaml` (the local launcher: 4 virtual nodes) with enough
steps to last about `--minutes`, and every `--every-s` seconds (jittered) injects one
fault, drawn at random:

  agent        SIGKILL a node agent (only while 3 or more cells are alive: the floors
               need 2); its cell must be marked failed and the job go on
  engine-kill  SIGKILL a rollout engine process; its agent must restart it (or, past
               its restart limit, the cell fails); only while 3 or more cells are alive
  engine-hang  SIGSTOP a rollout engine (it stops answering health); same
  coordinator  SIGKILL the coordinator; this tool restarts it with `gyre run --resume`
               (what the requeued Slurm job does), which must resume from `latest`

A fault is survived when the run records the answer about the cell hit (cell_failed,
engine_restarted, engine_replaced; resume for the coordinator) and trains another step
afterwards. When the job has finished, every call in
the call store is accounted for: trained (its run's trajectories were trained, each
exactly once), superseded (an attempt interrupted by a fault: restarted under a new id,
never trained, by the documented rule) or lost (anything else: must be 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import faults  # noqa: E402  (tests/faults.py: find a run's processes, signal them)
from runtime_checks import trained_trajectories  # noqa: E402
from gyre_slurm.common.fsio import read_jsonl  # noqa: E402

KINDS = ("agent", "engine-kill", "engine-hang", "coordinator")


def start(run_dir: Path, sets: list[str], *, resume: bool, log) -> subprocess.Popen:
    args = [sys.executable, "-m", "gyre_slurm", "run"]
    args += ["--run-dir", str(run_dir), "--resume"] if resume else \
        [str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            start_new_session=True)


def latest_pids(run_dir: Path) -> tuple[int | None, dict[int, int]]:
    """The coordinator's pid (the newest start) and each node's newest agent pid."""
    coord, agents = None, {}
    for e in faults.events(run_dir):
        if e["kind"] == "start":
            coord = e.get("pid")
        elif e["kind"] == "agent_registered":
            agents[e["node"]] = e.get("pid")
    return coord, agents


def live_cells(run_dir: Path) -> list[dict]:
    return [c for c in faults.status(run_dir).get("cells", []) if c["role"] != "failed"]


def node_indices(cell: dict) -> list[int]:
    """The allocation indices of a cell's nodes (status.json names them; cells are
    consecutive runs of `cell_nodes` nodes)."""
    k = len(cell["nodes"])
    return [cell["cell"] * k + i for i in range(k)]


def inject(kind: str, run_dir: Path, rng: random.Random) -> tuple[str, int | None] | None:
    """Inject one fault; returns what was done and the cell hit (None: the coordinator),
    or None when it does not apply now."""
    coord, agents = latest_pids(run_dir)
    cells = live_cells(run_dir)
    if kind == "coordinator":
        return (f"coordinator pid {coord}", None) if coord and faults.kill(coord) else None
    if kind == "agent":
        if len(cells) < 3:
            return None
        cell = rng.choice(cells)
        node = rng.choice(node_indices(cell))
        pid = agents.get(node)
        return (f"agent of node {node} (cell {cell['cell']}, pid {pid})", cell["cell"]) \
            if pid and faults.kill(pid) else None
    if len(cells) < 3:  # an engine restarted too often fails its cell
        return None
    rollout = [c for c in cells if c["role"] == "rollout"]
    rng.shuffle(rollout)
    for cell in rollout:
        for node in node_indices(cell):
            ready = run_dir / "logs" / f"engine-node{node}-s0.log.ready.json"
            try:
                pid = json.loads(ready.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if not faults.alive(pid):
                continue
            sig = signal.SIGKILL if kind == "engine-kill" else signal.SIGSTOP
            if faults.kill(pid, sig):
                return (f"engine of node {node} (cell {cell['cell']}, pid {pid}, {sig.name})",
                        cell["cell"])
    return None


# What the run records in answer, about the cell hit (an engine restarted too often
# fails its cell; an engine hung as its cell hands off is replaced by its agent).
ENGINE_ANSWERS = ("engine_restarted", "engine_replaced", "cell_failed")
ANSWER = {"agent": ("cell_failed",), "engine-kill": ENGINE_ANSWERS,
          "engine-hang": ENGINE_ANSWERS, "coordinator": ("resume",)}


def account(run_dir: Path) -> dict:
    """Every recorded call: trained, superseded (a restarted attempt) or lost."""
    from gyre_slurm.traj.store import load_store

    store = load_store(run_dir)
    records = {}
    for r in read_jsonl(run_dir / "runs" / "runs.jsonl"):
        records[r["run_id"]] = r
    seen = trained_trajectories(run_dir)  # (run id, token ids) -> times trained
    trained_runs = {rid for rid, _ in seen}
    attempts = collections.defaultdict(list)  # base run id -> ids with a record
    for rid in records:
        attempts[rid.split("-a")[0]].append(rid)
    started = {r["run_id"] for r in read_jsonl(run_dir / "runs" / "started.jsonl")}
    out = collections.Counter()
    lost = []
    for rid, calls in store.runs.items():
        base = rid.split("-a")[0]
        later = [k for k in attempts[base] if k != rid and k > rid]
        if rid in trained_runs:
            out["trained"] += len(calls)
        elif records.get(rid, {}).get("status") not in (None, "ok") or later:
            out["superseded"] += len(calls)  # a failed or interrupted attempt, retried
        else:
            out["lost"] += len(calls)
            lost.append(rid)
    ok_untrained = [rid for rid, r in records.items() if r["status"] == "ok"
                    and rid not in trained_runs]
    return {"calls_recorded": sum(len(c) for c in store.runs.values()),
            "calls_trained": out["trained"], "calls_superseded": out["superseded"],
            "calls_lost": out["lost"], "lost_runs": lost[:10],
            "store_errors": [str(e) for e in store.errors][:10],
            "runs_started": len(started), "runs_ok": sum(1 for r in records.values()
                                                         if r["status"] == "ok"),
            "ok_runs_not_trained": ok_untrained[:10],
            "trajectories_trained_twice": sum(1 for n in seen.values() if n > 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="inject faults this long")
    ap.add_argument("--every-s", type=float, default=150.0, help="mean seconds between faults")
    ap.add_argument("--steps", type=int, default=250, help="workload.num_steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/gyre-soak"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"unknown fault kinds {bad}: choose from {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    import shutil

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    run_dir = args.out / "run"
    sets = [f"workload.num_steps={args.steps}"] + args.set
    log = open(args.out / "gyre-run.out", "ab")
    proc = start(run_dir, sets, resume=False, log=log)
    t0 = time.time()
    injected, survived = collections.Counter(), collections.Counter()
    pending: list[tuple[str, float, int, int | None]] = []  # (kind, t, version, cell)
    next_fault = t0 + rng.uniform(0.5, 1.5) * args.every_s
    restarts = 0
    print(f"soak: {run_dir}, {args.steps} steps, a fault every ~{args.every_s:g} s for "
          f"{args.minutes:g} min", flush=True)
    while True:
        rc = proc.poll()
        if rc is not None:
            coord_killed = pending and pending[-1][0] == "coordinator" and rc != 0
            if coord_killed:
                restarts += 1
                proc = start(run_dir, [], resume=True, log=log)
                continue
            break
        now = time.time()
        version = faults.status(run_dir).get("version", 0)
        for item in list(pending):
            kind, t, v, cell = item
            answered = [e for a in ANSWER[kind] for e in faults.events(run_dir, a)
                        if cell is None or e.get("cell") == cell]
            if version > v and any(e["t"] >= t for e in answered):
                survived[kind] += 1
                pending.remove(item)
                print(f"  {now - t0:6.0f} s  survived {kind} (v{v} -> v{version})", flush=True)
        if now >= next_fault and now - t0 < args.minutes * 60 and version > 0:
            for kind in rng.sample(kinds, len(kinds)):
                hit = inject(kind, run_dir, rng)
                if hit:
                    what, cell = hit
                    injected[kind] += 1
                    pending.append((kind, time.time(), version, cell))
                    print(f"  {now - t0:6.0f} s  v{version}  inject {kind}: {what}", flush=True)
                    break
            next_fault = now + rng.uniform(0.5, 1.5) * args.every_s
        time.sleep(0.5)
    wall = time.time() - t0
    status = faults.status(run_dir)
    acc = account(run_dir)
    finished = bool(status.get("final")) and status.get("version") == args.steps
    print(f"job ended rc={rc} after {wall:.0f} s; version {status.get('version')} of "
          f"{args.steps}{' (finished)' if finished else ''}; coordinator restarts {restarts}")
    print("faults injected: " + ", ".join(f"{k} {injected[k]}" for k in KINDS if k in kinds)
          + f" (total {sum(injected.values())})")
    print("faults survived: " + ", ".join(f"{k} {survived[k]}" for k in KINDS if k in kinds)
          + f" (total {sum(survived.values())}); not yet answered: {[p[0] for p in pending]}")
    print(f"calls recorded {acc['calls_recorded']}: trained {acc['calls_trained']}, "
          f"superseded {acc['calls_superseded']}, lost {acc['calls_lost']}")
    print(f"runs started {acc['runs_started']}, ok {acc['runs_ok']}; ok runs not trained: "
          f"{len(acc['ok_runs_not_trained'])}; trajectories trained twice: "
          f"{acc['trajectories_trained_twice']}; store errors: {len(acc['store_errors'])}")
    summary = {"wall_s": wall, "rc": rc, "finished": finished, "restarts": restarts,
               "injected": dict(injected), "survived": dict(survived),
               "unanswered": [p[0] for p in pending], **acc}
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    nothing_lost = (finished and acc["calls_lost"] == 0 and not acc["ok_runs_not_trained"]
                    and acc["trajectories_trained_twice"] == 0 and not acc["store_errors"])
    print("NOTHING LOST" if nothing_lost else "SOMETHING LOST OR UNFINISHED: see "
          f"{args.out}/soak.json and {args.out}/gyre-run.out")
    return 0 if nothing_lost and not pending else 1


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
