"""The embedded rollout engine: an aiohttp server around `sampler.Sampler`.

    python -m gyre_slurm.engines.embedded --model-dir DIR --host 127.0.10.N --port P \
        --weights WEIGHTS_DIR --version V --secret-file FILE [--ready-file F] \
        [--model-name NAME] [--log-level INFO] [--parent-pid PID]

Binds only to the given loopback address (port 0: a free one). Once serving it writes
`{"host", "port", "pid", "base_url"}` to the ready file atomically. Every request must
carry `Authorization: Bearer <secret>` (the secret file's content, stripped), else 401.
Requests and answers are JSON:

    GET  /health        -> {"status": "ok"|"released", "policy_version": V, "active": n,
                            "cancelled": generations cancelled by their client leaving}
    POST /generate      {"prompt_ids", "max_tokens", "temperature"=1.0,
                         "stop_token_ids"=[], "seed"=null}
                        -> {"output_ids", "output_logprobs", "finish_reason":
                            "stop"|"length", "policy_version"}
    POST /load_weights  {"path", "version"} -> {"policy_version"} (after the generations
                        already in flight, which finish under the old version)
    POST /release       -> {"status": "released"}  (then /generate answers 503)
    POST /resume        {"path", "version"} -> {"status": "ok", "policy_version"};
                        without "path": a model whose weights a streamed round brings
                        (status "syncing" until then) -> {"status": "syncing"}
    GET  /v1/models     -> {"object": "list", "data": [{"id": NAME, ...}]}

Streamed weight sync (gyre_slurm.train.wsync), the routes and payloads of vLLM's RL API, so
the coordinator drives both engines alike:

    POST /init_weight_transfer_engine  {"init_info": {...}} join a transfer generation
                                       (blocks until every member has joined)
    POST /start_weight_update          {}
    POST /update_weights               {"update_info": {"generation", "version"}}: the
                                       round is received on the model's worker thread,
                                       after the generations already queued (they keep
                                       the old version), before the ones queued after
    POST /finish_weight_update         {"weight_version": "N"} (checks it)
    POST /shutdown_weight_transfer_engine

A stale generation is refused with 409. While a round is under way, or after one that
failed, /health says "syncing" and /generate waits (as vLLM's, paused) until a round
has loaded a whole policy.

Errors are `{"error": message}` with 400 (bad request), 401, 409 (stale transfer
generation), 503 (released) or 500.
A client that disconnects during /generate cancels it: the sampler stops at the next
token (or drops it if still queued).
SIGTERM/SIGINT stop the server cleanly; so does the exit of `--parent-pid` (checked every
second), so that an engine never outlives the process that launched it.

For tests only: when `$GYRE_TEST_ENGINE_START_DELAY_FILE` names a file that exists, the
engine first waits the seconds it holds (a slow start, like a vLLM-CPU server's on a
loaded machine, at a moment the test chooses). When `$GYRE_TEST_ENGINE_STOP_IN_UPDATE_FILE`
names a file that exists as a streamed round begins, the first engine to take that file
(a rename) stops itself (SIGSTOP: a server hung in a weight sync).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre_slurm.common import fsio
from gyre_slurm.common.values import is_int
from gyre_slurm.common.web import auth_middleware
from gyre_slurm.engines.sampler import BadRequest, Released, Sampler, parse_generate
from gyre_slurm.errors import UserError
from gyre_slurm.train.dist import StaleGeneration

log = logging.getLogger(__name__)
START_DELAY_ENV = "GYRE_TEST_ENGINE_START_DELAY_FILE"
STOP_IN_UPDATE_ENV = "GYRE_TEST_ENGINE_STOP_IN_UPDATE_FILE"

MAX_BODY_BYTES = 8 << 20
SAMPLER = web.AppKey("sampler", Sampler)
STATE = web.AppKey("state", dict)


def check_loopback(host: str) -> None:
    """Servers bind to one node's own address, never to every interface: a wildcard
    (0.0.0.0, ::) or a name is refused. On one machine (tests, the local launcher) that
    address is loopback (127.x.y.z); on a cluster it is the node's address, and the run's
    secret is what keeps others out."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is None or addr.is_unspecified or addr.is_multicast:
        raise UserError(f"host {host!r}: a server binds to one node's own IP address "
                        "(127.x.y.z on one machine), not a name or a wildcard")


