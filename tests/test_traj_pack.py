"""Packing into micro-batches, deduplication stats, and run-level processing
(rejections, group advantages)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from traj_helpers import mk_run

from gyre_slurm.errors import UserError
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.pack import pack
from gyre_slurm.traj.process import group_advantages, process
from gyre_slurm.traj.records import Loaded, RunRecord
from gyre_slurm.traj.select import Trajectory

S = [1001, 1002]


def _traj(run_id: str, n: int, advantage: float = 0.0) -> Trajectory:
    mask = (np.arange(n) % 2).astype(np.uint8)
    return Trajectory(run_id, np.arange(1000, 1000 + n, dtype=np.int32), mask,
                      -mask.astype(np.float32) / 2, np.where(mask == 1, 7, -1),
                      7, advantage, 1)


# lengths, budget, expected micro-batches as lists of trajectory indices
PACK_CASES = [
    ([5, 3, 4, 2], 8, [[0, 1], [2, 3]]),
    ([8, 8], 8, [[0], [1]]),
    ([1, 1, 1], 8, [[0, 1, 2]]),
    ([6, 2, 6, 2], 8, [[0, 1], [2, 3]]),
    ([], 8, []),
]


@pytest.mark.parametrize("lengths,budget,expected", PACK_CASES)
def test_pack_first_fit_decreasing(lengths, budget, expected):
    trajs = [_traj(f"r{i}", n) for i, n in enumerate(lengths)]
    batches = pack(trajs, max_tokens=budget)
    assert [[int(r[1:]) for r in b.run_ids] for b in batches] == expected


def test_pack_rejects_a_trajectory_over_budget():
    with pytest.raises(UserError, match="run 'big': a trajectory of 9 tokens"):
        pack([_traj("big", 9)], max_tokens=8)


@given(st.lists(st.integers(1, 20), max_size=12), st.integers(20, 60))
def test_packed_fields_stay_aligned(lengths, budget):
    trajs = [_traj(f"r{i}", n, advantage=float(i)) for i, n in enumerate(lengths)]
    batches = pack(trajs, max_tokens=budget)
    assert sorted(r for b in batches for r in b.run_ids) == sorted(t.run_id for t in trajs)
    for b in batches:
        assert b.num_tokens <= budget and b.cu_seqlens[-1] == b.num_tokens
        for k, run_id in enumerate(b.run_ids):
            t = trajs[int(run_id[1:])]
            lo, hi = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
            assert b.token_ids[lo:hi].tolist() == t.token_ids.tolist()
            assert b.loss_mask[lo:hi].tolist() == t.loss_mask.tolist()
            assert b.logprobs[lo:hi].tolist() == t.logprobs.tolist()
            assert b.versions[lo:hi].tolist() == t.versions.tolist()
            assert b.position_ids[lo:hi].tolist() == list(range(hi - lo))
            assert set(b.advantages[lo:hi].tolist()) == {t.advantage}


def test_dedup_stats_compare_with_a_per_call_split():
    calls = mk_run([(S, [2001, 2002]), (S + [2001, 2002, 3001], [2003]),
                    (S + [2001, 2002, 3001, 2003, 3002], [2004])])
    result = process(Loaded({"r": encode_run(calls)}, []))
    stats = result.summary()["dedup"]
    assert (stats["naive_tokens"], stats["naive_trained"]) == (4 + 6 + 8, 4)
    assert (stats["traj_tokens"], stats["trained_tokens"], stats["tree_tokens"]) == (8, 4, 8)
    assert stats["fed_vs_naive"] == round(8 / 18, 6) and stats["coverage"] == 1.0


def test_group_advantage_is_reward_minus_mean_of_ok_runs_of_the_task():
    runs = {r.run_id: r for r in [
        RunRecord("a", "t1", 1.0, "ok"), RunRecord("b", "t1", 0.0, "ok"),
        RunRecord("c", "t1", 0.0, "failed"), RunRecord("d", "t2", 0.25, "ok")]}
    assert group_advantages(runs) == {"a": 0.5, "b": -0.5, "d": 0.0}


def test_rejected_runs_say_why_and_others_are_kept():
    ok = encode_run(mk_run([(S, [2001])], run_id="ok"))
    broken = encode_run(mk_run([(S, [2001]), (S + [2001], [2002])], run_id="broken"))
    broken[1] = broken[1].__class__(**{**broken[1].__dict__, "parent_call": 5})
    failed = encode_run(mk_run([(S, [2001])], run_id="failed"))
    orphan = encode_run(mk_run([(S, [2001])], run_id="orphan"))
    runs = {"ok": RunRecord("ok", "t", 1.0, "ok"), "broken": RunRecord("broken", "t", 0, "ok"),
            "failed": RunRecord("failed", "t", 0.0, "timeout", "wall clock"),
            "empty": RunRecord("empty", "t", 0.0, "ok"),
            "crashed": RunRecord("crashed", "t", 0.0, "failed")}
    loaded = Loaded({"ok": ok, "broken": broken, "failed": failed, "orphan": orphan}, [])
    result = process(loaded, runs=runs, calls_file="c.jsonl", runs_file="r.jsonl")
    assert [r.run_id for r in result.runs] == ["ok"]
    why = {e.run_id: (e.call, e.reason, e.kind) for e in result.rejected}
    assert why == {
        "broken": (1, "parent call 5 is not an earlier call of the run", "record"),
        "failed": (None, "run status timeout: wall clock", "status"),
        "orphan": (None, "no run record", "record"),
        "empty": (None, "run has no calls", "record"),
        "crashed": (None, "run status failed (no reason given)", "status"),
    }
