#!/usr/bin/env python3
"""Benchmark of tree packing against rows packing (a benchmark, not a test: it prints
figures). Tree packing feeds each run's prefix tree once with a tree attention mask;
rows packing feeds every trajectory whole, right-padded to the longest row.

Workloads (runs of calls through the real processor: prefix tree, K paths, the
shared-prefix rule; then the coordinator's micro-batching, `StepBook.next_microbatch`):

  linear      a long-horizon agent run (system prompt + task, then turns: tool result
              in, answer out, the context growing) that never compacts: one path per run
  compaction  the same with the agent loop's compaction: past a context budget the
              history restarts as [system + task, summary] (a new branch sharing only
              the head)
  branchy     compaction plus retried calls (a call re-sampled at the same prompt) and
              sub-agents (a fork of the current context running a few calls of its
              own), the branches that share long prefixes
  store       with --store RUN_DIR: every run of a recorded call store (a gyre run dir)

Figures per workload: runs, trajectories, trained tokens; tokens computed per trained
token (tree vs rows); padding share (rows; tree has none); step time: the median over
--repeats of forward + backward of every micro-batch on the torch trainer
(`TrainerWorker.train_microbatch`, a model made here, CPU, one thread), tree vs rows, in
wall and in CPU seconds (the process's; steadier than wall on a shared machine, and the
goal's figure). Goals: at
least 2x fewer tokens computed on branch-heavy runs, and tree no slower on linear runs.

    tools/gyre-env python tools/bench_tree.py [--store RUN_DIR] [--json]
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

from gyre_slurm.runtime.book import StepBook, run_id_of  # noqa: E402
from gyre_slurm.traj.encode import encode_run  # noqa: E402
from gyre_slurm.traj.process import process_run  # noqa: E402
from gyre_slurm.traj.records import CallRecord  # noqa: E402
from gyre_slurm.traj.treepack import tree_tokens  # noqa: E402

SHAPES = {  # budget: the context budget (compaction); p_retry, p_sub: per turn
    "linear": {"budget": None, "p_retry": 0.0, "p_sub": 0.0},
    "compaction": {"budget": 2400, "p_retry": 0.0, "p_sub": 0.0},
    "branchy": {"budget": 2400, "p_retry": 0.08, "p_sub": 0.05},
}


class _Calls:
    def __init__(self, run_id: str, rng: np.random.Generator):
        self.run_id, self.rng, self.out = run_id, rng, []

    def band(self, base: int, n: int) -> np.ndarray:
        return self.rng.integers(base, base + 100, size=max(1, int(n)), dtype=np.int32)

    def call(self, prompt: np.ndarray, n_out: int) -> np.ndarray:
        out = self.band(300, n_out)
        lp = (-np.log(512) + self.rng.normal(scale=0.3, size=len(out))).astype(np.float32)
        i = len(self.out)
        self.out.append(CallRecord(self.run_id, i, prompt, out, lp, 0, float(i),
                                   float(i) + 0.5, "stop"))
        return np.concatenate([prompt, out])


def synthetic_run(run_id: str, shape: dict, rng: np.random.Generator, *, head: int = 300,
                  result: int = 110, answer: int = 28) -> list[CallRecord]:
    """One agent run (module doc): turns ~ lognormal (median 24), tool results ~`result`
    tokens, answers ~`answer`, a `head`-token system prompt + task."""
    c = _Calls(run_id, rng)
    first = c.band(100, head)
    ctx = first
    for turn in range(max(2, int(rng.lognormal(np.log(24), 0.5)))):
        obs = c.band(200, rng.lognormal(np.log(result), 0.5))
        if turn and shape["budget"] and len(ctx) + len(obs) > shape["budget"]:
            ctx = np.concatenate([first, c.band(100, 60)])  # compacted: head + summary
        prompt = ctx if turn == 0 else np.concatenate([ctx, obs])
        n_out = int(rng.integers(answer // 2, answer * 2))
        seq = c.call(prompt, n_out)
        if rng.random() < shape["p_retry"]:  # re-sampled; the agent keeps the new answer
            seq = c.call(prompt, n_out)
        if rng.random() < shape["p_sub"]:  # a sub-agent forks off the current context
            sub = np.concatenate([seq, c.band(100, 40)])
            for _ in range(3):
                sub = np.concatenate([c.call(sub, n_out), c.band(200, result)])
        ctx = seq
    return c.out


def workload(shape: str, *, runs: int, k: int, seed: int) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        calls = synthetic_run(f"{shape}-{r}", SHAPES[shape], rng)
        res = process_run(encode_run(calls), max_per_run=k, advantage=float(rng.normal()))
        out.append([dict(t.to_json(), versions=t.versions.tolist()) for t in res.trajectories])
    return out


def recorded(run_dir: Path, *, k: int) -> list[list[dict]]:
    """Every ok run of a gyre run dir (runs/runs.jsonl), or every run of a bare store."""
    from gyre_slurm.common.fsio import read_jsonl
    from gyre_slurm.traj.store import load_store

    loaded = load_store(run_dir)
    records = run_dir / "runs" / "runs.jsonl"
    ok = {r["run_id"] for r in read_jsonl(records) if r["status"] == "ok"} \
        if records.exists() else set(loaded.runs)
    out = []
    for rid, deltas in sorted(loaded.runs.items()):
        if rid not in ok:
            continue
        trajs = process_run(deltas, max_per_run=k, advantage=0.5).trajectories
        out.append([dict(t.to_json(), versions=t.versions.tolist()) for t in trajs
                    if not t.loss_mask[0]])
    return [r for r in out if r]


def microbatches(runs: list[list[dict]], *, budget: int, packing: str) -> list[list[dict]]:
    """The coordinator's micro-batches: runs ended in this order, one step."""
    book = StepBook(num_steps=1, prompts_per_step=len(runs), group_size=1, staleness=0)
    for p, trajs in enumerate(runs):
        rid = run_id_of(0, p, 0)
        book.start(rid)
        book.finish(rid, status="ok", reward=0.0, trajectories=trajs)
    out = []
    while batch := book.next_microbatch(max_tokens=budget, packing=packing):
        out.append(batch)
    return out


