"""The rollout manager: starts agent runs within the batch and staleness budget and the
servers' capacity, and turns each finished run into trajectories.

A run is an asyncio task running the agent loop against the gateway's per-run URL, as
an unmodified OpenAI client would. When it ends, its run record is appended to
`runs/runs.jsonl`; an ok run's calls are read back from the call store, rebuilt into a
prefix tree and cut into at most K trajectories (`gyre_slurm.traj`), and the ledger
releases its group for training once the whole group has ended. Reading the calls and
building the tree is CPU work that grows with the run (a run of a million tokens takes
seconds): it runs on a worker thread of its own (one, so the call store's reader is
used by one thread at a time), never on the coordinator's event loop.

A run whose model call failed because of the rollout server under it (the gateway
answered 502: the engine crashed, hung and was killed, or its node was lost; or 503: no
server became available) was interrupted, not failed: it restarts as a new attempt
(`StepBook.restart`, `<run_id>-a<N>`) after `faults.run_restart_backoff_s`, at most
`faults.max_run_attempts` attempts in all (the last one's failure is recorded). The interrupted
attempt gets no run record; its partial calls stay in the store, never trained.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre_slurm.common.fsio import append_jsonl
from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.errors import UserError
from gyre_slurm.runtime.book import RunEntry, StepBook
from gyre_slurm.runtime.rundir import RunDir

if TYPE_CHECKING:
    from gyre_slurm.gateway import Gateway

log = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, *, cfg: GyreConfig, rd: RunDir, book: StepBook, gateway: Gateway,
                 gateway_url: str, flush_calls: Callable[[], None] | None = None,
                 gateway_socket: Path | None = None):
        self.cfg, self.rd, self.book = cfg, rd, book
        self.gateway, self.gateway_url = gateway, gateway_url
        self.flush_calls = flush_calls  # makes the gateway's recorded calls readable
        self.tasks: dict[str, asyncio.Task] = {}
        self.started_at: dict[str, float] = {}
        self.not_before: dict[str, float] = {}  # restarted runs wait out a backoff
        self.ending: set[asyncio.Task] = set()  # runs whose trajectories are being built
        self._buffer = None  # traj.store.RunBuffer: used on the worker thread only
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajectories")
        self._tasks_cache: dict[int, list] = {}
        from gyre_slurm.envs import make_env
        from gyre_slurm.envs.base import env_params_for_run

        self.env_params = env_params_for_run(cfg.agent.env, cfg.agent.env_params,
                                             run_dir=rd.path)
        if isinstance(self.env_params.get("python"), str):  # an env's own interpreter
            from gyre_slurm.runtime.roles import resolve_python

            self.env_params["python"] = resolve_python(self.env_params["python"],
                                                       section="agent.env_params")
        # Made once now (and dropped: nothing was reset, so nothing to clean): a bad
        # environment setting (an unknown parameter, a sandbox that cannot isolate
        # here, a phase's turns the env cannot take) is refused before any run starts.
        make_env(cfg.agent.env, **self.env_params)
        for phase in cfg.workload.phases:
            make_env(cfg.agent.env, **self.env_params_at(phase.from_step))
        self.scaffolds = self._scaffold_runners(gateway_socket)

    def _scaffold_runners(self, socket: Path | None) -> dict[str | None, Any]:
        """pattern (None: the default) -> a ScaffoldRunner, or None for the built-in loop.
        An environment a scaffold cannot drive, or a scaffold that cannot start here, is
        refused now."""
        from gyre_slurm.agents.scaffold import ScaffoldRunner
        from gyre_slurm.envs import make_env
        from gyre_slurm.runtime.roles import resolve_python

        agent, out = self.cfg.agent, {}
        for pattern, spec in [(None, agent.scaffold), *agent.scaffold_per_task.items()]:
            if not spec.external:
                out[pattern] = None
                continue
            env = make_env(agent.env, **self.env_params)
            if not (callable(getattr(env, "execute", None))
                    and callable(getattr(env, "evaluate", None))):
                raise UserError(f"agent.env = {agent.env!r} cannot be driven by an external "
                                "scaffold (it has no execute/evaluate): use env shell, or "
                                "agent.scaffold.type: builtin")
            default = "env:minisweagent" if spec.type == "mini-swe-agent" else None
            python = resolve_python(spec.python or default, section="agent.scaffold")
            out[pattern] = ScaffoldRunner(spec, python=python, run_dir=self.rd.path,
                                          socket_path=socket, gateway_url=self.gateway_url)
        return out

    def scaffold_for(self, task_id: str) -> Any:
        """The runner of a task's scaffold (the first matching pattern), or None."""
        for pattern, runner in self.scaffolds.items():
            if pattern is not None and fnmatch.fnmatchcase(task_id, pattern):
                return runner
        return self.scaffolds[None]

    @property
    def started_file(self) -> Path:
        return self.rd.path / "runs" / "started.jsonl"

    def in_flight(self) -> int:
        return len(self.tasks)

    def elapsed_s(self, now: float) -> list[float]:
        return [now - t for t in self.started_at.values()]

    def call_interval_s(self, now: float, calls_of) -> float | None:
        """The mean time between a run's model calls, over the runs in flight that have
        called (`calls_of(run_id)`: the gateway's count): their time so far over their
        calls. None before any has called."""
        calls = elapsed = 0.0
        for rid, t in self.started_at.items():
            n = calls_of(rid)
            if n > 0:
                calls += n
                elapsed += now - t
        return elapsed / calls if calls else None

    def run_steps(self) -> list[int]:
        """The step of each run in flight, in the order of `elapsed_s`."""
        return [self.book.runs[rid].step for rid in self.started_at]

    def env_params_at(self, step: int) -> dict:
        """The environment's parameters for a step's runs: its phase's (workload.phases:
        tool time scaled, tool_sigma and turns set where the env takes them)."""
        from gyre_slurm.config.phases import StepShape, step_shape
        from gyre_slurm.envs.base import env_param_names

        shape = step_shape(self.cfg, step)
        if shape == StepShape():
            return self.env_params
        return shape.env_params(self.env_params, env_param_names(self.cfg.agent.env))

    def fill(self, capacity: int) -> int:
        """Start pending runs while servers have room. Returns how many started."""
        started, now = 0, time.time()
        for entry in self.book.pending():
            if len(self.tasks) >= capacity:
                break
            if self.not_before.get(entry.run_id, 0.0) > now:
                continue
            self.not_before.pop(entry.run_id, None)
            self.book.start(entry.run_id)
            append_jsonl(self.started_file, {"run_id": entry.run_id, "t": time.time()})
            self.started_at[entry.run_id] = time.time()
            self.tasks[entry.run_id] = asyncio.create_task(self._run(entry), name=entry.run_id)
            started += 1
        return started

    def _task_spec(self, step: int, prompt: int):
        from gyre_slurm.envs import tasks_for_step

        if step not in self._tasks_cache:
            self._tasks_cache[step] = tasks_for_step(
                self.cfg.agent.env, step=step, num_prompts=self.cfg.workload.prompts_per_step,
                seed=self.cfg.seed, env_params=self.env_params)
        return self._tasks_cache[step][prompt]

    async def _run(self, entry: RunEntry) -> None:
        from gyre_slurm.envs import make_env

        agent, faults = self.cfg.agent, self.cfg.faults
        env = make_env(agent.env, **self.env_params_at(entry.step))
        task = self._task_spec(entry.step, entry.prompt)
        try:
            record, interrupted = await asyncio.wait_for(self._episode(entry, env, task),
                                                         timeout=agent.run_timeout_s)
        except asyncio.TimeoutError:
            interrupted = False
            record = {"run_id": entry.run_id, "task_id": task.task_id, "reward": 0.0,
                      "status": "timeout", "error": f"run exceeded {agent.run_timeout_s:g}s"}
        except Exception as exc:  # noqa: BLE001 - a run that raised must still end:
            # left unfinished, its group would never close and the job would wait on it
            log.exception("run %s raised", entry.run_id)
            interrupted = False
            record = {"run_id": entry.run_id, "task_id": task.task_id, "reward": 0.0,
                      "status": "failed", "error": f"{type(exc).__name__}: {exc}"[:4000]}
        finally:
            try:
                await env.close()
            except Exception:  # noqa: BLE001 - the run's record stands
                log.exception("run %s: closing its environment raised", entry.run_id)
        record.update(step=entry.step, prompt=entry.prompt, member=entry.member)
        if interrupted and entry.attempt + 1 < faults.max_run_attempts:
            self.restart(entry.run_id, reason=record["error"])
        else:
            await self.finish(entry.run_id, record)

    async def _episode(self, entry: RunEntry, env: Any, task: Any) -> tuple[dict, bool]:
        """One run with its agent: the environment's own loop (`env.drive`: a verifiers
        environment), the task's scaffold, or the built-in loop; each with the run's own
        key (revoked by `end_run` when the run ends). (run record, interrupted)."""
        from gyre_slurm.agents.driven import drives_itself, run_driven
        from gyre_slurm.agents.loop import run_agent
        from gyre_slurm.agents.scaffold import run_scaffold
        from gyre_slurm.config.phases import step_shape
        from gyre_slurm.envs.base import run_seed_of

        agent, run_id = self.cfg.agent, entry.run_id
        run_seed = run_seed_of(self.cfg.seed, run_id)
        scaffold = self.scaffold_for(task.task_id)
        if drives_itself(env):
            record = await run_driven(
                env=env, task=task, run_id=run_id, gateway=self.gateway,
                gateway_url=self.gateway_url, max_tokens=agent.max_tokens,
                temperature=agent.temperature, run_seed=run_seed,
                log_path=self.rd.path / "logs" / f"env-{run_id}.log",
                max_calls=self.cfg.gateway.max_calls_per_run)
        elif scaffold is not None:
            record = await run_scaffold(scaffold, env=env, task=task, run_id=run_id,
                                        gateway=self.gateway, run_seed=run_seed,
                                        max_calls=self.cfg.gateway.max_calls_per_run)
        else:
            result = await run_agent(
                base_url=f"{self.gateway_url}/runs/{run_id}/v1",
                api_key=self.gateway.open_run(run_id), env=env, task=task, run_id=run_id,
                max_turns=step_shape(self.cfg, entry.step).turns or agent.max_turns,
                context_budget_tokens=agent.context_budget_tokens,
                max_tokens=agent.max_tokens, temperature=agent.temperature,
                run_seed=run_seed)
            return result.to_record(), result.interrupted
        # failed after a rollout server failed under one of its calls (502/503)
        return record, (record["status"] == "failed"
                        and self.gateway.server_errors(run_id) > 0)

    def restart(self, run_id: str, *, reason: str) -> str:
        """The run was interrupted by a server failure: a new attempt, after a backoff."""
        self.tasks.pop(run_id, None)
        self.started_at.pop(run_id, None)
        if self.gateway is not None:
            self.gateway.end_run(run_id)
        self._worker.submit(self._forget_calls, run_id)  # its partial calls never train
        new_id = self.book.restart(run_id)
        self.not_before[new_id] = time.time() + self.cfg.faults.run_restart_backoff_s
        self.rd.event("run_restarted", run_id=run_id, new_run_id=new_id, reason=reason[:300])
        return new_id

    async def finish(self, run_id: str, record: dict) -> None:
        """Record a run's end (also used on resume for runs that ended before a stop)."""
        self.tasks.pop(run_id, None)
        writer = getattr(self.gateway, "call_writer", None)
        if record["status"] != "ok" and getattr(writer, "error", None) is not None:
            # The call store failed (disk full): not the run's failure. Left unrecorded,
            # it runs again (a new attempt) on --resume; the job is stopping.
            self.started_at.pop(run_id, None)
            return
        if self.started_at.pop(run_id, None) is not None:  # not a run replayed on resume
            append_jsonl(self.rd.runs_file, record)
        if self.gateway is not None:
            self.gateway.end_run(run_id)
        trajectories, status = [], record["status"]
        if status == "ok":
            if self.flush_calls is not None:  # the gateway's recorded calls, readable
                self.flush_calls()
            trajectories, error = await self._off_loop(self._trajectories, run_id)
            if error:
                status = "failed"
                self.rd.event("run_rejected", run_id=run_id, reason=error)
        # The ledger releases the group to the training loop once every run of it ended.
        self.book.finish(run_id, status=status, reward=float(record.get("reward", 0.0)),
                         trajectories=trajectories)
        self.rd.event("run_end", run_id=run_id, status=status, reward=record.get("reward"),
                      trajectories=len(trajectories), error=record.get("error"))

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the worker thread; this task counts as ending meanwhile."""
        task = asyncio.current_task()
        self.ending.add(task)
        try:
            return await asyncio.wrap_future(self._worker.submit(fn, *args))
        finally:
            self.ending.discard(task)

    def _calls(self):
        """The call store's reader (worker thread only)."""
        from gyre_slurm.traj.store import RunBuffer

        if self._buffer is None:
            self._buffer = RunBuffer(self.rd.path)
        self._buffer.poll()
        return self._buffer

    def _forget_calls(self, run_id: str) -> None:
        """An interrupted attempt's calls are dropped (worker thread)."""
        self._calls().take(run_id)

    def _trajectories(self, run_id: str) -> tuple[list[dict], str | None]:
        """The run's trajectories, or why there are none (worker thread)."""
        from gyre_slurm.traj.process import process_run

        loaded = self._calls().take(run_id)
        if run_id not in loaded.runs:
            reasons = "; ".join(str(e) for e in loaded.errors) or "no recorded calls"
            return [], f"calls of {run_id} unusable: {reasons}"
        result = process_run(loaded.runs[run_id], max_per_run=self.cfg.training.max_per_run)
        return [t.to_dict() for t in result.trajectories], None  # arrays: 5x less memory

    async def cancel_all(self) -> None:
        tasks = list(self.tasks.values()) + list(self.ending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        await asyncio.to_thread(self._worker.shutdown, wait=True, cancel_futures=True)
