"""Property tests of the elastic policy against the layouts it must beat or match, over
random workloads that include its hard cases: 2-3 cells, training-bound steps, heavy
tails, and demand that changes over the job (workload phases).

- elastic's makespan is never more than 3% above that of the best fixed split, chosen
  with hindsight (every split, with and without streaming: no online policy has that);
- cell moves stay bounded: at most one handoff per cell per mean run duration;
- and on every shipped preset, elastic / lower bound <= 1.15, or for the presets that
  miss it, no worse than when the policy landed (slow: whole presets).
"""

import os
import random

import pytest

from gyre_slurm.config.presets import preset_names, preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.sched.baselines import AsyncPolicy
from gyre_slurm.sched.policies import feasible_async_splits, make_elastic, named_policy
from gyre_slurm.sim.bounds import lower_bound
from gyre_slurm.sim.runner import simulate
from gyre_slurm.sim.workload import sample_workload

# The same jobs every run, wherever the test runs (set GYRE_POLICY_EXAMPLES higher to
# look further; 150 examples were checked when the policy landed). Drawn with a seeded
# random.Random, not hypothesis: hypothesis mixes into its draws the constants of every
# local module loaded in the process, so its derandomized examples changed with the
# tests that shared the pytest worker, and with any constant added to gyre_slurm (run
# beside eight other scheduler test files on 2 workers, this test drew another job at
# its 10th example and failed on it, on code whose CI run had passed).
EXAMPLES = int(os.environ.get("GYRE_POLICY_EXAMPLES", "40"))
# Simulations in this process only: tools/test's light worker may take the slow ones.
pytestmark = pytest.mark.solo


def draw_job(rng: random.Random) -> list[str]:
    """A job on 2-8 one-node cells: runs of a given mean with a light to heavy tail,
    training from a twentieth to two thirds of the work, handoffs 2-10% of a run, and
    sometimes demand that changes (runs that grow, or a task mix that shifts). As the
    `--set` overrides of a config (tools/sim_draws.py draws the same jobs by the
    thousand and prints them so)."""
    cells = rng.choice([2, 3, 3, 4, 6, 8])
    mean = rng.choice([300.0, 1800.0])
    sigma = rng.choice([0.2, 0.5, 1.0, 1.5])
    cap = rng.choice([2, 4, 8])
    prompts, group = rng.randint(1, 4), rng.choice([2, 4])
    runs = prompts * group
    share = rng.choice([0.05, 0.2, 0.4, 0.66])  # training's share of the work
    tokens = 20_000.0
    node_tps = runs * tokens / (runs * mean / cap * share / (1 - share))
    hand = rng.choice([0.02, 0.1]) * mean
    phases = rng.choice([
        None, "[{from_step: 0, growth_per_step: 0.15}]",
        "[{from_step: 0, duration_scale: 0.5, growth_per_step: 0.1, tokens_growth_per_step: 0.25}]",
        "[{from_step: 3, duration_scale: 2.5, tokens_scale: 0.6, sigma: 1.2}]",
        "[{from_step: 3, duration_scale: 0.4, tokens_scale: 2.0}]"])
    steps, staleness, seed = rng.randint(6, 10), rng.choice([1, 1, 2]), rng.randint(0, 999)
    overrides = [
        f"cluster.num_nodes={cells}", "cluster.cell_nodes=1",
        f"workload.num_steps={steps}",
        f"workload.prompts_per_step={prompts}", f"workload.group_size={group}",
        f"workload.duration.mean_s={mean}", f"workload.duration.sigma={sigma}",
        f"workload.tokens_mean={tokens}", f"rollout.runs_per_node={cap}",
        f"training.node_tokens_per_s={node_tps:.4f}",
        f"training.max_staleness={staleness}",
        f"training.optimizer_step_s={0.01 * mean}",
        f"training.microbatch_tokens={max(tokens, runs * tokens / 8)}",
        f"handoff.engine_release_s={0.2 * hand}", f"handoff.group_rebuild_s={0.1 * hand}",
        f"handoff.train_state_load_s={0.3 * hand}", f"handoff.weight_load_s={0.2 * hand}",
        f"handoff.engine_start_s={0.3 * hand}",
        f"rollout.weight_sync_s={0.01 * mean}", f"rollout.reprefill_s={0.02 * mean}",
        f"rollout.call_interval_s={0.02 * mean}",
        f"scheduler.interval_s={0.02 * mean}", f"seed={seed}",
        f"scheduler.confirm_s={0.05 * mean}", f"scheduler.min_dwell_s={0.2 * mean}",
    ]
    if phases:
        overrides.append(f"workload.phases={phases}")
    return overrides


