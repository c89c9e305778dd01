"""The Megatron-core backend for real: 4 processes of the megatron environment (Python
3.12, megatron-core on CPU through `cpu_shim`) in gloo worlds on 127.0.0.1, driven from
here through `gyre_slurm.train.rankproc --backend megatron`; Hugging Face references from
transformers in this (core) environment."""

import itertools
import time

import numpy as np
import pytest
import torch

from gyre_slurm.models import tiny
from gyre_slurm.models.tiny import load_weights, new_model
from gyre_slurm.train.dist import WorldSpec, host_store
from gyre_slurm.train.loss import (LossSettings, policy_loss, rows_from_trajectories,
                                   token_logprobs)
from gyre_slurm.train.metrics import merge_all
from gyre_slurm.train.signals import loss_and_signals
from gyre_slurm.train.megatron import convert
from gyre_slurm.train.megatron.convert import ModelShape
from gyre_slurm.train.wsync import plan as planlib
from megatron_procs import MODEL_FAMILIES as FAMILIES
from megatron_procs import VOCAB, ClusterPool, DriverError, make_test_model
import batch_helpers
from batch_helpers import n_tokens

HOST = "127.0.0.1"
CALL_TIMEOUT_S = 180
IDS = [7, 290, 12, 45, 9, 299, 88, 23, 150, 3, 77, 201, 64, 5, 222, 19, 98, 2]
# (TP, PP, EP) worlds of 4 ranks the parity test visits, per family
LAYOUTS = {"dense": ((2, 2, 1), (1, 1, 1)), "moe": ((2, 1, 2), (1, 1, 4), (2, 2, 2))}


# ---- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (model_dir, weights_dir, hf model)} for every family (megatron_procs)."""
    root = tmp_path_factory.mktemp("megatron")
    out = {f: make_test_model(root, f, seed=i + 1) for i, f in enumerate(FAMILIES)}
    out["qwen2_tied"] = make_test_model(root, "qwen2", seed=9, tied=True)
    return out


@pytest.fixture(scope="module")
def store():
    st, port = host_store(HOST)
    yield port, itertools.count(1)
    del st


@pytest.fixture(scope="module")
def clusters(models, megatron_python, store, tmp_path_factory):
    """cluster(family): 4 processes for that family (one family alive at a time)."""
    pool = ClusterPool(models=models, python=megatron_python,
                       log_root=tmp_path_factory.mktemp("logs"), host=HOST, port=store[0],
                       gens=store[1], call_timeout_s=CALL_TIMEOUT_S, lr=1e-2, seed=0)
    yield pool.get
    pool.close()


def micro_batch(seed, n=6):
    return batch_helpers.micro_batch(seed, n, VOCAB)


def hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()
    return token_logprobs(logits, torch.tensor([ids]))[0].double().numpy()


def hf_loss(model, mb, num_step_tokens):
    rows = rows_from_trajectories(mb, pad_id=model.config.pad_token_id)
    logits = model(input_ids=rows["token_ids"]).logits
    loss, _ = policy_loss(logits, rows["token_ids"], rows["loss_mask"], rows["logprobs"],
                          rows["advantages"], num_step_tokens=num_step_tokens)
    return loss


def load_hf(model_dir, weights_dir):
    model = new_model(model_dir, seed=0)
    load_weights(model, weights_dir)  # strict
    return model.eval()


# ---- 1. conversion ----------------------------------------------------------------------

ROUND_TRIPS = [(f, (tp, pp, 1)) for f in FAMILIES for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2))]
ROUND_TRIPS += [("qwen3_moe", layout) for layout in ((1, 1, 2), (2, 1, 4), (2, 2, 8))]


