"""What one rank measures on one micro-batch, besides the loss: sums over its trained
tokens, so that micro-batches and ranks combine exactly (`gyre_slurm.train.metrics.merge`:
sums add, `*_max` take the max) and the step's means are computed once, at the end.

Per trained token t, with d_t = logπ_t - logμ_t (trainer minus sampler logprob, both
of the token actually sampled; the trainer at the weights being trained):

    mismatch_abs_sum   Σ |d_t|            mismatch_abs_max   max |d_t|
    mismatch_k1_sum    Σ -d_t             (k1: unbiased, noisy estimate of KL(μ ‖ π))
    mismatch_k3_sum    Σ exp(d_t) - 1 - d_t
                       (k3, Schulman's "Approximating KL divergence": ≥ 0, unbiased
                       for KL(μ ‖ π) since tokens are drawn from μ; verl's k3_kl)
    entropy_sum        Σ H_t, the entropy of the trainer's distribution at t
    by_lag[L]          tokens, mismatch_abs_sum/_max, mismatch_k3_sum of the tokens
                       whose policy lag is L: trainer version - version that sampled it

plus the loss's own sums (`train.loss.policy_loss_tokens`: tokens, loss_sum, ratio_sum,
weight_sum, clipped, truncated, dropped). Lags are JSON object keys (strings).
"""

from __future__ import annotations

from typing import Any

import torch

from gyre_slurm.train.loss import LOG_RATIO_LIMIT

LOSS_KEYS = ("tokens", "loss_sum", "ratio_sum", "weight_sum", "clipped", "truncated",
             "dropped")


def _mismatch(d: torch.Tensor) -> dict[str, float]:
    d = d.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return {"mismatch_abs_sum": float(d.abs().sum()),
            "mismatch_abs_max": float(d.abs().max()) if d.numel() else 0.0,
            "mismatch_k3_sum": float((torch.expm1(d) - d).sum())}


@torch.no_grad()
def microbatch_signals(*, logp: torch.Tensor, old_logprobs: torch.Tensor,
                       loss_mask: torch.Tensor, lags: torch.Tensor, entropy: torch.Tensor,
                       loss_stats: dict[str, Any]) -> dict[str, Any]:
    """The micro-batch's sums (module doc). Tensors share one shape; `lags` is the policy
    lag of each trained token (ignored elsewhere), `entropy` as `loss.token_entropy`."""
    mask = loss_mask.bool()
    d = (logp.detach().double() - old_logprobs.double())[mask]
    lag = lags[mask].long()
    out: dict[str, Any] = {k: loss_stats.get(k, 0) for k in LOSS_KEYS}
    out.update(_mismatch(d), mismatch_k1_sum=float(-d.sum()),
               entropy_sum=float(entropy.double()[mask].sum()))
    by_lag = {}
    for value in torch.unique(lag).tolist():
        of = lag == value
        by_lag[str(int(value))] = {"tokens": int(of.sum()), **_mismatch(d[of])}
    out["by_lag"] = by_lag
    return out


def rows_lags(versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Policy lag per token of rows: trainer version - the version that sampled it
    (versions -1 where untrained; those lags are meaningless and never read)."""
    return trainer_version - versions


def loss_and_signals(logits: torch.Tensor, rows: dict[str, torch.Tensor], *,
                     settings, num_step_tokens: int,
                     trainer_version: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """A micro-batch's loss (`settings`: a `loss.LossSettings`) from the logits of its
    rows (`loss.rows_from_trajectories`), and its signals (module doc), both trainers'
    one path. `trainer_version`: the policy version of the weights being trained."""
    from gyre_slurm.train.loss import policy_loss_tokens, token_entropy, token_logprobs

    mask = rows["loss_mask"].bool()
    if mask[:, 0].any():
        raise ValueError("the first token of a sequence has no prediction: loss_mask must be 0")
    logp = token_logprobs(logits, rows["token_ids"])
    loss, stats = policy_loss_tokens(logp, rows["logprobs"], rows["advantages"], mask,
                                     num_step_tokens=num_step_tokens, settings=settings)
    signals = microbatch_signals(
        logp=logp, old_logprobs=rows["logprobs"], loss_mask=mask,
        lags=rows_lags(rows["versions"], trainer_version),
        entropy=token_entropy(logits, mask), loss_stats=stats)
    return loss, signals
