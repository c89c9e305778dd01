"""OpenAI request parsing and response shapes (chat completions and completions).

Request fields honoured: `messages` (chat: roles system/developer/user/assistant/tool;
content a string, null or a list of text parts; assistant `tool_calls`; tool
`tool_call_id`) / `prompt` (a string, a one-string list, or a list of token ids),
`max_completion_tokens` / `max_tokens` (default: the room left in the model's context,
capped by the gateway's `default_max_tokens` when set), `temperature` (default 1.0, 0
to 1e6; under 1e-5 it samples greedily, as vLLM does), `seed` (choice i of n gets seed + i), `n` (1..16), `stream`
and `stream_options.include_usage`, `stop` (a string or up to 4), `logprobs` (chat:
bool, with `top_logprobs` 0..20 accepted; completions: an int), `tools` and
`tool_choice` (see `gateway.tools`); `seed` is a 64-bit integer, and `max_tokens` plus
the prompt must fit the model's context (checked by the gateway). Refused: `echo`,
`functions`/`function_call`.
Checked (OpenAI's ranges: `top_p` in (0, 1], `min_p` in [0, 1], presence/frequency
penalties in [-2, 2], `repetition_penalty` > 0, `top_k` >= -1, `logit_bias` token ids to
[-100, 100]) and not applied: the engines sample from the full distribution, and the
recorded logprobs are of that sampling. Ignored: `user`, `response_format`,
`parallel_tool_calls` and anything else. Top-logprob alternatives are reported empty
(`top_logprobs: []` per token in chat, `null` in completions): the engines return only
the sampled token's logprob.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre_slurm.common.values import is_int, is_number
from gyre_slurm.config.checks import MAX_TEMPERATURE
from gyre_slurm.gateway.errors import RequestError

__all__ = ["RequestError", "Sampling", "Choice", "parse_sampling", "parse_messages",
           "parse_prompt", "chat_response", "completion_response", "chat_stream",
           "completion_stream", "models_response", "error_body"]

MAX_N = 16
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1 - MAX_N
MAX_STOPS = 4
# MAX_TEMPERATURE: agent.temperature is held to it too (temperatures under 1e-5 sample
# greedily, as in vLLM)
IGNORED_NUMBERS = {  # checked, not applied: name -> (lo, hi, lo excluded)
    "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (0.0, 1e6, True),
}
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the request named none (resolved by the gateway)
    temperature: float
    seed: int | None
    logprobs: bool
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()


@dataclass
class Choice:
    """One generation as answered: `output_ids`/`logprobs` as recorded (cut at a stop
    string), `pieces` the answer text of each of those tokens (special tokens empty),
    `text` the answer text, `content`/`tool_calls` the chat message."""

    index: int
    output_ids: list[int]
    logprobs: list[float]
    pieces: list[str]
    text: str
    finish_reason: str
    content: str | None
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    gyre: dict[str, Any] = field(default_factory=dict)


def _int_field(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int | None
               ) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise RequestError(f"{name} must be an integer {rng}, got {v!r:.40}")
    return v


def _number_field(body: dict[str, Any], name: str, default: float | None, lo: float,
                  hi: float, *, lo_open: bool = False) -> float | None:
    """A number in [lo, hi] ((lo, hi] with `lo_open`), as a float; RequestError else
    (a bool, a string, an integer too large for a float included)."""
    v = body.get(name)
    if v is None:
        return default
    ok = is_number(v)
    if ok:
        try:
            f = float(v)
        except OverflowError:
            ok = False
        else:
            ok = (lo < f if lo_open else lo <= f) and f <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"{name} must be a number in {rng}, got {v!r:.40}")
    return f


def _check_ignored(body: dict[str, Any]) -> None:
    """Sampling fields the engines do not apply are still checked (OpenAI's and vLLM's
    ranges), so a malformed value is a 400 here as it would be there."""
    for name, (lo, hi, lo_open) in IGNORED_NUMBERS.items():
        _number_field(body, name, None, lo, hi, lo_open=lo_open)
    _int_field(body, "top_k", None, -1, None)
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise RequestError("logit_bias must be an object of at most 1024 "
                           "{\"token id\": bias from -100 to 100}")
    for k in bias:
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 9):
            raise RequestError(f"logit_bias key {k!r:.40} is not a token id")
        try:
            _number_field(bias, k, None, -100.0, 100.0)
        except RequestError as exc:
            raise RequestError(f"logit_bias[{k!r}]: {exc}") from None


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS \
            or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of at most "
                           f"{MAX_STOPS} non-empty strings, got {stop!r}")
    return tuple(stops)


def parse_sampling(body: dict[str, Any], *, chat: bool) -> Sampling:
    """The request's sampling settings; `max_tokens` None when the request names none
    (the gateway then gives the room left in the context)."""
    if body.get("echo"):
        raise RequestError("echo=true is not supported")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 0):
        raise RequestError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    temperature = _number_field(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    _check_ignored(body)
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not SEED_MIN <= seed <= SEED_MAX):
        raise RequestError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX} (a 64-bit "
                           f"seed, choice i of n taking seed + i), got {seed!r:.40}")
    n = _int_field(body, "n", 1, 1, MAX_N)
    lp = body.get("logprobs")
    if chat and lp not in (None, True, False):
        raise RequestError(f"logprobs must be true or false, got {lp!r}")
    if not chat:
        _int_field(body, "logprobs", None, 0, None)
    _int_field(body, "top_logprobs", None, 0, 20)
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise RequestError(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}")
    include_usage = bool((options or {}).get("include_usage"))
    want = bool(lp) if chat else lp is not None
    return Sampling(max_tokens, float(temperature), seed, want, n, bool(stream),
                    include_usage, _stops(body))


def _content(where: str, content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content: only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string, null or a list of parts")


def _tool_calls(where: str, calls: Any) -> list[dict[str, str]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str) \
                or c.get("type", "function") != "function":
            raise RequestError(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": "
                               "\"function\", \"function\": {\"name\", \"arguments\": a "
                               "JSON string}}")
        out.append({"id": str(c.get("id") or ""), "name": fn["name"],
                    "arguments": fn.get("arguments", "")})
    return out


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """[{role, content (str or None), tool_calls [{id, name, arguments}], tool_call_id}]"""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'")
        if m["role"] not in ROLES:
            raise RequestError(f"{where}.role {m['role']!r}: use one of {', '.join(ROLES)}")
        calls = _tool_calls(where, m.get("tool_calls")) if m["role"] == "assistant" else []
        out.append({"role": m["role"], "content": _content(where, m.get("content")),
                    "tool_calls": calls, "tool_call_id": m.get("tool_call_id")})
    return out


def parse_prompt(body: dict[str, Any], vocab_size: int) -> str | list[int]:
    """The prompt text, or its token ids when given as ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside [0, {vocab_size})")
        return [int(t) for t in prompt]
    raise RequestError("'prompt' must be a string or a non-empty list of token ids "
                       "(one prompt per request)")


