"""`gyre memory MODEL --world N [--tp --pp --ep --precision --distributed-optimizer
--microbatch-tokens --ranks-per-node --rollout-tp --gpu-gib]`: the memory each role needs,
per rank and per node, for a model (a Hugging Face model dir or its config.json) and a
training layout (gyre_slurm.models.memory; docs/models.md). Without --ep an MoE model
gets one row per expert-parallel size the world allows (`expert_parallel_sizes`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.common.yamltext import read_text
from gyre_slurm.errors import UserError

GIB = 1 << 30
MAX_GPU_GIB = 1 << 20  # a GiB count beyond any device (a typo, or not a number)


def register(subparsers) -> None:
    m = subparsers.add_parser("memory", help="memory per rank and node for a model and "
                                             "layout (training and rollout)")
    m.add_argument("model", type=Path, help="a Hugging Face model dir, or its config.json")
    m.add_argument("--world", type=int, default=8, help="training ranks (GPUs) in the world")
    m.add_argument("--tp", type=int, default=1, help="tensor parallel")
    m.add_argument("--pp", type=int, default=1, help="pipeline parallel")
    m.add_argument("--ep", type=int, default=None,
                   help="expert parallel (MoE; default: every size the world allows)")
    m.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    m.add_argument("--distributed-optimizer", choices=("true", "false"), default="true",
                   help="shard the optimizer state over the data-parallel ranks")
    m.add_argument("--microbatch-tokens", type=int, default=4096,
                   help="tokens of one micro-batch (activations)")
    m.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node")
    m.add_argument("--rollout-tp", type=int, default=None,
                   help="GPUs per vLLM server (default: --tp)")
    m.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    m.set_defaults(func=memory)


def _shape(path: Path):
    from gyre_slurm.models.shape import ModelShape

    try:
        if path.is_file():
            try:
                config = loads_json(read_text(path, what=str(path)))
            except ValueError as exc:
                raise ValueError(f"{path}: not a model's config.json (not JSON: {exc}); "
                                 "give a Hugging Face model directory or its config.json") \
                    from None
            return ModelShape.from_config(config, source=str(path))
        return ModelShape.from_model_dir(path)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def rows(shape, args) -> list[tuple[str, dict[str, int]]]:
    """(layout label, bytes of the busiest rank) for each layout asked for."""
    from gyre_slurm.models.memory import TrainLayout, expert_parallel_sizes, train_rank_bytes

    if args.ep is not None:
        eps = [args.ep]
    elif shape.is_moe:
        eps = expert_parallel_sizes(args.world, num_experts=shape.num_experts, tp=args.tp,
                                    pp=args.pp)
    else:
        eps = [1]
    if not eps:
        raise UserError(f"a world of {args.world} ranks holds no TP {args.tp} x PP {args.pp} "
                        f"replicas: --world must be a multiple of --tp x --pp")
    out = []
    for ep in eps:
        lay = TrainLayout(world_size=args.world, tp=args.tp, pp=args.pp, ep=ep,
                          precision=args.precision,
                          distributed_optimizer=args.distributed_optimizer == "true",
                          microbatch_tokens=args.microbatch_tokens)
        try:
            out.append((f"TP{args.tp} PP{args.pp} EP{ep} DP{lay.dp}",
                        train_rank_bytes(shape, lay)))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    return out


def memory(args: argparse.Namespace) -> int:
    from gyre_slurm.models.memory import rollout_gpu_bytes

    for name in ("world", "tp", "pp", "ranks_per_node", "microbatch_tokens", "ep",
                 "rollout_tp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.gpu_gib <= MAX_GPU_GIB:  # also NaN
        raise UserError(f"--gpu-gib must be a GPU's memory in GiB, in (0, {MAX_GPU_GIB}], "
                        f"not {args.gpu_gib}")
    shape = _shape(args.model)
    layouts = rows(shape, args)  # a layout the model cannot take fails before any output
    n = shape.num_params()
    print(f"{shape.family}: {n['total'] / 1e9:.2f}B parameters ({n['expert'] / 1e9:.2f}B in "
          f"experts), {shape.num_layers} layers, hidden {shape.hidden_size}")
    print(f"training, {args.world} ranks, {args.precision}, distributed optimizer "
          f"{args.distributed_optimizer}, {args.microbatch_tokens} tokens a micro-batch "
          "(GiB, the busiest rank):")
    cols = ("weights", "grads", "optimizer", "activations", "logits", "total")
    print(f"  {'layout':<22}{'params':>9}" + "".join(f"{c:>12}" for c in cols)
          + f"{'per node':>11}")
    per_node = min(args.ranks_per_node, args.world)
    for label, b in layouts:
        print(f"  {label:<22}{b['params'] / 1e9:>8.2f}B"
              + "".join(f"{b[c] / GIB:>12.2f}" for c in cols)
              + f"{per_node * b['total'] / GIB:>11.1f}")
    tp = args.rollout_tp or args.tp
    r = rollout_gpu_bytes(shape, tp=tp, gpu_bytes=int(args.gpu_gib * GIB))
    print(f"rollout (vLLM, bf16, TP {tp}) per GPU: weights {r['weights'] / GIB:.2f} GiB, "
          f"KV cache {r['kv_per_token'] / 1024:.1f} KiB a token, {r['kv_tokens']:,} tokens "
          f"fit in 90% of {args.gpu_gib:g} GiB")
    if r["kv_tokens"] == 0:
        print(f"  the weights do not fit: raise --rollout-tp above {tp}")
    return 0
