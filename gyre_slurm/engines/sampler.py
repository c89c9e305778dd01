"""The model side of the embedded engine: one model, one worker thread, KV-cache decoding.

`Sampler` owns the tiny model (`gyre_slurm.models.tiny`) and runs every job (generate,
load weights, release, resume) on ONE worker thread, in submission order. So a weight
load waits for the generations submitted before it (they finish under the old policy
version and report it), and generations submitted after it see the new version.

Sampling: token t is drawn from softmax(logits / T) with `torch.multinomial` (a
per-request `torch.Generator`, seeded by the request's `seed` when given), or argmax for
T = 0. `output_logprobs[i]` is log softmax(logits / T)[output_ids[i]] in float32 for
T > 0; for T = 0 (greedy, a point mass) it is log softmax(logits)[output_ids[i]], i.e.
the T = 1 distribution. A temperature under `MIN_TEMPERATURE` (1e-5, vLLM's
threshold) is greedy too: dividing logits by a denormal overflows. A stop token ends
generation and IS part of `output_ids` (finish_reason "stop"); otherwise generation
ends after `max_tokens` tokens or at the model's maximum positions (finish_reason
"length"). A generation whose `cancel` event is set (its client left) stops at the next
token and raises `Cancelled`; one still queued is dropped.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_slurm.common.values import is_int, is_number
from gyre_slurm.models import tiny

log = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-5  # below: greedy (vLLM's _SAMPLING_EPS)
MAX_TEMPERATURE = 1e6  # above, softmax(logits / T) is uniform to float32 anyway


class BadRequest(ValueError):
    """The request cannot be served as given (the HTTP layer answers 400)."""


class Released(RuntimeError):
    """The model has been released (the HTTP layer answers 503)."""


class Cancelled(RuntimeError):
    """The generation was cancelled (its client left)."""


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    stop_token_ids: frozenset[int]
    seed: int | None = None


def parse_generate(body: Any, *, vocab_size: int, max_positions: int) -> GenRequest:
    """Validate a /generate JSON body; `BadRequest` says what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    for key in ("prompt_ids", "max_tokens"):
        if key not in body:
            raise BadRequest(f"missing field {key!r}")
    ids = body["prompt_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest("prompt_ids must be a non-empty list of token ids")
    _check_ids(ids, "prompt_ids", vocab_size)
    if len(ids) > max_positions:
        raise BadRequest(f"prompt has {len(ids)} tokens; the model takes at most "
                         f"{max_positions} positions")
    max_tokens = body["max_tokens"]
    if not is_int(max_tokens) or max_tokens < 0:
        raise BadRequest(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    temperature = body.get("temperature", 1.0)
    if not is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadRequest(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, "
                         f"got {temperature!r:.40}")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list):
        raise BadRequest("stop_token_ids must be a list of token ids")
    _check_ids(stop, "stop_token_ids", vocab_size)
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -(1 << 63) <= seed < (1 << 64)):
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r:.40}")
    return GenRequest(list(ids), max_tokens, float(temperature), frozenset(stop), seed)