# -- answers ---------------------------------------------------------------------------
def _usage(prompt_ids: Sequence[int], choices: Sequence[Choice]) -> dict[str, int]:
    out = sum(len(c.output_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": out,
            "total_tokens": len(prompt_ids) + out}


def _gyre(choices: Sequence[Choice]) -> dict[str, Any]:
    """The first choice's gyre object, plus every choice's call numbers."""
    return {**choices[0].gyre, "calls": [c.gyre["call"] for c in choices]}


def _chat_lp(tokens: Sequence[str], lps: Sequence[float]) -> list[dict[str, Any]]:
    return [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(tokens, lps)]


def _tool_call_objs(calls: Sequence[dict[str, str]]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def chat_response(*, model: str, prompt_ids: Sequence[int], choices: Sequence[Choice],
                  token_strings, want_logprobs: bool) -> dict[str, Any]:
    """`token_strings(ids)`: one display string per token (for logprobs)."""
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.tool_calls:
            message["tool_calls"] = _tool_call_objs(c.tool_calls)
        lp = {"content": _chat_lp(token_strings(c.output_ids), c.logprobs)} \
            if want_logprobs else None
        out.append({"index": c.index, "message": message, "logprobs": lp,
                    "finish_reason": c.finish_reason})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": out,
            "usage": _usage(prompt_ids, choices), "gyre": _gyre(choices)}


def _completion_lp(tokens: Sequence[str], lps: Sequence[float], start: int
                   ) -> dict[str, Any]:
    offsets, pos = [], start
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": list(tokens), "token_logprobs": list(lps), "top_logprobs": None,
            "text_offset": offsets}


