"""Every `loss.kind` variant against a float64 reference written as plain loops: value
and gradient, masked and unmasked tokens, per-token and per-sequence advantages."""

import math

import numpy as np
import pytest
import torch

from gyre_slurm.train.loss import (LOSS_NAMES, LossSettings, policy_loss, policy_loss_tokens,
                                   token_entropy, token_logprobs)

# Ranges chosen so that the fixed batches exercise every branch (clipped and not,
# truncated and not, dropped and kept): see test_batches_exercise_every_branch.
SETTINGS = {
    "ppo_clip": LossSettings(name="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28),
    "tis": LossSettings(name="tis", is_cap=1.3),
    "masked_is": LossSettings(name="masked_is", is_band_low=0.7, is_band_high=1.4),
    "masked_is_seq": LossSettings(name="masked_is", is_band_low=0.85, is_band_high=1.15,
                                  is_mask_level="sequence"),
    "decoupled": LossSettings(name="decoupled", clip_eps_low=0.1, clip_eps_high=0.15,
                              is_cap=1.3),
    "gspo": LossSettings(name="gspo", gspo_clip_eps_low=0.05, gspo_clip_eps_high=0.08),
}


def logsoftmax_row(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def seq_mean_delta(b, logp, old, mask):
    ts = [t for t in range(len(mask[b])) if mask[b][t]]
    return sum(logp[b][t] - old[b][t] for t in ts) / max(1, len(ts))


def clip_branch(ratio, a, low, high):
    """(-min(ratio A, clip(ratio) A), d/dratio of it)."""
    un, cl = ratio * a, min(max(ratio, 1 - low), 1 + high) * a
    return -min(un, cl), (-a if un <= cl + 1e-15 else 0.0)


def term(s, b, t, logp, old, prox, adv, mask):
    """(ℓ_t, dℓ_t/dlogπ_t) for token (b, t), by the formulas of the loss module's doc."""
    a, lp, mu = adv[b][t], logp[b][t], old[b][t]
    rho = math.exp(lp - mu)
    if s.name == "ppo_clip":
        v, d = clip_branch(rho, a, s.clip_eps_low, s.clip_eps_high)
        return v, d * rho
    if s.name == "tis":
        w = min(rho, s.is_cap)
        return -w * a, -w * a
    if s.name == "masked_is":
        band = rho if s.is_mask_level == "token" else math.exp(seq_mean_delta(b, logp, old, mask))
        w = rho if s.is_band_low <= band <= s.is_band_high else 0.0
        return -w * a, -w * a
    if s.name == "decoupled":
        r, w = math.exp(lp - prox[b][t]), min(math.exp(prox[b][t] - mu), s.is_cap)
        v, d = clip_branch(r, a, s.clip_eps_low, s.clip_eps_high)
        return w * v, w * d * r
    if s.name == "gspo":  # d s_{i,t} / d logπ_t = s_i (sg on the sequence ratio)
        seq = math.exp(seq_mean_delta(b, logp, old, mask))
        v, d = clip_branch(seq, a, s.gspo_clip_eps_low, s.gspo_clip_eps_high)
        return v, d * seq
    raise AssertionError(s.name)


def reference(s, logits, ids, mask, old, adv, *, n_step, prox=None):
    """(loss, dloss/dlogits) by hand, float64, one token at a time."""
    B, T, V = logits.shape
    lsm = [[logsoftmax_row(logits[b][t]) for t in range(T)] for b in range(B)]
    logp = [[0.0] + [lsm[b][t - 1][ids[b][t]] for t in range(1, T)] for b in range(B)]
    prox = logp if prox is None else prox
    loss, grad = 0.0, np.zeros_like(logits)
    for b in range(B):
        for t in range(1, T):
            if not mask[b][t]:
                continue
            value, dlogp = term(s, b, t, logp, old, prox, adv, mask)
            loss += value / n_step
            for v in range(V):
                p = math.exp(lsm[b][t - 1][v])
                grad[b][t - 1][v] += dlogp / n_step * ((1.0 if v == ids[b][t] else 0.0) - p)
    return loss, grad


def fixed_batch(seed=0, B=6, T=8, V=11, noise=0.35):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, V))
    ids = rng.integers(0, V, size=(B, T))
    mask = (rng.random((B, T)) < 0.7).astype(np.uint8)
    mask[:, 0] = 0
    mask[2, 5:] = 0  # a padded tail
    mask[4, 1:4] = 1
    new = token_logprobs(torch.tensor(logits), torch.tensor(ids)).numpy()
    # sequences near and far from the sampler: some in each band, some out
    scale = noise * np.array([0.1, 1.0, 0.3, 1.5, 0.05, 0.6])[:B, None]
    old = np.where(mask == 1, new + rng.normal(scale=1.0, size=(B, T)) * scale, 0.0)
    prox = np.where(mask == 1, new + rng.normal(scale=0.15, size=(B, T)), 0.0)
    return logits, ids, mask, old, prox


