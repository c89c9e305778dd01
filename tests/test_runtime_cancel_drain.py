"""A drain the policy cancels, on the real runtime (the coordinator in this process with
real node agents, engines, gateway and training world; runtime/handoff.py's docstring):
the cell stops draining, serves runs again and never joins training; a decision the
runtime cannot carry out is logged with its reason (`decision_dropped`), not dropped.

The decisions come from a script that wraps the tiny config's elastic policy (its
layout: cell 0 rolls out, cell 1 trains, both standalone; cells 2 and 3 elastic, rolling
out): the thing under test is what the runtime does with them, not when a policy
cancels (tests/test_elastic.py, the simulator's tests).
"""

import asyncio

import pytest

from gyre_slurm.config.schema import load_config
from gyre_slurm.runtime.coordinator import Coordinator
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import Decision
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT

pytestmark = pytest.mark.slow
CELL = 2


class CancelScript:
    """Release cell 2 with a wait drain once it serves runs; while it drains, ask again
    (the runtime must refuse and say why), then cancel the drain; then watch the runs it
    serves, as the gateway reports them in each observation."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.streaming, self.max_staleness = inner.streaming, inner.max_staleness
        self.phase = 0
        self.runs_after = 0  # most runs cell 2 served at once after the cancel

    def initial_layout(self, num_cells):
        return self.inner.initial_layout(num_cells)

    def decide(self, obs):
        cell = obs.cells[CELL]
        if self.phase == 0 and cell.role is Role.ROLLOUT and cell.active_runs >= 2:
            self.phase = 1
            return [Decision(CELL, Role.TRAIN, "release", "test: release", drain="wait")]
        if self.phase == 1 and cell.role is Role.DRAINING:
            self.phase = 2
            return [Decision(CELL, Role.TRAIN, "release", "test: again", drain="wait")]
        if self.phase == 2:
            self.phase = 3
            return [Decision(CELL, Role.ROLLOUT, "cancel_drain", "test: cancel")]
        if self.phase == 3 and cell.role is Role.ROLLOUT:
            self.runs_after = max(self.runs_after, cell.active_runs)
        return []


def test_a_cancelled_drain_serves_again_and_refused_decisions_are_logged(tmp_path):
    run_dir, num_steps = tmp_path / "run", 3
    # each run's tool call takes 3-6 s: the wait drain outlasts the next policy tick
    cfg = load_config(ROOT / "configs" / "tiny.yaml", FAST + [
        f"workload.num_steps={num_steps}", "scheduler.interval_s=0.2",
        "agent.env_params={tool_mean_s: 3.0, tool_sigma: 0.2, tool_max_s: 6.0}"])
    coordinator = Coordinator(cfg, run_dir)
    script = CancelScript(coordinator.policy)
    coordinator.policy = script
    assert [c.role for c in coordinator.table.cells][CELL] is Role.ROLLOUT
    assert asyncio.run(asyncio.wait_for(coordinator.run(), 300)) == 0

    events = check_run_dir(run_dir, num_steps=num_steps)  # nothing lost nor trained twice
    mine = [e for e in events if e.get("cell") == CELL or CELL in e.get("cells", [])]
    kinds = [(e["kind"], e.get("cause")) for e in mine
             if e["kind"] in ("decision", "decision_dropped", "handoff_cancelled", "handoff")]
    assert kinds == [("decision", "release"), ("decision_dropped", "release"),
                     ("decision", "cancel_drain"), ("handoff_cancelled", None)], kinds
    dropped = next(e for e in mine if e["kind"] == "decision_dropped")
    assert dropped["why"] == "the cell is draining in a handoff to train", dropped
    cancelled = next(e for e in mine if e["kind"] == "handoff_cancelled")
    assert cancelled["others"] == [] and cancelled["drain_s"] < 3.0, cancelled
    assert script.runs_after >= 1  # the gateway routes runs to it again
    assert [c.role for c in coordinator.table.cells][CELL] is Role.ROLLOUT
