"""Publishing a policy: the streamed weight sync against the file path, per model size.

    tools/gyre-env python tools/bench_weightsync.py [--sizes small,large] [--tp 2 --pp 2]
        [--bucket-mb 64] [--receivers 1] [--repeats 3]

Each size is a model made by the project's model maker (gyre_slurm.models.tiny: config,
tokenizer and random weights, float32), held by TP x PP training ranks as Megatron
shards (cut by gyre_slurm.train.megatron.convert, as a MegatronWorker holds them), and
published to `--receivers` servers, each a process holding the whole model (as a
rollout server does), every rank a process of its own on this machine:

- file: the ranks gather the model into rank 0 (gather_hf_state: the Megatron backend's
  export), which writes model.safetensors; each server then reads it and loads it in
  place (tiny.load_weights' way). Time: export + load.
- stream: one round of gyre_slurm.train.wsync over a gloo transfer group: each rank sends the
  pieces it holds, bucket by bucket, straight to the servers, which load each bucket.

Printed per size: parameters, model bytes, bucket bytes, publish time (median of the
repeats) for both paths and their ratio, and each rank's and server's peak resident
memory growth during a publish (median; the baseline is the process's memory with its
shard or model loaded). Goals: the stream's growth does not rise with the model size
(about one bucket), and the stream is faster than the file. Figures on a shared
machine are noisy; the medians and the ratios are what to compare. The file is written
to a local disk here (page cache): on a shared filesystem the file path is slower.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {  # hidden, layers, heads: ~85 M and ~340 M parameters
    "small": (1024, 8, 8), "medium": (1536, 8, 12), "large": (2048, 8, 16)}
HOST = "127.0.0.1"
MB = 1 << 20


# ---- the member processes ----------------------------------------------------------------

def _stage_state(model_dir: Path, shape, pp_rank: int, pp_size: int):
    """The Hugging Face tensors stage `pp_rank` holds, read from the weights file."""
    from safetensors import safe_open

    from gyre_slurm.train.megatron import convert

    layers = convert.stage_layers(shape, pp_rank, pp_size)
    keep = ("model.embed_tokens.", "model.norm.", "lm_head.")
    out = {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if name.startswith(keep) or (len(parts) > 2 and parts[1] == "layers"
                                         and int(parts[2]) in layers):
                out[name] = f.get_tensor(name)
    return out


class Member:
    def __init__(self, args: dict):
        import torch

        from gyre_slurm.train.megatron import convert
        from gyre_slurm.train.wsync.endpoint import Endpoint

        torch.set_num_threads(1)
        self.args, self.model_dir = args, Path(args["model_dir"])
        self.shape = convert.ModelShape.from_model_dir(self.model_dir)
        self.endpoint = Endpoint()
        if args["role"] == "rank":
            tp, pp = args["rank"] % args["tp"], args["rank"] // args["tp"]
            self.coord = (tp, pp)
            hf = _stage_state(self.model_dir, self.shape, pp, args["pp"])
            self.local = convert.hf_to_megatron_shard(hf, self.shape, tp_rank=tp,
                                                      tp_size=args["tp"], pp_rank=pp,
                                                      pp_size=args["pp"])
            del hf
        else:
            from safetensors.torch import load_file

            self.state = load_file(str(self.model_dir / "model.safetensors"))

    def join(self, op: dict) -> dict:
        from gyre_slurm.train.dist import WorldSpec, join_world

        a = self.args
        if a["role"] == "rank":
            join_world(WorldSpec(1, a["tp"] * a["pp"], HOST, a["store_port"]), a["rank"])
        self.endpoint.join(op["transfer"], rank=a["rank"], host=HOST)
        return {}

    def export(self, op: dict) -> dict:
        from gyre_slurm.models import tiny
        from gyre_slurm.train.megatron.convert import gather_hf_state

        a, (tp, pp) = self.args, self.coord
        full = gather_hf_state(self.local, self.shape, tp_rank=tp, tp_size=a["tp"],
                               pp_rank=pp, pp_size=a["pp"], dp_rank=0, rank=a["rank"],
                               world_size=a["tp"] * a["pp"])
        if full is not None:
            tiny.save_state(full, Path(op["dir"]))
        return {}

    def load(self, op: dict) -> dict:
        import torch
        from safetensors.torch import load_file

        new = load_file(str(Path(op["dir"]) / "model.safetensors"))
        with torch.no_grad():
            for name, t in new.items():
                self.state[name].copy_(t)
        return {}

    def send(self, op: dict) -> dict:
        from gyre_slurm.train.megatron import convert
        from gyre_slurm.train.wsync import stream

        a = self.args
        group, plan = self.endpoint.check(op["generation"])
        held = convert.megatron_shard_to_hf_pieces(self.local, self.shape, tp_size=a["tp"],
                                                   pp_rank=self.coord[1], pp_size=a["pp"],
                                                   lazy=True)
        out = stream.send(group, plan, held, targets=op["targets"])
        return {"peak_growth_bytes": out["peak_growth_bytes"]}

    def receive(self, op: dict) -> dict:
        import torch

        from gyre_slurm.train.wsync import stream

        group, plan = self.endpoint.check(op["generation"])

        def load(pairs):
            with torch.no_grad():
                for name, t in pairs:
                    self.state[name].copy_(t)

        return {"peak_growth_bytes": stream.receive(group, plan, load=load)["peak_growth_bytes"]}


def _trim() -> None:
    """Give the memory freed by the previous publish back to the OS (glibc keeps it
    otherwise, and a later publish reusing it would not show as growth)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def member_main(path: str) -> None:
    from gyre_slurm.train.wsync.stream import peak_rss_growth, peak_rss_reset

    member = Member(json.loads(Path(path).read_text()))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)
        _trim()
        baseline = peak_rss_reset()
        t0 = time.perf_counter()
        out = getattr(member, op["op"])(op)
        out.setdefault("peak_growth_bytes", peak_rss_growth(baseline))
        print(json.dumps({**out, "seconds": time.perf_counter() - t0}), flush=True)


