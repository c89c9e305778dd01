"""Lending (scheduler.lend_cells): elastic lends spare rollout cells to training in a
step's tail and takes them back when the next batch is allowed; every lend and return
says what it expected."""

import collections
from pathlib import Path

import numpy as np
import pytest

from gyre_slurm.config.presets import preset_path
from gyre_slurm.config.schema import SchedulerConfig, load_config
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.elastic import ElasticPolicy
from gyre_slurm.sched.lend import TailLending
from gyre_slurm.sched.outlook import WorkloadPrior
from gyre_slurm.sched.policies import named_policy
from gyre_slurm.sched.types import CellObs, Observation
from gyre_slurm.sched.waterlevel import DurationModel, StepDurations
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
            assert e["handoff_cell_s"] == pytest.approx(e["cells"] * cost, abs=0.1)
            assert d["reason"].startswith(f"lend {e['cells']} cell(s)") and "gains" in d["reason"]
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


def _opening(result) -> tuple[list, list]:
    """The job's first 10 s: each cell's role from the start, and the moves."""
    roles = [role for _cell, role in sorted(
        (cell, role) for cell, start, _end, role in result.timeline if start == 0.0)]
    return roles, [(d["t"], d["cell"], d["to"]) for d in result.decisions if d["t"] < 10]


def test_a_lend_gives_way_to_the_base_layouts_opening():
    """The real-run benchmark's workload (8 cells, light steps first): a cell was lent
    at 1.5 s, before any cell may move (`min_dwell_s` 3 s), for a gain measured against
    staying, and the lent cells held the base layout: its opening release of 6 cells,
    at 4.5 s without lending, waited until 28 s (348.6 s against 300.9 s). The opening
    is now the one without lending: since session 40 the 6 cells train from the start
    (the initial layout), before that they were released at 4.5 s."""
    off, _, on = _with_and_without_lending("bench-modes-phases.yaml")
    roles, moves = opening = _opening(off)
    # cells beyond the training floor (1) train from the start or are released early
    assert roles.count(Role.TRAIN.value) > 1 or any(
        to == Role.TRAIN.value for _t, _cell, to in moves), opening
    assert _opening(on) == opening
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


def _lend_obs(*, now, ready, roles=None, loads=None, cap=8):
    """An 8-cell job in a step's tail: 6 rollout cells part full, 2 training."""
    roles = roles or [Role.ROLLOUT] * 6 + [Role.TRAIN] * 2
    loads = loads or [5, 5, 4, 4, 3, 3, 0, 0]
    cells = tuple(CellObs(i, r, None, i in (0, 6), n, since_s=0.0)
                  for i, (r, n) in enumerate(zip(roles, loads)))
    runs = sum(loads)
    return Observation(
        now_s=now, cells=cells, cell_capacity=cap, runs_in_flight=runs, runs_queued=0,
        runs_future=128, run_elapsed_s=np.full(runs, 300.0), train_ready_tokens=ready,
        train_waiting_tokens=0.0, train_tokens_per_cell_s=100.0, min_train_cells=1,
        tokens_per_run=20_000.0, policy_version=2, steps_done=2, num_steps=8,
        handoff_to_train_s=60.0, handoff_to_rollout_s=60.0, step_runs_left=runs,
        run_steps=np.full(runs, 3))


def _capacities(outlook, obs, roll: int, train: int):
    """Rollout and training capacities of `roll` and `train` cells held from now."""
    from gyre_slurm.sched.outlook import Capacity

    cap = obs.cell_capacity
    return (Capacity(obs.now_s, roll, lambda c: c * cap),
            Capacity(obs.now_s, train, outlook.train_rate))


def _lend_policy(runs_per_step=32):
    prior = WorkloadPrior(durations=StepDurations((DurationModel.lognormal(mean_s=600, sigma=0.5),)),
                          runs_per_step=runs_per_step, group_size=4, staleness=1)
    return ElasticPolicy(SchedulerConfig(confirm_s=0, min_dwell_s=300, lend_cells=4), prior=prior)


def test_the_lending_credit_does_not_come_and_go_with_the_tokens_ready_now():
    """Consecutive plans are weighed with the same credit whether training has tokens
    ready at that instant or not: a credit given only within `min_dwell_s` of tokens
    ready had the real-run benchmark reclaim a cell with it and release another 1.5 s
    later without it (the same layout expected to train step 7 at 334.6 s, then 402.7 s)."""
    p = _lend_policy()
    for now, ready in ((1000.0, 0.0), (1100.0, 50_000.0), (1300.0, 0.0), (1401.0, 0.0)):
        obs = _lend_obs(now=now, ready=ready)
        outlook = p.outlook(obs)
        assert outlook.lend is not None, (now, ready)
        outlook.finish_s(*_capacities(outlook, obs, roll=6, train=2))
        assert outlook.lent_cell_s > 0.0, (now, ready)
    obs = _lend_obs(now=1100.0, ready=50_000.0)
    assert p.outlook(obs, lending=False).lend is None


def test_no_lending_where_a_new_batch_never_needs_the_cells_back():
    """A staleness window of 2 x 4 runs fits in one 8-slot cell: a cell lent in a tail
    is a release the base plan should make once, not a lend and a return every step
    (jobs of a few runs a step on 6-8 cells: up to 7.6% slower with lending)."""
    obs = _lend_obs(now=1000.0, ready=50_000.0)
    assert _lend_policy(runs_per_step=4).lending.cells(obs) == 0
    assert _lend_policy(runs_per_step=32).lending.cells(obs) == 4  # 64 runs: 8 cells' slots
    assert TailLending(4).cells(obs) == 4  # window unknown: as before


