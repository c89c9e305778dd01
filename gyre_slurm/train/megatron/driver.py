"""A `MegatronWorker` driven by JSON lines: the way a process of another Python (the
core environment's tests, a local launcher) talks to the Megatron environment.

    python -m gyre_slurm.train.megatron.driver --model-dir DIR --node-index I \\
        [--lr F] [--seed N] [--grad-clip F] [--tensor-parallel N] [--pipeline-parallel N]

Protocol: the parent writes one JSON object per line on stdin, `{"method": NAME,
"kwargs": {...}}`; the driver answers one line on stdout, `{"ok": RESULT}` or
`{"error": TRACEBACK}`. A `spec` argument is a `WorldSpec` as a dict; arguments named
`path`, `init_weights`, `checkpoint`, `publish_dir` become `Path`s. The first line
written is `{"ready": PID}`; end of input ends the process. Everything else the
process prints goes to stderr (stdout is the answer channel only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

PATH_ARGS = ("path", "init_weights", "checkpoint", "publish_dir")


def _decode(kwargs: dict) -> dict:
    from gyre_slurm.train.dist import WorldSpec

    out = dict(kwargs)
    if isinstance(out.get("spec"), dict):
        out["spec"] = WorldSpec(**out["spec"])
    for key in PATH_ARGS:
        if out.get(key) is not None:
            out[key] = Path(out[key])
    return out


def _encode(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--node-index", required=True, type=int)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--pipeline-parallel", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr

    import torch

    from gyre_slurm.train.megatron.worker import MegatronWorker

    torch.set_num_threads(args.num_threads)
    worker = MegatronWorker(model_dir=args.model_dir, node_index=args.node_index, lr=args.lr,
                            seed=args.seed, grad_clip=args.grad_clip,
                            tensor_parallel=args.tensor_parallel,
                            pipeline_parallel=args.pipeline_parallel)
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            result = getattr(worker, msg["method"])(**_decode(msg.get("kwargs") or {}))
            reply = {"ok": _encode(result)}
        except Exception:  # noqa: BLE001 - the parent re-raises it
            reply = {"error": traceback.format_exc()}
        answers.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
