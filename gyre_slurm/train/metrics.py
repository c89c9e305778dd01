"""The training signals of one optimizer step, from what the ranks measured and what the
step trained (pure: no I/O, no torch).

Ranks report sums (`gyre_slurm.train.signals`); `merge` combines them exactly across
local ranks, nodes and micro-batches: numbers add, keys ending in `_max` take the
maximum, nested dicts merge key by key. `step_metrics` turns one step's merged sums,
its trajectories and its runs into the flat dict written to `metrics.jsonl` and
TensorBoard (keys are TensorBoard tags, grouped by their prefix):

  train/      loss (Σ ℓ_t / N, the step's loss), clip_frac (tokens with a zero-gradient
              clip branch / N), is_truncated_frac, is_dropped_frac, ratio_mean (the
              trainer/sampler ratio ρ), is_weight_mean, entropy (mean over trained
              tokens), grad_norm (before clipping; none when nothing trained), tokens,
              trajectories, skipped (1: the update was skipped, for a non-finite
              grad_norm or no token to train; the version advanced)
  mismatch/   abs_mean, abs_max (|logπ - logμ| over trained tokens), kl_k3, kl_k1
              (estimates of KL(sampler ‖ trainer) per token: see train/signals.py); and
              per policy lag L: lag<L>/abs_mean, lag<L>/abs_max, lag<L>/kl_k3,
              lag<L>/tokens
  staleness/  lag_mean, lag_max over trained tokens (lag = the step's version minus the
              version that sampled the token); multi_version_run_frac (runs whose
              trained tokens came from more than one version), run_span_max (the
              largest version span of a run), longest_run_span (the span of the run
              with the most trained tokens); `lag_hist` {lag: tokens} is nested
  reward/     mean, std over the step's ok runs; group_std_mean (the mean over groups
              of the reward spread within a group: GRPO's signal), zero_spread_frac
              (groups whose runs all scored the same: no gradient)
  length/     response_mean, response_max (trained tokens per trajectory),
              sequence_mean (tokens per trajectory, context included)
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gyre_slurm.common.values import is_number

# the trainers' log line for an optimizer step a non-finite gradient norm skips
SKIPPED = ("non-finite gradient norm (%s): the step's update is skipped and its gradients "
           "dropped; the version advances with the weights unchanged")


def merge(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """Combine two measurement dicts (module doc); neither is changed."""
    out = dict(a or {})
    for key, value in (b or {}).items():
        have = out.get(key)
        if have is None:
            out[key] = value
        elif isinstance(value, dict) and isinstance(have, dict):
            out[key] = merge(have, value)
        elif is_number(value) and is_number(have):
            out[key] = max(have, value) if key.endswith("_max") else have + value
    return out


def merge_all(items: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        out = merge(out, item)
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def train_figures(sums: dict[str, Any], *, grad_norm: float | None) -> dict[str, Any]:
    n = sums.get("tokens", 0)
    out = {"train/loss": _ratio(sums.get("loss_sum", 0.0), n),
           "train/clip_frac": _ratio(sums.get("clipped", 0), n),
           "train/is_truncated_frac": _ratio(sums.get("truncated", 0), n),
           "train/is_dropped_frac": _ratio(sums.get("dropped", 0), n),
           "train/ratio_mean": _ratio(sums.get("ratio_sum", 0.0), n),
           "train/is_weight_mean": _ratio(sums.get("weight_sum", 0.0), n),
           "train/entropy": _ratio(sums.get("entropy_sum", 0.0), n),
           "train/grad_norm": grad_norm, "train/tokens": n,
           # the step's update was skipped (the version advanced): a non-finite norm,
           # or nothing to train
           "train/skipped": int(not n or (is_number(grad_norm)
                                          and not math.isfinite(grad_norm)))}
    out.update(_mismatch("mismatch/", sums))
    out["mismatch/kl_k1"] = _ratio(sums.get("mismatch_k1_sum", 0.0), n)
    for lag, part in sorted((sums.get("by_lag") or {}).items(), key=lambda kv: int(kv[0])):
        out.update(_mismatch(f"mismatch/lag{lag}/", part))
        out[f"mismatch/lag{lag}/tokens"] = part.get("tokens", 0)
    return out


def _mismatch(prefix: str, sums: dict[str, Any]) -> dict[str, Any]:
    n = sums.get("tokens", 0)
    return {f"{prefix}abs_mean": _ratio(sums.get("mismatch_abs_sum", 0.0), n),
            f"{prefix}abs_max": sums.get("mismatch_abs_max") if n else None,
            f"{prefix}kl_k3": _ratio(sums.get("mismatch_k3_sum", 0.0), n)}


def staleness(trajectories: Sequence[dict[str, Any]], *, version: int) -> dict[str, Any]:
    """Lag histogram and version spans of the step's runs (module doc). A trajectory
    without per-token `versions` counts its `policy_version` for every trained token.
    Its arrays may be lists or numpy arrays (the coordinator's book holds arrays)."""
    hist: dict[int, int] = defaultdict(int)
    seen: dict[str, list[int]] = {}  # run -> [min version, max version, trained tokens]
    for t in trajectories:
        mask = np.asarray(t["loss_mask"]) != 0
        if not mask.any():
            continue
        given = t.get("versions")
        if given is None or len(given) == 0:
            trained = np.full(int(mask.sum()), int(t.get("policy_version", version)))
        else:
            trained = np.asarray(given, dtype=np.int64)[mask]
        lags, counts = np.unique(version - trained, return_counts=True)
        for lag, n in zip(lags.tolist(), counts.tolist()):
            hist[lag] += n
        lo, hi, n = int(trained.min()), int(trained.max()), len(trained)
        run = seen.setdefault(t["run_id"], [lo, hi, 0])
        run[0], run[1], run[2] = min(run[0], lo), max(run[1], hi), run[2] + n
    spans = {r: hi - lo for r, (lo, hi, _) in seen.items()}
    total = sum(hist.values())
    longest = max(seen, key=lambda r: seen[r][2]) if seen else None
    return {"staleness/lag_mean": _ratio(sum(k * n for k, n in hist.items()), total),
            "staleness/lag_max": max(hist) if hist else None,
            "staleness/multi_version_run_frac": _ratio(sum(s > 0 for s in spans.values()),
                                                       len(spans)),
            "staleness/run_span_max": max(spans.values()) if spans else None,
            "staleness/longest_run_span": spans[longest] if longest else None,
            "staleness/lag_hist": {str(k): hist[k] for k in sorted(hist)}}


def rewards(groups: dict[Any, list[float]]) -> dict[str, Any]:
    """Reward figures from {group: rewards of its ok runs}."""
    every = [r for rs in groups.values() for r in rs]
    spreads = [statistics.pstdev(rs) for rs in groups.values() if rs]
    return {"reward/mean": statistics.fmean(every) if every else None,
            "reward/std": statistics.pstdev(every) if every else None,
            "reward/group_std_mean": statistics.fmean(spreads) if spreads else None,
            "reward/zero_spread_frac": _ratio(sum(s == 0.0 for s in spreads), len(spreads))}


def lengths(trajectories: Sequence[dict[str, Any]]) -> dict[str, Any]:
    trained = [int(np.count_nonzero(t["loss_mask"])) for t in trajectories]
    total = [len(t["token_ids"]) for t in trajectories]
    return {"length/response_mean": statistics.fmean(trained) if trained else None,
            "length/response_max": max(trained) if trained else None,
            "length/sequence_mean": statistics.fmean(total) if total else None}


def step_metrics(*, sums: dict[str, Any], trajectories: Sequence[dict[str, Any]],
                 version: int, groups: dict[Any, list[float]],
                 grad_norm: float | None) -> dict[str, Any]:
    """All of one step's figures (module doc). `version`: the policy version the step
    trained (its weights before the optimizer step)."""
    out = train_figures(sums, grad_norm=grad_norm)
    out["train/trajectories"] = len(trajectories)
    out.update(staleness(trajectories, version=version))
    out.update(rewards(groups))
    out.update(lengths(trajectories))
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in out.items()}


MAIN = ("train/loss", "train/clip_frac", "train/entropy", "train/grad_norm",
        "mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl_k3", "staleness/lag_mean",
        "reward/mean", "reward/group_std_mean", "length/response_mean")
