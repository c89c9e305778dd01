#!/usr/bin/env python3
"""Print the simulator tables of docs/scheduler.md (markdown) for the shipped presets.

  tools/gyre-env python tools/sim_table.py [PRESET ...]      the preset and ablation tables
  tools/gyre-env python tools/sim_table.py --assumptions      one preset, one assumption
                                                              changed at a time
  tools/gyre-env python tools/sim_table.py --all              both
  tools/gyre-env python tools/sim_table.py --losses [PRESET ...]
                                                              where elastic's and async-stream's
                                                              cell-seconds go, against the
                                                              lower bound's
  tools/gyre-env python tools/sim_table.py --starved [PRESET ...]
                                                              elastic's empty rollout slots:
                                                              with no run allowed to start
                                                              (the staleness bound) or with
                                                              runs queued; each step's
                                                              release, starts and end

Speedups are makespan ratios (other / elastic's). "Published" columns are the figures of
the published runs (the presets cite them) and of the published ablation (streaming
alone saves 11.6% over async; elastic cells add 1.19x on top of colocate with
streaming); a dash where none was published.
"""

from __future__ import annotations

import functools
import sys

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.runner import best_async, compare, simulate
from gyre_slurm.sim.workload import sample_workload

PRESETS = ("terminalbench-122b", "deepswe-122b", "nl2repo-122b", "nl2repo-2.4t",
           "terminalbench-122b-growing", "deepswe-122b-curriculum")
PUBLISHED = {  # elastic speedup vs colocate, vs async (published)
    "terminalbench-122b": ("up to 1.85", "up to 1.43"),
    "nl2repo-2.4t": ("1.21", "1.78"),
}
ABLATIONS = ("elastic-nostream", "elastic-nofloor", "elastic-naive", "colocate-stream",
             "async-stream")
# One assumption of a preset changed at a time (label, preset, overrides, async at even?).
ASSUMPTIONS = (
    ("terminalbench-122b as shipped", "terminalbench-122b", (), False),
    ("async at the even split (untuned)", "terminalbench-122b", (), True),
    ("heavier tail (sigma 0.8)", "terminalbench-122b", ("workload.duration.sigma=0.8",), False),
    ("demand that changes: runs and contexts grow", "terminalbench-122b-growing", (), False),
    ("demand that changes: a task curriculum", "deepswe-122b-curriculum", (), False),
    ("changing demand and async untuned", "deepswe-122b-curriculum", (), True),
)


def row(name: str, out: dict, num_cells: int) -> tuple[str, str]:
    lb = out["bound"]["lower_bound_s"]
    r = {k: v.makespan_s for k, v in out["results"].items()}
    e = r["elastic"]
    pub_c, pub_a = PUBLISHED.get(name, ("-", "-"))
    main = (f"| {name} | {e / 3600:.1f} h | {r['colocate'] / e:.2f}x | {pub_c} | "
            f"{r['async'] / e:.2f}x ({out['best_async_split']}/{num_cells}) | "
            f"{r['async-even'] / e:.2f}x | {pub_a} | {e / lb:.3f} | {r['colocate'] / lb:.3f} | "
            f"{r['async'] / lb:.3f} |")
    ablation = (f"| {name} | " + " | ".join(f"{r[a] / e:.3f}" for a in ABLATIONS)
                + f" | {1 - r['async-stream'] / r['async']:.1%} | {r['colocate-stream'] / e:.2f}x |")
    return main, ablation


def tables(presets) -> None:
    rows, ablation_rows = [], []
    for name in presets:
        cfg = load_config(preset_path(name))
        main, ablation = row(name, _compare(name, ()), cfg.cluster.num_cells)
        rows.append(main)
        ablation_rows.append(ablation)
        print(f"done {name}", file=sys.stderr)
    print("| preset | elastic | vs colocate | published | vs async, best split (R/cells) "
          "| vs async, even | published | elastic / bound | colocate / bound | async / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| preset (makespan / elastic's) | " + " | ".join(ABLATIONS)
          + " | streaming saves over async (published 11.6%) "
          "| elastic vs colocate-stream (published 1.19x) |")
    print("|---|" + "---|" * (len(ABLATIONS) + 2))
    print("\n".join(ablation_rows))


@functools.lru_cache(maxsize=None)
def _compare(name: str, overrides: tuple[str, ...]) -> dict:
    return compare(load_config(preset_path(name), list(overrides)))


def assumptions() -> None:
    print("| assumption | streaming saves over async (published 11.6%) | elastic vs "
          "colocate-stream (published 1.19x) | elastic vs async-stream | elastic vs async |")
    print("|---|---|---|---|---|")
    for label, name, overrides, even in ASSUMPTIONS:
        out = _compare(name, tuple(overrides))
        r = {k: v.makespan_s for k, v in out["results"].items()}
        e = r["elastic"]
        plain, stream = (r["async-even"], r["async-stream-even"]) if even else (
            r["async"], r["async-stream"])
        print(f"| {label} | {1 - stream / plain:.1%} | {r['colocate-stream'] / e:.2f}x | "
              f"{stream / e:.2f}x | {plain / e:.2f}x |", flush=True)


