"""The agent loop against a real HTTP server on 127.0.0.1.

`ScriptedServer` is the other side of the protocol (a minimal OpenAI chat-completions
endpoint answering from a fixed script), not the thing under test: the gateway is
written elsewhere. It records each request (headers, JSON body) and answers with the
scripted step: a content string, ("status", code, body), ("sleep", seconds, content),
("raw", text), or a callable(body) -> content. `usage.prompt_tokens` is the characters
of the request's message contents / 4 (rounded up), completion_tokens that of the reply.
"""

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web

from gyre_slurm.agents import RunResult, run_agent
from gyre_slurm.envs import TaskSpec, make_env
from gyre_slurm.envs.learnable import task_digits
from gyre_slurm.traj.records import parse_run

LONG = {"median_turns": 6, "turns_sigma": 0.0, "tool_mean_s": 0.002, "tool_sigma": 0.5,
        "tool_max_s": 0.01, "result_tokens": 30, "result_sigma": 0.0}


def _tokens(text: str) -> int:
    return math.ceil(len(text) / 4)


class ScriptedServer:
    def __init__(self, script):
        self.script = list(script)
        self.requests: list[dict] = []
        self.usages: list[int] = []
        self.runner = None
        self.base_url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body,
                              "path": request.path})
        step = self.script.pop(0) if self.script else "done"
        if callable(step):
            step = step(body)
        if isinstance(step, tuple) and step[0] == "status":
            return web.Response(status=step[1], text=step[2])
        if isinstance(step, tuple) and step[0] == "raw":
            return web.Response(text=step[1], content_type="application/json")
        if isinstance(step, tuple) and step[0] == "sleep":
            await asyncio.sleep(step[1])
            step = step[2]
        prompt = sum(_tokens(m["content"]) for m in body["messages"])
        self.usages.append(prompt + _tokens(step))
        return web.json_response({
            "id": f"c{len(self.requests)}", "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": step}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": _tokens(step),
                      "total_tokens": prompt + _tokens(step)}})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/runs/{run_id}/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/runs/r1/v1"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def run(script, *, env_name="learnable", env_params=None, seed=7, timeout_s=20,
        **kwargs) -> tuple[RunResult, ScriptedServer]:
    async def go():
        async with ScriptedServer(script) as server:
            env = make_env(env_name, **(env_params or {}))
            args = {"max_turns": 50, "context_budget_tokens": 10_000, **kwargs}
            result = await run_agent(base_url=server.base_url, api_key="sk-test", env=env,
                                     task=TaskSpec(f"{env_name}/{seed}", seed),
                                     run_id="r1", **args)
            await env.close()
            return result, server
    return asyncio.run(asyncio.wait_for(go(), timeout_s))


def roles(request) -> list[str]:
    return [m["role"] for m in request["body"]["messages"]]


def key_of(body) -> str:
    """The key of the last observation (a compacted summary names the task's first key
    before it)."""
    return body["messages"][-1]["content"].rsplit("key: ", 1)[1].split()[0].rstrip(".")


def test_two_turn_messages_auth_body_and_reward():
    digits = task_digits(7, 3)
    result, server = run([digits, "x" + digits[0]], env_params={"num_digits": 3, "turns": 2},
                         max_tokens=12, temperature=0.7, model="m0")
    assert result.status == "ok" and result.error is None
    assert result.reward == pytest.approx((1.0 + 0.5) / 2)
    assert result.num_calls == 2 and result.num_compactions == 0
    first, second = server.requests
    assert first["headers"]["Authorization"] == "Bearer sk-test"
    assert first["path"] == "/runs/r1/v1/chat/completions"
    assert {k: first["body"][k] for k in ("model", "max_tokens", "temperature")} == \
        {"model": "m0", "max_tokens": 12, "temperature": 0.7}
    assert roles(first) == ["system", "user"]
    assert roles(second) == ["system", "user", "assistant", "user"]
    msgs = second["body"]["messages"]
    assert msgs[:2] == first["body"]["messages"]
    assert msgs[1]["content"] == "Use only the digits " + " ".join(digits) + "."
    assert msgs[2]["content"] == digits and msgs[3]["content"].startswith("Score: 1.00")


def test_record_shape_and_traj_accepts_it():
    result, _ = run([task_digits(7, 5)])
    rec = result.to_record()
    assert set(rec) == {"run_id", "task_id", "reward", "status", "num_calls",
                        "num_compactions", "error", "t_start", "t_end"}
    assert rec["run_id"] == "r1" and rec["task_id"] == "learnable/7" and rec["reward"] == 1.0
    assert rec["t_start"] <= rec["t_end"]
    parsed = parse_run(rec)
    assert parsed.status == "ok" and parsed.reward == 1.0