def read_secret(path: str | Path) -> str:
    path = Path(path)
    secret = path.read_text().strip()
    if not secret:
        raise UserError(f"{path}: the secret file is empty")
    if path.stat().st_mode & 0o077:
        log.warning("%s: secret file is readable by others (chmod 600 it)", path)
    return secret


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    """Engine errors as JSON with their status (the secret is checked before this)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        raise
    except BadRequest as exc:
        return _error(400, str(exc))
    except Released as exc:
        return _error(503, str(exc))
    except StaleGeneration as exc:
        return _error(409, str(exc))
    except Exception as exc:  # noqa: BLE001 - the server keeps serving
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


async def _json(request: web.Request) -> Any:
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.web_protocol import RequestPayloadError

    try:
        return await request.json()
    except ValueError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. gzip that is not
        raise BadRequest(f"the body cannot be read: {str(exc).strip()}") from None


def _path_version(body: Any) -> tuple[Path, int]:
    if not isinstance(body, dict) or "path" not in body or "version" not in body:
        raise BadRequest("body must be {\"path\": WEIGHTS_DIR, \"version\": V}")
    version = body["version"]
    if not is_int(version) or version < 0:
        raise BadRequest(f"version must be an integer >= 0, got {version!r}")
    return Path(str(body["path"])), version


async def health(request: web.Request) -> web.Response:
    sampler, state = request.app[SAMPLER], request.app[STATE]
    return web.json_response({"status": sampler.status,
                              "policy_version": sampler.version,
                              "active": state["active"], "cancelled": state["cancelled"]})


async def generate(request: web.Request) -> web.Response:
    sampler, state = request.app[SAMPLER], request.app[STATE]
    req = parse_generate(await _json(request), vocab_size=sampler.vocab_size,
                         max_positions=sampler.max_positions)
    if not sampler.loaded:
        raise Released("the model is released; POST /resume first")
    state["active"] += 1
    try:
        while sampler.status == "syncing":  # as vLLM paused: wait for a whole policy
            await asyncio.sleep(0.05)
        cancel = threading.Event()
        job = sampler.generate(req, cancel)
        try:
            return web.json_response(await asyncio.wrap_future(job))
        except asyncio.CancelledError:  # the client left (handler_cancellation)
            cancel.set()
            job.cancel()
            state["cancelled"] += 1
            raise
    finally:
        state["active"] -= 1


async def load_weights(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER]
    path, version = _path_version(await _json(request))
    await asyncio.wrap_future(sampler.load(path, version))
    return web.json_response({"policy_version": version})


async def release(request: web.Request) -> web.Response:
    await asyncio.wrap_future(request.app[SAMPLER].release())
    return web.json_response({"status": "released"})


async def resume(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER]
    body = await _json(request)
    if isinstance(body, dict) and body.get("path") is None and "version" not in body:
        await asyncio.wrap_future(sampler.fresh())
        return web.json_response({"status": sampler.status})
    path, version = _path_version(body)
    await asyncio.wrap_future(sampler.load(path, version))
    return web.json_response({"status": "ok", "policy_version": version})


def _payload(body: Any, key: str) -> dict:
    if not isinstance(body, dict) or not isinstance(body.get(key), dict):
        raise BadRequest(f"body must be {{\"{key}\": {{...}}}}")
    return body[key]


async def init_transfer(request: web.Request) -> web.Response:
    info = _payload(await _json(request), "init_info")
    state = request.app[STATE]
    try:
        rank = int(info["rank_offset"])
        out = await asyncio.to_thread(state["wsync"].join, info, rank=rank,
                                      host=state["host"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"bad init_info: {type(exc).__name__}: {exc}") from None
    return web.json_response(out)


async def start_update(request: web.Request) -> web.Response:
    return web.json_response({"message": "Weight update started"})


async def update_weights(request: web.Request) -> web.Response:
    info = _payload(await _json(request), "update_info")
    generation, version = info.get("generation"), info.get("version")
    if not isinstance(generation, int) or not isinstance(version, int) or version < 0:
        raise BadRequest("update_info must be {\"generation\": N, \"version\": V >= 0}")
    sampler, state = request.app[SAMPLER], request.app[STATE]
    _test_stop_in_update()
    stats = await asyncio.wrap_future(sampler.stream_update(state["wsync"], generation,
                                                            version))
    return web.json_response(stats)


async def finish_update(request: web.Request) -> web.Response:
    body = await _json(request)
    label = body.get("weight_version") if isinstance(body, dict) else None
    sampler = request.app[SAMPLER]
    if label is not None and str(sampler.version) != str(label):
        raise BadRequest(f"weight_version {label!r}, but the model holds version "
                         f"{sampler.version}")
    return web.json_response({"message": "Weight update finished"})


async def shutdown_transfer(request: web.Request) -> web.Response:
    await asyncio.to_thread(request.app[STATE]["wsync"].leave)
    return web.json_response({"message": "Weight transfer shut down"})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state["model_name"], "object": "model", "created": state["created"],
        "owned_by": "gyre"}]})


def make_app(sampler: Sampler, *, secret: str, model_name: str,
             host: str | None = None) -> web.Application:
    from gyre_slurm.train.wsync.endpoint import Endpoint

    app = web.Application(middlewares=[auth_middleware(secret), _errors_middleware],
                          client_max_size=MAX_BODY_BYTES)
    app[SAMPLER] = sampler
    app[STATE] = {"active": 0, "cancelled": 0, "model_name": model_name,
                  "created": int(time.time()), "wsync": Endpoint(), "host": host}
    app.add_routes([web.get("/health", health), web.post("/generate", generate),
                    web.post("/load_weights", load_weights), web.post("/release", release),
                    web.post("/resume", resume), web.get("/v1/models", models),
                    web.post("/init_weight_transfer_engine", init_transfer),
                    web.post("/start_weight_update", start_update),
                    web.post("/update_weights", update_weights),
                    web.post("/finish_weight_update", finish_update),
                    web.post("/shutdown_weight_transfer_engine", shutdown_transfer)])
    return app


def _test_stop_in_update() -> None:
    path = os.environ.get(STOP_IN_UPDATE_ENV)
    if not path:
        return
    try:
        os.rename(path, f"{path}.taken-{os.getpid()}")  # one engine takes it
    except OSError:
        return
    log.warning("stopping in a weight update for a test (%s)", path)
    os.kill(os.getpid(), signal.SIGSTOP)


async def _test_start_delay() -> None:
    path = os.environ.get(START_DELAY_ENV)
    try:
        delay_s = float(Path(path).read_text()) if path else 0.0
    except (OSError, ValueError):
        return
    if delay_s > 0:
        log.warning("slow start for a test: waiting %.1f s (%s)", delay_s, path)
        await asyncio.sleep(delay_s)


async def serve(args: argparse.Namespace) -> None:
    check_loopback(args.host)
    secret = read_secret(args.secret_file)
    await _test_start_delay()
    sampler = Sampler(args.model_dir)
    await asyncio.wrap_future(sampler.load(Path(args.weights), args.version))
    app = make_app(sampler, secret=secret, model_name=args.model_name, host=args.host)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    info = {"host": args.host, "port": port, "pid": os.getpid(),
            "base_url": f"http://{args.host}:{port}"}
    if args.ready_file:
        fsio.write_json_atomic(args.ready_file, info)
    log.info("engine serving at %s (policy version %d)", info["base_url"], args.version)
    watch = asyncio.create_task(_watch_parent(args.parent_pid, stop)) if args.parent_pid \
        else None
    try:
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        log.info("engine stopping")
        await runner.cleanup()
        app[STATE]["wsync"].leave()
        sampler.close()


async def _watch_parent(pid: int, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent pid %d is gone: stopping", pid)
            stop.set()
            return
        except PermissionError:
            pass  # alive, someone else's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre_slurm.engines.embedded",
                                description="Embedded rollout engine (tiny local model).")
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--host", required=True, help="loopback address to bind (127.x.y.z)")
    p.add_argument("--port", type=int, default=0, help="0: pick a free port")
    p.add_argument("--weights", required=True, type=Path, help="weights dir of --version")
    p.add_argument("--version", required=True, type=int, help="policy version of --weights")
    p.add_argument("--secret-file", required=True, type=Path)
    p.add_argument("--ready-file", type=Path, help="written (JSON) once serving")
    p.add_argument("--model-name", default="gyre-policy")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--parent-pid", type=int, help="stop when this process is gone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except UserError as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    from gyre_slurm.common.fastexit import exit_now

    exit_now(main())
