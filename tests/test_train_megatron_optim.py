"""Megatron's own optimizer for real (4 processes of the megatron environment, gloo):
bf16 parameters with fp32 master weights and moments, the distributed optimizer (that
state sharded over the data-parallel ranks), and expert parallelism. The sharded state
must survive every change of world the elastic runtime makes: cells joining and
leaving mid-step (DP 4 -> 2 -> 3 -> 4, the cell cycle 4 -> 2+2 -> 3+1 -> 4 with one rank
per cell) and a change of the expert layout, each compared with the same steps taken
in one uninterrupted world."""

import itertools

import numpy as np
import pytest

from gyre_slurm.train.dist import host_store
from megatron_procs import VOCAB, ClusterPool, DriverError, make_test_model
import batch_helpers
from batch_helpers import n_tokens

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
STEPS = [(1, 2), (3, 4), (5, 6)]  # the micro-batches (seeds) of each optimizer step
LR = 1e-2
# What a reshard may change: the order of float sums (DP 3 sums its gradients in another
# order than DP 4), which Adam turns into up to ~lr on elements whose gradient is ~0.
# fp32: two UNINTERRUPTED runs at DP 4 and DP 3 differ by 8.5e-5 after 3 steps, so
# |got - ref| <= ATOL per element with ATOL = LR / 10; a lost or doubled
# micro-batch, or a wrong optimizer state, moves parameters by ~LR (a shared Adam step
# counter after a load moved them by 33x their size). The eval loss: within LOSS_TOL.
# bf16: each rank's forward and backward run in bf16 on its own share of the batch, so
# the gradients of DP 2, 3 and 4 differ by bf16 rounding (~1e-3), and at LR 1e-2 two
# UNINTERRUPTED runs at DP 4 and DP 2 end 26x ATOL and 2.2% in eval loss apart (DP 3:
# 31x, 2.8%). There the reshard is held to that floor, measured in the same test (the
# worst of the two uninterrupted runs, times NOISE_MARGIN), and near-exactness where it
# holds: a reload into the same layout mid-step, whose only change is where the sum of
# the first micro-batch's gradients is taken (fp32 association: measured 1e-7 in the eval
# loss, 1.8e-2 x ATOL in the weights; bf16: 0), within SAME_TOL x ATOL and SAME_LOSS_TOL.
# On an environment built fresh on 2026-12-03 (the pinned torch 2.13.0 and megatron-core
# 0.19.2, the unpinned packages as resolved that day) the same reload measures 1.52e-6 in
# the eval loss and 2.4e-2 x ATOL in the weights, every run alike: the loss bound, 1e-6
# until then, is 1e-5 (a lost or doubled micro-batch moves the weights by ~LR, 400x
# what this reload moves them).
ATOL = LR / 10
SAME_TOL = 0.1
SAME_LOSS_TOL = 1e-5
LOSS_TOL = 1e-4
NOISE_MARGIN = 1.5
@pytest.fixture(scope="module")
def clusters(megatron_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("optim")
    models = {f: make_test_model(root, f, seed=5) for f in ("qwen3", "qwen3_moe")}
    store, port = host_store(HOST)
    pool = ClusterPool(models=models, python=megatron_python, log_root=root, host=HOST,
                       port=port, gens=itertools.count(1), lr=LR, seed=0)
    yield pool.get
    pool.close()
    del store


def mb(seed):
    return batch_helpers.micro_batch(seed, 6, VOCAB)


def run(c, worlds, out, *, layout_kw):
    """Train STEPS through a sequence of worlds: `worlds[i]` = (members, tp, ep) is the
    world that trains micro-batch i of the flattened STEPS (a new world loads the last
    one's mid-step checkpoint). Publishes the final weights to `out`; returns the
    eval loss on a fixed batch after each step."""
    fixed = mb(0)
    members, losses, previous = None, [], None
    flat = [(s, seed) for s, pair in enumerate(STEPS) for seed in pair]
    for i, ((step, seed), world) in enumerate(zip(flat, worlds)):
        if world != previous:
            new, tp, ep = world
            kw = dict(layout_kw, tensor_parallel=tp, pipeline_parallel=1, expert_parallel=ep)
            if members is None:
                c.world(new, init_weights=str(c.weights), **kw)
            else:
                ck = out.parent / f"{out.name}-ck{i}"
                c.on(members, "save_checkpoint", path=str(ck))
                if [m for m in members if m not in new]:
                    c.on([m for m in members if m not in new], "leave")
                c.world(new, checkpoint=str(ck), **kw)
            members, previous = new, world
        n = n_tokens(*(mb(s) for s in STEPS[step]))
        c.on(members, "train_microbatch", mb=mb(seed), num_step_tokens=n)
        if seed == STEPS[step][-1]:
            last = step == len(STEPS) - 1
            res = c.on(members, "optimizer_step", publish_dir=str(out) if last else None)
            assert res[members[0]]["version"] == step + 1 and not res[members[0]]["skipped"]
            losses.append(c.one(members, "eval_loss", mb=fixed, num_step_tokens=n_tokens(fixed)))
    return losses


def compare(a_dir, b_dir):
    """The worst element of all published tensors, as |a - b| / ATOL."""
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a) / ATOL