def token_figures(batches: list[list[dict]], packing: str) -> dict:
    trained = sum(sum(t["loss_mask"]) for b in batches for t in b)
    if packing == "tree":
        fed, pad = sum(tree_tokens(b) for b in batches), 0
    else:
        fed = sum(len(b) * max(len(t["token_ids"]) for t in b) for b in batches)
        pad = fed - sum(len(t["token_ids"]) for b in batches for t in b)
    return {"micro_batches": len(batches), "tokens_computed": fed,
            "computed_per_trained": round(fed / trained, 3), "padding_share": round(pad / fed, 4)}


class Trainer:
    """The torch trainer in a world of one (gloo on loopback), on a model made here."""

    def __init__(self, tmp: Path, *, hidden: int, layers: int):
        from gyre_slurm.models.tiny import make_model_dir
        from gyre_slurm.train.dist import WorldSpec, host_store
        from gyre_slurm.train.worker import TrainerWorker

        model_dir = make_model_dir(tmp / "model", hidden_size=hidden, num_layers=layers,
                                   num_heads=hidden // 32, max_positions=16384)
        self.store, port = host_store("127.0.0.1")
        self.worker = TrainerWorker(model_dir=model_dir, node_index=0, lr=1e-4)
        self.worker.join(WorldSpec(1, 1, "127.0.0.1", port), 0, src_rank=0)

    def step_s(self, batches: list[list[dict]], packing: str) -> tuple[float, float]:
        """(wall, CPU) seconds of forward + backward of every micro-batch."""
        n = max(1, sum(sum(t["loss_mask"]) for b in batches for t in b))
        t0, c0 = time.perf_counter(), time.process_time()
        for b in batches:
            self.worker.train_microbatch(b, num_step_tokens=n, packing=packing)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        self.worker._grads.zero_()  # gradients are not the point here: no optimizer step
        return dt, dc

    def close(self) -> None:
        from gyre_slurm.train.dist import leave_world

        leave_world()


def kernel_times(batch: list[dict], *, heads: int, dim: int, repeats: int) -> dict:
    """Median seconds of attention alone (forward + backward, float32, CPU) on one
    micro-batch: the tree kernels ("paths": causal SDPA path by path, the CPU default;
    "mask": SDPA with the dense boolean tree mask) and rows (causal SDPA on the padded
    rows)."""
    import torch

    from gyre_slurm.train.tree import to_inputs, tree_attention
    from gyre_slurm.traj.treepack import pack_trees

    tree = to_inputs(pack_trees(batch), kernel="paths")
    gen = torch.Generator().manual_seed(0)
    rows_shape = (len(batch), heads, max(len(t["token_ids"]) for t in batch), dim)
    shapes = {"paths": (1, heads, tree.num_tokens, dim), "mask": None, "rows": rows_shape}
    shapes["mask"] = shapes["paths"]
    out = {}
    for name, shape in shapes.items():
        qkv = [torch.randn(*shape, generator=gen).requires_grad_() for _ in range(3)]
        runs = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            if name == "rows":
                y = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
            else:
                y = tree_attention(*qkv, tree, kernel=name)
            y.square().sum().backward()
            runs.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(runs[1:]), 4)  # the first warms up
    return out


