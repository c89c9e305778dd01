"""Prefix tree + K-path selection on hand-written runs (prompt tokens 1000s, outputs
2000s, tool results 3000s)."""

from __future__ import annotations

import numpy as np
import pytest
from traj_helpers import lp_of, mk_run, oracle_trainable

from gyre_slurm.traj.delta import check_run, decode_run
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.dump import dump_run, trajectory_rows, tree_lines
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.tree import build_tree

S = [1001, 1002]  # system prompt

# name, [(prompt, output) per call], K, expected [(token_ids, loss_mask)] in pick order
CASES = [
    ("linear run", [
        (S + [1003], [2001, 2002]),
        (S + [1003, 2001, 2002, 3001, 3002], [2003]),
        (S + [1003, 2001, 2002, 3001, 3002, 2003, 3003], [2004, 2005]),
    ], 5, [
        (S + [1003, 2001, 2002, 3001, 3002, 2003, 3003, 2004, 2005],
         [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]),
    ]),
    ("compaction restart", [
        (S + [1003], [2001, 2002]),
        (S + [1003, 2001, 2002, 3001], [2003]),
        (S + [1010, 1011], [2004]),  # compacted: system + summary
        (S + [1010, 1011, 2004, 3002], [2005]),
    ], 5, [
        (S + [1003, 2001, 2002, 3001, 2003], [0, 0, 0, 1, 1, 0, 1]),
        (S + [1010, 1011, 2004, 3002, 2005], [0, 0, 0, 0, 1, 0, 1]),
    ]),
    ("retry of the same prompt, two outputs", [
        (S, [2001, 2002]),
        (S, [2003]),
    ], 5, [
        (S + [2001, 2002], [0, 0, 1, 1]),
        (S + [2003], [0, 0, 1]),
    ]),
    ("retry that shares its first output token", [
        (S, [2001, 2002]),
        (S, [2001, 2003]),
    ], 5, [
        (S + [2001, 2002], [0, 0, 1, 1]),
        (S + [2001, 2003], [0, 0, 0, 1]),
    ]),
    ("sub-agent fork", [
        (S + [1003], [2001]),  # main agent spawns a sub-agent
        (S + [1003, 2001, 1020], [2002]),  # sub-agent, its instruction appended
        (S + [1003, 2001, 1020, 2002, 3001], [2003]),
        (S + [1003, 2001, 3005], [2004]),  # main agent, sub-agent result as a tool result
    ], 5, [
        (S + [1003, 2001, 1020, 2002, 3001, 2003], [0, 0, 0, 1, 0, 1, 0, 1]),
        (S + [1003, 2001, 3005, 2004], [0, 0, 0, 0, 0, 1]),
    ]),
    ("output re-sent in a rewritten context is context", [
        (S + [1003], [2001, 2002]),
        ([1001, 1005, 2001, 2002, 3001], [2003]),
    ], 5, [
        (S + [1003, 2001, 2002], [0, 0, 0, 1, 1]),
        ([1001, 1005, 2001, 2002, 3001, 2003], [0, 0, 0, 0, 0, 1]),
    ]),
    ("K smaller than the number of leaves", [
        (S, [2001]),
        (S, [2002, 2003, 2004]),
        (S, [2005, 2006]),
    ], 2, [
        (S + [2002, 2003, 2004], [0, 0, 1, 1, 1]),
        (S + [2005, 2006], [0, 0, 1, 1]),
    ]),
    ("tie broken by the earliest leaf", [
        (S, [2001]),
        (S, [2002]),
    ], 1, [
        (S + [2001], [0, 0, 1]),
    ]),
    ("output generated where an earlier prompt had it as context", [
        (S + [2001], [2005]),
        (S, [2001, 2002]),
    ], 5, [
        (S + [2001, 2005], [0, 0, 1, 1]),
        (S + [2001, 2002], [0, 0, 0, 1]),
    ]),
    ("empty output", [
        (S, []),
        (S + [3001], [2001]),
    ], 5, [
        (S + [3001, 2001], [0, 0, 0, 1]),
    ]),
]


@pytest.mark.parametrize("name,pairs,k,expected", CASES, ids=[c[0] for c in CASES])
def test_trajectories(name, pairs, k, expected):
    calls = mk_run(pairs)
    result = process_run(encode_run(calls), max_per_run=k)
    got = [(t.token_ids.tolist(), t.loss_mask.tolist()) for t in result.trajectories]
    assert got == [(list(ids), list(mask)) for ids, mask in expected]
    oracle = oracle_trainable(calls)
    for t in result.trajectories:
        ids = t.token_ids.tolist()
        for i, (m, lp) in enumerate(zip(t.loss_mask.tolist(), t.logprobs.tolist())):
            assert lp == (oracle[tuple(ids[:i + 1])][0] if m else 0.0)


