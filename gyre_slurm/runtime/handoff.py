"""Handoffs (DESIGN 6), executed for the coordinator, every phase timed into events.jsonl.

rollout -> train: stop routing new runs to the cell's server (gateway drain); wait
until no call is in flight on it — its runs move to another server at their next call
— or, with the `wait` drain, until all its runs have ended (`drain_s`);
release the engine (`engine_release_s`); rebuild the training world with the cell's
nodes, which receive weights and optimizer state from a member that stays
(`rebuild_s`, with the workers' own phases). train -> rollout: the training loop
finishes its current micro-batch (the world lock: `drain_s`); the world is rebuilt
without the cell (`rebuild_s`); the engine resumes with the current policy version and
is added to the gateway (`engine_start_s`). Decisions of one tick that go the same way
are executed together: one drain wait, one rebuild.

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
import logging
import time

from gyre_slurm.models import tiny
from gyre_slurm.sched.cells import Role
from gyre_slurm.sched.types import Decision

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 120.0  # a server that has not loaded new weights by then is restarted


def start(coord, decisions: list[Decision]) -> None:
    to_train = [d for d in decisions if d.to_role is Role.TRAIN and d.cause != "cancel_drain"]
    to_rollout = [d for d in decisions if d.to_role is Role.ROLLOUT and d.cause != "cancel_drain"]
    for group, fn in ((to_train, to_train_cells), (to_rollout, to_rollout_cells)):
        if group:
            cells = [d.cell_id for d in group]
            coord.busy_cells.update(cells)
            wait = any(d.drain == "wait" for d in group)
            task = asyncio.create_task(_guard(coord, fn, cells, wait))
            coord.handoff_tasks.add(task)
            task.add_done_callback(coord.handoff_tasks.discard)


async def _guard(coord, fn, cells: list[int], wait: bool) -> None:
    from gyre_slurm.runtime import recovery

    try:
        await fn(coord, cells, wait=wait)
    except Exception as exc:  # noqa: BLE001 - a failed handoff stops the job, loudly
        verdict = await recovery.lost_during(coord, cells, exc)
        error = f"{type(exc).__name__}: {exc}"[:500]
        if verdict == "abandon":
            coord.rd.event("handoff_abandoned", cells=cells, error=error)
            return
        if verdict == "resume":
            coord.rd.event("handoff_resumed", cells=cells, error=error)
            try:
                await _finish_without_lost(coord, fn, cells)
                return
            except Exception as again:  # noqa: BLE001 - as below
                exc = again
        log.exception("handoff of cells %s failed", cells)
        coord.rd.event("handoff_failed", cells=cells, error=f"{type(exc).__name__}: {exc}")
        coord.failure = exc
    finally:
        coord.busy_cells.difference_update(cells)


async def _finish_without_lost(coord, fn, cells: list[int]) -> None:
    """A node the handoff needed was lost: its cells that are left (all loading: only
    the engine release, the rebuild and the engine start talk to nodes) finish it, in a
    world rebuilt without the lost node (`recovery.rebuild_without_lost`)."""
    from gyre_slurm.runtime import recovery
    from gyre_slurm.sched.cells import Role as R

    t0 = time.monotonic()
    live = [c for c in cells if coord.table[c].role is R.LOADING]
    moving = {n for c in live for n in coord.nodes_of(c)}
    async with coord.world.lock:
        await recovery.rebuild_without_lost(coord)
        if fn is to_train_cells:
            new = (set(coord.world.nodes) | moving) - recovery.failed_nodes(coord)
        else:
            new = set(coord.world.nodes) - moving
        await coord.world.rebuild(sorted(new))
    if fn is to_rollout_cells:
        await asyncio.gather(*(bring_up_engine(coord, c) for c in live
                               if not coord.engine_clients.get(c)))
    for c in live:
        coord.table.finish_handoff(c, now_s=time.time() - coord.t0)
    coord.rd.event("handoff", direction="rollout->train" if fn is to_train_cells
                   else "train->rollout", cells=live, resumed=True,
                   total_s=time.monotonic() - t0, drain_s=0.0, rebuild_s=0.0)


def server_ids(coord, cell: int) -> list[str]:
    return list(coord.engine_clients.get(cell, {}))


async def bring_up_engine(coord, cell: int) -> float:
    """Start (or resume) the servers of every node of the cell, bring them to the
    current policy and add them to the gateway; the slowest node's start seconds."""
    from gyre_slurm.engines import make_client

    version = coord.book.version
    nodes = coord.nodes_of(cell)
    results = await asyncio.gather(*(coord.agents[n].post("/cmd/start_engine",
                                                          {"version": version})
                                     for n in nodes))
    clients = {}
    for node, res in zip(nodes, results):
        if res.get("replaced"):
            coord.rd.event("engine_replaced", cell=cell, node=node, when="resume",
                           reason=res["replaced"][:300])
        for k, url in enumerate(res["base_urls"]):
            clients[f"cell{cell}-n{node}-s{k}"] = make_client(
                res.get("engine_kind", "embedded"), url, coord.rd.secret(),
                release_mode=coord.cfg.release_mode)
    while coord.book.version != version:  # a step finished meanwhile: catch up
        version = coord.book.version
        path = str(tiny.weights_dir(coord.rd.path, version))
        await asyncio.gather(*(c.load_weights(path, version) for c in clients.values()))
    coord.engine_clients[cell] = clients
    for sid, client in clients.items():
        coord.gateway.add_server(sid, client, capacity=max(
            1, coord.cfg.cell_capacity // len(clients)))
    return max(float(res.get("engine_start_s", 0.0)) for res in results)


async def load_weights_everywhere(coord, version: int) -> None:
    """Every serving engine loads the new policy in place, between calls, through the
    gateway's own client (the one that records which version answered each call)."""
    from gyre_slurm.runtime import recovery

    cells = [c for c in coord.engine_clients if c not in coord.busy_cells and
             coord.table[c].role is Role.ROLLOUT]
    t0 = time.monotonic()
    path = str(tiny.weights_dir(coord.rd.path, version))
    servers = [(c, sid, client) for c in cells
               for sid, client in list(coord.engine_clients[c].items())]
    results = await asyncio.gather(*(
        asyncio.wait_for(client.load_weights(path, version), LOAD_TIMEOUT_S)
        for _, _, client in servers), return_exceptions=True)
    failed = []
    for (c, sid, _), res in zip(servers, results):
        if isinstance(res, BaseException):  # it must not serve the old version on
            failed.append(sid)
            if sid in coord.gateway.server_load():
                coord.gateway.drain_server(sid)
            recovery.request_restart(coord, c, sid, reason=f"weight load failed: "
                                     f"{type(res).__name__}: {res}")
    coord.rd.event("weights_loaded", version=version, cells=cells, failed=failed,
                   seconds=time.monotonic() - t0)


async def to_train_cells(coord, cells: list[int], *, wait: bool) -> None:
    t0 = time.monotonic()
    for c in cells:
        coord.table.begin_handoff(c, Role.TRAIN, now_s=time.time() - coord.t0)
        for sid in server_ids(coord, c):
            coord.gateway.drain_server(sid)
    while any(_busy(coord, c, wait=wait) for c in cells):
        await asyncio.sleep(0.05)
    phases = {"drain_s": time.monotonic() - t0}
    t1 = time.monotonic()
    for c in cells:
        for sid, client in coord.engine_clients.pop(c).items():
            coord.gateway.remove_server(sid)
            await client.close()
        coord.table.begin_loading(c, now_s=time.time() - coord.t0)
    pairs = [(c, n) for c in cells for n in coord.nodes_of(c)]
    released = await asyncio.gather(*(coord.agents[n].post("/cmd/release_engine")
                                      for _, n in pairs))
    for (c, n), res in zip(pairs, released):
        if res.get("killed"):
            coord.rd.event("engine_replaced", cell=c, node=n, when="release",
                           reason=res["killed"][:300])
    phases["engine_release_s"] = time.monotonic() - t1
    from gyre_slurm.runtime.recovery import failed_nodes

    async with coord.world.lock:
        new = sorted((set(coord.world.nodes) | {n for c in cells for n in coord.nodes_of(c)})
                     - failed_nodes(coord))
        phases.update(await coord.world.rebuild(new))
    for c in cells:
        coord.table.finish_handoff(c, now_s=time.time() - coord.t0)
    phases["total_s"] = time.monotonic() - t0
    coord.rd.event("handoff", direction="rollout->train", cells=cells, **phases)


async def to_rollout_cells(coord, cells: list[int], *, wait: bool = False) -> None:
    t0 = time.monotonic()
    for c in cells:
        coord.table.begin_handoff(c, Role.ROLLOUT, now_s=time.time() - coord.t0)
    async with coord.world.lock:  # the current micro-batch finishes first
        phases = {"drain_s": time.monotonic() - t0}
        for c in cells:
            coord.table.begin_loading(c, now_s=time.time() - coord.t0)
        leaving = {n for c in cells for n in coord.nodes_of(c)}
        phases.update(await coord.world.rebuild([n for n in coord.world.nodes
                                                 if n not in leaving]))
    t1 = time.monotonic()
    starts = await asyncio.gather(*(bring_up_engine(coord, c) for c in cells))
    phases["engine_start_s"] = time.monotonic() - t1
    phases["engine_start_each_s"] = max(starts)
    for c in cells:
        coord.table.finish_handoff(c, now_s=time.time() - coord.t0)
    phases["total_s"] = time.monotonic() - t0
    coord.rd.event("handoff", direction="train->rollout", cells=cells, **phases)


def _busy(coord, cell: int, *, wait: bool) -> bool:
    """A draining server is done when no call is in flight on it (migrate: its runs move
    at their next call) or, with the `wait` drain, when none of its runs is left."""
    loads = coord.gateway.server_load()
    for sid in server_ids(coord, cell):
        load = loads.get(sid, {})
        if load.get("in_flight", 0) or (wait and load.get("runs", 0)):
            return True
    return False
