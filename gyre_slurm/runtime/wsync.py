"""The coordinator's side of the streamed weight sync (`rollout.weight_sync: stream`): the
transfer group's generations and the rounds. docs/weight-sync.md has the whole story.

The transfer group joins every rank of the training world (transfer rank = world rank)
and the workers of the rollout servers (after them, in server order). It is rebuilt —
a new generation, a fresh `wsync/gen<N>/` prefix on the job's one TCPStore, announced
there first so that a member asked to join an older one refuses — whenever the world
changed, a round needs a server that is not in it, or a round failed (a member may be
left mid-message). Members join concurrently: the world's nodes through their agents
(`/cmd/wsync_join`), the servers through vLLM's RL route `/init_weight_transfer_engine`
(the embedded engine has the same route).

A round sends the current policy to some servers (`targets`): all serving ones after an
optimizer step (`publish`), or the ones that come up later (`bring_up`: a cell released
to rollout, an engine restarted). Callers hold the world lock (the ranks must not be
training meanwhile). Per target: begin (vLLM: pause once the calls in flight are done,
label "syncing", start its layerwise reload), then every target receives
(`/update_weights`) while every rank sends what it holds (`/cmd/wsync_send`), then
finish (label = the version, resume). A server pauses for its load only.

When no training world stands (colocate between phases, a resume into all-rollout),
the weights come from one stood up for the purpose on the nodes of a whole replica,
from the trainer state the next world would load (`source_world`), and dissolved after.

Faults (the outcome of a round: {server: None | why it failed}; the caller restarts
the failed ones that serve, and fails a bring-up whose servers did not get the policy):
- a target that dies mid-round fails only its own sends: the round finishes for the
  others;
- a target that hangs makes the senders' sends time out (`weight_sync_timeout_s`),
  which closes the whole group, or never answers once every rank has sent: the round
  is retried in a new generation for the others it took down, at most `RETRIES` times;
- a sending rank that fails (its node lost) fails the round loudly (`SyncBroken`, whose
  error goes to the training loop's recovery, which rebuilds the world); the targets
  keep a half-loaded model, paused and labelled "syncing" (nothing reports a version
  from it), and are `pending`: the training loop syncs them before it trains again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.runtime.control import CommandError, ControlClient
from gyre_slurm.runtime.job import JobState, ServerId
from gyre_slurm.runtime.world import TrainWorld
from gyre_slurm.sched.cells import Role

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from gyre_slurm.engines.client import EngineClient
    from gyre_slurm.gateway import Gateway

log = logging.getLogger(__name__)
RETRIES = 2
Targets = dict[ServerId, "EngineClient"]


class SyncBroken(RuntimeError):
    """A sending rank failed mid-round (`error`, a CommandError): the world is broken.
    `failed`: the targets that failed on their own ({sid: why})."""

    def __init__(self, error: BaseException, failed: dict[ServerId, str]):
        super().__init__(str(error))
        self.error, self.failed = error, failed


def wire_dtype(model_dir: Path) -> str:
    """The dtype the weights travel in: the model's own (config.json)."""
    cfg = loads_json((Path(model_dir) / "config.json").read_text())
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return name if name in ("float32", "bfloat16", "float16") else "bfloat16"


