"""The `learnable` environment: rewards for known actions, task determinism, turns."""

import asyncio
import math

import pytest

from gyre_slurm.envs import make_env
from gyre_slurm.envs.learnable import instruction, score, task_digits
from gyre_slurm.errors import UserError


@pytest.mark.parametrize("allowed, action, expected", [
    ("357", "357 53", 1.0),
    ("357", "3a", 0.5),
    ("357", "42", 0.0),
    ("357", "", 0.0),
    ("357", "   \n", 0.0),
    ("357", "3 4 5 6", 0.5),
    ("0123456789", "12ab", 0.5),
    ("5", "5555", 1.0),
    ("135", "\ufffd1", 0.5),  # a replacement character counts as a wrong character
])
def test_score_table(allowed, action, expected):
    assert score(action, allowed) == pytest.approx(expected)


def run_episode(actions, *, seed=7, **params):
    async def go():
        env = make_env("learnable", **params)
        first = await env.reset(task_id=f"learnable/{seed}", seed=seed)
        results = [await env.step(a) for a in actions]
        await env.close()
        return env, first, results
    return asyncio.run(asyncio.wait_for(go(), 10))


def test_one_turn_reward_through_the_env():
    digits = task_digits(7, 5)
    other = next(d for d in "0123456789" if d not in digits)
    env, first, (res,) = run_episode([digits[0] * 3 + other])
    assert first == instruction(digits) == "Use only the digits " + " ".join(digits) + "."
    assert res.done and res.reward == pytest.approx(0.75) and res.observation == ""
    assert env.system_prompt


def test_two_turns_pay_the_mean_on_the_last_step():
    digits = task_digits(7, 3)
    env, _, (r1, r2) = run_episode([digits, "x"], num_digits=3, turns=2)
    assert not r1.done and r1.reward == 0.0 and "Score: 1.00" in r1.observation
    assert digits[0] in r1.observation
    assert r2.done and r2.reward == pytest.approx(0.5)


def test_step_after_done_raises():
    with pytest.raises(RuntimeError):
        run_episode(["1", "2"])


@pytest.mark.parametrize("num_digits", [1, 3, 5, 10])
def test_task_digits_deterministic_distinct_sorted(num_digits):
    for seed in range(50):
        d = task_digits(seed, num_digits)
        assert d == task_digits(seed, num_digits)
        assert len(set(d)) == len(d) == num_digits and list(d) == sorted(d)
    assert len({task_digits(s, num_digits) for s in range(50)}) > (1 if num_digits < 10 else 0)


@pytest.mark.parametrize("params", [{"num_digits": 0}, {"num_digits": 11}, {"turns": 3},
                                    {"bogus": 1}, {"tool_mean_s": float("nan")},
                                    {"tool_sigma": float("inf")}, {"tool_max_s": 0.0}])
def test_bad_params_are_user_errors(params):
    with pytest.raises(UserError):
        make_env("learnable", **params)


def test_tool_times_replay_for_a_run_seed():
    """The same run seed draws the same tool times (a run waits the same in every
    layout); run_seed_of ignores the attempt suffix and differs between runs."""
    from gyre_slurm.envs.base import run_seed_of

    def draws(run_seed):
        env = make_env("learnable", tool_mean_s=1e-4, tool_sigma=1.0, tool_max_s=1.0)
        asyncio.run(env.reset(task_id="learnable/1", seed=1, run_seed=run_seed))
        mu = math.log(env.tool_mean_s) - env.tool_sigma ** 2 / 2
        return [env._rng.lognormvariate(mu, env.tool_sigma) for _ in range(3)]

    a = run_seed_of(0, "s0003-p001-g02")
    assert a == run_seed_of(0, "s0003-p001-g02-a1")
    assert len({a, run_seed_of(0, "s0003-p001-g03"), run_seed_of(1, "s0003-p001-g02")}) == 3
    assert draws(a) == draws(a)
    assert draws(a) != draws(run_seed_of(0, "s0003-p001-g03"))
    assert draws(None) != draws(None)