def losses(presets) -> None:
    """Each policy's cell-seconds (cells x makespan), as a share of what the lower bound
    needs (rollout at full load, training at the best per-node rate): rollout cells not
    full, training cells waiting for groups, training cells beyond the world's whole
    model replicas (held, adding no throughput), training slower than the best rate
    (wider worlds), cells in transit."""
    print("| preset | policy | makespan / bound | cell-s / bound's need | rollout not full "
          "| training idle | training cells beyond whole replicas "
          "| training below best rate | in transit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in presets:
        cfg = load_config(preset_path(name))
        w = sample_workload(cfg)
        b = lower_bound(cfg, w)
        need = b["rollout_cell_s"] + b["train_cell_s"]
        split, stream, _ = best_async(cfg, w, streaming=True, name="async-stream")
        for label, res in (("elastic", simulate(cfg, named_policy(cfg, "elastic"), w)),
                           (f"async-stream ({split})", stream)):
            t = res.cell_time()
            held = cfg.cluster.num_cells * res.makespan_s
            print(f"| {name} | {label} | {res.makespan_s / b['lower_bound_s']:.3f} | "
                  f"{held / need:.3f} | {(t['rollout_s'] - t['rollout_busy_s']) / need:.1%} | "
                  f"{(t['train_s'] - t['train_busy_s']) / need:.1%} | "
                  f"{t['train_spare_s'] / need:.1%} | "
                  f"{(t['train_busy_s'] - t['train_spare_s'] - b['train_cell_s']) / need:.1%} | "
                  f"{t['transit_s'] / need:.1%} |", flush=True)


def starved(presets) -> None:
    """Elastic's empty rollout slots (as cell-seconds, a share of all the cells' time),
    split by whether a run was queued: with none (every run allowed by the staleness
    bound already started or done: the next batch waits for a step to be trained) or
    with runs queued (a cell stalled or just back). And the steps: each one's release
    (step k - s - 1 trained), when its runs started (the queue), and when it was trained."""
    import numpy as np

    from gyre_slurm.sched.cells import Role
    from gyre_slurm.sim.engine import Simulator

    print("| preset | elastic / bound | empty slots, no run allowed | empty slots, runs "
          "queued | training cells idle | steps: start delay after release, trained after "
          "release (medians) |")
    print("|---|---|---|---|---|---|")
    for name in presets:
        cfg = load_config(preset_path(name))
        w = sample_workload(cfg)
        sim = Simulator(cfg, named_policy(cfg, "elastic"), w)
        rows: list[tuple[float, float, int, int, bool, int]] = []
        flush = sim.flush_dirty

        def record(sim=sim, rows=rows, flush=flush) -> None:  # after every event
            flush()
            roll = sim.table.ids(Role.ROLLOUT)
            empty = len(roll) * sim.cap - int(sum(sim.rollout.load[c] for c in roll))
            rows.append((sim.now, empty / sim.cap, len(sim.queue),
                         len(sim.table.ids(Role.TRAIN)), sim.mb is not None, sim.version))
        sim.flush_dirty = record
        res = sim.run()
        t = np.array([r[0] for r in rows])
        dt = np.diff(t, append=t[-1])
        empty = np.array([r[1] for r in rows])
        queued = np.array([r[2] for r in rows]) > 0
        train_idle = np.array([r[3] * (not r[4]) for r in rows])
        version = np.array([r[5] for r in rows])
        whole = cfg.cluster.num_cells * res.makespan_s
        trained = [float(t[np.argmax(version >= k + 1)]) for k in range(w.num_steps)]
        s = sim.staleness
        release = [trained[k - s - 1] if k - s - 1 >= 0 else 0.0 for k in range(w.num_steps)]
        per = w.runs_per_step
        last_start = [float(sim.start_s[k * per:(k + 1) * per].max()) - release[k]
                      for k in range(w.num_steps)]
        done = [trained[k] - release[k] for k in range(w.num_steps)]
        longest = np.median([w.work_s[k * per:(k + 1) * per].max() for k in range(w.num_steps)])
        bound = lower_bound(cfg, w)["lower_bound_s"]
        print(f"| {name} | {res.makespan_s / bound:.3f} | "
              f"{np.sum(dt * empty * ~queued) / whole:.1%} | "
              f"{np.sum(dt * empty * queued) / whole:.1%} | "
              f"{np.sum(dt * train_idle) / whole:.1%} | last run started "
              f"{np.median(last_start) / 3600:.2f} h after release, trained "
              f"{np.median(done) / 3600:.2f} h after; longest run {longest / 3600:.2f} h "
              f"of work |", flush=True)


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="sim_table.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--assumptions", action="store_true",
                      help="one preset, one assumption changed at a time")
    mode.add_argument("--all", action="store_true", help="the tables and --assumptions")
    mode.add_argument("--losses", action="store_true",
                      help="where elastic's and async-stream's cell-seconds go")
    mode.add_argument("--starved", action="store_true", help="elastic's empty rollout slots")
    p.add_argument("presets", nargs="*", metavar="PRESET",
                   help=f"default: {', '.join(PRESETS)}")
    args = p.parse_args(argv)
    presets = tuple(args.presets) or PRESETS
    if (args.assumptions or args.all) and args.presets:
        p.error("--assumptions and --all take no PRESET (they use their own)")
    for name in presets:
        preset_path(name)  # an unknown name is refused before any table is printed
    if args.losses:
        losses(presets)
    elif args.starved:
        starved(presets)
    elif args.assumptions:
        assumptions()
    elif args.all:  # both, each comparison run once
        tables(PRESETS)
        print()
        assumptions()
    else:
        tables(presets)


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main, sys.argv[1:])
