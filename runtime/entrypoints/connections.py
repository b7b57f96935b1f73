"""Bounds on what a connection may hold: the time to send a request's headers and its body, the time
an idle keep-alive connection stays open, and how many connections are open at once.

uvicorn bounds only the keep-alive wait after a response: a client that connects and sends nothing,
or sends its headers or body a byte a second, holds a socket (a file descriptor) for as long as it
likes. `guarded_protocol` is uvicorn's h11 protocol with a timer on each of those waits; a request
over its time gets a 408 (unless its response has begun) and the connection is closed. A connection
beyond `max_connections` gets a 503 and is closed at once.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float  # from the connection's first byte (or its opening) to the end of the headers
    body_timeout: float  # from the end of the headers to the end of the body
    keep_alive_timeout: float  # an idle connection between requests
    max_connections: int


def raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body that closes the connection."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's h11 protocol class under `limits` (for uvicorn.Config(http=...))."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._waiting_for: str | None = None  # "headers" or "body": what the timer bounds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(raw_response(503, "Service Unavailable",
                                             f"the server holds its limit of {limits.max_connections} open "
                                             "connections; retry later"))
                transport.close()
                return
            self._arm("headers")  # a connection that sends nothing is bounded like a slow one

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            their = self.conn.their_state
            if their is h11.IDLE and self.conn.trailing_data[0]:
                self._arm("headers")  # part of a request line or headers came
            elif their is h11.SEND_BODY:
                self._arm("body")
            elif their is not h11.IDLE:
                self._disarm()  # the request is in; the response takes the time it takes

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, what: str) -> None:
            if self._waiting_for == what:
                return  # the deadline runs from the first byte, not the latest: a trickle does not extend it
            self._disarm()
            timeout = limits.header_timeout if what == "headers" else limits.body_timeout
            self._waiting_for = what
            self._timer = self.loop.call_later(timeout, self._timed_out, what, timeout)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._waiting_for = None, None

        def _timed_out(self, what: str, timeout: float) -> None:
            self._timer, self._waiting_for = None, None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                self.transport.write(raw_response(408, "Request Timeout",
                                                  f"the request's {what} did not arrive within {timeout:g} s"))
            self.transport.close()

    return GuardedH11Protocol
