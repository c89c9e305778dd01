"""An ASGI middleware that vLLM loads (`--middleware gyre_slurm.engines.vllm_guard.GuardAll`)
so that EVERY route of the server needs the run's secret, not only vLLM's guarded
prefixes: vLLM 0.32's `--api-key` leaves /collective_rpc, /pause, /sleep, /wake_up,
/update_weight_version, /health, /metrics, ... open to anyone who reaches the port, and
/collective_rpc calls any worker method. The secret is the server's `VLLM_API_KEY`
(the adapter puts the run's secret there). This module runs inside the vLLM process: it
imports only the standard library and starlette (a vLLM dependency).
"""

from __future__ import annotations

import hashlib
import hmac
import os


class GuardAll:
    def __init__(self, app) -> None:
        self.app = app
        secret = os.environ.get("VLLM_API_KEY", "")
        if not secret:
            raise RuntimeError("gyre's vLLM guard needs VLLM_API_KEY (the run's secret)")
        self._digest = hashlib.sha256(f"Bearer {secret}".encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan events
            return
        headers = dict(scope.get("headers") or [])
        got = hashlib.sha256(headers.get(b"authorization", b"")).digest()
        if hmac.compare_digest(got, self._digest):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        response = JSONResponse({"error": "missing or wrong bearer token (the run's secret)"},
                                status_code=401)
        await response(scope, receive, send)