def drawn_jobs(n: int, seed: int = 0) -> list[list[str]]:
    """The first n jobs of draw `seed`: job k from its own Random, so the first n of a
    longer draw are the same jobs."""
    return [draw_job(random.Random(1_000_003 * seed + k)) for k in range(n)]


def fixed_split_makespans(cfg, workload) -> dict[int, float]:
    """Each fixed split's makespan, the faster of with and without streaming (by its
    rollout cells; tools/sim_draws.py compares elastic with them too)."""
    return {r: min(simulate(cfg, AsyncPolicy(rollout_cells=r, streaming=stream),
                            workload).makespan_s for stream in (False, True))
            for r in feasible_async_splits(cfg)}


def best_fixed_split(cfg, workload) -> float:
    return min(fixed_split_makespans(cfg, workload).values())


@pytest.mark.slow
@pytest.mark.parametrize("overrides", drawn_jobs(EXAMPLES),
                         ids=[f"job{k:03d}" for k in range(EXAMPLES)])
def test_elastic_is_never_far_behind_the_best_fixed_split(overrides):
    cfg = load_config(None, overrides)
    workload = sample_workload(cfg)
    elastic = simulate(cfg, named_policy(cfg, "elastic"), workload)
    best = best_fixed_split(cfg, workload)
    assert elastic.makespan_s <= 1.03 * best, (elastic.makespan_s / best, overrides)
    # Moves stay bounded: no cell changes role more than once per mean run duration.
    run_lengths = elastic.makespan_s / cfg.workload.duration.mean_s
    assert elastic.handoffs <= cfg.cluster.num_cells * run_lengths, elastic.handoffs
    assert elastic.runs_finished == workload.num_runs


