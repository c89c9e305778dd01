"""Async HTTP client of a rollout engine (the protocol of `gyre_slurm.engines.embedded`).

Every method raises `EngineError` (with the HTTP status, 0 when the engine could not be
reached or answered garbage) when the engine does not answer 200.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine call failed: `status` is the HTTP status, or 0 for no usable answer."""

    def __init__(self, message: str, *, status: int = 0, base_url: str = ""):
        super().__init__(message)
        self.status = status
        self.base_url = base_url


class EngineClient:
    """One aiohttp session to one engine; create and use it inside the event loop."""

    def __init__(self, base_url: str, secret: str, *, connect_timeout_s: float = 10.0,
                 request_timeout_s: float | None = None):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s,
                                              sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=self._timeout)
        return self._session

    async def _call(self, method: str, path: str, body: Any = None, *,
                    timeout_s: float | None = None) -> dict[str, Any]:
        url = self.base_url + path
        kw: dict[str, Any] = {} if body is None else {"json": body}
        if timeout_s is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._get_session().request(method, url, **kw) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = None
                if resp.status != 200 or not isinstance(data, dict):
                    msg = data.get("error") if isinstance(data, dict) else None
                    raise EngineError(f"{method} {url}: HTTP {resp.status}: "
                                      f"{msg or 'no JSON answer'}",
                                      status=resp.status, base_url=self.base_url)
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EngineError(f"{method} {url}: {type(exc).__name__}: {exc}",
                              base_url=self.base_url) from exc

    async def generate(self, prompt_ids: Iterable[int], *, max_tokens: int,
                       temperature: float = 1.0, stop_token_ids: Iterable[int] = (),
                       seed: int | None = None) -> dict[str, Any]:
        """{"output_ids", "output_logprobs", "finish_reason", "policy_version"}."""
        body = {"prompt_ids": [int(i) for i in prompt_ids], "max_tokens": max_tokens,
                "temperature": temperature, "stop_token_ids": [int(i) for i in stop_token_ids]}
        if seed is not None:
            body["seed"] = seed
        return await self._call("POST", "/generate", body)

    async def health(self, *, timeout_s: float | None = 5.0) -> dict[str, Any]:
        """{"status": "ok"|"released", "policy_version", "active"}."""
        return await self._call("GET", "/health", timeout_s=timeout_s)

    async def load_weights(self, path: str | Path, version: int) -> dict[str, Any]:
        return await self._call("POST", "/load_weights",
                                {"path": str(path), "version": version})

    async def release(self) -> dict[str, Any]:
        return await self._call("POST", "/release", {})

    async def resume(self, path: str | Path, version: int) -> dict[str, Any]:
        return await self._call("POST", "/resume", {"path": str(path), "version": version})

    # -- streamed weight sync (gyre_slurm.train.wsync; the routes of vLLM's RL API) ---------
    async def num_workers(self) -> int:
        """Members this server brings to a transfer group (its workers; it answers)."""
        await self.health(timeout_s=10.0)
        return 1

    async def wake(self) -> dict[str, Any]:
        """Make a released engine ready to receive a streamed policy (it serves again
        only once a round has finished)."""
        return await self._call("POST", "/resume", {})

    async def init_weight_transfer(self, init_info: dict[str, Any], *,
                                   timeout_s: float | None = None) -> dict[str, Any]:
        return await self._call("POST", "/init_weight_transfer_engine",
                                {"init_info": init_info}, timeout_s=timeout_s)

    async def begin_weight_update(self) -> None:
        await self._call("POST", "/start_weight_update", {})

    async def update_weights(self, *, generation: int, version: int) -> dict[str, Any]:
        return await self._call("POST", "/update_weights", {
            "update_info": {"generation": generation, "version": version}})

    async def finish_weight_update(self, version: int) -> dict[str, Any]:
        await self._call("POST", "/finish_weight_update", {"weight_version": str(version)})
        return {"policy_version": version}

    async def models(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/models")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
