"""Tree-packed training equals training the same trajectories one by one (float64): the
loss, its signals and the gradient of every parameter, for linear runs, compaction
branches, retries, sub-agent forks, K < leaves, several runs per micro-batch, a token
trained by two trajectories with different advantages, and every loss variant. Also:
FlexAttention with the block mask (the GPU kernel) and causal SDPA path by path (the CPU
kernel) compute the same tree attention.

The model is the torch trainer's (transformers' Llama/Qwen2 through the attention
implementation `train.tree` registers) in float64. Its RMSNorm computes in float32 even
in a float64 model, which rounds the gradient of a shared prefix once (tree) or per
branch (rows) at ~1e-8; the tests give the norms a float64 forward so that the
comparison is exact to float64 noise."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch
from traj_helpers import mk_run

from gyre_slurm.models.tiny import make_model_dir, new_model
from gyre_slurm.train.loss import LOSS_NAMES, LossSettings, rows_from_trajectories
from gyre_slurm.train.signals import loss_and_signals
from gyre_slurm.train.tree import (
    register_hf_attention, to_inputs, tree_attention, tree_loss_and_signals)
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.treepack import ancestors, pack_trees

VOCAB = 300
S = [11, 12, 13, 14]  # system prompt
TOOL = [31, 32, 33]


def _f64_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                          + self.variance_epsilon))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    d = make_model_dir(tmp_path_factory.mktemp("tree") / request.param, family=request.param,
                       vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_positions=256)
    m = new_model(d, seed=3, attn_implementation=register_hf_attention()).double()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    for mod in m.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_f64_norm, mod)
    return m.train()


def _process(pairs, *, run_id, k=5, advantage=0.0):
    calls = mk_run(pairs, run_id=run_id)
    for c in calls:  # sampler logprobs near the tiny model's, so ratios vary around 1
        c.output_logprobs[:] = -np.log(VOCAB) + np.linspace(-0.4, 0.4, len(c.output_ids))
    trajs = process_run(encode_run(calls), max_per_run=k, advantage=advantage).trajectories
    return [dict(t.to_json(), versions=t.versions.tolist()) for t in trajs]


def _o(*xs):  # outputs in a readable band
    return [200 + x for x in xs]


SCENARIOS = {
    "linear": lambda: _process([(S, _o(1, 2)), (S + _o(1, 2) + TOOL, _o(3, 4, 5)),
                                (S + _o(1, 2) + TOOL + _o(3, 4, 5) + TOOL, _o(6))],
                               run_id="lin", advantage=0.8),
    "compaction": lambda: _process([(S, _o(1, 2, 3)), (S + _o(1, 2, 3) + TOOL, _o(4, 5)),
                                    (S + [50, 51], _o(6, 7)),  # compacted: S + summary
                                    (S + [50, 51] + _o(6, 7) + TOOL, _o(8))],
                                   run_id="cmp", advantage=-0.6),
    "retries": lambda: _process([(S, _o(1, 2)), (S + _o(1, 2) + TOOL, _o(3, 4)),
                                 (S + _o(1, 2) + TOOL, _o(5)),  # retried call
                                 (S + _o(1, 2) + TOOL, _o(3, 9))],  # shares 203 with call 1
                                run_id="ret", advantage=1.3),
    "subagent": lambda: _process([(S, _o(1, 2, 3)),
                                  (S + _o(1, 2) + [60, 61], _o(4, 5)),  # fork mid-output
                                  (S + _o(1, 2, 3) + TOOL, _o(6))],
                                 run_id="sub", advantage=0.4),
    "k_below_leaves": lambda: _process([(S, _o(1)), (S + _o(1) + TOOL, _o(2, 3)),
                                        (S + _o(1) + TOOL, _o(4)), (S + [70], _o(5, 6)),
                                        (S + _o(1) + [71], _o(7, 8, 9))],
                                       run_id="k2", k=2, advantage=-1.1),
}


def _several_runs():
    """All scenarios in one micro-batch, plus a run whose tokens equal another's."""
    out = [t for make in SCENARIOS.values() for t in make()]
    twin = [dict(t, run_id="twin", advantage=-t["advantage"]) for t in SCENARIOS["linear"]()]
    return out + twin


def _shared_trained_token():
    """A hostile input: two trajectories of one run both train their shared tokens
    (201, 202), with different advantages and logprobs."""
    a = {"run_id": "dup", "token_ids": S + _o(1, 2, 3), "loss_mask": [0] * 4 + [1, 1, 1],
         "logprobs": [0.0] * 4 + [-5.5, -5.9, -5.6], "advantage": 1.5}
    b = {"run_id": "dup", "token_ids": S + _o(1, 2, 9, 8), "loss_mask": [0] * 4 + [1] * 4,
         "logprobs": [0.0] * 4 + [-5.8, -5.4, -5.7, -5.7], "advantage": -0.7}
    return [a, b]