def completion_response(*, model: str, prompt_ids: Sequence[int],
                        choices: Sequence[Choice], token_strings,
                        want_logprobs: bool) -> dict[str, Any]:
    out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
            "logprobs": _completion_lp(token_strings(c.output_ids), c.logprobs, 0)
            if want_logprobs else None} for c in choices]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": out,
            "usage": _usage(prompt_ids, choices), "gyre": _gyre(choices)}


def _text_steps(c: Choice, text: str) -> Iterator[tuple[str, list[int]]]:
    """(piece of `text`, token indices whose logprobs go with it), token by token; the
    tokens after `text` is complete (a cut stop string, a final special token) come last
    with an empty piece."""
    left, waiting = len(text), []
    for i, piece in enumerate(c.pieces):
        waiting.append(i)
        piece = piece[:left] if left > 0 else ""
        if piece:
            left -= len(piece)
            yield piece, waiting
            waiting = []
    if waiting:
        yield "", waiting


def _sse(chunks: Sequence[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"
                    for c in chunks) + b"data: [DONE]\n\n"


def chat_stream(*, model: str, prompt_ids: Sequence[int], choices: Sequence[Choice],
                token_strings, want_logprobs: bool, include_usage: bool) -> bytes:
    """The whole Server-Sent-Events body: per choice a role chunk, content chunks (one
    per token, or one with tool calls), tool-call chunks, a finish chunk; a usage chunk
    if asked; `data: [DONE]`."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    chunks = []

    def chunk(c: Choice, delta: dict[str, Any], idx: Sequence[int] = (),
              finish: str | None = None, **extra: Any) -> None:
        lp = {"content": _chat_lp(token_strings([c.output_ids[i] for i in idx]),
                                  [c.logprobs[i] for i in idx])} \
            if want_logprobs and idx else None
        chunks.append({**head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                            "finish_reason": finish}], **extra})
    for c in choices:
        chunk(c, {"role": "assistant", "content": ""})
        rest: list[int] = []
        if c.tool_calls:
            if c.content:
                chunk(c, {"content": c.content})
            for j, call in enumerate(_tool_call_objs(c.tool_calls)):
                chunk(c, {"tool_calls": [{"index": j, **call}]})
            rest = list(range(len(c.output_ids)))
        else:
            for piece, idx in _text_steps(c, c.content or ""):
                if piece:
                    chunk(c, {"content": piece}, idx)
                else:
                    rest = idx
        chunk(c, {}, rest, c.finish_reason, gyre=c.gyre)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(prompt_ids, choices),
                       "gyre": _gyre(choices)})
    return _sse(chunks)


def completion_stream(*, model: str, prompt_ids: Sequence[int],
                      choices: Sequence[Choice], token_strings, want_logprobs: bool,
                      include_usage: bool) -> bytes:
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model}
    chunks = []
    for c in choices:
        offset = 0
        steps = list(_text_steps(c, c.text))
        for k, (piece, idx) in enumerate(steps):
            last = k == len(steps) - 1
            lp = _completion_lp(token_strings([c.output_ids[i] for i in idx]),
                                [c.logprobs[i] for i in idx], offset) \
                if want_logprobs else None
            offset += len(piece)
            chunks.append({**head, "choices": [{
                "index": c.index, "text": piece, "logprobs": lp,
                "finish_reason": c.finish_reason if last else None}],
                **({"gyre": c.gyre} if last else {})})
        if not steps:
            chunks.append({**head, "choices": [{"index": c.index, "text": "", "logprobs": None,
                                                "finish_reason": c.finish_reason}],
                           "gyre": c.gyre})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(prompt_ids, choices),
                       "gyre": _gyre(choices)})
    return _sse(chunks)


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "gyre"}]}


def error_body(message: str, *, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}
