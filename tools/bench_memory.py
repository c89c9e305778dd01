#!/usr/bin/env python3
"""The memory calculator (`gyre memory`, gyre_slurm/models/memory.py) against a measured
CPU run (a benchmark, not a test: it prints figures).

A small Qwen3-MoE model (8 experts, top-2) trains one step on 4 Megatron rank processes
(the megatron environment, gloo) in each layout below; every rank then counts its own
model state from its tensors (`MegatronWorker.memory_bytes`: parameters, DDP's gradient
buffers, Adam moments and fp32 master weights) and reports its peak RSS. Printed per
layout: the calculator's bytes per rank and the measured median over the ranks, per
component, and their ratio (the goal: 1.00 for weights, grads and optimizer; the
calculator counts the busiest rank, and a distributed optimizer's shard may be a few
elements larger on some ranks than on others). Peak RSS is printed beside it: it holds
the Python, torch and Megatron processes (~0.5-1 GiB on CPU) and the activations, which
the calculator estimates for a GPU's fused attention and are not compared.

    tools/gyre-env python tools/bench_memory.py [--hidden 256 --layers 4 --json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the rank-process driver the tests use

from batch_helpers import micro_batch, n_tokens  # noqa: E402
from megatron_procs import Cluster, MegatronProcesses  # noqa: E402

from gyre_slurm.models import tiny  # noqa: E402
from gyre_slurm.models.memory import TrainLayout, stage_params  # noqa: E402
from gyre_slurm.models.memory import _state_bytes  # noqa: E402
from gyre_slurm.models.shape import ModelShape  # noqa: E402
from gyre_slurm.train.dist import host_store  # noqa: E402

HOST = "127.0.0.1"
# (tp, ep, precision, distributed optimizer) on 4 ranks
LAYOUTS = [(1, 1, "fp32", False), (2, 2, "bf16", True), (1, 4, "bf16", True),
           (2, 1, "bf16", False), (1, 2, "fp32", True)]
KEYS = ("weights", "grads", "optimizer")


def make_model(root: Path, *, hidden: int, layers: int, vocab: int) -> tuple[Path, Path]:
    model_dir = tiny.make_model_dir(root / "model", family="qwen3_moe", vocab_size=vocab,
                                    hidden_size=hidden, num_layers=layers, num_heads=4,
                                    num_kv_heads=2, num_experts=8, experts_per_token=2)
    weights = tiny.save_weights(tiny.new_model(model_dir, seed=0), root / "w0")
    return model_dir, weights


def measure(cluster: Cluster, layout: tuple, vocab: int) -> list[dict]:
    tp, ep, precision, distopt = layout
    members = [0, 1, 2, 3]
    cluster.world(members, tp, 1, init_weights=str(cluster.weights), expert_parallel=ep,
                  precision=precision, distributed_optimizer=distopt)
    mb = micro_batch(1, 6, vocab)
    cluster.on(members, "train_microbatch", mb=mb, num_step_tokens=n_tokens(mb))
    cluster.on(members, "optimizer_step")
    return list(cluster.on(members, "memory_bytes").values())


def predicted(shape: ModelShape, layout: tuple) -> dict[str, int]:
    tp, ep, precision, distopt = layout
    lay = TrainLayout(world_size=4, tp=tp, ep=ep, precision=precision,
                      distributed_optimizer=distopt)
    n = stage_params(shape, lay, first=True, last=True)
    return {**_state_bytes(n, lay), "params": n["dense"] + n["expert"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    python = subprocess.run([str(ROOT / "tools" / "role-env"), "megatron"], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        model_dir, weights = make_model(root, hidden=args.hidden, layers=args.layers,
                                        vocab=args.vocab)
        shape = ModelShape.from_model_dir(model_dir)
        store, port = host_store(HOST)
        with MegatronProcesses(4, python=python, model_dir=model_dir, log_dir=root) as procs:
            cluster = Cluster(procs, host=HOST, port=port, gens=itertools.count(1),
                              model_dir=model_dir, weights=weights, family="qwen3_moe")
            for layout in LAYOUTS:
                ranks = measure(cluster, layout, shape.vocab_size)
                got = {k: statistics.median(r[k] for r in ranks)
                       for k in (*KEYS, "params", "max_rss")}
                results.append({"layout": dict(zip(("tp", "ep", "precision",
                                                    "distributed_optimizer"), layout)),
                                "predicted": predicted(shape, layout), "measured": got})
        del store
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"qwen3_moe hidden {args.hidden}, {args.layers} layers, 8 experts top-2, vocab "
          f"{shape.vocab_size}; 4 ranks; MiB per rank (measured: median over ranks)")
    print(f"{'layout':<26}" + "".join(f"{k:>22}" for k in KEYS) + f"{'peak RSS':>11}")
    for r in results:
        lay, pr, me = r["layout"], r["predicted"], r["measured"]
        label = (f"TP{lay['tp']} EP{lay['ep']} {lay['precision']}"
                 + (" distopt" if lay["distributed_optimizer"] else ""))
        cells = "".join(f"{pr[k] / 2**20:>8.2f} /{me[k] / 2**20:>7.2f} x{me[k] / pr[k]:.2f}"
                        for k in KEYS)
        print(f"{label:<26}{cells}{me['max_rss'] / 2**20:>10.0f}")
    print("(each cell: calculated / measured, then measured / calculated)")
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