def advantages(kind, B, T, seed=5):
    rng = np.random.default_rng(seed)
    if kind == "sequence":
        per = np.array([1.3, -0.7, 0.4, -1.1, 0.9, 0.25])[:B]
        return per, np.repeat(per[:, None], T, axis=1)
    tok = rng.normal(size=(B, T))
    return tok, tok


def run_loss(s, logits, ids, mask, old, adv, *, n_step, prox=None):
    lg = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(lg, torch.tensor(ids), torch.tensor(mask), torch.tensor(old),
                              torch.tensor(adv), num_step_tokens=n_step, settings=s,
                              prox_logprobs=None if prox is None else torch.tensor(prox))
    loss.backward()
    return float(loss.detach()), lg.grad.numpy(), stats


@pytest.mark.parametrize("adv_kind", ["sequence", "token"])
@pytest.mark.parametrize("variant", sorted(SETTINGS))
def test_value_and_gradient_match_float64_reference(variant, adv_kind):
    s = SETTINGS[variant]
    logits, ids, mask, old, prox = fixed_batch()
    adv_in, adv_full = advantages(adv_kind, *mask.shape)
    n_step = int(mask.sum()) + 7  # the step holds other micro-batches' tokens too
    use_prox = prox if s.name == "decoupled" else None
    loss, grad, stats = run_loss(s, logits, ids, mask, old, adv_in, n_step=n_step,
                                 prox=use_prox)
    ref_loss, ref_grad = reference(s, logits, ids, mask, old, adv_full, n_step=n_step,
                                   prox=use_prox)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert stats["tokens"] == int(mask.sum())
    assert stats["loss_sum"] == pytest.approx(ref_loss * n_step, rel=1e-9, abs=1e-12)


def test_batches_exercise_every_branch():
    """The reference test above means something only if each variant's special branch
    is taken for some tokens and not for others."""
    logits, ids, mask, old, prox = fixed_batch()
    adv, _ = advantages("sequence", *mask.shape)
    n = int(mask.sum())
    branch = {"ppo_clip": "clipped", "tis": "truncated", "masked_is": "dropped",
              "masked_is_seq": "dropped", "gspo": "clipped"}
    for variant, key in branch.items():
        _, _, stats = run_loss(SETTINGS[variant], logits, ids, mask, old, adv, n_step=n)
        assert 0 < stats[key] < n, (variant, key, stats)
    _, _, stats = run_loss(SETTINGS["decoupled"], logits, ids, mask, old, adv, n_step=n,
                           prox=prox)
    assert 0 < stats["clipped"] < n and 0 < stats["truncated"] < n, stats


def test_sequence_mask_drops_whole_sequences():
    logits, ids, mask, old, _ = fixed_batch()
    adv, _ = advantages("sequence", *mask.shape)
    lg, ids_t, mask_t = torch.tensor(logits), torch.tensor(ids), torch.tensor(mask)
    dropped = []
    for b in range(mask.shape[0]):
        one = slice(b, b + 1)
        _, st = policy_loss(lg[one], ids_t[one], mask_t[one], torch.tensor(old)[one],
                            torch.tensor(adv)[one], num_step_tokens=1,
                            settings=SETTINGS["masked_is_seq"])
        assert st["dropped"] in (0, st["tokens"])
        dropped.append(st["dropped"] > 0)
    assert any(dropped) and not all(dropped)


