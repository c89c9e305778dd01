"""The coordinator: one long-lived process that owns the cell table and runs the job.

    gyre run CONFIG --run-dir DIR [--resume]

It starts the node agents (launcher), hosts the control endpoints, the gateway and the
TCPStore of the training worlds, lays the cells out as the policy asks, and then runs
three loops until every step is trained: the policy loop (observations in, decisions
out, handoffs executed: `gyre_slurm.runtime.handoff`), the rollout loop (runs started
within the batch, staleness and capacity budget: `rollouts`), and the training loop
(streaming micro-batches, one optimizer step per batch, new weights published and
loaded by every rollout server, a checkpoint after each step). `status.json` is
rewritten about once a second; everything that happens lands in `events.jsonl`.

Faults it survives (`gyre_slurm.runtime.recovery` has the rules): a node agent that
stops answering (heartbeats silent for `faults.agent_lost_s`, or its port closed) has
its cell marked `failed`; the runs on that cell's servers continue on other servers (a
run whose call was in flight there restarts as a new attempt); the training world is
rebuilt without it and the step's micro-batches are trained again from the state after
the last optimizer step. A crashed or hung rollout engine (a failed health check) is
restarted by its node agent on the same cell. The job stops only when no cell is left
that could roll out or train. A killed coordinator is restarted by `gyre run --resume`
(under Slurm the batch script requeues the job, which resumes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import statistics
import time
from pathlib import Path

import numpy as np
from aiohttp import web

from gyre_slurm.config.schema import GyreConfig
from gyre_slurm.models import tiny
from gyre_slurm.runtime.book import StepBook
from gyre_slurm.runtime import recovery
from gyre_slurm.runtime.control import AgentUnreachable, CommandError, ControlClient, make_app
from gyre_slurm.runtime.launcher import make_launcher
from gyre_slurm.runtime.rollouts import RolloutManager
from gyre_slurm.runtime.rundir import RunDir
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.sched.cells import Cell, CellTable, Role
from gyre_slurm.sched.policies import run_policy
from gyre_slurm.sched.observe import RunsNow, build_observation
from gyre_slurm.sched.types import Observation

log = logging.getLogger(__name__)


class AgentLost(RuntimeError):
    """A node agent stopped answering."""


class Coordinator:
    def __init__(self, cfg: GyreConfig, run_dir: Path, *, resume: bool = False):
        self.cfg, self.rd, self.resume = cfg, RunDir(run_dir), resume
        self.policy = run_policy(cfg)
        stale = cfg.training.max_staleness
        if self.policy.max_staleness is not None:
            stale = min(stale, self.policy.max_staleness)
        w = cfg.workload
        self.book = StepBook(num_steps=w.num_steps, prompts_per_step=w.prompts_per_step,
                             group_size=w.group_size, staleness=stale)
        self.launcher = make_launcher(cfg.cluster.launcher, run_dir=self.rd.path,
                                      num_nodes=cfg.cluster.num_nodes,
                                      addr_prefix=cfg.cluster.node_addr_prefix)
        self.addr0 = self.launcher.coordinator_addr()  # node 0's own address
        self.agents: dict[int, ControlClient] = {}
        self.heartbeats: dict[int, float] = {}
        self.lost: set[int] = set()  # nodes whose agents were lost (recovery.node_lost)
        self.engine_restarts: dict[str, int] = {}  # server id -> restarts so far
        self.resume_state = None
        self.training_now = None  # (stream index, micro-batch) being trained
        self.registered = asyncio.Event()
        self.engine_clients: dict = {}  # cell -> {gateway server id: its engine client}
        self.table: CellTable | None = None
        self.world: TrainWorld | None = None
        self.gateway = None
        self.rollouts: RolloutManager | None = None
        self.busy_cells: set[int] = set()  # cells with a handoff under way
        self.handoff_tasks: set[asyncio.Task] = set()
        self.train_rate: list[float] = []  # measured tokens/s per cell
        self.rewards: list[dict] = []
        self.metrics = None  # runtime.metrics.MetricsLog: metrics.jsonl and TensorBoard
        self.step_signals: dict[int, dict] = {}  # stream index -> its micro-batch's sums
        self.waterlevel_history: collections.deque = collections.deque(maxlen=300)
        self.failure: BaseException | None = None
        self.t0 = time.time()

    # -- setup -----------------------------------------------------------------------
    def prepare_run_dir(self) -> int:
        """Create the run dir (or check it for --resume); returns the starting version."""
        from gyre_slurm.runtime import checkpoint

        if self.resume:
            return checkpoint.load_for_resume(self)
        self.rd.create(self.cfg)
        model = self.cfg.model
        tiny.make_model_dir(self.rd.model_dir, hidden_size=model.hidden_size,
                            num_layers=model.layers, num_heads=model.heads,
                            family=model.family,
                            max_positions=max(4096, self.cfg.rollout.max_model_len))
        tiny.save_weights(tiny.new_model(self.rd.model_dir, seed=self.cfg.seed),
                          tiny.weights_dir(self.rd.path, 0))
        return 0

    async def start_services(self) -> None:
        from gyre_slurm.gateway import Gateway
        from gyre_slurm.traj.store import CallStoreWriter
        from gyre_slurm.train.dist import host_store

        secret = self.rd.secret()
        self.store, store_port = host_store(self.addr0)
        app = make_app(secret)
        app.router.add_post("/agent/register", self.on_register)
        app.router.add_post("/agent/heartbeat", self.on_heartbeat)
        self.control_runner = web.AppRunner(app, access_log=None)
        await self.control_runner.setup()
        site = web.TCPSite(self.control_runner, self.addr0, 0)
        await site.start()
        self.control_url = f"http://{self.addr0}:{site._server.sockets[0].getsockname()[1]}"
        writer_id = f"gateway-{int(time.time())}-{os.getpid()}"
        self.call_writer = CallStoreWriter(self.rd.path, writer_id)
        # The gateway never holds the job secret: each run gets a key of its own.
        external, self.external_writer = None, None
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
        gw_port = await self.gateway.start(self.addr0, 0)
        self.gateway_url = f"http://{self.addr0}:{gw_port}"
        cfg = self.cfg
        self.world = TrainWorld(run_dir=self.rd.path, store_host=self.addr0, store_port=store_port,
                                agents=self.agents, init_weights=tiny.weights_dir(self.rd.path, 0),
                                checkpoint=self.resume_state, ranks_per_node=cfg.ranks_per_node,
                                replica_nodes=cfg.replica_nodes,
                                reshard=cfg.trainer.backend == "megatron",
                                backend="nccl" if cfg.cluster.gpus_per_node else "gloo")
        from gyre_slurm.runtime.metrics import MetricsLog

        self.metrics = MetricsLog(self.rd.path,
                                  purge_step=self.book.version if self.resume else None)
        self.rollouts = RolloutManager(cfg=self.cfg, rd=self.rd, book=self.book,
                                       gateway=self.gateway, gateway_url=self.gateway_url,
                                       flush_calls=self.call_writer.flush)

    async def on_register(self, request: web.Request) -> web.Response:
        body = await request.json()
        node = int(body["node"])
        if not 0 <= node < self.cfg.cluster.num_nodes:
            return web.json_response({"error": f"node {node} is not in this job "
                                      f"(0..{self.cfg.cluster.num_nodes - 1})"}, status=400)
        self.agents[node] = ControlClient(body["url"], self.rd.secret(), node=node)
        self.heartbeats[node] = time.monotonic()
        self.rd.event("agent_registered", node=node, url=body["url"], pid=body.get("pid"),
                      gpus=body.get("cuda_visible_devices"))
        if len(self.agents) == self.cfg.cluster.num_nodes:
            self.registered.set()
        return web.json_response({})

    async def on_heartbeat(self, request: web.Request) -> web.Response:
        body = await request.json()
        node = int(body["node"])
        if node not in self.agents:  # only registered agents beat
            return web.json_response({"error": f"node {node} never registered"}, status=400)
        if node not in self.lost:  # a lost agent stays lost
            self.heartbeats[node] = time.monotonic()
        return web.json_response({})

    def nodes_of(self, cell: int) -> list[int]:
        n = self.cfg.cluster.cell_nodes
        return list(range(cell * n, (cell + 1) * n))

    async def lay_out(self) -> None:
        layout = self.policy.initial_layout(self.cfg.cluster.num_cells)
        names = self.launcher.node_names()
        self.table = CellTable(Cell(i, tuple(names[n] for n in self.nodes_of(i)),
                                    layout.standalone[i], layout.roles[i])
                               for i in range(self.cfg.cluster.num_cells))
        from gyre_slurm.runtime import handoff

        rollout = [c.cell_id for c in self.table.cells if c.role is Role.ROLLOUT]
        await asyncio.gather(*(handoff.bring_up_engine(self, c) for c in rollout))
        train_nodes = [n for c in self.table.ids(Role.TRAIN) for n in self.nodes_of(c)]
        async with self.world.lock:
            timings = await self.world.rebuild(train_nodes)
        self.rd.event("layout", roles=[c.role.value for c in self.table.cells], **timings)

    # -- the job ---------------------------------------------------------------------
    async def run(self) -> int:
        self.resume_state = None
        version = self.prepare_run_dir()
        self.book.mark_trained_before(version)
        from gyre_slurm.runtime.roles import resolve_roles

        # Interpreters of the engine and trainer roles (a role env may be built now):
        # a missing one is refused before any process starts.
        await asyncio.to_thread(resolve_roles, self.cfg, self.rd.path)
        await self.start_services()
        from gyre_slurm.runtime.gcpolicy import freeze_startup_heap

        freeze_startup_heap()  # torch, transformers, the tokenizer: out of the GC's scans
        self.launcher.start(self.control_url)
        try:
            await asyncio.wait_for(self.registered.wait(), timeout=120)
            if self.resume:
                from gyre_slurm.runtime import checkpoint

                checkpoint.replay_runs(self)
            await self.lay_out()
            self.rd.event("start", policy=self.policy.name, version=self.book.version,
                          resume=self.resume, pid=os.getpid())
            loops = [self.policy_loop(), self.training_loop(), self.status_loop(),
                     self.watch_agents(), recovery.watch_engines(self)]
            tasks = [asyncio.create_task(c) for c in loops]
            training, done = tasks[1], set()
            try:
                # The job ends when training has finished its last step (and checkpoint),
                # or when any loop fails; a loop that simply ends (the policy's, once
                # every run has started) leaves the others running.
                pending = set(tasks)
                while not training.done():
                    finished, pending = await asyncio.wait(
                        pending, return_when=asyncio.FIRST_COMPLETED)
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
            self.rd.event("finish", version=self.book.version, wall_s=time.time() - self.t0)
            self.write_status(final=True)
            return 0
        finally:
            await self.shutdown()

    def explain(self, exc: BaseException) -> BaseException:
        """A command that found its node agent gone means that agent is lost."""
        if isinstance(exc, AgentUnreachable) and exc.node is not None:
            self.rd.event("agent_lost", node=exc.node, error=str(exc))
            return AgentLost(f"node agent {exc.node} is gone ({exc}); see "
                             f"{self.launcher.agent_log(exc.node)}")
        return exc

    async def shutdown(self) -> None:
        handoffs = list(self.handoff_tasks)
        for task in handoffs:
            task.cancel()
        await asyncio.gather(*handoffs, return_exceptions=True)
        if self.rollouts is not None:
            await self.rollouts.cancel_all()
        await asyncio.gather(*(a.post("/cmd/shutdown", timeout_s=5) for a in self.agents.values()),
                             return_exceptions=True)
        await asyncio.to_thread(self.launcher.stop)
        for client in self.agents.values():
            await client.close()
        for clients in self.engine_clients.values():
            for client in clients.values():
                await client.close()
        if self.gateway is not None:
            await self.gateway.stop()
        self.call_writer.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.external_writer is not None:
            self.external_writer.close()
        await self.control_runner.cleanup()

    def capacity(self) -> int:
        serving = [c for c in self.table.ids(Role.ROLLOUT) if c not in self.busy_cells]
        return len(serving) * self.cfg.cell_capacity

    async def policy_loop(self) -> None:
        from gyre_slurm.runtime import handoff

        while not self.book.done():
            if self.failure is not None:
                raise self.failure
            self.rollouts.fill(self.capacity())
            decisions = [d for d in self.policy.decide(self.observe())
                         if d.cell_id not in self.busy_cells
                         and self.table[d.cell_id].role is not Role.FAILED]
            for d in decisions:
                fields = d.as_event(time.time() - self.t0)
                fields.pop("kind")
                fields["t_run_s"] = fields.pop("t")  # seconds into this coordinator's life
                self.rd.event("decision", **fields)
            if decisions:
                handoff.start(self, decisions)
            await asyncio.sleep(self.cfg.scheduler.interval_s)

    async def training_loop(self) -> None:
        from gyre_slurm.runtime import checkpoint

        while not self.book.done():
            async with self.world.lock:
                try:
                    trained = await self.train_one() if self.world.members else False
                    if not trained and self.world.members and self.book.step_complete():
                        await self.finish_step()
                        if (self.book.version % self.cfg.training.checkpoint_every_steps == 0
                                or self.book.done()):
                            await checkpoint.save(self)
                        continue
                except CommandError as exc:  # a member lost? then rebuild and rewind
                    unfinished, self.training_now = self.training_now, None
                    await recovery.after_training_error(self, exc, unfinished)
                    continue
            if not trained:
                await asyncio.sleep(0.05)

    async def train_one(self) -> bool:
        step = self.book.version
        again = self.book.next_redo()  # a rewound step's micro-batch: same file, again
        if again is not None:
            index, batch = again
        else:
            batch = self.book.next_microbatch(
                max_tokens=int(self.cfg.training.microbatch_tokens))
            if not batch:
                return False
            index = self.book.steps[step].handed_out
        self.training_now = (index, batch)
        t0 = time.monotonic()
        stats = await self.world.train_microbatch(batch, self.rd.stream_file(step, index))
        self.training_now = None
        tokens = sum(len(t["token_ids"]) for t in batch)
        if self.cfg.trainer.pace:  # emulated accelerators: see TrainerConfig.pace
            pace = self.cfg.training.node_tokens_per_s
            hold = tokens / (pace * len(self.world.members)) - (time.monotonic() - t0)
            if hold > 0:
                await asyncio.sleep(hold)
        dt = time.monotonic() - t0
        cells = max(1, len(self.world.members) // self.cfg.cluster.cell_nodes)
        self.train_rate.append(tokens / max(dt, 1e-6) / cells)
        self.book.trained(batch, index=index)
        self.step_signals[index] = stats  # a micro-batch trained again replaces its sums
        self.rd.event("microbatch", step=step, index=index, runs=[t["run_id"] for t in batch],
                      tokens=tokens, members=list(self.world.members), seconds=dt,
                      stats=stats, again=again is not None)
        return True

    async def finish_step(self) -> None:
        from gyre_slurm.runtime import handoff

        from gyre_slurm.runtime.metrics import step_figures
        from gyre_slurm.train.metrics import merge_all

        step = self.book.version
        state = self.book.steps[step]
        t0 = time.monotonic()
        publish = tiny.weights_dir(self.rd.path, step + 1)
        stats = await self.world.optimizer_step(publish_dir=publish,
                                                num_step_tokens=max(1, state.trained_tokens))
        figures = step_figures(self.book, step, merge_all(self.step_signals.values()),
                               grad_norm=stats.get("grad_norm"))
        self.step_signals.clear()
        version = self.book.step_done()
        self.metrics.write(step=step, version=version, figures=figures)
        await handoff.load_weights_everywhere(self, version)
        rewards = [self.book.runs[r].reward for r in state.runs
                   if self.book.runs[r].state == "ok"]
        mean = statistics.fmean(rewards) if rewards else float("nan")
        self.rewards.append({"step": step, "mean_reward": mean, "runs_ok": len(rewards)})
        self.rd.event("step", step=step, version=version, mean_reward=mean,
                      trajectories=state.trained, tokens=state.trained_tokens,
                      runs_ok=len(rewards), runs=len(state.runs),
                      seconds=time.monotonic() - t0, stats=stats, metrics=figures)

    # -- observation and status ------------------------------------------------------
    def cell_runs(self, cell: int, load: dict) -> int:
        """Runs on the cell's servers (`load`: the gateway's server_load())."""
        return sum(int(load.get(sid, {}).get("runs", 0))
                   for sid in self.engine_clients.get(cell, {}))

    def observe(self) -> Observation:
        now = time.time()
        load = self.gateway.server_load()
        rate = statistics.median(self.train_rate[-20:]) if self.train_rate else 1000.0
        traj_tokens = [len(t["token_ids"]) for s in self.book.steps for t in s.ready]
        runs = RunsNow(in_flight=self.rollouts.in_flight(), queued=len(self.book.pending()),
                       future=self.book.future(),
                       elapsed_s=np.asarray(self.rollouts.elapsed_s(now)),
                       steps=np.asarray(self.rollouts.run_steps(), dtype=np.int64))
        return build_observation(
            cfg=self.cfg, now_s=now - self.t0, table=self.table,
            cell_runs={c.cell_id: self.cell_runs(c.cell_id, load) for c in self.table.cells},
            runs=runs, ledger=self.book.work, version=self.book.version,
            streaming=True,  # the runtime trains every ready group as it comes
            train_tokens_per_cell_s=rate,
            tokens_per_run=float(statistics.fmean(traj_tokens)) if traj_tokens else 100.0,
            handoff=self.cfg.handoff)

    def sample_waterlevel(self) -> dict:
        in_flight = self.rollouts.in_flight() if self.rollouts else 0
        queued = len(self.book.pending())
        sample = {"t": round(time.time() - self.t0, 2), "in_flight": in_flight,
                  "queued": queued,
                  "waterlevel": round((in_flight + queued) / self.cfg.cell_capacity, 3),
                  "rollout_cells": len(self.table.heading_to(Role.ROLLOUT)) if self.table else 0,
                  "train_cells": len(self.table.heading_to(Role.TRAIN)) if self.table else 0}
        self.waterlevel_history.append(sample)
        return sample

    def write_status(self, *, final: bool = False) -> None:
        load = self.gateway.server_load() if self.gateway else {}
        now = self.sample_waterlevel()
        self.rd.write_status({
            "t": time.time(), "elapsed_s": time.time() - self.t0, "final": final,
            # Where the run serves (the gateway: each run's own key; control: the secret).
            "gateway_url": getattr(self, "gateway_url", None),
            "gateway_runs": self.gateway.run_stats() if self.gateway else {},
            "control_url": getattr(self, "control_url", None),
            "policy": self.policy.name, "version": self.book.version,
            "num_steps": self.book.num_steps,
            "cells": [{"cell": c.cell_id, "nodes": list(c.nodes), "role": c.role.value,
                       "target": c.target.value if c.target else None,
                       "runs": self.cell_runs(c.cell_id, load)}
                      for c in self.table.cells] if self.table else [],
            "runs": self.book.run_counts(),  # trained: live, as training consumes them
            "train": {"members": list(self.world.members) if self.world else [],
                      "generation": self.world.generation if self.world else 0,
                      "ready_tokens": self.book.ready_tokens()},
            "rewards": self.rewards,
            "waterlevel": now,  # demand / runs per cell, now
            "waterlevel_history": list(self.waterlevel_history),  # the last 300 samples
        })

    async def status_loop(self) -> None:
        while True:
            self.write_status()
            await asyncio.sleep(self.cfg.monitor.status_interval_s)

    async def watch_agents(self) -> None:
        """A node agent silent for `faults.agent_lost_s` is lost: its cell fails and the
        job goes on without it (`recovery.node_lost`)."""
        lost_s = self.cfg.faults.agent_lost_s
        while True:
            if self.failure is not None:
                raise self.failure
            now = time.monotonic()
            for node, beat in list(self.heartbeats.items()):
                if now - beat > lost_s:
                    recovery.node_lost(self, node, reason=f"silent for {now - beat:.1f}s")
            if self.call_writer.error is not None:  # disk full: no call may go unrecorded
                try:
                    self.rd.event("call_store_failed", error=str(self.call_writer.error))
                except OSError:
                    pass  # events.jsonl is on the full disk too: the error says it all
                raise self.call_writer.error
            await asyncio.sleep(0.5)
