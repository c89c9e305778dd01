"""`gyre traj build|show|export|import`, run through the real `gyre` entry point."""

from __future__ import annotations

import json

import pytest
from traj_helpers import mk_run

from gyre_slurm.cli import main

S = [1001, 1002]
GOOD = mk_run([(S + [1003], [2001, 2002]), (S + [1003, 2001, 2002, 3001], [2003]),
               (S + [1010], [2004])], run_id="good")
OTHER = mk_run([(S, [2005])], run_id="other")
FAILED = mk_run([(S, [2006])], run_id="failed")


def _jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


@pytest.fixture
def files(tmp_path):
    bad = GOOD[0].to_json() | {"run_id": "bad", "output_logprobs": [-0.1]}
    calls = [c.to_json() for c in GOOD[:2]] + [bad] + [c.to_json() for c in GOOD[2:]]
    calls += [c.to_json() for c in OTHER + FAILED]
    runs = [{"run_id": "good", "task_id": "t", "reward": 1.0, "status": "ok"},
            {"run_id": "other", "task_id": "t", "reward": 0.0, "status": "ok"},
            {"run_id": "failed", "task_id": "t", "reward": 0.0, "status": "failed",
             "reason": "sandbox crashed"},
            {"run_id": "bad", "task_id": "u", "reward": 0.5, "status": "ok"}]
    return _jsonl(tmp_path / "calls.jsonl", calls), _jsonl(tmp_path / "runs.jsonl", runs)


def test_build_writes_good_runs_and_reports_bad_ones(files, tmp_path, capsys):
    calls, runs = files
    out = tmp_path / "out.jsonl"
    rc = main(["traj", "build", calls, "--runs", runs, "--max-per-run", "5", "-o", str(out),
               "--stats", "--micro-batch-tokens", "64"])
    captured = capsys.readouterr()
    assert rc == 1  # a run had a bad record
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(t["run_id"], t["advantage"]) for t in lines] == [
        ("good", 0.5), ("good", 0.5), ("other", -0.5)]
    assert set(lines[0]) == {"run_id", "token_ids", "loss_mask", "logprobs", "versions",
                             "policy_version", "advantage"}
    assert lines[0]["token_ids"] == S + [1003, 2001, 2002, 3001, 2003]
    assert lines[0]["loss_mask"] == [0, 0, 0, 1, 1, 0, 1]
    stats = json.loads(captured.out)
    rejected = {(r["run"], r["call"], r["kind"]): r for r in stats["rejected"]}
    assert rejected[("bad", 0, "record")]["where"] == "line 3"
    assert rejected[("bad", 0, "record")]["file"] == calls
    assert "sandbox crashed" in rejected[("failed", None, "status")]["reason"]
    assert stats["dedup"]["trained_tokens"] == 5 and stats["packing"]["num_micro_batches"] == 1
    assert f"{calls}:line 3: run 'bad' call 0: 2 output_ids but 1 output_logprobs" \
        in captured.err


def test_build_without_runs_gives_zero_advantage(files, tmp_path):
    calls, _ = files
    out = tmp_path / "out.jsonl"
    assert main(["traj", "build", calls, "--max-per-run", "1", "-o", str(out)]) == 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(t["run_id"], t["advantage"]) for t in lines] == [
        ("good", 0.0), ("other", 0.0), ("failed", 0.0)]


def test_only_failed_status_rejections_exit_zero(tmp_path):
    calls = _jsonl(tmp_path / "c.jsonl", [c.to_json() for c in GOOD + FAILED])
    runs = _jsonl(tmp_path / "r.jsonl", [
        {"run_id": "good", "task_id": "t", "reward": 1.0, "status": "ok"},
        {"run_id": "failed", "task_id": "t", "reward": 0.0, "status": "timeout"}])
    assert main(["traj", "build", calls, "--runs", runs, "-o", str(tmp_path / "o")]) == 0