@pytest.mark.parametrize("family,layout", ROUND_TRIPS)
def test_convert_round_trip_exact(models, family, layout):
    """Every rank's shard (TP x PP x EP) of the Hugging Face weights and back: exact."""
    tp, pp, ep = layout
    model_dir, _, model = models[family]
    shape = ModelShape.from_model_dir(model_dir)
    hf = {k: v.detach().clone() for k, v in tiny.checkpoint_state(model).items()}
    shards = {(t, p, e): convert.hf_to_megatron_shard(hf, shape, tp_rank=t, tp_size=tp,
                                                      pp_rank=p, pp_size=pp, ep_rank=e,
                                                      ep_size=ep)
              for t in range(tp) for p in range(pp) for e in range(ep)}
    per_group = (shape.num_heads // shape.num_kv_heads + 2) * shape.head_dim
    for (t, p, e), shard in shards.items():
        assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
            shape.num_kv_heads // tp * per_group, shape.hidden_size)
        assert ("embedding.word_embeddings.weight" in shard) == (p == 0)
        assert ("output_layer.weight" in shard) == (p == pp - 1)
        assert f"decoder.layers.{shape.num_layers // pp}.input_layernorm.weight" not in shard
        assert ("decoder.layers.0.self_attention.linear_qkv.bias" in shard) == (
            family == "qwen2")
        assert ("decoder.layers.0.self_attention.q_layernorm.weight" in shard) == (
            family in ("qwen3", "qwen3_moe"))
        if shape.is_moe:  # rank e holds experts e*E/EP..: whole (expert TP 1)
            experts = [k for k in shard if k.startswith("decoder.layers.0.mlp.experts.")]
            assert len(experts) == 2 * shape.num_experts // ep
            fc1 = shard["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
            first = e * shape.num_experts // ep
            assert torch.equal(fc1[:shape.moe_ffn_hidden_size],
                               hf[f"model.layers.{p * shape.num_layers // pp}.mlp.experts."
                                  f"{first}.gate_proj.weight"])
        else:
            assert shard["decoder.layers.0.mlp.linear_fc1.weight"].shape == (
                2 * shape.ffn_hidden_size // tp, shape.hidden_size)
    back = convert.megatron_shards_to_hf(shards, shape, tp_size=tp, pp_size=pp, ep_size=ep)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_convert_tied_embeddings_name_the_tensor_once(models, tp, pp):
    """tie_word_embeddings: the checkpoint has no lm_head.weight. With PP 1 no rank holds
    an output layer (Megatron's shares the embedding); over PP the last stage holds the
    embedding's copy, which nothing exports: the way back names the tensor once."""
    model_dir, _, model = models["qwen2_tied"]
    shape = ModelShape.from_model_dir(model_dir)
    assert shape.tied_embeddings and "lm_head.weight" not in shape.hf_tensor_shapes()
    hf = {k: v.detach().clone() for k, v in tiny.checkpoint_state(model).items()}
    assert "lm_head.weight" not in hf
    shards = {(t, p): convert.hf_to_megatron_shard(hf, shape, tp_rank=t, tp_size=tp,
                                                   pp_rank=p, pp_size=pp)
              for t in range(tp) for p in range(pp)}
    for (t, p), shard in shards.items():
        assert ("output_layer.weight" in shard) == (pp > 1 and p == pp - 1)
        if "output_layer.weight" in shard:
            assert torch.equal(shard["output_layer.weight"],
                               shards[(t, 0)]["embedding.word_embeddings.weight"])
    back = convert.megatron_shards_to_hf(shards, shape, tp_size=tp, pp_size=pp)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name


def test_convert_packs_qkv_per_query_group_and_gate_up_per_shard(models):
    """Readable rows: q head h holds 100 + h, k head g 200 + g, v head g 300 + g; gate rows
    1000 + i, up rows 2000 + i. Megatron's order: per KV group [its q heads; k; v]."""
    model_dir, _, model = models["qwen2"]
    shape = ModelShape.from_model_dir(model_dir)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    d, heads, groups, ffn = shape.head_dim, shape.num_heads, shape.num_kv_heads, \
        shape.ffn_hidden_size
    for proj, base, n in (("q", 100, heads), ("k", 200, groups), ("v", 300, groups)):
        rows = torch.arange(n).repeat_interleave(d).float() + base
        hf[f"model.layers.0.self_attn.{proj}_proj.bias"] = rows
    hf["model.layers.0.mlp.gate_proj.weight"][:, 0] = torch.arange(ffn).float() + 1000
    hf["model.layers.0.mlp.up_proj.weight"][:, 0] = torch.arange(ffn).float() + 2000
    for tp, want in ((1, [100, 101, 200, 300, 102, 103, 201, 301]),
                     (2, [100, 101, 200, 300])):
        shard = convert.hf_to_megatron_shard(hf, shape, tp_rank=0, tp_size=tp, pp_rank=0,
                                             pp_size=1)
        bias = shard["decoder.layers.0.self_attention.linear_qkv.bias"]
        assert bias[::d].tolist() == want
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist()
        half = ffn // tp
        assert fc1 == [1000 + i for i in range(half)] + [2000 + i for i in range(half)]


def test_convert_refuses_layouts_that_do_not_divide(models):
    shape = ModelShape.from_model_dir(models["llama"][0])
    with pytest.raises(ValueError, match="num_key_value_heads 2 % TP 4"):
        shape.check_layout(4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers 2 % PP 4"):
        shape.check_layout(1, 4)
    with pytest.raises(ValueError, match="expert parallel 2 needs a mixture-of-experts"):
        shape.check_layout(1, 1, 2)
    moe = ModelShape.from_model_dir(models["qwen3_moe"][0])
    with pytest.raises(ValueError, match="num_experts 8 % EP 3"):
        moe.check_layout(1, 1, 3)


# ---- 2. parity with Hugging Face --------------------------------------------------------

# The tests that drive processes run in an order that starts each family's processes
# once (the pool keeps one family alive at a time; a start of 4 Megatron processes is
# seconds of CPU each): llama, qwen3, then every qwen2 test, then every qwen3_moe test
# (its parity test comes after the export test's qwen2 case).
DENSE = ("llama", "qwen3", "qwen2")
assert sorted(DENSE + ("qwen3_moe",)) == sorted(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", DENSE)
def test_logprobs_match_transformers(clusters, models, family):
    check_parity(clusters, models, family)


def test_tied_embeddings_logprobs_match_transformers(clusters, models):
    """A tied Qwen2 (the output layer is the embedding, as in most small published
    models) at TP2/PP2 (the last stage's copy, kept by Megatron's embedding group) and
    TP1 x DP4: transformers' log-probs, loss and signals."""
    check_parity(clusters, models, "qwen2_tied")


def check_parity(clusters, models, family):
    """Megatron's log-probabilities, loss and training signals equal transformers' at
    each of the family's layouts (LAYOUTS); a world whose size is not a multiple of
    TP x PP is refused."""
    c = clusters(family)
    model = models[family][2]
    assert ModelShape.from_model_dir(c.model_dir).padded_vocab_size > model.config.vocab_size
    want = hf_logprobs(model, IDS)
    mb = micro_batch(21, n=7)
    with torch.no_grad():
        want_loss = float(hf_loss(model, mb, n_tokens(mb)))
    moe = ModelShape.from_model_dir(c.model_dir).is_moe
    for tp, pp, ep in LAYOUTS["moe" if moe else "dense"]:  # TP1/PP1 on 4 ranks: DP 4
        c.world([0, 1, 2, 3], tp, pp, expert_parallel=ep, init_weights=str(c.weights))
        got = np.array(c.one(range(4), "token_logprobs", token_ids=IDS))
        diff = float(np.abs(got - want).max())
        got_loss = c.one(range(4), "eval_loss", mb=mb, num_step_tokens=n_tokens(mb))
        print(f"{family} TP{tp}/PP{pp}/EP{ep}: max |logprob - transformers| = {diff:.2e}, "
              f"loss {got_loss:.6f} vs {want_loss:.6f}")
        assert got[0] == 0.0 and diff < 1e-4
        assert _close(got_loss, want_loss), (got_loss, want_loss)
        check_signals(c, model, mb)
    with pytest.raises(DriverError, match="multiple of TP \\* PP"):
        c.world([0, 1], 2, 2, expert_parallel=1, init_weights=str(c.weights))


def check_signals(c, model, mb):
    """The training signals of a micro-batch, reported by one rank per data-parallel
    replica and merged over the world, equal those of transformers' logits (entropy over
    the full vocabulary, though the logits are vocabulary-parallel under TP)."""
    mb = [dict(t, versions=[0 if m else -1 for m in t["loss_mask"]]) for t in mb]
    rows = rows_from_trajectories(mb, pad_id=model.config.pad_token_id)
    with torch.no_grad():
        _, want = loss_and_signals(model(input_ids=rows["token_ids"]).logits.float(), rows,
                                   settings=LossSettings(), num_step_tokens=1,
                                   trainer_version=0)
    got = merge_all(c.on(range(4), "train_microbatch", mb=mb, num_step_tokens=1).values())
    assert got["tokens"] == want["tokens"] == n_tokens(mb)
    assert got["trajectories"] == len(mb) and set(got["by_lag"]) == {"0"}
    for key in ("loss_sum", "entropy_sum", "mismatch_abs_sum", "mismatch_abs_max",
                "mismatch_k3_sum", "ratio_sum"):
        assert _close(got[key], want[key], rel=1e-4), (key, got[key], want[key])


# ---- 3. the handoff cycle ---------------------------------------------------------------

def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _params_diff(a_dir, b_dir):
    from safetensors.torch import load_file

    a = load_file(str(a_dir / "model.safetensors"))
    b = load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_handoff_cycle_reshards_state(clusters, tmp_path):
    """TP2/PP2 (4) -> TP1/PP2 (2) -> TP2/PP2 (4) -> TP1/PP2 (4: DP 2) -> TP2/PP2 (4),
    every rebuild a new generation loading the last world's checkpoint resharded. The
    loss on a fixed batch is unchanged by each rebuild; a step split by a mid-step save
    equals the un-interrupted step."""
    c = clusters("qwen2")
    fixed = micro_batch(0)
    n_fixed = n_tokens(fixed)
    loss = lambda members: c.one(members, "eval_loss", mb=fixed, num_step_tokens=n_fixed)
    report = {}
    all4 = [0, 1, 2, 3]

    def handoff(old, new, tp, pp, name):
        """Save in the old world, rebuild, check the loss is unchanged."""
        before = loss(old)
        t0 = time.perf_counter()
        c.on(old, "save_checkpoint", path=str(tmp_path / name))
        save_s = time.perf_counter() - t0
        leaving = [m for m in old if m not in new]
        if leaving:
            c.on(leaving, "leave")
        joins = c.world(new, tp, pp, checkpoint=str(tmp_path / name))
        after = loss(new)
        report[name] = {"loss_before": before, "loss_after": after,
                        "rel_diff": abs(after - before) / abs(before), "save_s": save_s,
                        "load_s": max(j["load_s"] for j in joins.values())}
        assert _close(before, after), report[name]

    def split_step(old, new, tp, pp, name, mb_a, mb_b):
        """mb_a, save mid-step, then (reference) mb_b + step in the old world; rebuild;
        mb_b + step in the new world: same parameters."""
        n_ab = n_tokens(mb_a, mb_b)
        c.on(old, "train_microbatch", mb=mb_a, num_step_tokens=n_ab)
        before = loss(old)
        c.on(old, "save_checkpoint", path=str(tmp_path / name))
        c.on(old, "train_microbatch", mb=mb_b, num_step_tokens=n_ab)
        ref = c.on(old, "optimizer_step", publish_dir=str(tmp_path / f"{name}-ref"))[old[0]]
        leaving = [m for m in old if m not in new]
        if leaving:
            c.on(leaving, "leave")
        c.world(new, tp, pp, checkpoint=str(tmp_path / name))
        after = loss(new)
        assert _close(before, after), (before, after)
        stats = c.on(new, "train_microbatch", mb=mb_b, num_step_tokens=n_ab)
        assert sum(s["trajectories"] for s in stats.values()) == len(mb_b)
        assert sum(s["tokens"] for s in stats.values()) == n_tokens(mb_b)
        got = c.on(new, "optimizer_step", publish_dir=str(tmp_path / f"{name}-got"))[new[0]]
        diff = _params_diff(tmp_path / f"{name}-ref", tmp_path / f"{name}-got")
        report[name] = {"loss_before": before, "loss_after": after,
                        "rel_diff": abs(after - before) / abs(before),
                        "grad_norm_ref": ref["grad_norm"], "grad_norm_got": got["grad_norm"],
                        "max_param_diff": diff}
        assert got["version"] == ref["version"]
        assert _close(ref["grad_norm"], got["grad_norm"]), report[name]
        # Adam divides by sqrt(v): elements with near-zero gradients turn float noise of the
        # layout change into ~1e-5 (lr 1e-2); a lost micro-batch would move them ~lr.
        assert diff < 1e-4, report[name]

    c.world(all4, 2, 2, init_weights=str(c.weights))
    l0 = loss(all4)
    mb1 = micro_batch(1)
    c.on(all4, "train_microbatch", mb=mb1, num_step_tokens=n_tokens(mb1))
    step = c.on(all4, "optimizer_step")[0]
    assert step["version"] == 1 and loss(all4) != l0
    handoff(all4, [0, 1], 1, 2, "ck1")                     # 4 -> 2 (2 processes leave)
    mb2 = micro_batch(2)
    c.on([0, 1], "train_microbatch", mb=mb2, num_step_tokens=n_tokens(mb2))
    assert c.on([0, 1], "optimizer_step")[0]["version"] == 2
    split_step([0, 1], all4, 2, 2, "ck2", micro_batch(3), micro_batch(4))   # 2 -> 4
    split_step(all4, all4, 1, 2, "ck3", micro_batch(5), micro_batch(6))     # DP 1 -> 2
    split_step(all4, all4, 2, 2, "ck4", micro_batch(7), micro_batch(8))     # DP 2 -> 1
    versions = {d["version"] for d in c.on(all4, "digests").values()}
    assert versions == {5}
    assert not list(tmp_path.glob(".*tmp*"))  # every write was renamed into place
    for name, r in report.items():
        print(name, {k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in r.items()})
    print("timings (s, per call):", {k: [round(x, 3) for x in v]
                                     for k, v in c.timings.items()})


# ---- 4. tree packing ---------------------------------------------------------------------

@pytest.mark.slow
def test_tree_packed_step_matches_the_torch_trainer(clusters, models, store, tmp_path):
    """Branchy runs (shared prefixes), tree-packed: Megatron at TP1/PP1 x DP4 (whole runs
    per replica) and TP2/PP2 (one packed sequence per run through the 1F1B pipeline) give
    the loss of the rows layout and of transformers, compute only the trees' tokens, and
    TP2/PP2's step equals the torch trainer's tree-packed step; a step with no token to
    train after it changes nothing."""
    from gyre_slurm.train.dist import leave_world
    from gyre_slurm.train.worker import TrainerWorker
    from gyre_slurm.traj.treepack import tree_tokens

    c = clusters("qwen2")
    mb = batch_helpers.branchy_micro_batch(5, VOCAB, runs=4, branches=3)
    n = n_tokens(mb)
    with torch.no_grad():
        want = float(hf_loss(models["qwen2"][2], mb, n))
    fed = tree_tokens(mb)
    assert fed < sum(len(t["token_ids"]) for t in mb)
    for tp, pp in ((1, 1), (2, 2)):
        c.world([0, 1, 2, 3], tp, pp, init_weights=str(c.weights))
        tree = c.one(range(4), "eval_loss", mb=mb, num_step_tokens=n, packing="tree")
        rows = c.one(range(4), "eval_loss", mb=mb, num_step_tokens=n, packing="rows")
        print(f"TP{tp}/PP{pp}: tree {tree:.7f}, rows {rows:.7f}, transformers {want:.7f}")
        assert _close(tree, want) and _close(rows, want)
    stats = c.on(range(4), "train_microbatch", mb=mb, num_step_tokens=n, packing="tree")
    assert sum(s["tokens"] for s in stats.values()) == n
    assert sum(s.get("fed_tokens", 0) for s in stats.values()) == fed
    assert sum(s.get("pad_tokens", 0) for s in stats.values()) == 0
    got = c.on(range(4), "optimizer_step", publish_dir=str(tmp_path / "meg"))[0]
    got_lp = np.array(c.one(range(4), "token_logprobs", token_ids=IDS))
    # a step with no token to train changes nothing (AdamW's momentum would move it)
    empty = c.on(range(4), "optimizer_step", num_step_tokens=0)[0]
    assert empty["empty"] and empty["skipped"] and empty["grad_norm"] is None
    assert empty["version"] == got["version"] + 1
    assert np.array_equal(np.array(c.one(range(4), "token_logprobs", token_ids=IDS)), got_lp)

    port, gens = store
    worker = TrainerWorker(model_dir=c.model_dir, node_index=0, lr=1e-2, seed=0)
    worker.join(WorldSpec(next(gens), 1, HOST, port), 0, src_rank=0, init_weights=c.weights)
    try:
        s = worker.train_microbatch(mb, num_step_tokens=n, packing="tree")
        ref = worker.optimizer_step(publish_dir=tmp_path / "torch")
        ref_lp = hf_logprobs(worker.model.eval(), IDS)
    finally:
        leave_world()
    assert (s["tokens"], s["fed_tokens"]) == (n, fed)
    moved = float(np.abs(ref_lp - hf_logprobs(load_hf(c.model_dir, c.weights), IDS)).max())
    diff = float(np.abs(got_lp - ref_lp).max())
    params = _params_diff(tmp_path / "meg", tmp_path / "torch")
    print(f"tree step: grad norm {got['grad_norm']:.6f} (megatron TP2/PP2) vs "
          f"{ref['grad_norm']:.6f} (torch); logprobs differ by {diff:.2e} (the step moved "
          f"them {moved:.2e}); max param diff {params:.2e}")
    assert _close(got["grad_norm"], ref["grad_norm"])
    assert diff < 1e-4 < 1e-2 < moved
    # Adam's first step is about lr x sign(gradient): float noise in near-zero gradients
    # moves those elements by up to ~lr, without changing the function (logprobs above)
    assert params < 1e-3


# ---- 5. export to Hugging Face; Qwen3-MoE's parity and tree packing ---------------------

@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [("qwen2", (2, 2, 1)), ("qwen3_moe", (2, 1, 2)),
                                           ("qwen2_tied", (2, 2, 1))])
def test_published_weights_load_into_transformers(clusters, models, tmp_path, family, layout):
    """One step (qwen2 at TP2/PP2; qwen3_moe at TP2/EP2/DP2 with sequence parallelism;
    a tied qwen2 at TP2/PP2, the embedding's gradient summed with its copy's),
    published in Hugging Face names: transformers loads it (strict) and agrees with
    Megatron; the step equals the same step taken on the transformers model (global
    grad norm, clipping, AdamW)."""
    c = clusters(family)
    tp, pp, ep = layout
    c.world([0, 1, 2, 3], tp, pp, expert_parallel=ep, init_weights=str(c.weights))
    mb = micro_batch(11)
    c.on(range(4), "train_microbatch", mb=mb, num_step_tokens=n_tokens(mb))
    out = tmp_path / "v000001"
    steps = c.on(range(4), "optimizer_step", publish_dir=str(out))
    assert {s["version"] for s in steps.values()} == {1}
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "model.safetensors"]
    got = np.array(c.one(range(4), "token_logprobs", token_ids=IDS))
    model = load_hf(c.model_dir, out)
    diff = float(np.abs(hf_logprobs(model, IDS) - got).max())
    print(f"published v1: max |transformers - megatron| = {diff:.2e}")
    assert diff < 1e-4
    before = hf_logprobs(load_hf(c.model_dir, c.weights), IDS)
    assert float(np.abs(before - got).max()) > 1e-4  # the step did change the model

    ref = load_hf(c.model_dir, c.weights).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    hf_loss(ref, mb, n_tokens(mb)).backward()
    grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    opt.step()
    # AdamW's first step moves an element by lr * g / (|g| + eps): where the gradient is
    # of the order of eps (1e-8) float noise in it moves the step by up to lr, so the
    # step is compared where the reference gradient is 100 eps or more (a tied model's
    # gate_proj had one element of gradient 9.5e-9 off by 1.007e-4; the others 2.5e-5)
    state = model.state_dict()
    param_diff = max(float(((p.detach() - state[k]).abs() * (grads[k].abs() >= 1e-6)).max())
                     for k, p in ref.named_parameters())
    print(f"step vs transformers: grad norm {steps[0]['grad_norm']:.6f} vs {norm:.6f}, "
          f"max param diff {param_diff:.2e}")
    assert _close(steps[0]["grad_norm"], norm)
    assert param_diff < 1e-4


@pytest.mark.slow
def test_moe_logprobs_match_transformers(clusters, models):
    check_parity(clusters, models, "qwen3_moe")


@pytest.mark.slow
def test_tree_packing_trains_moe_with_expert_parallelism(clusters, models, tmp_path):
    """Qwen3-MoE, experts split over EP 2 (TP2 x EP2 with sequence parallelism, and TP1 x
    EP2 x DP4): tree and rows packing of branchy runs give transformers' loss, and one
    step from each gives the same gradient norm and the same weights."""
    c = clusters("qwen3_moe")
    mb = batch_helpers.branchy_micro_batch(7, VOCAB, runs=4, branches=3)
    n = n_tokens(mb)
    with torch.no_grad():
        want = float(hf_loss(models["qwen3_moe"][2], mb, n))
    for tp in (2, 1):
        steps = {}
        for packing in ("tree", "rows"):
            c.world([0, 1, 2, 3], tp, 1, init_weights=str(c.weights), expert_parallel=2)
            info = c.on(range(4), "layout_info")
            for rank in range(4):  # Megatron's own ranks, as the weight-sync plan lays them
                lay = planlib.TrainerLayout("megatron", 4, tp=tp, ep=2)
                assert rank == lay.rank(tp=info[rank]["tp_rank"], pp=0,
                                        dp=info[rank]["dp_rank"])
                assert rank % 2 == info[rank]["ep_rank"]  # expert_rank(ep, 0, edp)
            loss = c.one(range(4), "eval_loss", mb=mb, num_step_tokens=n, packing=packing)
            stats = c.on(range(4), "train_microbatch", mb=mb, num_step_tokens=n,
                         packing=packing)
            assert sum(s["tokens"] for s in stats.values()) == n
            steps[packing] = c.on(range(4), "optimizer_step",
                                  publish_dir=str(tmp_path / f"{packing}{tp}"))[0]
            print(f"TP{tp}/EP2 {packing}: loss {loss:.7f} (transformers {want:.7f}), grad "
                  f"norm {steps[packing]['grad_norm']:.7f}")
            assert _close(loss, want)
        params = _params_diff(tmp_path / f"tree{tp}", tmp_path / f"rows{tp}")
        print(f"TP{tp}/EP2: tree vs rows step, max param diff {params:.2e}")
        assert _close(steps["tree"]["grad_norm"], steps["rows"]["grad_norm"])
        assert params < 1e-3  # Adam's first step: ~lr x sign(g) on near-zero gradients
