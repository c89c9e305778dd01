#!/usr/bin/env python3
"""The elastic property test's random jobs, by the hundred: how often and why elastic
falls more than 3% behind the best fixed split chosen with hindsight.

    tools/gyre-env python tools/sim_draws.py [--draws N] [--seed S] [--repeats K]
        [--jobs J] [--variant KEY=VALUE ...] [--jsonl FILE]

Draws N jobs with tests/test_sim_policy_props.py's `drawn_jobs` (draw S; the test checks
the first 40 of draw 0, so `--seed 0` repeats them first) and simulates each
with elastic and every fixed split (async, with and without streaming), as the test
does. Prints how many are more than 3% behind the best fixed split, the worst, the mean
ratio, and each job over 3% with its `--set` overrides.

A job over 3% is one sampled workload; the hindsight split is chosen on that sample,
which no online policy can do. `--repeats K` (default 20) re-simulates each such job's
config on K workload seeds (`seed=0..K-1`) and prints elastic's mean makespan against
the mean of each fixed split: a job elastic loses only on its sample (the mean of
elastic at or below the best split's mean) is sampling noise; one it loses on average
is a policy error.

`--variant KEY=VALUE` (repeatable) also runs elastic with those overrides on every job
and prints the pair: jobs over 3% both ways, and the jobs the variant makes more than 1%
faster or slower. `--jsonl FILE` writes one line per job (ratios, makespans, handoffs,
its overrides). Deterministic for S, wherever it runs; the first 30 of 500 are the 30 of
`--draws 30`. 500 jobs take about 4 CPU-minutes
(with --repeats 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gyre_slurm.common.fsio import check_output_file, write_bytes_atomic  # noqa: E402
from gyre_slurm.config.schema import load_config  # noqa: E402
from gyre_slurm.errors import UserError  # noqa: E402
from gyre_slurm.sched.policies import named_policy  # noqa: E402
from gyre_slurm.sim.runner import simulate  # noqa: E402
from gyre_slurm.sim.workload import sample_workload  # noqa: E402
from test_sim_policy_props import drawn_jobs, fixed_split_makespans  # noqa: E402

BEHIND = 1.03  # the property test's limit


def measure(args: tuple[list[str], list[str]]) -> dict:
    overrides, variant = args
    cfg = load_config(None, overrides)
    workload = sample_workload(cfg)
    elastic = simulate(cfg, named_policy(cfg, "elastic"), workload)
    best = min(fixed_split_makespans(cfg, workload).values())
    out = {"ratio": elastic.makespan_s / best, "elastic_s": elastic.makespan_s,
           "best_split_s": best, "handoffs": elastic.handoffs,
           "cells": cfg.cluster.num_cells, "runs_per_step": cfg.workload.runs_per_step,
           "overrides": overrides}
    if variant:
        other = load_config(None, overrides + variant)
        v = simulate(other, named_policy(other, "elastic"), workload)
        out.update(variant_ratio=v.makespan_s / best, variant_s=v.makespan_s,
                   variant_handoffs=v.handoffs)
    return out


def expectation(args: tuple[list[str], int]) -> dict:
    """Elastic and every fixed split over `repeats` workload seeds of one job's config."""
    overrides, repeats = args
    elastic, fixed, hindsight = [], {}, []
    for k in range(repeats):
        cfg = load_config(None, [o for o in overrides if not o.startswith("seed=")]
                          + [f"seed={k}"])
        workload = sample_workload(cfg)
        elastic.append(simulate(cfg, named_policy(cfg, "elastic"), workload).makespan_s)
        made = fixed_split_makespans(cfg, workload)
        for r, m in made.items():
            fixed.setdefault(r, []).append(m)
        hindsight.append(min(made.values()))
    means = {r: statistics.mean(v) for r, v in fixed.items()}
    best = min(means, key=means.get)
    return {"elastic_mean_s": statistics.mean(elastic), "best_split": best,
            "best_split_mean_s": means[best], "hindsight_mean_s": statistics.mean(hindsight),
            "behind_on": sum(e > BEHIND * h for e, h in zip(elastic, hindsight)),
            "repeats": repeats}


def brief(overrides: list[str]) -> str:
    keep = ("cluster.num_nodes", "workload.prompts_per_step", "workload.group_size",
            "workload.duration.mean_s", "workload.duration.sigma", "rollout.runs_per_node",
            "training.node_tokens_per_s", "training.max_staleness", "workload.phases",
            "seed")
    return " ".join(o for o in overrides if o.split("=", 1)[0] in keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0, help="which draw (the test checks draw 0)")
    ap.add_argument("--repeats", type=int, default=20,
                    help="workload seeds per job over 3%% (0: none)")
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--jsonl", type=Path)
    a = ap.parse_args()
    for name, least in (("draws", 1), ("repeats", 0), ("jobs", 1)):
        if getattr(a, name) < least:
            raise UserError(f"--{name} must be >= {least}, got {getattr(a, name)}")
    if a.jsonl is not None:
        check_output_file(a.jsonl, what="--jsonl")
    jobs = drawn_jobs(a.draws, a.seed)
    with Pool(a.jobs) as pool:
        rows = pool.map(measure, [(j, a.variant) for j in jobs], chunksize=4)
        if a.jsonl:
            lines = "".join(json.dumps(r) + "\n" for r in rows)
            write_bytes_atomic(a.jsonl, lines.encode())
        ratios = [r["ratio"] for r in rows]
        over = [r for r in rows if r["ratio"] > BEHIND]
        print(f"{len(rows)} jobs (draw {a.seed}): {len(over)} more than 3% behind "
              f"the best fixed split; worst {max(ratios):.4f}, mean {statistics.mean(ratios):.4f}, "
              f"median {statistics.median(ratios):.4f}")
        if a.variant:
            vr = [r["variant_ratio"] for r in rows]
            faster = sum(r["variant_s"] < 0.99 * r["elastic_s"] for r in rows)
            slower = sum(r["variant_s"] > 1.01 * r["elastic_s"] for r in rows)
            print(f"with {' '.join(a.variant)}: {sum(x > BEHIND for x in vr)} more than 3% "
                  f"behind; worst {max(vr):.4f}, mean {statistics.mean(vr):.4f}; "
                  f"{faster} jobs more than 1% faster, {slower} more than 1% slower")
        if not over:
            return 0
        distinct = list({json.dumps([o for o in r["overrides"] if not o.startswith("seed=")]): r
                         for r in over}.values())
        found = (pool.map(expectation, [(r["overrides"], a.repeats) for r in distinct])
                 if a.repeats > 0 else [None] * len(distinct))
    print(f"\njobs more than 3% behind ({len(distinct)} distinct configs); over "
          f"{a.repeats} workload seeds each: elastic's mean against the best fixed split's "
          f"mean (noise: at or below it) and against the hindsight split's mean")
    noise = 0
    for r, e in zip(distinct, found):
        line = f"{r['ratio']:.4f} ({r['handoffs']} handoffs)"
        if e is not None:
            vs_best = e["elastic_mean_s"] / e["best_split_mean_s"]
            noise += vs_best <= 1.0
            line += (f"  mean: {vs_best:.3f} of split {e['best_split']}, "
                     f"{e['elastic_mean_s'] / e['hindsight_mean_s']:.3f} of hindsight; "
                     f"behind on {e['behind_on']}/{e['repeats']} seeds")
        print(f"  {line}\n      {brief(r['overrides'])}")
    if a.repeats > 0:
        print(f"{noise} of {len(distinct)} configs: elastic at or below the best fixed split "
              f"on average (sampling noise); {len(distinct) - noise} behind it on average")
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
