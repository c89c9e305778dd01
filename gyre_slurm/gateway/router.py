"""Which rollout server serves which run: affinity, draining, waiting for a server.

Rules:
- A run keeps the server it was given (its prefix cache lives there) until that server
  drains or is removed; then its NEXT call goes to another server (migration). How a
  draining server's runs leave is the drain's `runs`: "move" (a fault: at the next
  call, to any server), "free" (the `migrate` drain of a move to training: at the next
  call when a server has a free slot, else the run stays and tries again at its next
  call, as the simulator has it: a migrating run never overfills a server) or "keep"
  (the `wait` drain: the runs it holds keep calling it until they end). Until session
  39 every drain moved its runs at their next call to any server, so a many-turn run on
  a `wait`-drained cell paid a re-prefill elsewhere while the cell waited for it, and a
  `migrate` drain could overfill the servers that stayed.
- A new (or migrating) run goes to the non-draining server with the fewest runs, ties
  to the lowest id; a server holding `capacity` runs or more gets one only when every
  server does.
- With no non-draining server, a call waits (the coordinator may add one) up to
  `wait_s`, then `NoServer`.
- A `suspect` server (a call to it just failed with no answer: refused, reset, timed
  out) is routed to like a draining one until `trust` (its next good health check)
  or its removal: runs must not pile onto a dead server, whose empty slots make it
  look like the least loaded one, while its health check takes a few seconds.
- `reopen` a draining server whose drain was cancelled: it takes runs again.
- `remove` only a draining server with no call in flight; its runs lose their affinity.
- External runs (`external=True`: runs the coordinator did not start, see
  `gateway.runs`) are routed the same way and count for placement while they live,
  but are reported apart (`load()["external"]`): the scheduler's run counts and the
  `wait` drain see only the job's runs, so an external client can neither inflate a
  cell's load nor hold a drain.
All methods run on the event loop thread (no locks needed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


LEAVE = {"move": "move at their next call", "free": "move at their next call to a free slot",
         "keep": "stay until they end"}


class NoServer(RuntimeError):
    """No rollout server became available in time."""


@dataclass
class ServerState:
    server_id: str
    client: Any  # an EngineClient
    capacity: int
    draining: bool = False
    leave: str = "move"  # draining: how its runs leave (Router.drain's `runs`)
    suspect: bool = False  # takes no runs until trusted again
    runs: set[str] = field(default_factory=set)
    external: set[str] = field(default_factory=set)
    in_flight: int = 0
    answered_at: float | None = None  # time.monotonic() of its last good generation
    added_at: float = field(default_factory=time.monotonic)

    def holding(self) -> int:
        return len(self.runs) + len(self.external)

    def runs_of(self, external: bool) -> set[str]:
        return self.external if external else self.runs


class Router:
    def __init__(self) -> None:
        self.servers: dict[str, ServerState] = {}
        self.affinity: dict[str, str] = {}  # run_id -> server_id
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def add(self, server_id: str, client: Any, capacity: int) -> None:
        if server_id in self.servers:
            raise ValueError(f"server {server_id!r} is already routed to")
        if capacity < 1:
            raise ValueError(f"server {server_id!r}: capacity must be >= 1, got {capacity}")
        self.servers[server_id] = ServerState(server_id, client, capacity)
        log.info("server %s added (capacity %d)", server_id, capacity)
        self._notify()

    def drain(self, server_id: str, *, runs: str = "move") -> None:
        """No new runs for the server; its runs leave at their next call ("move"), at
        their next call once a server has a free slot ("free"), or when they end
        ("keep"). Draining again with "move" (a fault) moves them."""
        if runs not in LEAVE:
            raise ValueError(f"runs must be one of {sorted(LEAVE)}, got {runs!r}")
        state = self._get(server_id)
        state.draining, state.leave = True, runs
        log.info("server %s draining (%d runs %s)", server_id, len(state.runs), LEAVE[runs])

    def free_slots(self) -> int:
        """Free slots of the servers that take runs (not draining, not suspect)."""
        return sum(max(0, s.capacity - s.holding()) for s in self.servers.values()
                   if not (s.draining or s.suspect))

    def reopen(self, server_id: str) -> None:
        """A draining server takes runs again (its cell's drain was cancelled); the runs
        that have not moved yet keep their affinity to it."""
        state = self._get(server_id)
        state.draining, state.leave = False, "move"
        log.info("server %s open again (drain cancelled)", server_id)
        self._notify()

    def suspect(self, server_id: str) -> None:
        state = self.servers.get(server_id)
        if state is not None and not state.suspect:
            state.suspect = True
            log.warning("server %s suspect: no new runs until it answers its health check",
                        server_id)

    def answered(self, server_id: str) -> None:
        """The server just answered a generation: it is alive, however slowly its health
        endpoint answers (a loaded node)."""
        state = self.servers.get(server_id)
        if state is not None:
            state.answered_at = time.monotonic()

    def answered_within(self, server_id: str, seconds: float, *, new_grace_s: float = 0.0
                        ) -> bool:
        """Whether the server answered a generation in the last `seconds`; one that has
        answered none yet counts as answering for `new_grace_s` after it was added (its
        first calls are the slowest)."""
        state = self.servers.get(server_id)
        if state is None:
            return False
        if state.answered_at is None:
            return time.monotonic() - state.added_at <= new_grace_s
        return time.monotonic() - state.answered_at <= seconds

    def trust(self, server_id: str) -> None:
        state = self.servers.get(server_id)
        if state is not None and state.suspect:
            state.suspect = False
            log.info("server %s trusted again", server_id)
            self._notify()

    def remove(self, server_id: str) -> None:
        state = self._get(server_id)
        if not state.draining:
            raise RuntimeError(f"server {server_id!r} is not drained: drain_server first")
        if state.in_flight:
            raise RuntimeError(f"server {server_id!r} has {state.in_flight} calls in "
                               "flight: remove it once they are done")
        for run_id in state.runs | state.external:
            self.affinity.pop(run_id, None)
        del self.servers[server_id]
        log.info("server %s removed (%d runs move at their next call)", server_id,
                 len(state.runs | state.external))

    def end_run(self, run_id: str) -> None:
        server_id = self.affinity.pop(run_id, None)
        if server_id is not None and server_id in self.servers:
            self.servers[server_id].runs.discard(run_id)
            self.servers[server_id].external.discard(run_id)

    def load(self) -> dict[str, dict[str, Any]]:
        return {sid: {"runs": len(s.runs), "external": len(s.external),
                      "in_flight": s.in_flight, "draining": s.draining, "suspect": s.suspect}
                for sid, s in sorted(self.servers.items())}

    def _get(self, server_id: str) -> ServerState:
        try:
            return self.servers[server_id]
        except KeyError:
            raise KeyError(f"no server {server_id!r} (known: {sorted(self.servers)})") from None

    def _pick(self, run_id: str, external: bool) -> ServerState | None:
        current = self.servers.get(self.affinity.get(run_id, ""))
        held = current is not None and not current.suspect
        if held and (not current.draining or current.leave == "keep"):
            return current
        open_ = [s for s in self.servers.values() if not (s.draining or s.suspect)]
        best = min(open_, key=lambda s: (s.holding() >= s.capacity, s.holding(), s.server_id),
                   default=None)
        if held and current.leave == "free" and (best is None
                                                 or best.holding() >= best.capacity):
            return current  # no free slot: it stays, and tries again at its next call
        if best is None:
            return None
        if current is not None:
            current.runs_of(external).discard(run_id)
            log.info("run %s migrates from server %s to %s", run_id,
                     current.server_id, best.server_id)
        best.runs_of(external).add(run_id)
        self.affinity[run_id] = best.server_id
        return best

    async def acquire(self, run_id: str, *, wait_s: float, num: int = 1,
                      external: bool = False) -> ServerState:
        """The run's server, with `num` more calls in flight (`release` them after)."""
        deadline = time.monotonic() + wait_s
        while (state := self._pick(run_id, external)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoServer(f"no rollout server available for run {run_id!r} after "
                               f"waiting {wait_s:g} s")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        state.in_flight += num
        return state

    def release(self, state: ServerState, num: int = 1) -> None:
        state.in_flight -= num
