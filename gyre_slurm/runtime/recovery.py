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
  current policy version; the new server replaces the old one in the gateway
  (`engine_restarted`). A server
  restarted more than `faults.max_engine_restarts` times marks its cell failed. The
  restart names the server by its address, and the agent runs one engine command at a
  time (`runtime.node_engines`): a server replaced or killed meanwhile is answered
  plainly, and a restarted engine goes into the gateway only while its cell still
  serves with the server it replaces (else `engine_restart_dropped`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from gyre_slurm.runtime.control import AgentUnreachable, CommandError
from gyre_slurm.sched.cells import Role

log = logging.getLogger(__name__)

SERVER_ID = re.compile(r"^cell(\d+)-n(\d+)-s(\d+)$")


class JobCannotContinue(RuntimeError):
    """After a failure, no cell is left that could roll out or train."""


# -- lost node agents -------------------------------------------------------------------
def node_lost(coord, node: int, reason: str) -> None:
    """Declare `node`'s agent lost (idempotent): its cell fails, its servers leave the
    gateway, the training world is rebuilt without it."""
    if node in coord.lost:
        return
    coord.lost.add(node)
    coord.heartbeats.pop(node, None)
    coord.rd.event("agent_lost", node=node, reason=reason,
                   log=str(coord.launcher.agent_log(node)))
    log.error("node agent %d lost (%s); see %s", node, reason, coord.launcher.agent_log(node))
    coord.launcher.lost(node)
    _spawn(coord, _tell_to_stop(coord, node))
    cell = node // coord.cfg.cluster.cell_nodes
    fail_cell(coord, cell, reason=f"node agent {node} lost: {reason}")


async def _tell_to_stop(coord, node: int) -> None:
    """An agent declared lost that is in fact alive (silent, not dead) stops its engines
    and ranks: nobody will talk to it again."""
    try:
        await coord.agents[node].post("/cmd/shutdown", timeout_s=5)
    except Exception:  # noqa: BLE001 - gone is what we expect
        pass


def fail_cell(coord, cell: int, *, reason: str) -> None:
    if coord.table is None or coord.table[cell].role is Role.FAILED:
        return
    before = coord.table[cell]
    coord.table.mark_failed(cell, now_s=time.time() - coord.t0)
    coord.rd.event("cell_failed", cell=cell, nodes=coord.nodes_of(cell),
                   was=before.role.value, standalone=before.standalone, reason=reason,
                   floors=[c.cell_id for c in coord.table.cells if c.standalone])
    for sid in list(coord.engine_clients.get(cell, {})):
        _spawn(coord, _retire_server(coord, cell, sid))
    world = set(coord.world.nodes) | set(coord.world.members)
    if any(n in world for n in coord.nodes_of(cell)):
        _spawn(coord, _drop_from_world(coord))
    check_can_continue(coord)


def failed_nodes(coord) -> set[int]:
    """Every node of a failed cell (a cell of several nodes fails whole)."""
    return {n for c in coord.table.cells if c.role is Role.FAILED
            for n in coord.nodes_of(c.cell_id)}


async def lost_during(coord, cells: list[int], exc: BaseException) -> str | None:
    """A handoff of `cells` failed with `exc`. "abandon" when that was the loss of those
    cells (each of them failed), "resume" when a node was lost that the handoff needed
    (one of its cells, or a member of the world it rebuilt): the rest of it can be done
    again without that node; None when no loss explains it (by now, or by the heartbeat
    verdict within `agent_lost_s`)."""
    if isinstance(exc, AgentUnreachable) and exc.node is not None:
        node_lost(coord, exc.node, reason=str(exc))
    deadline = time.monotonic() + coord.cfg.faults.agent_lost_s + 2.0
    while True:
        if all(coord.table[c].role is Role.FAILED for c in cells):
            return "abandon"
        world = set(coord.world.members) | set(coord.world.nodes)
        if any(coord.table[c].role is Role.FAILED for c in cells) or world & coord.lost:
            return "resume"
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.2)


