"""The agent loop: one run of an environment task against an OpenAI-compatible endpoint.

Each model call is `POST {base_url}/chat/completions` with `Authorization: Bearer
{api_key}` and the JSON body {"model", "messages", "max_tokens", "temperature"}, as an
OpenAI client sends it; the action is `choices[0].message.content` (null -> ""), and
`usage.prompt_tokens` (+ `usage.completion_tokens`) measures the context.

Messages: [system (env.system_prompt), user (first observation), assistant (action),
user (next observation), ...]. Before each call after the first, the context is
estimated as the last call's prompt_tokens + completion_tokens + the new observation's
rough length (`rough_tokens`: ceil(characters / 4)); when that exceeds
`context_budget_tokens` the history is COMPACTED to [system, user(summary)], where the
summary names the task (the first observation, shortened), the turns done, and holds
the last observation (its tail, if it alone is too long). This starts a new branch in
the run's prefix tree, as real scaffolds do; `num_compactions` counts them.

Ending a run (never raises; the environment is not closed, the caller owns it):
- the env says done: status "ok", reward = the final step's reward;
- `max_turns` model calls made and the env not done: status "timeout", reward 0.0;
- an HTTP call fails (non-2xx, timeout after `call_timeout_s`, connection error, a
  body without choices[0].message), the env raises, or it pays a reward that is not a
  finite number (`envs.base.run_reward`): status "failed", reward 0.0, `error` says
  why (for non-2xx: "HTTP <status>: <body, first 200 chars>").

Run record (`RunResult.to_record()`, docs/runtime.md): {"run_id", "task_id", "reward",
"status": "ok"|"failed"|"timeout", "num_calls", "num_compactions", "error": null|str,
"t_start", "t_end"} (times: time.time() seconds).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from gyre_slurm.envs.base import Environment, TaskSpec, run_reward

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4
TASK_SUMMARY_CHARS = 200
DEFAULT_SYSTEM_PROMPT = "You are an agent."


@dataclass(frozen=True)
class RunResult:
    run_id: str
    task_id: str
    reward: float
    status: str  # "ok" | "failed" | "timeout"
    num_calls: int
    num_compactions: int
    error: str | None
    t_start: float
    t_end: float
    # The failure was the server's, not the run's: the gateway answered 502 (the engine
    # under the call failed) or 503 (no server available). Not part of the run record.
    interrupted: bool = False

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        del record["interrupted"]
        return record


SERVER_FAILED = (502, 503)  # the gateway's answers when the server under a call failed


class CallError(Exception):
    """A model call that failed; its message is the run's `error`, `http_status` the
    answer's status (None: no answer)."""

    def __init__(self, message: str, *, http_status: int | None = None):
        super().__init__(message)
        self.http_status = http_status


def rough_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def compacted(system: str, *, task_text: str, turns_done: int, observation: str,
              budget_tokens: int) -> list[dict]:
    """[system, user(summary)]: the task, the progress, and the last observation."""
    task = task_text if len(task_text) <= TASK_SUMMARY_CHARS else (
        task_text[:TASK_SUMMARY_CHARS] + "...")
    keep_chars = max(1, budget_tokens * CHARS_PER_TOKEN // 2)
    obs = observation if len(observation) <= keep_chars else observation[-keep_chars:]
    summary = (f"Summary of the work so far. Task: {task}\n"
               f"Turns done: {turns_done}.\nLast observation:\n{obs}")
    return [{"role": "system", "content": system}, {"role": "user", "content": summary}]


async def chat(session: aiohttp.ClientSession, *, url: str, api_key: str, body: dict,
               timeout_s: float) -> tuple[str, int]:
    """(content, prompt_tokens + completion_tokens) of one chat completion, or CallError."""
    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status // 100 != 2:
                raise CallError(f"HTTP {resp.status}: {text[:200]}", http_status=resp.status)
    except asyncio.TimeoutError as exc:
        raise CallError(f"model call timed out after {timeout_s:g}s") from exc
    except aiohttp.ClientError as exc:
        raise CallError(f"model call failed: {type(exc).__name__}: {exc}") from exc
    try:
        data = json.loads(text)
        content = data["choices"][0]["message"].get("content") or ""
        usage = data.get("usage") or {}
        used = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CallError(f"model call returned bad JSON: {exc}") from exc
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise CallError(f"model call returned no choices[0].message: {exc!r}") from exc
    return str(content), used


@dataclass
class _State:
    num_calls: int = 0
    num_compactions: int = 0
    context_tokens: int = 0


async def _episode(session, *, env: Environment, task: TaskSpec, url: str, api_key: str,
                   params: dict, state: _State) -> tuple[str, float]:
    """Drive the env to the end: ("ok"|"timeout", reward). Raises on failure."""
    system = getattr(env, "system_prompt", DEFAULT_SYSTEM_PROMPT)
    if params.get("run_seed") is None:
        first = await env.reset(task_id=task.task_id, seed=task.seed)
    else:
        first = await env.reset(task_id=task.task_id, seed=task.seed, run_seed=params["run_seed"])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    budget = params["context_budget_tokens"]
    while state.num_calls < params["max_turns"]:
        body = {"model": params["model"], "messages": messages,
                "max_tokens": params["max_tokens"], "temperature": params["temperature"]}
        action, state.context_tokens = await chat(
            session, url=url, api_key=api_key, body=body, timeout_s=params["call_timeout_s"])
        state.num_calls += 1
        res = await env.step(action)
        if res.done:
            return "ok", run_reward(res.reward, env_name=getattr(env, "name", "?"))
        messages = messages + [{"role": "assistant", "content": action},
                               {"role": "user", "content": res.observation}]
        if state.context_tokens + rough_tokens(res.observation) > budget:
            messages = compacted(system, task_text=first, turns_done=state.num_calls,
                                 observation=res.observation, budget_tokens=budget)
            state.num_compactions += 1
    return "timeout", 0.0


async def run_agent(*, base_url: str, api_key: str, env: Environment, task: TaskSpec,
                    run_id: str, max_turns: int, context_budget_tokens: int,
                    max_tokens: int = 16, temperature: float = 1.0,
                    session: aiohttp.ClientSession | None = None,
                    call_timeout_s: float = 120.0, model: str = "policy",
                    run_seed: int | None = None) -> RunResult:
    """Run `task` in `env` with the model behind `base_url`; see the module docstring."""
    t_start = time.time()
    params = {"max_turns": max_turns, "context_budget_tokens": context_budget_tokens,
              "max_tokens": max_tokens, "temperature": temperature,
              "call_timeout_s": call_timeout_s, "model": model, "run_seed": run_seed}
    url = base_url.rstrip("/") + "/chat/completions"
    state, error, status, reward = _State(), None, "failed", 0.0
    interrupted = False
    own = session is None
    if own:
        session = aiohttp.ClientSession()
    try:
        status, reward = await _episode(session, env=env, task=task, url=url,
                                        api_key=api_key, params=params, state=state)
    except CallError as exc:
        error, interrupted = str(exc), exc.http_status in SERVER_FAILED
    except Exception as exc:  # an env failure ends the run, never the caller
        log.warning("run %s: environment error", run_id, exc_info=True)
        error = f"environment error: {type(exc).__name__}: {exc}"
    finally:
        if own:
            await session.close()
    if error is not None:
        log.info("run %s failed: %s", run_id, error)
    return RunResult(run_id=run_id, task_id=task.task_id, reward=reward, status=status,
                     num_calls=state.num_calls, num_compactions=state.num_compactions,
                     error=error, t_start=t_start, t_end=time.time(), interrupted=interrupted)
