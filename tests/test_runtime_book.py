"""The coordinator's ledger: batches, staleness, groups, streaming, exactly-once."""

import numpy as np
import pytest

from gyre_slurm.runtime.book import StepBook, run_id_of


def traj(run_id, n=4):
    return {"run_id": run_id, "token_ids": list(range(n)), "loss_mask": [0, 1] * (n // 2),
            "logprobs": [0.0] * n, "policy_version": 0, "advantage": 0.0}


def book(**kw):
    args = dict(num_steps=3, prompts_per_step=2, group_size=2, staleness=1)
    args.update(kw)
    return StepBook(**args)


def test_staleness_bounds_the_batches_allowed():
    b = book(staleness=1)
    assert list(b.allowed_steps()) == [0, 1]
    assert len(b.pending()) == 8 and b.future() == 4
    b0 = book(staleness=0)
    assert list(b0.allowed_steps()) == [0] and len(b0.pending()) == 4


def test_a_group_trains_only_when_all_its_runs_ended_with_group_advantages():
    b = book()
    for r in b.pending():
        b.start(r.run_id)
    g0, g1 = run_id_of(0, 0, 0), run_id_of(0, 0, 1)
    assert b.finish(g0, status="ok", reward=1.0, trajectories=[traj(g0)]) == []
    ready = b.finish(g1, status="ok", reward=0.0, trajectories=[traj(g1), traj(g1)])
    assert [(t["run_id"], t["advantage"]) for t in ready] == [(g0, 0.5), (g1, -0.5), (g1, -0.5)]


def test_failed_runs_never_train_and_leave_the_baseline():
    b = book()
    for r in b.pending():
        b.start(r.run_id)
    g0, g1 = run_id_of(0, 1, 0), run_id_of(0, 1, 1)
    b.finish(g0, status="failed", reward=0.0, trajectories=[traj(g0)])
    ready = b.finish(g1, status="ok", reward=0.7, trajectories=[traj(g1)])
    assert [(t["run_id"], t["advantage"]) for t in ready] == [(g1, 0.0)]


def test_streaming_microbatches_and_step_completion():
    b = book()
    for r in b.pending():
        b.start(r.run_id)
    for p in range(2):
        for g in range(2):
            rid = run_id_of(0, p, g)
            b.finish(rid, status="ok", reward=float(g), trajectories=[traj(rid, 6)])
    assert not b.step_complete()
    seen = []
    while batch := b.next_microbatch(max_tokens=12):
        assert sum(len(t["token_ids"]) for t in batch) <= 12
        b.trained(batch)
        seen += [t["run_id"] for t in batch]
    assert sorted(seen) == sorted(run_id_of(0, p, g) for p in range(2) for g in range(2))
    assert b.step_complete()
    assert b.step_done() == 1
    assert list(b.allowed_steps()) == [1, 2]  # step 0 is trained
    assert b.steps[0].trained_tokens == 4 * 3


def test_trajectories_held_as_arrays_count_their_tokens_exactly():
    """The rollout side hands the book numpy arrays (`Trajectory.to_dict`): 300 trained
    tokens in a uint8 mask count 300 (a Python sum of uint8 values wraps at 256), and
    sizes and micro-batches are those of the same trajectories as lists."""
    counts = []
    for form in (list, lambda v: np.asarray(v, dtype=np.uint8)):
        b = book(prompts_per_step=1, group_size=2)
        for r in b.pending():
            b.start(r.run_id)
        for g, n in enumerate((600, 40)):
            rid = run_id_of(0, 0, g)
            t = traj(rid, n)
            t.update(token_ids=np.arange(n, dtype=np.int32) if form is not list else t[
                "token_ids"], loss_mask=form(t["loss_mask"]))
            b.finish(rid, status="ok", reward=float(g), trajectories=[t])
        batches = []
        while batch := b.next_microbatch(max_tokens=500, packing="tree"):
            b.trained(batch)
            batches.append([(t["run_id"], len(t["token_ids"])) for t in batch])
        counts.append((b.steps[0].trained_tokens, type(b.steps[0].trained_tokens), batches))
    assert counts[0] == counts[1]
    assert counts[1][:2] == (320, int)


def test_the_book_holds_no_trajectory_of_a_trained_step():
    """A job of days must not keep every token it trained: once a group is released its
    trajectories live in the step's queue and batches only, and once the step is
    trained nothing of them is held (the runs keep their counts and token totals)."""
    import gc
    import weakref

    b = book(num_steps=3, prompts_per_step=2, group_size=2, staleness=1)
    refs, counts = [], []
    for step in range(3):
        for r in b.pending():
            b.start(r.run_id)
        for r in [e for e in b.runs.values() if e.state == "running" and e.step == step]:
            arr = np.arange(10 + r.member, dtype=np.int32)
            refs.append(weakref.ref(arr))
            t = dict(traj(r.run_id, len(arr)), token_ids=arr)
            b.finish(r.run_id, status="ok", reward=float(r.member), trajectories=[t])
        while batch := b.next_microbatch(max_tokens=100):
            b.trained(batch)
        assert b.tokens_per_run(step) == 10.5
        b.step_done()
        counts.append(b.run_counts()["trained"])
        del arr, t  # the test's own last references
        gc.collect()
        assert all(ref() is None for ref in refs), f"step {step}'s tokens still held"
        assert all(e.trajectories == [] for e in b.runs.values())
    assert counts == [4, 8, 12]
    assert [b.tokens_per_run(s) for s in range(3)] == [10.5] * 3


def test_a_microbatch_holds_at_least_one_trajectory():
    b = book(prompts_per_step=1, group_size=1)
    b.start(run_id_of(0, 0, 0))
    b.finish(run_id_of(0, 0, 0), status="ok", reward=1, trajectories=[traj("x", 100)])
    assert len(b.next_microbatch(max_tokens=10)) == 1


def test_tree_packing_hands_out_whole_runs_by_their_tree_tokens():
    """Tree packing: a run's trajectories stay together and cost their prefix tree's
    tokens (a shared prefix once); rows: trajectory by trajectory, each its length."""
    b = book(prompts_per_step=3, group_size=1)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    for p in range(3):
        rid = run_id_of(0, p, 0)
        b.start(rid)
        trajs = [{"run_id": rid, "token_ids": shared + [20 + i], "loss_mask": [0] * 8 + [1],
                  "logprobs": [0.0] * 8 + [-1.0]} for i in range(3)]  # 11 tree, 27 rows
        b.finish(rid, status="ok", reward=float(p), trajectories=trajs)
    batches = []
    while batch := b.next_microbatch(max_tokens=22, packing="tree"):
        batches.append([t["run_id"] for t in batch])
    assert batches == [[run_id_of(0, 0, 0)] * 3 + [run_id_of(0, 1, 0)] * 3,
                       [run_id_of(0, 2, 0)] * 3]


def test_restart_gives_an_interrupted_run_a_new_attempt():
    b = book()
    rid = run_id_of(1, 0, 1)
    b.start(rid)
    new = b.restart(rid)
    assert new == rid + "-a1"
    assert rid not in b.runs and b.runs[new].state == "pending"
    assert new in b.steps[1].runs
    b.finish("s0000-p000-g00", status="ok", reward=0, trajectories=[])
    with pytest.raises(AssertionError):  # a run ends once
        b.finish("s0000-p000-g00", status="ok", reward=0, trajectories=[])


def test_waiting_tokens_count_open_groups_and_later_steps():
    """What cannot train yet but will: ok runs of the current step whose group is still
    open, and every ok run of a later step (released or not); not what is trainable now.
    The book counts its work in the ledger the simulator keeps too (`sched.ledger`)."""
    b = book()
    for r in b.pending():
        b.start(r.run_id)

    def waiting():
        return b.work.waiting(b.version, streaming=True)

    assert waiting() == 0
    b.finish(run_id_of(0, 0, 0), status="ok", reward=1.0, trajectories=[traj("a", 4)])
    assert waiting() == 4 and b.ready_tokens() == 0  # its group is open
    b.finish(run_id_of(0, 0, 1), status="ok", reward=0.0, trajectories=[traj("b", 6)])
    assert waiting() == 0 and b.ready_tokens() == 10  # released: trainable now
    b.finish(run_id_of(1, 1, 0), status="ok", reward=1.0, trajectories=[traj("c", 8)])
    b.finish(run_id_of(1, 1, 1), status="failed", reward=0.0, trajectories=[])
    assert waiting() == 8  # a later step's released group still waits
    assert b.work.step_runs_left(0) == 2


def test_trained_runs_are_counted_live_as_training_consumes_them():
    """`gyre status` showed `trained 0` through a healthy job (the state was set only on
    resume): a run counts as trained once its last trajectory is, a rewound step's
    count drops back, and trained runs leave the `ok` count."""
    b = book(prompts_per_step=1, group_size=2)
    for r in b.pending():
        b.start(r.run_id)
    g0, g1 = run_id_of(0, 0, 0), run_id_of(0, 0, 1)
    b.finish(g0, status="ok", reward=1.0, trajectories=[traj(g0), traj(g0)])
    b.finish(g1, status="failed", reward=0.0, trajectories=[])
    assert b.run_counts() == {"pending": 2, "running": 2, "ok": 1, "failed": 1,
                              "timeout": 0, "trained": 0}
    first = b.next_microbatch(max_tokens=4)
    b.trained(first, index=1)
    assert b.run_counts()["trained"] == 0  # one of its two trajectories trained
    second = b.next_microbatch(max_tokens=4)
    b.trained(second, index=2)
    assert b.run_counts()["trained"] == 1 and b.run_counts()["ok"] == 0
    b.rewind_step()  # a member was lost: the step's micro-batches train again
    assert b.run_counts()["trained"] == 0 and b.run_counts()["ok"] == 1
    while (again := b.next_redo()) is not None:
        b.trained(again[1], index=again[0])
    b.step_done()
    assert b.run_counts()["trained"] == 1 and b.run_counts()["failed"] == 1
    resumed = book(prompts_per_step=1, group_size=2)
    resumed.mark_trained_before(1)
    assert resumed.run_counts()["trained"] == 2 and resumed.run_counts()["pending"] == 4


def test_a_runs_tokens_are_measured_per_run_and_stay_once_handed_out():
    """The observation's tokens per run: every trajectory of an ended ok run counts
    (a run of two trajectories is twice one), failed runs not at all, and the figure
    holds once the trainer has taken the trajectories (it used to be the mean of those
    not yet handed out, per trajectory, and the config's prior in between)."""
    b = book()
    assert b.tokens_per_run(0) is None and b.tokens_per_run(-1) is None
    for r in b.pending():
        b.start(r.run_id)
    a, c, f = run_id_of(0, 0, 0), run_id_of(0, 0, 1), run_id_of(0, 1, 0)
    b.finish(a, status="ok", reward=1.0, trajectories=[traj(a, 4)])
    assert b.tokens_per_run(0) == 4
    b.finish(c, status="ok", reward=0.0, trajectories=[traj(c, 4), traj(c, 8)])
    b.finish(f, status="failed", reward=0.0, trajectories=[traj(f, 100)])
    assert b.tokens_per_run(0) == (4 + 12) / 2
    while b.next_microbatch(max_tokens=1000):  # handed out: the measure holds
        pass
    assert b.tokens_per_run(0) == 8 and b.tokens_per_run(1) is None
