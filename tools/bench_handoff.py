#!/usr/bin/env python3
"""Benchmark of training-side handoffs (a benchmark, not a test: it prints figures).

`--procs` local worker processes (gloo on 127.0.0.1, one long-lived TCPStore, a new
generation prefix per world) hold one `TrainerWorker` each. After one micro-batch and
one optimizer step (so AdamW state is real), each of `--cycles` cycles does:

  * leave: the last member goes (flush onto rank 0 on the old world, `leave` on the
    member, `join` of the others into a world one smaller, sourced by rank 0);
  * join: it comes back empty (`join` of all: it builds the model and receives weights
    + AdamW state by broadcast), plus one all-reduce probe.

Figures, per direction, median and p90 over cycles:
  * group rebuild = destroy + init of the process group (max over members),
  * broadcast (max over members), build (the newcomer), flush,
  * whole handoff = the coordinator's wall time from the flush to every join returned
    (includes the command round trips to the worker processes).
Targets: group rebuild < 0.5 s, whole handoff < 2 s.

    bash -c 'source tools/env.sh && python tools/bench_handoff.py'
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.models.tiny import make_model_dir  # noqa: E402
from gyre_slurm.train.dist import WorldSpec, host_store  # noqa: E402
from gyre_slurm.train.harness import WorkerProcesses  # noqa: E402

HOST = "127.0.0.1"


def micro_batch(vocab: int, n: int = 8, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(16, 48))
        mask = [0] * 4 + [1] * (length - 4)
        out.append({"token_ids": rng.integers(0, vocab, length).tolist(), "loss_mask": mask,
                    "logprobs": [float(-np.log(vocab)) if m else 0.0 for m in mask],
                    "advantage": float(rng.normal())})
    return out


def handoff(w, gens, port, members, *, src, flush_on=(), leave=()) -> dict[str, float]:
    t0 = time.perf_counter()
    if flush_on:
        w.call({m: ("flush", {"keep_rank": 0}) for m in flush_on})
    t1 = time.perf_counter()
    if leave:
        w.call({m: ("leave", {}) for m in leave})
    spec = WorldSpec(next(gens), len(members), HOST, port)
    joins = w.call({m: ("join", {"spec": spec, "rank": r, "src_rank": members.index(src)})
                    for r, m in enumerate(members)})
    total = time.perf_counter() - t0
    sums = w.call({m: ("all_reduce_sum", {"value": 1.0}) for m in members})
    assert set(sums.values()) == {float(len(members))}, sums
    return {"whole_handoff_s": total, "flush_s": t1 - t0,
            "group_rebuild_s": max(j["destroy_s"] + j["init_s"] for j in joins.values()),
            "broadcast_s": max(j["broadcast_s"] for j in joins.values()),
            "build_s": max(j["build_s"] for j in joins.values())}


def summary(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in rows[0]:
        xs = sorted(r[key] for r in rows)
        out[key] = {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
                    "max": xs[-1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", vocab_size=args.vocab,
                                   hidden_size=args.hidden, num_layers=args.layers,
                                   num_heads=4)
        store, port = host_store(HOST)
        gens = itertools.count(1)
        everyone = list(range(args.procs))
        with WorkerProcesses(args.procs, model_dir=model_dir) as w:
            handoff(w, gens, port, everyone, src=0)
            mb = micro_batch(args.vocab)
            n = sum(sum(t["loss_mask"]) for t in mb)
            w.call_all("train_microbatch", mb=mb, num_step_tokens=n)
            w.call_all("optimizer_step")
            rows = {"leave": [], "join": []}
            for _ in range(args.cycles):
                w.call_all("train_microbatch", mb=mb, num_step_tokens=n)
                rows["leave"].append(handoff(w, gens, port, everyone[:-1], src=0,
                                             flush_on=everyone, leave=everyone[-1:]))
                rows["join"].append(handoff(w, gens, port, everyone, src=0,
                                            flush_on=everyone[:-1]))
                w.call_all("optimizer_step")
            digests = w.call_all("digests")
            assert len({d["state"] for d in digests.values()}) == 1
        del store
    figures = {k: summary(v) for k, v in rows.items()}
    print(f"{args.procs} processes, {args.cycles} cycles, gloo on {HOST}, model hidden "
          f"{args.hidden} x {args.layers} layers, vocab {args.vocab}")
    print(f"{'direction':<10}{'phase':<18}{'median s':>10}{'p90 s':>10}{'max s':>10}")
    for direction, fig in figures.items():
        for phase, f in fig.items():
            print(f"{direction:<10}{phase:<18}{f['median']:>10.4f}{f['p90']:>10.4f}"
                  f"{f['max']:>10.4f}")
    for direction, fig in figures.items():
        rebuild, whole = fig["group_rebuild_s"]["median"], fig["whole_handoff_s"]["median"]
        print(f"{direction}: median group rebuild {rebuild:.3f} s (target < 0.5: "
              f"{'ok' if rebuild < 0.5 else 'MISSED'}), median whole handoff {whole:.3f} s "
              f"(target < 2: {'ok' if whole < 2 else 'MISSED'})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