@pytest.mark.parametrize("variant", sorted(SETTINGS))
def test_untrained_tokens_contribute_nothing(variant):
    s = SETTINGS[variant]
    logits, ids, mask, old, prox = fixed_batch(seed=1)
    adv, _ = advantages("token", *mask.shape)
    use_prox = prox if s.name == "decoupled" else None
    base = run_loss(s, logits, ids, mask, old, adv, n_step=40, prox=use_prox)
    logits2, ids2, old2, adv2 = logits.copy(), ids.copy(), old.copy(), adv.copy()
    prox2 = None if use_prox is None else prox.copy()
    off = mask == 0
    old2[off] = 1e4  # an absurd ratio would overflow if it were used
    adv2[off] = 1e6
    if prox2 is not None:
        prox2[off] = -1e4
    ids2[off] = (ids[off] + 3) % logits.shape[-1]
    for b, t in zip(*np.nonzero(off)):
        if t >= 1:  # logits at t-1 only predict token t
            logits2[b, t - 1] = np.random.default_rng(int(t)).normal(scale=5.0,
                                                                    size=logits.shape[-1])
    logits2[:, -1] = 99.0  # the last position predicts nothing
    again = run_loss(s, logits2, ids2, mask, old2, adv2, n_step=40, prox=prox2)
    assert again[0] == base[0]
    np.testing.assert_array_equal(again[1], base[1])
    z_loss, z_grad, z_stats = run_loss(s, logits, ids, np.zeros_like(mask), old, adv,
                                       n_step=40, prox=use_prox)
    assert z_loss == 0.0 and not z_grad.any() and z_stats["tokens"] == 0


@pytest.mark.parametrize("variant", sorted(SETTINGS))
def test_micro_batches_add_up_to_the_step(variant):
    """Rows split over two micro-batches: losses and gradients add up exactly (every
    variant is normalised by the step's token count; sequences are never split)."""
    s = SETTINGS[variant]
    logits, ids, mask, old, prox = fixed_batch(seed=2)
    adv, _ = advantages("sequence", *mask.shape)
    n = int(mask.sum())
    p = prox if s.name == "decoupled" else None
    whole = run_loss(s, logits, ids, mask, old, adv, n_step=n, prox=p)
    parts = [run_loss(s, logits[k], ids[k], mask[k], old[k], adv[k], n_step=n,
                      prox=None if p is None else p[k])
             for k in (slice(0, 2), slice(2, 6))]
    assert parts[0][0] + parts[1][0] == pytest.approx(whole[0], rel=1e-12, abs=1e-15)
    np.testing.assert_allclose(np.concatenate([parts[0][1], parts[1][1]]), whole[1],
                               rtol=1e-12, atol=1e-15)


def test_packed_tokens_with_sequence_ids_equal_rows():
    """One packed row [N] with sequence ids gives the rows' loss and gradient: the
    per-token API composes with padding-free packing."""
    for variant in ("gspo", "masked_is_seq", "tis"):
        s = SETTINGS[variant]
        logits, ids, mask, old, _ = fixed_batch(seed=3)
        adv, _ = advantages("sequence", *mask.shape)
        lg = torch.tensor(logits, requires_grad=True)
        logp = token_logprobs(lg, torch.tensor(ids))
        m, o = torch.tensor(mask).bool(), torch.tensor(old)
        a = torch.tensor(adv)[:, None].expand_as(logp)
        seq = torch.arange(mask.shape[0])[:, None].expand_as(logp)
        rows, _ = policy_loss_tokens(logp, o, torch.tensor(adv), m, num_step_tokens=9,
                                     settings=s)
        g_rows, = torch.autograd.grad(rows, lg, retain_graph=True)
        flat, _ = policy_loss_tokens(logp.reshape(-1), o.reshape(-1), a.reshape(-1),
                                     m.reshape(-1), num_step_tokens=9, settings=s,
                                     seq_ids=seq.reshape(-1))
        g_flat, = torch.autograd.grad(flat, lg)
        assert flat.detach().item() == pytest.approx(rows.detach().item(), rel=1e-12)
        torch.testing.assert_close(g_flat, g_rows, rtol=1e-12, atol=1e-15)


