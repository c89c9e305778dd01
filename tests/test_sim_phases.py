"""Workload phases: demand that changes with the step, in the config, the sampled
workload, the forecast's prior and the environments of real runs."""

import numpy as np
import pytest

from gyre_slurm.config.phases import StepShape, shape_at
from gyre_slurm.config.presets import preset_names, preset_path
from gyre_slurm.config.schema import load_config
from gyre_slurm.errors import ConfigError
from gyre_slurm.sched.policies import duration_model
from gyre_slurm.sim.workload import sample_workload

BASE = ["workload.num_steps=6", "workload.prompts_per_step=4", "workload.group_size=4",
        "workload.duration.mean_s=100", "workload.duration.sigma=0.5", "seed=3"]


def with_phases(text: str, *extra: str):
    return load_config(None, BASE + [f"workload.phases={text}", *extra])


def test_a_phase_scales_its_steps_runs_and_leaves_the_others_alone():
    plain = sample_workload(load_config(None, BASE))
    cfg = with_phases("[{from_step: 3, duration_scale: 2.5, tokens_scale: 4.0}]")
    phased = sample_workload(cfg)
    before, after = plain.batch < 3, plain.batch >= 3
    # The same runs (same draws), scaled from step 3 on.
    assert np.array_equal(phased.work_s[before], plain.work_s[before])
    assert np.allclose(phased.work_s[after], 2.5 * plain.work_s[after])
    # A run's tokens follow its duration relative to its own step's mean: x4 in all.
    assert np.allclose(phased.tokens[after], np.minimum(
        cfg.workload.tokens_max, 4.0 * plain.tokens[after]), rtol=1e-3, atol=1)


def test_growth_compounds_per_step_and_sigma_changes_the_spread():
    cfg = with_phases("[{from_step: 1, growth_per_step: 0.5, sigma: 0.0}]")
    w = sample_workload(cfg)
    means = [w.work_s[w.batch == k] for k in range(6)]
    for k in range(1, 6):  # sigma 0: every run of the step is its mean
        assert np.allclose(means[k], 100 * 1.5 ** (k - 1))
    assert means[0].std() > 0
    shape = shape_at(cfg.workload.phases, 4, base_turns=2)
    assert shape == StepShape(duration_scale=1.5 ** 3, sigma=0.0, tokens_scale=1.5 ** 3)


def test_turns_scale_the_simulated_runs_against_the_base_turns():
    cfg = with_phases("[{from_step: 2, turns: 4}]", "agent.max_turns=2")
    plain = sample_workload(load_config(None, BASE + ["agent.max_turns=2"]))
    w = sample_workload(cfg)
    assert np.allclose(w.work_s[w.batch >= 2], 2 * plain.work_s[plain.batch >= 2])


def test_the_forecast_prior_follows_the_phase_of_each_runs_step():
    cfg = with_phases("[{from_step: 2, duration_scale: 10.0}]")
    prior = duration_model(cfg)
    assert prior.at(0).mean_s() == pytest.approx(100, rel=0.02)
    assert prior.at(5).mean_s() == pytest.approx(1000, rel=0.02)
    ages = np.array([150.0, 150.0])
    # A run of step 4 that has run 150 s is young; one of step 0 is past its mean.
    young = prior.expected_remaining_runs(ages, 200.0, np.array([4, 4]))
    old = prior.expected_remaining_runs(ages, 200.0, np.array([0, 0]))
    assert young > 1.8 and old < 0.5


def test_env_params_of_a_step_scale_the_tool_time_where_the_env_takes_it():
    shape = StepShape(duration_scale=2.0, sigma=0.3, turns=2)
    params = {"tool_mean_s": 5.0, "tool_max_s": 20.0, "num_digits": 5}
    out = shape.env_params(params, ["num_digits", "turns", "tool_mean_s", "tool_sigma",
                                    "tool_max_s"])
    assert out == {"tool_mean_s": 10.0, "tool_max_s": 40.0, "num_digits": 5,
                   "tool_sigma": 0.3, "turns": 2}
    # An env without those parameters gets none of them.
    assert shape.env_params({"x": 1}, ["x"]) == {"x": 1}
    assert params["tool_mean_s"] == 5.0  # the config's own dict is untouched


@pytest.mark.parametrize("text, message", [
    ("[{from_step: 3}, {from_step: 2}]", r"workload\.phases\[1\]\.from_step = 2 does not follow"),
    ("[{from_step: 6}]", r"workload\.phases\[0\]\.from_step = 6 is past the last step"),
    ("[{from_step: 0, duration_scale: 0}]", "duration_scale must be > 0"),
    ("[{from_step: 0, growth_per_step: -1}]", "must be > -1"),
    ("[{from_step: 0, turns: 0}]", "turns must be >= 1"),
    ("[{from_step: 0, speed: 2}]", "Valid keys here"),
])
def test_bad_phases_are_refused_with_the_key_to_fix(text, message):
    with pytest.raises(ConfigError, match=message):
        with_phases(text)


def test_a_trace_workload_takes_no_phase_sigma():
    with pytest.raises(ConfigError, match="with duration.dist: trace"):
        load_config(None, BASE + ["workload.duration.dist=trace",
                                  "workload.duration.trace_file=t.txt",
                                  "workload.phases=[{from_step: 1, sigma: 0.2}]"])


@pytest.mark.parametrize("name", ["terminalbench-122b-growing", "deepswe-122b-curriculum"])
def test_changing_demand_presets_shift_the_balance(name):
    # Rollout work per trained token changes by half or more between the first and the
    # last steps: the split that suits one end does not suit the other.
    assert name in preset_names()
    cfg = load_config(preset_path(name))
    w = sample_workload(cfg)

    def ratio(sel):
        return w.work_s[sel].sum() / w.tokens[sel].sum()

    first, last = ratio(w.batch < 4), ratio(w.batch >= w.num_steps - 4)
    assert max(first, last) / min(first, last) > 1.5


def test_tokens_may_grow_at_their_own_rate():
    cfg = with_phases("[{from_step: 0, growth_per_step: 0.1, tokens_growth_per_step: 0.5}]")
    shape = shape_at(cfg.workload.phases, 3, base_turns=2)
    assert shape.duration_scale == pytest.approx(1.1 ** 3)
    assert shape.tokens_scale == pytest.approx(1.5 ** 3)
