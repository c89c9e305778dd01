#!/usr/bin/env python3
"""Benchmark (figures, not a test): the same job as elastic, colocate and async, measured
on the local Slurm cluster, with the simulator's prediction beside each measurement.

    tools/gyre-env python tools/bench_modes.py [--out DIR] [--modes elastic,colocate,async]
        [--async-splits 3] [--steps N] [--launcher slurm|local] [--png FILE] [--set K=V ...]
        [--bench-cluster]

    tools/gyre-env python tools/bench_modes.py --config configs/bench-modes-phases.yaml \
        --bench-cluster --async-splits 4,5      (changing demand, 8 nodes)

1. Runs configs/bench-modes.yaml (or --config) once per mode with `sbatch
   sbatch/gyre.sbatch` on the local Slurm cluster (started if it is down, `tools/localslurm`;
   with `--bench-cluster` a second cluster of the config's node count beside the shared
   4-node one: own state dir, ports, node names bnodeN and addresses 127.0.11.N),
   changing nothing but `scheduler.policy` (and, for `async-R`, the split). Same seed,
   tasks, batch, steps, model; every run's tool time is fixed by its run seed, so each
   layout replays the same runs.
2. Per mode, from the run dir: wall time (submit to job end; and the coordinator's start
   to finish, what the simulator models), cell busy fraction (run slots in use plus
   training compute, over cells x time: the simulator's definition), handoffs and the
   median of each phase, trajectories trained per step, the largest policy lag of a
   trained trajectory, final reward.
3. Checks identical training semantics: every mode trains the same number of
   trajectories in every step, each exactly once, all runs ok, no trajectory older than
   `training.max_staleness` versions. A mode that differs is reported and the benchmark
   exits 1 (a mode that finishes sooner by training less does not count).
4. Simulates each mode on the same workload with the costs measured in these runs
   (handoff phases, weight reloads, optimizer step, training tokens/s per cell): once on
   the replayed runs (each run's measured duration and trained tokens: the prediction
   error is then the model's, not sampling noise), once on a fresh sample of the config's
   duration distribution (`gyre sim`'s view). Prints predicted vs measured side by side.
5. Draws the cell-role timelines, measured (left) and simulated (right), one mode per row.

Results land in OUT/results.json; each run dir stays under OUT/<mode>/run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gyre_slurm.common.fsio import (check_output_file, make_folder, read_jsonl,  # noqa: E402
                                    write_bytes_atomic, write_json_atomic)
from gyre_slurm.config.loader import apply_overrides, dump_yaml, from_dict, load_yaml_file, to_dict  # noqa: E402
from gyre_slurm.config.schema import GyreConfig  # noqa: E402
from gyre_slurm.errors import UserError  # noqa: E402
from gyre_slurm.monitor.model import trained_microbatches  # noqa: E402
from gyre_slurm.runtime.book import run_id_of  # noqa: E402

BENCH_CLUSTER = {"state_dir": "/tmp/gyre-bench-slurm", "ctld_port": 16827,
                 "node_port_base": 17100, "node_prefix": "bnode", "addr_prefix": "127.0.11."}
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE")


# -- running the modes -----------------------------------------------------------------
def mode_overrides(label: str) -> list[str]:
    if label in ("elastic", "colocate", "async"):
        return [f"scheduler.policy={label}"]
    if label.startswith("async-") and label[6:].isdigit():
        return ["scheduler.policy=async", f"scheduler.async_rollout_cells={label[6:]}"]
    raise UserError(f"unknown mode {label!r}: elastic, colocate, async or async-R "
                     "(R rollout cells)")


def mode_config(base: dict, label: str) -> GyreConfig:
    """The job config of one mode: the base config with the mode's overrides, checked."""
    return from_dict(GyreConfig, apply_overrides(base, mode_overrides(label)))


def write_mode_config(base: dict, label: str, out: Path) -> tuple[Path, GyreConfig]:
    cfg = mode_config(base, label)
    path = out / "job.yaml"
    write_bytes_atomic(path, dump_yaml(cfg).encode())
    return path, cfg


def run_slurm(cluster, config: Path, run_dir: Path, *, nodes: int, timeout_s: float) -> float:
    env = dict(cluster.env(), GYRE_ROOT=str(ROOT))
    t0 = time.time()
    proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}",
                           f"--output={run_dir.parent}/job-%j.out",
                           str(ROOT / "sbatch" / "gyre.sbatch"), str(config), str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"sbatch failed: {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]
    print(f"  job {job}, run dir {run_dir}", flush=True)
    try:
        return _wait_for_job(job, env, run_dir, t0=t0, timeout_s=timeout_s)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM) or failed: the job goes too
        subprocess.run(["scancel", job], env=env, timeout=30)
        raise