def check_can_continue(coord) -> None:
    live = [c for c in coord.table.cells if c.role is not Role.FAILED]
    elastic = [c for c in live if not c.standalone]
    for role in (Role.ROLLOUT, Role.TRAIN):
        if not elastic and not any(c.heading is role for c in live):
            coord.failure = JobCannotContinue(
                f"no cell is left that could {'roll out' if role is Role.ROLLOUT else 'train'}"
                f" (failed cells: {[c.cell_id for c in coord.table.cells if c not in live]});"
                f" continue with --resume once the nodes are back")
            return


def _spawn(coord, coro) -> None:
    task = asyncio.create_task(coro)
    coord.handoff_tasks.add(task)  # cancelled at shutdown with the handoffs
    task.add_done_callback(coord.handoff_tasks.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or
                           _record_failure(coord, t.exception()))


def _record_failure(coord, exc: BaseException) -> None:
    log.error("recovery failed: %r", exc)
    coord.failure = coord.failure or exc


async def _retire_server(coord, cell: int, sid: str) -> None:
    """Stop routing to a dead server; remove it once its calls in flight have failed."""
    client = coord.engine_clients.get(cell, {}).get(sid)
    if client is None or sid not in coord.gateway.server_load():
        return
    coord.gateway.drain_server(sid)
    while coord.gateway.server_load().get(sid, {}).get("in_flight", 0):
        await asyncio.sleep(0.05)
    if sid in coord.gateway.server_load():  # a handoff may have removed it meanwhile
        coord.gateway.remove_server(sid)
    coord.engine_clients.get(cell, {}).pop(sid, None)
    await client.close()


