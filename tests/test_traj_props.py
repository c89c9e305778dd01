"""Property tests: random scaffold-like runs (extend, retry, fork, restart, re-send an
earlier output) over small token alphabets, so that paths collide often, checked against
a brute-force oracle of which token prefixes were generated."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from traj_helpers import mk_call, oracle_trainable, trained_nodes

from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.store import CallStoreReader, CallStoreWriter, load_store

USER = st.lists(st.sampled_from([1001, 1002, 1003]), min_size=0, max_size=3)
TOOL = st.lists(st.sampled_from([3001, 3002]), min_size=0, max_size=3)
OUTPUT = st.lists(st.sampled_from([2001, 2002, 2003]), min_size=0, max_size=4)
OPS = ("new", "extend", "retry", "fork", "resend")


@st.composite
def runs(draw, max_calls: int = 8):
    calls = []
    for i in range(draw(st.integers(1, max_calls))):
        op = draw(st.sampled_from(OPS)) if calls else "new"
        j = draw(st.integers(0, len(calls) - 1)) if calls else 0
        seq = (np.concatenate([calls[j].prompt_ids, calls[j].output_ids]).tolist()
               if calls else [])
        if op == "new":
            prompt = draw(USER)
        elif op == "extend":
            prompt = seq + draw(TOOL)
        elif op == "retry":
            prompt = calls[j].prompt_ids.tolist()
        elif op == "fork":
            prompt = seq[:draw(st.integers(0, len(seq)))] + draw(USER)
        else:  # resend an earlier output after a rewritten prefix
            prompt = draw(USER) + calls[j].output_ids.tolist() + draw(TOOL)
        calls.append(mk_call(i, prompt, draw(OUTPUT), version=draw(st.integers(0, 3))))
    return calls


def _build(calls, k):
    return process_run(encode_run(calls), max_per_run=k)


@given(runs(), st.integers(1, 6))
def test_every_trainable_token_is_trained_at_most_once(calls, k):
    nodes = trained_nodes(_build(calls, k).trajectories)
    assert len(nodes) == len(set(nodes))
    assert set(nodes) <= set(oracle_trainable(calls))


@given(runs())
def test_with_k_at_least_leaves_all_trainable_tokens_are_trained(calls):
    num_leaves = len(_build(calls, 1).tree.leaves)
    result = _build(calls, max(1, num_leaves))
    assert set(trained_nodes(result.trajectories)) == set(oracle_trainable(calls))
    assert result.stats.trained_tokens == result.tree.num_trainable


@given(runs(), st.integers(1, 6))
def test_each_trajectory_is_a_path_of_the_tree_ending_a_call(calls, k):
    result = _build(calls, k)
    sequences = {tuple(np.concatenate([c.prompt_ids, c.output_ids]).tolist()) for c in calls}
    assert len(result.trajectories) <= k
    for t in result.trajectories:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert result.tree.contains(t.token_ids)
        assert tuple(t.token_ids.tolist()) in sequences


@given(runs(), st.integers(1, 6))
def test_logprobs_and_versions_line_up_with_their_tokens(calls, k):
    oracle = oracle_trainable(calls)
    for t in _build(calls, k).trajectories:
        ids = t.token_ids.tolist()
        mine = []
        for i, (m, lp, v) in enumerate(zip(t.loss_mask.tolist(), t.logprobs.tolist(),
                                           t.versions.tolist())):
            if m:
                assert (lp, v) == oracle[tuple(ids[:i + 1])]
                mine.append(v)
            else:
                assert (lp, v) == (0.0, -1)
        assert mine and t.policy_version == min(mine)


@given(runs(), st.integers(1, 5))
def test_more_paths_only_add_trained_tokens(calls, k):
    fewer = set(trained_nodes(_build(calls, k).trajectories))
    assert fewer <= set(trained_nodes(_build(calls, k + 1).trajectories))


@given(runs())
def test_tree_holds_each_distinct_prefix_once(calls):
    prefixes = set()
    for c in calls:
        seq = np.concatenate([c.prompt_ids, c.output_ids]).tolist()
        prefixes |= {tuple(seq[:i + 1]) for i in range(len(seq))}
    tree = _build(calls, 1).tree
    assert tree.num_tokens == len(prefixes)
    assert tree.num_trainable == len(oracle_trainable(calls))


@given(runs())
def test_delta_form_round_trips(calls):
    back = list(decode_run(encode_run(calls)))
    assert [c.to_json() for c in back] == [c.to_json() for c in calls]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(runs())
def test_stored_prompt_shares_the_longest_prefix_with_an_earlier_call(calls):
    seqs = [np.concatenate([c.prompt_ids, c.output_ids]).tolist() for c in calls]
    for d, c in zip(encode_run(calls), calls):
        prompt = c.prompt_ids.tolist()
        best = max([_common(prompt, s) for s in seqs[:c.call]], default=0)
        assert d.shared_len == best and (d.parent_call >= 0) == (best > 0)
        if d.parent_call >= 0:
            assert seqs[d.parent_call][:best] == prompt[:best]


@settings(max_examples=50, deadline=None)
@given(runs())
def test_store_round_trips(calls):
    with tempfile.TemporaryDirectory() as run_dir:
        with CallStoreWriter(run_dir, "w0", fsync_interval_s=None) as writer:
            for c in calls:
                writer.append(c)
        loaded = load_store(run_dir)
    assert loaded.errors == []
    back = list(decode_run(loaded.runs["r"]))
    assert [c.to_json() for c in back] == [c.to_json() for c in calls]


@settings(max_examples=60, deadline=None)
@given(runs(max_calls=4), st.data())
def test_a_cut_segment_never_yields_part_of_a_record(calls, data):
    with tempfile.TemporaryDirectory() as run_dir:
        ends = []
        with CallStoreWriter(run_dir, "w0", fsync_interval_s=None) as writer:
            for c in calls:
                writer.append(c)
                ends.append(writer.num_bytes)
        seg = Path(run_dir, "calls", "w0.seg")
        cut = data.draw(st.integers(8, seg.stat().st_size))
        with open(seg, "r+b") as f:
            f.truncate(cut)
        live = CallStoreReader(run_dir).poll()
        final = CallStoreReader(run_dir).poll(final=True)
    whole = sum(1 for e in ends if e <= cut)
    assert [d.call for d, _, _ in live.calls] == list(range(whole)) and live.torn == ()
    assert [d.call for d, _, _ in final.calls] == list(range(whole))
    torn_at = max([8] + [e for e in ends if e <= cut])
    assert [(t.offset, t.num_bytes) for t in final.torn] == (
        [] if cut == torn_at else [(torn_at, cut - torn_at)])