# ---- the driver ----------------------------------------------------------------------------

class Members:
    def __init__(self, tmp: Path, model_dir: Path, *, tp: int, pp: int, receivers: int,
                 store_port: int):
        self.ranks = tp * pp
        self.procs = []
        for i in range(self.ranks + receivers):
            args = {"role": "rank" if i < self.ranks else "server", "rank": i, "tp": tp,
                    "pp": pp, "model_dir": str(model_dir), "store_port": store_port}
            path = tmp / f"member-{i}.json"
            path.write_text(json.dumps(args))
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--member", str(path)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, cwd=ROOT))
        self.read(range(len(self.procs)))

    def ask(self, ops: dict[int, dict]) -> None:
        for i, op in ops.items():
            self.procs[i].stdin.write(json.dumps(op) + "\n")
            self.procs[i].stdin.flush()

    def read(self, who) -> dict[int, dict]:
        out = {}
        for i in who:
            line = self.procs[i].stdout.readline()
            if not line:
                raise RuntimeError(f"member {i} exited with {self.procs[i].wait()}")
            out[i] = json.loads(line)
        return out

    def call(self, ops: dict[int, dict]) -> dict[int, dict]:
        self.ask(ops)
        return self.read(ops)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            p.wait(60)


def bench_size(name: str, args, tmp: Path) -> dict:
    from gyre_slurm.models import tiny
    from gyre_slurm.train.dist import announce_transfer_generation, host_store
    from gyre_slurm.train.wsync import plan as planlib

    hidden, layers, heads = SIZES[name]
    model_dir = tiny.make_model_dir(tmp / name, hidden_size=hidden, num_layers=layers,
                                    num_heads=heads, max_positions=512)
    model = tiny.new_model(model_dir, seed=0)
    params = sum(p.numel() for p in model.parameters())
    tiny.save_weights_into(model, model_dir)
    del model
    layout = planlib.TrainerLayout("megatron", args.tp * args.pp, tp=args.tp, pp=args.pp)
    plan = planlib.build_plan(model_dir, layout, bucket_bytes=int(args.bucket_mb * MB))
    store, port = host_store(HOST)
    announce_transfer_generation(store, 1)
    n = layout.world_size + args.receivers
    members = Members(tmp, model_dir, tp=args.tp, pp=args.pp, receivers=args.receivers,
                      store_port=port)
    ranks, servers = range(layout.world_size), range(layout.world_size, n)
    transfer = {"generation": 1, "world_size": n, "store_host": HOST, "store_port": port,
                "timeout_s": 600, "plan": plan.to_json()}
    members.call({i: {"op": "join", "transfer": transfer} for i in range(n)})
    runs = {"file": [], "stream": []}
    try:
        for r in range(args.repeats):
            members.ask({i: {"op": "receive", "generation": 1} for i in servers})
            members.ask({i: {"op": "send", "generation": 1, "targets": list(servers)}
                         for i in ranks})
            res = members.read(range(n))
            runs["stream"].append({**res, "seconds": max(v["seconds"] for v in res.values())})
            out = tmp / f"{name}-v{r}"
            exp = members.call({i: {"op": "export", "dir": str(out)} for i in ranks})
            got = members.call({i: {"op": "load", "dir": str(out)} for i in servers})
            runs["file"].append({**{i: v for i, v in exp.items()}, **got,
                                 "seconds": max(v["seconds"] for v in exp.values())
                                 + max(v["seconds"] for v in got.values())})
            shutil.rmtree(out, ignore_errors=True)
    finally:
        members.close()
        del store
    return {"size": name, "params": params, "model_bytes": plan.model_bytes,
            "bucket_bytes": plan.bucket_bytes, "buckets": len(plan.buckets),
            "members": n, "ranks": layout.world_size, "runs": runs}


def summary(res: dict) -> list[str]:
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in res["runs"].items()}
    lines = [f"{res['size']}: {res['params'] / 1e6:.0f} M parameters, model "
             f"{res['model_bytes'] / MB:.0f} MB, bucket {res['bucket_bytes'] / MB:.0f} MB "
             f"({res['buckets']} buckets); publish: file {med['file']:.2f} s, stream "
             f"{med['stream']:.2f} s (file / stream = {med['file'] / med['stream']:.1f}x)"]
    for path, runs in res["runs"].items():
        growth = [statistics.median(x[i]["peak_growth_bytes"] for x in runs) / MB
                  for i in range(res["members"])]
        ranks = " ".join(f"{g:.0f}" for g in growth[:res["ranks"]])
        servers = " ".join(f"{g:.0f}" for g in growth[res["ranks"]:])
        lines.append(f"  {path:6s} peak memory growth, MB: ranks [{ranks}] servers "
                     f"[{servers}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,large")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--receivers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--member", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.member:
        member_main(args.member)
        return 0
    results = []
    for name in args.sizes.split(","):
        if name not in SIZES:
            p.error(f"--sizes: {name!r} is not one of {', '.join(SIZES)}")
        with tempfile.TemporaryDirectory(prefix="bench-wsync-") as tmp:
            results.append(bench_size(name, args, Path(tmp)))
        print("\n".join(summary(results[-1])), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
