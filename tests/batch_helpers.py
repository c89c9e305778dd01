"""Test helper: random micro-batches of trajectories (docs/runtime.md shape) for trainer tests."""

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


def branchy_micro_batch(seed: int, vocab: int, *, runs: int = 3, branches: int = 3) -> list[dict]:
    """`runs` runs of `branches` trajectories each, shaped like a processor's output
    for an agent run with compactions and forks: branch 0 is a prompt (3 untrained
    tokens) and a trained stretch; branch j > 0 leaves an earlier branch at a random
    point and trains only its own new tokens (the shared-prefix rule). One advantage
    per run; logprobs near uniform."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        adv = float(rng.normal())
        paths: list[list[int]] = []
        for j in range(branches):
            if j == 0:
                ids = rng.integers(0, vocab, 3 + int(rng.integers(4, 9))).tolist()
                mask = [0] * 3 + [1] * (len(ids) - 3)
            else:
                base = paths[int(rng.integers(0, j))]
                cut = int(rng.integers(3, len(base)))
                new = rng.integers(0, vocab, int(rng.integers(2, 7))).tolist()
                if cut < len(base) and new[0] == base[cut]:  # really leave the branch
                    new[0] = (new[0] + 1) % vocab
                ids, mask = base[:cut] + new, [0] * cut + [1] * len(new)
            paths.append(ids)
            out.append({"run_id": f"b{seed}-{r}", "token_ids": ids, "loss_mask": mask,
                        "logprobs": [float(-np.log(vocab) + rng.normal(scale=0.3)) if m
                                     else 0.0 for m in mask],
                        "advantage": adv})
    return out
