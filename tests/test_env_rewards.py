"""What an environment pays must be a finite number, and whatever it does, its run ends.

A run's reward is its group's baseline: one NaN (a rubric that divided by zero), an
infinity or an integer past a float's range makes every advantage of its group NaN, and
the step's loss with it. `envs.base.run_reward` refuses such a reward, and the three
ways a run is driven (the built-in loop, an environment that drives itself, a scaffold)
fail the run with it said. An environment that raises, from `drive` or from `close`,
fails its run: the rollout manager's run task ends either way, or the run's group would
never close and the job would wait on it forever."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_slurm.agents import run_agent
from gyre_slurm.config.schema import load_config
from gyre_slurm.envs import StepResult, TaskSpec, register_env
from gyre_slurm.envs.base import run_reward
from gyre_slurm.gateway import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.runtime.book import StepBook
from gyre_slurm.runtime.rollouts import RolloutManager
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.traj.store import CallStoreWriter
from test_agent_loop import ScriptedServer

ROOT = Path(__file__).resolve().parent.parent
def short_id(value) -> str:
    """A test id for a value: its repr, or for a long one (a 400-digit integer) `int-401-chars`."""
    text = repr(value)
    return text if len(text) <= 24 else f"{type(value).__name__}-{len(text)}-chars"


BAD = [float("nan"), float("inf"), -float("inf"), 10 ** 400, "1.0", b"1", None, [1.0],
       np.array([1.0, 2.0]), torch.tensor([1.0, 2.0]), {"reward": 1}]


@pytest.mark.parametrize("value, want", [
    (1, 1.0), (0.25, 0.25), (-3, -3.0), (True, 1.0), (np.float32(0.5), 0.5),
    (np.int64(2), 2.0), (np.float64(0.75), 0.75), (torch.tensor(0.5), 0.5),
    (np.array(1.5), 1.5), (10 ** 300, 1e300)], ids=short_id)
def test_a_finite_reward_of_any_real_type_passes_as_a_float(value, want):
    got = run_reward(value, env_name="e")
    assert type(got) is float and got == want


@pytest.mark.parametrize("value", BAD, ids=short_id)
def test_a_reward_that_is_not_a_finite_number_is_refused_saying_what(value):
    with pytest.raises(ValueError) as info:
        run_reward(value, env_name="my-env")
    msg = str(info.value)
    assert "'my-env'" in msg and "must be a finite number" in msg
    assert type(value).__name__ in msg


class Pays:
    """Done on its first step, paying `reward`."""

    name, system_prompt = "pays", "sys"

    def __init__(self, reward):
        self.reward = reward

    async def reset(self, *, task_id, seed, run_seed=None):
        return "go"

    async def step(self, action):
        return StepResult("", self.reward, True, {})

    async def close(self):
        pass


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), 10 ** 400, "0.5", None],
                         ids=short_id)
def test_the_agent_loop_fails_a_run_whose_env_pays_no_finite_number(reward):
    async def go():
        async with ScriptedServer(["a"]) as server:
            return await run_agent(base_url=server.base_url, api_key="k", env=Pays(reward),
                                   task=TaskSpec("pays/1", 1), run_id="r1", max_turns=3,
                                   context_budget_tokens=100)
    result = asyncio.run(asyncio.wait_for(go(), 10))
    assert result.status == "failed" and result.reward == 0.0 and result.num_calls == 1
    assert result.error.startswith("environment error: ValueError: environment 'pays' paid")
    assert "must be a finite number" in result.error
    json.dumps(result.to_record(), allow_nan=False)  # the run record stays valid JSON


def test_the_agent_loop_takes_a_numpy_reward_as_a_float():
    async def go():
        async with ScriptedServer(["a"]) as server:
            return await run_agent(base_url=server.base_url, api_key="k",
                                   env=Pays(np.float32(0.5)), task=TaskSpec("pays/1", 1),
                                   run_id="r1", max_turns=3, context_budget_tokens=100)
    result = asyncio.run(asyncio.wait_for(go(), 10))
    assert result.status == "ok" and type(result.reward) is float and result.reward == 0.5


# -- through the rollout manager: an environment that drives itself ---------------------
class Drives:
    """An environment with its own rollout loop (like a verifiers one): `drive` does
    what `how` says, `close` raises where `close_raises`."""

    system_prompt = "sys"

    def __init__(self, *, how: str = "nan", close_raises: bool = False):
        self.name, self.how, self.close_raises = f"drives-{how}", how, close_raises

    async def reset(self, *, task_id, seed, run_seed=None):
        return "go"

    async def step(self, action):
        raise RuntimeError("driven whole")

    async def drive(self, *, base_url, api_key, model, log_path, max_tokens=None,
                    temperature=None):
        if self.how == "raises":
            raise KeyError("reward")  # e.g. a result without the field it expected
        reward = {"nan": float("nan"), "huge": 10 ** 400, "ok": 1.0}[self.how]
        return StepResult("", reward, True, {"tests": "1/1"})

    async def close(self):
        if self.close_raises:
            raise OSError("the sandbox is gone")


register_env("test-drives", Drives)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("model"))


def manager_run(tmp_path, model_dir, **params) -> tuple[dict, dict]:
    """One run of a one-run job with `test-drives` (params), through the rollout
    manager and a real gateway: (the book's entry, its run_end event)."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      ["agent.env=test-drives", f"agent.env_params={json.dumps(params)}"])
    rd = RunDir(tmp_path / "run")
    rd.create(cfg)
    book = StepBook(num_steps=1, prompts_per_step=1, group_size=1, staleness=0)

    async def main():
        writer = CallStoreWriter(rd.path, "gateway")
        gw = Gateway(model_dir=model_dir, call_writer=writer, wait_for_server_s=1)
        manager = RolloutManager(cfg=cfg, rd=rd, book=book, gateway=gw,
                                 gateway_url="http://127.0.0.1:9", flush_calls=writer.flush)
        try:
            assert manager.fill(4) == 1
            await asyncio.wait_for(asyncio.gather(*manager.tasks.values(),
                                                  *manager.ending), 30)
            assert not manager.tasks  # the run ended: its task is gone
        finally:
            await manager.cancel_all()
            writer.close()
    asyncio.run(main())
    (entry,) = book.runs.values()
    events = [json.loads(line) for line in rd.events_file.read_text().splitlines()]
    (end,) = [e for e in events if e["kind"] == "run_end"]
    return entry, end


@pytest.mark.parametrize("how, close_raises, error", [
    ("nan", False, "ValueError: environment 'drives-nan' paid the reward nan (float)"),
    ("huge", False, "ValueError: environment 'drives-huge' paid the reward 1000"),
    ("raises", False, "KeyError: 'reward'"),
    ("raises", True, "KeyError: 'reward'"),
])
def test_a_run_whose_env_fails_ends_failed_and_its_group_closes(tmp_path, model_dir, how,
                                                                close_raises, error):
    entry, end = manager_run(tmp_path, model_dir, how=how, close_raises=close_raises)
    assert entry.state == "failed" and entry.reward == 0.0
    assert end["status"] == "failed" and end["error"].startswith(error), end
    assert math.isfinite(end["reward"])


def test_an_env_whose_close_raises_keeps_its_runs_result(tmp_path, model_dir):
    """The run's own record stands (ok, reward 1.0); it is then refused for training
    only because this env called no model (no trajectory to train), not for the close."""
    _, end = manager_run(tmp_path, model_dir, how="ok", close_raises=True)
    (record,) = [json.loads(line) for line in
                 (tmp_path / "run" / "runs" / "runs.jsonl").read_text().splitlines()]
    assert record["status"] == "ok" and record["reward"] == 1.0 and record["error"] is None
    assert end["reward"] == 1.0 and end["error"] is None
    events = [json.loads(line) for line in
              (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (rejected,) = [e for e in events if e["kind"] == "run_rejected"]
    assert rejected["reason"].endswith("no recorded calls"), rejected
