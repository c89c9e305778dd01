"""Property tests of the simulator and every policy over random small workloads."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.baselines import AsyncPolicy
from gyre_slurm.sched.policies import feasible_async_splits, named_policy
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.runner import simulate
from gyre_slurm.sim.workload import sample_workload

POLICIES = ["elastic", "colocate", "colocate-stream", "async-split", "elastic-nostream",
            "elastic-nofloor", "elastic-naive", "async-stream"]


@st.composite
def configs(draw):
    cell_nodes = draw(st.sampled_from([1, 2]))
    num_cells = draw(st.integers(2, 6))
    min_rollout = draw(st.integers(0, 1))
    min_train = draw(st.integers(0, min(1, num_cells - min_rollout)))
    min_replica = draw(st.sampled_from([1, 2]))
    if -(-min_replica // cell_nodes) > num_cells - min_rollout:
        min_replica = 1
    overrides = [
        f"cluster.num_nodes={num_cells * cell_nodes}", f"cluster.cell_nodes={cell_nodes}",
        f"scheduler.min_rollout_cells={min_rollout}", f"scheduler.min_train_cells={min_train}",
        f"scheduler.drain={draw(st.sampled_from(['wait', 'migrate']))}",
        f"scheduler.confirm_s={draw(st.sampled_from([0, 30, 120]))}",
        f"scheduler.min_dwell_s={draw(st.sampled_from([0, 60, 300]))}",
        f"scheduler.hysteresis={draw(st.sampled_from([0.0, 0.5, 1.0]))}",
        f"workload.num_steps={draw(st.integers(1, 4))}",
        f"workload.prompts_per_step={draw(st.integers(1, 4))}",
        f"workload.group_size={draw(st.integers(1, 4))}",
        f"workload.duration.mean_s={draw(st.sampled_from([60, 300, 1200]))}",
        f"workload.duration.sigma={draw(st.sampled_from([0.0, 0.4, 1.2]))}",
        f"workload.llm_time_fraction={draw(st.sampled_from([0.0, 0.5, 1.0]))}",
        f"rollout.runs_per_node={draw(st.integers(1, 4))}",
        f"rollout.weight_sync_s={draw(st.sampled_from([0, 20]))}",
        f"rollout.reprefill_s={draw(st.sampled_from([0, 15]))}",
        f"training.min_replica_nodes={min_replica}",
        f"training.max_staleness={draw(st.integers(0, 2))}",
        f"training.node_tokens_per_s={draw(st.sampled_from([200, 2000, 20000]))}",
        f"training.optimizer_step_s={draw(st.sampled_from([0, 5, 300]))}",
        f"training.scaling_efficiency={draw(st.sampled_from([0.3, 0.95]))}",
        f"handoff.train_state_load_s={draw(st.sampled_from([0, 30]))}",
        f"seed={draw(st.integers(0, 2**16))}",
        "scheduler.interval_s=10",
    ]
    return load_config(None, overrides)


def policy_for(cfg, name, rng_choice):
    if name.startswith("async"):
        assume(feasible_async_splits(cfg))  # every cell is needed for one replica
    if name == "async-split":
        splits = feasible_async_splits(cfg)
        return AsyncPolicy(rollout_cells=splits[rng_choice % len(splits)], name="async")
    if name == "async-stream":
        return AsyncPolicy(streaming=True, name=name,
                           rollout_cells=feasible_async_splits(cfg)[0])
    return named_policy(cfg, name)


EXAMPLES = int(os.environ.get("GYRE_PROP_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), name=st.sampled_from(POLICIES), choice=st.integers(0, 10))
def test_invariants_hold_for_every_policy(cfg, name, choice):
    workload = sample_workload(cfg)
    policy = policy_for(cfg, name, choice)
    res = simulate(cfg, policy, workload)
    # Every run finishes exactly once and no run was cut short or started over: the
    # work done is the sampled work plus the re-prefill of each migration.
    assert res.runs_finished == workload.num_runs
    expected_work = workload.work_s.sum() + res.migrations * cfg.rollout.reprefill_s
    assert res.work_done_s == pytest.approx(expected_work)
    # Same training semantics in every mode: whole batches, within the staleness bound.
    assert res.trajectories_per_step == [workload.runs_per_step] * workload.num_steps
    bound = cfg.training.max_staleness
    if policy.max_staleness is not None:
        bound = min(bound, policy.max_staleness)
    assert 0 <= res.max_staleness <= bound
    # Nothing beats the lower bound.
    assert res.makespan_s >= lower_bound(cfg, workload)["lower_bound_s"] * (1 - 1e-9)
    assert 0.0 < res.busy_fraction <= 1.0 + 1e-9
    # Floors hold: a standalone cell never leaves its role.
    layout = policy.initial_layout(cfg.cluster.num_cells)
    for cell, _t0, _t1, label in res.timeline:
        if layout.standalone[cell]:
            assert label == layout.roles[cell].value
    # A decision always carries a cause and a reason.
    assert all(d["cause"] and d["reason"] for d in res.decisions)


@settings(max_examples=10, deadline=None)
@given(cfg=configs(), name=st.sampled_from(["elastic", "colocate", "elastic-naive"]))
def test_deterministic_for_a_seed(cfg, name):
    a = simulate(cfg, named_policy(cfg, name), sample_workload(cfg))
    b = simulate(cfg, named_policy(cfg, name), sample_workload(cfg))
    assert a.makespan_s == b.makespan_s
    assert a.decisions == b.decisions
    assert a.timeline == b.timeline


def test_seed_changes_the_workload():
    a = sample_workload(load_config(None, ["seed=1"]))
    b = sample_workload(load_config(None, ["seed=2"]))
    assert not np.array_equal(a.work_s, b.work_s)


def test_training_cost_counts_the_tokens_the_packing_computes():
    """The trainer computes a run's tree once with tree packing, `rows_reread` times as
    many tokens with rows: the simulated training time follows."""
    base = ["workload.rows_reread=2.5", "training.node_tokens_per_s=200",
            "workload.duration.sigma=0.0", "handoff.train_state_load_s=0"]
    tree = load_config(None, base + ["training.packing=tree"])
    rows = load_config(None, base + ["training.packing=rows"])
    wt, wr = sample_workload(tree), sample_workload(rows)
    np.testing.assert_array_equal(wr.tokens, np.rint(wt.tokens * 2.5).astype(np.int64))
    colocate = lambda cfg, w: simulate(cfg, named_policy(cfg, "colocate"), w)  # noqa: E731
    assert colocate(rows, wr).makespan_s > colocate(tree, wt).makespan_s
