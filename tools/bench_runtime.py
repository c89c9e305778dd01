#!/usr/bin/env python3
"""Benchmark of the runtime (figures, not a test): handoff phases and idle CPU.

    tools/gyre-env python tools/bench_runtime.py [--steps 12]

1. Runs `gyre run configs/tiny.yaml` (4 virtual nodes) and prints, per handoff
   direction, the median of every phase from events.jsonl. Targets (CPU): group rebuild
   (destroy + init of the new process group) < 0.5 s; whole handoff excluding the wait
   for in-flight calls (total - drain) < 2 s.
2. Starts a run whose agents spend 40 s in one tool call, and samples the coordinator's
   CPU time over 10 s while nothing but heartbeats, status writes and policy ticks
   happen. Target < 5% of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gyre_slurm.common.fsio import read_jsonl  # noqa: E402


def gyre_run(run_dir: Path, *sets: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "gyre_slurm", "run", str(ROOT / "configs" / "tiny.yaml"),
            "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def handoff_phases(run_dir: Path) -> None:
    by_dir: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e["kind"] != "handoff":
            continue
        phases = by_dir[e["direction"]]
        for key, value in e.items():
            if key.endswith("_s"):
                phases[key].append(value)
        phases["group_rebuild_s"].append(e.get("destroy_s", 0.0) + e.get("init_s", 0.0))
        phases["total_minus_drain_s"].append(e["total_s"] - e["drain_s"])
    for direction, phases in sorted(by_dir.items()):
        n = len(phases["total_s"])
        print(f"{direction}: {n} handoffs, median seconds per phase:")
        for key in sorted(phases):
            values = phases[key]
            print(f"  {key:22s} {statistics.median(values):7.3f}  (max {max(values):.3f})")
    print("targets: group_rebuild_s < 0.5, total_minus_drain_s < 2.0")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(tmp: Path) -> None:
    run_dir = tmp / "idle"
    proc = gyre_run(run_dir, "workload.num_steps=1", "workload.prompts_per_step=2",
                    "workload.group_size=2",
                    "agent.env_params={tool_mean_s: 40.0, tool_sigma: 0.0, tool_max_s: 60.0}")
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            status = run_dir / "status.json"
            if status.exists() and json.loads(status.read_text())["runs"]["running"] == 4:
                break
            time.sleep(0.2)
        time.sleep(2.0)
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(10.0)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        print(f"coordinator CPU while runs sit in tool calls: "
              f"{100 * (c1 - c0) / (t1 - t0):.2f}% of a core over {t1 - t0:.0f} s "
              f"[target < 5%]")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_dir = tmp / "handoffs"
        t0 = time.monotonic()
        proc = gyre_run(run_dir, f"workload.num_steps={args.steps}")
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"gyre run failed: see {run_dir}/logs")
        print(f"gyre run configs/tiny.yaml, {args.steps} steps: {time.monotonic() - t0:.0f} s")
        handoff_phases(run_dir)
        idle_cpu(tmp)


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
