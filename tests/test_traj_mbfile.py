"""Micro-batch files (gyre_slurm.traj.mbfile): what the coordinator writes is what every
rank reads back, exactly, and packs to the same inputs; a file the writer could not have
made (torn, foreign, inconsistent) is a BadMicrobatch naming the file and the fault."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save
from test_traj_props import runs

from gyre_slurm.train.loss import rows_from_trajectories
from gyre_slurm.traj import mbfile
from gyre_slurm.traj.encode import encode_run
from gyre_slurm.traj.process import process_run
from gyre_slurm.traj.records import token_digest
from gyre_slurm.traj.treepack import pack_trees, shard, tree_tokens


def _trajectories(run_list):
    out = []
    for i, (calls, k) in enumerate(run_list):
        calls = [c.__class__(**{**c.__dict__, "run_id": f"run-{i}-é"}) for c in calls]
        result = process_run(encode_run(calls), max_per_run=k, advantage=i / 3 - 0.5)
        out += [t.to_json() for t in result.trajectories]
    return out


def _same_packing(a, b):
    pa, pb = pack_trees(a), pack_trees(b)
    for field in ("token_ids", "position_ids", "parent", "subtree_end", "cu_runs", "target",
                  "logprobs", "advantages", "versions", "seq_ids", "path_index", "cu_paths"):
        x, y = getattr(pa, field), getattr(pb, field)
        assert x.dtype == y.dtype and np.array_equal(x, y), field
    assert pa.run_ids == pb.run_ids


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(runs(), st.integers(1, 4)), min_size=1, max_size=3))
def test_what_the_coordinator_writes_every_rank_reads_back_exactly(tmp_path_factory, run_list):
    trajs = _trajectories(run_list)
    # a call with an empty prompt trains its first token, which nothing predicts: the
    # packers refuse that (tests/test_traj_treepack.py)
    assume(trajs and not any(t["loss_mask"][0] for t in trajs))
    path = tmp_path_factory.mktemp("mb") / "step000000_mb00000.safetensors"
    size = mbfile.write(path, trajs)
    assert path.stat().st_size == size
    back = mbfile.read(path)
    assert len(back) == len(trajs)
    for t, b in zip(trajs, back):
        assert set(b) == set(t)
        for key in ("run_id", "policy_version", "advantage"):
            assert b[key] == t[key] and type(b[key]) is type(t[key]), key
        for key in mbfile.ARRAYS:
            assert b[key].tolist() == t[key], key  # logprobs: the same float32 values
        assert token_digest(b["token_ids"]) == token_digest(t["token_ids"])
    # the trainer's inputs are the same whichever form it got
    _same_packing(trajs, back)
    assert tree_tokens(back) == tree_tokens(trajs)
    for rank in range(2):
        assert [t["run_id"] for t in shard(back, rank=rank, world_size=2, packing="tree")] \
            == [t["run_id"] for t in shard(trajs, rank=rank, world_size=2, packing="tree")]
    ra, rb = rows_from_trajectories(trajs), rows_from_trajectories(back)
    assert set(ra) == set(rb)
    for key in ra:
        assert ra[key].dtype == rb[key].dtype and bool((ra[key] == rb[key]).all()), key


def _traj(run_id="r", n=5, **extra):
    return {"run_id": run_id, "token_ids": list(range(100, 100 + n)),
            "loss_mask": [0, 0] + [1] * (n - 2), "logprobs": [0.0, 0.0] + [-0.5] * (n - 2),
            "versions": [-1, -1] + [3] * (n - 2), "policy_version": 3, "advantage": 0.25,
            **extra}


def test_numpy_arrays_and_lists_make_the_same_file(tmp_path):
    """(The header's JSON order is safetensors' own: files compare by what they hold.)"""
    a = [_traj("a"), _traj("b", 7)]
    b = [{k: np.asarray(v) if isinstance(v, list) else v for k, v in t.items()} for t in a]
    # numpy scalars among the other fields are the numbers they are
    c = [dict(t, policy_version=np.int64(3), advantage=np.float32(0.25)) for t in b]
    held = []
    for i, form in enumerate((a, b, c)):
        mbfile.write(tmp_path / f"{i}.safetensors", form)
        held.append([{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in t.items()}
                     for t in mbfile.read(tmp_path / f"{i}.safetensors")])
    assert held[0] == held[1] == held[2] == a
    assert type(held[2][0]["policy_version"]) is int


def test_a_trajectory_the_writer_cannot_hold_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no versions"):
        mbfile.encode([{k: v for k, v in _traj("run-7").items() if k != "versions"}])
    bad = _traj("run-8")
    bad["logprobs"] = bad["logprobs"][:-1]
    with pytest.raises(ValueError, match="run-8.*logprobs holds 4 values for 5 tokens"):
        mbfile.encode([bad])
    with pytest.raises(ValueError, match="at least one"):
        mbfile.encode([])
    assert not list(tmp_path.iterdir())


def _tensors(trajs):
    n = sum(len(t["token_ids"]) for t in trajs)
    return {"token_ids": np.arange(n, dtype=np.int32), "loss_mask": np.ones(n, np.uint8),
            "logprobs": np.zeros(n, np.float32), "versions": np.zeros(n, np.int32),
            "offsets": np.cumsum([0] + [len(t["token_ids"]) for t in trajs]).astype(np.int64)}


META = {"format": mbfile.FORMAT, "trajectories": json.dumps([{"run_id": "r"}, {"run_id": "s"}])}
TWO = [_traj("r"), _traj("s", 3)]


def _variant(name):
    t, m = _tensors(TWO), dict(META)
    if name == "format":
        m["format"] = "gyre-microbatch/99"
    elif name == "no format":
        del m["format"]
    elif name == "fields not JSON":
        m["trajectories"] = "[{"
    elif name == "fields not a list":
        m["trajectories"] = json.dumps({"run_id": "r"})
    elif name == "one field too few":
        m["trajectories"] = json.dumps([{"run_id": "r"}])
    elif name == "offsets past the end":
        t["offsets"] = np.array([0, 5, 9], np.int64)
    elif name == "offsets backwards":
        t["offsets"] = np.array([0, 6, 5, 8], np.int64)
        m["trajectories"] = json.dumps([{}, {}, {}])
    elif name == "offsets int32":
        t["offsets"] = t["offsets"].astype(np.int32)
    elif name == "ids int64":
        t["token_ids"] = t["token_ids"].astype(np.int64)
    elif name == "mask short":
        t["loss_mask"] = t["loss_mask"][:-1]
    elif name == "ids 2-d":
        t["token_ids"] = t["token_ids"].reshape(2, 4)
    elif name == "no versions":
        del t["versions"]
    elif name == "extra tensor":
        t["rewards"] = np.zeros(2, np.float32)
    return save(t, metadata=m)


@pytest.mark.parametrize("name", [
    "format", "no format", "fields not JSON", "fields not a list", "one field too few",
    "offsets past the end", "offsets backwards", "offsets int32", "ids int64", "mask short",
    "ids 2-d", "no versions", "extra tensor"])
def test_a_file_the_writer_could_not_have_made_is_a_bad_microbatch(tmp_path, name):
    path = tmp_path / "step000001_mb00002.safetensors"
    path.write_bytes(_variant(name))
    with pytest.raises(mbfile.BadMicrobatch, match="step000001_mb00002"):
        mbfile.read(path)


def test_a_torn_or_foreign_file_is_a_bad_microbatch(tmp_path):
    good = mbfile.encode(TWO)
    path = tmp_path / "mb.safetensors"
    path.write_bytes(_variant("none"))
    assert [t["run_id"] for t in mbfile.read(path)] == ["r", "s"]
    for data in (good[: len(good) // 2], good[:7], b"", b"[]", b"\xff" * 64,
                 (2**62).to_bytes(8, "little") + b"{}"):
        path.write_bytes(data)
        with pytest.raises(mbfile.BadMicrobatch, match="mb.safetensors"):
            mbfile.read(path)
    path.unlink()
    with pytest.raises(mbfile.BadMicrobatch, match="mb.safetensors"):
        mbfile.read(path)  # gone (pruned under a rank that was late): said so, by name


def test_a_rewrite_replaces_the_file_whole(tmp_path):
    path = tmp_path / "step000000_mb00000.safetensors"
    mbfile.write(path, TWO)
    mbfile.write(path, [_traj("t", 9)])  # a rewound step's micro-batch, written again
    assert [(t["run_id"], len(t["token_ids"])) for t in mbfile.read(path)] == [("t", 9)]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
