"""A run of an environment that drives its own rollout (`env.drive`, e.g. a verifiers
environment): gyre's agent loop stays out; the environment's own loop calls the model
through the run's gateway URL with the run's own key, and its reward is the run's.

    record = await run_driven(env=env, task=task, run_id=..., gateway=gateway,
                              gateway_url=..., max_tokens=..., temperature=...,
                              run_seed=..., log_path=RUN_DIR/logs/env-<run_id>.log)

The record has the agent loop's fields (run_id, task_id, reward, status, num_calls,
error, t_start, t_end) and the environment's `info` under "env_info". Whatever the
environment raises, and a reward that is not a finite number, fails the run (status
"failed", `error` says why), never the job.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gyre_slurm.envs.base import run_reward


def drives_itself(env) -> bool:
    return callable(getattr(env, "drive", None))


async def run_driven(*, env, task, run_id: str, gateway, gateway_url: str,
                     max_tokens: int | None, temperature: float | None,
                     run_seed: int | None, log_path: Path,
                     max_calls: int | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"run_id": run_id, "task_id": task.task_id, "reward": 0.0,
                              "status": "failed", "num_calls": 0, "num_compactions": 0,
                              "error": None, "t_start": time.time()}
    kw = {} if run_seed is None else {"run_seed": run_seed}
    try:
        await env.reset(task_id=task.task_id, seed=task.seed, **kw)
        key = gateway.open_run(run_id, max_calls=max_calls)  # revoked by end_run at its end
        result = await env.drive(base_url=f"{gateway_url}/runs/{run_id}/v1", api_key=key,
                                 model=gateway.model_name, log_path=log_path,
                                 max_tokens=max_tokens, temperature=temperature)
        record.update(status="ok", env_info=result.info,
                      reward=run_reward(result.reward, env_name=getattr(env, "name", "?")))
    except Exception as exc:  # noqa: BLE001 - whatever the env raises fails the run, not the job
        record["error"] = f"{type(exc).__name__}: {exc}"[:4000]
    record.update(num_calls=gateway.calls_of(run_id), t_end=time.time())
    return record