def loss_diff(ref, got):
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


W4 = ([0, 1, 2, 3], 1, 1)
CYCLE = [W4, ([0, 1], 1, 1), ([0, 1], 1, 1), ([0, 1, 2], 1, 1), ([0, 1, 2], 1, 1), W4]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distributed_optimizer_survives_the_cell_cycle(clusters, tmp_path, precision):
    """One rank per cell, TP1: cells 4 -> 2 (+2 rolling out) -> 3 (+1) -> 4, each change
    between two micro-batches of a step, against the same three steps in 4 cells; and a
    reload mid-step into the same layout (other processes as ranks), near-exact."""
    c = clusters("qwen3")
    kw = {"precision": precision, "distributed_optimizer": True}
    ref = run(c, [W4] * 6, tmp_path / "ref", layout_kw=kw)
    assert len(set(np.round(ref, 6))) == len(ref)  # every step moved the model
    again = ([1, 0, 3, 2], 1, 1)
    same = run(c, [W4] + [again] * 5, tmp_path / "same", layout_kw=kw)
    same_diff = compare(tmp_path / "ref", tmp_path / "same")
    print(f"{precision}: reloaded mid-step into the same layout: {same_diff:.2e} x ATOL, "
          f"eval loss {loss_diff(ref, same):.2e}")
    assert same_diff <= SAME_TOL and loss_diff(ref, same) <= SAME_LOSS_TOL
    got = run(c, CYCLE, tmp_path / "got", layout_kw=kw)
    diff, ldiff = compare(tmp_path / "ref", tmp_path / "got"), loss_diff(ref, got)
    print(f"{precision} + distributed optimizer, 4 -> 2 -> 3 -> 4 cells: worst param diff "
          f"{diff:.2e} x ATOL, eval loss {got} vs {ref} (max rel {ldiff:.2e})")
    if precision == "fp32":
        assert diff <= 1.0 and ldiff <= LOSS_TOL
        return
    floor, lfloor = 0.0, 0.0
    for world in (([0, 1], 1, 1), ([0, 1, 2], 1, 1)):  # uninterrupted at DP 2 and DP 3
        out = tmp_path / f"dp{len(world[0])}"
        other = run(c, [world] * 6, out, layout_kw=kw)
        floor = max(floor, compare(tmp_path / "ref", out))
        lfloor = max(lfloor, loss_diff(ref, other))
    print(f"bf16 noise floor (uninterrupted DP 2, DP 3 vs DP 4): {floor:.2e} x ATOL, eval "
          f"loss {lfloor:.2e}")
    assert diff <= NOISE_MARGIN * floor and ldiff <= NOISE_MARGIN * lfloor


