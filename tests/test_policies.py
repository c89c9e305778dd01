"""Table-driven tests of the waterlevel rule (`scheduler.forecast: false`) and the
baselines on hand-made observations (the elastic outlook: tests/test_elastic.py)."""

from dataclasses import replace

import numpy as np
import pytest

from gyre_slurm.config.schema import SchedulerConfig
from gyre_slurm.sched.baselines import AsyncPolicy, ColocatePolicy
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.elastic import ElasticPolicy
from gyre_slurm.sched.types import CellObs, Observation
from gyre_slurm.sched.waterlevel import waterlevel

R, T = Role.ROLLOUT, Role.TRAIN


def cells(*specs):
    """specs: (role, active_runs) or (role, active_runs, target); cell 0 and 1 standalone."""
    out = []
    for i, spec in enumerate(specs):
        role, runs = spec[0], spec[1]
        target = spec[2] if len(spec) > 2 else None
        out.append(CellObs(i, role, target, i < 2, runs, since_s=0.0))
    return tuple(out)


def obs(cell_specs, *, now=10_000.0, in_flight=0, queued=0, ready=0.0, waiting=0.0,
        elapsed=None, future=0, step_runs_left=10):
    c = cells(*cell_specs)
    return Observation(
        now_s=now, cells=c, cell_capacity=10, runs_in_flight=in_flight, runs_queued=queued,
        runs_future=future,
        run_elapsed_s=np.full(in_flight, 600.0) if elapsed is None else np.asarray(elapsed),
        train_ready_tokens=ready, train_waiting_tokens=waiting, train_tokens_per_cell_s=1000.0,
        min_train_cells=1, tokens_per_run=10_000.0, policy_version=0, steps_done=0,
        num_steps=10, handoff_to_train_s=60.0, handoff_to_rollout_s=60.0,
        step_runs_left=step_runs_left)


def naive(**kw):
    cfg = SchedulerConfig(forecast=False, drain="wait", confirm_s=60, min_dwell_s=0,
                          hysteresis=0.5, **kw)
    return ElasticPolicy(cfg, durations=None)


def test_waterlevel():
    assert waterlevel(runs_in_flight=25, runs_queued=5, cell_capacity=10) == 3.0


@pytest.mark.parametrize("name, layout, kw, expect", [
    # R=4 rollout cells, demand 12 runs -> L=1.2; spare 2.8 >= 1.5 -> release floor(2.3)=2
    ("release two", [(R, 5), (T, 0), (R, 4), (R, 3), (R, 0)], dict(in_flight=12),
     [(4, T, "release"), (3, T, "release")]),
    # spare 4 - 2.6 = 1.4 < 1 + h: keep
    ("within hysteresis", [(R, 9), (T, 0), (R, 9), (R, 8), (R, 0)], dict(in_flight=26), []),
    # runs queue: L = (40 + 10)/10 = 5 > R=3 + 0.5 -> reclaim ceil(5-3-0.5)=2 of the train cells
    ("reclaim", [(R, 10), (T, 0), (R, 10), (R, 10), (T, 0), (T, 0), (T, 0)],
     dict(in_flight=30, queued=20), [(6, R, "reclaim"), (5, R, "reclaim")]),
    # never a standalone cell, never below floors
    ("floors hold", [(R, 10), (T, 0)], dict(in_flight=10, queued=50), []),
    # a cell draining towards training is given back before any train cell moves
    ("cancel drain first", [(R, 10), (T, 0), (Role.DRAINING, 10, T), (T, 0)],
     dict(in_flight=20, queued=8), [(2, R, "cancel_drain")]),
])
def test_naive_waterlevel_decisions(name, layout, kw, expect):
    policy = naive()
    first = policy.decide(obs(layout, now=0.0, **kw))
    later = policy.decide(obs(layout, now=100.0, **kw))
    got = [(d.cell_id, d.to_role, d.cause) for d in (first if kw.get("queued") else later)]
    assert got == expect, name
    for d in list(first) + list(later):
        assert d.reason  # every decision says why


def test_release_waits_for_the_confirmation_window():
    policy = naive()
    layout = [(R, 0), (T, 0), (R, 0), (R, 0)]
    assert policy.decide(obs(layout, now=0.0)) == []
    assert policy.decide(obs(layout, now=59.0)) == []
    assert [d.cell_id for d in policy.decide(obs(layout, now=60.0))] == [3, 2]


def test_window_restarts_when_the_condition_breaks():
    policy = naive()
    layout = [(R, 0), (T, 0), (R, 0), (R, 0)]
    policy.decide(obs(layout, now=0.0))
    policy.decide(obs(layout, now=30.0, in_flight=30))  # demand back: window resets
    assert policy.decide(obs(layout, now=70.0)) == []
    assert policy.decide(obs(layout, now=130.0)) != []


def test_min_dwell_keeps_a_fresh_cell_in_place():
    policy = ElasticPolicy(SchedulerConfig(forecast=False, confirm_s=0, min_dwell_s=500),
                           durations=None)
    o = obs([(R, 0), (T, 0), (R, 0), (R, 0)], now=100.0)
    assert policy.decide(o) == []
    assert len(policy.decide(replace(o, now_s=600.0))) == 2


def test_colocate_switches_all_cells_together():
    p = ColocatePolicy()
    rolling = [(R, 0), (R, 0), (R, 0)]
    assert p.decide(obs(rolling, in_flight=3)) == []
    to_train = p.decide(obs(rolling, ready=100.0))
    assert [(d.cell_id, d.to_role) for d in to_train] == [(0, T), (1, T), (2, T)]
    training = [(T, 0), (T, 0), (T, 0)]
    assert p.decide(obs(training, ready=100.0, queued=30)) == []
    assert len(p.decide(obs(training, queued=30))) == 3
    moving = [(T, 0), (Role.LOADING, 0, R), (T, 0)]
    assert p.decide(obs(moving, queued=30)) == []


def test_async_never_moves_and_splits_as_asked():
    p = AsyncPolicy(rollout_cells=3)
    layout = p.initial_layout(5)
    assert layout.roles == (R, R, R, T, T) and all(layout.standalone)
    assert p.decide(obs([(R, 10)] * 3 + [(T, 0)] * 2, in_flight=30, queued=99)) == []
    assert AsyncPolicy().split(8) == 4
    with pytest.raises(ValueError, match="1..4 rollout cells"):
        AsyncPolicy(rollout_cells=5).split(5)
