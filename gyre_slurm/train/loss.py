"""Policy-gradient losses for off-policy training, chosen by `loss.kind`.

Per trained token t (loss_mask[t] = 1) of sequence i, with sg(.) the stop-gradient:

    logπ_t    the trainer's logprob of token t, under the weights being trained (grad)
    logμ_t    the sampler's recorded logprob (the rollout server, at the policy version
              that served the call: the behaviour policy)
    logπ'_t   the proximal logprob: the trainer's, under the weights at the start of the
              optimizer step (no grad)
    A_t       the advantage (per token, or the sequence's on each of its tokens)
    δ_t       = clamp(logπ_t - logμ_t, -20, 20); ρ_t = exp(δ_t), the trainer/sampler ratio
              (the clamp only guards exp against overflow)
    n_i       trained tokens of sequence i; N = trained tokens of the WHOLE optimizer step

Every variant is a sum of per-token terms ℓ_t normalised by the step's token count,

    loss = Σ_t ℓ_t / N

so gradients of micro-batches and ranks simply add up (sum all-reduce, never averages)
to the gradient of the step's token mean. Tokens with loss_mask 0 contribute nothing
(loss or gradient); the first token of a row has no prediction and must have mask 0.
Tokens a variant drops or clips stay in N.

`ppo_clip` (default): PPO's clip against the sampler (Schulman et al. 2017, arXiv
1707.06347; verl `compute_policy_loss_vanilla` in "bypass mode", old = rollout logprobs):

    ℓ_t = -min(ρ_t A_t, clip(ρ_t, 1 - ε_lo, 1 + ε_hi) A_t)

`tis`: token-level truncated importance sampling of the trainer/sampler ratio, no PPO
clip (Ionides 2008; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; verl `compute_rollout_correction_weights(rollout_is="token")`
with `compute_policy_loss_reinforce`; slime `vanilla_tis_function`):

    w_t = min(sg(ρ_t), C);    ℓ_t = -w_t · exp(logπ_t - sg(logπ_t)) · A_t

  value -w_t A_t, gradient -w_t A_t ∇logπ_t.

`masked_is`: the masked (rejection) variant: instead of truncating, tokens whose ratio
leaves the band [lo, hi] are dropped (verl `rollout_rs` token_k1 / geometric-mean
sequence RS; slime `icepop_function`). Per token, k_t = 1[lo <= sg(ρ_t) <= hi]; per
sequence (`is_mask_level: sequence`), every token of i shares k_i = 1[lo <= ρ_i <= hi]
with the geometric mean ρ_i = exp(Σ_{t∈i} sg(δ_t) / n_i) (a product of hundreds of
ratios would leave any band):

    ℓ_t = -k · sg(ρ_t) · exp(logπ_t - sg(logπ_t)) · A_t

`decoupled`: decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL
`ppo_actor_loss_fn` with `proximal_logprobs`; verl's decoupled mode): the clip is
against the proximal policy, the behaviour correction is a separate truncated weight
(AReaL's `behav_imp_weight_cap` drops the tokens above the cap; here they are truncated):

    r_t = exp(logπ_t - logπ'_t);    w_t = min(exp(logπ'_t - logμ_t), C)
    ℓ_t = -w_t · min(r_t A_t, clip(r_t, 1 - ε_lo, 1 + ε_hi) A_t)

  gyre takes ONE optimizer step per batch: every micro-batch of a step is trained under
  the weights of the step's start, so the proximal logprobs are those of the training
  forward pass itself (`prox_logprobs=None`: sg(logπ); a second forward pass gives the
  same numbers, bit for bit on CPU: tests/test_train_loss_variants.py). Then r_t = 1,
  the clip never acts, and `decoupled` has `tis`'s value and gradient. A trainer that
  updates several times per batch passes the step-start logprobs as `prox_logprobs`.

`gspo`: the sequence-level ratio of GSPO (Zheng et al. 2025, arXiv 2507.18071; verl
`compute_policy_loss_gspo`, its token form), with its own, much smaller clip range:

    s_i = exp(Σ_{t∈i} δ_t / n_i);    s_{i,t} = sg(s_i) · exp(logπ_t - sg(logπ_t))
    ℓ_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - ε^g_lo, 1 + ε^g_hi) A_t)

  GSPO averages per sequence; here, like every variant, Σ/N (micro-batches add up), so
  with a per-sequence advantage this is the gradient of Σ_i n_i ℓ_i(s_i) / N.

API: `policy_loss_tokens` takes per-token tensors of any one shape (right-padded rows
[B, T], or one packed row [N]) plus sequence ids for the sequence-level variants, so
packed layouts compose with it; `policy_loss` is the same from logits [B, T, V] and
token ids of rows. `rows_from_trajectories` / `rows_from_packed` build rows from
trajectory dicts (docs/runtime.md) or a `gyre_slurm.traj.pack.MicroBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

LOG_RATIO_LIMIT = 20.0
LOSS_NAMES = ("ppo_clip", "tis", "masked_is", "decoupled", "gspo")
MASK_LEVELS = ("token", "sequence")


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """Which loss and its constants (the `training.*` keys of the same names)."""

    name: str = "ppo_clip"
    clip_eps_low: float = 0.2  # ε_lo: ppo_clip, decoupled
    clip_eps_high: float = 0.2  # ε_hi
    is_cap: float = 2.0  # C: tis, decoupled
    is_band_low: float = 0.5  # masked_is keeps lo <= ratio <= hi
    is_band_high: float = 2.0
    is_mask_level: str = "token"  # masked_is: "token" or "sequence"
    gspo_clip_eps_low: float = 3e-4  # ε^g_lo (GSPO paper: 3e-4 / 4e-4)
    gspo_clip_eps_high: float = 4e-4

    def __post_init__(self) -> None:
        if self.name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {self.name!r}; use one of {', '.join(LOSS_NAMES)}")
        if self.is_mask_level not in MASK_LEVELS:
            raise ValueError(f"is_mask_level must be token or sequence, got "
                             f"{self.is_mask_level!r}")

    @classmethod
    def from_config(cls, loss: Any) -> LossSettings:
        """From a config's `loss` section (`LossConfig.settings`)."""
        return cls(**loss.settings)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] logprob of token t under logits at t-1; position 0 is 0.0."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    shifted = logits[:, :-1].to(dtype)
    target = token_ids[:, 1:].long().unsqueeze(-1)
    picked = shifted.gather(-1, target).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return torch.nn.functional.pad(picked, (1, 0))


