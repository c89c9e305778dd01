"""One ledger of waiting and ready work (`sched.ledger.WorkLedger`) for the runtime and the
simulator, and one observation builder (`sched.observe`).

The runtime's `StepBook` holds the trajectories themselves and counts their work in a
`WorkLedger`; a random sequence of the runtime's events (runs ending ok or failed,
restarts, micro-batches handed out and trained, a rewound step, an optimizer step) must
leave the ledger's counts equal to what the payloads say. The simulator feeds the same
ledger; its tables are checked directly."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_slurm.runtime.book import StepBook
from gyre_slurm.sched.ledger import WorkLedger

PKG = Path(__file__).resolve().parent.parent / "gyre_slurm"


def traj(run_id: str, n: int) -> dict:
    return {"run_id": run_id, "token_ids": list(range(n)), "loss_mask": [1] * n,
            "logprobs": [0.0] * n, "policy_version": 0}


def tokens(trajs) -> int:
    return sum(len(t["token_ids"]) for t in trajs)


def expected(b: StepBook) -> dict:
    """The work as the old runtime computed it, from the trajectories themselves."""
    v = b.version
    if v >= b.num_steps:
        return {"ready": 0, "waiting": 0, "runs_left": 0}
    waiting = 0
    for s in b.allowed_steps():
        runs = [b.runs[r] for r in b.steps[s].runs]
        open_groups = {r.prompt for r in runs if r.state in ("pending", "running")}
        waiting += sum(r.tokens for r in runs
                       if r.state == "ok" and (s > v or r.prompt in open_groups))
    return {"ready": tokens(b.steps[v].ready), "waiting": waiting,
            "runs_left": sum(1 for r in b.steps[v].runs
                             if b.runs[r].state in ("pending", "running"))}


def counted(b: StepBook) -> dict:
    """`run_counts` as it was computed before the book kept counts: from every run (the
    step being trained by the book's own `trained_in_step`, which did not change)."""
    counts = Counter(r.state for r in b.runs.values())
    trained = sum(1 for step in b.steps[:b.version] for rid in step.runs
                  if b.runs[rid].state == "ok") + b.trained_in_step()
    counts["ok"] -= trained
    counts["trained"] += trained
    return {s: counts[s] for s in ("pending", "running", "ok", "failed", "timeout", "trained")}


def observed(b: StepBook) -> dict:
    return {"ready": b.work.trainable(b.version, streaming=True),
            "waiting": b.work.waiting(b.version, streaming=True),
            "runs_left": b.work.step_runs_left(b.version)}


ACTIONS = st.lists(st.tuples(st.sampled_from(["finish", "fail", "restart", "train",
                                              "rewind", "step"]),
                             st.integers(0, 1000), st.integers(1, 9)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_the_books_ledger_counts_what_its_trajectories_hold(actions):
    b = StepBook(num_steps=3, prompts_per_step=2, group_size=2, staleness=1)
    in_progress: list = []  # (index, batch) handed out, not yet trained
    for action, pick, size in actions:
        running = [r for r in b.runs.values() if r.state in ("pending", "running")
                   and r.step in b.allowed_steps()]
        if action in ("finish", "fail", "restart") and running:
            run = running[pick % len(running)]
            if run.state == "pending":
                b.start(run.run_id)
            if action == "restart":
                b.restart(run.run_id)
            else:
                ok = action == "finish"
                b.finish(run.run_id, status="ok" if ok else "failed", reward=pick % 3,
                         trajectories=[traj(run.run_id, size)] * (1 + pick % 2) if ok else [])
        elif action == "train" and not b.done():
            if in_progress:  # one micro-batch at a time, as the coordinator trains
                index, batch = in_progress.pop()
                b.trained(batch, index=index)
            else:
                item = b.next_redo() or (pick, b.next_microbatch(max_tokens=size * 2))
                if item[1]:
                    in_progress.append(item)
        elif action == "rewind" and not b.done():
            b.rewind_step(in_progress.pop() if in_progress else None)
        elif action == "step" and b.step_complete() and not in_progress:
            b.step_done()
        assert observed(b) == expected(b), (action, pick, size)
        assert b.run_counts() == counted(b), (action, pick, size)
        state = b.steps[b.version] if not b.done() else None
        assert b.step_complete() == (state is not None and all(
            b.runs[r].state not in ("pending", "running") for r in state.runs)
            and not state.ready and not state.redo and state.trained == state.handed_out)
    resumed = StepBook(num_steps=3, prompts_per_step=2, group_size=2, staleness=1)
    resumed.mark_trained_before(b.version)
    assert resumed.run_counts() == counted(resumed)
    assert b.work.trained_total + b.work.in_progress_total <= b.work.done_total


def test_without_streaming_a_step_trains_only_once_its_whole_batch_has_finished():
    w = WorkLedger(num_steps=2, groups_per_step=2, group_size=2)
    assert w.run_finished(step=0, group=0, tokens=5) is False
    assert w.run_finished(step=0, group=0, tokens=7) is True  # group 0 complete
    assert w.trainable(0, streaming=True) == 12
    assert w.trainable(0, streaming=False) == 0  # group 1 still running
    assert w.waiting(0, streaming=False) == 12
    w.run_finished(step=0, group=1, tokens=1)
    w.run_finished(step=1, group=2, tokens=4)  # a later step: waits
    w.run_finished(step=0, group=1, tokens=2)
    assert w.trainable(0, streaming=False) == 15 and w.waiting(0, streaming=False) == 4
    w.hand_out(0, 10)
    assert w.trainable(0, streaming=False) == 0  # part of the batch is in training
    assert w.waiting(0, streaming=False) == 4 + 5
    w.train_done(0, 10)
    assert not w.step_trained(0)
    w.hand_out(0, 5)
    w.train_done(0, 5)
    assert w.step_trained(0) and w.waiting(0, streaming=False) == 4
    w.rewind(0)  # its gradients were lost: all of it is trained again
    assert not w.step_trained(0) and w.in_progress_total == 15


def _definitions(name: str) -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                out.append(str(path.relative_to(PKG)))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
                out.append(str(path.relative_to(PKG)))
    return out


def test_one_ledger_and_one_observation_builder():
    """Waiting and trainable work are defined once, and an Observation is built in one
    module, for the runtime and the simulator alike."""
    assert _definitions("waiting") == ["sched/ledger.py"]
    assert _definitions("trainable") == ["sched/ledger.py"]
    # the opening one (from the config) and the running one (from what is seen)
    assert sorted(set(_definitions("Observation"))) == ["sched/observe.py"]
    assert _definitions("build_observation") == [
        "runtime/coordinator.py", "sched/observe.py", "sim/engine.py"]
