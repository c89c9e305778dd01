"""Rank arithmetic of train cells and handoff plans (pure, table-driven)."""

import pytest

from gyre_slurm.train.layout import (expert_parallel_fits, expert_parallel_sizes, layout,
                                     plan_handoff)

# (cells, nodes_per_cell, ranks_per_node, tp, pp, world_size, dp_size, {node: rank})
LAYOUTS = [
    ((3,), 1, 1, 1, 1, 1, 1, {(3, 0): 0}),
    ((2, 0), 1, 1, 1, 1, 2, 2, {(2, 0): 0, (0, 0): 1}),
    ((5, 1, 4), 2, 1, 1, 1, 6, 6,
     {(5, 0): 0, (5, 1): 1, (1, 0): 2, (1, 1): 3, (4, 0): 4, (4, 1): 5}),
    ((1, 2), 2, 4, 2, 2, 16, 4, {(1, 0): 0, (1, 1): 4, (2, 0): 8, (2, 1): 12}),
    ((0, 1), 1, 4, 4, 2, 8, 1, {(0, 0): 0, (1, 0): 4}),  # a replica of two whole cells
]


@pytest.mark.parametrize("cells,npc,rpn,tp,pp,world,dp,ranks", LAYOUTS)
def test_layout_ranks(cells, npc, rpn, tp, pp, world, dp, ranks):
    lay = layout(cells, nodes_per_cell=npc, ranks_per_node=rpn, tp=tp, pp=pp)
    assert lay.world_size == world and lay.dp_size == dp
    assert {n: lay.rank_of(n) for n in lay.nodes} == ranks
    for rank in range(world):  # node_of inverts rank_of
        node, local = lay.node_of(rank)
        assert lay.rank_of(node, local) == rank
        assert lay.dp_rank(rank) == rank // (tp * pp)
    if rpn == 1:
        assert lay.node_ranks() == ranks


@pytest.mark.parametrize("kwargs,match", [
    (dict(cells=(1, 1), nodes_per_cell=1), "twice"),
    (dict(cells=(1,), nodes_per_cell=0), ">= 1"),
    (dict(cells=(1, 2, 3), nodes_per_cell=4, tp=6), "whole cells"),  # straddles cells
    (dict(cells=(1, 2, 3), nodes_per_cell=2, tp=4), "do not split"),  # 1.5 replicas
    (dict(cells=(1, 2), nodes_per_cell=2, tp=3), "fit in a cell"),
    (dict(cells=(1, 2, 3), nodes_per_cell=1, ep=2), "expert-parallel"),
])
def test_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layout(**kwargs)


@pytest.mark.parametrize("query", [(9, 0), (1, 2)])
def test_unknown_node(query):
    with pytest.raises(KeyError):
        layout((1, 2), nodes_per_cell=2).rank_of(query)


# (old cells, new cells, joining, leaving, keep_old_rank, src_rank, new ranks by cell)
HANDOFFS = [
    (None, (0, 1), [0, 1], [], None, None, {0: 0, 1: 1}),
    ((0, 1, 2, 3), (0, 1), [], [2, 3], 0, 0, {0: 0, 1: 1}),          # 4 -> 2
    ((0, 1, 2, 3), (2, 3), [], [0, 1], 2, 0, {2: 0, 3: 1}),          # old rank 0 leaves
    ((0, 1), (0, 1, 2), [2], [], 0, 0, {0: 0, 1: 1, 2: 2}),          # a member joins
    ((3, 1), (2, 1, 3), [2], [], 0, 2, {2: 0, 1: 1, 3: 2}),          # joins in front
    ((0,), (4,), [4], [0], None, None, {4: 0}),                      # nobody stays
]


@pytest.mark.parametrize("old,new,joining,leaving,keep,src,ranks", HANDOFFS)
def test_plan_handoff(old, new, joining, leaving, keep, src, ranks):
    old_l = None if old is None else layout(old, nodes_per_cell=1)
    plan = plan_handoff(old_l, layout(new, nodes_per_cell=1))
    assert [c for c, _ in plan.joining] == joining
    assert [c for c, _ in plan.leaving] == leaving
    assert plan.keep_old_rank == keep and plan.src_rank == src
    assert {c: r for (c, _), r in plan.new_ranks.items()} == ranks
    if src is not None:  # the source is a member of both worlds
        (node,) = [n for n, r in plan.new_ranks.items() if r == src]
        assert node in plan.staying and old_l.rank_of(node) == keep


def test_plan_handoff_multi_node_cells():
    plan = plan_handoff(layout((0, 1), nodes_per_cell=2), layout((1, 5), nodes_per_cell=2))
    assert plan.new_ranks == {(1, 0): 0, (1, 1): 1, (5, 0): 2, (5, 1): 3}
    assert plan.joining == ((5, 0), (5, 1)) and plan.leaving == ((0, 0), (0, 1))
    assert plan.keep_old_rank == 2 and plan.src_rank == 0


@pytest.mark.parametrize("world,tp,pp,experts,sizes", [
    (4, 1, 1, 8, [1, 2, 4]),
    (4, 2, 1, 8, [1, 2, 4]),     # expert TP 1: EP groups of a stage's 4 ranks
    (4, 2, 2, 8, [1, 2]),        # a stage holds 2 ranks
    (6, 2, 1, 8, [1, 2]),        # 3 and 6 do not divide 8 experts
    (6, 1, 1, 6, [1, 2, 3, 6]),
    (3, 2, 1, 8, []),            # not whole TP2 replicas
    (128, 4, 2, 128, [1, 2, 4, 8, 16, 32, 64]),  # Qwen3-MoE's 128 experts, 16 nodes of 8
])
def test_expert_parallel_sizes(world, tp, pp, experts, sizes):
    assert expert_parallel_sizes(world, num_experts=experts, tp=tp, pp=pp) == sizes
    for ep in sizes:  # each one makes a valid layout of that world
        layout(range(world), nodes_per_cell=1, tp=tp, pp=pp, ep=ep)


@pytest.mark.parametrize("per_cell,tp,pp,ep,fits", [
    (2, 2, 1, 2, True),   # configs/tiny-vllm-megatron-moe.yaml: worlds of 2, 4, 6 ranks
    (1, 1, 1, 2, False),  # a world of 3 one-rank cells holds no EP 2
    (8, 2, 2, 8, False),  # 8 ranks = 2 stages of 4: EP 8 needs 16
    (8, 2, 2, 2, True),
    (4, 8, 1, 8, True),   # a replica of two cells: worlds of 8, 16, ...
])
def test_expert_parallel_fits_every_world(per_cell, tp, pp, ep, fits):
    assert expert_parallel_fits(ep, ranks_per_cell=per_cell, tp=tp, pp=pp) is fits
    if fits:  # the smallest worlds of whole cells and whole replicas
        unit = max(per_cell, tp * pp)
        for k in (1, 2, 3):
            assert ep in expert_parallel_sizes(k * unit, num_experts=64, tp=tp, pp=pp)
