"""uvicorn's httptools protocol with one change and three additions (`HeadHoldingHttpToolsProtocol`).

The change: a response's head leaves in the same send as its body (`HeadHoldingTransport` holds a
write that starts a response head until the next write, which it joins, or until the end of the
current pass of the event loop), saving a send() and a client wake-up per small answer.
The additions: a request head must be complete within `timeout_keep_alive` (15 s) of the
connection opening or of the first byte of a later request (slowloris); a request httptools
cannot parse is a 400 `invalid_http` in the proxy's error shape; a request head is bounded by
`max_head_bytes` (`proxy.max_request_head_bytes`, 64 KiB), counted before the parser sees it:
past it a 431 `request_header_too_large` (a 414 `url_too_long` for the request line), then
`connection: close` with a lingering close. docs/design/proxy.md, "The uvicorn protocol", has
the measurements and the details.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from molctl.proxy import fastjson
from molctl.proxy.errors import ProxyError, shown

RESPONSE_HEAD = b"HTTP/1.1 "
MAX_HEAD_BYTES = 64 * 1024  # the default bound of a request head (proxy.max_request_head_bytes)
LINGER_S = 2.0  # after a refused head: how long what the client still sends is read and dropped

log = logging.getLogger("molctl.proxy")


class HeadHoldingTransport:
    """A transport wrapper (see the module docstring); the rest of the transport's interface is
    passed through."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(RESPONSE_HEAD):
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _close_delimited(cycle: Any, send: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """The ASGI `send` of an HTTP/1.0 request's cycle: a response without a Content-Length is
    written as it comes and ended by closing the connection (uvicorn's cycle would write chunks).
    The cycle is told it is not chunked and that each body message is exactly as long as it is."""
    delimited = False

    async def close_delimited(message: dict) -> None:
        nonlocal delimited
        if message["type"] == "http.response.start" and not cycle.response_started:
            sized = any(
                name.lower() in (b"content-length", b"transfer-encoding") for name, _ in message.get("headers", ())
            )
            if not sized and cycle.scope["method"] != "HEAD" and message["status"] not in (204, 304):
                delimited = True
                cycle.chunked_encoding, cycle.keep_alive = False, False
        elif delimited and message["type"] == "http.response.body" and not cycle.response_complete:
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    return close_delimited


class HeadHoldingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a HeadHoldingTransport (`uvicorn.Config(http=...)`), with
    the request head deadline and bound (see the module docstring). A head that arrives whole in
    one read (the usual case) arms no timer; a new connection arms one until its first head is
    complete. `configured()` gives the class with another bound and a hook told of each refusal."""

    max_head_bytes = MAX_HEAD_BYTES
    on_refused: Callable[[int], None] | None = None  # told the status (431, 414) of each refused head
    _in_head = True  # a request head is awaited or partly read
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes: int | None = 0  # bytes of the current request head so far; None while a body is read
    _line_done = False  # the current head's request line is complete (a newline arrived)
    _refused: int | None = None  # the status of a refused head: what arrives is dropped from then on
    _refusal_sent = False
    _upgraded = False

    @classmethod
    def configured(
        cls, max_head_bytes: int = MAX_HEAD_BYTES, on_refused: Callable[[int], None] | None = None
    ) -> type[HeadHoldingHttpToolsProtocol]:
        """This protocol with a request head bound of `max_head_bytes` and `on_refused` (a plain
        function: it is stored on the class) called with the status of each refused head."""
        return type(
            cls.__name__,
            (cls,),
            {"max_head_bytes": max_head_bytes, "on_refused": staticmethod(on_refused) if on_refused else None},
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, a head's bytes counted first: at most what is left under the bound
        at a time, and nothing once a head passed it (then everything is dropped)."""
        while data and self._refused is None:
            if self._head_bytes is None:  # a body: not counted
                super().data_received(data)
                break
            room = self.max_head_bytes - self._head_bytes
            if room <= 0:  # more head bytes than the bound, the head still not complete
                self._refuse(414 if not self._line_done else 431)
                return
            piece, data = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._head_bytes += len(piece)
            if not self._line_done and b"\n" in piece:
                self._line_done = True
            super().data_received(piece)
            if self.parser is None or self._upgraded or self.transport.is_closing():
                return
        if self._in_head and self._head_timer is None and self.parser is not None and self._refused is None:
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._line_done = True  # a header is complete: so is the request line before it
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and self.scope.get("http_version") == "1.0":
            cycle.send = _close_delimited(cycle, cycle.send)  # run_asgi looks it up when the task starts

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes, self._line_done = 0, False  # the next request's head is counted afresh

    def handle_websocket_upgrade(self) -> None:
        self._upgraded = True
        super().handle_websocket_upgrade()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refused is not None and not self._refusal_sent and not self.pipeline:
            self._refuse(self._refused)

    def _refuse(self, status: int) -> None:
        """A head passed the bound: answer `status` now, or once the responses running or queued on
        this connection are complete (never in the middle of one); drop what arrives meanwhile."""
        self._refused = status
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.transport.is_closing():
            return
        if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
            self.flow.resume_reading()  # dropped as they arrive, never buffered
            return
        self._refusal_sent = True
        rid = "req-" + os.urandom(8).hex()
        limit = self.max_head_bytes
        if status == 414:
            error = ProxyError(
                414,
                f"The request line exceeds {limit} bytes (proxy.max_request_head_bytes; request id {rid}).",
                "invalid_request_error",
                "url_too_long",
            )
        else:
            error = ProxyError(
                431,
                f"The request head (request line and headers) exceeds {limit} bytes "
                f"(proxy.max_request_head_bytes; request id {rid}).",
                "invalid_request_error",
                "request_header_too_large",
            )
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("request %s: %s sent a request head over %d bytes: answered %d", rid, client, limit, status)
        self._write_error(error, rid)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._head_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
        if self.on_refused is not None:
            self.on_refused(status)

    def _write_error(self, error: ProxyError, rid: str) -> None:
        """`error` as a whole response, its body JSON, with `x-request-id: rid` and `connection: close`."""
        body = fastjson.dumps_bytes(error.body())
        content = [STATUS_LINE[error.status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend(
            [
                b"content-type: application/json\r\n",
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                b"x-request-id: " + rid.encode("ascii") + b"\r\n",
                b"connection: close\r\n\r\n",
                body,
            ]
        )
        self.transport.write(b"".join(content))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request httptools cannot parse (called, after uvicorn's warning,
        while the parser's error is handled), as every other error of the proxy: a 400 with
        `{"error": {..., "type": "invalid_request_error", "code": "invalid_http"}}`, the parser's
        reason (a fixed text of llhttp's, never the client's bytes; cut at 80 characters, ASCII),
        a new `x-request-id` and `connection: close`; then the connection is closed."""
        exc = sys.exc_info()[1]
        reason = str(exc).encode("ascii", "backslashreplace").decode("ascii") if exc is not None else ""
        detail = shown((reason or msg).rstrip("."))
        message = f"The request is not valid HTTP/1.1: {detail}" + ("" if detail.endswith("...") else ".")
        self._write_error(
            ProxyError(400, message, "invalid_request_error", "invalid_http"), "req-" + os.urandom(8).hex()
        )
        self.transport.close()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a response runs: never cut it
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)
            return
        self.transport.close()
