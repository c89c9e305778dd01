"""The two drains of a move to training, on the real runtime (the coordinator in this
process with real node agents, engines, gateway and training world) with many-turn runs:
a `wait` drain keeps its runs on the cell until they end (the gateway routes their
later calls to it, none migrates), as the simulator and the policy's outlook have it; a
`migrate` drain moves them to another server at their next call.

Until session 39 both drains moved every run at its next call (the gateway rerouted any
draining server's runs), so on many-turn agents a `wait` drain paid each run's
re-prefill on another cell and still held the cell until the last run had called again:
the policy chose it for heavy tails expecting neither. The benchmark's one-turn runs
never showed it (a one-turn run makes no call after its first).

The decisions come from a script that wraps the tiny config's elastic policy (its
layout: cell 0 rolls out, cell 1 trains, both standalone; cells 2 and 3 elastic, rolling
out): what is under test is what the runtime does with a drain, not when a policy asks.
"""

import asyncio
import logging
import re

import pytest

from gyre_slurm.config.schema import load_config
from gyre_slurm.runtime.coordinator import Coordinator
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import Decision
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT

pytestmark = pytest.mark.slow
CELL = 2
# Runs of 3-6 turns, each turn's tool 0.3-1.5 s: a run released early has calls left.
MANY_TURNS = ["agent.env=longhorizon", "agent.max_turns=6", "agent.max_tokens=4",
              "agent.env_params={median_turns: 4, turns_sigma: 0.2, max_turns: 6, "
              "tool_mean_s: 0.6, tool_sigma: 0.5, tool_max_s: 1.5, result_tokens: 8}",
              "workload.duration.mean_s=2.5"]


class ReleaseOnce:
    """Release cell 2 (`drain`) once it holds 2 runs; the policy decides nothing else,
    so the cell's drain is the only move. Records the runs it held when released and
    the most it held in its drain."""

    def __init__(self, inner, drain):
        self.inner, self.name, self.drain = inner, inner.name, drain
        self.streaming, self.max_staleness = inner.streaming, inner.max_staleness
        self.released_with = None
        self.draining_runs = []  # the cell's runs at each tick of its drain

    def initial_layout(self, num_cells):
        return self.inner.initial_layout(num_cells)

    def decide(self, obs):
        cell = obs.cells[CELL]
        if self.released_with is None and cell.role is Role.ROLLOUT and cell.active_runs >= 2:
            self.released_with = cell.active_runs
            return [Decision(CELL, Role.TRAIN, "release", "test: release", drain=self.drain)]
        if cell.role is Role.DRAINING:
            self.draining_runs.append(cell.active_runs)
        return []


def run_with_drain(tmp_path, caplog, drain):
    run_dir, num_steps = tmp_path / drain, 2
    cfg = load_config(ROOT / "configs" / "tiny.yaml", FAST + MANY_TURNS + [
        f"workload.num_steps={num_steps}", "scheduler.interval_s=0.2"])
    coordinator = Coordinator(cfg, run_dir)
    script = ReleaseOnce(coordinator.policy, drain)
    coordinator.policy = script
    with caplog.at_level(logging.INFO, logger="gyre_slurm.gateway.router"):
        assert asyncio.run(asyncio.wait_for(coordinator.run(), 300)) == 0
    events = check_run_dir(run_dir, num_steps=num_steps)  # nothing lost nor trained twice
    # a run moves when its server drains (at its next call) or is removed with the run
    # still on it (its next call goes to another server)
    moves = re.findall(r"run (\S+) migrates from server (\S+) to (\S+)", caplog.text)
    removed = [(sid, int(n)) for sid, n in
               re.findall(r"server (\S+) removed \((\d+) runs move", caplog.text)]
    handoff = next(e for e in events if e["kind"] == "handoff" and CELL in e["cells"]
                   and e["direction"] == "rollout->train")
    return script, moves, removed, handoff


def test_a_wait_drain_lets_its_many_turn_runs_end_on_the_cell(tmp_path, caplog):
    script, moves, removed, handoff = run_with_drain(tmp_path, caplog, "wait")
    assert script.released_with >= 2
    assert script.draining_runs and script.draining_runs[0] >= 1, script.draining_runs
    # the cell's runs leave it only by ending: its run count never rises, and no run
    # of the job migrated anywhere (the only move is this drain)
    assert script.draining_runs == sorted(script.draining_runs, reverse=True)
    assert moves == [], moves
    assert removed == [("cell2-n2-s0", 0)], removed  # left once its runs had ended
    assert handoff["drain_s"] > 0, handoff


def test_a_migrate_drain_moves_its_runs_at_their_next_call(tmp_path, caplog):
    script, moves, removed, handoff = run_with_drain(tmp_path, caplog, "migrate")
    assert script.released_with >= 2
    # removed once no call was in flight, with runs that had turns left
    assert [sid for sid, _ in removed] == ["cell2-n2-s0"], removed
    assert removed[0][1] + len(moves) >= 1, (removed, moves)
    assert all(src == "cell2-n2-s0" for _, src, _ in moves), moves
    assert handoff["drain_s"] > 0, handoff
