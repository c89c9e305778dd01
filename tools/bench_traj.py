#!/usr/bin/env python3
"""Benchmark of the trajectory processor (a benchmark, not a test: it prints figures).

A synthetic run: a system prompt, then `--branches` compaction branches; each branch
restarts from the system prompt plus a fresh summary and grows by `--calls / --branches`
calls, each appending a tool result (3000s band) to the previous sequence and generating
an output (2000s band). Sizes are chosen so the run holds `--tokens` distinct tokens
(default: 400 calls, 10 branches, 1M tokens; the naive calls x context is ~21M tokens).

Measured, pinned to one CPU core:
  * tree build + greedy selection of K paths from the stored (delta) calls: median wall
    time of `--repeats` runs, and the tracemalloc peak of one more run, against the
    run's distinct-token bytes (4 B x distinct tokens);
  * bytes of the run in the call store against the bound 4 B x distinct tokens +
    4 B x generated tokens;
  * for context: appending all calls (parent choice + encoding + write, no fsync),
    loading the store, and materializing the K trajectories.

    bash -c 'source tools/env.sh && python tools/bench_traj.py'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.traj.records import CallRecord  # noqa: E402
from gyre_slurm.traj.select import materialize, select_paths  # noqa: E402
from gyre_slurm.traj.store import CallStoreWriter, load_store  # noqa: E402
from gyre_slurm.traj.tree import build_tree  # noqa: E402


def _band(rng: np.random.Generator, base: int, n: int) -> np.ndarray:
    return rng.integers(base, base + 1000, size=n, dtype=np.int32)


def synthetic_run(*, num_calls: int, num_branches: int, num_tokens: int, seed: int = 0):
    """Yields the run's CallRecords (full prompts), in call order."""
    rng = np.random.default_rng(seed)
    calls_per_branch = num_calls // num_branches
    system_len = 2000
    per_call = (num_tokens - system_len - num_branches * 2000) // num_calls
    output_len = per_call // 5
    tool_len = per_call - output_len
    summary_len = 2000 + tool_len  # a branch's first call has no tool result
    system = _band(rng, 1000, system_len)
    call = 0
    for _ in range(num_branches):
        seq = np.concatenate([system, _band(rng, 1000, summary_len)])
        for k in range(calls_per_branch):
            prompt = seq if k == 0 else np.concatenate([seq, _band(rng, 3000, tool_len)])
            output = _band(rng, 2000, output_len)
            logprobs = -rng.random(output_len, dtype=np.float32)
            yield CallRecord("bench-run", call, prompt, output, logprobs, call // 40,
                             float(call), float(call) + 0.5, "stop")
            seq = np.concatenate([prompt, output])
            call += 1


def build_and_select(deltas, k):
    tree = build_tree(deltas)
    return tree, select_paths(tree, max_paths=k)


def _peak_bytes(fn, *args) -> int:
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def store_figures(args, run_dir: str) -> dict:
    """Write the run through the call store; sizes, load time and load+build peak."""
    naive = generated = 0
    append_s = 0.0
    with CallStoreWriter(run_dir, "bench", fsync_interval_s=None) as writer:
        for rec in synthetic_run(num_calls=args.calls, num_branches=args.branches,
                                 num_tokens=args.tokens):
            t0 = time.perf_counter()
            writer.append(rec)
            append_s += time.perf_counter() - t0
            naive += len(rec.prompt_ids) + len(rec.output_ids)
            generated += len(rec.output_ids)
    t0 = time.perf_counter()
    loaded = load_store(run_dir)
    load_s = time.perf_counter() - t0
    assert not loaded.errors, loaded.errors
    peak = _peak_bytes(lambda: build_and_select(load_store(run_dir).runs["bench-run"], args.k))
    return {"deltas": loaded.runs["bench-run"], "naive_call_tokens": naive,
            "generated_tokens": generated, "load_store_s": round(load_s, 4),
            "append_all_calls_s": round(append_s, 4),
            "load_build_select_peak_bytes": peak,
            "store_bytes": sum(p.stat().st_size for p in Path(run_dir, "calls").iterdir())}


def tree_figures(deltas, *, k: int, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tree, selection = build_and_select(deltas, k)
        times.append(time.perf_counter() - t0)
    peak = _peak_bytes(build_and_select, deltas, k)
    t0 = time.perf_counter()
    trajs = materialize(tree, selection)
    return {
        "tree": tree, "distinct_tokens": tree.num_tokens, "tree_edges": tree.num_edges,
        "leaves": len(tree.leaves), "build_select_s_median": round(statistics.median(times), 4),
        "build_select_s_all": [round(t, 4) for t in times], "peak_bytes": peak,
        "materialize_s": round(time.perf_counter() - t0, 4), "trajectories": len(trajs),
        "trainable_tokens": tree.num_trainable,
        "trained_tokens": sum(t.num_trained for t in trajs),
        "trajectory_tokens": sum(len(t) for t in trajs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--branches", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    with tempfile.TemporaryDirectory() as run_dir:
        fig = store_figures(args, run_dir)
    fig.update(tree_figures(fig.pop("deltas"), k=args.k, repeats=args.repeats))
    tree = fig.pop("tree")
    distinct_bytes = 4 * tree.num_tokens
    bound = 4 * tree.num_tokens + 4 * fig["generated_tokens"]
    fig.update({
        "calls": args.calls, "branches": args.branches, "k": args.k,
        "distinct_token_bytes": distinct_bytes,
        "peak_vs_distinct_bytes": round(fig["peak_bytes"] / distinct_bytes, 3),
        "load_build_select_peak_vs_distinct_bytes":
            round(fig["load_build_select_peak_bytes"] / distinct_bytes, 3),
        "store_bound_bytes": bound, "store_vs_bound": round(fig["store_bytes"] / bound, 4),
    })
    print(json.dumps(fig, indent=2))
    ok = (fig["build_select_s_median"] < 1.0 and fig["peak_vs_distinct_bytes"] < 3
          and fig["store_vs_bound"] <= 1.1)
    print("targets (< 1 s, peak < 3x distinct bytes, store <= 1.1x bound):",
          "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