def test_a_plan_with_no_training_side_is_credited_no_lending():
    """A cell is lent only to a training world that trains (a whole replica); without
    floors (elastic-nofloor) plans with no training cell were credited lending that
    never came (deepswe-122b-curriculum 26% slower than elastic)."""
    p = _lend_policy()
    obs = _lend_obs(now=1000.0, ready=50_000.0)
    outlook = p.outlook(obs)
    assert outlook.lend is not None
    credited = {}
    for trainers in (0, 2):
        outlook.finish_s(*_capacities(outlook, obs, roll=6, train=trainers))
        credited[trainers] = outlook.lent_cell_s
    assert credited[0] == 0.0 and credited[2] > 0.0, credited


# 4 one-node cells of one slot, 2 runs a step of 1,800 s, training twice the rollout work,
# micro-batches of the default 100,000 tokens (a step is 30,000-80,000): one micro-batch
# holds a whole step, so a cell lent in its tail cannot join before the step is trained.
ONE_BATCH_STEPS = [
    "cluster.num_nodes=4", "cluster.cell_nodes=1", "cluster.gpus_per_node=0",
    "workload.num_steps=9", "workload.prompts_per_step=1", "workload.group_size=2",
    "workload.duration.mean_s=1800", "workload.duration.sigma=0.8",
    "workload.tokens_mean=20000", "rollout.runs_per_node=1",
    "training.node_tokens_per_s=18.5185", "training.scaling_efficiency=0.7",
    "scheduler.interval_s=36"]


def test_the_lending_credit_waits_for_a_micro_batch_to_join():
    """The outlook credited lent cells with training from their arrival, where a lent
    cell joins the world between micro-batches: here that is once a step, the lend rule
    (ready tokens beyond the micro-batch) never fired, and the credit kept a third
    rollout cell idle for it, 1.10x the best fixed split's mean over these six seeds
    (1.08x over twenty). With the join wait counted it is within 3%."""
    from test_sim_policy_props import fixed_split_makespans

    elastic, best = [], []
    for seed in range(6):
        cfg = load_config(None, ONE_BATCH_STEPS + [f"seed={seed}"])
        workload = sample_workload(cfg)
        elastic.append(simulate(cfg, named_policy(cfg, "elastic"), workload).makespan_s)
        best.append(fixed_split_makespans(cfg, workload))
    means = {r: np.mean([b[r] for b in best]) for r in best[0]}
    assert np.mean(elastic) <= 1.03 * min(means.values()), (np.mean(elastic), means)


def test_every_cell_spare_now_is_lent_together():
    """The lend takes the least-loaded elastic rollout cells while the runs of all of
    them fit in the free slots of the cells that stay, up to the cells lent at once."""
    obs = _lend_obs(now=1000.0, ready=50_000.0)  # loads 5 5 4 4 3 3 on 6 rollout cells
    ids = lambda cells: [c.cell_id for c in cells]  # noqa: E731
    # cells 5 and 4 (3 runs each), then 3 (4 runs): 10 runs into the 10 slots left on
    # cells 0-2; cell 2 as well would leave 6 slots for 14 runs
    assert ids(TailLending(4).candidates(obs, 300.0)) == [5, 4, 3]
    assert ids(TailLending(2).candidates(obs, 300.0)) == [5, 4]
    lending = TailLending(4)
    lending.lent[7] = 900.0  # one lent already (not in rollout): three more at most
    assert ids(lending.candidates(obs, 300.0)) == [5, 4, 3]
    lending.lent[6] = 900.0
    assert ids(lending.candidates(obs, 300.0)) == [5, 4]
    assert TailLending(4).candidates(obs, 2000.0) == []  # none has dwelt long enough


# terminalbench-122b on 64 cells of 4 nodes (2,048 runs a step), 4 steps
AT_SCALE = ["cluster.num_nodes=256", "workload.prompts_per_step=256", "workload.num_steps=4"]


def test_on_many_cells_the_lending_credited_is_the_lending_done():
    """The outlook credits every plan with each spare cell lent as soon as it is spare;
    lent one at a time, each later cell had to gain `min_gain` of the horizon by itself,
    which on 64 cells one cell never did: 2 of the 4 credited were lent in each tail and
    the base layout, chosen for 4, kept too few training cells (2.2% slower than with no
    lending at all). Lent together, several cells go at once, and lending costs at most
    1% against none."""
    made = {}
    for lend in (0, 4):
        cfg = load_config(preset_path("terminalbench-122b"),
                          AT_SCALE + [f"scheduler.lend_cells={lend}"])
        made[lend] = simulate(cfg, named_policy(cfg, "elastic"), sample_workload(cfg))
    lends = [d for d in made[4].decisions if (d.get("expected") or {}).get("plan") == "lend"]
    together = collections.Counter(d["t"] for d in lends)
    assert max(together.values()) >= 2, together
    for d in lends:  # one decision per cell, each saying how many went with it
        assert d["expected"]["cells"] == together[d["t"]], d
    assert made[4].makespan_s <= 1.01 * made[0].makespan_s, (made[4].makespan_s,
                                                              made[0].makespan_s)
