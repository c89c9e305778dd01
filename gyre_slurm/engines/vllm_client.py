"""The gyre engine protocol spoken to a vLLM server: `VllmClient` (the routes it uses,
log-probability semantics and the security guard: see `gyre_slurm.engines.vllm`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from gyre_slurm.common.fsio import loads_json
from gyre_slurm.engines.client import EngineClient, EngineError
from gyre_slurm.models import tiny

log = logging.getLogger(__name__)

RELEASED = "released"
SYNCING = "syncing"


class VllmClient(EngineClient):
    """The gyre engine protocol spoken to a vLLM server (see the module docstring).

    `sleep_mode`: whether release/resume use vLLM's sleep mode; None asks the server
    (/server_info) at the first release or resume."""

    def __init__(self, base_url: str, secret: str, *, model_name: str = "gyre-policy",
                 sleep_mode: bool | None = None, connect_timeout_s: float = 10.0,
                 request_timeout_s: float | None = None):
        super().__init__(base_url, secret, connect_timeout_s=connect_timeout_s,
                         request_timeout_s=request_timeout_s)
        self.model_name = model_name
        self.sleep_mode = sleep_mode
        self.released = False  # released through this client
        self._control = asyncio.Lock()

    async def _call(self, method: str, path: str, body: Any = None, *,
                    timeout_s: float | None = None, params: dict | None = None,
                    json_answer: bool = True) -> Any:
        url = self.base_url + path
        kw: dict[str, Any] = {} if body is None else {"json": body}
        if params:
            kw["params"] = params
        if timeout_s is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._get_session().request(method, url, **kw) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise EngineError(f"{method} {url}: {type(exc).__name__}: {exc}",
                              base_url=self.base_url) from exc
        try:
            data = loads_json(raw) if raw else None
        except ValueError:
            data = None
        if resp.status != 200:
            raise EngineError(f"{method} {url}: HTTP {resp.status}: {_message(data, raw)}",
                              status=resp.status, base_url=self.base_url)
        if json_answer and not isinstance(data, dict):
            raise EngineError(f"{method} {url}: no JSON object in the answer: {raw[:200]!r}",
                              status=resp.status, base_url=self.base_url)
        return data

    # -- generation -------------------------------------------------------------------
    async def generate(self, prompt_ids: Iterable[int], *, max_tokens: int,
                       temperature: float = 1.0, stop_token_ids: Iterable[int] = (),
                       seed: int | None = None) -> dict[str, Any]:
        """{"output_ids", "output_logprobs", "finish_reason": "stop"|"length",
        "policy_version", "weight_versions"}; see the module docstring."""
        if self.released:
            raise EngineError(f"{self.base_url}: the engine is released; resume it first",
                              status=503, base_url=self.base_url)
        ids = [int(i) for i in prompt_ids]
        if max_tokens == 0:  # vLLM wants >= 1; the protocol allows 0
            return {"output_ids": [], "output_logprobs": [], "finish_reason": "length",
                    "policy_version": (await self._label())[1], "weight_versions": []}
        params = {"max_tokens": max_tokens, "temperature": temperature, "logprobs": 0,
                  "stop_token_ids": [int(t) for t in stop_token_ids],
                  "skip_special_tokens": False, "detokenize": False}
        if seed is not None:
            params["seed"] = seed
        data = await self._call("POST", "/inference/v1/generate", {
            "model": self.model_name, "token_ids": ids, "sampling_params": params})
        return self._parse_generation(data)

    def _parse_generation(self, data: dict[str, Any]) -> dict[str, Any]:
        try:
            choice = data["choices"][0]
            out = [int(t) for t in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content") or []
            lps = [float(c["logprob"]) for c in content]
            spans = choice.get("weight_versions") or []
            finish = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"{self.base_url}: malformed generation answer ({exc}): "
                              f"{str(data)[:300]}", base_url=self.base_url) from exc
        if finish not in ("stop", "length"):
            raise EngineError(f"{self.base_url}: generation ended {finish!r} (aborted?)",
                              status=503, base_url=self.base_url)
        if len(lps) != len(out) or [int(c["token_id"]) for c in content] != out:
            raise EngineError(f"{self.base_url}: {len(out)} tokens but {len(lps)} "
                              "log-probabilities", base_url=self.base_url)
        if not spans:
            raise EngineError(f"{self.base_url}: no weight version in the answer",
                              base_url=self.base_url)
        versions = [_version(s["version"]) for s in spans]
        if versions[0] is None:
            raise EngineError(f"{self.base_url}: generated under weight label "
                              f"{spans[0]['version']!r}, not a policy version",
                              base_url=self.base_url)
        if len(set(versions)) > 1:
            log.warning("%s: one generation spans weight versions %s", self.base_url, spans)
        return {"output_ids": out, "output_logprobs": lps,
                "finish_reason": finish, "policy_version": versions[0],
                "weight_versions": spans}

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_i | tokens before i) under the served weights (T=1, unprocessed);
        the first is 0.0."""
        ids = [int(i) for i in token_ids]
        data = await self._call("POST", "/inference/v1/generate", {
            "model": self.model_name, "token_ids": ids, "sampling_params": {
                "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
                "detokenize": False}})
        entries = data.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise EngineError(f"{self.base_url}: no prompt log-probabilities in "
                              f"{str(data)[:300]}", base_url=self.base_url)
        out = [0.0]
        for tok, entry in zip(ids[1:], entries[1:]):
            out.append(float(entry[str(tok)]["logprob"]))
        return out

    # -- state ------------------------------------------------------------------------
    async def _label(self) -> tuple[str, int | None]:
        info = await self._call("GET", "/weight_info")
        label = str(info.get("weight_version"))
        return label, _version(label)

    async def health(self, *, timeout_s: float | None = 5.0) -> dict[str, Any]:
        """{"status": "ok"|"released"|"paused"|"syncing", "policy_version", "active",
        "weight_label"} from the server (paused: a reload in progress, or failed;
        syncing: a streamed round under way, or one that failed)."""
        await self._call("GET", "/health", timeout_s=timeout_s, json_answer=False)
        (label, version), paused, load = await asyncio.gather(
            self._label(), self._call("GET", "/is_paused", timeout_s=timeout_s),
            self._call("GET", "/load", timeout_s=timeout_s))
        if label == RELEASED:
            status = "released"
        elif label == SYNCING:
            status = "syncing"
        elif paused.get("is_paused") or version is None:
            status = "paused"
        else:
            status = "ok"
        return {"status": status, "policy_version": version,
                "active": load.get("server_load"), "weight_label": label}

    async def _uses_sleep(self) -> bool:
        if self.sleep_mode is None:
            info = await self._call("GET", "/server_info",
                                    params={"config_format": "json"}, timeout_s=60)
            self.sleep_mode = bool(info["vllm_config"]["model_config"]["enable_sleep_mode"])
        return self.sleep_mode

    async def _reload(self, path: str | Path, version: int) -> None:
        """Paused engine: load `path` in place and label it `version`."""
        weights = Path(path)
        from gyre_slurm.models.weights import INDEX, has_weights

        if not has_weights(weights):  # one file, or shards and their index (model.path)
            raise EngineError(f"no {tiny.WEIGHTS_FILE} or {INDEX} in {weights}", status=400,
                              base_url=self.base_url)
        await self._call("POST", "/collective_rpc", {
            "method": "reload_weights", "kwargs": {"weights_path": str(weights)}})
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})

    async def load_weights(self, path: str | Path, version: int) -> dict[str, Any]:
        """Load in place once the generations in flight are done (they keep the old
        version); generations sent meanwhile wait and get the new one."""
        async with self._control:
            if self.released:
                return await self._resume(path, version)
            await self._call("POST", "/pause", params={"mode": "wait"})
            try:
                await self._reload(path, version)
            finally:  # resume either way; a failed reload keeps the old label
                await self._call("POST", "/resume")
            return {"policy_version": version}

    async def release(self) -> dict[str, Any]:
        async with self._control:
            if await self._uses_sleep():
                await self._call("POST", "/sleep", params={"level": "1", "mode": "wait"})
            else:
                await self._call("POST", "/pause", params={"mode": "wait"})
            await self._call("POST", "/update_weight_version", {"new_version": RELEASED})
            self.released = True
            return {"status": "released"}

    async def resume(self, path: str | Path, version: int) -> dict[str, Any]:
        async with self._control:
            return await self._resume(path, version)

    async def _resume(self, path: str | Path, version: int) -> dict[str, Any]:
        sleep = await self._uses_sleep()
        if sleep:
            await self._call("POST", "/wake_up", params={"tags": "weights"})
        else:
            await self._call("POST", "/pause", params={"mode": "wait"})
        await self._reload(path, version)
        if sleep:
            await self._call("POST", "/wake_up", params={"tags": "kv_cache"})
        await self._call("POST", "/resume")
        self.released = False
        return {"status": "ok", "policy_version": version}


    # -- streamed weight sync: gyre's engine in vLLM's weight-transfer framework -------
    # (gyre_slurm.engines.vllm_wsync; vLLM's RL routes drive it)
    async def num_workers(self) -> int:
        info = await self._call("GET", "/get_world_size", timeout_s=30)
        return int(info["world_size"])

    async def wake(self) -> dict[str, Any]:
        """A released engine gets its weights' memory back (sleep mode) to receive a
        streamed policy; it stays paused, labelled "released", until the round's
        finish_weight_update resumes it."""
        async with self._control:
            if await self._uses_sleep():
                await self._call("POST", "/wake_up", params={"tags": "weights"})
            self.released = True
            return {"status": "syncing"}

    async def init_weight_transfer(self, init_info: dict[str, Any], *,
                                   timeout_s: float | None = None) -> dict[str, Any]:
        return await self._call("POST", "/init_weight_transfer_engine",
                                {"init_info": init_info}, timeout_s=timeout_s)

    async def begin_weight_update(self) -> None:
        """Pause once the generations in flight are done (they keep the old version),
        label the weights "syncing" (a round that fails leaves no policy version for
        anything to report), start vLLM's layerwise reload."""
        async with self._control:
            await self._call("POST", "/pause", params={"mode": "wait"})
            await self._call("POST", "/update_weight_version", {"new_version": SYNCING})
            await self._call("POST", "/start_weight_update", json_answer=False)

    async def update_weights(self, *, generation: int, version: int) -> dict[str, Any]:
        await self._call("POST", "/update_weights", {
            "update_info": {"generation": generation, "version": version}})
        return {}

    async def finish_weight_update(self, version: int) -> dict[str, Any]:
        """End the reload, label it `version`, wake whatever still sleeps, resume."""
        async with self._control:
            await self._call("POST", "/finish_weight_update",
                             {"weight_version": str(version)})
            if await self._uses_sleep():
                await self._call("POST", "/wake_up")
            await self._call("POST", "/resume")
            self.released = False
            return {"policy_version": version}


def _version(label: Any) -> int | None:
    try:
        v = int(str(label))
    except ValueError:
        return None
    return v if v >= 0 else None


def _message(data: Any, raw: bytes) -> str:
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return raw[:300].decode(errors="replace") or "no answer"
