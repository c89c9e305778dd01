"""The rollout manager builds a finished run's trajectories off the coordinator's event
loop: reading its calls back from the call store and building its prefix tree (seconds
of CPU for a run of a million tokens) run on a worker thread, while the loop goes on
serving (heartbeats, the gateway, the policy)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from gyre_slurm.config.schema import load_config
from gyre_slurm.runtime.book import StepBook, run_id_of
from gyre_slurm.runtime.rollouts import RolloutManager
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.traj import process
from gyre_slurm.traj.store import CallStoreWriter
from traj_helpers import mk_call

ROOT = Path(__file__).resolve().parent.parent


def test_trajectories_are_built_while_the_event_loop_keeps_running(tmp_path, monkeypatch):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    rd = RunDir(tmp_path / "run")
    rd.create(cfg)
    book = StepBook(num_steps=1, prompts_per_step=1, group_size=1, staleness=0)
    rid = run_id_of(0, 0, 0)
    book.start(rid)
    writer = CallStoreWriter(rd.path, "gateway-test")
    prompt = [1000, 1001, 1002]
    for call in range(3):  # a chain: each prompt is the previous sequence plus a suffix
        output = [2000 + 10 * call + j for j in range(4)]
        writer.append(mk_call(call, prompt, output, run_id=rid))
        prompt = prompt + output + [3000 + call]
    manager = RolloutManager(cfg=cfg, rd=rd, book=book, gateway=None,
                             gateway_url="http://127.0.0.1:9", flush_calls=writer.flush)

    # The real tree building, held until the loop has run a coroutine meanwhile: on the
    # loop's own thread it would wait forever (here: time out and fail).
    entered, released = threading.Event(), threading.Event()
    seen = {}
    real = process.process_run

    def held(*args, **kwargs):
        seen["thread"] = threading.get_ident()
        entered.set()
        seen["released"] = released.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(process, "process_run", held)

    async def main():
        finishing = asyncio.create_task(manager.finish(rid, {
            "run_id": rid, "task_id": "t", "reward": 1.0, "status": "ok", "error": None}))
        ticks = 0
        while not entered.is_set():
            await asyncio.sleep(0.005)
        while ticks < 5:  # the loop serves while the tree is being built
            ticks += 1
            await asyncio.sleep(0.005)
        assert manager.ending and not finishing.done()  # counted, cancellable at shutdown
        released.set()
        await finishing
        seen["loop_thread"] = threading.get_ident()
        await manager.cancel_all()

    asyncio.run(main())
    writer.close()
    assert seen["released"], "the tree was built on the event loop's thread"
    assert seen["thread"] != seen["loop_thread"]
    entry = book.runs[rid]
    assert entry.state == "ok" and entry.num_trajectories == 1
    [ready] = book.steps[0].ready  # group released: the step's queue holds it, not the run
    assert entry.trajectories == [] and ready["run_id"] == rid
    assert ready["token_ids"][:3].tolist() == [1000, 1001, 1002]  # arrays
    assert book.ready_tokens() == len(ready["token_ids"]) == entry.tokens
    events = [json.loads(line) for line in rd.events_file.read_text().splitlines()]
    assert [e["trajectories"] for e in events if e["kind"] == "run_end"] == [1]
    assert not rd.runs_file.exists()  # a run this manager never started: not recorded


def test_the_time_between_a_runs_calls_is_measured_from_the_runs_in_flight(tmp_path):
    """The policy expects a migrating run to leave at its next model call, so the
    coordinator tells it the mean time between calls it sees: the runs in flight that
    have called, their time so far over their calls (the gateway's counts); none before
    any has called (the policy then takes the configured rollout.call_interval_s)."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    rd = RunDir(tmp_path / "run")
    rd.create(cfg)
    book = StepBook(num_steps=1, prompts_per_step=1, group_size=3, staleness=0)
    manager = RolloutManager(cfg=cfg, rd=rd, book=book, gateway=None,
                             gateway_url="http://127.0.0.1:9", flush_calls=lambda: None)
    a, b, c = (run_id_of(0, 0, g) for g in range(3))
    manager.started_at.update({a: 100.0, b: 130.0, c: 139.0})
    calls = {a: 4, b: 2}  # c has not called yet
    assert manager.call_interval_s(140.0, lambda rid: calls.get(rid, 0)) == \
        (40.0 + 10.0) / 6
    assert manager.call_interval_s(140.0, lambda rid: 0) is None