def test_decoupled_with_the_steps_own_weights_is_tis():
    """One optimizer step per batch: the proximal policy is the weights being trained, a
    second forward pass gives the same logprobs bit for bit, and decoupled PPO then has
    truncated IS's value and gradient (the clip never acts: r = 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(30, 16), torch.nn.Linear(16, 30)).double()
    ids = torch.randint(0, 30, (4, 9))
    mask = (torch.rand(4, 9) < 0.7).to(torch.uint8)
    mask[:, 0] = 0
    with torch.no_grad():
        prox = token_logprobs(model(ids), ids)  # the "extra forward pass"
    old = prox + 0.3 * torch.randn(4, 9)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])
    out = {}
    for name, p in (("tis", None), ("decoupled", None), ("decoupled_fwd", prox)):
        model.zero_grad()
        logits = model(ids)
        assert torch.equal(token_logprobs(logits, ids).detach(), prox)
        s = LossSettings(name="tis" if name == "tis" else "decoupled", is_cap=1.2)
        loss, stats = policy_loss(logits, ids, mask, old, adv, num_step_tokens=20,
                                  settings=s, prox_logprobs=p)
        loss.backward()
        out[name] = (loss.item(), [q.grad.clone() for q in model.parameters()], stats)
    for name in ("decoupled", "decoupled_fwd"):
        assert out[name][0] == pytest.approx(out["tis"][0], rel=1e-12)
        for g, ref in zip(out[name][1], out["tis"][1]):
            torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-15)
        assert out[name][2]["clipped"] == 0
        assert out[name][2]["truncated"] == out["tis"][2]["truncated"] > 0


def test_on_policy_tokens_train_alike():
    """Sampler == trainer (ratio 1 everywhere): every variant's gradient is the plain
    policy gradient -A ∇logπ / N (nothing clipped, truncated or dropped)."""
    logits, ids, mask, _, _ = fixed_batch(seed=4)
    new = token_logprobs(torch.tensor(logits), torch.tensor(ids)).numpy()
    old = np.where(mask == 1, new, 0.0)
    adv, _ = advantages("sequence", *mask.shape)
    grads = []
    for variant, s in SETTINGS.items():
        loss, grad, stats = run_loss(s, logits, ids, mask, old, adv, n_step=30)
        assert stats["clipped"] == stats["truncated"] == stats["dropped"] == 0, variant
        grads.append(grad)
    for g in grads[1:]:
        np.testing.assert_allclose(g, grads[0], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("chunk", [2048, 3])
def test_entropy_of_trained_tokens_matches_reference(chunk, monkeypatch):
    monkeypatch.setattr("gyre_slurm.train.loss.ENTROPY_CHUNK_TOKENS", chunk)
    logits, ids, mask, _, _ = fixed_batch(seed=6)
    got = token_entropy(torch.tensor(logits, dtype=torch.float32), torch.tensor(mask))
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert got[b, t] == 0.0
                continue
            lsm = logsoftmax_row(logits[b][t - 1])
            ref = -sum(math.exp(x) * x for x in lsm)
            assert float(got[b, t]) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("bad,match", [
    (dict(name="ppo"), "unknown loss 'ppo'"),
    (dict(is_mask_level="row"), "token or sequence"),
])
def test_settings_refuse_unknown_names(bad, match):
    with pytest.raises(ValueError, match=match):
        LossSettings(**bad)
    assert set(LOSS_NAMES) == {s.name for s in SETTINGS.values()}


@pytest.mark.parametrize("override,match", [
    ("loss.kind=ppo2", "loss.kind"),
    ("loss.clip_eps_low=1.0", "clip_eps_low must be in \\(0, 1\\)"),
    ("loss.is_cap=0.5", "is_cap = 0.5 would down-weight on-policy tokens"),
    ("loss.is_band_high=0.9", "must hold 1"),
    ("loss.is_mask_level=row", "is_mask_level"),
])
def test_config_refuses_bad_loss_settings(override, match):
    from gyre_slurm.config.schema import load_config
    from gyre_slurm.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(None, [override])
    cfg = load_config(None, ["loss.kind=masked_is", "loss.is_mask_level=sequence"])
    assert LossSettings.from_config(cfg.loss) == LossSettings(
        name="masked_is", is_mask_level="sequence")
