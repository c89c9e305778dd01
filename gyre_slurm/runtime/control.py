"""The control channel between the coordinator and the node agents: HTTP (aiohttp).

Every request carries `Authorization: Bearer <run secret>` (the secret lives in the run
dir, mode 0600); anything else is refused with 401 before a handler runs. Bodies are
JSON, capped in size; nothing is unpickled. A node agent serves `POST /cmd/<name>` on
its node's own address; the coordinator serves `POST /agent/register` and
`POST /agent/heartbeat` beside the gateway.
"""

from __future__ import annotations

import hmac
from typing import Any

import aiohttp
from aiohttp import web

MAX_BODY_BYTES = 1 << 20


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


def make_app(secret: str) -> web.Application:
    return web.Application(middlewares=[auth_middleware(secret)], client_max_size=MAX_BODY_BYTES)


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
