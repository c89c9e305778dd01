"""The `Gateway` class: the aiohttp app, auth, errors, and one model call end to end.

A request: parse -> render (`tools`) -> prompt token ids (`history`) -> `Router.acquire`
(maybe wait for a server) -> n x `EngineClient.generate` (concurrently) -> cut at stop
strings, parse tool calls (`text`, `tools`) -> append the call records -> remember the
turns (`history`) -> answer (JSON, or a whole event stream).

Access (`gateway.runs`): every route is a run's (`/runs/<run_id>/...`) and needs that
run's own key: `open_run` gives a run started by the coordinator a fresh key, valid on
its own URL only, revoked by `end_run`; the job secret opens nothing here, and a route
outside a run answers 401. With an `ExternalPolicy` (the config's external mode), the
external key registers and opens runs whose ids carry the external prefix; they time
out, end (`POST /runs/<id>/end`) and are freed, and their calls go to
`external_writer` (never the job's call store, so never trained). The Authorization
header is compared as raw bytes (a non-UTF-8 one is just a wrong key: 401). The
gateway binds one node's own address (a wildcard is refused). A body is read through
`common.web.read_json_object`: 415 unless JSON, 413 over `MAX_BODY_BYTES`, 408 if
it does not arrive within `body_timeout_s`, 400 for bytes that are not UTF-8 or JSON
(NaN, Infinity, deep nesting included); field checks (`gateway.openai`) answer 400, and
so does a prompt whose `max_tokens` would run past the model's context. An idle or
half-sent connection (request line and headers never finished) is closed after
`idle_timeout_s`. Nothing is unpickled: JSON only. An unexpected failure answers 500 and
the gateway keeps serving.

A client that disconnects cancels its request: the engine calls are cancelled (the
engines stop those generations) and nothing is recorded, so an answer nobody received
is never trained; likewise a call that finishes after its run ended is not recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.common.web import BODY_TIMEOUT_S, IDLE_TIMEOUT_S, BadRequest, read_json_object
from gyre_slurm.engines.client import EngineClient, EngineError
from gyre_slurm.engines.embedded import check_loopback
from gyre_slurm.errors import CommandRefused
from gyre_slurm.gateway import openai, tools
from gyre_slurm.gateway.history import Anchor, History, Served, turn_anchor
from gyre_slurm.gateway.router import NoServer, Router
from gyre_slurm.gateway.runs import ExternalPolicy, Refused, RunRegistry, RunState
from gyre_slurm.gateway.text import (
    answer_spans, content_spans, control_strings, cut_at_stop, suffix_encoder, token_pieces)
from gyre_slurm.models import tiny

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
RUN_ID = re.compile(r"^[A-Za-z0-9_.:@+-]{1,200}$")
RUN_PATH = re.compile(r"^/runs/([^/]+)/")
RUN = web.RequestKey("run", RunState)  # the run a request was admitted to


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Gateway:
    """OpenAI-compatible front of the rollout servers (see the package docstring)."""

    def __init__(self, *, model_dir: Path, call_writer, external: ExternalPolicy | None = None,
                 external_writer=None, model_name: str = "gyre-policy",
                 default_max_tokens: int | None = None, wait_for_server_s: float = 60.0,
                 history_calls_per_run: int = 16, body_timeout_s: float = BODY_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S):
        """`default_max_tokens`: for a request that names none, at most this many (None:
        the room left in the model's context, as OpenAI and vLLM do)."""
        self.tokenizer = tiny.load_tokenizer(model_dir)
        self.vocab_size = len(self.tokenizer)
        config = loads_json((Path(model_dir) / "config.json").read_text())
        self.max_context = int(config["max_position_embeddings"])  # prompt + output tokens
        self.body_timeout_s, self.idle_timeout_s = body_timeout_s, idle_timeout_s
        stop = {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}
        self.stop_token_ids = sorted(int(t) for t in stop if t is not None)
        self.end_texts = self.tokenizer.convert_ids_to_tokens(self.stop_token_ids)
        self.control_strings = control_strings(self.tokenizer)
        self._nonce = secrets.token_hex(8)  # content sentinels no client can spell
        self.history = History(calls_per_run=history_calls_per_run)
        self.call_writer = call_writer
        self.external_writer = external_writer if external_writer is not None else call_writer
        self.runs = RunRegistry(external)
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.wait_for_server_s = wait_for_server_s
        self.router = Router()
        self._calls: dict[str, int] = {}
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._reaper: asyncio.Task | None = None
        self._exec: dict[str, Any] = {}  # run id -> async fn(command) -> dict (sandbox/exec)

    # -- control by the coordinator (same event loop) --------------------------------
    def add_server(self, server_id: str, client: EngineClient, capacity: int) -> None:
        self.router.add(server_id, client, capacity)

    def drain_server(self, server_id: str, *, runs: str = "move") -> None:
        """No new runs for the server; how its runs leave: "move" (at their next call),
        "free" (at their next call, to a free slot), "keep" (when they end): see
        gateway.router."""
        self.router.drain(server_id, runs=runs)

    def free_slots(self) -> int:
        """Free slots of the servers that take runs."""
        return self.router.free_slots()

    def reopen_server(self, server_id: str) -> None:
        """A draining server takes runs again (its cell's drain was cancelled)."""
        self.router.reopen(server_id)

    def trust_server(self, server_id: str) -> None:
        """A suspect server answered its health check: route runs to it again."""
        self.router.trust(server_id)

    def remove_server(self, server_id: str) -> None:
        self.router.remove(server_id)

    def server_load(self) -> dict[str, dict[str, Any]]:
        return self.router.load()

    def answered_within(self, server_id: str, seconds: float, *, new_grace_s: float = 0.0
                        ) -> bool:
        """Whether the server answered a generation in the last `seconds` (one that has
        answered none yet: whether it was added in the last `new_grace_s`)."""
        return self.router.answered_within(server_id, seconds, new_grace_s=new_grace_s)

    def open_run(self, run_id: str, *, max_calls: int | None = None) -> str:
        """A run of the job starts: its own key (valid on its URL until `end_run`); past
        `max_calls` model calls (choices, recorded or in flight) it is answered 429."""
        if not RUN_ID.match(run_id):
            raise ValueError(f"run id {run_id!r}: use 1-200 of A-Z a-z 0-9 _ . : @ + -")
        return self.runs.open(run_id, now=time.monotonic(), max_calls=max_calls)

    def end_run(self, run_id: str) -> None:
        """The run is over: its key is revoked and everything kept for it is freed."""
        state = self.runs.end(run_id)
        self._exec.pop(run_id, None)
        self.router.end_run(run_id)
        self.history.forget(run_id)
        self._calls.pop(run_id, None)
        writer = self.external_writer if state is not None and state.external \
            else self.call_writer
        writer.forget(run_id)

    def attach_exec(self, run_id: str, execute) -> None:
        """Serve `POST /runs/<run_id>/sandbox/exec` {"command"} for the run (its key only):
        `await execute(command)` -> a JSON object (the command's output, exit code,
        limit); it raises `errors.CommandRefused` to refuse one (409). Until `detach_exec` or
        `end_run`."""
        self._exec[run_id] = execute

    def detach_exec(self, run_id: str) -> None:
        self._exec.pop(run_id, None)

    def server_errors(self, run_id: str) -> int:
        """Calls of a live run that failed because of a rollout server (502/503)."""
        state = self.runs.runs.get(run_id)
        return state.server_errors if state is not None else 0

    def run_stats(self) -> dict[str, int]:
        """Live job and external runs, ended external ids remembered, runs with history."""
        return {**self.runs.stats(), "history_runs": self.history.num_runs()}

    def calls_of(self, run_id: str) -> int:
        """Calls recorded for a live run (0 once it ended: nothing is kept)."""
        return self._calls.get(run_id, 0)

    async def start(self, host: str, port: int, *, unix_path: str | os.PathLike | None = None
                    ) -> int:
        """Serve on host:port (and on the Unix socket `unix_path`, for sandboxes)."""
        check_loopback(host)
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/runs/{run_id}/v1/chat/completions", self._chat),
            web.post("/runs/{run_id}/v1/completions", self._completions),
            web.get("/runs/{run_id}/v1/models", self._models),
            web.post("/runs/{run_id}/end", self._end),
            web.post("/runs/{run_id}/sandbox/exec", self._sandbox_exec)])
        # handler_cancellation: a client that disconnects cancels its handler, and so
        # its engine calls (the engines stop those generations)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self.idle_timeout_s,
                                     handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        if unix_path is not None:  # scaffolds' sandboxes reach the gateway only this way
            await web.UnixSite(self._runner, str(unix_path)).start()
            os.chmod(unix_path, 0o666)  # the sandbox's user; the run keys guard it
        log.info("gateway serving at http://%s:%d/runs/<run_id>/v1", host, bound)
        if self.runs.external is not None:
            self._reaper = asyncio.create_task(self._reap_external())
        return bound

    async def _reap_external(self) -> None:
        ext = self.runs.external
        every = max(0.05, min(5.0, ext.idle_timeout_s / 4, ext.max_run_s / 4))
        while True:
            await asyncio.sleep(every)
            for run_id in self.runs.expired(time.monotonic()):
                log.info("external run %s ended (idle or past its time)", run_id)
                self.end_run(run_id)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- HTTP -------------------------------------------------------------------------
    def _admit(self, request: web.Request) -> RunState:
        """The run whose key the request carries, for the run of its URL; else 401/409/429."""
        m = RUN_PATH.match(request.path)  # the run of the path (404/405 come after auth)
        run_id = m[1] if m else None
        if run_id is None:  # no run's route: no key opens it
            raise HttpError(401, "no run in the path: use /runs/<run_id>/v1 with the run's "
                            "key", "authentication_error")
        if not RUN_ID.match(run_id):
            raise HttpError(400, f"run id {run_id!r}: use 1-200 of A-Z a-z 0-9 _ . : @ + -")
        auth = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        try:
            return self.runs.admit(run_id, auth, now=time.monotonic())
        except Refused as exc:
            kind = "authentication_error" if exc.status == 401 else "invalid_request_error"
            raise HttpError(exc.status, str(exc), kind) from None

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            request[RUN] = self._admit(request)
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
        try:
            body = await read_json_object(request, timeout_s=self.body_timeout_s,
                                          max_bytes=MAX_BODY_BYTES)
        except BadRequest as exc:
            raise HttpError(exc.status, str(exc)) from None
        return run_id, body

    def _room(self, prompt_ids: list[int], sampling: openai.Sampling) -> openai.Sampling:
        """`sampling` with its max_tokens resolved: a request that names none gets the
        room left in the context (at most `default_max_tokens`); 400 when it does not fit."""
        room = self.max_context - len(prompt_ids)
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            if room < 1:
                raise HttpError(400, f"the prompt's {len(prompt_ids)} tokens fill the model's "
                                f"{self.max_context} positions; shorten the prompt")
            max_tokens = room if self.default_max_tokens is None \
                else min(room, self.default_max_tokens)
            return dataclasses.replace(sampling, max_tokens=max_tokens)
        if len(prompt_ids) + max_tokens > self.max_context:
            raise HttpError(400, f"max_tokens {max_tokens} + the prompt's {len(prompt_ids)} "
                            f"tokens exceed the model's {self.max_context} positions; lower "
                            f"max_tokens or shorten the prompt")
        return sampling

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(openai.models_response(self.model_name, self._created))

    async def _sandbox_exec(self, request: web.Request) -> web.Response:
        """A command of the run's scaffold, run in the run's task sandbox."""
        state: RunState = request[RUN]
        execute = self._exec.get(state.run_id)
        if execute is None:
            raise HttpError(404, f"run {state.run_id!r} has no sandbox to run commands in "
                            "(only runs of an external scaffold on a tool environment)")
        _, body = await self._body(request)
        command = body.get("command")
        if not isinstance(command, str) or not command.strip() or set(body) - {"command"}:
            raise HttpError(400, "body must be {\"command\": a non-empty shell command}")
        try:
            return web.json_response(await execute(command))
        except CommandRefused as exc:
            raise HttpError(409, str(exc)) from None

    async def _end(self, request: web.Request) -> web.Response:
        """An external run says it is done (a job run ends when the coordinator says)."""
        state: RunState = request[RUN]
        if not state.external:
            raise HttpError(403, "a job run ends when its agent ends; only external runs "
                            "end themselves")
        state.ending = True
        calls = self.calls_of(state.run_id)
        if state.in_flight == 0:
            self.end_run(state.run_id)
        return web.json_response({"run_id": state.run_id, "ended": True, "calls": calls})

    async def _chat(self, request: web.Request) -> web.Response:
        run_id, body = await self._body(request)
        try:
            sampling = openai.parse_sampling(body, chat=True)
            spec = tools.parse_tools(body)
            rendered = tools.render_messages(openai.parse_messages(body), spec,
                                             lambda key: self.history.said(run_id, key))
            prompt_text, encode = self._render_plain(rendered, generation_prompt=True)
        except openai.RequestError as exc:
            raise HttpError(400, str(exc)) from None
        prompt, prompt_ids, _ = self.history.prompt(run_id, prompt_text, encode)
        sampling = self._room(prompt_ids, sampling)
        choices = await self._generate(request, prompt_ids, sampling, spec)
        for c in choices:
            turn = rendered + [{"role": "assistant", "content": c.text}]
            try:
                full, full_encode = self._render_plain(turn, generation_prompt=False)
            except openai.RequestError:  # recorded already: answer, with no turn anchor
                full, full_encode = None, None
            said = {tools.message_key(c.content, c.tool_calls): c.text} if c.tool_calls else {}
            self._remember(run_id, c, prompt, full, said, full_encode)
        kw = dict(model=self.model_name, prompt_ids=prompt_ids, choices=choices,
                  token_strings=self._token_strings, want_logprobs=sampling.logprobs)
        if sampling.stream:
            return _sse(openai.chat_stream(**kw, include_usage=sampling.include_usage))
        return web.json_response(openai.chat_response(**kw))

    async def _completions(self, request: web.Request) -> web.Response:
        run_id, body = await self._body(request)
        try:
            sampling = openai.parse_sampling(body, chat=False)
            prompt = openai.parse_prompt(body, self.vocab_size)
        except openai.RequestError as exc:
            raise HttpError(400, str(exc)) from None
        anchor = None
        if isinstance(prompt, str):
            anchor, prompt_ids, _ = self.history.prompt(run_id, prompt, self._encode)
        else:
            prompt_ids = prompt
        sampling = self._room(prompt_ids, sampling)
        choices = await self._generate(request, prompt_ids, sampling, tools.NO_TOOLS)
        if anchor is not None:
            for c in choices:
                self._remember(run_id, c, anchor, prompt + c.text, {},
                               self._answer_encoder(prompt + c.text, len(prompt)))
        kw = dict(model=self.model_name, prompt_ids=prompt_ids, choices=choices,
                  token_strings=self._token_strings, want_logprobs=sampling.logprobs)
        if sampling.stream:
            return _sse(openai.completion_stream(**kw, include_usage=sampling.include_usage))
        return web.json_response(openai.completion_response(**kw))

    # -- one request: n generations, answers, records -------------------------------
    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] \
            if text else []

    def _token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False)
        except jinja2.TemplateError as exc:
            raise openai.RequestError(f"the chat template failed on these messages: "
                                      f"{exc}") from None

    def _render_plain(self, messages: list[dict[str, str]], *, generation_prompt: bool):
        """(the rendered text, an encoder of its suffixes) in which control tokens spelled
        inside message content are plain text: a user's or a tool's text cannot forge a
        turn (`<|im_start|>` in a tool's output is the characters, not the token)."""
        try:
            text, spans = content_spans(
                lambda ms: self._render(ms, generation_prompt=generation_prompt), messages,
                self.control_strings, self._nonce)
        except ValueError as exc:
            raise openai.RequestError(str(exc)) from None
        return text, (suffix_encoder(self.tokenizer, text, spans) if spans else self._encode)

    def _answer_encoder(self, text: str, start: int):
        spans = answer_spans(text, start, self.control_strings)
        return suffix_encoder(self.tokenizer, text, spans) if spans else self._encode

    def _remember(self, run_id: str, c: openai.Choice, prompt: Anchor,
                  full_text: str | None, said: dict[str, str], encode=None) -> None:
        turn = None if full_text is None else turn_anchor(
            prompt=prompt, full_text=full_text, answer=c.text, output_ids=c.output_ids,
            pieces=c.pieces, end_texts=self.end_texts, stop_ids=self.stop_token_ids,
            encode=encode or self._encode)
        self.history.add(run_id, Served(c.gyre["call"], prompt, turn, said))

    async def _generate(self, request: web.Request, prompt_ids: list[int],
                        sampling: openai.Sampling, spec: tools.ToolSpec) -> list[openai.Choice]:
        """`n` generations on the run's server, answered and recorded (consecutive call
        numbers, in choice order); any failure fails the request and records nothing."""
        run: RunState = request[RUN]
        made = self._calls.get(run.run_id, 0) + run.reserved
        if run.max_calls is not None and made + sampling.n > run.max_calls:
            raise HttpError(429, f"run {run.run_id!r} has made {made} model calls of the "
                            f"{run.max_calls} it may (gateway.max_calls_per_run): end the "
                            f"run", "insufficient_quota")
        run.in_flight += 1
        run.reserved += sampling.n
        run.t_last = time.monotonic()
        try:
            results, server = await self._results(run, prompt_ids, sampling)
        finally:
            run.in_flight -= 1
            run.reserved -= sampling.n
            run.t_last = time.monotonic()
        if self.runs.runs.get(run.run_id) is not run:
            raise HttpError(409, f"run {run.run_id!r} ended while this call ran: not recorded")
        if request.transport is None or request.transport.is_closing():
            raise asyncio.CancelledError()  # the client left: record nothing
        writer = self.external_writer if run.external else self.call_writer
        choices = []
        t_start = results[0][2]
        for i, (result, t_end, _) in enumerate(results):
            c, finish = self._answer(i, result, sampling, spec)
            call = self._calls.get(run.run_id, 0)
            writer.append({
                "run_id": run.run_id, "call": call, "prompt_ids": prompt_ids,
                "output_ids": c.output_ids, "output_logprobs": c.logprobs,
                "policy_version": result["policy_version"], "t_start": t_start,
                "t_end": t_end, "finish_reason": finish})
            self._calls[run.run_id] = call + 1
            c.gyre = {"run_id": run.run_id, "call": call, "server": server.server_id,
                      "policy_version": result["policy_version"]}
            choices.append(c)
        return choices

    async def _results(self, run: RunState, prompt_ids: list[int], sampling: openai.Sampling
                       ) -> tuple[list[tuple[dict[str, Any], float, float]], Any]:
        """The `n` engine answers [(result, t_end, t_start)] and the server; a failed
        one fails the request (HttpError)."""
        n, run_id = sampling.n, run.run_id
        try:
            server = await self.router.acquire(run_id, wait_s=self.wait_for_server_s, num=n,
                                               external=run.external)
        except NoServer as exc:
            run.server_errors += 1
            raise HttpError(503, str(exc), "server_unavailable") from None
        t_start = time.time()

        async def one(i: int) -> tuple[dict[str, Any], float, float]:
            seed = None if sampling.seed is None else sampling.seed + i
            result = await server.client.generate(
                prompt_ids, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                stop_token_ids=self.stop_token_ids, seed=seed)
            return result, time.time(), t_start
        try:
            results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        finally:
            self.router.release(server, num=n)
        for r in results:
            if isinstance(r, EngineError):
                if r.status == 400:
                    raise HttpError(400, f"the model rejected the request: {r}") from None
                log.warning("run %s: server %s failed: %s", run_id, server.server_id, r)
                run.server_errors += 1
                if r.status == 0:  # no answer at all: no new runs there until it is healthy
                    self.router.suspect(server.server_id)
                raise HttpError(502, f"rollout server {server.server_id!r} failed: {r}",
                                "server_error") from None
            if isinstance(r, BaseException):
                raise r
            if not _well_formed(r[0]):
                raise HttpError(502, f"rollout server {server.server_id!r} answered a "
                                f"malformed generation: {str(r[0])[:200]}", "server_error")
        self.router.answered(server.server_id)
        return results, server

    def _answer(self, index: int, result: dict[str, Any], sampling: openai.Sampling,
                spec: tools.ToolSpec) -> tuple[openai.Choice, str]:
        """The answered choice and the finish reason to record: the generation is cut at
        the first stop string (keeping the tokens up to the one completing it); tool calls
        are parsed out of the text when tools are active."""
        out, lps = list(result["output_ids"]), list(result["output_logprobs"])
        pieces = token_pieces(self.tokenizer, out, skip_special=True)
        text, finish = "".join(pieces), result["finish_reason"]
        cut = cut_at_stop(pieces, sampling.stop) if sampling.stop else None
        if cut is not None:
            text, k = cut
            out, lps, pieces, finish = out[:k], lps[:k], pieces[:k], "stop"
        content, calls = tools.parse_tool_calls(text) if spec.active else (text, [])
        answered = "tool_calls" if calls else finish
        return openai.Choice(index, out, lps, pieces, text, answered, content, calls), finish


def _sse(payload: bytes) -> web.Response:
    """A whole event stream at once: the engines answer whole generations."""
    return web.Response(body=payload, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})


def _well_formed(result: dict[str, Any]) -> bool:
    ids, lps = result.get("output_ids"), result.get("output_logprobs")
    return (isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps)
            and isinstance(result.get("policy_version"), int)
            and result.get("finish_reason") in ("stop", "length"))
