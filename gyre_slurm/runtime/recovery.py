"""Faults the coordinator survives: a lost node agent, a crashed or hung rollout engine.

Rules (each action lands in `events.jsonl`):

- **A node agent is lost** when its heartbeats stop for `faults.agent_lost_s`, or at
  once when a command finds its port closed (the process is gone). Its cell is marked
  `failed` (`cell_failed`) for the rest of the job: the cell table hands a standalone
  cell's floor duty to an elastic cell of that role, the policy never moves it again,
  and whatever still runs on the node is killed (the local launcher kills the agent's
  process group; on a real node it died with the node). The job stops only when no
  cell is left that could roll out or train.
- **Runs on a lost or failed server** continue elsewhere: the gateway stops routing to
  the server, and a run without a call in flight there moves to another server at its
  next call (its history lives in the gateway, not in the engine). A run whose call was
  in flight on it gets an error (HTTP 502) and restarts as a new attempt, like an
  interrupted run on resume (`StepBook.restart`: `<run_id>-a<N>`, its partial calls are
  never trained), after `faults.run_restart_backoff_s`; a run has at most
  `faults.max_run_attempts` attempts in all.
- **Training without the lost member**: its share of the step's accumulated gradient is
  gone, and the survivors may be mid-collective with it. The world is rebuilt from the
  training nodes that are left (`TrainWorld.drop`), starting from the state after the
  last optimizer step (the checkpoint taken right after it; the initial weights before
  the first step), and every micro-batch of the step trained so far is trained again
  from its stream file (`StepBook.rewind_step`): the step's gradient is again the sum
  over the same trajectories, and nothing is trained twice into the weights. When the
  state after the last step was not checkpointed (`training.checkpoint_every_steps` > 1,
  or the member died while writing that checkpoint) and the step has trained nothing
  yet, a survivor of a replicated trainer (every member holds the whole state) writes
  that checkpoint first (`checkpoint_restored_by_survivor`). Otherwise (a sharded
  trainer: the lost member's shard is gone; or gradients of the step were accumulated)
  the job stops and `--resume` continues from `latest`, training the steps after it
  again.
- **A call that gets no answer from its server** (refused, reset, timed out) makes the
  server suspect: the gateway routes no new runs there until its next good health
  check (else restarted runs would pile onto the dead server, the least loaded).
- **A draining cell's engines are checked too**: one that fails its checks is killed by
  its agent (`engine_replaced`, when "drain"), so the calls in flight there fail and
  the drain ends; the cell's next rollout starts new engines.
- **A rollout engine is checked** every `faults.engine_check_s` (GET /health with a
  timeout of `faults.engine_health_timeout_s`). After `faults.engine_strikes` failed
  checks in a row (crashed: connection refused; hung: no answer) the server is drained
  and its node agent kills the engine process and starts a new one on the same cell
  after a backoff (0.5 s, doubling per restart of that server, at most 8 s), at the
  current policy version (`rollout.weight_sync: stream`: from the initial weights, then
  the current policy by a streamed round of its own); the new server replaces the old
  one in the gateway (`engine_restarted`). A server that a streamed round left
  half-loaded says "syncing" outside any round: it fails its checks. A server
  restarted more than `faults.max_engine_restarts` times marks its cell failed. The
  restart names the server by its address, and the agent runs one engine command at a
  time (`runtime.node_engines`): a server replaced or killed meanwhile is answered
  plainly, and a restarted engine goes into the gateway only while its cell still
  serves with the server it replaces (else `engine_restart_dropped`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from typing import TYPE_CHECKING

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.errors import JobFailed
from gyre_slurm.runtime import checkpoint
from gyre_slurm.runtime.book import Microbatch
from gyre_slurm.runtime.control import AgentUnreachable, CommandError, ControlClient
from gyre_slurm.runtime.job import JobState, ServerId
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.sched.cells import Role

if TYPE_CHECKING:
    from gyre_slurm.engines.client import EngineClient
    from gyre_slurm.gateway import Gateway
    from gyre_slurm.runtime.launcher import Launcher
    from gyre_slurm.runtime.wsync import WeightStream

log = logging.getLogger(__name__)


class JobCannotContinue(JobFailed):
    """After a failure, no cell is left that could roll out or train."""


class Recovery:
    """The rules of the module docstring, acting on the job's shared state through the
    services it names."""

    def __init__(self, *, job: JobState, world: TrainWorld, gateway: Gateway,
                 agents: dict[int, ControlClient], launcher: Launcher,
                 started_from: Path | None, wsync: WeightStream | None = None):
        self.job, self.world, self.gateway = job, world, gateway
        self.agents, self.launcher = agents, launcher
        self.started_from = started_from  # the trainer state the job resumed from
        self.wsync = wsync  # rollout.weight_sync: stream (None: file)

    # -- lost node agents ---------------------------------------------------------------
    def node_lost(self, node: int, reason: str) -> None:
        """Declare `node`'s agent lost (idempotent): its cell fails, its servers leave the
        gateway, the training world is rebuilt without it."""
        job = self.job
        if node in job.lost:
            return
        job.lost.add(node)
        job.heartbeats.pop(node, None)
        agent_log = self.launcher.agent_log(node)
        job.rd.event("agent_lost", node=node, reason=reason, log=str(agent_log))
        log.error("node agent %d lost (%s); see %s", node, reason, agent_log)
        self.launcher.lost(node)
        job.spawn(self._tell_to_stop(node), fails_job=True)
        self.fail_cell(job.cell_of(node), reason=f"node agent {node} lost: {reason}")

    async def _tell_to_stop(self, node: int) -> None:
        """An agent declared lost that is in fact alive (silent, not dead) stops its
        engines and ranks: nobody will talk to it again."""
        try:
            await self.agents[node].post("/cmd/shutdown", timeout_s=5)
        except Exception:  # noqa: BLE001 - gone is what we expect
            pass

    def fail_cell(self, cell: int, *, reason: str) -> None:
        job = self.job
        if job.table[cell].role is Role.FAILED:
            return
        before = job.table[cell]
        job.table.mark_failed(cell, now_s=job.now_s())
        job.rd.event("cell_failed", cell=cell, nodes=job.nodes_of(cell),
                     was=before.role.value, standalone=before.standalone, reason=reason,
                     floors=[c.cell_id for c in job.table.cells if c.standalone])
        for sid in job.server_ids(cell):
            job.spawn(self.retire_server(cell, sid), fails_job=True)
        world = set(self.world.nodes) | set(self.world.members)
        if any(n in world for n in job.nodes_of(cell)):
            job.spawn(self._drop_from_world(), fails_job=True)
        self.check_can_continue()

    def failed_nodes(self) -> set[int]:
        """Every node of a failed cell (a cell of several nodes fails whole)."""
        job = self.job
        return {n for c in job.table.cells if c.role is Role.FAILED
                for n in job.nodes_of(c.cell_id)}

    async def lost_during(self, cells: list[int], exc: BaseException) -> str | None:
        """A handoff of `cells` failed with `exc`. "abandon" when that was the loss of
        those cells (each of them failed), "resume" when a node was lost that the handoff
        needed (one of its cells, or a member of the world it rebuilt): the rest of it can
        be done again without that node; None when no loss explains it (by now, or by the
        heartbeat verdict within `agent_lost_s`)."""
        job = self.job
        if isinstance(exc, AgentUnreachable) and exc.node is not None:
            self.node_lost(exc.node, reason=str(exc))
        deadline = time.monotonic() + job.cfg.faults.agent_lost_s + 2.0
        while True:
            if all(job.table[c].role is Role.FAILED for c in cells):
                return "abandon"
            world = set(self.world.members) | set(self.world.nodes)
            if any(job.table[c].role is Role.FAILED for c in cells) or world & job.lost:
                return "resume"
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.2)

    def check_can_continue(self) -> None:
        job = self.job
        live = [c for c in job.table.cells if c.role is not Role.FAILED]
        elastic = [c for c in live if not c.standalone]
        for role in (Role.ROLLOUT, Role.TRAIN):
            if not elastic and not any(c.heading is role for c in live):
                what = "roll out" if role is Role.ROLLOUT else "train"
                failed = [c.cell_id for c in job.table.cells if c not in live]
                job.failure.set(JobCannotContinue(
                    f"no cell is left that could {what} (failed cells: {failed}); continue "
                    f"with --resume once the nodes are back"))
                return

    async def retire_server(self, cell: int, sid: ServerId) -> None:
        """Stop routing to a dead server; remove it once its calls in flight have failed."""
        clients, name = self.job.engine_clients.get(cell, {}), str(sid)
        client = clients.get(sid)
        if client is None or name not in self.gateway.server_load():
            return
        self.gateway.drain_server(name)
        while self.gateway.server_load().get(name, {}).get("in_flight", 0):
            await asyncio.sleep(0.05)
        if name in self.gateway.server_load():  # a handoff may have removed it meanwhile
            self.gateway.remove_server(name)
        self.job.engine_clients.get(cell, {}).pop(sid, None)
        await client.close()

    # -- the training world without a lost member ---------------------------------------
    def _checkpointed_state(self) -> Path | None:
        """The trainer state of the checkpoint of the current version, or None when there
        is no such checkpoint (or it names another version, or lacks the state)."""
        job = self.job
        version = job.book.version
        path = job.rd.checkpoints / f"step_{version:06d}"
        try:
            saved = loads_json((path / "coordinator.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            return None
        state = path / self.world.state_name
        return state if saved == version and state.exists() else None

    async def _checkpoint_from_survivor(self, gone: list[int]) -> None:
        """The state after the last optimizer step is not on disk: if a surviving member
        holds all of it (a replicated trainer, in a world that stood: not one a member
        was still joining) with no gradient accumulated since (the step has trained
        nothing), it writes that checkpoint. Else `restore_point` says the job cannot go
        on."""
        job, book, world = self.job, self.job.book, self.world
        survivors = [n for n in world.members if n not in gone]
        fresh = book.done() or book.steps[book.version].trained == 0
        why_not = ("the trainer is sharded" if world.reshard else
                   "the world was still being built" if not world.standing else
                   "no member survived" if not survivors else
                   "gradients of the step were accumulated" if not fresh else
                   "no step was trained yet" if book.version == 0 else None)
        if why_not:
            log.warning("no survivor writes the checkpoint of version %d: %s", book.version,
                        why_not)
            return
        t0 = time.monotonic()
        await checkpoint.save(rd=job.rd, world=world, version=book.version,
                              config_name=job.cfg.name, node=survivors[0],
                              weight_sync=job.cfg.rollout.weight_sync)
        job.rd.event("checkpoint_restored_by_survivor", version=book.version,
                     node=survivors[0], lost=gone, seconds=time.monotonic() - t0)

    def restore_point(self) -> Path | None:
        """The trainer state after the last optimizer step: the checkpoint of the current
        version, or None (the initial weights) before the first step."""
        job = self.job
        version = job.book.version
        state = self._checkpointed_state()
        if state is not None:
            return state
        if version == 0 and self.started_from is None:
            return None
        why = ("its trainer is sharded (the lost member's shard of that state is gone)"
               if self.world.reshard else "none that survived holds it without gradients "
               "of the step accumulated")
        raise JobCannotContinue(
            f"a training member was lost in step {version}, whose starting state is not in "
            f"a checkpoint (training.checkpoint_every_steps = "
            f"{job.cfg.training.checkpoint_every_steps}, or the member died writing it), "
            f"and no survivor can write it: {why}; continue with --resume (from "
            f"checkpoints/latest: the steps after it are trained again)")

    async def _drop_from_world(self) -> None:
        async with self.world.lock:
            await self.rebuild_without_lost()

    async def rebuild_without_lost(self, unfinished: Microbatch | None = None) -> None:
        """Callers hold the world lock. Drops the failed cells' nodes from the world; when
        a member was among them, the step is rewound (module docstring)."""
        job, world = self.job, self.world
        failed = self.failed_nodes()
        gone = [n for n in dict.fromkeys(world.members + world.nodes) if n in failed]
        if not gone and unfinished is None:
            return
        hit_members = bool(set(gone) & set(world.members))
        assert hit_members or unfinished is None, "a micro-batch failed with no member lost"
        t0 = time.monotonic()
        if hit_members and unfinished is None and self._checkpointed_state() is None:
            await self._checkpoint_from_survivor(gone)
        restore = self.restore_point() if hit_members else None
        timings = await world.drop(gone, restore=restore)
        redo = job.book.rewind_step(unfinished) if timings.get("restarted") else 0
        job.rd.event("world_rebuilt", lost=gone, members=list(world.members),
                     generation=world.generation, step=job.book.version,
                     restored_from=str(restore) if restore else None,
                     microbatches_again=redo, seconds=time.monotonic() - t0,
                     **{k: v for k, v in timings.items() if k != "restarted"})

    async def after_training_error(self, exc: BaseException,
                                   unfinished: Microbatch | None) -> None:
        """A training command failed (callers hold the world lock). If a member's agent is
        gone (now, or by the heartbeat verdict within `agent_lost_s`), rebuild and
        rewind; else the error stands."""
        job = self.job
        if isinstance(exc, AgentUnreachable) and exc.node is not None:
            self.node_lost(exc.node, reason=str(exc))
        deadline = time.monotonic() + job.cfg.faults.agent_lost_s + 2.0
        while not (job.lost & set(self.world.members)):
            if time.monotonic() > deadline or not isinstance(exc, CommandError):
                raise exc
            await asyncio.sleep(0.2)
        await self.rebuild_without_lost(unfinished)

    # -- rollout engines ----------------------------------------------------------------
    def request_restart(self, cell: int, sid: ServerId, *, reason: str) -> None:
        """Restart server `sid` of `cell` (unless a handoff or a restart has the cell)."""
        job = self.job
        if cell in job.busy_cells or job.table[cell].role is not Role.ROLLOUT:
            return
        job.engine_restarts[sid] = job.engine_restarts.get(sid, 0) + 1
        job.busy_cells.add(cell)
        job.spawn(self.restart_engine(cell, sid, reason=reason,
                                      attempt=job.engine_restarts[sid]), fails_job=True)

    async def watch_engines(self) -> None:
        job, faults = self.job, self.job.cfg.faults
        strikes: dict[ServerId, int] = {}
        slow: set[ServerId] = set()  # answering generations, not health checks (logged)
        # a hung engine answers nothing for the strikes' span; one that answered a
        # generation within it is alive
        window = faults.engine_strikes * (faults.engine_check_s + faults.engine_health_timeout_s)
        while True:
            await asyncio.sleep(faults.engine_check_s)
            checks = [(cell, sid, client)
                      for cell, clients in list(job.engine_clients.items())
                      if self._watched(cell) for sid, client in list(clients.items())
                      if sid not in job.syncing]  # in a streamed round: it answers for them
            results = await asyncio.gather(*(
                c.health(timeout_s=faults.engine_health_timeout_s) for _, _, c in checks),
                return_exceptions=True)
            loads, pending = self.gateway.server_load(), self.wsync_pending()
            for (cell, sid, _), res in zip(checks, results):
                if not self._watched(cell) or sid not in job.engine_clients.get(cell, {}):
                    continue  # a handoff, a restart or a failure began meanwhile
                suspect = bool(loads.get(str(sid), {}).get("suspect"))
                ok, slow_now = health_verdict(
                    res, syncing_ok=sid in pending, suspect=suspect,
                    answered_recently=self.gateway.answered_within(
                        str(sid), window, new_grace_s=faults.engine_start_grace_s))
                if not slow_now:
                    slow.discard(sid)
                elif sid not in slow:
                    slow.add(sid)
                    log.info("engine %s: health check unanswered in time but it answers "
                             "generations: slow, not hung", sid)
                strikes[sid] = 0 if ok else strikes.get(sid, 0) + 1
                if ok and suspect:
                    self.gateway.trust_server(str(sid))  # it answers: route to it again
                if strikes[sid] >= faults.engine_strikes:
                    strikes[sid] = 0
                    reason = f"{type(res).__name__}: {res}" \
                        if isinstance(res, BaseException) else f"health {res}"
                    if job.table[cell].role is Role.DRAINING:
                        job.spawn(self.kill_draining_engine(cell, sid, reason=reason),
                                  fails_job=True)
                    else:
                        self.request_restart(cell, sid, reason=reason)

    def _watched(self, cell: int) -> bool:
        """Cells whose engines are health-checked: serving ones, and ones draining towards
        training (a hung engine's calls would never end, and the drain waits for them)."""
        role = self.job.table[cell].role
        return (role is Role.ROLLOUT and cell not in self.job.busy_cells) \
            or role is Role.DRAINING

    async def kill_draining_engine(self, cell: int, sid: ServerId, *, reason: str) -> None:
        """A draining cell's engine is hung or dead: its agent kills the node's engines,
        so that the calls in flight there fail (their runs restart elsewhere) and the
        drain ends; the cell's next rollout starts new engines."""
        rd = self.job.rd
        if str(sid) in self.gateway.server_load():  # a `wait` drain's runs leave it too
            self.gateway.drain_server(str(sid))
        rd.event("engine_unhealthy", cell=cell, server=str(sid), reason=reason[:300],
                 restart=0, draining=True)
        try:
            await self.agents[sid.node].post("/cmd/kill_engines", {"reason": reason[:300]})
        except AgentUnreachable as exc:
            self.node_lost(sid.node, reason=str(exc))
            return
        rd.event("engine_replaced", cell=cell, node=sid.node, when="drain",
                 reason=reason[:300])

    async def restart_engine(self, cell: int, sid: ServerId, *, reason: str,
                             attempt: int) -> None:
        job = self.job
        again = False
        try:
            again = await self._restart_engine(cell, sid, reason=reason, attempt=attempt)
        finally:
            job.busy_cells.discard(cell)
        if again:
            self.request_restart(cell, sid, reason="the restarted engine did not start")

    async def _restart_engine(self, cell: int, sid: ServerId, *, reason: str,
                              attempt: int) -> bool:
        """One restart of `sid`; True when its new engine did not start (try again)."""
        from gyre_slurm.engines import make_client

        job, name = self.job, str(sid)
        job.rd.event("engine_unhealthy", cell=cell, server=name, reason=reason[:300],
                     restart=attempt)
        if attempt > job.cfg.faults.max_engine_restarts:
            self.fail_cell(cell, reason=f"engine {name} failed {attempt} times: {reason}")
            return False
        old = job.engine_clients.get(cell, {}).get(sid)
        if old is None:
            return False  # retired meanwhile (its cell failed)
        self.gateway.drain_server(name)
        t0 = time.monotonic()
        backoff = min(8.0, 0.5 * 2 ** (attempt - 1))
        try:
            res = await self.agents[sid.node].post("/cmd/restart_engine", {
                "server": sid.index, "version": job.book.version, "backoff_s": backoff,
                "base_url": old.base_url})
        except AgentUnreachable as exc:
            self.node_lost(sid.node, reason=str(exc))
            return False
        except CommandError as exc:  # the new engine did not start: try again, or fail
            job.rd.event("engine_restart_failed", cell=cell, server=name,
                         restart=attempt, error=str(exc)[-500:])
            return True
        if not self.restart_serves(cell, sid, old, res):
            return False
        while self.gateway.server_load().get(name, {}).get("in_flight", 0):
            await asyncio.sleep(0.05)  # the killed engine's calls fail now
        self.gateway.remove_server(name)
        await old.close()
        client = make_client(res.get("engine_kind", "embedded"), res["base_url"],
                             job.rd.secret(), release_mode=job.cfg.release_mode)
        capacity = max(1, job.cfg.cell_capacity // len(job.engine_clients[cell]))
        if self.wsync is None:
            version = await catch_up([client], job, int(res["version"]))
        else:  # a late joiner: the current policy, streamed
            job.engine_clients[cell].pop(sid, None)  # the old one takes no part
            try:
                version = await self._stream_to(sid, client)
            except Exception as exc:  # noqa: BLE001 - restarted again, or its cell fails
                job.rd.event("engine_restart_failed", cell=cell, server=name,
                             restart=attempt, error=f"weight sync: {exc}"[-500:])
                job.engine_clients[cell][sid] = client  # the next restart replaces it
                self.gateway.add_server(name, client, capacity=capacity)
                self.gateway.drain_server(name)
                return True
        job.engine_clients[cell][sid] = client
        self.gateway.add_server(name, client, capacity=capacity)
        job.rd.event("engine_restarted", cell=cell, server=name, node=sid.node,
                     restart=attempt, backoff_s=backoff, exit_code=res.get("exit_code"),
                     seconds=time.monotonic() - t0, version=version)
        return False

    async def _stream_to(self, sid: ServerId, client: EngineClient) -> int:
        """A restarted engine holds the initial weights: stream it the current policy
        (again if a step ended meanwhile). The version it then holds."""
        version = None
        while version != self.job.book.version:
            version, outcome = await self.wsync.bring_up({sid: client})
            if outcome.get(sid):
                raise RuntimeError(outcome[sid])
        return version

    def wsync_pending(self) -> set[ServerId]:
        """Servers a broken streamed round left half-loaded, waiting for the training
        loop to sync them (alive while they say "syncing")."""
        return set(self.wsync.pending) if self.wsync is not None else set()

    def restart_serves(self, cell: int, sid: ServerId, old: EngineClient, res: dict) -> bool:
        """Whether the restarted engine goes into the gateway: only when the agent did
        restart it and the cell still serves with the server it replaces. A cell that was
        lost, or that moved on meanwhile, keeps it out: the agent holds the new engine
        with the cell's others (released, resumed or killed with them)."""
        job = self.job
        if not res.get("restarted", True):  # replaced or killed already: said plainly
            job.rd.event("engine_restart_dropped", cell=cell, server=str(sid),
                         reason=str(res.get("reason"))[:300])
            job.spawn(self.retire_server(cell, sid), fails_job=True)
            return False
        role = job.table[cell].role
        if role is Role.FAILED:
            return False  # the node was lost meanwhile: its servers are retired
        why = (f"the cell is {role.value} now, no longer serving" if role is not Role.ROLLOUT
               else "the server was replaced meanwhile"
               if job.engine_clients.get(cell, {}).get(sid) is not old else None)
        if why:
            job.rd.event("engine_restart_dropped", cell=cell, server=str(sid), reason=why)
        return why is None


async def catch_up(clients: list, job: JobState, version: int) -> int:
    """Engines started at `version` load the policy of every step finished since,
    together; returns the version they serve."""
    from gyre_slurm.models import tiny

    while job.book.version != version:
        version = job.book.version
        path = str(tiny.weights_dir(job.rd.path, version))
        await asyncio.gather(*(c.load_weights(path, version) for c in clients))
    return version


def _timed_out(exc: object) -> bool:
    """Whether an engine call failed by running out of time (not refused, not reset)."""
    seen = 0
    while isinstance(exc, BaseException) and seen < 8:
        if isinstance(exc, TimeoutError):  # asyncio's and aiohttp's timeouts too
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def health_verdict(res: object, *, syncing_ok: bool, suspect: bool,
                   answered_recently: bool) -> tuple[bool, bool]:
    """(alive, slow) of one health check's result (an answer or the exception).

    Alive: "ok", or "paused" (vLLM reloading weights), or "syncing" inside a streamed
    round (`syncing_ok`; outside one it is half-loaded by a round that failed and must not
    serve). Also alive, and slow: no answer in time while the server answered a
    generation within the strikes' span, or is new and has answered none yet
    (`answered_recently`, `faults.engine_start_grace_s`), and no call to it has failed
    (`suspect`): a loaded node, not a hung engine. A refused or reset connection, a wrong
    status, or silence with no generation answered either, is a strike. Restarting a slow
    engine costs a start and its runs' prefix caches, and under the same load its
    successor fares no better (a loaded CI machine restarted a healthy vLLM server every
    25 s, three times)."""
    if isinstance(res, dict):
        status = res.get("status")
        return status in ("ok", "paused") or (status == "syncing" and syncing_ok), False
    slow = _timed_out(res) and not suspect and answered_recently
    return slow, slow
