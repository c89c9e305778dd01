"""What the real coordinator tells the policy before it has measured anything: the
config's priors, the ones the opening layout was chosen on (`opening_observation`).

Until session 40 the runtime's observation fell back to fixed figures (1,000 trained
tokens/s per cell, 100 tokens per run) until the first micro-batch and trajectory came:
on the real-run benchmark (60 tokens/s a node) the first decision, at 0.0 s, saw a
training side 16 times faster than the one the opening layout was chosen for,
reclaimed 2 of its 7 training cells, and released them again 8 s later, once training
had been measured. The simulator's observations always carried the config's rates.
"""

import asyncio

import pytest

from gyre_slurm.config.schema import load_config
from gyre_slurm.runtime.coordinator import Coordinator
from gyre_slurm.sched.observe import prior_tokens_per_cell_s, prior_tokens_per_run
from runtime_checks import check_run_dir
from test_runtime_e2e import FAST, ROOT

pytestmark = pytest.mark.slow


class Recorder:
    """The coordinator's policy, unchanged, with every observation it is given kept."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.streaming, self.max_staleness = inner.streaming, inner.max_staleness
        self.seen = []

    def initial_layout(self, num_cells):
        return self.inner.initial_layout(num_cells)

    def decide(self, obs):
        self.seen.append(obs)
        return self.inner.decide(obs)


def test_the_policy_sees_the_configs_priors_until_the_runtime_has_measured(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "tiny.yaml", FAST + [
        "workload.num_steps=1", "scheduler.interval_s=0.2",
        "training.node_tokens_per_s=37", "workload.tokens_mean=55"])
    coordinator = Coordinator(cfg, run_dir)
    policy = coordinator.policy = Recorder(coordinator.policy)
    assert asyncio.run(asyncio.wait_for(coordinator.run(), 300)) == 0
    check_run_dir(run_dir, num_steps=1)

    first = policy.seen[0]
    assert first.train_ready_tokens == 0  # nothing measured yet
    assert first.train_tokens_per_cell_s == pytest.approx(prior_tokens_per_cell_s(cfg))
    assert first.tokens_per_run == pytest.approx(prior_tokens_per_run(cfg, 0))
    assert prior_tokens_per_cell_s(cfg) != 1000.0 and prior_tokens_per_run(cfg, 0) != 100.0
    # ... and once trajectories have come, what they hold
    measured = [i for i, o in enumerate(policy.seen)
                if o.tokens_per_run != pytest.approx(prior_tokens_per_run(cfg, 0))]
    assert measured, "no observation carried a measured tokens per run"
    # ... and every observation after the first measured one: the measure does not go
    # back to the prior once the trainer has taken the trajectories (it did: it was the
    # mean of those not yet handed out)
    later = [o.tokens_per_run for o in policy.seen[measured[0]:]]
    assert prior_tokens_per_run(cfg, 0) not in later, later