class WeightStream:
    def __init__(self, *, job: JobState, world: TrainWorld, gateway: Gateway,
                 agents: dict[int, ControlClient], store: TCPStore):
        self.job, self.world, self.gateway, self.agents = job, world, gateway, agents
        self.store = store  # the job's TCPStore (the coordinator hosts it)
        self.generation = 0
        self.key: tuple | None = None  # (world generation, server base URLs) of the group
        self.offsets: dict[str, int] = {}  # server base URL -> its first transfer rank
        self.workers: dict[str, int] = {}  # server base URL -> its workers
        self.plans: dict = {}  # TrainerLayout -> Plan
        self._hf = None
        self.pending: Targets = {}  # half-loaded by a round a sender broke

    # -- plan and group -------------------------------------------------------------------
    def layout(self):
        from gyre_slurm.train.wsync.plan import TrainerLayout

        cfg = self.job.cfg
        size = len(self.world.members) * cfg.ranks_per_node
        if not self.world.reshard:
            return TrainerLayout("replicated", size)
        return TrainerLayout("megatron", size, tp=cfg.trainer.tensor_parallel,
                             pp=cfg.trainer.pipeline_parallel, ep=cfg.trainer.expert_parallel)

    async def plan(self):
        from gyre_slurm.train.wsync import plan as planlib

        layout = self.layout()
        if layout not in self.plans:
            model_dir = self.job.rd.model_dir
            if self._hf is None:
                self._hf = await asyncio.to_thread(planlib.hf_meta_state, model_dir)
            bucket = int(self.job.cfg.rollout.weight_bucket_mb * (1 << 20))
            self.plans[layout] = await asyncio.to_thread(
                planlib.build_plan, model_dir, layout, bucket_bytes=bucket,
                dtype=wire_dtype(model_dir), hf=self._hf)
        return self.plans[layout]

    def serving(self) -> Targets:
        """Every server that serves the policy: routed to by the gateway (a draining one
        is leaving for training, restarting, or dead), on a live cell."""
        job, out = self.job, {}
        load = self.gateway.server_load()
        for cell, clients in list(job.engine_clients.items()):
            if job.table[cell].role in (Role.FAILED, Role.DRAINING):
                continue
            out.update({sid: c for sid, c in clients.items()
                        if str(sid) in load and not load[str(sid)].get("draining")})
        return out

    async def ensure(self, targets: Targets) -> dict[ServerId, str]:
        """A group holding the world's ranks and every target (callers hold the lock),
        and the serving servers if they can join (the next publish needs them). A server
        that does not answer its health check is left out (a dead one would hold every
        member's rendezvous until the timeout): the targets left out, {sid: why}."""
        if (self.key is not None and self.key[0] == self.world.generation
                and all(c.base_url in self.key[1] for c in targets.values())):
            return {}
        servers = {c.base_url: (sid, c) for sid, c in self.serving().items()}
        servers.update({c.base_url: (sid, c) for sid, c in targets.items()})
        left_out: dict[str, str] = {}
        for attempt in range(2):
            bad = await self._unhealthy(servers)
            left_out.update(bad)
            servers = {u: s for u, s in servers.items() if u not in bad}
            if not any(c.base_url in servers for c in targets.values()):
                break
            try:
                await self._rebuild(servers)
                break
            except RuntimeError as exc:  # CommandError, EngineError: who failed?
                if attempt:
                    raise
                log.warning("transfer generation %d failed (%s): again", self.generation,
                            _why(exc))
        return {sid: f"not in the transfer group: {left_out[c.base_url]}"
                for sid, c in targets.items() if c.base_url in left_out}

    async def _unhealthy(self, servers: dict) -> dict[str, str]:
        """{base URL: why} of the servers that do not answer a health check."""
        limit = self.job.cfg.faults.engine_health_timeout_s
        checks = await asyncio.gather(*(c.health(timeout_s=limit)
                                        for _, c in servers.values()), return_exceptions=True)
        return {url: _why(r) for url, r in zip(servers, checks) if isinstance(r, BaseException)}

    async def _rebuild(self, servers: dict) -> None:
        from gyre_slurm.engines.client import EngineError
        from gyre_slurm.train.dist import announce_transfer_generation

        job, world = self.job, self.world
        self.key = None
        plan = (await self.plan()).to_json()
        ranks = len(world.members) * job.cfg.ranks_per_node
        counts = await asyncio.gather(*(c.num_workers() for _, c in servers.values()))
        offsets, total = {}, ranks
        for url, n in zip(servers, counts):
            offsets[url] = total
            total += n
        self.generation += 1
        announce_transfer_generation(self.store, self.generation)
        rt = job.cfg.rollout
        info = {"generation": self.generation, "world_size": total,
                "store_host": world.store_host, "store_port": world.store_port,
                "backend": self._backend(servers), "timeout_s": rt.weight_sync_timeout_s,
                "plan": plan}
        t0 = time.monotonic()
        calls = [self.agents[n].post("/cmd/wsync_join", {
            "transfer": info, "rank": pos * job.cfg.ranks_per_node})
            for pos, n in enumerate(world.members)]
        calls += [c.init_weight_transfer({**info, "rank_offset": offsets[url],
                                          "host": _host(url)},
                                         timeout_s=rt.weight_sync_timeout_s + 30)
                  for url, (_, c) in servers.items()]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            err = errors[0]
            raise err if isinstance(err, (CommandError, EngineError)) else RuntimeError(
                f"transfer generation {self.generation}: {type(err).__name__}: {err}")
        self.offsets, self.workers = offsets, dict(zip(servers, counts))
        self.key = (world.generation, frozenset(servers))
        job.rd.event("wsync_group", generation=self.generation, ranks=ranks,
                     servers=[str(sid) for sid, _ in servers.values()], size=total,
                     world_generation=world.generation, buckets=len(plan["buckets"]),
                     seconds=time.monotonic() - t0)

    def _backend(self, servers: dict) -> str:
        """The world's backend, but gloo (through host memory) when a training rank
        shares its node's GPUs with a server (a world stood up on serving nodes): NCCL
        refuses two ranks on one GPU."""
        nodes = {sid.node for sid, _ in servers.values()}
        shared = nodes & set(self.world.members)
        return "gloo" if self.world.backend == "nccl" and shared else self.world.backend

    # -- rounds ---------------------------------------------------------------------------
    async def round(self, targets: Targets, version: int, *, why: str) -> dict:
        """Send policy `version` to `targets`; callers hold the world lock and a world
        stands. Returns {sid: None (ok) | why it failed}; SyncBroken if a sender failed."""
        outcome: dict[ServerId, str | None] = {}
        left = dict(targets)
        for attempt in range(RETRIES + 1):
            outcome.update(await self.ensure(left))
            left = {sid: c for sid, c in left.items() if sid not in outcome}
            if not left:
                break
            done, failed, retry = await self._one_round(left, version, why=why,
                                                        attempt=attempt)
            outcome.update(done)
            outcome.update(failed)
            left = {sid: left[sid] for sid in retry}
            if not left:
                break
        outcome.update({sid: "the round timed out again" for sid in left})
        return outcome

    async def _one_round(self, targets: Targets, version: int, *, why: str, attempt: int):
        generation, t0 = self.generation, time.monotonic()
        self.job.syncing.update(targets)
        try:
            failed, live = await self._begin(targets)
            got, sent, silent = await self._transfer(live, generation, version)
            ok = [sid for sid, r in zip(live, got) if not isinstance(r, BaseException)]
            limit = self.job.cfg.faults.engine_handoff_timeout_s
            finished = await asyncio.gather(*(asyncio.wait_for(
                live[sid].finish_weight_update(version), limit) for sid in ok),
                return_exceptions=True)
        finally:
            self.job.syncing.difference_update(targets)
        done = {sid: None for sid, r in zip(ok, finished) if not isinstance(r, BaseException)}
        failed.update({sid: f"finish: {_why(r)}" for sid, r in zip(ok, finished)
                       if isinstance(r, BaseException)})
        dead, hung = self._verdicts(sent, live)
        hung.update(silent)
        failed.update({sid: f"died mid-round: {dead[sid]}" for sid in dead if sid not in done})
        failed.update({sid: f"hung mid-round: {hung[sid]}" for sid in hung})
        if failed:  # a member may be left mid-message: the next round in a new generation
            self.key = None
        victims = [sid for sid, r in zip(live, got) if isinstance(r, BaseException)
                   and sid not in failed]
        sender_error = next((r for r in sent if isinstance(r, BaseException)), None)
        if sender_error is not None:  # the world is broken: recovery first, then resync
            self.key = None
            self.pending.update({sid: live[sid] for sid in victims})
            self._event(version, generation, t0, why, attempt, done, failed, sent,
                        pending=[str(s) for s in victims])
            raise SyncBroken(sender_error, failed)
        retry = victims if hung else []
        failed.update({sid: "a round that failed for another server"
                       for sid in victims if sid not in retry})
        self._event(version, generation, t0, why, attempt, done, failed, sent,
                    retry=[str(s) for s in retry])
        return done, failed, retry

    async def _begin(self, targets: Targets) -> tuple[dict, Targets]:
        """Every target begins (pauses after its calls in flight); (failed, live)."""
        limit = self.job.cfg.faults.engine_handoff_timeout_s
        begun = await asyncio.gather(*(asyncio.wait_for(c.begin_weight_update(), limit)
                                       for c in targets.values()), return_exceptions=True)
        failed = {sid: f"begin: {_why(r)}" for sid, r in zip(targets, begun)
                  if isinstance(r, BaseException)}
        return failed, {sid: c for sid, c in targets.items() if sid not in failed}

    async def _transfer(self, live: Targets, generation: int, version: int):
        """The live targets receive while every rank sends. Returns the receivers'
        answers, the senders' answers, and the receivers silent after every sender was
        done for `weight_sync_timeout_s` ({sid: why}: hung)."""
        ranks = [self.offsets[c.base_url] + i for c in live.values()
                 for i in range(self.workers[c.base_url])]
        receive = [asyncio.ensure_future(c.update_weights(generation=generation,
                                                          version=version))
                   for c in live.values()]
        sent = await asyncio.gather(*(self.agents[n].post("/cmd/wsync_send", {
            "generation": generation, "targets": ranks}, timeout_s=None)
            for n in self.world.members), return_exceptions=True)
        limit = self.job.cfg.rollout.weight_sync_timeout_s
        if receive:
            await asyncio.wait(receive, timeout=limit)
        silent = {}
        for sid, fut in zip(live, receive):
            if not fut.done():
                fut.cancel()
                silent[sid] = f"no answer {limit:g} s after every rank had sent"
        got = await asyncio.gather(*receive, return_exceptions=True)
        return [TimeoutError(silent[sid]) if sid in silent else r
                for sid, r in zip(live, got)], sent, silent

    def _verdicts(self, sent: list, targets: Targets) -> tuple[dict, dict]:
        """Targets the senders found dead (connection lost) or hung (timed out)."""
        by_rank = {self.offsets[c.base_url]: sid for sid, c in targets.items()}
        dead, hung = {}, {}
        for res in sent:
            for r in res.get("ranks", []) if isinstance(res, dict) else []:
                for rank, why in (r.get("failed_targets") or {}).items():
                    if (sid := _owner(by_rank, int(rank))) is not None:
                        dead.setdefault(sid, why)
                t = r.get("timed_out_target")
                if t is not None and (sid := _owner(by_rank, int(t))) is not None:
                    hung.setdefault(sid, r.get("error", "timed out"))
        return dead, hung

    def _event(self, version, generation, t0, why, attempt, done, failed, sent, **extra):
        ranks = [r for res in sent if isinstance(res, dict) for r in res.get("ranks", [])]
        self.job.rd.event(
            "weights_streamed", version=version, generation=generation, why=why,
            attempt=attempt, servers=sorted(str(s) for s in done),
            failed={str(s): w for s, w in failed.items()}, seconds=time.monotonic() - t0,
            bytes_sent=sum(int(r.get("bytes", 0)) for r in ranks),
            send_s=max((float(r.get("seconds", 0)) for r in ranks), default=0.0),
            peak_growth_bytes=[int(r.get("peak_growth_bytes", 0)) for r in ranks],
            **extra)

    # -- entry points ---------------------------------------------------------------------
    def _still_pending(self) -> Targets:
        """Pending servers that are still the ones their cell serves with."""
        job = self.job
        out = {sid: c for sid, c in self.pending.items()
               if job.engine_clients.get(sid.cell, {}).get(sid) is c}
        self.pending = {}
        return out

    async def publish(self, version: int) -> dict:
        """After an optimizer step (world lock held): every serving server, and any
        left pending by a broken round."""
        targets = {**self._still_pending(), **self.serving()}
        return await self.round(targets, version, why="publish") if targets else {}

    async def resync_pending(self) -> dict:
        """Servers a broken round left half-loaded (world lock held, a world stands)."""
        targets = self._still_pending()
        if not targets:
            return {}
        return await self.round(targets, self.job.book.version, why="resync")

    async def bring_up(self, targets: Targets) -> tuple[int, dict]:
        """Late joiners: the current policy, from the training world (or one stood up
        for it). Takes the world lock; returns the version sent and the outcome."""
        async with self.world.lock:
            version = self.job.book.version
            async with source_world(self.job, self.world):
                return version, await self.round(targets, version, why="join")

    def drain_failed(self, outcome: dict) -> list[tuple[ServerId, str]]:
        """The failed servers of a round that serve: out of the gateway's routing (a
        half-loaded model must not serve); (sid, why) for the caller to restart."""
        out = []
        for sid, why in outcome.items():
            if why and str(sid) in self.gateway.server_load():
                self.gateway.drain_server(str(sid))
                out.append((sid, why))
        return out


