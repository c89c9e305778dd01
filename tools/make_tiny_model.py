"""Make a tiny model directory (config, tokenizer, random weights), nothing downloaded.

    tools/gyre-env python tools/make_tiny_model.py OUT_DIR [--family llama|qwen2|qwen3|
        qwen3_moe] [--hidden 64] [--layers 2] [--heads 4] [--kv-heads 4] [--vocab 512]
        [--experts 8 --experts-per-token 2] [--shards 1] [--seed 0]

OUT_DIR is a Hugging Face model directory that vLLM, transformers and gyre's trainers
load (and `gyre run` starts from: model.path): config.json (a small model of the
family), a byte-level BPE tokenizer trained here with a chat template, and random
weights for the seed, as model.safetensors or (--shards N) as N shards with their
index, the layout of published checkpoints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.errors import UserError  # noqa: E402
from gyre_slurm.models import tiny  # noqa: E402

MIN_VOCAB = 256 + len(tiny.SPECIAL_TOKENS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--family", choices=tiny.FAMILIES, default="llama")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    p.add_argument("--experts-per-token", type=int, default=2, help="qwen3_moe: top-k")
    p.add_argument("--shards", type=int, default=1, help="weight files (with an index)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "max_positions", "experts",
                 "experts_per_token", "shards"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.vocab < MIN_VOCAB:
        raise UserError(f"--vocab must be >= {MIN_VOCAB} (the byte alphabet and the special "
                        f"tokens)")
    if args.experts_per_token > args.experts:
        raise UserError("--experts-per-token must be <= --experts")
    t0 = time.perf_counter()
    try:
        out = tiny.make_model_dir(args.out_dir, vocab_size=args.vocab, hidden_size=args.hidden,
                                  num_layers=args.layers, num_heads=args.heads,
                                  num_kv_heads=args.kv_heads, max_positions=args.max_positions,
                                  family=args.family, num_experts=args.experts,
                                  experts_per_token=args.experts_per_token)
    except ValueError as exc:  # the sizes do not make a model (heads, head_dim)
        raise UserError(str(exc)) from None
    model = tiny.new_model(out, seed=args.seed)
    tiny.save_weights_into(model, out, shards=args.shards)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {args.family}, {n:,} parameters, made in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    from gyre_slurm.cli import run_tool  # a UserError: one line, exit 2

    run_tool(main)
