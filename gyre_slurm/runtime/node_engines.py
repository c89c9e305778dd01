"""A node's rollout servers and the engine commands that change them (node agent side).

The node agent (`runtime.agent`) owns `servers_per_node` engine processes, kept across
handoffs. The coordinator changes them with five commands: start (or resume), release,
restart one server, kill all, shut down. Each takes seconds to minutes (a vLLM-CPU
server starts in 30-100 s), and several may be sent at once (a health check's restart,
a handoff, the job's end), so:

- **One command at a time.** Every command takes the node's engine lock, in arrival
  order, so no command sees another's half-done change.
- **A restart names what it replaces.** `restart(server, base_url=...)` replaces that
  server only while it is still the one the coordinator means (same index, same
  address); else it answers `{"restarted": False, "reason": ...}` (already replaced;
  killed with the node's engines; superseded by a kill), never an error.
- **Kill and shutdown come first.** A kill stops every restart sent before it (one
  starting now has its new process killed at once; one waiting for the lock gives up)
  and then kills the servers. A shutdown also cancels a start under way, refuses every
  later command (`EnginesClosed`), and stops every server: no engine process is left
  behind, however the commands interleaved.
- **All or nothing.** A start of several servers that fails for one stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

from gyre_slurm.engines.client import EngineError

log = logging.getLogger(__name__)


class EnginesClosed(RuntimeError):
    """The node agent is shutting down: no engine command runs any more."""


class BadEngineCommand(ValueError):
    """A command that names a server this node can never run (a client mistake)."""


class StartCancelled(EngineError):
    """A start was cancelled by a kill or a shutdown; its processes are gone."""


@dataclass(eq=False)
class Server:
    proc: Any  # launcher.EngineProcess or vllm.VllmProcess
    client: Any  # its EngineClient

    @property
    def base_url(self) -> str:
        return self.proc.base_url


def kill_engine(proc) -> int:
    """SIGKILL an engine (works on a stopped process, unlike SIGTERM: a vLLM server's
    whole process group) and reap it; the exit code."""
    if hasattr(proc, "pids"):  # vLLM: a supervisor leading its own process group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif proc.popen.poll() is None:
        proc.popen.kill()
    return proc.popen.wait(30)


class NodeEngines:
    """`start_one(k, version, cancel)` starts server k (blocking, in a thread; it stops
    its process and raises when the threading.Event `cancel` is set); `make_client(proc)`
    makes its client."""

    def __init__(self, *, node_index: int, count: int,
                 start_one: Callable[[int, int, threading.Event], Any],
                 make_client: Callable[[Any], Any], handoff_timeout_s: float):
        self.node_index, self.count = node_index, count
        self._start_one, self._make_client = start_one, make_client
        self.handoff_timeout_s = handoff_timeout_s
        self.servers: list[Server] = []
        self.closed = False
        self._lock = asyncio.Lock()
        self._killed = asyncio.Event()  # set by the next kill or shutdown (then replaced)
        self._why_killed = ""
        self._starts: dict[threading.Event, bool] = {}  # a start under way -> a restart's?

    @property
    def base_urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    # -- the commands -------------------------------------------------------------------
    async def start(self, *, version: int, weights_path: str,
                    stream: bool = False) -> tuple[str | None, int | None, bool]:
        """Resume the servers at `version` (killed and started anew if they do not answer
        in time: the reason is returned), or start them. `stream` (streamed weight
        sync): resumed servers only wake, their policy comes by stream. Returns the
        reason they were replaced (or None), the version their weights hold (None:
        woken, whatever they held) and whether new processes were started."""
        async with self._turn():
            replaced, held = None, version
            if self.servers and stream:
                replaced = await self._within_timeout("wake", [
                    s.client.wake() for s in self.servers])
                held = None
            elif self.servers:
                replaced = await self._within_timeout("resume", [
                    s.client.resume(weights_path, version) for s in self.servers])
            spawned = not self.servers
            if spawned:
                self.servers = await self._spawn(range(self.count), version, restart=False)
                held = version
            return replaced, held, spawned

    async def release(self, *, stop: bool) -> str | None:
        """Release the servers (or stop them); the reason, if they had to be killed."""
        async with self._turn():
            if stop:
                await self._stop_all()
                return None
            return await self._within_timeout("release", [
                s.client.release() for s in self.servers])

    async def restart(self, *, server: int, version: int, backoff_s: float = 0.0,
                      base_url: str | None = None) -> dict:
        """Replace `server` (crashed or hung) with a new engine at `version` after
        `backoff_s`: the module's rules."""
        if not 0 <= server < self.count:
            raise BadEngineCommand(f"node {self.node_index} runs servers 0..{self.count - 1}"
                                   f", not server {server}")
        killed = self._killed  # a kill from now on supersedes this restart
        async with self._turn():
            why = self._why_not_restart(server, base_url, killed)
            if why:
                log.warning("restart of engine s%d not done: %s", server, why)
                return {"restarted": False, "reason": why}
            old = self.servers[server]
            await old.client.close()
            exit_code = await asyncio.to_thread(kill_engine, old.proc)
            log.warning("engine s%d (pid %d) killed for a restart (exit code %s); restarting "
                        "in %.1f s", server, old.proc.pid, exit_code, backoff_s)
            try:
                await asyncio.wait_for(killed.wait(), backoff_s)
            except asyncio.TimeoutError:
                pass
            try:
                if killed.is_set():
                    raise StartCancelled(self._why_killed)
                (new,) = await self._spawn([server], version, restart=True)
            except StartCancelled as exc:
                return {"restarted": False, "exit_code": exit_code,
                        "reason": f"cancelled: the node's engines were killed ({exc})"}
            self.servers[server] = new
            return {"restarted": True, "base_url": new.base_url, "pid": new.proc.pid,
                    "exit_code": exit_code}

    async def kill(self, *, reason: str) -> list[int]:
        """Kill every server (hung or dead) and every restart sent before; the exit
        codes. The next start starts new servers."""
        self._preempt(reason, everything=False)
        async with self._turn():
            return await self._kill_all(reason)

    async def shutdown(self) -> None:
        """Cancel whatever is under way, refuse what comes next, stop every server."""
        self.closed = True
        self._preempt("the node agent is shutting down", everything=True)
        async with self._lock:
            await self._stop_all()

    # -- under the lock -----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _turn(self):
        """The engine lock, refused once the node shuts down."""
        if self.closed:
            raise EnginesClosed("the node agent is shutting down")
        async with self._lock:
            if self.closed:
                raise EnginesClosed("the node agent is shutting down")
            yield

    def _why_not_restart(self, server: int, base_url: str | None,
                         killed: asyncio.Event) -> str | None:
        if killed.is_set():
            return f"cancelled: the node's engines were killed ({self._why_killed})"
        if server >= len(self.servers):
            return (f"node {self.node_index} has no engine server {server} now (its "
                    f"engines were killed or stopped): nothing to restart")
        current = self.servers[server].base_url
        if base_url is not None and current != base_url:
            return (f"server {server} was already replaced: it serves at {current} now, "
                    f"not {base_url}")
        return None

    def _preempt(self, reason: str, *, everything: bool) -> None:
        self._why_killed = reason
        self._killed.set()
        self._killed = asyncio.Event()
        for cancel, is_restart in self._starts.items():
            if everything or is_restart:
                cancel.set()

    async def _spawn(self, ks, version: int, *, restart: bool) -> list[Server]:
        """Start servers `ks`, all or none: a failure or a cancellation (`StartCancelled`)
        kills every process this start made, and so does our own cancellation."""
        cancel = threading.Event()
        self._starts[cancel] = restart
        futs = [asyncio.ensure_future(asyncio.to_thread(self._start_one, k, version, cancel))
                for k in ks]
        try:
            results = await asyncio.shield(asyncio.gather(*futs, return_exceptions=True))
        except asyncio.CancelledError:
            cancel.set()
            results = await asyncio.gather(*futs, return_exceptions=True)
            await _kill_all_procs([r for r in results if not isinstance(r, BaseException)])
            raise
        finally:
            self._starts.pop(cancel, None)
        procs = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors or cancel.is_set():
            await _kill_all_procs(procs)
            if cancel.is_set():
                raise StartCancelled(self._why_killed)
            raise errors[0]
        return [Server(p, self._make_client(p)) for p in procs]

    async def _within_timeout(self, what: str, calls) -> str | None:
        """Await the servers' `calls`; None when all answered in time, else why not —
        and then every server is killed (a hung or dead engine must not hold a handoff;
        the cell's next rollout starts new ones)."""
        limit = self.handoff_timeout_s
        try:
            await asyncio.wait_for(asyncio.gather(*calls), limit)
            return None
        except asyncio.TimeoutError:
            why = f"{what} got no answer within {limit:g} s (faults.engine_handoff_timeout_s)"
        except (EngineError, OSError) as exc:
            why = f"{what} failed: {type(exc).__name__}: {exc}"
        await self._kill_all(f"engine {why}")
        return why

    async def _kill_all(self, reason: str) -> list[int]:
        servers, self.servers = self.servers, []
        for s in servers:
            await s.client.close()
        codes = await _kill_all_procs([s.proc for s in servers])
        log.warning("%s: killed %d engine(s) (exit codes %s)", reason, len(servers), codes)
        return codes

    async def _stop_all(self) -> None:
        servers, self.servers = self.servers, []
        for s in servers:
            await s.client.close()
        await asyncio.gather(*(asyncio.to_thread(s.proc.stop, 10.0) for s in servers))


async def _kill_all_procs(procs: list) -> list[int]:
    return list(await asyncio.gather(*(asyncio.to_thread(kill_engine, p) for p in procs)))
