"""External agent scaffolds (any program that speaks the OpenAI API) as gateway clients.

One run = one process of the scaffold, started in the run's working directory with

    OPENAI_BASE_URL = {gateway_url}/runs/{run_id}/v1   (the run's own endpoint)
    OPENAI_API_KEY  = the gateway's key
    GYRE_RUN_ID     = run_id

in its environment; its stdout and stderr go to one log file. The gateway records every
call it makes under `run_id`, so the run's calls become a prefix tree and trajectories
like those of the built-in loop (`gyre_slurm.agents.loop`); the scaffold itself is not
changed, only configured.

    rec = await run_external_agent_async(cmd, base_url=gateway_url, api_key=KEY,
                                         run_id="r1", workdir=wd, timeout_s=600)
    # {"run_id", "status": "ok"|"failed"|"timeout", "exit_code", "error", "log_path",
    #  "t_start", "t_end", "command"}

`status` is "ok" when the process exits 0, "failed" when it exits otherwise or cannot be
started, "timeout" when it runs past `timeout_s` (then its whole process group gets
SIGTERM, and SIGKILL `KILL_GRACE_S` later). Use the async form inside the event loop that
serves the gateway (the coordinator's): the blocking `run_external_agent` there would
stall the gateway the scaffold is waiting on.

mini-swe-agent (the `minisweagent` role environment, `tools/role-env minisweagent`) is
the shipped example: `mini_swe_agent_command(...)` writes its config and builds the
command line. It runs the text-based model class (the action is a fenced bash block in
the reply's content, since the gateway answers text, not tool calls), the
non-interactive `default` agent and the local environment (a shell in the workdir),
with cost tracking off (an unknown model has no price) and no look-ups on the network.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.common.fsio import loads_json

KILL_GRACE_S = 5.0
MINI_BASE_CONFIG = "mini_textbased.yaml"


def run_base_url(gateway_url: str, run_id: str) -> str:
    """The OpenAI base URL of one run on the gateway at `gateway_url` (http://HOST:PORT)."""
    if not gateway_url.startswith(("http://", "https://")) or "/runs/" in gateway_url:
        raise ValueError(f"gateway url {gateway_url!r}: give the gateway's root, "
                         "http://HOST:PORT (the run's path is added here)")
    return f"{gateway_url.rstrip('/')}/runs/{run_id}/v1"


def _prepare(command: list[str], *, base_url: str, api_key: str, run_id: str,
             workdir: str | os.PathLike, env_extra: dict[str, str] | None,
             log_path: str | os.PathLike | None) -> tuple[dict[str, str], Path, Path]:
    if not command or not all(isinstance(c, str) for c in command):
        raise ValueError(f"run {run_id}: the command must be a non-empty list of strings, "
                         f"got {command!r}")
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ValueError(f"run {run_id}: workdir {workdir} is not a directory")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **(env_extra or {}), "OPENAI_BASE_URL": run_base_url(base_url, run_id),
           "OPENAI_API_KEY": api_key, "GYRE_RUN_ID": run_id}
    log = Path(log_path) if log_path is not None else workdir / f"agent-{run_id}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return env, workdir, log


def _record(run_id: str, command: list[str], log: Path, t_start: float, *, status: str,
            exit_code: int | None, error: str | None) -> dict[str, Any]:
    if error is not None:
        error = f"{error} (log: {log})"
    return {"run_id": run_id, "status": status, "exit_code": exit_code, "error": error,
            "log_path": str(log), "t_start": t_start, "t_end": time.time(),
            "command": list(command)}


def _outcome(code: int) -> tuple[str, str | None]:
    if code == 0:
        return "ok", None
    return "failed", f"exited with code {code}"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def run_external_agent(command: list[str], *, base_url: str, api_key: str, run_id: str,
                       workdir: str | os.PathLike, env_extra: dict[str, str] | None = None,
                       timeout_s: float, log_path: str | os.PathLike | None = None
                       ) -> dict[str, Any]:
    """Run the scaffold `command` for run `run_id` to its end; its run record (module
    docstring). Blocking: not in the event loop of the gateway it calls."""
    env, workdir, log = _prepare(command, base_url=base_url, api_key=api_key, run_id=run_id,
                                 workdir=workdir, env_extra=env_extra, log_path=log_path)
    t_start = time.time()
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as exc:
            return _record(run_id, command, log, t_start, status="failed", exit_code=None,
                           error=f"cannot start {command[0]!r}: {exc}")
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
            return _record(run_id, command, log, t_start, status="timeout",
                           exit_code=proc.returncode,
                           error=f"ran past its {timeout_s:g} s and was stopped")
    status, error = _outcome(code)
    return _record(run_id, command, log, t_start, status=status, exit_code=code, error=error)


