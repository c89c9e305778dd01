"""The control channel between the coordinator and the node agents: HTTP (aiohttp).

Every request carries `Authorization: Bearer <run secret>` (the secret lives in the run
dir, mode 0600); anything else is refused with 401 before a handler runs or a body is
read. No route is left open, health included: the channel has no health route (an
agent's liveness is its authenticated heartbeat), and nothing outside the run needs to
reach it. A node agent serves `POST /cmd/<name>` on its node's own address (never a
wildcard); the coordinator serves `POST /agent/register` and `POST /agent/heartbeat`
beside the gateway.

Bodies are JSON objects, checked before a handler runs (`check_body`): 415 unless
`Content-Type: application/json`; 413 over `MAX_BODY_BYTES`; 408 when the body does not
arrive within `BODY_TIMEOUT_S` (a half-sent request); 400 for bytes that are not UTF-8,
JSON that does not parse (NaN and Infinity included) or nests too deep, strings with lone
surrogate escapes, a body that is not an object, and fields that do not fit the route: a
command's arguments are checked against the signature of the agent's `cmd_<name>` method
(names and annotated types), the coordinator's routes against `ROUTE_FIELDS`. So a
malformed request never reaches a command, and the server keeps serving. An idle
connection, or one that never finishes its request line and headers, is closed after
`IDLE_TIMEOUT_S`. Nothing is unpickled: the only decoder is `json.loads`.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from gyre_slurm.common.web import (BODY_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_BODY_BYTES, BadRequest,
                                   auth_middleware, check_arguments, fits, read_json_object,
                                   type_name)
from gyre_slurm.errors import UserError

ROUTE_FIELDS: dict[str, dict[str, type]] = {  # required fields of the coordinator's routes
    "/agent/register": {"node": int, "url": str},
    "/agent/heartbeat": {"node": int},
}


def _route_error(request: web.Request, payload: dict[str, Any]) -> str | None:
    name = request.match_info.get("name")
    owner = getattr(request.match_info.handler, "__self__", None)  # NodeAgent.handle
    command = getattr(owner, f"cmd_{name}", None) if name else None
    if command is not None:
        return check_arguments(command, payload)
    for field, tp in ROUTE_FIELDS.get(request.path, {}).items():
        if not fits(payload.get(field), tp):
            return f"field {field!r} must be {type_name(tp)}, got {payload.get(field)!r:.80}"
    return None


@web.middleware
async def check_body(request: web.Request, handler):
    """Refuse a malformed body before the handler (see the module docstring)."""
    if request.method in ("POST", "PUT", "PATCH") and request.match_info.http_exception is None:
        try:
            payload = await read_json_object(request, timeout_s=BODY_TIMEOUT_S)
            error = _route_error(request, payload)
            if error:
                raise BadRequest(400, f"{request.path}: {error}")
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return await handler(_BodyRead(request))
    return await handler(request)


class _BodyRead:
    """The request with its body read and checked: `request.json()` answers from aiohttp's
    cache, and `can_read_body` keeps saying whether there was a body to read (a handler
    that asks it, as the node agent's does, still finds its arguments)."""

    def __init__(self, request: web.Request):
        self._request = request
        self.can_read_body = request.body_exists

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)

    def __getitem__(self, key: str) -> Any:
        return self._request[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._request[key] = value


def make_app(secret: str) -> web.Application:
    return web.Application(middlewares=[auth_middleware(secret), check_body],
                           client_max_size=MAX_BODY_BYTES,
                           handler_args={"keepalive_timeout": IDLE_TIMEOUT_S})


class ControlClient:
    """Sends authenticated commands; one aiohttp session per client."""

    def __init__(self, base_url: str, secret: str, *, timeout_s: float = 600.0,
                 node: int | None = None):
        self.base_url = base_url.rstrip("/")
        self.node = node  # the node agent behind it, for error messages
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def post(self, path: str, payload: dict[str, Any] | None = None,
                   *, timeout_s: float | None = None) -> dict:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        try:
            async with self._session.post(f"{self.base_url}{path}", json=payload or {},
                                          timeout=timeout) as resp:
                body = await resp.json(content_type=None)
                if resp.status == USER_ERROR_STATUS and isinstance(body, dict):
                    where = f"node agent {self.node}" if self.node is not None \
                        else self.base_url
                    raise AgentRefused(f"{where} ({path}): {body.get('error')}")
                if resp.status != 200:
                    error = body.get("error") if isinstance(body, dict) else None
                    raise CommandError(f"{self.base_url}{path}: {resp.status} {body}",
                                       error=error if isinstance(error, str) else None)
                return body
        except aiohttp.ClientConnectionError as exc:
            raise AgentUnreachable(f"{self.base_url}{path}: unreachable ({exc})",
                                   node=self.node) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class CommandError(RuntimeError):
    """A node agent refused or failed a command; `error`: what the agent said failed
    (its answer's text, the rank's or server's traceback after it), when it said."""

    def __init__(self, message: str, *, error: str | None = None):
        super().__init__(message)
        self.error = error


USER_ERROR_STATUS = 422  # a node agent's command failed on a UserError (a file to fix)


class AgentRefused(CommandError, UserError):
    """A node agent's command failed on something the user must fix (a UserError there:
    a run dir's file missing or garbled); the message is its, and names the node.
    A CommandError to the code that retries or fails a cell, a UserError (no traceback)
    where it ends the job."""


class AgentUnreachable(CommandError):
    """The process behind a control endpoint is gone (connection refused or reset)."""

    def __init__(self, message: str, *, node: int | None = None):
        super().__init__(message)
        self.node = node