PRESETS = [name for name in preset_names() if name != "small"]
# The aim is 1.15 everywhere; these presets miss it, each by the figure measured when the
# policy landed (docs/scheduler.md, "Against the lower bound", says where the time goes),
# so the test holds them to it: a change that loses more fails. nl2repo-2.4t's went from
# 1.212 to 1.246 when the bound stopped adding its 48 optimizer steps of 120 s to the
# makespan whole (rollout goes on meanwhile): the policy is unchanged. Measured at b5d6997
# (a step's tail from all its runs, a horizon of 2 steps): deepswe-122b 1.198,
# nl2repo-2.4t 1.248, terminalbench-122b-growing 1.2296, deepswe-122b-curriculum 1.198;
# since a migrate drain is expected to last until its runs' next calls (session 37):
# nl2repo-2.4t 1.2445, deepswe-122b-curriculum 1.187. With lending on by default
# (session 38): deepswe-122b 1.147 (within the aim), terminalbench-122b-growing 1.195,
# deepswe-122b-curriculum 1.184; nl2repo-2.4t lends nothing (a replica is 4 cells).
# Since a migrate drain is tried where the cells that stay lack free slots for all its
# runs (session 39): nl2repo-2.4t 1.1998, deepswe-122b-curriculum 1.1730,
# terminalbench-122b-growing 1.1948 (same), deepswe-122b 1.1503 (one release at 8,280 s
# migrates for 270 s before it is cancelled, as the wait drain was, and the job ends
# 0.3% later; on workload seeds 0-4 of every preset, and 5-9 of deepswe-122b, the
# change is slower on 2 of 35 (by 0.3% and 0.1%): docs/scheduler.md).
# Since the outlook looks one step past those allowed where the steps ahead are alike
# (session 40): nl2repo-2.4t 1.1591, deepswe-122b 1.1353 (within the aim),
# terminalbench-122b-growing 1.1948 (same: its demand grows every step),
# deepswe-122b-curriculum 1.1818 (1.1730 before; over seeds 0-9 its mean is 1.203
# against 1.204, the other presets' all lower: docs/scheduler.md).
# Since a lent cell's credit waits to join between micro-batches (session 45):
# terminalbench-122b-growing 1.1934, deepswe-122b-curriculum 1.1826, nl2repo-2.4t 1.1591.
# Since the cells spare in a tail are lent together (session 46; on 32-64 cells elastic
# is 0.4-1.4% faster, the lending credited being the lending done): growing 1.1932,
# deepswe-122b-curriculum 1.1851 (over seeds 0-4 its mean 1.2003 against 1.1991).
# The bound's tail speed (session 53: a faster longest run costs its cell's work) took
# terminalbench-122b-growing's bound from 215,784 s to 218,927 s: 1.1932 -> 1.1761.
MISSED = {"nl2repo-2.4t": 1.165, "terminalbench-122b-growing": 1.18,
          "deepswe-122b-curriculum": 1.186}


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_elastic_against_the_lower_bound_on_every_preset(name):
    """Within 1.15x of the lower bound, the aim; the presets in MISSED are held to the
    figure they reached (the aim is not met there: docs/scheduler.md)."""
    cfg = load_config(preset_path(name))
    workload = sample_workload(cfg)
    elastic = simulate(cfg, named_policy(cfg, "elastic"), workload)
    bound = lower_bound(cfg, workload)["lower_bound_s"]
    assert elastic.makespan_s <= MISSED.get(name, 1.15) * bound, elastic.makespan_s / bound


# The drain case: 8 one-node cells of 2 slots, 8 runs a step of a heavy tail (sigma 1.5)
# that grow 10% a step, training a fifth of the work; one of the property test's draws.
# On nl2repo-122b at sigma 1.2 (the case until session 35) both drains got faster when
# the outlook took a step's tail from all its runs and migrating came within 0.2% of
# waiting there: no longer a case where the choice matters.
HEAVY_TAIL = [
    "cluster.num_nodes=8", "cluster.cell_nodes=1", "workload.num_steps=6",
    "workload.prompts_per_step=4", "workload.group_size=2", "workload.duration.mean_s=1800",
    "workload.duration.sigma=1.5", "workload.tokens_mean=20000", "rollout.runs_per_node=2",
    "training.node_tokens_per_s=33.3333", "training.max_staleness=1",
    "training.optimizer_step_s=18", "training.microbatch_tokens=20000",
    "handoff.engine_release_s=36", "handoff.group_rebuild_s=18",
    "handoff.train_state_load_s=54", "handoff.weight_load_s=36", "handoff.engine_start_s=54",
    "rollout.weight_sync_s=18", "rollout.reprefill_s=36", "rollout.call_interval_s=36",
    "scheduler.interval_s=36", "seed=377", "scheduler.confirm_s=90",
    "scheduler.min_dwell_s=360",
    "workload.phases=[{from_step: 0, duration_scale: 0.5, growth_per_step: 0.1, "
    "tokens_growth_per_step: 0.25}]"]


@pytest.mark.slow
def test_the_auto_drain_waits_where_the_tail_is_heavy():
    """The issue's case: on a heavy-tailed workload migrating moves a step's longest runs
    onto busier cells and the wait drain is faster; scheduler.drain: auto (per release,
    the drain the outlook expects to end sooner) finishes with the better of the two."""
    cfg = load_config(None, HEAVY_TAIL)
    workload = sample_workload(cfg)
    made = {drain: simulate(cfg, make_elastic(cfg, drain=drain), workload).makespan_s
            for drain in ("auto", "wait", "migrate")}
    assert made["migrate"] > 1.01 * made["wait"], made  # the tail makes the difference
    assert made["auto"] <= 1.005 * min(made["wait"], made["migrate"]), made
