"""Members of a weight-transfer group as processes of their own, for tests/test_wsync.py.

    python tests/wsync_procs.py ARGS.json

ARGS: {"role": "send" | "recv" | "hold", "model_dir", "weights" (send, recv), "plan"
(Plan.to_json()), "transfer" (the init_info without rank), "rank", "rounds":
[{"generation", "targets"}] (send) or a number of rounds (recv), "fault": null |
{"at_bucket": k, "how": "die" | "stop"}}.

`weights`: a safetensors file of a tiny model's state dict, which the test writes once
(so that no member imports transformers and builds the model: seconds of CPU each). A
sender holds the shard of its (tp, pp) coordinate of that model, cut by
gyre_slurm.train.megatron.convert as a Megatron rank holds it (or the whole model for a
replicated layout). A receiver compares every received tensor with the same state. One
JSON line of results goes to stdout.
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

from gyre_slurm.train.megatron import convert  # noqa: E402
from gyre_slurm.train.wsync import plan as planlib  # noqa: E402
from gyre_slurm.train.wsync import stream  # noqa: E402
from gyre_slurm.train.wsync.endpoint import Endpoint  # noqa: E402


def coord_of(layout: planlib.TrainerLayout, rank: int) -> tuple[int, int]:
    tp = rank % layout.tp
    pp = rank // (layout.tp * layout.dp)
    return tp, pp


def held_pieces(model_dir, hf, layout, rank):
    if layout.kind == "replicated":
        return {k: (v, None) for k, v in hf.items()}
    tp, pp = coord_of(layout, rank)
    shape = convert.ModelShape.from_model_dir(model_dir)
    shard = convert.hf_to_megatron_shard(hf, shape, tp_rank=tp, tp_size=layout.tp,
                                         pp_rank=pp, pp_size=layout.pp)
    return convert.megatron_shard_to_hf_pieces(shard, shape, tp_size=layout.tp, pp_rank=pp,
                                               pp_size=layout.pp, lazy=True)  # as trainers


def main() -> None:
    args = json.loads(Path(sys.argv[1]).read_text())
    hf = load_file(args["weights"]) if args["role"] != "hold" else {}
    ep = Endpoint()
    ep.join({**args["transfer"], "plan": args["plan"]}, rank=args["rank"], host="127.0.0.1")
    out = {"rank": args["rank"]}
    if args["role"] == "hold":  # a member that only stands there until stdin closes
        print(json.dumps({**out, "generation": ep.generation}), flush=True)
        sys.stdin.read()
    elif args["role"] == "send":
        layout = ep.plan.layout
        held = held_pieces(args["model_dir"], hf, layout, args["rank"])
        out["rounds"] = []
        for r in args["rounds"]:
            try:
                group, plan = ep.check(r["generation"])
                out["rounds"].append(stream.send(group, plan, held, targets=r["targets"]))
            except stream.TransferTimeout as exc:
                out["rounds"].append({"timed_out_target": exc.target})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out["rounds"].append({"error": f"{type(exc).__name__}: {exc}"})
    else:
        fault = args.get("fault") or {}
        seen = {"buckets": 0, "max_diff": 0.0, "names": []}

        def load(pairs):
            if seen["buckets"] == fault.get("at_bucket"):
                if fault["how"] == "die":
                    os._exit(9)
                os.kill(os.getpid(), signal.SIGSTOP)
            seen["buckets"] += 1
            for name, t in pairs:
                seen["names"].append(name)
                diff = (t.float() - hf[name].float()).abs().max().item() if t.numel() else 0.0
                seen["max_diff"] = max(seen["max_diff"], diff)

        out["rounds"] = []
        for r in range(args["rounds"]):
            seen.update(buckets=0, max_diff=0.0, names=[])
            try:
                group, plan = ep.check(args["generation"])
                stats = stream.receive(group, plan, load=load)
                out["rounds"].append({**stats, "max_diff": seen["max_diff"],
                                      "names": sorted(seen["names"])})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out["rounds"].append({"error": f"{type(exc).__name__}: {exc}"})
    ep.leave()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
