"""OpenAI request parsing and response shapes (chat completions and completions).

Supported request fields: `messages` (chat) / `prompt` (a string, a one-string list, or
a list of token ids), `max_completion_tokens` / `max_tokens` (default: the gateway's),
`temperature` (default 1.0, 0 = greedy), `seed`, `logprobs` (chat: bool; completions:
an int, the number of top alternatives, which are not reported), `n` = 1 only,
`stream` = false only, `echo` = false only. `stop` strings, `tools`, `top_p`,
penalties and the like are accepted and ignored (generation stops at `<|im_end|>` and
the eos token). Message content is a string, null, or a list of text parts.
Re-sent assistant messages are re-tokenized through the chat template (their text, not
the tokens first sampled: making re-sent text token-exact is a later issue).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """A malformed request (400); the message says what to fix."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    seed: int | None
    logprobs: bool


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_sampling(body: dict[str, Any], *, default_max_tokens: int, chat: bool) -> Sampling:
    if body.get("stream"):
        raise RequestError("stream=true is not supported: ask without streaming")
    if body.get("n", 1) not in (1, None):
        raise RequestError(f"n={body['n']!r}: only n=1 is supported")
    if body.get("echo"):
        raise RequestError("echo=true is not supported")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not _int(max_tokens) or max_tokens < 0:
        raise RequestError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not 0 <= temperature < float("inf"):
        raise RequestError(f"temperature must be a number >= 0, got {temperature!r}")
    seed = body.get("seed")
    if seed is not None and not _int(seed):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    lp = body.get("logprobs")
    if chat and lp not in (None, True, False):
        raise RequestError(f"logprobs must be true or false, got {lp!r}")
    if not chat and lp is not None and (not _int(lp) or lp < 0):
        raise RequestError(f"logprobs must be an integer >= 0 or null, got {lp!r}")
    want = bool(lp) if chat else lp is not None
    return Sampling(max_tokens, float(temperature), seed, want)


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string, null or a list of parts")


def parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        out.append({"role": m["role"], "content": _content(i, m.get("content"))})
    return out


def parse_prompt(body: dict[str, Any], tokenizer, vocab_size: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    elif isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside [0, {vocab_size})")
    else:
        raise RequestError("'prompt' must be a string or a non-empty list of token ids "
                           "(one prompt per request)")
    if not ids:
        raise RequestError("the prompt is empty")
    return [int(t) for t in ids]


def _usage(prompt_ids: list[int], output_ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
            "total_tokens": len(prompt_ids) + len(output_ids)}


def _token_strings(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def chat_response(*, tokenizer, model: str, prompt_ids: list[int], result: dict[str, Any],
                  want_logprobs: bool, extra: dict[str, Any]) -> dict[str, Any]:
    out = result["output_ids"]
    logprobs = None
    if want_logprobs:
        logprobs = {"content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            for s, lp in zip(_token_strings(tokenizer, out), result["output_logprobs"])]}
    text = tokenizer.decode(out, skip_special_tokens=True)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": result["finish_reason"]}],
            "usage": _usage(prompt_ids, out), "gyre": extra}


def completion_response(*, tokenizer, model: str, prompt_ids: list[int],
                        result: dict[str, Any], want_logprobs: bool,
                        extra: dict[str, Any]) -> dict[str, Any]:
    out = result["output_ids"]
    logprobs = None
    if want_logprobs:
        tokens = _token_strings(tokenizer, out)
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        logprobs = {"tokens": tokens, "token_logprobs": list(result["output_logprobs"]),
                    "top_logprobs": None, "text_offset": offsets}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": tokenizer.decode(out, skip_special_tokens=True),
                         "logprobs": logprobs, "finish_reason": result["finish_reason"]}],
            "usage": _usage(prompt_ids, out), "gyre": extra}


def models_response(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "gyre"}]}


def error_body(message: str, *, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}
