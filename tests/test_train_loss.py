"""The clipped policy-gradient loss against a float64 reference written as plain loops."""

import math

import numpy as np
import pytest
import torch

from gyre_slurm.traj.pack import pack
from gyre_slurm.traj.select import Trajectory
from gyre_slurm.train.loss import policy_loss, rows_from_packed, rows_from_trajectories


def reference(logits, token_ids, mask, old, adv, *, n_step, eps_low=0.2, eps_high=0.2):
    """(loss, dloss/dlogits) by hand, float64, one token at a time."""
    B, T, V = logits.shape
    loss, grad = 0.0, np.zeros_like(logits)
    for b in range(B):
        for t in range(1, T):
            if not mask[b][t]:
                continue
            row = logits[b][t - 1]
            m = max(row)
            lse = m + math.log(sum(math.exp(x - m) for x in row))
            logp = row[token_ids[b][t]] - lse
            r = math.exp(logp - old[b][t])
            a = adv[b]
            unclipped, clipped = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
            loss += -min(unclipped, clipped) / n_step
            # d(-min)/dlogp: -a*r when the unclipped branch is active (or both are equal)
            dlogp = -a * r / n_step if unclipped <= clipped + 1e-15 else 0.0
            for v in range(V):
                p = math.exp(row[v] - lse)
                grad[b][t - 1][v] += dlogp * ((1.0 if v == token_ids[b][t] else 0.0) - p)
    return loss, grad


def fixed_batch(seed=0, B=3, T=7, V=11):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, V))
    ids = rng.integers(0, V, size=(B, T))
    mask = (rng.random((B, T)) < 0.6).astype(np.uint8)
    mask[:, 0] = 0
    mask[2, 5:] = 0  # a padded tail
    # old logprobs near the new ones, so that some ratios fall in and some out of the clip range
    lse = np.log(np.exp(logits).sum(-1))
    new = np.zeros((B, T))
    for b in range(B):
        for t in range(1, T):
            new[b, t] = logits[b, t - 1, ids[b, t]] - lse[b, t - 1]
    old = np.where(mask == 1, new + rng.normal(scale=0.4, size=(B, T)), 0.0)
    adv = np.array([1.3, -0.7, 0.4])
    return logits, ids, mask, old, adv


def run_loss(logits, ids, mask, old, adv, **kw):
    lg = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(lg, torch.tensor(ids), torch.tensor(mask), torch.tensor(old),
                              torch.tensor(adv), **kw)
    loss.backward()
    return float(loss.detach()), lg.grad.numpy(), stats


@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.1, 0.28)])
def test_loss_and_grad_match_float64_reference(eps_low, eps_high):
    logits, ids, mask, old, adv = fixed_batch()
    n_step = int(mask.sum()) + 5  # the step holds tokens of other micro-batches too
    loss, grad, stats = run_loss(logits, ids, mask, old, adv, num_step_tokens=n_step,
                                 eps_low=eps_low, eps_high=eps_high)
    ref_loss, ref_grad = reference(logits, ids, mask, old, adv, n_step=n_step,
                                   eps_low=eps_low, eps_high=eps_high)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert stats["tokens"] == int(mask.sum())
    assert 0 < stats["clipped"] < stats["tokens"]  # the batch exercises both branches
    assert stats["loss_sum"] == pytest.approx(ref_loss * n_step, rel=1e-9)


# (advantage, ratio, eps_high, expected per-token loss, clipped branch active)
CLIP_CASES = [
    (1.0, 1.1, 0.2, -1.1, False),    # A>0, inside the range
    (1.0, 1.5, 0.2, -1.2, True),     # A>0, above: capped at 1+eps, no gradient
    (1.0, 0.5, 0.2, -0.5, False),    # A>0, below: the unclipped (smaller) term wins
    (-1.0, 0.9, 0.2, 0.9, False),    # A<0, inside
    (-1.0, 0.5, 0.2, 0.8, True),     # A<0, below: capped at 1-eps, no gradient
    (-1.0, 1.5, 0.2, 1.5, False),    # A<0, above: the unclipped (larger loss) term wins
    (1.0, 1.25, 0.28, -1.25, False),  # asymmetric range (eps_high 0.28): still inside
    (2.0, 1.4, 0.28, -2.56, True),   # |A| scales the capped value
]


