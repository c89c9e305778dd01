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

import asyncio
import hmac
import json
import types
import typing
from typing import Any

import aiohttp
from aiohttp import web

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 75.0  # above the clients' own idle expiry (aiohttp 15 s), so no race
ROUTE_FIELDS: dict[str, dict[str, type]] = {  # required fields of the coordinator's routes
    "/agent/register": {"node": int, "url": str},
    "/agent/heartbeat": {"node": int},
}


def auth_middleware(secret: str):
    """Refuse (401) any request without `Authorization: Bearer <secret>`."""
    expected = f"Bearer {secret}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return web.json_response(
                {"error": "missing or wrong 'Authorization: Bearer <run secret>'"}, status=401)
        return await handler(request)

    return check


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_json_object(request: web.Request, *, timeout_s: float = BODY_TIMEOUT_S,
                           max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request's body as a JSON object, or `BadRequest` (415, 413, 408, 400).
    `max_bytes`: the app's `client_max_size` (for the message)."""
    if request.body_exists and request.content_type != "application/json":
        raise BadRequest(415, f"Content-Type must be application/json, got "
                              f"{request.content_type!r}")
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(408, f"the body did not arrive within {timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(413, f"body over {max_bytes} bytes") from None
    except (aiohttp.ClientError, ConnectionError) as exc:  # a truncated body
        raise BadRequest(400, f"incomplete body: {exc}") from None
    if not raw:
        return {}
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"body is not UTF-8: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, f"body must be a JSON object, got {type(body).__name__}")
    _check_text(body)
    return body


def _check_text(body: Any) -> None:
    """JSON's \\u escapes can spell a lone surrogate, which is no text: refuse it here
    rather than let it reach a tokenizer or a file."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise BadRequest(400, f"body holds a string that is not text (a lone "
                                      f"surrogate escape): {exc}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_arguments(fn, payload: dict[str, Any]) -> str | None:
    """Why `payload` cannot be `fn`'s keyword arguments (unknown or missing names, a value
    not of the annotated type), or None."""
    import inspect

    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    for name in payload:
        if name not in params:
            return f"unknown argument {name!r}; takes {', '.join(params) or 'none'}"
    for name, p in params.items():
        if name not in payload:
            if p.default is p.empty and p.kind is not p.VAR_KEYWORD:
                return f"missing argument {name!r}"
        elif name in hints and not _is(payload[name], hints[name]):
            return f"argument {name!r} must be {_show(hints[name])}, got {payload[name]!r:.80}"
    return None


def _is(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, list) and all(_is(v, args[0]) for v in value) if args \
            else isinstance(value, list)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _show(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _route_error(request: web.Request, payload: dict[str, Any]) -> str | None:
    name = request.match_info.get("name")
    owner = getattr(request.match_info.handler, "__self__", None)  # NodeAgent.handle
    command = getattr(owner, f"cmd_{name}", None) if name else None
    if command is not None:
        return check_arguments(command, payload)
    for field, tp in ROUTE_FIELDS.get(request.path, {}).items():
        if not _is(payload.get(field), tp):
            return f"field {field!r} must be {_show(tp)}, got {payload.get(field)!r:.80}"
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
                if resp.status != 200:
                    raise CommandError(f"{self.base_url}{path}: {resp.status} {body}")
                return body
        except aiohttp.ClientConnectionError as exc:
            raise AgentUnreachable(f"{self.base_url}{path}: unreachable ({exc})",
                                   node=self.node) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class CommandError(RuntimeError):
    """A node agent refused or failed a command."""


class AgentUnreachable(CommandError):
    """The process behind a control endpoint is gone (connection refused or reset)."""

    def __init__(self, message: str, *, node: int | None = None):
        super().__init__(message)
        self.node = node