ENTROPY_CHUNK_TOKENS = 2048


@torch.no_grad()
def token_entropy(logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] entropy of the distribution that predicted token t, at trained tokens only
    (0.0 elsewhere): H = logsumexp(z) - Σ_v softmax(z)_v z_v over the full vocabulary
    (with tensor parallelism the logits must be gathered, as the Megatron worker's are).
    Only the trained positions' rows are taken, ENTROPY_CHUNK_TOKENS at a time, in
    float32 (float64 logits stay float64): the extra memory is [chunk, V], not [B, T, V]."""
    mask = loss_mask.bool()
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.zeros(mask.shape, dtype=dtype, device=logits.device)
    rows = logits[:, :-1][mask[:, 1:]]
    values = []
    for start in range(0, rows.shape[0], ENTROPY_CHUNK_TOKENS):
        z = rows[start:start + ENTROPY_CHUNK_TOKENS].to(dtype)
        values.append(torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
    if values:
        out[:, 1:][mask[:, 1:]] = torch.cat(values)
    return out


def _segment_mean(values: torch.Tensor, mask: torch.Tensor,
                  seq_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the mean of `values` over the trained tokens of its sequence."""
    ids = seq_ids.long()
    n = int(ids.max()) + 1 if ids.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device)
    sums.index_add_(0, ids[mask], values[mask])
    counts.index_add_(0, ids[mask], torch.ones_like(values[mask]))
    return (sums / counts.clamp(min=1.0))[ids]


