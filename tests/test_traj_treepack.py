"""Tree packing (pure): a run's trajectories laid out once per prefix-tree node, the tree
mask rule, per-token positions and predecessors, loss entries, and whole-run shards.
Token ids in bands: prompt 1000s, outputs 2000s, tool results 3000s."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_traj_props import runs
from traj_helpers import mk_run

from gyre_slurm.errors import UserError
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.treepack import (
    ancestors, assign_runs, pack_trees, run_tree_tokens, shard, tree_tokens)

S = [1001, 1002, 1003]


def _traj(run_id, ids, mask, adv=0.5, lp=-1.0):
    return {"run_id": run_id, "token_ids": list(ids), "loss_mask": list(mask),
            "logprobs": [lp if m else 0.0 for m in mask], "advantage": adv}


def test_compaction_branches_share_the_system_prompt_once():
    """Two branches after a compaction: [S a1 a2 t a3] and [S sum b1]; packed S once,
    the first branch, then the second (depth-first pre-order)."""
    a = _traj("r", S + [2001, 2002, 3001, 2003], [0, 0, 0, 1, 1, 0, 1], adv=1.0, lp=-0.5)
    b = _traj("r", S + [1009, 2004], [0, 0, 0, 0, 1], adv=1.0, lp=-0.25)
    tb = pack_trees([a, b])
    assert tb.token_ids.tolist() == S + [2001, 2002, 3001, 2003, 1009, 2004]
    assert tb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4]
    assert tb.parent.tolist() == [-1, 0, 1, 2, 3, 4, 5, 2, 7]
    assert tb.subtree_end.tolist() == [9, 9, 9, 7, 7, 7, 7, 9, 9]
    assert ancestors(tb, 8).tolist() == [0, 1, 2, 7, 8]  # S, sum, b1: its own prefix
    assert tb.target.tolist() == [3, 4, 6, 8]
    assert tb.seq_ids.tolist() == [0, 0, 0, 1]
    assert tb.logprobs.tolist() == [-0.5, -0.5, -0.5, -0.25]
    assert tb.traj_end.tolist() == [6, 8]
    assert (tb.num_tokens, tb.rows_tokens, tree_tokens([a, b])) == (9, 12, 9)


def test_runs_never_share_nodes_or_attention():
    """Two runs with the same tokens are packed twice, one after the other; no token of
    one run attends to the other."""
    t = [_traj(r, S + [2001, 2002], [0, 0, 0, 1, 1]) for r in ("x", "y", "x")]
    tb = pack_trees(t)
    assert tb.run_ids == ("x", "y") and tb.cu_runs.tolist() == [0, 5, 10]
    assert tb.num_tokens == 10 and tree_tokens(t) == 10
    for q in range(10):
        lo = 0 if q < 5 else 5
        assert ancestors(tb, q).tolist() == list(range(lo, q + 1))
    # the third trajectory (run x again, identical) trains the same nodes as the first;
    # entries come run by run
    assert tb.target.tolist() == [3, 4, 3, 4, 8, 9] and tb.seq_ids.tolist() == [0, 0, 2, 2, 1, 1]


def test_a_trajectory_that_is_a_prefix_of_another_adds_no_node():
    long = _traj("r", S + [2001, 2002, 2003], [0, 0, 0, 1, 1, 1], adv=1.0)
    short = _traj("r", S + [2001, 2002], [0, 0, 0, 0, 1], adv=-2.0)  # trains 2002 again
    tb = pack_trees([long, short])
    assert tb.num_tokens == 6 and tb.traj_end.tolist() == [5, 4]
    assert tb.target.tolist() == [3, 4, 5, 4]
    assert tb.advantages.tolist() == [1.0, 1.0, 1.0, -2.0]


@pytest.mark.parametrize("bad, message", [
    (_traj("r", [1, 2, 3], [1, 0, 0]), "first token of a trajectory has no prediction"),
    ({**_traj("r", [1, 2, 3], [0, 1, 1]), "logprobs": [0.0]}, "differ in length"),
    (_traj("r", [], []), "without tokens"),
])
def test_bad_trajectories_are_refused(bad, message):
    with pytest.raises(UserError, match=message):
        pack_trees([bad])
    with pytest.raises(UserError, match="no trajectories"):
        pack_trees([])


def _check(trajs, tb):
    """Every trajectory reads back from the packing: its last token's ancestors are its
    tokens, at positions 0.., each token's predecessor is the one before it, and its
    trained tokens are entries at those nodes with its logprobs and advantage."""
    for j, t in enumerate(trajs):
        ids = np.asarray(t["token_ids"])
        path = ancestors(tb, int(tb.traj_end[j]))
        assert tb.token_ids[path].tolist() == ids.tolist()
        assert tb.position_ids[path].tolist() == list(range(len(ids)))
        assert tb.parent[path].tolist() == [-1] + path[:-1].tolist()
        mine = tb.seq_ids == j
        trained = np.flatnonzero(np.asarray(t["loss_mask"]))
        assert tb.target[mine].tolist() == path[trained].tolist()
        np.testing.assert_array_equal(tb.logprobs[mine],
                                      np.asarray(t["logprobs"], np.float32)[trained])
        assert set(tb.advantages[mine].tolist()) <= {np.float32(t["advantage"])}
    for r in range(len(tb.run_ids)):
        lo, hi = int(tb.cu_runs[r]), int(tb.cu_runs[r + 1])
        ends = tb.subtree_end[lo:hi]
        assert (ends <= hi).all() and (ends > np.arange(lo, hi)).all()
        prefixes = {tuple(t["token_ids"][:i + 1]) for t in trajs if t["run_id"] == tb.run_ids[r]
                    for i in range(len(t["token_ids"]))}
        assert hi - lo == len(prefixes)  # each distinct prefix (tree node) exactly once


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(runs(), st.integers(1, 4)), min_size=1, max_size=3))
def test_random_scaffold_runs_pack_exactly(run_list):
    """Processor output of random runs (extend, retry, fork, restart, re-send), several
    runs per micro-batch, K from 1 to 4."""
    trajs = []
    for i, (calls, k) in enumerate(run_list):
        calls = [c.__class__(**{**c.__dict__, "run_id": f"r{i}"}) for c in calls]
        result = process_run(encode_run(calls), max_per_run=k, advantage=float(i) - 0.5)
        trajs += [dict(t.to_json(), versions=t.versions.tolist()) for t in result.trajectories]
    # a call with an empty prompt trains its first token, which nothing predicts: both
    # packings refuse that (test_bad_trajectories_are_refused)
    assume(trajs and not any(t["loss_mask"][0] for t in trajs))
    tb = pack_trees(trajs)
    _check(trajs, tb)
    assert tb.num_tokens == tree_tokens(trajs) <= tb.rows_tokens
    assert tb.num_entries == sum(sum(t["loss_mask"]) for t in trajs)


def test_tree_tokens_of_a_branchy_run_from_the_processor():
    """A linear run packs to its one trajectory; compaction + retry + a sub-agent fork
    share their prefixes; K=2 of 4 leaves packs only the chosen paths."""
    linear = mk_run([(S, [2001]), (S + [2001, 3001], [2002]), (S + [2001, 3001, 2002, 3002],
                                                                 [2003, 2004])])
    t = process_run(encode_run(linear), max_per_run=5).trajectories
    assert len(t) == 1 and run_tree_tokens([x.token_ids for x in t]) == len(t[0])
    branchy = mk_run([
        (S, [2001, 2002]),                                  # 0
        (S + [2001, 2002, 3001], [2003]),                   # 1: extends 0
        (S + [2001, 2002, 3001], [2005]),                   # 2: a retry of 1
        (S + [1005], [2006, 2007]),                         # 3: compaction branch
        (S + [2001, 2002, 1007], [2008]),                   # 4: a sub-agent forked off 0
    ])
    every = process_run(encode_run(branchy), max_per_run=5).trajectories
    two = process_run(encode_run(branchy), max_per_run=2).trajectories
    assert len(every) == 4 and len(two) == 2
    tb = pack_trees(every)
    assert tb.num_tokens == 3 + 2 + 1 + 1 + 1 + 3 + 2 == tree_tokens(every)
    assert tb.rows_tokens == 7 + 7 + 6 + 7
    assert pack_trees(two).num_tokens == tree_tokens(two) < tb.num_tokens


def test_shards_take_whole_runs_balanced_by_tree_tokens():
    trajs = ([_traj("big", S + [2001] * k, [0, 0, 0] + [1] * k) for k in (30, 31)]
             + [_traj(f"s{i}", S + [2002] * 5, [0, 0, 0] + [1] * 5) for i in range(4)])
    parts = assign_runs(trajs, 2)
    assert parts == [[0, 1], [2, 3, 4, 5]]  # 34 tree tokens vs 4 x 8
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert assign_runs(trajs, 2) == parts  # deterministic
    assert shard(trajs, rank=1, world_size=2, packing="tree") == [trajs[i] for i in parts[1]]
    assert shard(trajs, rank=1, world_size=2, packing="rows") == trajs[1::2]
    assert assign_runs(trajs, 8)[6:] == [[], []]
    with pytest.raises(ValueError, match="choose one of tree, rows"):
        shard(trajs, rank=0, world_size=1, packing="packed")
