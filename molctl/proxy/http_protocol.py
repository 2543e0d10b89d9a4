"""uvicorn's httptools protocol with one change: a response's head leaves in the same send as
its body.

uvicorn writes the status line and headers (`http.response.start`) and then the body
(`http.response.body`) as two transport writes: two send() system calls and, on the client's
side, two wake-ups for one small JSON answer (it reads the head, then waits again for the body).
Measured on the benchmark's 2-core VM at 1 client, that second write and wake-up were the
largest single cost between the engine's answer and the client holding it (BENCHMARKS.md).

`HeadHoldingTransport` holds a write that starts a response head (`HTTP/1.1 `) until the next
write, which it joins, or until the end of the current pass of the event loop (`call_soon`), so
a head whose body comes later (a stream waiting for its first token) is never held longer than
that pass. Order is kept; every other write goes straight through; `close()` sends what is held
first.

And one addition: a request head must be complete within `timeout_keep_alive` (15 s in the
proxy) of the connection opening, or of the first byte of a later request on a kept-alive
connection; else the connection is closed. uvicorn arms its keep-alive timeout only after a
response, so a connection that sent nothing, or half a head (slowloris), was held for ever,
before any key is checked.

And a request httptools cannot parse (a bad request line, header or Content-Length, a broken
chunk) is answered 400 in the proxy's error shape, `code: invalid_http`, not uvicorn's
`text/plain` "Invalid HTTP request received.". Everything else is uvicorn's own protocol,
unchanged."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from molctl.proxy import fastjson
from molctl.proxy.errors import ProxyError, shown

RESPONSE_HEAD = b"HTTP/1.1 "


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

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._held or b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HeadHoldingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a HeadHoldingTransport (`uvicorn.Config(http=...)`), with
    the request head deadline (see the module docstring). A head that arrives whole in one read
    (the usual case) arms no timer; a new connection arms one until its first head is complete."""

    _in_head = True  # a request head is awaited or partly read
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and self._head_timer is None and self.parser is not None:
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

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
        body = fastjson.dumps_bytes(ProxyError(400, message, "invalid_request_error", "invalid_http").body())
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: application/json\r\n",
                        b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                        b"x-request-id: req-" + os.urandom(8).hex().encode("ascii") + b"\r\n",
                        b"connection: close\r\n\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a response runs: never cut it
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)
            return
        self.transport.close()
