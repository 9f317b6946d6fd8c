"""The HTTP edge: limits on what a client may send before the app sees a request.

uvicorn's httptools protocol reads a request's head with no size, count or time limit (a
96 MB header was read for 14 s of event-loop time, stalling every other client; a client
sending a byte a second held its connection open indefinitely). An ASGI middleware only
runs once the head is complete, too late for its bytes, so the limits live in a subclass
of the protocol itself:

* a request's head (request line and headers) over `max_header_bytes` is answered 431 and
  the connection closed, before any more of it is read; so is one with over `max_headers`
  header lines;
* a head not complete `header_timeout_s` after its first byte (or after the connection
  opened, for a connection that never sends one) is answered 408 and closed;
* a body not complete `body_timeout_s` after its head is cut off (408 when no response
  has started).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class EdgeLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message, "errors": []}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def edge_protocol(limits: EdgeLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` (pass as `uvicorn.Config(http=...)`)."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})


class EdgeProtocol(HttpToolsProtocol):
    limits = EdgeLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # reading a request's head (or waiting for its first byte)
        self._head_bytes = 0
        self._header_count = 0
        self._refusal: bytes | None = None
        self._deadline: asyncio.TimerHandle | None = None

    # -- deadlines ------------------------------------------------------------------------
    def _arm(self, seconds: float, on_expiry: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, on_expiry)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_too_slow(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        self._close(_raw_response(408, "Request Timeout", (
            f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s "
            "(HPT_HEADER_TIMEOUT_S)")) if idle else None)

    def _body_too_slow(self) -> None:
        cycle = self.cycle
        response = None
        if cycle is not None and not cycle.response_started:
            response = _raw_response(408, "Request Timeout", (
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s of "
                "its headers (HPT_BODY_TIMEOUT_S)"))
        if cycle is not None:  # the app waiting on the body sees a disconnect
            cycle.disconnected = True
            cycle.message_event.set()
        self._close(response)

    def _close(self, response: bytes | None) -> None:
        self._disarm()
        if not self.transport.is_closing():
            if response:
                self.transport.write(response)
            self.transport.close()

    # -- uvicorn's protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # While a head is being read, feed at most what is left of its allowance: a head
        # over the limit is refused before the rest of it is read (or parsed).
        while data and self._in_head and self.parser is not None:
            room = self.limits.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse_head(self._too_large())
                return
            piece, data = data[:room], data[room:]
            self._head_bytes += len(piece)
            self._feed(piece)
            if self.transport.is_closing():
                return
        if data and self.parser is not None:
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse_head(self._refusal)
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _too_large(self) -> bytes:
        return _raw_response(431, "Request Header Fields Too Large", (
            f"the request line and headers are over the server's limit of "
            f"{self.limits.max_header_bytes} bytes (HPT_MAX_HEADER_BYTES): send fewer or "
            "shorter headers"))

    def _refuse_head(self, response: bytes) -> None:
        self.logger.warning("Refused a request: %s", response.split(b"\r\n", 1)[0].decode())
        self._close(response)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._header_count = True, 0
        self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = _raw_response(431, "Request Header Fields Too Large", (
                f"the request has more than {self.limits.max_headers} headers "
                "(HPT_MAX_HEADERS): send fewer"))
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, self._body_too_slow)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()
