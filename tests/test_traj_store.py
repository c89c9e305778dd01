"""The append-only call store: format, size, polling while writing, torn and corrupt
records, writer recovery, and the JSONL records it converts from and to."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from traj_helpers import mk_call, mk_run

from gyre_slurm.errors import UserError
from gyre_slurm.traj.delta import decode_run
from gyre_slurm.traj.records import collect_calls, collect_runs, parse_call
from gyre_slurm.traj.store import (
    FILE_MAGIC, CallStoreReader, CallStoreWriter, RunBuffer, encode_record, load_store,
)

S = [1001, 1002, 1003]


def _grow(num_calls: int, *, run_id: str = "r") -> list:
    pairs, seq = [], list(S)
    for i in range(num_calls):
        out = [2000 + i, 2100 + i]
        pairs.append((seq, out))
        seq = seq + out + [3000 + i]
    return mk_run(pairs, run_id=run_id)


def _write(run_dir, calls, writer_id="w0"):
    with CallStoreWriter(run_dir, writer_id, fsync_interval_s=None) as w:
        return [w.append(c) for c in calls], w.num_bytes


def test_round_trip_keeps_every_field(tmp_path):
    obj = {"run_id": "q17-r3", "call": 0, "prompt_ids": [1001, 1002], "output_ids": [2001],
           "output_logprobs": [-0.1], "policy_version": 12, "t_start": 0.25, "t_end": 1.5,
           "finish_reason": "stop", "model": "m-7b", "tags": {"retry": 1}}
    obj2 = {**obj, "call": 1, "prompt_ids": [1001, 1002, 2001, 3001], "output_ids": [],
            "output_logprobs": [], "finish_reason": "length"}
    with CallStoreWriter(tmp_path, "w0") as w:  # plain trajectory-format dicts are accepted
        w.append(obj)
    with CallStoreWriter(tmp_path, "w0") as w:  # reopened: appends after the first
        w.append(obj2)
    loaded = load_store(tmp_path)
    assert loaded.errors == []
    assert [r.to_json() for r in decode_run(loaded.runs["q17-r3"])] == [obj, obj2]


def test_a_run_costs_its_distinct_tokens(tmp_path):
    calls = _grow(200)
    deltas, num_bytes = _write(tmp_path, calls)
    distinct = len(S) + sum(len(c.output_ids) + 1 for c in calls) - 1
    generated = sum(len(c.output_ids) for c in calls)
    assert sum(len(d.new_ids) + len(d.output_ids) for d in deltas) == distinct
    naive = sum(4 * (len(c.prompt_ids) + 2 * len(c.output_ids)) for c in calls)
    overhead = num_bytes - 4 * distinct - 4 * generated
    assert overhead <= len(FILE_MAGIC) + 200 * 80 and num_bytes < naive / 10


def test_reader_polls_only_new_records(tmp_path):
    calls = _grow(4)
    reader = CallStoreReader(tmp_path)
    assert reader.poll().calls == ()
    with CallStoreWriter(tmp_path, "w0", fsync_interval_s=0) as w:
        w.append(calls[0])
        w.append(calls[1])
        first = reader.poll()
        w.append(calls[2])
        second = reader.poll()
    assert [d.call for d, _, _ in first.calls] == [0, 1]
    assert [d.call for d, _, _ in second.calls] == [2]
    assert reader.poll(final=True) == reader.poll()


def test_half_written_record_waits_then_arrives(tmp_path):
    calls = _grow(2)
    _write(tmp_path, calls[:1])
    seg = tmp_path / "calls" / "w0.seg"
    data = encode_record(_write(tmp_path / "other", calls)[0][1])
    reader = CallStoreReader(tmp_path)
    with open(seg, "ab") as f:
        f.write(data[:30])
        f.flush()
        assert [d.call for d, _, _ in reader.poll().calls] == [0]
        assert reader.poll().torn == ()
        f.write(data[30:])
    assert [d.call for d, _, _ in reader.poll().calls] == [1]


def test_torn_tail_is_reported_with_file_offset_run_and_call(tmp_path):
    _write(tmp_path, _grow(3, run_id="bad"))
    _write(tmp_path, _grow(2, run_id="good"), writer_id="w1")
    seg = tmp_path / "calls" / "w0.seg"
    size = seg.stat().st_size
    os.truncate(seg, size - 5)
    loaded = load_store(tmp_path)
    assert list(loaded.runs) == ["good"]
    (err,) = loaded.errors
    assert err.file == str(seg) and err.run_id == "bad" and err.call == 2
    assert err.where.startswith("offset ") and int(err.where.split()[1]) < size - 5
    assert "torn record" in err.reason


def test_corrupt_record_is_skipped_and_later_records_are_kept(tmp_path):
    calls = [mk_call(0, S, [2001], run_id="a"), mk_call(0, S, [2002], run_id="b"),
             mk_call(0, S, [2003], run_id="c")]
    _write(tmp_path, calls)
    seg = tmp_path / "calls" / "w0.seg"
    buf = bytearray(seg.read_bytes())
    second = len(FILE_MAGIC) + len(encode_record(_write(tmp_path / "x", calls[:1])[0][0]))
    buf[second + 40] ^= 0xFF  # a flipped byte inside run b's record
    seg.write_bytes(bytes(buf))
    loaded = load_store(tmp_path)
    assert sorted(loaded.runs) == ["a", "c"]
    (err,) = loaded.errors
    assert err.where == f"offset {second}" and "CRC mismatch" in err.reason


def test_writer_reopening_truncates_its_torn_tail(tmp_path, caplog):
    calls = _grow(3)
    _write(tmp_path, calls[:2])
    seg = tmp_path / "calls" / "w0.seg"
    good = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"GCAL\x10\x00")  # a crash mid-record
    _write(tmp_path, calls[2:])
    loaded = load_store(tmp_path)
    assert loaded.errors == [] and [d.call for d in loaded.runs["r"]] == [0, 1, 2]
    assert f"offset {good}" in caplog.text


def test_two_writers_of_one_run_merge_by_call_number(tmp_path):
    calls = _grow(4)
    _write(tmp_path, calls[0::2], writer_id="gw-a")
    _write(tmp_path, calls[1::2], writer_id="gw-b")
    loaded = load_store(tmp_path)
    assert [r.to_json() for r in decode_run(loaded.runs["r"])] == [c.to_json() for c in calls]


def test_not_a_segment_is_reported(tmp_path):
    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "x.seg").write_bytes(b"hello world")
    (err,) = load_store(tmp_path).errors
    assert "not a call segment" in err.reason and err.where == "offset 0"


@pytest.mark.parametrize("writer_id", ["", "a/b", "../x", "a b"])
def test_bad_writer_id_is_a_user_error(tmp_path, writer_id):
    with pytest.raises(UserError):
        CallStoreWriter(tmp_path, writer_id)


# Bad JSONL call records: (line, expected reason); each leaves only its own run out.
BAD_LINES = [
    ({"output_ids": [2001, 2002], "output_logprobs": [-0.1]},
     "2 output_ids but 1 output_logprobs"),
    ({"prompt_ids": [1001, -3]}, "prompt_ids[1] = -3 is negative"),
    ({"output_ids": [2001, 70000], "output_logprobs": [-0.1, -0.2]},
     "output_ids[1] = 70000 is out of vocab (size 50000)"),
    ({"prompt_ids": [1001, 1.5]}, "prompt_ids must be a list of integers"),
    ({"output_logprobs": [float("nan")]}, "output_logprobs must be a list of finite numbers"),
    # an integer past a float's range (JSON has no limit): a bad record, not an OverflowError
    ({"output_logprobs": [-10 ** 400]}, "output_logprobs must be a list of finite numbers"),
    ({"t_start": 10 ** 400}, "t_start and t_end must be finite numbers"),
    ({"output_logprobs": [0.5]}, "output_logprobs[0] = 0.5 is above 0: a log-probability is "
                                 "at most 0 (the sampler's log p of the token it drew)"),
    ({"policy_version": -1}, "policy_version must be an integer from 0 to 9223372036854775807"),
    ({"call": "4"}, "call must be an integer from 0 to 2147483647"),
]


@pytest.mark.parametrize("change,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_call_record_names_run_call_and_line(change, reason):
    good = {"run_id": "ok", "call": 0, "prompt_ids": [1001], "output_ids": [2001],
            "output_logprobs": [-0.5], "policy_version": 1}
    bad = {**good, "run_id": "bad", **change}
    lines = [json.dumps(good), json.dumps({**good, "run_id": "bad"}), json.dumps(bad)]
    loaded = collect_calls(lines, file="calls.jsonl", vocab_size=50000)
    assert list(loaded.runs) == ["ok"]
    (err,) = loaded.errors
    assert (err.file, err.where, err.run_id, err.reason) == (
        "calls.jsonl", "line 3", "bad", reason)
    assert err.call == (None if "call" in change else 0)


@pytest.mark.parametrize("reward", ["NaN", "Infinity", "1" + "0" * 400, "true", '"1"'])
def test_a_run_record_whose_reward_is_no_finite_number_is_a_bad_record(reward):
    lines = ['{"run_id": "ok", "status": "ok", "task_id": "t", "reward": 1}',
             '{"run_id": "bad", "status": "ok", "task_id": "t", "reward": %s}' % reward]
    runs, errors = collect_runs(lines, file="runs.jsonl")
    assert list(runs) == ["ok"]
    (err,) = errors
    assert (err.where, err.run_id, err.reason) == ("line 2", "bad",
                                                   "reward must be a finite number")


@pytest.mark.parametrize("calls,reason", [
    ([0, 0], "duplicate call number 0"),
    ([0, 2, 1], "call 1 comes after call 2: out of order"),
    ([0, 2], "call 1 is missing"),
])
def test_call_numbers_must_count_up_once(calls, reason):
    lines = [json.dumps(mk_call(c, S, [2001], run_id="x").to_json()) for c in calls]
    lines.append(json.dumps(mk_call(0, S, [2001], run_id="y").to_json()))
    loaded = collect_calls(lines, file="f.jsonl")
    assert list(loaded.runs) == ["y"]
    assert any(reason in e.reason and e.run_id == "x" for e in loaded.errors)


def test_parse_call_rounds_logprobs_to_float32_once():
    rec = parse_call({"run_id": "r", "call": 0, "prompt_ids": [], "output_ids": [2001],
                      "output_logprobs": [-0.1], "policy_version": 0})
    assert rec.output_logprobs.dtype == np.float32
    assert rec.to_json()["output_logprobs"] == [-0.1]
    assert parse_call(rec.to_json()).output_logprobs.tobytes() == rec.output_logprobs.tobytes()


def test_store_files_live_under_calls(tmp_path):
    _write(tmp_path, _grow(1), writer_id="gw-7")
    assert sorted(p.name for p in Path(tmp_path, "calls").iterdir()) == ["gw-7.seg"]


def test_run_buffer_hands_out_runs_while_writers_append(tmp_path):
    a, b = _grow(3, run_id="a"), _grow(2, run_id="b")
    buffer = RunBuffer(tmp_path)
    with CallStoreWriter(tmp_path, "w0", fsync_interval_s=None) as w:
        for rec in [a[0], b[0], a[1]]:
            w.append(rec)
        assert buffer.poll() == [] and buffer.run_ids() == ["a", "b"]
        w.append(b[1])
        buffer.poll()
        done = buffer.take("b")  # run b's record says it is over
        w.append(a[2])
    buffer.poll(final=True)
    assert [r.to_json() for r in decode_run(done.runs["b"])] == [c.to_json() for c in b]
    rest = buffer.take("a")
    assert [r.to_json() for r in decode_run(rest.runs["a"])] == [c.to_json() for c in a]
    assert buffer.run_ids() == [] and buffer.take("a").runs == {}


def test_run_buffer_rejects_a_run_with_a_torn_record(tmp_path):
    _write(tmp_path, _grow(2, run_id="a"))
    seg = tmp_path / "calls" / "w0.seg"
    os.truncate(seg, seg.stat().st_size - 3)
    buffer = RunBuffer(tmp_path)
    assert buffer.poll() == [] and buffer.take("a").runs["a"][0].call == 0  # live: waits
    buffer = RunBuffer(tmp_path)
    assert buffer.poll(final=True) == []  # the torn record names its run
    taken = buffer.take("a")
    assert taken.runs == {} and taken.errors[0].call == 1


def test_torn_last_jsonl_line_leaves_its_run_out():
    calls = [json.dumps(c.to_json()) for c in _grow(2, run_id="q17-r3")]
    other = json.dumps(mk_call(0, S, [2001], run_id="other").to_json())
    loaded = collect_calls([calls[0], other, calls[1][:40]], file="calls.jsonl")
    assert list(loaded.runs) == ["other"]
    (err,) = loaded.errors
    assert (err.run_id, err.call, err.where) == ("q17-r3", 1, "line 3")
    assert err.reason.startswith("not JSON")


def test_a_line_nested_too_deep_to_decode_leaves_its_run_out():
    """JSON nested past Python's recursion limit is no record of ours: its run is left
    out with the reason, the other runs load (it was a RecursionError out of the reader)."""
    calls = [json.dumps(c.to_json()) for c in _grow(2, run_id="q17-r3")]
    other = json.dumps(mk_call(0, S, [2001], run_id="other").to_json())
    deep = calls[1][:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    loaded = collect_calls([calls[0], other, deep], file="calls.jsonl")
    assert list(loaded.runs) == ["other"]
    (err,) = loaded.errors
    assert (err.run_id, err.where) == ("q17-r3", "line 3")
    assert "nested too deep" in err.reason


def test_a_line_with_an_integer_past_pythons_digits_leaves_its_run_out():
    """An integer of 5,000 digits is a ValueError out of json.loads (Python's 4,300-digit
    limit), not a JSONDecodeError: it escaped the reader."""
    other = json.dumps(mk_call(0, S, [2001], run_id="other").to_json())
    huge = json.dumps(mk_call(0, S, [2001], run_id="q1").to_json())[:-1] + \
        ', "x": 1' + "0" * 5000 + "}"
    loaded = collect_calls([other, huge], file="calls.jsonl")
    assert list(loaded.runs) == ["other"]
    (err,) = loaded.errors
    assert (err.run_id, err.call, err.where) == ("q1", 0, "line 2")
    assert err.reason.startswith("not a record: Exceeds the limit (4300 digits)")
    runs, errors = collect_runs(['{"run_id": "r", "status": "ok", "task_id": "t", '
                                 '"reward": 1' + "0" * 5000 + "}"], file="runs.jsonl")
    assert not runs and errors[0].run_id == "r"