def _clip_term(ratio, adv, low: float, high: float):
    """(-min(ratio A, clip(ratio) A), whether the clipped branch is active)."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def _ppo_clip(t: dict, s: LossSettings):
    per, clip = _clip_term(torch.exp(t["delta"]), t["adv"], s.clip_eps_low, s.clip_eps_high)
    return per, {"clipped": clip}


def _tis(t: dict, s: LossSettings):
    rho = torch.exp(t["delta"].detach())
    w = rho.clamp(max=s.is_cap)
    return -w * t["grad_one"] * t["adv"], {"truncated": rho > s.is_cap, "weight": w}


def _masked_is(t: dict, s: LossSettings):
    delta = t["delta"].detach()
    if s.is_mask_level == "sequence":
        band_of = torch.exp(_segment_mean(delta, t["mask"], t["seq_ids"]))
    else:
        band_of = torch.exp(delta)
    keep = (band_of >= s.is_band_low) & (band_of <= s.is_band_high)
    w = torch.where(keep, torch.exp(delta), torch.zeros_like(delta))
    return -w * t["grad_one"] * t["adv"], {"dropped": ~keep, "weight": w}


def _decoupled(t: dict, s: LossSettings):
    prox = t["prox"]
    r = torch.exp((t["logp"] - prox).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    behav = torch.exp((prox - t["old"]).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    w = behav.clamp(max=s.is_cap)
    per, clip = _clip_term(r, t["adv"], s.clip_eps_low, s.clip_eps_high)
    return w * per, {"clipped": clip, "truncated": behav > s.is_cap, "weight": w}


def _gspo(t: dict, s: LossSettings):
    log_s = _segment_mean(t["delta"].detach(), t["mask"], t["seq_ids"])
    ratio = torch.exp(log_s) * t["grad_one"]
    per, clip = _clip_term(ratio, t["adv"], s.gspo_clip_eps_low, s.gspo_clip_eps_high)
    return per, {"clipped": clip, "seq_ratio": torch.exp(log_s)}


VARIANTS = {"ppo_clip": _ppo_clip, "tis": _tis, "masked_is": _masked_is,
            "decoupled": _decoupled, "gspo": _gspo}
DEFAULT_SETTINGS = LossSettings()


def _inputs(logp, old_logprobs, advantages, mask, seq_ids, prox_logprobs) -> dict:
    """The masked per-token inputs of a variant (zeros where mask is 0, so that no
    garbage there can reach a value or a gradient)."""
    zero = torch.zeros_like(logp)
    dtype = logp.dtype
    lp = torch.where(mask, logp, zero)
    old = torch.where(mask, old_logprobs.to(dtype), zero)
    prox = lp.detach() if prox_logprobs is None else torch.where(
        mask, prox_logprobs.to(dtype).detach(), zero)
    adv = advantages.to(dtype)
    if adv.dim() == 1 and logp.dim() == 2:  # one advantage per row
        adv = adv.unsqueeze(1)
    adv = torch.where(mask, adv.expand_as(logp), zero)
    if seq_ids is None:
        if logp.dim() != 2:
            seq_ids = torch.zeros(logp.shape, dtype=torch.long, device=logp.device)
        else:
            seq_ids = torch.arange(logp.shape[0], device=logp.device).unsqueeze(1)
    return {"logp": lp, "old": old, "prox": prox, "adv": adv, "mask": mask,
            "seq_ids": seq_ids.expand_as(logp), "grad_one": torch.exp(lp - lp.detach()),
            "delta": (lp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)}


def policy_loss_tokens(logp: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                       num_step_tokens: int, settings: LossSettings = DEFAULT_SETTINGS,
                       seq_ids: torch.Tensor | None = None,
                       prox_logprobs: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """The step-normalised loss of one micro-batch from per-token tensors (module doc).

    `logp`, `old_logprobs`, `loss_mask` (and `seq_ids`, `prox_logprobs`) share one
    shape; `advantages` too, or [B] for rows [B, T]. `seq_ids` (sequence-level
    variants) numbers each token's sequence; by default each row of [B, T] is one
    sequence (a 1-D input is then a single sequence). Returns (loss, stats), stats sums
    over the trained tokens: "tokens", "loss_sum" (Σ ℓ_t), "ratio_sum" (Σ ρ_t),
    "clipped" (tokens whose clipped branch is active: zero gradient), "truncated"
    (weights capped at C), "dropped" (masked_is), "weight_sum" (Σ IS weight; the ratio
    that multiplies A for the clipped variants)."""
    if num_step_tokens < 1:
        raise ValueError("num_step_tokens must be >= 1")
    mask = loss_mask.bool()
    t = _inputs(logp, old_logprobs, advantages, mask, seq_ids, prox_logprobs)
    per, marks = VARIANTS[settings.name](t, settings)
    per_token = torch.where(mask, per, torch.zeros_like(per))
    loss = per_token.sum() / num_step_tokens
    with torch.no_grad():
        ratio = torch.exp(t["delta"].detach())
        weight = marks.get("weight", marks.get("seq_ratio", ratio))
        stats = {"tokens": int(mask.sum()), "loss_sum": float(per_token.sum()),
                 "ratio_sum": float(ratio[mask].sum()),
                 "weight_sum": float(weight[mask].sum())}
        for key in ("clipped", "truncated", "dropped"):
            stats[key] = int((marks[key] & mask).sum()) if key in marks else 0
    return loss, stats


def policy_loss(logits: torch.Tensor, token_ids: torch.Tensor, loss_mask: torch.Tensor,
                old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                num_step_tokens: int, settings: LossSettings | None = None,
                eps_low: float | None = None, eps_high: float | None = None,
                prox_logprobs: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """`policy_loss_tokens` of rows: logits [B, T, V], the rest [B, T] (advantages [B, T]
    or [B]); each row is one sequence. `eps_low` / `eps_high` override the settings'
    PPO clip range."""
    mask = loss_mask.bool()
    if mask[:, 0].any():
        raise ValueError("the first token of a sequence has no prediction: loss_mask must be 0")
    settings = settings or DEFAULT_SETTINGS
    if eps_low is not None or eps_high is not None:
        settings = LossSettings(**{**settings.to_json(), **{
            k: v for k, v in (("clip_eps_low", eps_low), ("clip_eps_high", eps_high))
            if v is not None}})
    logp = token_logprobs(logits, token_ids)
    return policy_loss_tokens(logp, old_logprobs, advantages, mask,
                              num_step_tokens=num_step_tokens, settings=settings,
                              prox_logprobs=prox_logprobs)


def _rows(seqs: Sequence[tuple], pad_id: int,
          device: torch.device | str) -> dict[str, torch.Tensor]:
    width = max(len(s[0]) for s in seqs)
    out = {"token_ids": np.full((len(seqs), width), pad_id, dtype=np.int64),
           "loss_mask": np.zeros((len(seqs), width), dtype=np.uint8),
           "logprobs": np.zeros((len(seqs), width), dtype=np.float32),
           "versions": np.full((len(seqs), width), -1, dtype=np.int64)}
    for i, (ids, mask, logp, _, versions) in enumerate(seqs):
        out["token_ids"][i, :len(ids)] = ids
        out["loss_mask"][i, :len(ids)] = mask
        out["logprobs"][i, :len(ids)] = logp
        out["versions"][i, :len(ids)] = np.where(np.asarray(mask) == 1, versions, -1)
    rows = {k: torch.from_numpy(v).to(device) for k, v in out.items()}
    rows["advantages"] = torch.tensor([s[3] for s in seqs], dtype=torch.float32, device=device)
    return rows


def rows_from_trajectories(trajs: Sequence[dict[str, Any]], *, pad_id: int = 0,
                           device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded rows from trajectory dicts (docs/runtime.md): token_ids, loss_mask, logprobs,
    versions (policy version of each trained token, -1 elsewhere: the dict's
    `versions`, else its `policy_version` on every trained token) [B, T] and
    advantages [B]."""
    if not trajs:
        raise ValueError("no trajectories")
    seqs = []
    for t in trajs:
        ids = np.asarray(t["token_ids"], dtype=np.int64)
        mask = np.asarray(t["loss_mask"], dtype=np.uint8)
        logp = np.asarray(t["logprobs"], dtype=np.float32)
        versions = np.asarray(t.get("versions", [t.get("policy_version", -1)] * len(ids)),
                              dtype=np.int64)
        if not len(ids) == len(mask) == len(logp) == len(versions):
            raise ValueError(f"run {t.get('run_id')!r}: token_ids, loss_mask, logprobs and "
                             "versions differ in length")
        seqs.append((ids, mask, logp, float(t["advantage"]), versions))
    return _rows(seqs, pad_id, device)


def rows_from_packed(mb, *, pad_id: int = 0,
                     device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded rows from a packed `MicroBatch` (one row per trajectory)."""
    cu = [int(x) for x in mb.cu_seqlens]
    seqs = [(mb.token_ids[a:b], mb.loss_mask[a:b], mb.logprobs[a:b], float(mb.advantages[a]),
             mb.versions[a:b]) for a, b in zip(cu[:-1], cu[1:])]
    return _rows(seqs, pad_id, device)
