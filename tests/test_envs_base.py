"""The environment interface: registry, task sampling, conformance of both envs."""

import asyncio

import pytest

from gyre_slurm.envs import Environment, StepResult, TaskSpec, env_names, make_env, tasks_for_step
from gyre_slurm.errors import UserError

FAST_LONG = {"median_turns": 4, "tool_mean_s": 0.001, "tool_max_s": 0.01,
             "result_tokens": 10}


def test_registry_knows_both_and_rejects_unknown():
    assert {"learnable", "longhorizon", "shell"} <= set(env_names())
    with pytest.raises(UserError, match="unknown environment"):
        make_env("nope")


def test_tasks_for_step_is_deterministic_and_varies():
    a = tasks_for_step("learnable", step=3, num_prompts=8, seed=1)
    assert a == tasks_for_step("learnable", step=3, num_prompts=8, seed=1)
    assert len(a) == 8 and all(isinstance(t, TaskSpec) for t in a)
    assert all(t.task_id == f"learnable/{t.seed}" for t in a)
    assert len({t.seed for t in a}) == 8
    assert a != tasks_for_step("learnable", step=4, num_prompts=8, seed=1)
    assert a != tasks_for_step("learnable", step=3, num_prompts=8, seed=2)
    assert a[:3] == tasks_for_step("learnable", step=3, num_prompts=3, seed=1)
    assert tasks_for_step("learnable", step=0, num_prompts=0, seed=0) == []


def test_tasks_for_step_pool():
    seeds = {t.seed for s in range(20)
             for t in tasks_for_step("x", step=s, num_prompts=4, seed=0, pool_size=5)}
    assert seeds <= set(range(5)) and len(seeds) > 1
    with pytest.raises(UserError):
        tasks_for_step("x", step=0, num_prompts=1, seed=0, pool_size=0)


@pytest.mark.parametrize("name, params", [("learnable", {}), ("learnable", {"turns": 2}),
                                          ("longhorizon", FAST_LONG),
                                          ("shell", {"max_steps": 2, "time_s": 5})])
def test_conformance(name, params, tmp_path):
    if "max_steps" in params:
        params = dict(params, base_dir=str(tmp_path))
    async def go():
        env = make_env(name, **params)
        assert isinstance(env, Environment) and env.name == name
        task = tasks_for_step(name, step=0, num_prompts=1, seed=0, env_params=params)[0]
        first = await env.reset(task_id=task.task_id, seed=task.seed)
        assert isinstance(first, str) and first and isinstance(env.system_prompt, str)
        steps = []
        while not steps or not steps[-1].done:
            assert len(steps) < 1000
            steps.append(await env.step("1 red"))
        assert all(isinstance(s, StepResult) and isinstance(s.info, dict) for s in steps)
        assert all(s.reward == 0.0 for s in steps[:-1])
        assert 0.0 <= steps[-1].reward <= 1.0
        with pytest.raises(RuntimeError):
            await env.step("again")
        again = await env.reset(task_id=task.task_id, seed=task.seed)  # reusable after reset
        assert again == first
        await env.close()
    asyncio.run(asyncio.wait_for(go(), 20))
