"""The simulator's mechanics and the lower bound, on hand-made cases."""

import itertools

import numpy as np
import pytest

from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.baselines import ColocatePolicy
from gyre_slurm.sim.bounds import work_bound
from gyre_slurm.sim.engine import Simulator
from gyre_slurm.sim.training import train_throughput
from gyre_slurm.sim.workload import sample_workload


class Recording(Simulator):
    """Records every cell's load each time queued runs are admitted."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.admissions: list[tuple[float, list[int]]] = []

    def admit(self) -> None:
        super().admit()
        serving = self.accepting()
        self.admissions.append((self.now, [int(self.rollout.load[c]) for c in serving]))


@pytest.mark.parametrize("runs_per_step, cells", [(16, 4), (12, 4), (10, 3)])
def test_colocate_cells_returning_together_share_the_queue(runs_per_step, cells):
    # Every step all cells come back from training at once and the step's batch waits:
    # the runs spread over the cells (least loaded first), never filling some cells to
    # capacity while others stay empty.
    cfg = load_config(None, [f"cluster.num_nodes={cells}", "rollout.runs_per_node=8",
                             "workload.num_steps=3", f"workload.prompts_per_step={runs_per_step // 2}",
                             "workload.group_size=2", "handoff.group_rebuild_s=7"])
    sim = Recording(cfg, ColocatePolicy(), sample_workload(cfg))
    sim.run()
    after_training = [loads for t, loads in sim.admissions if t > 0 and len(loads) == cells
                      and sum(loads) == runs_per_step]
    assert len(after_training) >= 2  # steps 1 and 2 started on every cell at once
    for loads in after_training:
        assert max(loads) - min(loads) <= 1, loads


def test_work_bound_mixes_two_training_widths():
    # Replicas of 2 nodes on 5 one-node cells: widths 2 and 4 train; 3 does no better
    # than 2. With this much rollout, neither width alone balances the cells; a mix of
    # the two does, and the bound is the best mix (checked against a brute force over
    # every pair of widths and every split of the tokens between them).
    cfg = load_config(None, ["cluster.num_nodes=5", "training.min_replica_nodes=2",
                             "training.scaling_efficiency=0.8", "training.node_tokens_per_s=100"])
    rollout_cell_s, tokens = 10_000.0, 1_000_000.0
    got = work_bound(cfg, rollout_cell_s=rollout_cell_s, tokens=tokens)
    thr = {w: train_throughput(cfg.training, w) for w in range(1, 6)}
    single = min(max(tokens / thr[w], (rollout_cell_s + w * tokens / thr[w]) / 5)
                 for w in thr if thr[w] > 0)
    brute = single
    for w1, w2 in itertools.combinations([w for w in thr if thr[w] > 0], 2):
        for x in np.linspace(0, 1, 20001):  # share of tokens trained at w1
            wall = tokens * (x / thr[w1] + (1 - x) / thr[w2])
            cell_s = tokens * (x * w1 / thr[w1] + (1 - x) * w2 / thr[w2])
            brute = min(brute, max(wall, (rollout_cell_s + cell_s) / 5))
    assert got == pytest.approx(brute, rel=1e-4)
    assert got < single * 0.995


def test_cell_time_accounts_for_every_cell_second():
    # `tools/sim_table.py --losses` splits each policy's cell-seconds: held in rollout,
    # in training and in transit add up to cells x makespan; busy is at most held.
    from gyre_slurm.sched.policies import named_policy

    cfg = load_config(None, ["cluster.num_nodes=4", "rollout.runs_per_node=8",
                             "workload.num_steps=4", "workload.prompts_per_step=8",
                             "workload.group_size=2"])
    res = Simulator(cfg, named_policy(cfg, "elastic"), sample_workload(cfg)).run()
    t = res.cell_time()
    held = t["rollout_s"] + t["train_s"] + t["transit_s"]
    assert held == pytest.approx(cfg.cluster.num_cells * res.makespan_s, rel=1e-9)
    assert 0 < t["rollout_busy_s"] <= t["rollout_s"] * (1 + 1e-9)
    assert 0 < t["train_busy_s"] <= t["train_s"] * (1 + 1e-9)


@pytest.mark.parametrize("train_cells,spare", [(3, 1), (2, 0), (5, 1)])
def test_training_cells_beyond_whole_replicas_are_counted_spare(train_cells, spare):
    # A replica of 2 one-node cells: a world of 3 trains as fast as one of 2, and its
    # third cell is held busy for nothing. `--losses` reports it apart from the cost of
    # wide worlds (nl2repo-2.4t's elastic held 11 cells, 8 of them usable).
    from gyre_slurm.sched.baselines import AsyncPolicy

    cfg = load_config(None, ["cluster.num_nodes=6", "cluster.cell_nodes=1",
                             "training.min_replica_nodes=2", "rollout.runs_per_node=8",
                             "workload.num_steps=3", "workload.prompts_per_step=8",
                             "workload.group_size=2"])
    res = Simulator(cfg, AsyncPolicy(rollout_cells=6 - train_cells),
                    sample_workload(cfg)).run()
    t = res.cell_time()
    assert t["train_busy_s"] > 0
    assert t["train_spare_s"] == pytest.approx(t["train_busy_s"] * spare / train_cells,
                                               rel=1e-9)


def test_the_tail_lending_experiment_lends_in_tails_and_gives_cells_back():
    # tools/sim_lend.py, which docs/scheduler.md cites: cells go to training only while
    # no run waits to start, come back when runs queue, and the job's semantics hold.
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "sim_lend.py"
    spec = importlib.util.spec_from_file_location("sim_lend", path)
    sim_lend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim_lend)
    cfg = load_config(None, ["cluster.num_nodes=4", "cluster.cell_nodes=1",
                             "rollout.runs_per_node=4", "workload.num_steps=6",
                             "workload.prompts_per_step=4", "workload.group_size=2",
                             "training.node_tokens_per_s=200"])
    w = sample_workload(cfg)
    res = Simulator(cfg, sim_lend.TailLendPolicy(floor=1, floats=2), w).run()
    assert res.runs_finished == w.num_runs
    assert res.trajectories_per_step == [w.runs_per_step] * w.num_steps
    assert res.max_staleness <= cfg.training.max_staleness
    lends = [d for d in res.decisions if d["to"] == "train"]
    backs = [d for d in res.decisions if d["to"] == "rollout"]
    assert lends and backs, res.decisions[:4]
    assert all(d["drain"] == "migrate" and "tail" in d["reason"] for d in lends)
    assert all(d["cause"] in ("reclaim", "cancel_drain") for d in backs)
    assert len(backs) <= len(lends)


def test_optimizer_steps_count_once_against_the_cells_not_whole():
    # Rollout goes on while training takes its optimizer steps: ten steps of 500 s hold
    # one training cell for 5,000 s, not all sixteen. The bound used to add the ten
    # steps to the makespan whole, and elastic finished 2.1% below that "lower bound".
    from gyre_slurm.sched.policies import named_policy
    from gyre_slurm.sim.bounds import lower_bound

    cfg = load_config(None, ["cluster.num_nodes=16", "rollout.runs_per_node=8",
                             "workload.num_steps=10", "workload.prompts_per_step=64",
                             "workload.group_size=4", "workload.duration.mean_s=2000",
                             "workload.duration.sigma=0.05", "rollout.weight_sync_s=0",
                             "training.optimizer_step_s=500",
                             "training.node_tokens_per_s=1000000"])
    w = sample_workload(cfg)
    bound = lower_bound(cfg, w)
    res = Simulator(cfg, named_policy(cfg, "elastic"), w).run()
    assert res.makespan_s >= bound["lower_bound_s"]
    # What the bound charges: the rollout on every cell plus one cell held per step.
    rollout_s = float(w.work_s.sum()) / cfg.cell_capacity
    assert bound["work_bound_s"] >= (rollout_s + 10 * 500) / 16
    assert bound["work_bound_s"] < rollout_s / 16 + 10 * 500 * 0.2


def test_the_critical_path_trains_on_the_fastest_world():
    # Below 0.5 a doubling, a wider world trains fewer tokens/s than a narrow one: the
    # critical path must charge training at the fastest world, not at every node (where
    # it used to, putting elastic at 0.37 of the "lower bound" on this training-bound job).
    from gyre_slurm.sched.policies import named_policy
    from gyre_slurm.sim.bounds import fastest_throughput, lower_bound

    cfg = load_config(None, ["cluster.num_nodes=4", "rollout.runs_per_node=8",
                             "workload.num_steps=4", "workload.prompts_per_step=2",
                             "workload.group_size=2", "workload.duration.mean_s=60",
                             "workload.tokens_mean=100000", "training.max_staleness=0",
                             "training.scaling_efficiency=0.3",
                             "training.node_tokens_per_s=200"])
    assert fastest_throughput(cfg) == train_throughput(cfg.training, 1)
    w = sample_workload(cfg)
    bound = lower_bound(cfg, w)["lower_bound_s"]
    for name in ("elastic", "colocate"):
        res = Simulator(cfg, named_policy(cfg, name), w).run()
        assert res.makespan_s >= bound, name


@pytest.mark.parametrize("waits", [(), ("scheduler.confirm_s=5000", "scheduler.min_dwell_s=3000")])
def test_a_policy_waiting_to_confirm_is_not_a_deadlock(waits):
    # No training cell, the only batch done, its tokens ready: the waterlevel rule
    # (elastic-naive) waits to confirm a release (and for cells to dwell) before any cell
    # moves. The simulator took 100 quiet ticks (100 s here) for a deadlock and failed
    # every elastic policy (elastic itself now starts a cell in training: its opening
    # weighs the floors' never-finishing stay, tests/test_elastic.py).
    from gyre_slurm.sched.policies import named_policy

    cfg = load_config(None, ["cluster.num_nodes=4", "rollout.runs_per_node=2",
                             "workload.num_steps=2", "workload.prompts_per_step=1",
                             "workload.group_size=1", "workload.duration.mean_s=10",
                             "scheduler.interval_s=1", "scheduler.min_train_cells=0", *waits])
    w = sample_workload(cfg)
    for name in ("elastic", "elastic-naive", "elastic-nofloor"):
        res = Simulator(cfg, named_policy(cfg, name), w).run()
        assert res.runs_finished == w.num_runs, name
    naive = Simulator(cfg, named_policy(cfg, "elastic-naive"), w).run()
    assert naive.makespan_s > cfg.scheduler.confirm_s  # it did wait, past 100 ticks
    assert naive.makespan_s > 100 * cfg.scheduler.interval_s


def test_runs_all_on_the_model_with_no_half_load_point_take_their_time():
    # llm_time_fraction 1 and half_load_runs 0: a run's speed is capacity / load, and an
    # empty cell's would be infinite. That advanced the empty cells' virtual clocks to
    # infinity, the next run placed there ended at once, and colocate finished at 0.10
    # of the lower bound (found by a wide random draw of configs).
    from gyre_slurm.sched.policies import named_policy
    from gyre_slurm.sim.bounds import lower_bound

    cfg = load_config(None, ["cluster.num_nodes=4", "rollout.runs_per_node=4",
                             "workload.num_steps=3", "workload.prompts_per_step=2",
                             "workload.group_size=2", "workload.duration.mean_s=600",
                             "workload.duration.sigma=1.0", "workload.llm_time_fraction=1.0",
                             "rollout.half_load_runs=0", "seed=3"])
    w = sample_workload(cfg)
    bound = lower_bound(cfg, w)["lower_bound_s"]
    for name in ("colocate", "elastic"):
        res = Simulator(cfg, named_policy(cfg, name), w).run()
        assert res.makespan_s >= bound, name
        assert res.makespan_s >= w.work_s.max() / cfg.cell_capacity, name


def test_a_longest_run_goes_faster_only_at_its_cells_cost():
    # The critical path lets each step's longest run go alone on a cell at rate_max (here
    # 1.875x a full cell's rate: 80% of a run's time waits on the model), the work bound
    # counts every rollout cell full; the tail-speed bound charges the chain's runs what
    # their speed costs their cells. Here it binds, 4% above the three others, and no
    # policy finishes below it.
    from gyre_slurm.sched.policies import named_policy
    from gyre_slurm.sim.bounds import lower_bound

    cfg = load_config(None, ["cluster.num_nodes=4", "rollout.runs_per_node=8",
                             "workload.num_steps=6", "workload.prompts_per_step=4",
                             "workload.group_size=4", "workload.duration.mean_s=600",
                             "workload.duration.sigma=0.3", "workload.llm_time_fraction=0.8",
                             "workload.tokens_mean=20000", "training.max_staleness=1",
                             "training.node_tokens_per_s=1000"])
    w = sample_workload(cfg)
    bound = lower_bound(cfg, w)
    others = max(bound["work_bound_s"], bound["critical_path_s"], bound["staged_bound_s"])
    assert bound["lower_bound_s"] == bound["tail_speed_bound_s"] > 1.03 * others
    for name in ("elastic", "colocate", "async-even"):
        res = Simulator(cfg, named_policy(cfg, name), w).run()
        assert res.makespan_s >= bound["lower_bound_s"], name
