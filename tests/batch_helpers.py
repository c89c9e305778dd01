"""Test helper: random micro-batches of trajectories (DESIGN §4 shape) for trainer tests."""

from __future__ import annotations

import numpy as np


def micro_batch(seed: int, n: int, vocab: int) -> list[dict]:
    """`n` trajectories of 6-13 tokens: the first 3 untrained, ~80% of the rest trained,
    logprobs near uniform, a random advantage each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(6, 14))
        mask = [0] * 3 + [int(x) for x in rng.random(length - 3) < 0.8]
        out.append({"run_id": f"s{seed}-{i}", "token_ids": rng.integers(0, vocab, length).tolist(),
                    "loss_mask": mask,
                    "logprobs": [float(-np.log(vocab) + rng.normal(scale=0.3)) if m else 0.0
                                 for m in mask],
                    "advantage": float(rng.normal())})
    return out


def n_tokens(*mbs) -> int:
    """Trained tokens in these micro-batches."""
    return sum(sum(t["loss_mask"]) for mb in mbs for t in mb)
