"""`verifiers`: an environment of the verifiers library (the prime-rl ecosystem's) as a
gyre environment, its rubric's reward as the run's.

    agent:
      env: verifiers
      env_params:
        environment: my-env        # verifiers.load_environment's id: an installed
                                   # environment package or a module with load_environment
        env_args: '{"turns": 3}'   # its keyword arguments, a JSON object
        python: env:verifiers      # the interpreter that has verifiers (tools/role-env)
        path: /path/to/envs        # optional: a folder on that interpreter's PYTHONPATH
                                   # (relative: to the directory gyre runs in)

A verifiers environment runs its own rollout loop (its `env_response`, tools, stop
conditions), so gyre's agent loop does not drive it: the runtime calls `drive(...)`
instead, which runs `verifiers_run.py` in the verifiers interpreter (one process per
run: verifiers pins its own openai, pydantic and datasets, apart from gyre's) with the
run's gateway URL and key. Every model call of the rollout goes through the gateway, is
recorded as the run's calls and trained like the built-in loop's; the rubric scores the
rollout when it has ended and that score is the run's reward. Task ids are
"verifiers/<task seed>": example (seed modulo the dataset's size) of the environment's
dataset; `tasks_for_step` draws the seeds as for any environment.

`reset` and `step` exist for the environment protocol; `step` refuses (a verifiers
environment is driven whole). The environment's own code runs as the job's user, like
any environment's (it is trusted code); only what the model writes is the agent's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

from gyre_slurm.envs.base import StepResult, register_env
from gyre_slurm.errors import UserError

RUNNER = Path(__file__).resolve().parent / "verifiers_run.py"
LOG_TAIL = 2000


class VerifiersEnv:
    name = "verifiers"
    system_prompt = ""  # the verifiers environment's own dataset prompts carry it

    def __init__(self, *, environment: str, env_args: str = "{}",
                 python: str = "env:verifiers", path: str | None = None):
        if not environment or not environment.strip():
            raise UserError("agent.env_params.environment is empty: name a verifiers "
                            "environment (its load_environment id)")
        try:
            args = json.loads(env_args)
        except (ValueError, RecursionError) as exc:
            raise UserError(f"agent.env_params.env_args is not JSON ({exc}): give a JSON "
                            "object, e.g. '{\"turns\": 3}'") from None
        if not isinstance(args, dict):
            raise UserError("agent.env_params.env_args must be a JSON object of "
                            f"load_environment's arguments, got {env_args!r}")
        if path is not None and not Path(path).is_dir():
            raise UserError(f"agent.env_params.path = {path!r} is not a directory")
        self.environment, self.env_args = environment, env_args
        self.python = python
        self.path = None if path is None else str(Path(path).resolve())
        self.task_id: str | None = None
        self.example = 0

    async def reset(self, *, task_id: str, seed: int, run_seed: int | None = None) -> str:
        self.task_id, self.example = task_id, int(seed)
        return ""

    async def step(self, action: str) -> StepResult:
        raise RuntimeError("a verifiers environment runs its own rollout: drive it with "
                           "drive(), not step()")

    async def close(self) -> None:
        pass

    def argv(self, *, base_url: str, model: str, max_tokens: int | None,
             temperature: float | None, results_fd: int) -> list[str]:
        if self.python.startswith("env:"):
            raise UserError(f"agent.env_params.python = {self.python!r} was not resolved "
                            "to an interpreter (the runtime does; elsewhere give a path)")
        argv = [self.python, str(RUNNER), "--environment", self.environment,
                "--env-args", self.env_args, "--example", str(self.example),
                "--base-url", base_url, "--model", model, "--results-fd", str(results_fd)]
        if max_tokens is not None:
            argv += ["--max-tokens", str(max_tokens)]
        if temperature is not None:
            argv += ["--temperature", repr(float(temperature))]
        return argv

    async def drive(self, *, base_url: str, api_key: str, model: str, log_path: Path,
                    max_tokens: int | None = None,
                    temperature: float | None = None) -> StepResult:
        """One rollout of the task against `base_url` (the run's URL) with `api_key`
        (the run's key, in the child's environment, never on its command line); its
        rubric's reward; RuntimeError if the rollout failed (the environment, or a model
        call, raised). The child's output goes to `log_path`; cancelling this kills
        the child and all it started (the runtime cancels at agent.run_timeout_s)."""
        if self.task_id is None:
            raise RuntimeError("drive() before reset()")
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "GYRE_"))}
        env.update(OPENAI_API_KEY=api_key, PYTHONPATH=self.path or "",
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(log_path, "ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv(base_url=base_url, model=model, max_tokens=max_tokens,
                               temperature=temperature, results_fd=write_fd),
                    env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
                    stderr=asyncio.subprocess.STDOUT, pass_fds=(write_fd,),
                    start_new_session=True)
        finally:
            os.close(write_fd)
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb"))
        try:
            raw, code = await _read_and_wait(proc, reader)
        except asyncio.CancelledError:
            _kill_group(proc)
            await proc.wait()
            raise
        finally:
            transport.close()
        return self._result(raw, code, log_path)

    def _result(self, raw: bytes, code: int, log_path: Path) -> StepResult:
        try:
            out: dict[str, Any] = json.loads(raw) if raw else {}
        except (ValueError, RecursionError):
            out = {}
        if code != 0 or not out or out.get("failed") or (out.get("error")
                                                         and not out.get("policy_error")):
            tail = log_path.read_bytes()[-LOG_TAIL:].decode(errors="replace")
            raise RuntimeError(f"verifiers rollout failed (exit {code}): "
                               f"{out.get('error') or 'no result'}; log {log_path}: ...{tail}")
        info = {k: out.get(k) for k in ("metrics", "example_id", "stop_condition",
                                        "is_truncated", "error", "policy_error")}
        return StepResult(observation="", reward=float(out["reward"]), done=True, info=info)


async def _read_and_wait(proc, reader: asyncio.StreamReader) -> tuple[bytes, int]:
    raw = await reader.read()  # EOF once the child (and all it started) closed the pipe
    return raw, await proc.wait()


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


register_env("verifiers", VerifiersEnv)