def test_same_node_keeps_the_logprob_of_its_first_generation():
    calls = mk_run([(S, [2001, 2002]), (S, [2001, 2003])])
    result = process_run(encode_run(calls), max_per_run=5)
    first = result.trajectories[0]
    assert first.logprobs.tolist()[2] == lp_of(0, 0)
    assert len(result.tree.notes) == 1 and "kept call 0" in result.tree.notes[0]


def test_identical_retry_is_one_leaf_without_note():
    calls = mk_run([(S, [2001, 2002]), (S, [2001, 2002])])
    calls[1] = calls[1].__class__(**{**calls[1].__dict__, "output_logprobs":
                                     calls[0].output_logprobs})
    result = process_run(encode_run(calls), max_per_run=5)
    assert len(result.tree.leaves) == 1 and result.tree.notes == ()
    assert result.stats.trained_tokens == 2 and result.stats.naive_trained == 4


def test_generated_where_context_was_takes_the_generating_calls_logprob():
    calls = mk_run([(S + [2001], [2005]), (S, [2001, 2002])])
    traj = process_run(encode_run(calls), max_per_run=5).trajectories[0]
    assert traj.logprobs.tolist() == [0.0, 0.0, lp_of(1, 0), lp_of(0, 0)]


def test_policy_version_is_the_minimum_over_trained_tokens():
    calls = mk_run([(S, [2001]), (S + [2001, 3001], [2002]), (S + [2001, 3001, 2002], [2003])],
                   versions=[5, 3, 4])
    traj = process_run(encode_run(calls), max_per_run=5).trajectories[0]
    assert traj.policy_version == 3
    assert traj.versions.tolist() == [-1, -1, 5, -1, 3, 4]


def test_each_call_sequence_is_in_the_tree():
    calls = mk_run([pair for _, pairs, _, _ in CASES[:6] for pair in pairs])
    tree = build_tree(encode_run(calls))
    for rec in calls:
        seq = np.concatenate([rec.prompt_ids, rec.output_ids])
        assert tree.call_sequence(rec.call).tolist() == seq.tolist()
        assert tree.contains(seq)
    assert not tree.contains(np.array([1001, 1002, 2999]))


@pytest.mark.parametrize("name,pairs,k,expected", CASES, ids=[c[0] for c in CASES])
def test_delta_form_converts_losslessly(name, pairs, k, expected):
    calls = mk_run(pairs)
    deltas = encode_run(calls)
    assert check_run(deltas) is None
    back = list(decode_run(deltas))
    assert [c.to_json() for c in back] == [c.to_json() for c in calls]


def test_delta_stores_only_new_tokens_of_a_linear_run():
    calls = mk_run(CASES[0][1])
    deltas = encode_run(calls)
    assert [(d.parent_call, d.shared_len, d.new_ids.tolist()) for d in deltas] == [
        (-1, 0, S + [1003]), (0, 5, [3001, 3002]), (1, 8, [3003])]


@pytest.mark.parametrize("parent,shared,reason", [
    (3, 2, "parent call 3 is not an earlier call"),
    (0, 9, "shared length 9 exceeds parent call 0's 4 tokens"),
])
def test_inconsistent_deltas_are_reported(parent, shared, reason):
    deltas = encode_run(mk_run([(S, [2001, 2002]), (S + [2001, 2002], [2003])]))
    bad = deltas[1].__class__(**{**deltas[1].__dict__, "parent_call": parent,
                                 "shared_len": shared})
    problem = check_run([deltas[0], bad])
    assert problem is not None and problem[0] == 1 and reason in problem[1]


def test_dump_aligns_token_and_mask_rows():
    calls = mk_run(CASES[4][1])  # sub-agent fork
    result = process_run(encode_run(calls), max_per_run=5)
    rows = trajectory_rows(result.trajectories[0], width=40)
    blocks = [rows[i:i + 4] for i in range(1, len(rows), 5)]
    tokens, masks = [], []
    for pos, tok, mask, lp in blocks:
        assert pos.startswith("pos") and tok.startswith("token") and mask.startswith("mask")
        assert len(pos) == len(tok) == len(mask) <= 40
        tokens += tok.split()[1:]
        masks += mask.split()[1:]
    assert tokens == [str(t) for t in CASES[4][3][0][0]]
    assert masks == ["1" if m else "." for m in CASES[4][3][0][1]]
    text = dump_run(result.tree, result.selection, result.trajectories)
    assert "[t1]" in text and "gen c3 v1 1 tok -> t1: 2004" in text


def test_tree_lines_show_token_counts_per_branch():
    calls = mk_run(CASES[1][1])  # compaction restart
    lines = tree_lines(build_tree(encode_run(calls)))
    assert lines[0] == "run r: 12 tokens, 5 trainable, 2 leaves"
    assert lines[1] == "  ctx 2 tok (branch 12 tok): 1001 1002"
