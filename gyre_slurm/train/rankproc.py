"""A training rank as a process of its own, driven over its stdin and stdout.

    PYTHON -m gyre_slurm.train.rankproc --backend torch|megatron --model-dir DIR \
        --node-index I --local-rank L [--lr --seed --grad-clip --tp --pp --ep
        --precision fp32|bf16 --distributed-optimizer true|false --loss JSON]

The node agent starts one per training rank of its node, whatever the trainer (a rank
blocked in a collective can be killed at once; Megatron-core needs another Python, 3.12
with its own torch build; several ranks per node, one per GPU; a container). The
process keeps its worker (`TrainerWorker` or `MegatronWorker`: one API) for the whole
job, so a handoff rebuilds process groups without starting Python again.

Protocol: one JSON object per line. Request `{"id": N, "method": NAME, "args": {...}}`;
answer `{"id": N, "result": {...}}` or `{"id": N, "error": "Type: message",
"traceback": "..."}`. Methods run one at a time in arrival order (collectives must be
issued in the same order on every rank). The node agent's methods: join (args: spec
{generation, world_size, store_host, store_port, backend}, rank, src_rank,
init_weights, checkpoint), flush, leave, train_mb (args: path of a micro-batch file
(`gyre_slurm.traj.mbfile`), num_step_tokens, packing), step (publish_dir, num_step_tokens), save (path), digests,
ping; any other name calls the worker's method of that name with `args` as keyword
arguments (a `spec` dict becomes a WorldSpec, `path`, `init_weights`, `checkpoint`,
`publish_dir` become paths): the tests drive `eval_loss`, `token_logprobs`, ... so. stdout carries only answers (anything else printed
goes to stderr, the rank's log). The process exits at EOF on stdin, and when its
parent (the node agent) dies, even while blocked in a collective.

Failpoint (for fault-injection tests; off unless set): `GYRE_FAILPOINT=METHOD:NODE:N`
makes node NODE's rank stop itself (SIGSTOP, as a hung process) just before its N-th
request of METHOD, so a test can kill its node at exactly that moment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

log = logging.getLogger(__name__)


def make_worker(args):
    loss = json.loads(args.loss) if args.loss else None
    if args.backend == "megatron":
        from gyre_slurm.train.megatron.worker import MegatronWorker

        return MegatronWorker(model_dir=args.model_dir, node_index=args.node_index,
                              lr=args.lr, seed=args.seed, grad_clip=args.grad_clip,
                              tensor_parallel=args.tp, pipeline_parallel=args.pp,
                              expert_parallel=args.ep, precision=args.precision,
                              distributed_optimizer=args.distributed_optimizer, loss=loss)
    from gyre_slurm.train.worker import TrainerWorker

    return TrainerWorker(model_dir=args.model_dir, node_index=args.node_index, lr=args.lr,
                         seed=args.seed, grad_clip=args.grad_clip, loss=loss)


PATH_ARGS = ("path", "init_weights", "checkpoint", "publish_dir")


def _path(value):
    return None if value is None else Path(value)


def _decode(args: dict) -> dict:
    from gyre_slurm.train.dist import WorldSpec

    out = dict(args)
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


def dispatch(worker, method: str, a: dict):
    if method == "ping":
        return {"pid": os.getpid()}
    if method == "join":
        kw = _decode(a)
        times = worker.join(kw.pop("spec"), int(kw.pop("rank")), **kw)
        return {**times, "version": worker.version}
    if method == "flush":
        worker.flush(keep_rank=int(a.get("keep_rank", 0)))
        return {}
    if method == "leave":
        return worker.leave() or {}
    if method == "train_mb":
        from gyre_slurm.traj import mbfile

        mb = mbfile.read(Path(a["path"]))
        return worker.train_microbatch(mb, num_step_tokens=a["num_step_tokens"],
                                       packing=a.get("packing", "tree"))
    if method == "step":
        return worker.optimizer_step(publish_dir=_path(a.get("publish_dir")),
                                     num_step_tokens=a.get("num_step_tokens"))
    if method == "save":  # `writer`: the world rank that writes a replicated state
        extra = {"writer": int(a["writer"])} if a.get("writer") is not None else {}
        worker.save_checkpoint(Path(a["path"]), **extra)
        return {}
    if method == "digests":
        return worker.digests()
    if method.startswith("_") or not callable(getattr(worker, method, None)):
        raise ValueError(f"unknown method {method!r}")
    return _encode(getattr(worker, method)(**_decode(a)))


FAILPOINT_ENV = "GYRE_FAILPOINT"


class Failpoint:
    def __init__(self, method: str, count: int):
        self.method, self.count, self.seen = method, count, 0

    def before(self, method: str) -> None:
        if method != self.method:
            return
        self.seen += 1
        if self.seen == self.count:
            log.warning("failpoint %s:%d reached: stopping this rank (SIGSTOP)",
                        self.method, self.count)
            os.kill(os.getpid(), signal.SIGSTOP)


def parse_failpoint(value: str, node_index: int) -> Failpoint | None:
    """`METHOD:NODE:N` -> a Failpoint for this rank (None: unset, or another node's)."""
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit() \
            or int(parts[2]) < 1:
        raise ValueError(f"{FAILPOINT_ENV}={value!r}: expected METHOD:NODE:N, e.g. save:1:2 "
                         f"(node 1's rank stops before its 2nd save)")
    return Failpoint(parts[0], int(parts[2])) if int(parts[1]) == node_index else None


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            log.error("the node agent (pid %d) is gone: exiting", parent)
            os._exit(3)
        time.sleep(1.0)


def warm_up(worker) -> None:
    """The worker's first-use costs, paid before the first request is read (requests
    sent meanwhile wait in stdin, as they would behind a cold first build). A worker
    without `warm` (Megatron: its modules load at import, before `ready`) skips it; a
    failed warm-up is logged and the first join builds from cold, as before."""
    warm = getattr(worker, "warm", None)
    if warm is None:
        return
    try:
        log.info("warmed up in %.2f s (the first build's one-time costs)", warm())
    except Exception:  # noqa: BLE001 - only a cost moved earlier; the join still builds
        log.exception("warm-up failed: the first join builds from cold")


def _flag(value: str) -> bool:
    """A true/false argument as the agent writes it (`str(bool).lower()`)."""
    return value.lower() in ("1", "true", "yes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one gyre training rank")
    p.add_argument("--backend", choices=("torch", "megatron"), required=True)
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--node-index", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--tp", "--tensor-parallel", dest="tp", type=int, default=1)
    p.add_argument("--pp", "--pipeline-parallel", dest="pp", type=int, default=1)
    p.add_argument("--ep", "--expert-parallel", dest="ep", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--distributed-optimizer", type=_flag, default=False,
                   help="true: Megatron's distributed optimizer (megatron)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads")
    p.add_argument("--warm-up", type=_flag, default=True,
                   help="pay the first build's one-time costs now (trainer.warm_up), not at "
                        "the first join")
    p.add_argument("--loss", default=None, help="the loss and its settings, JSON "
                   "(gyre_slurm.train.loss.LossSettings; default ppo_clip)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=(
        f"%(asctime)s node{args.node_index}.{args.local_rank} %(levelname)s %(name)s: "
        "%(message)s"))
    # stdout is the answer channel: keep it, and send every other print to the log.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    failpoint = parse_failpoint(os.environ.get(FAILPOINT_ENV, ""), args.node_index)
    worker = make_worker(args)
    answers.write(json.dumps({"id": 0, "result": {"ready": True, "pid": os.getpid()}}) + "\n")
    if args.warm_up:
        warm_up(worker)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            rid = req.get("id")
            if failpoint is not None:
                failpoint.before(req["method"])
            result = dispatch(worker, req["method"], req.get("args") or {})
            answer = {"id": rid, "result": result}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the agent
            log.exception("request failed")
            answer = {"id": locals().get("rid"), "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        answers.write(json.dumps(answer, default=float) + "\n")
    log.info("stdin closed: exiting")
    return 0


if __name__ == "__main__":
    from gyre_slurm.common.fastexit import exit_now

    exit_now(main())