def _wait_for_job(job: str, env: dict, run_dir: Path, *, t0: float, timeout_s: float) -> float:
    state = "UNKNOWN"
    while time.time() - t0 < timeout_s:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                             capture_output=True, text=True, timeout=30).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        state = fields.get("JobState", "UNKNOWN")
        if state in TERMINAL:
            break
        if state == "UNKNOWN" and time.time() - t0 > 30:
            raise SystemExit(f"job {job} is gone from the cluster (was it restarted?); "
                             f"see {run_dir.parent}")
        time.sleep(0.5)
    else:  # run_slurm cancels the job on the way out
        raise SystemExit(f"job {job} not done after {timeout_s:.0f}s; cancelled")
    wall = time.time() - t0
    if state != "COMPLETED":
        raise SystemExit(f"job {job} ended {state}; see {run_dir}/logs and "
                         f"{run_dir.parent}/job-{job}.out")
    return wall


def run_local(config: Path, run_dir: Path, *, timeout_s: float) -> float:
    t0 = time.time()
    with open(run_dir.parent / "gyre-run.out", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gyre_slurm", "run", str(config),
                                 "--run-dir", str(run_dir)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            proc.wait(timeout=timeout_s)
        except BaseException:  # a timeout or an interrupt: the run stops as a job would
            proc.terminate()  # (gyre run on SIGTERM stops its agents and engines)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    if proc.returncode != 0:
        raise SystemExit(f"gyre run failed ({proc.returncode}); see {run_dir.parent}/gyre-run.out")
    return time.time() - t0


# -- measuring a run dir -----------------------------------------------------------------
def median(values, default=0.0) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else default


def measure(run_dir: Path, cfg: GyreConfig) -> dict:
    from gyre_slurm.traj.store import load_store

    events = list(read_jsonl(run_dir / "events.jsonl"))
    start = next(e["t"] for e in events if e["kind"] == "start")
    finish = next(e["t"] for e in reversed(events) if e["kind"] == "finish")
    span = finish - start
    cells = cfg.cluster.num_cells
    cell_nodes = cfg.cluster.cell_nodes
    records = {r["run_id"]: r for r in read_jsonl(run_dir / "runs" / "runs.jsonl")}

    # Busy: run slots in use (each run holds 1/cell_capacity of a cell while it lasts)
    # plus training compute (micro-batches and optimizer steps, times the train cells).
    rollout_busy = sum(r["t_end"] - r["t_start"] for r in records.values()) \
        / cfg.cell_capacity
    train_busy, members = 0.0, 1
    for e in events:
        if e["kind"] == "microbatch":
            members = max(1, len(e["members"]) // cell_nodes)
            train_busy += e["seconds"] * members
        elif e["kind"] == "step":
            train_busy += e["seconds"] * members
    busy = (rollout_busy + train_busy) / (cells * span)

    handoffs = [e for e in events if e["kind"] == "handoff"]
    phases: dict[str, dict[str, float]] = {}
    for direction in ("rollout->train", "train->rollout"):
        mine = [e for e in handoffs if e["direction"] == direction]
        if mine:
            keys = ("drain_s", "engine_release_s", "rebuild_s", "engine_start_s", "total_s")
            phases[direction] = {k: round(median(e[k] for e in mine if k in e), 3)
                                 for k in keys if any(k in e for e in mine)}
            phases[direction]["handoffs"] = len(mine)
            phases[direction]["cells_moved"] = sum(len(e["cells"]) for e in mine)

    steps = [e for e in events if e["kind"] == "step"]
    mbs = [e for e in events if e["kind"] == "microbatch"]
    # Staleness: a trained trajectory's step minus the oldest policy version that
    # answered one of its run's calls (from the call store, not the coordinator).
    store = load_store(run_dir)
    oldest = {rid: min(c.policy_version for c in calls) for rid, calls in store.runs.items()}
    # What each micro-batch trained, from its event (the files of older steps are
    # pruned: training.keep_microbatch_steps); one trained again (a rewound step, a
    # resumed life) counts once, its last training.
    lags, seen, tokens_of = [], Counter(), defaultdict(int)
    for e in trained_microbatches(events):
        for rid, length, digest in zip(e["runs"], e["lengths"], e["digests"]):
            lags.append(e["step"] - oldest[rid])
            seen[(rid, digest)] += 1
            tokens_of[rid] += length
    return {
        "span_s": span,
        "busy_fraction": busy,
        "rollout_busy_cell_s": rollout_busy,
        "train_busy_cell_s": train_busy,
        "handoffs": len(handoffs),
        "cells_moved": sum(len(e["cells"]) for e in handoffs),
        "handoff_phases": phases,
        "steps": len(steps),
        "trajectories_per_step": [e["trajectories"] for e in steps],
        "runs_per_step": [e["runs"] for e in steps],
        "runs_ok": sum(1 for r in records.values() if r["status"] == "ok"),
        "runs": len(records),
        "trained_twice": sum(1 for n in seen.values() if n > 1),
        "max_lag": max(lags) if lags else None,
        "rewards": [round(e["mean_reward"], 4) for e in steps],
        "final_reward": round(statistics.fmean(e["mean_reward"] for e in steps[-2:]), 4)
        if steps else None,
        "first_reward": round(statistics.fmean(e["mean_reward"] for e in steps[:2]), 4)
        if steps else None,
        # Costs the simulator takes from this run.
        "costs": {
            "engine_release_s": [e["engine_release_s"] for e in handoffs if "engine_release_s" in e],
            "rebuild_s": [e["rebuild_s"] for e in handoffs if "rebuild_s" in e],
            "engine_start_s": [e["engine_start_s"] for e in handoffs if "engine_start_s" in e],
            "weight_sync_s": [e["seconds"] for e in events
                              if e["kind"] in ("weights_loaded", "weights_streamed")],
            "optimizer_step_s": [e["seconds"] for e in steps],
            "call_s": [c.t_end - c.t_start for calls in store.runs.values() for c in calls],
            "tokens_per_cell_s": [e["tokens"] / e["seconds"] / max(1, len(e["members"]) // cell_nodes)
                                  for e in mbs if e["seconds"] > 0],
        },
        # The replayed workload: each run's measured duration and trained tokens.
        "replay": {rid: [r["t_end"] - r["t_start"], tokens_of.get(rid, 0)]
                   for rid, r in records.items() if r["status"] == "ok"},
    }


def check_semantics(results: dict[str, dict], cfg: GyreConfig) -> list[str]:
    problems = []
    bound = cfg.training.max_staleness
    runs_per_step = cfg.workload.runs_per_step
    reference = None
    for label, m in results.items():
        if m["steps"] != cfg.workload.num_steps:
            problems.append(f"{label}: trained {m['steps']} steps, not {cfg.workload.num_steps}")
        if m["runs_ok"] != m["runs"] or any(n != runs_per_step for n in m["runs_per_step"]):
            problems.append(f"{label}: {m['runs'] - m['runs_ok']} runs not ok")
        if m["trained_twice"]:
            problems.append(f"{label}: {m['trained_twice']} trajectories trained twice")
        if m["max_lag"] is None or m["max_lag"] > bound:
            problems.append(f"{label}: a trajectory {m['max_lag']} versions old (bound {bound})")
        if reference is None:
            reference = (label, m["trajectories_per_step"])
        elif m["trajectories_per_step"] != reference[1]:
            problems.append(f"{label}: trajectories per step {m['trajectories_per_step']} "
                            f"!= {reference[0]}'s {reference[1]}")
    return problems


# -- the simulator on the same workload ------------------------------------------------
def sim_config(base: dict, label: str, costs: dict) -> GyreConfig:
    data = apply_overrides(base, mode_overrides(label))
    cfg = from_dict(GyreConfig, data)
    h = dataclasses.replace(cfg.handoff,
                            engine_release_s=median(costs["engine_release_s"], 0.3),
                            group_rebuild_s=median(costs["rebuild_s"], 0.5),
                            train_state_load_s=0.0,  # inside the measured rebuild
                            weight_load_s=0.0,  # inside the measured engine start
                            engine_start_s=median(costs["engine_start_s"], 1.0))
    tr = dataclasses.replace(cfg.training, scaling_efficiency=1.0,
                             node_tokens_per_s=median(costs["tokens_per_cell_s"],
                                                      cfg.training.node_tokens_per_s)
                             / cfg.cluster.cell_nodes,
                             optimizer_step_s=median(costs["optimizer_step_s"], 0.0))
    ro = dataclasses.replace(cfg.rollout, weight_sync_s=median(costs["weight_sync_s"], 0.0),
                             reprefill_s=0.0,  # a migrated run re-reads a short context
                             # a drained cell's runs move at their next call; runs of one
                             # call never come back, so only calls in flight are waited for
                             call_interval_s=median(costs["call_s"], 0.2))
    wl = dataclasses.replace(cfg.workload, llm_time_fraction=0.0)
    return dataclasses.replace(cfg, handoff=h, training=tr, rollout=ro, workload=wl)


def sim_policy(cfg: GyreConfig, label: str):
    from gyre_slurm.sched.baselines import AsyncPolicy
    from gyre_slurm.sched.policies import named_policy

    if label.startswith("async"):  # the runtime trains async in a stream too
        return AsyncPolicy(rollout_cells=cfg.scheduler.async_rollout_cells, streaming=True,
                           name=label)
    return named_policy(cfg, label)


def replay_workload(cfg: GyreConfig, replay: dict):
    from gyre_slurm.sim.workload import Workload

    w = cfg.workload
    work, tokens = [], []
    for s in range(w.num_steps):
        for p in range(w.prompts_per_step):
            for g in range(w.group_size):
                rid = run_id_of(s, p, g)
                attempts = [k for k in replay if k == rid or k.startswith(rid + "-a")]
                duration, toks = replay[max(attempts)] if attempts else (w.duration.mean_s,
                                                                         w.tokens_mean)
                work.append(duration)
                tokens.append(max(1, toks))
    index = np.arange(len(work))
    return Workload(work_s=np.asarray(work, dtype=np.float64),
                    tokens=np.asarray(tokens, dtype=np.int64),
                    batch=index // w.runs_per_step, group=index // w.group_size,
                    num_steps=w.num_steps, runs_per_step=w.runs_per_step,
                    group_size=w.group_size)


def predict(base: dict, label: str, costs: dict, replay: dict) -> dict:
    from gyre_slurm.sim.engine import Simulator
    from gyre_slurm.sim.workload import sample_workload

    cfg = sim_config(base, label, costs)
    # The policy is told the config's handoff prior, as in the real run; the simulation
    # charges the measured costs.
    prior = mode_config(base, label).handoff

    def run(workload):
        return Simulator(cfg, sim_policy(cfg, label), workload, policy_handoff=prior).run()

    replayed = run(replay_workload(cfg, replay))
    sampled = [run(sample_workload(dataclasses.replace(cfg, seed=seed))).makespan_s
               for seed in range(5)]
    return {"makespan_s": replayed.makespan_s, "busy_fraction": replayed.busy_fraction,
            "handoffs": replayed.handoffs, "sampled_makespan_s": median(sampled),
            "timeline": replayed.timeline}


# -- output ------------------------------------------------------------------------------
def print_table(results: dict, predicted: dict, wall: dict, problems: list[str]) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    elastic = results.get("elastic", {}).get("span_s")
    table = Table(title="elastic vs colocate vs async, measured (local Slurm) and simulated")
    cols = ("mode", "job wall s", "train span s", "elastic x", "busy", "handoffs",
            "traj/step", "max lag", "reward", "sim s", "sim err", "sim busy", "sim x",
            "sampled sim s")
    for c in cols:
        table.add_column(c, justify="left" if c == "mode" else "right", no_wrap=True)
    sim_elastic = predicted.get("elastic", {}).get("makespan_s")
    md = ["| mode | job wall (s) | start→finish (s) | elastic speedup | busy | handoffs (cells) "
          "| trajectories/step | max lag | reward first→last | simulated (s) | sim error "
          "| sim busy | sim speedup |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in results.items():
        p = predicted[label]
        err = (p["makespan_s"] - m["span_s"]) / m["span_s"]
        x = m["span_s"] / elastic if elastic else float("nan")
        sx = p["makespan_s"] / sim_elastic if sim_elastic else float("nan")
        tps = sorted(set(m["trajectories_per_step"]))
        tps_s = str(tps[0]) if len(tps) == 1 else ",".join(map(str, m["trajectories_per_step"]))
        row = (label, f"{wall[label]:.0f}", f"{m['span_s']:.0f}", f"{x:.2f}",
               f"{m['busy_fraction']:.0%}", f"{m['handoffs']} ({m['cells_moved']})", tps_s,
               str(m["max_lag"]), f"{m['first_reward']:.2f}→{m['final_reward']:.2f}",
               f"{p['makespan_s']:.0f}", f"{err:+.1%}", f"{p['busy_fraction']:.0%}",
               f"{sx:.2f}", f"{p['sampled_makespan_s']:.0f}")
        table.add_row(*row)
        md.append("| " + " | ".join(row[:10] + row[10:13]) + " |")
    Console(width=200).print(table)
    for label, m in results.items():
        for direction, ph in m["handoff_phases"].items():
            print(f"  {label:10s} {direction}: " + ", ".join(
                f"{k} {v:g}" for k, v in ph.items()))
    if problems:
        print("TRAINING SEMANTICS DIFFER (speedups do not count):")
        for p in problems:
            print("  - " + p)
    else:
        print("training semantics identical: same trajectories per step, each trained once, "
              "every run ok, no trajectory beyond the staleness bound")
    return md


def plot(results: dict, predicted: dict, run_dirs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from gyre_slurm.monitor.report import draw_roles
    from gyre_slurm.sim.report import ROLE_COLORS

    labels = list(results)
    span = max(max(m["span_s"] for m in results.values()),
               max(p["makespan_s"] for p in predicted.values()))
    fig, axes = plt.subplots(len(labels), 2, figsize=(15, 1.4 + 1.5 * len(labels)),
                             sharex=True, squeeze=False)
    for row, label in enumerate(labels):
        m, p = results[label], predicted[label]
        ax = axes[row, 0]
        draw_roles(ax, list(read_jsonl(run_dirs[label] / "events.jsonl")))
        ax.set_title("")
        ax.set_title(f"{label}, measured: {m['span_s']:.0f} s, busy {m['busy_fraction']:.0%}, "
                     f"{m['cells_moved']} cell moves", fontsize=10, loc="left")
        ax = axes[row, 1]
        for cell, t0, t1, lab in p["timeline"]:
            ax.broken_barh([(t0, max(t1 - t0, 0.05))], (cell - 0.4, 0.8),
                           facecolors=ROLE_COLORS.get(lab, "#7f7f7f"), linewidth=0)
        ax.set_yticks(sorted({c for c, *_ in p["timeline"]}))
        ax.invert_yaxis()
        ax.set_title(f"{label}, simulated: {p['makespan_s']:.0f} s, busy "
                     f"{p['busy_fraction']:.0%}, {p['handoffs']} cell moves", fontsize=10,
                     loc="left")
        for ax in axes[row]:
            ax.set_xlim(0, span * 1.01)
            ax.set_xlabel("seconds since start" if row == len(labels) - 1 else "")
    handles = [Patch(color=c, label=lab) for lab, c in ROLE_COLORS.items() if lab != "failed"]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8)
    cells = 1 + max(c for p in predicted.values() for c, *_ in p["timeline"])
    fig.suptitle("cell roles: the same job as elastic, colocate and async (local Slurm, "
                 f"{cells} cells)", x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "bench-modes.yaml")
    ap.add_argument("--modes", default="elastic,colocate,async",
                    help="comma-separated: elastic, colocate, async (the config's split), "
                         "async-R (R rollout cells)")
    ap.add_argument("--async-splits", default="",
                    help="also run async with these rollout-cell counts, e.g. 3")
    ap.add_argument("--steps", type=int, help="workload.num_steps (default: the config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--launcher", choices=("slurm", "local"), default="slurm")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gyre-bench-modes"))
    ap.add_argument("--png", type=Path, help="default: OUT/bench-modes.png")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per mode")
    ap.add_argument("--bench-cluster", action="store_true",
                    help="run on a second local cluster of the config's node count (state "
                         f"{BENCH_CLUSTER['state_dir']}), not the shared 4-node one")
    ap.add_argument("--reuse", action="store_true",
                    help="measure the run dirs already under OUT instead of running again")
    args = ap.parse_args()

    labels = [m for m in args.modes.split(",") if m]
    labels += [f"async-{r}" for r in args.async_splits.split(",") if r]
    sets = list(args.set) + ([f"workload.num_steps={args.steps}"] if args.steps else [])
    try:  # every mode's config checked before the first job, not when its turn comes
        if not labels:
            raise UserError("--modes names no mode: give e.g. --modes elastic,colocate")
        for label in labels:
            mode_overrides(label)  # refuse an unknown mode before anything runs
        base = apply_overrides(load_yaml_file(args.config), sets)
        cfg = from_dict(GyreConfig, base)
        for label in labels:
            mode_config(base, label)
        make_folder(args.out, what="--out", purpose="the benchmark's runs and results")
        if args.png is not None:
            check_output_file(args.png, what="--png", example="bench-modes.png")
    except UserError as exc:
        print(f"bench_modes: error: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (a timeout, a scancel of this tool's own job) unwinds like Ctrl-C: the job
    # under way is cancelled and a cluster this tool started is taken down.
    signal.signal(signal.SIGTERM, _interrupted)

    cluster, started = None, False
    if args.launcher == "slurm" and not args.reuse:
        from gyre_slurm.slurm.localcluster import LocalCluster

        if args.bench_cluster:
            cluster = LocalCluster(num_nodes=cfg.cluster.num_nodes, **BENCH_CLUSTER)
        elif cfg.cluster.num_nodes > 4:
            raise SystemExit(f"{cfg.cluster.num_nodes} nodes: the shared local cluster has 4 "
                             "(other tests use it; restarting it with more nodes breaks "
                             "them); pass --bench-cluster to run on a cluster of its own")
        else:
            cluster = LocalCluster(num_nodes=4)
        ok, why = cluster.can_run()
        if not ok:
            raise SystemExit(f"the local Slurm cluster cannot run here: {why} "
                             "(or pass --launcher local)")
        started = cluster.up()
    results, wall, run_dirs, cfgs = {}, {}, {}, {}
    try:
        for label in labels:
            out = args.out / label
            run_dirs[label] = out / "run"
            if args.reuse:
                cfgs[label] = from_dict(GyreConfig, load_yaml_file(run_dirs[label] / "config.yaml"))
                wall[label] = json.loads((out / "wall.json").read_text())["wall_s"]
            else:
                import shutil

                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
                config, cfgs[label] = write_mode_config(base, label, out)
                print(f"{label}: running ({cfg.workload.num_steps} steps)", flush=True)
                if args.launcher == "slurm":
                    wall[label] = run_slurm(cluster, config, run_dirs[label],
                                            nodes=cfg.cluster.num_nodes, timeout_s=args.timeout_s)
                else:
                    wall[label] = run_local(config, run_dirs[label], timeout_s=args.timeout_s)
                write_json_atomic(out / "wall.json", {"wall_s": wall[label]})
            results[label] = measure(run_dirs[label], cfgs[label])
            print(f"{label}: {wall[label]:.0f} s job wall, {results[label]['span_s']:.0f} s "
                  f"start to finish", flush=True)
    finally:
        if started:
            cluster.down()

    problems = check_semantics(results, cfg)
    costs: dict[str, list] = defaultdict(list)  # pooled over every mode's run
    for m in results.values():
        for k, v in m["costs"].items():
            costs[k].extend(v)
    predicted = {label: predict(base, label, costs, results[label]["replay"])
                 for label in labels}
    print("simulator inputs measured in these runs (medians): " + ", ".join(
        f"{k} {median(v):.3f}" for k, v in sorted(costs.items())))
    from gyre_slurm.sim.bounds import lower_bound

    first = labels[0]
    bcfg = sim_config(base, first, costs)
    bound = {k: float(v) for k, v in lower_bound(
        bcfg, replay_workload(bcfg, results[first]["replay"])).items()}
    print(f"lower bound of this workload (any layout, no handoff costs): "
          f"{bound['lower_bound_s']:.0f} s = max(work {bound['work_bound_s']:.0f} s, critical "
          f"path through the staleness bound {bound['critical_path_s']:.0f} s); per mode, "
          + ", ".join(f"{k} {m['span_s'] / bound['lower_bound_s']:.2f}x"
                      for k, m in results.items()))
    md = print_table(results, predicted, wall, problems)
    png = args.png or args.out / "bench-modes.png"
    plot(results, predicted, run_dirs, png)
    print(f"timelines: {png}")
    summary = {
        "config": to_dict(cfg), "modes": labels, "wall_s": wall,
        "measured": {k: {kk: vv for kk, vv in m.items() if kk not in ("replay", "costs")}
                     for k, m in results.items()},
        "predicted": {k: {kk: vv for kk, vv in p.items() if kk != "timeline"}
                      for k, p in predicted.items()},
        "sim_inputs": {k: median(v) for k, v in costs.items()},
        "lower_bound": bound,
        "semantics_problems": problems, "markdown": md,
    }
    write_json_atomic(args.out / "results.json", summary)
    print("\n".join(md))
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:
        print("bench_modes: interrupted; the job under way was cancelled", file=sys.stderr)
        raise SystemExit(130)
