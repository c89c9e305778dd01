"""The coordinator: one long-lived process that owns the cell table and runs the job.

    gyre run CONFIG --run-dir DIR [--resume]

`Coordinator.run` reads top to bottom: take the run dir's lock (`runlock`); make (or
check, on --resume) the run dir (`prepare`); start the services (the control endpoints
the node agents register and beat on, the TCPStore of the training worlds, the gateway,
the training world, the rollout manager); start the node agents (launcher) and wait for
them; lay the cells out as the policy asks; then run, until every step is trained:

- the policy loop: start runs within the batch, staleness and capacity budget
  (`rollouts.RolloutManager.fill`), observe, decide, hand cells off
  (`handoff.Handoffs`);
- the training loop: streaming micro-batches, one optimizer step per batch, new weights
  published and loaded by every rollout server (or, `rollout.weight_sync: stream`, sent
  by the training ranks to the servers: `wsync.WeightStream`), a checkpoint after each
  step (`checkpoint`);
- the status loop: `status.json` about once a second (everything that happens also
  lands in `events.jsonl`);
- the watchers: node agents' heartbeats and the call store (here), rollout engines'
  health (`recovery.Recovery.watch_engines`).

The state these parts share is typed (`job.JobState`); handoffs and recovery get it
with the services they use named. Faults it survives (`recovery` has the rules): a node
agent that stops answering (heartbeats silent for `faults.agent_lost_s`, or its port
closed) has its cell marked `failed`; the runs on that cell's servers continue on other
servers (a run whose call was in flight there restarts as a new attempt); the training
world is rebuilt without it and the step's micro-batches are trained again from the
state after the last optimizer step. A crashed or hung rollout engine (a failed health
check) is restarted by its node agent on the same cell. The job stops only when no cell
is left that could roll out or train (`JobState.failure`). A killed coordinator is
restarted by `gyre run --resume` (under Slurm the batch script requeues the job, which
resumes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.errors import JobFailed, UserError
from gyre_slurm.models import tiny
from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.book import StepBook
from gyre_slurm.runtime.control import AgentUnreachable, CommandError
from gyre_slurm.runtime.handoff import Handoffs
from gyre_slurm.runtime.job import JobState
from gyre_slurm.runtime.launcher import make_launcher
from gyre_slurm.runtime.recovery import Recovery
from gyre_slurm.runtime.registry import AgentRegistry
from gyre_slurm.runtime.rollouts import RolloutManager
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.runtime.runlock import RunDirBusy, RunLock
from gyre_slurm.runtime.prepare import RunDirSetup
from gyre_slurm.runtime.training import TrainingLoop
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.sched.cells import Cell, CellTable, Role
from gyre_slurm.sched.observe import (RunsNow, build_observation, prior_tokens_per_cell_s,
                                      prior_tokens_per_run)
from gyre_slurm.sched.policies import run_policy
from gyre_slurm.sched.types import Observation

log = logging.getLogger(__name__)


class AgentLost(JobFailed):
    """A node agent stopped answering."""


class LayoutFailed(JobFailed):
    """The first layout's servers or training world did not start."""


def _failure_text(exc: CommandError) -> str:
    """A failed command in a line or two: "URL/cmd/...: " what the agent said failed
    (its first line; a server's failure carries its log's tail after it) and the
    exception the traceback in it ends with."""
    said = getattr(exc, "error", None)
    if not said:
        return str(exc)[:2000]
    found = re.search(r"\n(\([^)\n]*\) *)?Traceback", said)  # vLLM's: "(Name pid=N) "
    head, trace = (said[:found.start()], said[found.start():]) if found else (said, "")
    first, _, rest = head.strip().partition("\n")
    last = [line for line in _exception_lines(trace) if line not in first]
    text = str(exc).split(" ", 1)[0] + " " + first.rstrip(":")
    if last:
        return text + " (" + " / ".join(last) + ")"
    return (text + (" " + rest.strip() if rest.strip() else ""))[:2000]


