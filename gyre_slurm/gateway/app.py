"""The `Gateway` class: the aiohttp app, auth, errors, and one model call end to end.

A call: parse -> prompt token ids -> `Router.acquire` (maybe wait for a server) ->
`EngineClient.generate` -> append the call record to the call store -> answer.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from gyre_slurm.engines.client import EngineClient, EngineError
from gyre_slurm.engines.embedded import check_loopback
from gyre_slurm.gateway import openai
from gyre_slurm.gateway.router import NoServer, Router
from gyre_slurm.models import tiny

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
RUN_ID = re.compile(r"^[A-Za-z0-9_.:@+-]{1,200}$")


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Gateway:
    """OpenAI-compatible front of the rollout servers (see the package docstring)."""

    def __init__(self, *, model_dir: Path, call_writer, api_key: str,
                 model_name: str = "gyre-policy", default_max_tokens: int = 64,
                 wait_for_server_s: float = 60.0):
        if not api_key:
            raise ValueError("the gateway needs a non-empty api_key")
        self.tokenizer = tiny.load_tokenizer(model_dir)
        self.vocab_size = len(self.tokenizer)
        stop = {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}
        self.stop_token_ids = sorted(int(t) for t in stop if t is not None)
        self.call_writer = call_writer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.wait_for_server_s = wait_for_server_s
        self.router = Router()
        self._expected_auth = f"Bearer {api_key}".encode()
        self._calls: dict[str, int] = {}
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None

    # -- control by the coordinator (same event loop) --------------------------------
    def add_server(self, server_id: str, client: EngineClient, capacity: int) -> None:
        self.router.add(server_id, client, capacity)

    def drain_server(self, server_id: str) -> None:
        self.router.drain(server_id)

    def remove_server(self, server_id: str) -> None:
        self.router.remove(server_id)

    def server_load(self) -> dict[str, dict[str, Any]]:
        return self.router.load()

    def end_run(self, run_id: str) -> None:
        self.router.end_run(run_id)
        self.call_writer.forget(run_id)

    def calls_of(self, run_id: str) -> int:
        return self._calls.get(run_id, 0)

    async def start(self, host: str, port: int) -> int:
        check_loopback(host)
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/runs/{run_id}/v1/chat/completions", self._chat),
            web.post("/runs/{run_id}/v1/completions", self._completions),
            web.get("/runs/{run_id}/v1/models", self._models),
            web.get("/v1/models", self._models)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        log.info("gateway serving at http://%s:%d/runs/<run_id>/v1", host, bound)
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- HTTP -------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        try:
            if not hmac.compare_digest(got, self._expected_auth):
                raise HttpError(401, "missing or wrong API key ('Authorization: Bearer "
                                "<key>')", "authentication_error")
            return await handler(request)
        except HttpError as exc:
            status, message, kind = exc.status, exc.message, exc.kind
        except web.HTTPException as exc:
            status, kind = exc.status, "invalid_request_error"
            message = (f"request body over {MAX_BODY_BYTES} bytes" if exc.status == 413
                       else f"{request.method} {request.path}: {exc.reason}")
        except Exception as exc:  # noqa: BLE001 - the gateway keeps serving
            log.exception("%s %s failed", request.method, request.path)
            status, message, kind = 500, f"{type(exc).__name__}: {exc}", "server_error"
        return web.json_response(openai.error_body(message, kind=kind, code=status),
                                 status=status)

    async def _body(self, request: web.Request) -> tuple[str, dict[str, Any]]:
        run_id = request.match_info["run_id"]
        if not RUN_ID.match(run_id):
            raise HttpError(400, f"run id {run_id!r}: use 1-200 of A-Z a-z 0-9 _ . : @ + -")
        try:
            body = await request.json()
        except ValueError as exc:
            raise HttpError(400, f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "body must be a JSON object")
        return run_id, body

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(openai.models_response(self.model_name, self._created))

    async def _chat(self, request: web.Request) -> web.Response:
        run_id, body = await self._body(request)
        try:
            sampling = openai.parse_sampling(body, default_max_tokens=self.default_max_tokens,
                                             chat=True)
            prompt_ids = tiny.chat_prompt_ids(self.tokenizer, openai.parse_messages(body))
        except openai.RequestError as exc:
            raise HttpError(400, str(exc)) from None
        result, extra = await self._call(run_id, prompt_ids, sampling)
        return web.json_response(openai.chat_response(
            tokenizer=self.tokenizer, model=self.model_name, prompt_ids=prompt_ids,
            result=result, want_logprobs=sampling.logprobs, extra=extra))

    async def _completions(self, request: web.Request) -> web.Response:
        run_id, body = await self._body(request)
        try:
            sampling = openai.parse_sampling(body, default_max_tokens=self.default_max_tokens,
                                             chat=False)
            prompt_ids = openai.parse_prompt(body, self.tokenizer, self.vocab_size)
        except openai.RequestError as exc:
            raise HttpError(400, str(exc)) from None
        result, extra = await self._call(run_id, prompt_ids, sampling)
        return web.json_response(openai.completion_response(
            tokenizer=self.tokenizer, model=self.model_name, prompt_ids=prompt_ids,
            result=result, want_logprobs=sampling.logprobs, extra=extra))

    async def _call(self, run_id: str, prompt_ids: list[int], sampling: openai.Sampling
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Generate on the run's server and record the call; (engine answer, extras)."""
        try:
            server = await self.router.acquire(run_id, wait_s=self.wait_for_server_s)
        except NoServer as exc:
            raise HttpError(503, str(exc), "server_unavailable") from None
        t_start = time.time()
        try:
            result = await server.client.generate(
                prompt_ids, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                stop_token_ids=self.stop_token_ids, seed=sampling.seed)
        except EngineError as exc:
            if exc.status == 400:
                raise HttpError(400, f"the model rejected the request: {exc}") from None
            log.warning("run %s: server %s failed: %s", run_id, server.server_id, exc)
            raise HttpError(502, f"rollout server {server.server_id!r} failed: {exc}",
                            "server_error") from None
        finally:
            self.router.release(server)
        if not _well_formed(result):
            raise HttpError(502, f"rollout server {server.server_id!r} answered a malformed "
                            f"generation: {str(result)[:200]}", "server_error")
        call = self._calls.get(run_id, 0)
        self.call_writer.append({
            "run_id": run_id, "call": call, "prompt_ids": prompt_ids,
            "output_ids": result["output_ids"], "output_logprobs": result["output_logprobs"],
            "policy_version": result["policy_version"], "t_start": t_start,
            "t_end": time.time(), "finish_reason": result["finish_reason"]})
        self._calls[run_id] = call + 1
        return result, {"run_id": run_id, "call": call, "server": server.server_id,
                        "policy_version": result["policy_version"]}


def _well_formed(result: dict[str, Any]) -> bool:
    ids, lps = result.get("output_ids"), result.get("output_logprobs")
    return (isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps)
            and isinstance(result.get("policy_version"), int)
            and result.get("finish_reason") in ("stop", "length"))
