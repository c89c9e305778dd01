"""Lending (scheduler.lend_cells): elastic lends spare rollout cells to training in a
step's tail and takes them back when the next batch is allowed; every lend and return
says what it expected."""

import collections
from pathlib import Path

import pytest

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.lend import TailLending
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sim.runner import simulate
from gyre_slurm.sim.workload import sample_workload

SHORT = ["workload.num_steps=4"]  # terminalbench-122b, 4 steps: 8 cells, a replica is one


@pytest.fixture(scope="module")
def runs():
    out = {}
    for lend in (0, 4):
        cfg = load_config(preset_path("terminalbench-122b"),
                          SHORT + [f"scheduler.lend_cells={lend}"])
        out[lend] = (cfg, simulate(cfg, named_policy(cfg, "elastic"), sample_workload(cfg)))
    return out


def test_lending_in_steps_tails_finishes_sooner(runs):
    (_, off), (_, on) = runs[0], runs[4]
    assert not [d for d in off.decisions if (d.get("expected") or {}).get("plan") == "lend"]
    assert on.makespan_s < 0.99 * off.makespan_s, (on.makespan_s, off.makespan_s)


def test_every_lend_and_return_says_what_it_expected(runs):
    cfg, res = runs[4]
    cost = cfg.handoff.to_train_s + cfg.handoff.to_rollout_s
    plans = collections.Counter((d.get("expected") or {}).get("plan") for d in res.decisions)
    assert plans["lend"] >= 2 and plans["return"] >= 1, plans
    lent: set[int] = set()
    for d in res.decisions:
        e = d.get("expected") or {}
        if e.get("plan") == "lend":
            assert d["to"] == Role.TRAIN.value and d["drain"] == "migrate"
            assert e["gain_s"] > 0 and e["finish_s"] < e["finish_without_lending_s"]
            left = e["finish_without_lending_s"] - d["t"]  # worth a move, as any move
            assert e["gain_s"] >= cfg.scheduler.min_gain * left - 0.1, (d["t"], e)
            assert e["handoff_cell_s"] == pytest.approx(cost, abs=0.1)
            assert d["reason"].startswith("lend 1 cell") and "gains" in d["reason"]
            lent.add(d["cell"])
            assert len(lent) <= 4
        elif e.get("plan") == "return":
            assert d["to"] == Role.ROLLOUT.value and d["cause"] in ("reclaim", "cancel_drain")
            assert e["runs_queued"] > 0 and "queued" in d["reason"]
            lent.discard(d["cell"])


def test_lending_needs_a_one_cell_replica_four_cells_and_keeps_half_of_them():
    cfg = load_config(preset_path("terminalbench-122b"), ["scheduler.lend_cells=6"])
    policy = named_policy(cfg, "elastic")
    lending = TailLending(6)

    class Obs:  # only what `cells` reads
        def __init__(self, cells, replica):
            self.cells, self.min_train_cells = [None] * cells, replica

    assert lending.cells(Obs(8, 1)) == 4 and lending.cells(Obs(4, 1)) == 2
    assert lending.cells(Obs(3, 1)) == 0  # a lent cell would be half the rollout side
    assert lending.cells(Obs(16, 4)) == 0  # a lent cell short of a replica trains nothing
    assert policy.lending.most == 6


def _with_and_without_lending(name):
    path = Path(__file__).resolve().parent.parent / "configs" / name
    made = {}
    for lend in (0, 4):
        cfg = load_config(path, [f"scheduler.lend_cells={lend}"])
        made[lend] = (cfg, simulate(cfg, named_policy(cfg, "elastic"), sample_workload(cfg)))
    return made[0][1], made[4][0], made[4][1]


def test_a_lend_gives_way_to_the_base_layouts_opening():
    """The real-run benchmark's workload (8 cells, light steps first): a cell was lent
    at 1.5 s, before any cell may move (`min_dwell_s` 3 s), for a gain measured against
    staying, and the lent cells held the base layout: its opening release of 6 cells,
    at 4.5 s without lending, waited until 28 s (348.6 s against 300.9 s). The opening
    is now the one without lending."""
    off, _, on = _with_and_without_lending("bench-modes-phases.yaml")
    opening = [(d["t"], d["cell"], d["to"]) for d in off.decisions if d["t"] < 10]
    assert opening and [(d["t"], d["cell"], d["to"]) for d in on.decisions
                        if d["t"] < 10] == opening
    assert on.makespan_s <= 1.01 * off.makespan_s, (on.makespan_s, off.makespan_s)


def test_a_lend_waits_for_the_dwell_and_names_the_base_move_it_beat():
    """Every lend comes after its cell has dwelt `min_dwell_s` in rollout, as any move
    must, and says which move of the base layout (without lending) it was weighed
    against: one expected to finish later than the lend, or none."""
    _, cfg, on = _with_and_without_lending("bench-modes-phases-tail.yaml")
    moved = collections.defaultdict(float)  # cell -> when it last changed role
    lends = 0
    for d in on.decisions:
        e = d.get("expected") or {}
        if e.get("plan") == "lend":
            lends += 1
            assert d["t"] - moved[d["cell"]] >= cfg.scheduler.min_dwell_s, d
            base = e["best_move_without_lending"]
            assert base is None or base["finish_s"] >= e["finish_s"], e  # (rounded)
        moved[d["cell"]] = d["t"]
    assert lends >= 1