def _checkpointed_state(coord):
    """The trainer state of the checkpoint of the current version, or None when there
    is no such checkpoint (or it names another version, or lacks the state)."""
    import json

    version = coord.book.version
    path = coord.rd.checkpoints / f"step_{version:06d}"
    try:
        saved = json.loads((path / "coordinator.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None
    state = path / coord.world.state_name
    return state if saved == version and state.exists() else None


async def _checkpoint_from_survivor(coord, gone: list[int]) -> None:
    """The state after the last optimizer step is not on disk: if a surviving member
    holds all of it (a replicated trainer, in a world that stood: not one a member was
    still joining) with no gradient accumulated since (the step has trained nothing),
    it writes that checkpoint. Else `restore_point` says the job cannot go on."""
    from gyre_slurm.runtime import checkpoint

    book, world = coord.book, coord.world
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
    await checkpoint.save(coord, node=survivors[0])
    coord.rd.event("checkpoint_restored_by_survivor", version=book.version,
                   node=survivors[0], lost=gone, seconds=time.monotonic() - t0)


def restore_point(coord):
    """The trainer state after the last optimizer step: the checkpoint of the current
    version, or None (the initial weights) before the first step."""
    version = coord.book.version
    state = _checkpointed_state(coord)
    if state is not None:
        return state
    if version == 0 and coord.resume_state is None:
        return None
    why = ("its trainer is sharded (the lost member's shard of that state is gone)"
           if coord.world.reshard else "none that survived holds it without gradients of "
           "the step accumulated")
    raise JobCannotContinue(
        f"a training member was lost in step {version}, whose starting state is not in a "
        f"checkpoint (training.checkpoint_every_steps = "
        f"{coord.cfg.training.checkpoint_every_steps}, or the member died writing it), and "
        f"no survivor can write it: {why}; continue with --resume (from "
        f"checkpoints/latest: the steps after it are trained again)")


async def _drop_from_world(coord, unfinished=None) -> None:
    async with coord.world.lock:
        await rebuild_without_lost(coord, unfinished)


async def rebuild_without_lost(coord, unfinished=None) -> None:
    """Callers hold the world lock. Drops the failed cells' nodes from the world; when a
    member was among them, the step is rewound (module docstring)."""
    failed = failed_nodes(coord)
    gone = [n for n in dict.fromkeys(coord.world.members + coord.world.nodes) if n in failed]
    if not gone and unfinished is None:
        return
    hit_members = bool(set(gone) & set(coord.world.members))
    assert hit_members or unfinished is None, "a micro-batch failed with no member lost"
    t0 = time.monotonic()
    if hit_members and unfinished is None and _checkpointed_state(coord) is None:
        await _checkpoint_from_survivor(coord, gone)
    restore = restore_point(coord) if hit_members else None
    timings = await coord.world.drop(gone, restore=restore)
    redo = coord.book.rewind_step(unfinished) if timings.get("restarted") else 0
    coord.rd.event("world_rebuilt", lost=gone, members=list(coord.world.members),
                   generation=coord.world.generation, step=coord.book.version,
                   restored_from=str(restore) if restore else None,
                   microbatches_again=redo, seconds=time.monotonic() - t0,
                   **{k: v for k, v in timings.items() if k != "restarted"})


async def after_training_error(coord, exc: BaseException, unfinished) -> None:
    """A training command failed (callers hold the world lock). If a member's agent is
    gone (now, or by the heartbeat verdict within `agent_lost_s`), rebuild and rewind;
    else the error stands."""
    if isinstance(exc, AgentUnreachable) and exc.node is not None:
        node_lost(coord, exc.node, reason=str(exc))
    deadline = time.monotonic() + coord.cfg.faults.agent_lost_s + 2.0
    while not (coord.lost & set(coord.world.members)):
        if time.monotonic() > deadline or not isinstance(exc, CommandError):
            raise exc
        await asyncio.sleep(0.2)
    await rebuild_without_lost(coord, unfinished)


# -- rollout engines --------------------------------------------------------------------
def request_restart(coord, cell: int, sid: str, *, reason: str) -> None:
    """Restart server `sid` of `cell` (unless a handoff or a restart has the cell)."""
    if cell in coord.busy_cells or coord.table[cell].role is not Role.ROLLOUT:
        return
    coord.engine_restarts[sid] = coord.engine_restarts.get(sid, 0) + 1
    coord.busy_cells.add(cell)
    _spawn(coord, restart_engine(coord, cell, sid, reason=reason,
                                 attempt=coord.engine_restarts[sid]))


async def watch_engines(coord) -> None:
    strikes: dict[str, int] = {}
    faults = coord.cfg.faults
    while True:
        await asyncio.sleep(faults.engine_check_s)
        checks = [(cell, sid, client) for cell, clients in list(coord.engine_clients.items())
                  if _watched(coord, cell) for sid, client in list(clients.items())]
        results = await asyncio.gather(*(c.health(timeout_s=faults.engine_health_timeout_s)
                                         for _, _, c in checks), return_exceptions=True)
        for (cell, sid, _), res in zip(checks, results):
            if not _watched(coord, cell) or sid not in coord.engine_clients.get(cell, {}):
                continue  # a handoff, a restart or a failure began meanwhile
            # vLLM says "paused" while it reloads weights: alive
            ok = isinstance(res, dict) and res.get("status") in ("ok", "paused")
            strikes[sid] = 0 if ok else strikes.get(sid, 0) + 1
            if ok and coord.gateway.server_load().get(sid, {}).get("suspect"):
                coord.gateway.trust_server(sid)  # a call failed, but it answers: route again
            if strikes[sid] >= faults.engine_strikes:
                strikes[sid] = 0
                reason = f"{type(res).__name__}: {res}" if isinstance(res, BaseException) \
                    else f"health {res}"
                if coord.table[cell].role is Role.DRAINING:
                    _spawn(coord, kill_draining_engine(coord, cell, sid, reason=reason))
                else:
                    request_restart(coord, cell, sid, reason=reason)


def _watched(coord, cell: int) -> bool:
    """Cells whose engines are health-checked: serving ones, and ones draining towards
    training (a hung engine's calls would never end, and the drain waits for them)."""
    role = coord.table[cell].role
    return (role is Role.ROLLOUT and cell not in coord.busy_cells) or role is Role.DRAINING


async def kill_draining_engine(coord, cell: int, sid: str, *, reason: str) -> None:
    """A draining cell's engine is hung or dead: its agent kills the node's engines, so
    that the calls in flight there fail (their runs restart elsewhere) and the drain
    ends; the cell's next rollout starts new engines."""
    _, node, _ = (int(x) for x in SERVER_ID.match(sid).groups())
    coord.rd.event("engine_unhealthy", cell=cell, server=sid, reason=reason[:300],
                   restart=0, draining=True)
    try:
        await coord.agents[node].post("/cmd/kill_engines", {"reason": reason[:300]})
    except AgentUnreachable as exc:
        node_lost(coord, node, reason=str(exc))
        return
    coord.rd.event("engine_replaced", cell=cell, node=node, when="drain", reason=reason[:300])


async def restart_engine(coord, cell: int, sid: str, *, reason: str, attempt: int) -> None:
    from gyre_slurm.engines import make_client
    from gyre_slurm.models import tiny

    again = False
    try:
        _, node, k = (int(x) for x in SERVER_ID.match(sid).groups())
        coord.rd.event("engine_unhealthy", cell=cell, server=sid, reason=reason[:300],
                       restart=attempt)
        if attempt > coord.cfg.faults.max_engine_restarts:
            fail_cell(coord, cell, reason=f"engine {sid} failed {attempt} times: {reason}")
            return
        old = coord.engine_clients.get(cell, {}).get(sid)
        if old is None:
            return  # retired meanwhile (its cell failed)
        coord.gateway.drain_server(sid)
        t0 = time.monotonic()
        backoff = min(8.0, 0.5 * 2 ** (attempt - 1))
        try:
            res = await coord.agents[node].post("/cmd/restart_engine", {
                "server": k, "version": coord.book.version, "backoff_s": backoff,
                "base_url": old.base_url})
        except AgentUnreachable as exc:
            node_lost(coord, node, reason=str(exc))
            return
        except CommandError as exc:  # the new engine did not start: try again, or fail
            coord.rd.event("engine_restart_failed", cell=cell, server=sid,
                           restart=attempt, error=str(exc)[-500:])
            again = True
            return
        if not _restart_serves(coord, cell, sid, old, res):
            return
        while coord.gateway.server_load().get(sid, {}).get("in_flight", 0):
            await asyncio.sleep(0.05)  # the killed engine's calls fail now
        coord.gateway.remove_server(sid)
        await old.close()
        client = make_client(res.get("engine_kind", "embedded"), res["base_url"],
                             coord.rd.secret(), release_mode=coord.cfg.release_mode)
        version = int(res["version"])
        while coord.book.version != version:  # a step finished meanwhile: catch up
            version = coord.book.version
            await client.load_weights(str(tiny.weights_dir(coord.rd.path, version)), version)
        coord.engine_clients[cell][sid] = client
        coord.gateway.add_server(sid, client, capacity=max(
            1, coord.cfg.cell_capacity // len(coord.engine_clients[cell])))
        coord.rd.event("engine_restarted", cell=cell, server=sid, node=node, restart=attempt,
                       backoff_s=backoff, exit_code=res.get("exit_code"),
                       seconds=time.monotonic() - t0, version=version)
    finally:
        coord.busy_cells.discard(cell)
    if again:
        request_restart(coord, cell, sid, reason="the restarted engine did not start")


def _restart_serves(coord, cell: int, sid: str, old, res: dict) -> bool:
    """Whether the restarted engine goes into the gateway: only when the agent did
    restart it and the cell still serves with the server it replaces. A cell that was
    lost, or that moved on meanwhile, keeps it out: the agent holds the new engine with
    the cell's others (released, resumed or killed with them)."""
    if not res.get("restarted", True):  # replaced or killed already: said plainly
        coord.rd.event("engine_restart_dropped", cell=cell, server=sid,
                       reason=str(res.get("reason"))[:300])
        _spawn(coord, _retire_server(coord, cell, sid))
        return False
    if coord.table[cell].role is Role.FAILED:
        return False  # the node was lost meanwhile: its servers are retired
    role = coord.table[cell].role
    why = (f"the cell is {role.value} now, no longer serving" if role is not Role.ROLLOUT
           else "the server was replaced meanwhile"
           if coord.engine_clients.get(cell, {}).get(sid) is not old else None)
    if why:
        coord.rd.event("engine_restart_dropped", cell=cell, server=sid, reason=why)
    return why is None