def _exception_lines(trace: str, most: int = 3) -> list[str]:
    """The exception a traceback ends with, its first `most` lines (each at most 300
    characters; a process's "(Name pid=N) " prefix dropped); [] if it has none."""
    lines = [re.sub(r"^\([^)]*\)\s*", "", line.strip()) for line in trace.splitlines()]
    lines = [line for line in lines if line]
    starts = [i for i, line in enumerate(lines)
              if re.match(r"[\w.]*(Error|Exception|Exit|Interrupt)\w*(:|$)", line)]
    return [line[:300] for line in lines[starts[-1]:starts[-1] + most]] if starts else []


class Coordinator:
    def __init__(self, cfg: GyreConfig, run_dir: Path, *, resume: bool = False):
        self.cfg, self.rd, self.resume = cfg, RunDir(run_dir), resume
        self.setup = RunDirSetup(cfg, self.rd, resume=resume)
        self.refused = False  # a UserError before anything started (prepare_run_dir, roles)
        self.policy = run_policy(cfg)
        self.launcher = make_launcher(cfg.cluster.launcher, run_dir=self.rd.path,
                                      num_nodes=cfg.cluster.num_nodes,
                                      addr_prefix=cfg.cluster.node_addr_prefix)
        self.addr0 = self.launcher.coordinator_addr()  # node 0's own address
        self.job = JobState(cfg=cfg, rd=self.rd, book=self._new_book(),
                            table=self._initial_table())
        self.registry = AgentRegistry(job=self.job)  # node agents register here
        self.agents = self.registry.agents  # node -> its agent's client, once registered
        # The services, made by start_services:
        self.control_url: str | None = None
        self.store = None  # the TCPStore of the training worlds
        self.call_writer = None  # traj.store.CallStoreWriter of the job's runs
        self.external_writer = None  # ... of external runs (gateway.external)
        self.gateway = None  # gateway.Gateway
        self.gateway_url: str | None = None
        self.gateway_socket: Path | None = None  # for sandboxed scaffolds (agents.scaffold)
        self.world: TrainWorld | None = None
        self.metrics = None  # runtime.metrics.MetricsLog: metrics.jsonl and TensorBoard
        self.rollouts: RolloutManager | None = None
        self.recovery: Recovery | None = None
        self.handoffs: Handoffs | None = None
        self.training: TrainingLoop | None = None
        self.wsync = None  # wsync.WeightStream with rollout.weight_sync: stream
        self.waterlevel_history: collections.deque = collections.deque(maxlen=300)
        self.dropped: dict[int, tuple] = {}  # cell -> its last decision_dropped (to, cause, why)

    @property
    def book(self) -> StepBook:
        return self.job.book

    @property
    def table(self) -> CellTable:
        return self.job.table

    def _new_book(self) -> StepBook:
        stale = self.cfg.training.max_staleness
        if self.policy.max_staleness is not None:
            stale = min(stale, self.policy.max_staleness)
        w = self.cfg.workload
        return StepBook(num_steps=w.num_steps, prompts_per_step=w.prompts_per_step,
                        group_size=w.group_size, staleness=stale)

    def _initial_table(self) -> CellTable:
        num_cells, cell_nodes = self.cfg.cluster.num_cells, self.cfg.cluster.cell_nodes
        layout = self.policy.initial_layout(num_cells)
        names = self.launcher.node_names()
        return CellTable(Cell(i, tuple(names[i * cell_nodes:(i + 1) * cell_nodes]),
                              layout.standalone[i], layout.roles[i])
                         for i in range(num_cells))

    # -- the job -------------------------------------------------------------------------
    async def run(self) -> int:
        """The job, holding the run dir's lock (runtime.runlock) from before anything is
        read or written there to after the last process stopped."""
        loop = asyncio.get_running_loop()
        lock = RunLock(self.rd.path, on_lost=lambda why: loop.call_soon_threadsafe(
            self.job.failure.set, RunDirBusy(why)))
        self.rd.path.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire()
        except UserError:  # another coordinator's run (nothing of it touched), or no lock
            self.refused = True  # can be made there: no summary of the run's earlier days
            raise
        try:
            return await self._run()
        finally:
            lock.release()

    async def _run(self) -> int:
        from gyre_slurm.runtime.gcpolicy import freeze_startup_heap
        from gyre_slurm.runtime.roles import resolve_roles

        # The run dir, the model, the interpreters of the engine and trainer roles (a
        # role env may be built now): what the user gave is refused before any process
        # starts and, in a run dir this job made, leaves no run behind (a config.yaml
        # would make the same command, once fixed, refuse it as "already holds a run").
        try:
            start = self.prepare_run_dir()
            await asyncio.to_thread(resolve_roles, self.cfg, self.rd.path)
        except UserError:
            self.refused = True  # before anything started: no summary of earlier attempts
            if self.made_fresh:
                self.rd.clear()
            raise
        self.book.mark_trained_before(start.version)
        await self.start_services(start)
        freeze_startup_heap()  # torch, transformers, the tokenizer: out of the GC's scans
        self.launcher.start(self.control_url)
        try:
            await self.wait_for_agents()
            try:
                self.registry.check_gpus()
            except UserError:
                self.refused = True  # before a rank or server started
                raise
            if self.resume:
                await checkpoint.replay_runs(book=self.book, rd=self.rd,
                                             finish=self.rollouts.finish)
            await self.lay_out()
            self.rd.event("start", policy=self.policy.name, version=self.book.version,
                          resume=self.resume, pid=os.getpid())
            await self.run_loops()
            self.rd.event("finish", version=self.book.version,
                          wall_s=time.time() - self.job.t0)
            self.write_status(final=True)
            return 0
        finally:
            await self.shutdown()
            if self.refused and self.made_fresh:
                self.rd.clear()  # the same command, once fixed, makes the run afresh

    async def wait_for_agents(self) -> None:
        """Every node agent registered, within `faults.agent_register_s` of the launch;
        else the job stops naming the nodes that did not and their logs (a bare
        TimeoutError after a fixed 120 s before)."""
        limit = self.cfg.faults.agent_register_s
        try:
            await asyncio.wait_for(self.registry.registered.wait(), timeout=limit)
        except TimeoutError:
            missing = [n for n in range(self.cfg.cluster.num_nodes)
                       if n not in self.registry.agents]
            logs = ", ".join(str(self.launcher.agent_log(n)) for n in missing[:3])
            raise AgentLost(
                f"{len(missing)} of {self.cfg.cluster.num_nodes} node agents did not "
                f"register within faults.agent_register_s = {limit:g} s (nodes "
                f"{', '.join(map(str, missing[:10]))}{' ...' if len(missing) > 10 else ''}): "
                f"see {logs}{' ...' if len(missing) > 3 else ''}; on a loaded or slow "
                f"machine raise faults.agent_register_s") from None

    async def run_loops(self) -> None:
        """Until training has finished its last step (and checkpoint), or a loop fails,
        or a part of the job sets its failure. A loop that simply ends (the policy's,
        once every run has started) leaves the others running."""
        tasks = [asyncio.create_task(c) for c in (
            self.training.run(), self.policy_loop(), self.status_loop(),
            self.watch_agents(), self.recovery.watch_engines(), self.job.failure.raised())]
        training, done = tasks[0], set()
        try:
            pending = set(tasks)
            while not training.done():
                finished, pending = await asyncio.wait(pending,
                                                       return_when=asyncio.FIRST_COMPLETED)
                done |= finished
                if any(t.exception() is not None for t in finished):
                    break
        finally:  # also on a stop signal: no loop may act while the job shuts down
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise self.explain(task.exception())

    # -- setup ---------------------------------------------------------------------------
    def prepare_run_dir(self) -> checkpoint.Resume:
        """Create the run dir (or check it for --resume); where the job starts."""
        return self.setup.prepare()

    @property
    def made_fresh(self) -> bool:
        return self.setup.made_fresh

    async def start_services(self, start: checkpoint.Resume) -> None:
        from gyre_slurm.runtime.metrics import MetricsLog
        from gyre_slurm.train.dist import host_store

        cfg = self.cfg
        self.store, store_port = host_store(self.addr0)
        self.control_url = await self.registry.start(self.addr0)
        await self._start_gateway()
        self.world = TrainWorld(run_dir=self.rd.path, store_host=self.addr0,
                                store_port=store_port, agents=self.agents,
                                init_weights=tiny.weights_dir(self.rd.path, 0),
                                checkpoint=start.state, ranks_per_node=cfg.ranks_per_node,
                                replica_nodes=cfg.replica_nodes,
                                reshard=cfg.trainer.backend == "megatron",
                                backend="nccl" if cfg.cluster.gpus_per_node else "gloo")
        self.metrics = MetricsLog(self.rd.path,
                                  purge_step=self.book.version if self.resume else None)
        self.rollouts = RolloutManager(cfg=cfg, rd=self.rd, book=self.book,
                                       gateway=self.gateway, gateway_url=self.gateway_url,
                                       flush_calls=self.call_writer.flush,
                                       gateway_socket=self.gateway_socket)
        if cfg.rollout.weight_sync == "stream":
            from gyre_slurm.runtime.wsync import WeightStream

            self.wsync = WeightStream(job=self.job, world=self.world, gateway=self.gateway,
                                      agents=self.agents, store=self.store)
        self.recovery = Recovery(job=self.job, world=self.world, gateway=self.gateway,
                                 agents=self.agents, launcher=self.launcher,
                                 started_from=start.state, wsync=self.wsync)
        self.handoffs = Handoffs(job=self.job, world=self.world, gateway=self.gateway,
                                 agents=self.agents, recovery=self.recovery, wsync=self.wsync)
        self.training = TrainingLoop(job=self.job, world=self.world, recovery=self.recovery,
                                     handoffs=self.handoffs, metrics=self.metrics,
                                     wsync=self.wsync)

    async def _start_gateway(self) -> None:
        from gyre_slurm.gateway import Gateway
        from gyre_slurm.traj.store import CallStoreWriter

        writer_id = f"gateway-{int(time.time())}-{os.getpid()}"
        self.call_writer = CallStoreWriter(self.rd.path, writer_id)
        # The gateway never holds the job secret: each run gets a key of its own.
        external = None
        ext = self.cfg.gateway.external
        if ext.enabled:
            from gyre_slurm.gateway.runs import ExternalPolicy

            external = ExternalPolicy(key=self.rd.external_key(), prefix=ext.prefix,
                                      max_runs=ext.max_runs, idle_timeout_s=ext.idle_timeout_s,
                                      max_run_s=ext.max_run_s)
            self.external_writer = CallStoreWriter(self.rd.path / "external", writer_id)
        self.gateway = Gateway(model_dir=self.rd.model_dir, call_writer=self.call_writer,
                               external=external, external_writer=self.external_writer,
                               default_max_tokens=self.cfg.gateway.default_max_tokens)
        from gyre_slurm.agents.scaffold import gateway_socket_path

        self.gateway_socket = gateway_socket_path(self.cfg.agent)
        gw_port = await self.gateway.start(self.addr0, 0, unix_path=self.gateway_socket)
        self.gateway_url = f"http://{self.addr0}:{gw_port}"

    async def lay_out(self) -> None:
        """Bring up the rollout cells' engines and the first training world. The servers
        start (on the weights they can load: the policy's file, or streamed, the initial
        one) while the world is built, on other cells: neither waits for the other's
        process start-ups. Then they get the current policy (streamed: from the world)."""
        rollout, train = self.table.ids(Role.ROLLOUT), self.table.ids(Role.TRAIN)
        train_nodes = [n for c in train for n in self.job.nodes_of(c)]
        # The standalone training floor never moves to rollout: no standby server there.
        standby = [c for c in train if not self.table[c].standalone] \
            if self.cfg.standby_engines else []

        async def build_world() -> dict:
            async with self.world.lock:
                return await self.world.rebuild(train_nodes)

        async def standby_and_world() -> dict:
            """The training cells' standby servers (`rollout.standby`) and the world:
            at once on CPU; on GPUs the servers start and sleep before the ranks take
            the devices' memory."""
            if not standby:
                return await build_world()
            if self.cfg.release_mode == "sleep":
                standby_s = await self.handoffs.standby_engines(standby)
                timings = await build_world()
            else:
                standby_s, timings = await both(self.handoffs.standby_engines(standby),
                                                build_world())
            return {**timings, "standby_s": standby_s, "standby_cells": standby}

        try:
            started, timings = await both(self.handoffs.start_engines(rollout),
                                          standby_and_world())
            await self.handoffs.connect_engines(rollout, started)
        except CommandError as exc:  # a rank or server that did not start: say which, why
            if isinstance(exc, UserError):
                raise
            raise LayoutFailed(
                f"the job's first layout did not start: {_failure_text(exc)}. The tracebacks "
                f"and the ranks' and servers' output are in the node agents' logs, "
                f"{self.rd.path / 'logs'}") from exc
        self.rd.event("layout", roles=[c.role.value for c in self.table.cells], **timings)

    # -- the policy loop -----------------------------------------------------------------
    async def policy_loop(self) -> None:
        while not self.book.done():
            self.rollouts.fill(self.capacity())
            obs = self.observe()
            decisions = self.carried(self.policy.decide(obs), obs)
            if decisions:
                self.handoffs.start(decisions)
            await asyncio.sleep(self.cfg.scheduler.interval_s)

    def carried(self, decisions, obs: Observation) -> list:
        """The decisions the handoffs carry out now, each logged (`decision`); the others
        are logged as `decision_dropped` with the reason, once per cell until its next
        carried decision or a different refusal (the policy repeats them every tick).
        The first carried decision of a tick also logs what the policy saw (`observed`:
        `Observation.as_record`)."""
        out = []
        for d in decisions:
            why = self.handoffs.refusal(d)
            fields = d.as_event(self.job.now_s())
            fields.pop("kind")
            fields["t_run_s"] = fields.pop("t")  # seconds into this coordinator's life
            if why is None:
                if not out:
                    fields["observed"] = obs.as_record()
                self.dropped.pop(d.cell_id, None)
                self.rd.event("decision", **fields)
                out.append(d)
            elif self.dropped.get(d.cell_id) != (d.to_role, d.cause, why):
                self.dropped[d.cell_id] = (d.to_role, d.cause, why)
                self.rd.event("decision_dropped", why=why, **fields)
        return out

    def capacity(self) -> int:
        serving = [c for c in self.table.ids(Role.ROLLOUT) if c not in self.job.busy_cells]
        return len(serving) * self.cfg.cell_capacity

    def observe(self) -> Observation:
        now = time.time()
        load = self.gateway.server_load()
        runs = RunsNow(in_flight=self.rollouts.in_flight(), queued=len(self.book.pending()),
                       future=self.book.future(),
                       elapsed_s=np.asarray(self.rollouts.elapsed_s(now)),
                       steps=np.asarray(self.rollouts.run_steps(), dtype=np.int64))
        return build_observation(
            cfg=self.cfg, now_s=now - self.job.t0, table=self.table,
            cell_runs={c.cell_id: self.cell_runs(c.cell_id, load) for c in self.table.cells},
            runs=runs, ledger=self.book.work, version=self.book.version,
            streaming=True,  # the runtime trains every ready group as it comes
            # Until measured, the config's priors, as the opening layout was chosen on
            # (fixed fallbacks of 1,000 tokens/s and 100 tokens had the benchmark's
            # first decision reclaim 2 of its opening training cells, released 8 s later)
            train_tokens_per_cell_s=self.training.tokens_per_cell_s(
                prior_tokens_per_cell_s(self.cfg)),
            tokens_per_run=self.tokens_per_run(),
            handoff=self.handoffs.times.costs(self.cfg.handoff),  # measured, else the config's
            call_interval_s=self.rollouts.call_interval_s(now, self.gateway.calls_of))

    def tokens_per_run(self) -> float:
        """A run's trained tokens in the step being trained: measured on its ended runs;
        before any has ended, the step before's measure scaled as the config scales the
        two (a phase); before that, the config's. It was the mean of the trajectories
        not yet handed to the trainer, per trajectory (not per run), and the config's
        whenever none were waiting: streamed training takes them as they come, so the
        observation went back and forth between the two, and on a slow machine the
        priors test's policy never saw a measured figure."""
        step = min(self.book.version, self.cfg.workload.num_steps - 1)
        prior = prior_tokens_per_run(self.cfg, step)
        measured = self.book.tokens_per_run(step)
        if measured is not None:
            return measured
        before = self.book.tokens_per_run(step - 1)
        if before is not None:
            return before * prior / max(prior_tokens_per_run(self.cfg, step - 1), 1e-9)
        return prior

    def cell_runs(self, cell: int, load: dict) -> int:
        """Runs on the cell's servers (`load`: the gateway's server_load())."""
        return sum(int(load.get(str(sid), {}).get("runs", 0))
                   for sid in self.job.server_ids(cell))

    # -- status and watchers -------------------------------------------------------------
    async def status_loop(self) -> None:
        while True:
            self.write_status()
            await asyncio.sleep(self.cfg.monitor.status_interval_s)

    def sample_waterlevel(self) -> dict:
        in_flight = self.rollouts.in_flight() if self.rollouts else 0
        queued = len(self.book.pending())
        sample = {"t": round(self.job.now_s(), 2), "in_flight": in_flight,
                  "queued": queued,
                  "waterlevel": round((in_flight + queued) / self.cfg.cell_capacity, 3),
                  "rollout_cells": len(self.table.heading_to(Role.ROLLOUT)),
                  "train_cells": len(self.table.heading_to(Role.TRAIN))}
        self.waterlevel_history.append(sample)
        return sample

    def write_status(self, *, final: bool = False) -> None:
        load = self.gateway.server_load() if self.gateway else {}
        now = self.sample_waterlevel()
        self.rd.write_status({
            "t": time.time(), "elapsed_s": self.job.now_s(), "final": final,
            # Where the run serves (the gateway: each run's own key; control: the secret).
            "gateway_url": self.gateway_url,
            "gateway_runs": self.gateway.run_stats() if self.gateway else {},
            "control_url": self.control_url,
            "policy": self.policy.name, "version": self.book.version,
            "num_steps": self.book.num_steps,
            "cells": [{"cell": c.cell_id, "nodes": list(c.nodes), "role": c.role.value,
                       "target": c.target.value if c.target else None,
                       "runs": self.cell_runs(c.cell_id, load)}
                      for c in self.table.cells],
            "runs": self.book.run_counts(),  # trained: live, as training consumes them
            "train": {"members": list(self.world.members) if self.world else [],
                      "generation": self.world.generation if self.world else 0,
                      "ready_tokens": self.book.ready_tokens()},
            "rewards": self.training.rewards if self.training else [],
            "waterlevel": now,  # demand / runs per cell, now
            "waterlevel_history": list(self.waterlevel_history),  # the last 300 samples
        })

    async def watch_agents(self) -> None:
        """A node agent silent for `faults.agent_lost_s` is lost: its cell fails and the
        job goes on without it (`Recovery.node_lost`). A call store that failed (disk
        full) stops the job: no call may go unrecorded."""
        lost_s = self.cfg.faults.agent_lost_s
        while True:
            now = time.monotonic()
            for node, beat in list(self.job.heartbeats.items()):
                if now - beat > lost_s:
                    self.recovery.node_lost(node, reason=f"silent for {now - beat:.1f}s")
            if self.call_writer.error is not None:
                try:
                    self.rd.event("call_store_failed", error=str(self.call_writer.error))
                except OSError:
                    pass  # events.jsonl is on the full disk too: the error says it all
                raise self.call_writer.error
            await asyncio.sleep(0.5)

    # -- the end -------------------------------------------------------------------------
    def explain(self, exc: BaseException) -> BaseException:
        """A command that found its node agent gone means that agent is lost."""
        if isinstance(exc, AgentUnreachable) and exc.node is not None:
            self.rd.event("agent_lost", node=exc.node, error=str(exc))
            return AgentLost(f"node agent {exc.node} is gone ({exc}); see "
                             f"{self.launcher.agent_log(exc.node)}")
        return exc

    async def shutdown(self) -> None:
        background = list(self.job.tasks)  # handoffs and recovery actions
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self.rollouts is not None:
            await self.rollouts.cancel_all()
        await asyncio.gather(*(a.post("/cmd/shutdown", timeout_s=5) for a in self.agents.values()),
                             return_exceptions=True)
        await asyncio.to_thread(self.launcher.stop)
        await self.registry.stop()
        for clients in self.job.engine_clients.values():
            for client in clients.values():
                await client.close()
        if self.gateway is not None:
            await self.gateway.stop()
        if self.gateway_socket is not None:
            shutil.rmtree(self.gateway_socket.parent, ignore_errors=True)
        for writer in (self.call_writer, self.metrics, self.external_writer):
            if writer is not None:
                writer.close()


async def both(first, second) -> tuple:
    """Await two coroutines at once; when one fails, the other is cancelled (and awaited)
    and the first failure raised as it is (asyncio.gather would leave the other running;
    a TaskGroup would wrap the error in an ExceptionGroup, which `explain` does not read)."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
        return tasks[0].result(), tasks[1].result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