async def run_external_agent_async(command: list[str], *, base_url: str, api_key: str,
                                   run_id: str, workdir: str | os.PathLike,
                                   env_extra: dict[str, str] | None = None, timeout_s: float,
                                   log_path: str | os.PathLike | None = None
                                   ) -> dict[str, Any]:
    """`run_external_agent` for the event loop (the gateway's own one included)."""
    env, workdir, log = _prepare(command, base_url=base_url, api_key=api_key, run_id=run_id,
                                 workdir=workdir, env_extra=env_extra, log_path=log_path)
    t_start = time.time()
    with open(log, "ab") as out:
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return _record(run_id, command, log, t_start, status="failed", exit_code=None,
                           error=f"cannot start {command[0]!r}: {exc}")
        try:
            code = await asyncio.wait_for(proc.wait(), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
            except asyncio.TimeoutError:
                _kill_group(proc.pid, signal.SIGKILL)
                await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return _record(run_id, command, log, t_start, status="timeout",
                           exit_code=proc.returncode,
                           error=f"ran past its {timeout_s:g} s and was stopped")
    status, error = _outcome(code)
    return _record(run_id, command, log, t_start, status=status, exit_code=code, error=error)


# -- mini-swe-agent ------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaffoldCommand:
    """A scaffold's command line, the extra environment it needs, and its files."""

    command: list[str]
    env: dict[str, str]
    config_path: Path
    output_path: Path  # the scaffold's own trajectory file (mini-swe-agent's JSON)


def mini_swe_agent_config(*, gateway_url: str, run_id: str, workdir: str | os.PathLike,
                          step_limit: int, model_name: str = "gyre-policy",
                          max_tokens: int | None = None, temperature: float | None = None,
                          command_timeout_s: int = 30) -> dict[str, Any]:
    """The settings laid over mini-swe-agent's `mini_textbased.yaml` for one run."""
    if step_limit < 1:
        raise ValueError(f"run {run_id}: step_limit must be >= 1 model calls, got {step_limit}")
    model_kwargs: dict[str, Any] = {"api_base": run_base_url(gateway_url, run_id),
                                    "drop_params": True}
    if max_tokens is not None:
        model_kwargs["max_tokens"] = max_tokens
    if temperature is not None:
        model_kwargs["temperature"] = temperature
    return {
        "agent": {"agent_class": "default", "step_limit": step_limit, "cost_limit": 0},
        "environment": {"environment_class": "local", "cwd": str(Path(workdir).resolve()),
                        "timeout": command_timeout_s},
        # "openai/<name>": litellm's OpenAI-compatible provider sends model=<name>; the key
        # comes from OPENAI_API_KEY, set by run_external_agent, never written to a file.
        "model": {"model_class": "litellm_textbased", "model_name": f"openai/{model_name}",
                  "cost_tracking": "ignore_errors", "model_kwargs": model_kwargs},
    }


def mini_swe_agent_command(*, python: str | os.PathLike, task: str, workdir: str | os.PathLike,
                           gateway_url: str, run_id: str, out_dir: str | os.PathLike,
                           step_limit: int, model_name: str = "gyre-policy",
                           max_tokens: int | None = None, temperature: float | None = None,
                           command_timeout_s: int = 30, max_attempts: int = 1
                           ) -> ScaffoldCommand:
    """Write the run's config to `out_dir` and build the `mini` command line.

    `python`: the minisweagent environment's interpreter (`tools/role-env minisweagent`).
    `max_attempts`: tries per model call (mini-swe-agent's retry; 1 = a failed call
    ends the run, which the gateway did not record)."""
    if not task.strip():
        raise ValueError(f"run {run_id}: the task is empty")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = mini_swe_agent_config(
        gateway_url=gateway_url, run_id=run_id, workdir=workdir, step_limit=step_limit,
        model_name=model_name, max_tokens=max_tokens, temperature=temperature,
        command_timeout_s=command_timeout_s)
    config_path = out / f"mini-{run_id}.yaml"  # JSON is YAML; mini wants the suffix
    tmp = config_path.with_name(config_path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, config_path)
    output_path = out / f"mini-{run_id}.traj.json"
    command = [str(python), "-m", "minisweagent.run.mini", "-c", MINI_BASE_CONFIG,
               "-c", str(config_path), "-t", task, "-o", str(output_path)]
    env = {
        "MSWEA_CONFIGURED": "true",  # no first-run setup prompt
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(out / "mswea-config"),  # not ~/.config
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(max_attempts),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm's price list: the packaged one
        "HF_HUB_OFFLINE": "1",
    }
    return ScaffoldCommand(command, env, config_path, output_path)


def mini_swe_agent_summary(output_path: str | os.PathLike) -> dict[str, Any]:
    """{"exit_status", "api_calls", "roles"} from mini-swe-agent's trajectory file."""
    data = loads_json(Path(output_path).read_text())
    info = data.get("info", {})
    return {"exit_status": info.get("exit_status", ""),
            "api_calls": info.get("model_stats", {}).get("api_calls", 0),
            "roles": [m.get("role") for m in data.get("messages", [])]}