@contextlib.asynccontextmanager
async def source_world(job: JobState, world: TrainWorld):
    """The training world, or, when none stands, one built on a whole replica's nodes
    from the trainer state the next world would load (and dissolved after)."""
    if world.members:
        yield
        return
    before = list(world.nodes)  # training nodes short of a whole replica wait there
    bad = {n for c in job.table.cells if c.role is Role.FAILED
           for n in job.nodes_of(c.cell_id)} | job.lost
    live = before + [n for n in range(job.cfg.cluster.num_nodes)
                     if n not in bad and n not in before]
    nodes = live[:job.cfg.replica_nodes]
    if len(nodes) < job.cfg.replica_nodes:
        raise RuntimeError(f"no training world stands and {len(live)} live nodes cannot "
                           f"hold a replica of {job.cfg.replica_nodes} nodes to send the "
                           "weights from")
    t0 = time.monotonic()
    await world.rebuild(nodes)
    job.rd.event("wsync_source_world", nodes=nodes, generation=world.generation,
                 seconds=time.monotonic() - t0)
    try:
        yield
    finally:
        await world.rebuild(before)


def _owner(by_rank: dict, rank: int):
    """The server whose workers include transfer rank `rank`."""
    starts = sorted(r for r in by_rank if r <= rank)
    return by_rank[starts[-1]] if starts else None


def _host(url: str) -> str:
    return url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]
