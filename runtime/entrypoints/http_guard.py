"""What stands between a socket and the endpoints: a pure ASGI middleware (API key, Origin and
Host checks, the body-size limit on every body, chunked ones included) and the JSON body
reader that refuses what no endpoint should see (deep nesting, NaN and Infinity, integers past
int64, lone UTF-16 surrogates), naming the field.

Pure ASGI rather than Starlette's BaseHTTPMiddleware: that one wraps `receive`, and an endpoint
behind it never sees its client hang up (a non-streaming request would run to the end).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from plait.runtime.ipc.limits import MAX_JSON_DEPTH, check_json_value

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# liveness probes need no key, nor the chat page's files (chat_page.py), which carry no data
_OPEN_PATHS = ("/health", "/", "/chat.js", "/chat.css")


class BodyError(ValueError):
    """The body is not acceptable JSON (a 400, or 413 when `status` says so)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


MAX_SHOWN = 80  # characters of a client's value an error message repeats
_MAX_MESSAGE = 2000  # characters of any error message: none repeats a huge value whole


def shown(value: str) -> str:
    """A client's value as an error message repeats it: at most MAX_SHOWN characters."""
    return value if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]}... ({len(value)} characters)"


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + f"... ({len(message)} characters)"
    type_ = type_ or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                      429: "rate_limit_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": type_, "code": status}}


# ---- JSON bodies ----------------------------------------------------------------------------
def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, checked all through (limits.check_json_value)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BodyError(f"the body is nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BodyError("the body must be a JSON object")
    check_json_value(data)
    return data


# ---- the ASGI middleware ----------------------------------------------------------------------
def default_allowed_hosts(bind_host: str) -> list[str]:
    """A loopback-bound server answers only to loopback names (DNS rebinding cannot reach it);
    one bound elsewhere is meant to be reached by any name."""
    if bind_host in _LOOPBACK_NAMES or _is_loopback(bind_host):
        return sorted({*_LOOPBACK_NAMES, bind_host})
    return ["*"]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """'example.com:80' -> 'example.com', '[::1]:80' -> '::1'."""
    return (urlsplit("//" + host_header).hostname or "").lower()


class Guard:
    """ASGI middleware for every HTTP request: API key (constant-time, scheme case-insensitive;
    /health and the chat page's files stay open), Host and Origin allow-lists, and a byte limit on every request body."""

    def __init__(self, app, api_key: str | None, max_body: int, allowed_hosts: list[str],
                 allowed_origins: list[str]):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.hosts = [h.lower() for h in allowed_hosts]
        self.origins = [o.lower().rstrip("/") for o in allowed_origins]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        ollama = scope["path"].startswith("/api/")  # Ollama's routes answer in its error shape
        if refusal is not None:
            return await _send_json(send, *refusal, ollama)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _send_json(send, 413, f"request body of {length} bytes exceeds the limit of {self.max_body}",
                                    ollama)
        await self.app(scope, self._bounded(receive), send)

    def _refusal(self, scope, headers: dict[str, str]) -> tuple[int, str] | None:
        host = _host_name(headers.get("host", ""))
        if "*" not in self.hosts and host not in self.hosts:
            return 403, f"host {host!r} is not allowed (see --allowed-hosts)"
        origin = headers.get("origin")
        if origin is not None and not self._origin_ok(origin.lower().rstrip("/"), headers.get("host", "").lower()):
            return 403, f"origin {origin!r} is not allowed (see --allowed-origins)"
        if self.key is not None and scope["path"] not in _OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return 401, "missing or wrong API key: send 'Authorization: Bearer <key>'"
        return None

    def _origin_ok(self, origin: str, host_header: str) -> bool:
        if "*" in self.origins or origin in self.origins:
            return True
        # a page served from this very host:port (same origin) is not foreign
        return urlsplit(origin).netloc == host_header

    def _bounded(self, receive: Callable[[], Awaitable[dict]]):
        seen = 0
        limit = self.max_body

        async def bounded_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyError(f"request body exceeds the limit of {limit} bytes", status=413)
            return message

        return bounded_receive


async def _send_json(send, status: int, message: str, ollama: bool = False) -> None:
    body = json.dumps({"error": message} if ollama else error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
