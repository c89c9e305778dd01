"""Make a tiny model directory (config, tokenizer, random weights), nothing downloaded.

    tools/gyre-env python tools/make_tiny_model.py OUT_DIR [--family llama|qwen2]
        [--hidden 64] [--layers 2] [--heads 4] [--kv-heads 4] [--vocab 512] [--seed 0]

OUT_DIR is a Hugging Face model directory that vLLM, transformers and gyre's trainers
load: config.json (a small Llama or Qwen2), a byte-level BPE tokenizer trained here with
a chat template, and model.safetensors (random weights for the seed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gyre_slurm.models import tiny  # noqa: E402


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
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = tiny.make_model_dir(args.out_dir, vocab_size=args.vocab, hidden_size=args.hidden,
                              num_layers=args.layers, num_heads=args.heads,
                              num_kv_heads=args.kv_heads, max_positions=args.max_positions,
                              family=args.family)
    model = tiny.new_model(out, seed=args.seed)
    tiny.save_weights_into(model, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: {args.family}, {n:,} parameters, made in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