def measure(name: str, runs: list[list[dict]], args, trainer: Trainer | None) -> dict:
    row: dict = {"workload": name, "runs": len(runs),
                 "trajectories": sum(len(r) for r in runs),
                 "trained_tokens": sum(sum(t["loss_mask"]) for r in runs for t in r)}
    batches = {p: microbatches(runs, budget=args.microbatch_tokens, packing=p)
               for p in ("tree", "rows")}
    for p in ("tree", "rows"):
        row[p] = token_figures(batches[p], p)
    row["rows_vs_tree_tokens"] = round(row["rows"]["tokens_computed"]
                                       / row["tree"]["tokens_computed"], 3)
    if args.kernels:
        row["attention_s"] = kernel_times(batches["tree"][0], heads=args.hidden // 32,
                                          dim=32, repeats=args.repeats)
    if trainer is not None:
        times = {p: [] for p in ("tree", "rows")}
        trainer.step_s(batches["tree"][:1], "tree")  # warm up
        for _, p in itertools.product(range(args.repeats), ("tree", "rows")):
            times[p].append(trainer.step_s(batches[p], p))
        for p in ("tree", "rows"):
            row[p]["step_s_median"] = round(statistics.median(t[0] for t in times[p]), 3)
            row[p]["step_cpu_s_median"] = round(statistics.median(t[1] for t in times[p]), 3)
        for name, key in (("step", "step_s_median"), ("step_cpu", "step_cpu_s_median")):
            row[f"rows_vs_tree_{name}"] = round(row["rows"][key] / row["tree"][key], 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=8, help="runs per synthetic workload")
    ap.add_argument("-k", type=int, default=5, help="trajectories per run (K)")
    ap.add_argument("--microbatch-tokens", type=int, default=12000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--store", type=Path, action="append", default=[],
                    help="a gyre run dir whose call store to measure too")
    ap.add_argument("--no-train", action="store_true", help="token figures only")
    ap.add_argument("--kernels", action="store_true",
                    help="also time attention alone on each workload's first micro-batch: "
                         "paths, dense mask, rows")
    ap.add_argument("--p-retry", type=float, default=SHAPES["branchy"]["p_retry"],
                    help="branchy: chance per turn that a call is re-sampled")
    ap.add_argument("--p-sub", type=float, default=SHAPES["branchy"]["p_sub"],
                    help="branchy: chance per turn that a sub-agent forks off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    SHAPES["branchy"].update(p_retry=args.p_retry, p_sub=args.p_sub)
    loads = [(s, workload(s, runs=args.runs, k=args.k, seed=args.seed + i))
             for i, s in enumerate(SHAPES)]
    loads += [(f"store:{p.name}", recorded(p, k=args.k)) for p in args.store]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = None if args.no_train else Trainer(Path(tmp), hidden=args.hidden,
                                                     layers=args.layers)
        try:
            rows = [measure(name, runs, args, trainer) for name, runs in loads if runs]
        finally:
            if trainer is not None:
                trainer.close()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _table(rows)
    branchy = next(r for r in rows if r["workload"] == "branchy")
    linear = next(r for r in rows if r["workload"] == "linear")
    ok = branchy["rows_vs_tree_tokens"] >= 2.0 and (
        args.no_train or linear["rows_vs_tree_step_cpu"] >= 0.95)
    print("goals (branchy: >= 2x fewer tokens computed; linear: tree step CPU time within "
          "5% of rows or faster):", "met" if ok else "NOT met")
    return 0 if ok else 1


def _pair(d: dict, a: str, b: str) -> str:
    return f"{d[a]} ({d[b]})" if a in d else "-"


def _table(rows: list[dict]) -> None:
    head = ("workload", "runs", "trajs", "trained", "tree tok/trained", "rows tok/trained",
            "rows/tree tokens", "rows padding", "tree step s (cpu s)", "rows step s (cpu s)",
            "rows/tree time (cpu)")
    print(" | ".join(head))
    for r in rows:
        t, w = r["tree"], r["rows"]
        print(" | ".join(str(x) for x in (
            r["workload"], r["runs"], r["trajectories"], r["trained_tokens"],
            t["computed_per_trained"], w["computed_per_trained"], r["rows_vs_tree_tokens"],
            f"{100 * w['padding_share']:.1f}%", _pair(t, "step_s_median", "step_cpu_s_median"),
            _pair(w, "step_s_median", "step_cpu_s_median"),
            _pair(r, "rows_vs_tree_step", "rows_vs_tree_step_cpu"))))
    for r in rows:
        if "attention_s" in r:
            a = r["attention_s"]
            print(f"attention fwd+bwd, first micro-batch of {r['workload']}: tree paths "
                  f"{a['paths']} s, tree dense mask {a['mask']} s, rows causal {a['rows']} s")


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
