#!/usr/bin/env python3
"""Benchmark of the coordinator's micro-batch hand-off (a benchmark, not a test: it
prints figures): each micro-batch goes to the training ranks as a file
(`gyre_slurm.traj.mbfile`, safetensors), written by the coordinator, whose event loop
serves the gateway's calls meanwhile, and read by every rank.

Figures, for micro-batches of long agent trajectories (synthetic: random token ids of a
152k vocabulary, `--generated` of the tokens trained with a logprob each, the rest
prompt and tool output), median over `--repeats`:

  bytes/token    the file's size per token
  write s        the file written (temp name, fsync, rename)
  read s         a rank's read back into trajectory dicts
  loop stall s   the longest the coordinator's event loop went without running (a 1 ms
                 ticker beside the write and the micro-batch's token digests): what a
                 gateway call waits at worst
  book MB        the trajectories' memory in the coordinator's book (tracemalloc)

and the book over a job (`--steps`, `--runs` a step, each run one trajectory of
`--tokens` / 8 tokens, as arrays): what it still holds after each step is trained
(tracemalloc), which must not grow with the steps (it held every trained token
until session 55).

Forms: `json` (the micro-batch as a JSON list of trajectory lines, written in the event
loop: the hand-off before safetensors), `safetensors` (written and hashed off the loop,
from the trajectories as the book holds them: lists, or numpy arrays with --arrays).

    tools/gyre-env python tools/bench_microbatch_io.py [--tokens 1400000] [--trajectories 1]
        [--generated 0.15] [--repeats 5] [--steps 6] [--runs 16] [--dir /tmp] [--json]

The files go to `--dir` (local disk by default; on a cluster point it at the run dir's
filesystem to measure that filesystem instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_slurm.common.fsio import write_json_atomic  # noqa: E402
from gyre_slurm.traj import mbfile  # noqa: E402
from gyre_slurm.traj.records import f32_list, token_digest  # noqa: E402


def make_batch(tokens: int, trajectories: int, generated: float, seed: int,
               arrays: bool) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for j in range(trajectories):
        n = tokens // trajectories
        ids = rng.integers(0, 151_936, n, dtype=np.int32)
        mask = (rng.random(n) < generated).astype(np.uint8)
        mask[0] = 0
        logp = np.where(mask == 1, -rng.exponential(0.5, n), 0.0).astype(np.float32)
        versions = np.where(mask == 1, 7, -1).astype(np.int64)  # as select.Trajectory holds them
        t = {"run_id": f"task-{j:04d}-s7-g3-r{j}", "token_ids": ids, "loss_mask": mask,
             "logprobs": logp, "versions": versions, "policy_version": 7,
             "advantage": 0.375 - j / 7}
        if not arrays:  # as `Trajectory.to_json` makes them
            t.update(token_ids=ids.tolist(), loss_mask=mask.tolist(),
                     logprobs=f32_list(logp), versions=versions.tolist())
        out.append(t)
    return out


def book_mb(args, arrays: bool) -> float:
    tracemalloc.start()
    batch = make_batch(args.tokens, args.trajectories, args.generated, 1, arrays)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del batch
    return size / 2**20


async def handoff(form: str, path: Path, batch: list[dict]) -> tuple[float, float]:
    """(seconds to write and hash, the loop's longest stall meanwhile)."""
    stall, last, done = 0.0, time.perf_counter(), False

    async def ticker():
        nonlocal stall, last
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    if form == "json":  # the hand-off before: in the loop
        write_json_atomic(path, batch)
        [token_digest(t["token_ids"]) for t in batch]
    else:
        await asyncio.to_thread(mbfile.write, path, batch)
        await asyncio.to_thread(lambda: [token_digest(t["token_ids"]) for t in batch])
    dt = time.perf_counter() - t0
    await asyncio.sleep(0.01)
    done = True
    await tick
    return dt, stall


def read(form: str, path: Path) -> float:
    t0 = time.perf_counter()
    if form == "json":
        json.loads(path.read_text())
    else:
        mbfile.read(path)
    return time.perf_counter() - t0


def book_over_steps(args) -> list[float]:
    """MB the book holds after each step is trained (its runs' trajectories dropped)."""
    from gyre_slurm.runtime.book import StepBook

    book = StepBook(num_steps=args.steps, prompts_per_step=max(1, args.runs // 4),
                    group_size=4, staleness=1)
    n = max(2, args.tokens // 8)
    held = []
    tracemalloc.start()
    for step in range(args.steps):
        for r in book.pending():
            book.start(r.run_id)
        for r in [e for e in book.runs.values() if e.state == "running" and e.step == step]:
            [t] = make_batch(n, 1, args.generated, step, True)
            book.finish(r.run_id, status="ok", reward=float(r.member),
                        trajectories=[dict(t, run_id=r.run_id)])
        while batch := book.next_microbatch(max_tokens=n * 4):
            book.trained(batch)
        book.step_done()
        del batch
        held.append(round(tracemalloc.get_traced_memory()[0] / 2**20, 1))
    tracemalloc.stop()
    return held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_400_000,
                    help="tokens of the micro-batch (all its trajectories together)")
    ap.add_argument("--trajectories", type=int, default=1)
    ap.add_argument("--generated", type=float, default=0.15,
                    help="share of the tokens trained (generated by the model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps of the book-over-a-job figure")
    ap.add_argument("--runs", type=int, default=16, help="runs a step there")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="one JSON object, not a table")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for form, arrays in (("json", False), ("safetensors", False), ("safetensors", True)):
            batch = make_batch(args.tokens, args.trajectories, args.generated, 0, arrays)
            suffix = ".json" if form == "json" else mbfile.SUFFIX
            path = Path(tmp) / f"step000000_mb00000{suffix}"
            writes, stalls, reads = [], [], []
            for _ in range(args.repeats):
                dt, stall = asyncio.run(handoff(form, path, batch))
                writes.append(dt)
                stalls.append(stall)
                reads.append(read(form, path))
            rows.append({"form": form, "book": "arrays" if arrays else "lists",
                         "bytes_per_token": round(path.stat().st_size / args.tokens, 2),
                         "write_s": round(statistics.median(writes), 3),
                         "read_s": round(statistics.median(reads), 3),
                         "loop_stall_s": round(statistics.median(stalls), 3),
                         "book_mb": round(book_mb(args, arrays), 1)})
    held = book_over_steps(args)
    if args.json:
        print(json.dumps({"tokens": args.tokens, "trajectories": args.trajectories,
                          "generated": args.generated, "repeats": args.repeats,
                          "rows": rows, "book_held_mb_after_each_step": held}))
        return 0
    print(f"micro-batch of {args.tokens:,} tokens in {args.trajectories} trajectories, "
          f"{args.generated:.0%} generated; medians of {args.repeats}")
    print(f"{'form':<12} {'book':<7} {'bytes/token':>11} {'write s':>8} {'read s':>7} "
          f"{'loop stall s':>12} {'book MB':>8}")
    for r in rows:
        print(f"{r['form']:<12} {r['book']:<7} {r['bytes_per_token']:>11} {r['write_s']:>8} "
              f"{r['read_s']:>7} {r['loop_stall_s']:>12} {r['book_mb']:>8}")
    print(f"book over {args.steps} steps of {args.runs} runs of {max(2, args.tokens // 8):,} "
          f"tokens: MB held after each step {held}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
