"""The `longhorizon` environment: turn/time/length distributions, determinism, reward."""

import asyncio
import statistics
import time

import pytest

from gyre_slurm.envs import make_env
from gyre_slurm.errors import UserError


def test_turn_counts_lognormal_median_and_cap():
    env = make_env("longhorizon", median_turns=20, turns_sigma=0.8, max_turns=60)
    counts = [env.draw_num_turns(s) for s in range(3000)]
    assert 18 <= statistics.median(counts) <= 22
    assert min(counts) >= 1 and max(counts) == 60  # the cap binds in the tail
    assert sum(c > 40 for c in counts) / len(counts) > 0.1  # heavy tail (lognormal ~19%)
    assert counts == [env.draw_num_turns(s) for s in range(3000)]


def test_tool_times_mean_tail_and_cap():
    env = make_env("longhorizon", tool_mean_s=0.5, tool_sigma=1.0, tool_max_s=1e9)
    times = [env.draw_tool_s(s, t) for s in range(200) for t in range(50)]
    assert statistics.fmean(times) == pytest.approx(0.5, rel=0.1)
    assert statistics.median(times) == pytest.approx(0.5 * 2.718 ** -0.5, rel=0.1)
    capped = make_env("longhorizon", tool_mean_s=0.5, tool_sigma=1.0, tool_max_s=1.0)
    ctimes = [capped.draw_tool_s(s, t) for s in range(200) for t in range(50)]
    assert max(ctimes) == 1.0 and sum(t == 1.0 for t in ctimes) > 100


def test_result_length_and_key_line():
    env = make_env("longhorizon", result_tokens=50, result_sigma=0.5)
    env.num_turns = 9
    texts = [env.result_text(s, 1) for s in range(400)]
    words = [len(t.split("\n", 1)[1].split()) for t in texts]
    assert statistics.fmean(words) == pytest.approx(50, rel=0.1)
    assert all(t.startswith(f"turn 2/9 key: {env.key(s, 1)}\n") for s, t in enumerate(texts))


def play(params, *, seed, answer):
    """Run an episode; `answer(observation)` gives the action. (steps, wall seconds)."""
    async def go():
        env = make_env("longhorizon", **params)
        obs = await env.reset(task_id=f"longhorizon/{seed}", seed=seed)
        t0 = time.monotonic()
        steps = []
        while not steps or not steps[-1].done:
            steps.append(await env.step(answer(obs)))
            obs = steps[-1].observation
        return obs, steps, time.monotonic() - t0
    return asyncio.run(asyncio.wait_for(go(), 20))[1:]


def key_of(obs: str) -> str:
    return obs.split("key: ", 1)[1].split()[0].rstrip(".")


FAST = {"median_turns": 8, "turns_sigma": 0.5, "tool_mean_s": 0.004, "tool_sigma": 1.0,
        "tool_max_s": 0.02, "result_tokens": 20}


def test_episode_sleeps_the_tool_times_and_pays_at_the_end():
    steps, wall_s = play(FAST, seed=5, answer=lambda obs: f"ok {key_of(obs)}")
    n = steps[0].info["num_turns"]
    assert len(steps) == n and [s.info["turn"] for s in steps] == list(range(1, n + 1))
    assert all(s.info["hit"] for s in steps) and steps[-1].reward == 1.0
    assert all(s.reward == 0.0 and not s.done for s in steps[:-1])
    slept = sum(s.info["tool_s"] for s in steps)
    assert slept <= wall_s < slept + 2.0
    assert all(0 <= s.info["tool_s"] <= 0.02 for s in steps)


@pytest.mark.parametrize("answer, expected", [
    (lambda obs: "nothing", 0.0),
    (lambda obs: key_of(obs).upper(), 1.0),     # case-insensitive
    (lambda obs: key_of(obs) + "x", 0.0),       # whole words only
])
def test_reward_table(answer, expected):
    steps, _ = play(FAST, seed=11, answer=answer)
    assert steps[-1].reward == expected


def test_half_hits_give_the_fraction():
    params = dict(FAST, median_turns=6, turns_sigma=0.0)
    calls = iter(range(100))
    steps, _ = play(params, seed=3, answer=lambda obs: key_of(obs) if next(calls) % 2 else "")
    assert len(steps) == 6 and steps[-1].reward == pytest.approx(0.5)


def test_deterministic_for_a_seed():
    a, _ = play(FAST, seed=9, answer=lambda obs: "red")
    b, _ = play(FAST, seed=9, answer=lambda obs: "red")
    c, _ = play(FAST, seed=10, answer=lambda obs: "red")
    assert [(s.observation, s.reward, s.info) for s in a] == \
        [(s.observation, s.reward, s.info) for s in b]
    assert [s.observation for s in a] != [s.observation for s in c]


@pytest.mark.parametrize("params", [{"median_turns": 0}, {"max_turns": 0},
                                    {"tool_sigma": -1}, {"result_tokens": 0},
                                    {"tool_mean_s": -1}])
def test_bad_params_are_user_errors(params):
    with pytest.raises(UserError):
        make_env("longhorizon", **params)