@pytest.mark.parametrize("adv,ratio,eps_high,expected,clipped", CLIP_CASES)
def test_clipping_cases(adv, ratio, eps_high, expected, clipped):
    logits = np.array([[[0.3, -0.2, 0.9, 0.1], [0.0, 0.0, 0.0, 0.0]]])
    ids = np.array([[0, 2]])
    mask = np.array([[0, 1]], dtype=np.uint8)
    logp = logits[0, 0, 2] - math.log(np.exp(logits[0, 0]).sum())
    old = np.array([[0.0, logp - math.log(ratio)]])
    loss, grad, stats = run_loss(logits, ids, mask, old, np.array([adv]), num_step_tokens=1,
                                 eps_high=eps_high)
    assert loss == pytest.approx(expected, rel=1e-9)
    assert stats["clipped"] == int(clipped)
    assert (np.abs(grad).max() == 0.0) == clipped
    assert stats["ratio_sum"] == pytest.approx(ratio, rel=1e-9)


def test_mask_zero_tokens_contribute_nothing():
    logits, ids, mask, old, adv = fixed_batch(seed=1)
    base_loss, base_grad, _ = run_loss(logits, ids, mask, old, adv, num_step_tokens=20)
    logits2, ids2, old2 = logits.copy(), ids.copy(), old.copy()
    off = mask == 0
    old2[off] = 1e4  # an absurd ratio would overflow if it were used
    ids2[off] = (ids[off] + 3) % logits.shape[-1]
    # logits at t-1 only predict token t: scramble those whose token t is not trained
    for b, t in zip(*np.nonzero(off)):
        if t >= 1:
            scramble = np.random.default_rng(int(t))
            logits2[b, t - 1] = scramble.normal(scale=5.0, size=logits.shape[-1])
    logits2[:, -1] = 99.0  # the last position predicts nothing
    loss, grad, _ = run_loss(logits2, ids2, mask, old2, adv, num_step_tokens=20)
    assert loss == base_loss
    np.testing.assert_array_equal(grad, base_grad)
    # all-masked rows: zero loss, zero gradient
    z_loss, z_grad, z_stats = run_loss(logits, ids, np.zeros_like(mask), old, adv,
                                       num_step_tokens=20)
    assert z_loss == 0.0 and not z_grad.any() and z_stats["tokens"] == 0


def test_first_token_cannot_be_trained():
    logits, ids, mask, old, adv = fixed_batch()
    mask[0, 0] = 1
    with pytest.raises(ValueError, match="first token"):
        run_loss(logits, ids, mask, old, adv, num_step_tokens=10)


def test_micro_batches_add_up_to_the_step():
    """Split a batch into two micro-batches: losses and gradients add up exactly to the
    whole batch's (the normalisation is by the step's token count, not per micro-batch)."""
    logits, ids, mask, old, adv = fixed_batch(seed=2)
    n_step = int(mask.sum())
    whole, g_whole, _ = run_loss(logits, ids, mask, old, adv, num_step_tokens=n_step)
    parts = [run_loss(logits[s], ids[s], mask[s], old[s], adv[s], num_step_tokens=n_step)
             for s in (slice(0, 1), slice(1, 3))]
    assert parts[0][0] + parts[1][0] == pytest.approx(whole, rel=1e-12)
    np.testing.assert_allclose(np.concatenate([parts[0][1], parts[1][1]]), g_whole,
                               rtol=1e-12, atol=1e-15)


def _trajs(rng, n=5, V=50):
    out = []
    for i in range(n):
        L = int(rng.integers(4, 10))
        mask = np.r_[np.zeros(2, np.uint8), (rng.random(L - 2) < 0.7).astype(np.uint8)]
        out.append(Trajectory(f"r{i}", rng.integers(0, V, L).astype(np.int32), mask,
                              np.where(mask == 1, -3.9 + rng.normal(scale=0.1, size=L),
                                       0.0).astype(np.float32),
                              np.where(mask == 1, 3, -1).astype(np.int64), 3,
                              float(rng.normal()), 0))
    return out


def test_packed_and_dict_rows_give_the_same_loss():
    rng = np.random.default_rng(3)
    trajs = _trajs(rng)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)).double()
    n_step = sum(t.num_trained for t in trajs)

    def loss_of(rows):
        loss, stats = policy_loss(model(rows["token_ids"]), rows["token_ids"],
                                  rows["loss_mask"], rows["logprobs"], rows["advantages"],
                                  num_step_tokens=n_step)
        return float(loss.detach()), stats["tokens"]

    by_dict = loss_of(rows_from_trajectories([t.to_json() for t in trajs]))
    packed = [loss_of(rows_from_packed(mb)) for mb in pack(trajs, max_tokens=16)]
    assert len(packed) > 1
    assert sum(p[0] for p in packed) == pytest.approx(by_dict[0], rel=1e-6)
    assert sum(p[1] for p in packed) == by_dict[1] == n_step
