"""HTTP pieces shared by every server of a job (the control channel, the gateway, the
embedded engine): bearer authentication and reading a request's body as a checked JSON
object.

`auth_middleware(secret)` refuses (401) any request without `Authorization: Bearer
<secret>`, before a handler runs or a body is read. `read_json_object` returns the body as
a JSON object or raises `BadRequest` with its status: 415 unless `Content-Type:
application/json`; 413 over `MAX_BODY_BYTES` (the app's `client_max_size`); 408 when the
body does not arrive within `BODY_TIMEOUT_S` (a half-sent request); 400 for bytes that are
not UTF-8, JSON that does not parse (NaN and Infinity included) or nests too deep, strings
with lone surrogate escapes, or a body that is not an object. `check_arguments` says why a
payload cannot be a function's keyword arguments (names and annotated types). Servers
close an idle connection after `IDLE_TIMEOUT_S`. Nothing is unpickled: the only decoder
is `json.loads`.
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
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from gyre_slurm.common.values import is_finite_number, is_int

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 75.0  # above the clients' own idle expiry (aiohttp 15 s), so no race


def auth_middleware(secret: str):
    """Refuse (401) any request without `Authorization: Bearer <secret>`. The header is
    compared as the bytes sent (aiohttp keeps non-UTF-8 bytes as surrogate escapes): a
    non-UTF-8 header is a wrong key, never a server error."""
    expected = f"Bearer {secret}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
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
    except (RequestPayloadError, HttpProcessingError) as exc:  # e.g. gzip that is not
        raise BadRequest(400, f"the body cannot be read: {str(exc).strip()}") from None
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
        elif name in hints and not fits(payload[name], hints[name]):
            return f"argument {name!r} must be {type_name(hints[name])}, got {payload[name]!r:.80}"
    return None


def fits(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits the annotation `tp` (int/float/str/bool, unions, lists)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if tp is float:  # finite: 1e400 decodes to inf, and 1 then 400 zeros to no float
        return is_finite_number(value)
    if tp is int:
        return is_int(value)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, list) and all(fits(v, args[0]) for v in value) if args \
            else isinstance(value, list)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