def test_compaction_when_budget_exceeded_and_next_request_starts_from_it():
    budget = 120
    result, server = run([lambda body: key_of(body)] * 10, env_name="longhorizon",
                         env_params=LONG, context_budget_tokens=budget)
    assert result.status == "ok" and result.reward == 1.0 and result.num_calls == 6
    reqs = server.requests
    compacted_at = [i for i in range(1, len(reqs)) if len(reqs[i]["body"]["messages"]) == 2]
    assert result.num_compactions == len(compacted_at) >= 2
    for i in range(1, len(reqs)):
        prev_msgs = reqs[i - 1]["body"]["messages"]
        obs = reqs[i]["body"]["messages"][-1]["content"]
        if i in compacted_at:
            # the rule: last usage + the new observation's rough size over the budget
            assert server.usages[i - 1] + _tokens(obs.split("Last observation:\n", 1)[1]) \
                > budget
            assert roles(reqs[i]) == ["system", "user"]
            assert obs.startswith("Summary of the work so far. Task: Task longhorizon/7")
            assert f"Turns done: {i}." in obs
        else:
            assert reqs[i]["body"]["messages"][:-2] == prev_msgs
            assert roles(reqs[i])[-2:] == ["assistant", "user"]
    # after a compaction the history grows again from the compacted prefix
    j = compacted_at[0]
    if j + 1 < len(reqs) and j + 1 not in compacted_at:
        assert reqs[j + 1]["body"]["messages"][:2] == reqs[j]["body"]["messages"]


def test_no_compaction_with_a_large_budget():
    result, server = run([lambda body: key_of(body)] * 10, env_name="longhorizon",
                         env_params=LONG, context_budget_tokens=100_000)
    assert result.num_compactions == 0 and result.reward == 1.0
    assert len(server.requests[-1]["body"]["messages"]) == 2 + 2 * 5


def test_http_500_ends_the_run_failed_with_the_reason():
    result, server = run([lambda body: key_of(body), ("status", 500, "engine exploded")],
                         env_name="longhorizon", env_params=LONG)
    assert result.status == "failed" and result.reward == 0.0
    assert result.error == "HTTP 500: engine exploded"
    assert result.num_calls == 1 and len(server.requests) == 2
    assert parse_run(result.to_record()).reason == "HTTP 500: engine exploded"


def test_call_timeout_ends_the_run_failed():
    result, _ = run([("sleep", 1.0, "1")], call_timeout_s=0.2, timeout_s=10)
    assert result.status == "failed" and "timed out after 0.2s" in result.error
    assert result.num_calls == 0 and result.t_end - result.t_start < 0.9


@pytest.mark.parametrize("raw, what", [("not json", "bad JSON"),
                                       ('{"choices": []}', "no choices[0].message")])
def test_malformed_answer_ends_the_run_failed(raw, what):
    result, _ = run([("raw", raw)])
    assert result.status == "failed" and what in result.error


def test_connection_error_ends_the_run_failed():
    async def go():
        sock_server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = sock_server.sockets[0].getsockname()[1]
        sock_server.close()
        await sock_server.wait_closed()  # nothing listens on the port now
        return await run_agent(base_url=f"http://127.0.0.1:{port}/runs/r9/v1", api_key="k",
                               env=make_env("learnable"), task=TaskSpec("learnable/1", 1),
                               run_id="r9", max_turns=3, context_budget_tokens=100,
                               call_timeout_s=5)
    result = asyncio.run(asyncio.wait_for(go(), 10))
    assert result.status == "failed" and result.error.startswith("model call failed:")


def test_max_turns_ends_with_timeout_status_and_zero_reward():
    result, server = run([lambda body: key_of(body)] * 10, env_name="longhorizon",
                         env_params=LONG, max_turns=3)
    assert result.status == "timeout" and result.reward == 0.0 and result.error is None
    assert result.num_calls == 3 == len(server.requests)


def test_env_finishing_on_the_last_allowed_turn_is_ok():
    result, _ = run([lambda body: key_of(body)] * 10, env_name="longhorizon",
                    env_params=LONG, max_turns=6)
    assert result.status == "ok" and result.reward == 1.0


def test_shared_session_is_used_and_left_open():
    async def go():
        async with ScriptedServer([task_digits(3, 5)] * 4) as server, \
                aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(
                run_agent(base_url=server.base_url, api_key="k", env=make_env("learnable"),
                          task=TaskSpec("learnable/3", 3), run_id=f"r{i}", max_turns=2,
                          context_budget_tokens=100, session=session) for i in range(4)))
            assert not session.closed
            return results, server
    results, server = asyncio.run(asyncio.wait_for(go(), 10))
    assert [r.reward for r in results] == [1.0] * 4 and len(server.requests) == 4
    assert [r.run_id for r in results] == ["r0", "r1", "r2", "r3"]


def test_env_error_ends_the_run_failed():
    class Broken:
        name, system_prompt = "broken", "sys"

        async def reset(self, *, task_id, seed):
            return "go"

        async def step(self, action):
            raise OSError("disk full")

        async def close(self):
            pass

    async def go():
        async with ScriptedServer(["a"]) as server:
            return await run_agent(base_url=server.base_url, api_key="k", env=Broken(),
                                   task=TaskSpec("b/1", 1), run_id="r1", max_turns=3,
                                   context_budget_tokens=100)
    result = asyncio.run(asyncio.wait_for(go(), 10))
    assert result.status == "failed" and result.error == "environment error: OSError: disk full"
    assert result.num_calls == 1

