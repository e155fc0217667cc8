"""The HTTP connection layer's guards, below the ASGI app (uvicorn's h11 protocol, extended):

    a connection from an address that already holds ``max_connections_per_client`` ─► 429, closed
    request headers not complete within ``read_timeout_s`` of their first byte   ─► 408, closed
    a connection that sends nothing for ``read_timeout_s``                        ─► closed
    malformed framing (h11 cannot parse the request)                             ─► 400, closed

Every answer is OpenAI's error JSON (uvicorn's own are plain text). The body's read timeout is
the app's (``Server._json``): only the app knows when it has read a whole body.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ninfer.server")
REASONS = {400: "Bad Request", 408: "Request Timeout", 429: "Too Many Requests"}


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the server (``ninfer serve`` flags of the same names)."""

    read_timeout_s: float = 30.0               # headers, then the body, each within this
    max_connections_per_client: int = 256      # open connections per client address


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in the OpenAI error shape that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def protocol_class(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the guards above; one class (and one count of connections
    per address) per server."""
    open_by_host: Counter = Counter()

    class GuardedH11(H11Protocol):
        _timer = None
        _host = None
        _refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._host = self.client[0] if self.client else None
            open_by_host[self._host] += 1
            if open_by_host[self._host] > limits.max_connections_per_client:
                self._refused = True                 # answered on its first bytes (a reply before them
            self._arm()                              # could be lost to a reset when the request lands)

        def connection_lost(self, exc) -> None:
            self._disarm()
            open_by_host[self._host] -= 1
            if open_by_host[self._host] <= 0:
                del open_by_host[self._host]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                self._reply(429, f"too many connections from {self._host}: at most "
                                 f"{limits.max_connections_per_client} at once", "too_many_connections")
                return
            if self._awaiting_headers() and self._timer is None:
                self._arm()                          # a kept-alive connection's next request begins
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._awaiting_headers() and self.conn.trailing_data[0] and not self.transport.is_closing():
                self._arm()                          # a pipelined request's first bytes are already here

        def send_400_response(self, msg: str) -> None:      # uvicorn has logged its one line
            self._reply(400, "the request is not valid HTTP/1.1 (malformed request line, headers or framing)",
                        "malformed_request")

        # ---- the header timer -----------------------------------------------------------------
        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(limits.read_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
                if self.cycle is None:               # connected, never sent a byte: just close
                    self.transport.close()
                return                               # between kept-alive requests: uvicorn's keep-alive
            log.info("client %s did not complete its request headers within %g s: 408, closed", self._host,
                     limits.read_timeout_s)
            self._reply(408, f"the request headers did not arrive within {limits.read_timeout_s:g} s",
                        "request_timeout")

        def _reply(self, status: int, message: str, code: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(error_response(status, message, code))
                self.transport.close()

    return GuardedH11
