"""Handoffs, executed for the coordinator, every phase timed into events.jsonl.

rollout -> train: stop routing new runs to the cell's server (gateway drain); wait
until no call is in flight on it and the servers that stay have free slots for the runs
still on it — its runs move to a free slot at their next call — or, with the `wait`
drain, until all its runs have ended there (`drain_s`: the gateway keeps routing their
calls to it);
release the engine (`engine_release_s`); rebuild the training world with the cell's
nodes, which receive weights and optimizer state from a member that stays
(`rebuild_s`, with the workers' own phases). train -> rollout: the training loop
finishes its current micro-batch (the world lock: `drain_s`); the world is rebuilt
without the cell (`rebuild_s`); the engine resumes with the current policy version and
is added to the gateway (`engine_start_s`); with `rollout.weight_sync: stream` it gets
the current policy from the training ranks first, one round for every cell that comes
up (`runtime.wsync`), and a cell leaves for training only once its servers are out of
any round. Decisions of one tick that go the same way are executed together: one drain
wait, one rebuild.

A `cancel_drain` decision stops a drain towards training while it waits (as the
simulator does): the cell's servers are brought to the current policy if a step ended
meanwhile (they missed its load), routed to again, and the cell rolls out; the other
cells of its handoff go on. A decision the runtime does not carry out (its cell
failed, is in a handoff past its drain, or restarts an engine) is logged
(`decision_dropped`, with the reason) by `refusal`'s caller, never dropped silently.

Faults (`recovery`): nodes of failed cells never join a world. An engine that does not
release or resume within `faults.engine_handoff_timeout_s` (hung, or dead while its
cell trained) is killed by its agent, and new engines start in its place
(`engine_replaced`): a hung engine never holds a handoff. A handoff that fails
because its cells were lost (each of them marked failed) ends there; the job goes on
(`handoff_abandoned`). A handoff that fails otherwise (among them: a node lost while
OTHER cells moved with it) stops the job, loudly; `--resume` continues it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gyre_slurm.models import tiny
from gyre_slurm.runtime.control import CommandError, ControlClient
from gyre_slurm.runtime.job import JobState, ServerId
from gyre_slurm.runtime.recovery import Recovery, catch_up
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.observe import HandoffTimes
from gyre_slurm.sched.types import Decision

if TYPE_CHECKING:
    from gyre_slurm.gateway import Gateway
    from gyre_slurm.runtime.wsync import WeightStream

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 120.0  # a server that has not loaded new weights by then is restarted

Move = Callable[[list[int], bool], Awaitable[None]]  # a handoff of cells; wait drain or not


class Handoffs:
    """Executes the policy's decisions and keeps the rollout servers on the
    current policy, on the job's shared state through the services it names."""

    def __init__(self, *, job: JobState, world: TrainWorld, gateway: Gateway,
                 agents: dict[int, ControlClient], recovery: Recovery,
                 wsync: WeightStream | None = None):
        self.job, self.world, self.gateway = job, world, gateway
        self.agents, self.recovery = agents, recovery
        self.wsync = wsync  # rollout.weight_sync: stream (None: file)
        self.draining: set[int] = set()  # cells waiting in the drain of a move to training
        self.cancels: set[int] = set()  # ... whose drain the policy cancelled
        self.times = HandoffTimes()  # measured transits: the costs the policy is told

    def refusal(self, d: Decision) -> str | None:
        """Why the decision is not carried out now (None: it is)."""
        cell = self.job.table[d.cell_id]
        if cell.role is Role.FAILED:
            return "the cell has failed"
        if d.cause == "cancel_drain":
            if d.cell_id in self.cancels:
                return "its drain is being cancelled already"
            if d.cell_id in self.draining:
                return None
            if cell.role in (Role.DRAINING, Role.LOADING) and cell.target is Role.TRAIN:
                return "too late: the cell's drain has ended, it is joining training"
            return f"the cell is {cell.role.value}, not draining towards training"
        if cell.role in (Role.DRAINING, Role.LOADING):
            return f"the cell is {cell.role.value} in a handoff to {cell.target.value}"
        if d.cell_id in self.job.busy_cells:
            return "the cell is busy: an engine restart, or a handoff that is starting"
        return None

    def start(self, decisions: list[Decision]) -> None:
        """Hand off the decided cells in the background, one handoff per direction;
        cancel the drains the decisions cancel (`refusal` has passed each of them)."""
        job = self.job
        self.cancels.update(d.cell_id for d in decisions if d.cause == "cancel_drain")
        moves: list[tuple[list[Decision], Move]] = [
            ([d for d in decisions if d.to_role is Role.TRAIN], self.to_train),
            ([d for d in decisions if d.to_role is Role.ROLLOUT and d.cause != "cancel_drain"],
             self.to_rollout)]
        for group, move in moves:
            if group:
                cells = [d.cell_id for d in group]
                job.busy_cells.update(cells)
                wait = any(d.drain == "wait" for d in group)
                job.spawn(self._guard(move, cells, wait))

    async def _guard(self, move: Move, cells: list[int], wait: bool) -> None:
        job = self.job
        try:
            await move(cells, wait)
        except Exception as exc:  # noqa: BLE001 - a failed handoff stops the job, loudly
            verdict = await self.recovery.lost_during(cells, exc)
            error = f"{type(exc).__name__}: {exc}"[:500]
            if verdict == "abandon":
                job.rd.event("handoff_abandoned", cells=cells, error=error)
                return
            if verdict == "resume":
                job.rd.event("handoff_resumed", cells=cells, error=error)
                try:
                    await self._finish_without_lost(move, cells)
                    return
                except Exception as again:  # noqa: BLE001 - as below
                    exc = again
            log.exception("handoff of cells %s failed", cells)
            job.rd.event("handoff_failed", cells=cells, error=f"{type(exc).__name__}: {exc}")
            job.failure.set(exc)
        finally:
            job.busy_cells.difference_update(cells)

    async def _finish_without_lost(self, move: Move, cells: list[int]) -> None:
        """A node the handoff needed was lost: its cells that are left (all loading: only
        the engine release, the rebuild and the engine start talk to nodes) finish it,
        in a world rebuilt without the lost node (`Recovery.rebuild_without_lost`)."""
        job, world = self.job, self.world
        to_train = move == self.to_train
        t0 = time.monotonic()
        live = [c for c in cells if job.table[c].role is Role.LOADING]
        moving = {n for c in live for n in job.nodes_of(c)}
        async with world.lock:
            await self.recovery.rebuild_without_lost()
            if to_train:
                new = (set(world.nodes) | moving) - self.recovery.failed_nodes()
            else:
                new = set(world.nodes) - moving
            await world.rebuild(sorted(new))
        if not to_train:
            await self.bring_up_engines([c for c in live if not job.engine_clients.get(c)])
        for c in live:
            job.table.finish_handoff(c, now_s=job.now_s())
        job.rd.event("handoff", direction="rollout->train" if to_train else "train->rollout",
                     cells=live, resumed=True, total_s=time.monotonic() - t0, drain_s=0.0,
                     rebuild_s=0.0)

    async def bring_up_engine(self, cell: int) -> float:
        """Start (or resume) the servers of every node of the cell, bring them to the
        current policy and add them to the gateway; the slowest node's start seconds."""
        return await self.bring_up_engines([cell])

    async def bring_up_engines(self, cells: list[int]) -> float:
        """`bring_up_engine` for several cells at once (streamed: one round for all)."""
        return await self.connect_engines(cells, await self.start_engines(cells))

    async def start_engines(self, cells: list[int]) -> list:
        """The first half of `bring_up_engines`: the cells' servers start (or resume) on
        what they hold, which needs no training world; `connect_engines` then brings them
        to the current policy and to the gateway."""
        return list(await asyncio.gather(*(self._start_engines(c) for c in cells)))

    async def standby_engines(self, cells: list[int]) -> float:
        """Start the servers of cells that open in training and release them at once
        (`rollout.standby`): a cell's first move to rollout then resumes a released
        server, as every later one does, instead of starting one (seconds on CPU,
        minutes on GPUs, while the rollout that called for the cell waits).
        A node whose server fails to start is logged and left without one: its cell's
        first move to rollout starts it then, as it would have. The seconds it took."""
        job = self.job
        t0 = time.monotonic()

        async def one(cell: int, node: int) -> None:
            agent = self.agents[node]
            try:
                res = await agent.post("/cmd/start_engine", {"version": job.book.version})
            except CommandError as exc:  # (AgentUnreachable too) the move starts it later
                job.rd.event("standby_failed", cell=cell, node=node,
                             reason=f"start: {type(exc).__name__}: {exc}"[:300])
                return
            self._log_start(cell, node, res, standby=True)
            try:
                self._log_release(cell, node, await agent.post("/cmd/release_engine", {}))
            except CommandError as exc:  # a server left holding the node: stopped
                job.rd.event("standby_failed", cell=cell, node=node,
                             reason=f"release: {type(exc).__name__}: {exc}"[:300])
                with contextlib.suppress(CommandError):
                    await agent.post("/cmd/kill_engines",
                                     {"reason": "its standby release failed"})

        await asyncio.gather(*(one(c, n) for c in cells for n in job.nodes_of(c)))
        return time.monotonic() - t0

    async def connect_engines(self, cells: list[int], started: list) -> float:
        """The second half of `bring_up_engines` (`started`: what `start_engines` gave)."""
        if not cells:
            return 0.0
        job = self.job
        clients = {sid: c for got, _ in started for sid, (c, _) in got.items()}
        if self.wsync is not None:
            held = {sid: v for got, _ in started for sid, (_, v) in got.items()}
            await self._to_current(clients, held)
        else:
            versions = {v for got, _ in started for _, v in got.values()}
            await catch_up(list(clients.values()), job, min(versions))
        for cell, (got, _) in zip(cells, started):
            job.engine_clients[cell] = {sid: c for sid, (c, _) in got.items()}
            for sid, (client, _) in got.items():
                self.gateway.add_server(str(sid), client, capacity=max(
                    1, job.cfg.cell_capacity // len(got)))
        return max(start_s for _, start_s in started)

    async def _start_engines(self, cell: int):
        """Start or resume the cell's servers: ({sid: (client, the version its weights
        hold: None when unknown)}, the slowest node's start seconds)."""
        from gyre_slurm.engines import make_client

        job = self.job
        version = job.book.version
        nodes = job.nodes_of(cell)
        results = await asyncio.gather(*(self.agents[n].post("/cmd/start_engine",
                                                             {"version": version})
                                         for n in nodes))
        got = {}
        for node, res in zip(nodes, results):
            self._log_start(cell, node, res)
            for k, url in enumerate(res["base_urls"]):
                client = make_client(res.get("engine_kind", "embedded"), url, job.rd.secret(),
                                     release_mode=job.cfg.release_mode)
                got[ServerId(cell, node, k)] = (client, res.get("weights_version", version))
        return got, max(float(res.get("engine_start_s", 0.0)) for res in results)

    def _log_start(self, cell: int, node: int, res: dict, **extra) -> None:
        """What a node's answer to /cmd/start_engine says: server processes started
        (`engine_spawned`: new ones, not released servers resumed), or servers that did
        not answer in time killed and started anew (`engine_replaced`)."""
        job = self.job
        if res.get("spawned"):
            job.rd.event("engine_spawned", cell=cell, node=node, version=job.book.version,
                         seconds=float(res.get("engine_start_s", 0.0)), **extra)
        if res.get("replaced"):
            job.rd.event("engine_replaced", cell=cell, node=node, when="resume",
                         reason=res["replaced"][:300])

    def _log_release(self, cell: int, node: int, res: dict) -> None:
        """A node's answer to /cmd/release_engine: servers killed that did not release."""
        if res.get("killed"):
            self.job.rd.event("engine_replaced", cell=cell, node=node, when="release",
                              reason=res["killed"][:300])

    async def _to_current(self, clients: dict, held: dict) -> None:
        """Servers that do not hold the current policy (`held`: sid -> version) get it:
        streamed from the training ranks, or loaded from its file; a step that ends
        meanwhile is caught up the same way, for every server of `clients`. A server that
        does not get it fails the bring-up, loudly."""
        while True:
            version = self.job.book.version
            stale = {sid: c for sid, c in clients.items() if held.get(sid) != version}
            if not stale:
                return
            if self.wsync is None:
                sent = await catch_up(list(stale.values()), self.job, -1)  # -1: the current
            else:
                sent, outcome = await self.wsync.bring_up(stale)
                bad = {str(sid): why for sid, why in outcome.items() if why}
                if bad:
                    raise RuntimeError(f"servers {sorted(bad)} did not get policy version "
                                       f"{sent} by the streamed weight sync: {bad}")
            held.update({sid: sent for sid in stale})

    async def load_weights_everywhere(self, version: int) -> None:
        """Every serving engine loads the new policy in place, between calls, through the
        gateway's own client (the one that records which version answered each call)."""
        job = self.job
        cells = [c for c in job.engine_clients if c not in job.busy_cells and
                 job.table[c].role is Role.ROLLOUT]
        t0 = time.monotonic()
        path = str(tiny.weights_dir(job.rd.path, version))
        servers = [(c, sid, client) for c in cells
                   for sid, client in list(job.engine_clients[c].items())]
        results = await asyncio.gather(*(
            asyncio.wait_for(client.load_weights(path, version), LOAD_TIMEOUT_S)
            for _, _, client in servers), return_exceptions=True)
        failed = []
        for (c, sid, _), res in zip(servers, results):
            if isinstance(res, BaseException):  # it must not serve the old version on
                failed.append(str(sid))
                if str(sid) in self.gateway.server_load():
                    self.gateway.drain_server(str(sid))
                self.recovery.request_restart(c, sid, reason=f"weight load failed: "
                                              f"{type(res).__name__}: {res}")
        job.rd.event("weights_loaded", version=version, cells=cells, failed=failed,
                     seconds=time.monotonic() - t0)

    async def to_train(self, cells: list[int], wait: bool) -> None:
        """`cells` is shared with the caller: a cell whose drain is cancelled leaves it
        (it is no longer this handoff's)."""
        job, world = self.job, self.world
        t0 = time.monotonic()
        for c in cells:
            job.table.begin_handoff(c, Role.TRAIN, now_s=job.now_s())
            for sid in job.server_ids(c):
                self.gateway.drain_server(str(sid), runs="keep" if wait else "free")
        self.draining.update(cells)
        try:
            await self._drain(cells, wait=wait, t0=t0)
        finally:
            self.draining.difference_update(cells)
        if not cells:
            return
        phases = {"drain_s": time.monotonic() - t0}
        t1 = time.monotonic()
        for c in cells:
            for sid, client in job.engine_clients.pop(c).items():
                self.gateway.remove_server(str(sid))
                await client.close()
            job.table.begin_loading(c, now_s=job.now_s())
        pairs = [(c, n) for c in cells for n in job.nodes_of(c)]
        released = await asyncio.gather(*(self.agents[n].post("/cmd/release_engine")
                                          for _, n in pairs))
        for (c, n), res in zip(pairs, released):
            self._log_release(c, n, res)
        phases["engine_release_s"] = time.monotonic() - t1
        async with world.lock:
            joining = {n for c in cells for n in job.nodes_of(c)}
            new = sorted((set(world.nodes) | joining) - self.recovery.failed_nodes())
            phases.update(await world.rebuild(new))
        for c in cells:
            job.table.finish_handoff(c, now_s=job.now_s())
        phases["total_s"] = time.monotonic() - t0
        self.times.add("train", phases["total_s"] - phases["drain_s"])
        job.rd.event("handoff", direction="rollout->train", cells=cells, **phases)

    async def to_rollout(self, cells: list[int], wait: bool = False) -> None:
        job, world = self.job, self.world
        t0 = time.monotonic()
        for c in cells:
            job.table.begin_handoff(c, Role.ROLLOUT, now_s=job.now_s())
        async with world.lock:  # the current micro-batch finishes first
            phases = {"drain_s": time.monotonic() - t0}
            for c in cells:
                job.table.begin_loading(c, now_s=job.now_s())
            leaving = {n for c in cells for n in job.nodes_of(c)}
            phases.update(await world.rebuild([n for n in world.nodes if n not in leaving]))
        t1 = time.monotonic()
        phases["engine_start_each_s"] = await self.bring_up_engines(cells)
        phases["engine_start_s"] = time.monotonic() - t1
        for c in cells:
            job.table.finish_handoff(c, now_s=job.now_s())
        phases["total_s"] = time.monotonic() - t0
        self.times.add("rollout", phases["total_s"])  # its "drain": the micro-batch under way
        job.rd.event("handoff", direction="train->rollout", cells=cells, **phases)

    async def _drain(self, cells: list[int], *, wait: bool, t0: float) -> None:
        """Until no cell of `cells` serves a call (`wait`: holds a run) nor is in a
        streamed round; a cancelled cell leaves `cells` and serves again at once."""
        job = self.job
        while True:
            gone = [c for c in cells if c in self.cancels]
            if gone:
                cells[:] = [c for c in cells if c not in gone]
                self.draining.difference_update(gone)
                try:
                    await self._reopen(gone)
                finally:
                    self.cancels.difference_update(gone)
                job.rd.event("handoff_cancelled", direction="rollout->train", cells=gone,
                             drain_s=time.monotonic() - t0, others=list(cells))
            if not cells:
                return
            if not self._busy(cells, wait=wait) and not any(
                    sid in job.syncing for c in cells for sid in job.server_ids(c)):
                return  # (a streamed round answers for its servers first)
            await asyncio.sleep(0.05)

    async def _reopen(self, cells: list[int]) -> None:
        """Cells whose drain was cancelled serve again, on the current policy (a step
        that ended during the drain did not reach them: they were out of its load). A
        server that does not answer or does not take the policy stays out of routing and
        is restarted (`Recovery.request_restart`)."""
        job = self.job
        clients = {sid: c for cell in cells for sid, c in job.engine_clients[cell].items()}
        answers = await asyncio.gather(*(
            c.health(timeout_s=job.cfg.faults.engine_health_timeout_s)
            for c in clients.values()), return_exceptions=True)
        held, bad = {}, {}
        for sid, res in zip(clients, answers):
            if isinstance(res, dict) and res.get("status") == "ok":
                held[sid] = res.get("policy_version")
            else:
                bad[sid] = f"health {res!r}"[:300]
        live = {sid: c for sid, c in clients.items() if sid in held}
        try:
            await self._to_current(live, held)
        except (RuntimeError, asyncio.TimeoutError) as exc:  # EngineError is one
            bad.update({sid: f"{type(exc).__name__}: {exc}"[:300] for sid in live})
            live = {}
        for sid in live:  # no await from the version check on: no step ends between
            self.gateway.reopen_server(str(sid))
        for c in cells:
            job.table.cancel_drain(c, now_s=job.now_s())
            job.busy_cells.discard(c)
        for sid, why in bad.items():
            self.recovery.request_restart(sid.cell, sid, reason=f"drain cancelled: {why}")

    def _busy(self, cells: list[int], *, wait: bool) -> bool:
        """Draining servers are done when no call is in flight on them and their runs
        left fit in the free slots of the servers that take runs (migrate: they move
        there at their next call; one that finds no slot stays, as in the simulator) or,
        with the `wait` drain, when none of their runs is left."""
        loads = self.gateway.server_load()
        mine = [loads.get(str(sid), {}) for c in cells for sid in self.job.server_ids(c)]
        runs = sum(load.get("runs", 0) for load in mine)
        if any(load.get("in_flight", 0) for load in mine):
            return True
        return runs > 0 if wait else runs > self.gateway.free_slots()
