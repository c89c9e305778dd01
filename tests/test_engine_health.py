"""The coordinator's engine watchdog tells a slow engine from a hung one.

A health check that times out is a strike, unless the server answered a generation
within the strikes' span and no call to it failed: a loaded node's engine answers its
calls late but answers them (a loaded CI machine restarted a healthy vLLM server every
25 s, three times, until the run missed its deadline); nor while a new server has
answered nothing yet, within `faults.engine_start_grace_s`. A refused or reset
connection, a bad status, or silence with no generation answered stay strikes, so a
dead or hung engine is still restarted. Real HTTP on loopback: a server whose /health answers late,
a closed port; the gateway's real router.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from gyre_slurm.engines import EngineClient
from gyre_slurm.engines.client import EngineError
from gyre_slurm.gateway.router import Router
from gyre_slurm.runtime.recovery import _timed_out, health_verdict

HOST = "127.0.0.1"


async def _slow_health_server(delay_s: float) -> tuple[web.AppRunner, str]:
    async def health(_req: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.json_response({"status": "ok", "policy_version": 0, "active": 0})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    return runner, f"http://{HOST}:{runner.addresses[0][1]}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_a_late_health_answer_is_a_timeout_and_a_closed_port_is_not():
    async def main():
        runner, url = await _slow_health_server(delay_s=2.0)
        late = EngineClient(url, "secret")
        dead = EngineClient(f"http://{HOST}:{_closed_port()}", "secret")
        try:
            results = await asyncio.gather(late.health(timeout_s=0.3), dead.health(timeout_s=2),
                                           late.health(timeout_s=5), return_exceptions=True)
        finally:
            await late.close()
            await dead.close()
            await runner.cleanup()
        return results
    timed_out, refused, answered = asyncio.run(main())
    assert isinstance(timed_out, EngineError) and _timed_out(timed_out), timed_out
    assert isinstance(refused, EngineError) and not _timed_out(refused), refused
    assert answered["status"] == "ok" and not _timed_out(answered)


def test_the_router_remembers_when_each_server_last_answered():
    async def main():
        router = Router()
        router.add("s0", client=None, capacity=4)
        router.add("s1", client=None, capacity=4)
        assert not router.answered_within("s0", 60)  # never answered: no credit
        # ... except in its start grace: a new server's first calls are its slowest
        assert router.answered_within("s0", 0.0, new_grace_s=60)
        await asyncio.sleep(0.3)
        assert not router.answered_within("s0", 60, new_grace_s=0.2)
        router.answered("s0")
        assert router.answered_within("s0", 60) and not router.answered_within("s1", 60)
        await asyncio.sleep(0.3)
        assert not router.answered_within("s0", 0.2) and router.answered_within("s0", 60)
        # once it has answered, the grace no longer stands in for an answer
        assert not router.answered_within("s0", 0.2, new_grace_s=3600)
        router.answered("gone")  # a server removed meanwhile: nothing to remember
        assert not router.answered_within("gone", 60)
    asyncio.run(main())


def _timeout_error() -> EngineError:
    try:
        try:
            raise asyncio.TimeoutError()
        except asyncio.TimeoutError as exc:
            raise EngineError("GET http://x/health: TimeoutError: ") from exc
    except EngineError as exc:
        return exc


def _refused_error() -> EngineError:
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise EngineError("GET http://x/health: ClientConnectorError") from exc
    except EngineError as exc:
        return exc


def test_the_verdict_spares_only_a_slow_engine_that_answers_generations():
    quiet = dict(syncing_ok=False, suspect=False)
    assert health_verdict({"status": "ok"}, **quiet, answered_recently=False) == (True, False)
    assert health_verdict({"status": "paused"}, **quiet, answered_recently=False) == (True, False)
    assert health_verdict({"status": "syncing"}, **quiet, answered_recently=True) == (False, False)
    assert health_verdict({"status": "syncing"}, syncing_ok=True, suspect=False,
                          answered_recently=False) == (True, False)
    assert health_verdict({"status": "released"}, **quiet, answered_recently=True) == (False, False)
    # silence: slow if it answered a generation lately and no call to it failed
    assert health_verdict(_timeout_error(), **quiet, answered_recently=True) == (True, True)
    assert health_verdict(_timeout_error(), **quiet, answered_recently=False) == (False, False)
    assert health_verdict(_timeout_error(), syncing_ok=False, suspect=True,
                          answered_recently=True) == (False, False)
    # a refused connection is a dead engine, whatever it answered before
    assert health_verdict(_refused_error(), **quiet, answered_recently=True) == (False, False)