# qwen3's tests first, then qwen3_moe's: the pool keeps one family's processes alive, so
# each family's are started once (4 Megatron processes: ~25 s of CPU)
def test_bf16_training_tracks_fp32(clusters, tmp_path):
    """The same three steps at TP2 x DP2, fp32 with Megatron's plain optimizer and bf16
    with the distributed optimizer: the eval loss after each step within 5% (measured:
    0.36%, 0.55%, 1.8%; 0.43%, 0.60%, 2.8% on a freshly built environment; bf16 runs at
    this LR differ by 2-3% among themselves with the data-parallel size, see above), and
    bf16 trains: its loss moves every step."""
    c = clusters("qwen3")
    world = [([0, 1, 2, 3], 2, 1)] * 6
    fp32 = run(c, world, tmp_path / "fp32", layout_kw={"precision": "fp32",
                                                        "distributed_optimizer": False})
    bf16 = run(c, world, tmp_path / "bf16", layout_kw={"precision": "bf16",
                                                        "distributed_optimizer": True})
    rel = [abs(a - b) / abs(a) for a, b in zip(fp32, bf16)]
    print(f"eval loss after each step: fp32 {fp32}, bf16 {bf16}, relative diff "
          f"{[f'{r:.2e}' for r in rel]}")
    assert max(rel) < 0.05
    # bf16 trains: every step moves its loss, by a tenth of fp32's mean move at least (a
    # model whose bf16 updates were lost would not move at all). Step by step the two
    # differ more than that: on a freshly built environment fp32's third step rose the
    # loss by 0.0108 and bf16's by 0.0023 (each step's move against fp32's, a third of it
    # at least, failed there; the two runs still end within 2.8%).
    moved = sum(abs(a - b) for a, b in zip(fp32, fp32[1:])) / (len(fp32) - 1)
    assert all(abs(a - b) > moved / 10 for a, b in zip(bf16, bf16[1:])), (fp32, bf16)


def test_experts_reshard_when_the_expert_layout_changes(clusters, tmp_path):
    """Qwen3-MoE with the distributed optimizer (dense and expert state sharded over
    their data-parallel groups): EP4 on 4 ranks -> TP2/EP2 on 2 -> TP2/EP2 on 4 (DP 2)
    -> TP1/EP2 on 4 (expert DP 2), mid-step, against EP4 on 4 ranks throughout (fp32:
    the tolerance above; bf16's floor is the DP cycle's)."""
    c = clusters("qwen3_moe")
    kw = {"precision": "fp32", "distributed_optimizer": True}
    ref = run(c, [([0, 1, 2, 3], 1, 4)] * 6, tmp_path / "ref", layout_kw=kw)
    cycle = [([0, 1, 2, 3], 1, 4), ([0, 1], 2, 2), ([0, 1], 2, 2), ([0, 1, 2, 3], 2, 2),
             ([0, 1, 2, 3], 2, 2), ([0, 1, 2, 3], 1, 2)]
    got = run(c, cycle, tmp_path / "got", layout_kw=kw)
    diff, ldiff = compare(tmp_path / "ref", tmp_path / "got"), loss_diff(ref, got)
    print(f"MoE fp32, EP4 -> TP2/EP2 (2) -> TP2/EP2 (4) -> TP1/EP2: worst param diff "
          f"{diff:.2e} x ATOL, eval loss {got} vs {ref} (max rel {ldiff:.2e})")
    assert diff <= 1.0 and ldiff <= LOSS_TOL
    # TP1 x EP1 keeps the experts in the dense optimizer (Megatron): refused, saying so
    members = [0, 1, 2, 3]
    c.on(members, "save_checkpoint", path=str(tmp_path / "last"))
    refused = r"optimizer has 2 part\(s\) cannot load into this one's 1"
    with pytest.raises(DriverError, match=refused):
        c.world(members, checkpoint=str(tmp_path / "last"), tensor_parallel=1,
                pipeline_parallel=1, expert_parallel=1, **kw)