def test_missing_input_is_a_user_error(tmp_path, capsys):
    assert main(["traj", "build", str(tmp_path / "nope.jsonl"), "-o", "x"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_an_output_or_run_dir_it_cannot_use_is_a_user_error_before_reading(files, tmp_path,
                                                                            capsys):
    """-o a folder, or under a file; a run dir that is missing or a file: exit 2 with
    what to fix, nothing written, the file in the way kept."""
    calls, _ = files
    blocker = tmp_path / "a_file"
    blocker.write_text("mine\n")
    for argv, message in (
            (["traj", "build", calls, "-o", str(tmp_path)], "is a folder: name a file"),
            (["traj", "build", calls, "-o", str(blocker / "o.jsonl")],
             "is a file, not a folder"),
            (["traj", "export", str(tmp_path / "nope"), "-o", str(tmp_path / "e.jsonl")],
             "run dir"),
            (["traj", "show", str(blocker), "r1"], "is not a folder"),
            (["traj", "import", calls, str(blocker)], "is a file, not a folder")):
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert blocker.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "calls.jsonl",
                                                          "runs.jsonl"]


def test_import_export_and_build_from_the_store(files, tmp_path, capsys):
    calls, runs = files
    run_dir = tmp_path / "run"
    assert main(["traj", "import", calls, str(run_dir)]) == 1  # run 'bad' is not imported
    assert main(["traj", "export", str(run_dir), "-o", str(tmp_path / "back.jsonl")]) == 0
    back = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == [c.to_json() for c in GOOD + OTHER + FAILED]
    from_file, from_store = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    main(["traj", "build", str(tmp_path / "back.jsonl"), "-o", str(from_file)])
    main(["traj", "build", str(run_dir), "-o", str(from_store)])
    assert from_file.read_text() == from_store.read_text() != ""


def test_show_draws_the_tree_with_counts(files, tmp_path, capsys):
    calls, _ = files
    run_dir = tmp_path / "run"
    main(["traj", "import", calls, str(run_dir)])
    capsys.readouterr()
    assert main(["traj", "show", str(run_dir), "good"]) == 0
    drawn = capsys.readouterr().out
    assert "run good: 9 tokens, 4 trainable, 2 leaves" in drawn
    assert "ctx 2 tok (branch 9 tok): 1001 1002" in drawn
    assert main(["traj", "show", str(run_dir), "good", "--dump"]) == 0
    dumped = capsys.readouterr().out
    assert "token   1001  1002  1003  2001  2002  3001  2003" in dumped
    assert "mask       .     .     .     1     1     .     1" in dumped
    assert main(["traj", "show", str(run_dir), "nobody"]) == 2
    assert "no calls of run 'nobody'" in capsys.readouterr().err


def test_runs_can_be_a_directory_of_run_records(tmp_path):
    calls = _jsonl(tmp_path / "c.jsonl", [c.to_json() for c in GOOD + OTHER])
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    (runs_dir / "good.json").write_text(json.dumps(
        {"run_id": "good", "task_id": "t", "reward": 3.0, "status": "ok"}, indent=2))
    _jsonl(runs_dir / "more.jsonl", [{"run_id": "other", "task_id": "t", "reward": 1.0,
                                      "status": "ok"}])
    out = tmp_path / "out.jsonl"
    assert main(["traj", "build", calls, "--runs", str(runs_dir), "-o", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(t["run_id"], t["advantage"]) for t in lines] == [
        ("good", 1.0), ("good", 1.0), ("other", -1.0)]


@pytest.mark.parametrize("change, reason", [
    ({"call": 2**31}, "call must be an integer from 0 to 2147483647"),
    ({"policy_version": 2**63}, "policy_version must be an integer from 0 to"),
    ({"run_id": "r" * 70_000}, "run_id must be at most 65,535 bytes"),
    ({"finish_reason": "s" * 70_000}, "finish_reason must be a string of at most 65,535"),
    ({"output_logprobs": [1e308, -0.1]}, "output_logprobs must be a list of finite numbers"),
    # JSON's "\ud800" decodes to a lone surrogate, which no UTF-8 file holds: it stopped
    # the import with a UnicodeEncodeError traceback
    ({"run_id": "bad\ud800"}, "run_id must be at most 65,535 bytes of UTF-8 (no lone"),
    ({"finish_reason": "\udfff"}, "finish_reason must be a string of at most 65,535 bytes"),
])
def test_import_refuses_what_the_store_cannot_hold_and_keeps_the_rest(tmp_path, capsys, change,
                                                                      reason):
    """A record whose numbers or names overflow the call store's fixed header (an int32
    call, an int64 version, 65,535-byte names) stopped `traj import` with a struct.error
    traceback part-way through the file; now it is rejected like any bad record and the
    records after it are imported (a run with a bad record is left out whole, as ever)."""
    calls = [c.to_json() for c in GOOD]
    bad = FAILED[0].to_json() | {"run_id": "bad"} | change
    path = _jsonl(tmp_path / "calls.jsonl", [calls[0], bad, *calls[1:], OTHER[0].to_json()])
    run_dir = tmp_path / "run"
    assert main(["traj", "import", path, str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err and "RuntimeWarning" not in err, err
    main(["traj", "export", str(run_dir), "-o", str(tmp_path / "back.jsonl")])
    back = [json.loads(line) for line in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert back == [*calls, OTHER[0].to_json()]