def _check_ids(ids: list, name: str, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise BadRequest(f"{name}[{i}] = {t!r} is not a token id in [0, {vocab_size})")


class Sampler:
    """The model and its single worker thread. Every public method returns a
    `concurrent.futures.Future` (wrap it with `asyncio.wrap_future`)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(str(self.model_dir))
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(config.max_position_embeddings)
        self.model = None
        self.version: int | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")
        self._pool.submit(_init_thread).result()

    @property
    def loaded(self) -> bool:
        return self.model is not None

    @property
    def status(self) -> str:
        """ok | released (no model) | syncing (a model whose weights are not a whole
        policy: a streamed round is under way, failed, or has not come yet)."""
        if self.model is None:
            return "released"
        return "ok" if self.version is not None else "syncing"

    def fresh(self) -> concurrent.futures.Future:
        """A model to stream weights into (its own are random until a round succeeds)."""
        return self._pool.submit(self._fresh)

    def stream_update(self, endpoint, generation: int, version: int
                      ) -> concurrent.futures.Future:
        """Receive policy `version` over the transfer group of `endpoint` (a
        gyre_slurm.train.wsync Endpoint) in place, after the jobs already queued; the jobs
        queued after it run under the new version."""
        return self._pool.submit(self._stream_update, endpoint, generation, version)

    def load(self, weights: str | Path, version: int) -> concurrent.futures.Future:
        """(Re)load weights in place (after the jobs already queued); new version."""
        return self._pool.submit(self._load, Path(weights), version)

    def release(self) -> concurrent.futures.Future:
        return self._pool.submit(self._release)

    def generate(self, req: GenRequest, cancel: threading.Event | None = None
                 ) -> concurrent.futures.Future:
        return self._pool.submit(self._generate, req, cancel or threading.Event())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, weights: Path, version: int) -> int:
        from gyre_slurm.models.weights import INDEX, has_weights

        if not has_weights(weights):  # one file, or shards and their index (model.path)
            raise BadRequest(f"no {tiny.WEIGHTS_FILE} or {INDEX} in {weights}")
        model = self.model if self.model is not None else tiny.new_model(self.model_dir)
        tiny.load_weights(model, weights)
        model.eval()
        self.model, self.version = model, version
        log.info("loaded weights %s as policy version %d", weights, version)
        return version

    def _fresh(self) -> None:
        if self.model is None:
            self.model = tiny.new_model(self.model_dir).eval()
        self.version = None

    def _stream_update(self, endpoint, generation: int, version: int) -> dict:
        import torch

        from gyre_slurm.train.wsync import stream

        group, plan = endpoint.check(generation)
        if self.model is None:
            raise Released("the model is released; POST /resume first")
        self.version = None  # half-loaded weights never serve
        params = self.model.state_dict()

        def load(pairs) -> None:
            with torch.no_grad():
                for name, t in pairs:
                    params[name].copy_(t)

        stats = stream.receive(group, plan, load=load)
        self.version = version
        log.info("streamed policy version %d: %d buckets, %.1f MB in %.3f s", version,
                 stats["buckets"], stats["bytes"] / 1e6, stats["seconds"])
        return stats

    def _release(self) -> None:
        self.model = None
        import gc
        gc.collect()
        log.info("model released")

    def _generate(self, req: GenRequest, cancel: threading.Event) -> dict[str, Any]:
        import torch

        if cancel.is_set():
            raise Cancelled("cancelled before it started")
        model, version = self.model, self.version
        if model is None:
            raise Released("the model is released; POST /resume first")
        if version is None:
            raise Released("the weights are being synced (no whole policy loaded)")
        budget = min(req.max_tokens, self.max_positions - len(req.prompt_ids))
        gen = torch.Generator()
        gen.manual_seed(req.seed if req.seed is not None else random.getrandbits(63))
        out_ids: list[int] = []
        out_lps: list[float] = []
        finish = "length"
        with torch.inference_mode():
            logits, cache = _forward(model, req.prompt_ids, None)
            while len(out_ids) < budget:
                if cancel.is_set():
                    raise Cancelled(f"cancelled after {len(out_ids)} tokens")
                tok, lp = _sample(logits, req.temperature, gen)
                out_ids.append(tok)
                out_lps.append(lp)
                if tok in req.stop_token_ids:
                    finish = "stop"
                    break
                if len(out_ids) < budget:
                    logits, cache = _forward(model, [tok], cache)
        return {"output_ids": out_ids, "output_logprobs": out_lps,
                "finish_reason": finish, "policy_version": version}


def _init_thread() -> None:
    import torch

    torch.set_num_threads(1)


_CACHE_KW: dict[type, str] = {}


def _forward(model, ids: list[int], cache):
    """Logits of the last position (float32) and the updated KV cache."""
    import torch

    kw = _CACHE_KW.get(type(model))
    if kw is None:  # transformers 5 names it `cache`, 4.x `past_key_values`
        params = inspect.signature(model.forward).parameters
        kw = _CACHE_KW[type(model)] = "cache" if "cache" in params else "past_key_values"
    args = {"input_ids": torch.tensor([ids], dtype=torch.long), "use_cache": True}
    if cache is not None:
        args[kw] = cache
    out = model(**args)
    new_cache = out.get("cache")
    if new_cache is None:
        new_cache = out.get("past_key_values")
    return out.logits[0, -1].float(), new_cache


def _sample(logits, temperature: float, gen) -> tuple[int, float]:
    import torch

    if temperature < MIN_TEMPERATURE:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logp))
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
    return tok, float(logp[tok])
