"""Token-level clipped policy-gradient loss (GRPO-style, PPO clip).

For every trained token t of a trajectory (loss_mask[t] = 1):

    logp_new[t] = log_softmax(logits[t-1])[token_ids[t]]        (temperature 1)
    r[t]        = exp(clamp(logp_new[t] - logp_old[t], -20, 20))
    L[t]        = -min(r[t] * A, clip(r[t], 1 - eps_low, 1 + eps_high) * A)

where logp_old[t] is the sampling logprob recorded with the call and A the trajectory's
advantage. The loss of one micro-batch on one rank is

    loss = sum over its trained tokens of L[t] / N_step

with N_step = the number of trained tokens in the WHOLE optimizer step (global batch:
all ranks, all micro-batches). Gradients of micro-batches and ranks therefore simply add
up (sum all-reduce, no averaging) to the gradient of the step's token mean. Tokens with
loss_mask 0 contribute nothing, to the loss or to the gradient; the first token of a
sequence has no prediction and must have loss_mask 0. The log-ratio clamp (±20) only
guards exp against overflow.

Input layout: rows of equal length (right-padded; padding has loss_mask 0), logits
[B, T, V], the rest [B, T]; `rows_from_trajectories` builds them from trajectory dicts
(DESIGN §4) and `rows_from_packed` from a `gyre_slurm.traj.pack.MicroBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

LOG_RATIO_LIMIT = 20.0


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] logprob of token t under logits at t-1; position 0 is 0.0."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    shifted = logits[:, :-1].to(dtype)
    target = token_ids[:, 1:].long().unsqueeze(-1)
    picked = shifted.gather(-1, target).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


def policy_loss(logits: torch.Tensor, token_ids: torch.Tensor, loss_mask: torch.Tensor,
                old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                num_step_tokens: int, eps_low: float = 0.2,
                eps_high: float = 0.2) -> tuple[torch.Tensor, dict[str, float]]:
    """The step-normalised clipped loss of one micro-batch (see the module docstring).

    `advantages` is per token [B, T] or per row [B]. Returns (loss, stats) with stats
    {"tokens", "loss_sum" (sum of L[t]), "ratio_sum", "clipped" (tokens whose clipped
    branch is active, i.e. with zero gradient)}."""
    if num_step_tokens < 1:
        raise ValueError("num_step_tokens must be >= 1")
    mask = loss_mask.bool()
    if mask[:, 0].any():
        raise ValueError("the first token of a sequence has no prediction: loss_mask must be 0")
    logp = token_logprobs(logits, token_ids)
    dtype = logp.dtype
    adv = advantages.to(dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logp)
    log_ratio = torch.where(mask, logp - old_logprobs.to(dtype), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = torch.where(mask, -torch.minimum(unclipped, clipped), torch.zeros_like(logp))
    loss = per_token.sum() / num_step_tokens
    with torch.no_grad():
        clip_active = mask & (clipped < unclipped)
        stats = {"tokens": int(mask.sum()), "loss_sum": float(per_token.sum()),
                 "ratio_sum": float(ratio[mask].sum()), "clipped": int(clip_active.sum())}
    return loss, stats


def _rows(seqs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, float]], pad_id: int,
          device: torch.device | str) -> dict[str, torch.Tensor]:
    width = max(len(s[0]) for s in seqs)
    out = {"token_ids": np.full((len(seqs), width), pad_id, dtype=np.int64),
           "loss_mask": np.zeros((len(seqs), width), dtype=np.uint8),
           "logprobs": np.zeros((len(seqs), width), dtype=np.float32)}
    for i, (ids, mask, logp, _) in enumerate(seqs):
        out["token_ids"][i, :len(ids)] = ids
        out["loss_mask"][i, :len(ids)] = mask
        out["logprobs"][i, :len(ids)] = logp
    rows = {k: torch.from_numpy(v).to(device) for k, v in out.items()}
    rows["advantages"] = torch.tensor([s[3] for s in seqs], dtype=torch.float32, device=device)
    return rows


def rows_from_trajectories(trajs: Sequence[dict[str, Any]], *, pad_id: int = 0,
                           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded rows from DESIGN §4 trajectory dicts: token_ids, loss_mask, logprobs
    [B, T] and advantages [B]."""
    if not trajs:
        raise ValueError("no trajectories")
    seqs = []
    for t in trajs:
        ids = np.asarray(t["token_ids"], dtype=np.int64)
        mask = np.asarray(t["loss_mask"], dtype=np.uint8)
        logp = np.asarray(t["logprobs"], dtype=np.float32)
        if not len(ids) == len(mask) == len(logp):
            raise ValueError(f"run {t.get('run_id')!r}: token_ids, loss_mask and logprobs "
                             "differ in length")
        seqs.append((ids, mask, logp, float(t["advantage"])))
    return _rows(seqs, pad_id, device)


def rows_from_packed(mb, *, pad_id: int = 0,
                     device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded rows from a packed `MicroBatch` (one row per trajectory)."""
    cu = [int(x) for x in mb.cu_seqlens]
    seqs = [(mb.token_ids[a:b], mb.loss_mask[a:b], mb.logprobs[a:b], float(mb.advantages[a]))
            for a, b in zip(cu[:-1], cu[1:])]
    return _rows(seqs, pad_id, device)