CASES = {**{k: v for k, v in SCENARIOS.items()}, "several_runs": _several_runs,
         "shared_trained_token": _shared_trained_token}


def _grads(model, fn):
    model.zero_grad()
    loss, stats = fn()
    loss.backward()
    return float(loss.detach()), stats, [p.grad.detach().clone() for p in model.parameters()]


def _one_by_one(model, trajs, n, settings, version=3):
    """Each trajectory alone (its own row, its own forward), losses and gradients summed."""
    total, stats, grads = 0.0, {}, None
    for t in trajs:
        def fn(t=t):
            rows = rows_from_trajectories([t])
            logits = model(input_ids=rows["token_ids"]).logits
            return loss_and_signals(logits, rows, settings=settings, num_step_tokens=n,
                                    trainer_version=version)
        loss, s, g = _grads(model, fn)
        total += loss
        for key in ("tokens", "loss_sum", "ratio_sum", "weight_sum", "clipped", "entropy_sum",
                    "mismatch_abs_sum", "mismatch_k3_sum"):
            stats[key] = stats.get(key, 0) + s[key]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    return total, stats, grads


def _tree(model, trajs, n, settings, version=3):
    tree = to_inputs(pack_trees(trajs))

    def fn():
        logits = model(**tree.hf_inputs()).logits
        return tree_loss_and_signals(logits, tree, settings=settings, num_step_tokens=n,
                                     trainer_version=version)
    return _grads(model, fn)


def _assert_same(model, trajs, settings):
    n = sum(sum(t["loss_mask"]) for t in trajs)
    want_loss, want_stats, want = _one_by_one(model, trajs, n, settings)
    got_loss, got_stats, got = _tree(model, trajs, n, settings)
    assert got_loss == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    for key, value in want_stats.items():
        assert got_stats[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    scale = max(float(g.abs().max()) for g in want)
    assert scale > 1e-4  # the loss does move the parameters
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert float((a - b).abs().max()) <= 1e-12 * scale, name
    return got_stats


@pytest.mark.parametrize("case", list(CASES))
def test_tree_packing_equals_one_by_one(model, case):
    trajs = CASES[case]()
    assert trajs
    stats = _assert_same(model, trajs, LossSettings())
    tb = pack_trees(trajs)
    assert stats["tokens"] == sum(sum(t["loss_mask"]) for t in trajs)
    if case == "linear":
        assert tb.num_tokens == tb.rows_tokens
    else:
        assert tb.num_tokens < tb.rows_tokens  # shared prefixes computed once


@pytest.mark.parametrize("name", [n for n in LOSS_NAMES if n != "ppo_clip"])
def test_every_loss_variant_composes_with_tree_packing(model, name):
    """Sequence-level variants (gspo, masked_is by sequence) see each trajectory's trained
    tokens as its sequence."""
    settings = LossSettings(name=name, is_mask_level="sequence" if name == "masked_is"
                            else "token", gspo_clip_eps_low=0.05, gspo_clip_eps_high=0.05)
    _assert_same(model, _several_runs(), settings)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_flex_attention_and_sdpa_compute_the_same_tree_attention(heads, kv_heads):
    """The GPU path's kernel (FlexAttention with the block mask of the whole batch; eager
    on CPU, forward only), the CPU path's (causal SDPA path by path) and SDPA with the
    dense boolean mask agree, and equal causal attention over each trajectory alone."""
    trajs = _several_runs()
    tree = to_inputs(pack_trees(trajs))
    n = tree.num_tokens
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, kv_heads, n, 16, dtype=torch.float64, generator=gen)
            for _ in range(2))
    sdpa = tree_attention(q, k, v, tree, kernel="paths")
    with warnings.catch_warnings():  # "called without torch.compile()": eager, on purpose
        warnings.simplefilter("ignore", UserWarning)
        flex = tree_attention(q, k, v, tree, kernel="flex")
    assert float((flex - sdpa).abs().max()) < 1e-12
    dense = tree_attention(q, k, v, tree, kernel="mask")
    assert float((dense - sdpa).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="choose flex, paths or mask"):
        tree_attention(q, k, v, tree, kernel="sparse")
    tb = pack_trees(trajs)
    kk, vv = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    for j in range(len(trajs)):  # the trajectory's own causal attention over its path
        path = torch.as_tensor(ancestors(tb, int(tb.traj_end[j])))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, path], kk[:, :, path], vv[:, :, path], is_causal=True)
        assert float((ref - sdpa[:, :, path]).abs().max()) < 1e-12
