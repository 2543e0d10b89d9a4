"""One keep-alive HTTP/1.1 connection to the engine (`_Connection`, parsed by httptools) and the
line reader of its streamed body (`_lines`), for `engine_client.EngineClient`."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import httptools

from molctl.proxy.errors import EngineHTTPError, EngineUnavailable

READ_HIGH_WATER = 1 << 20  # a stream's unread bytes above this pause reading from the engine


class Headers(dict):
    """Response headers, names lower-cased; get() in any case."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to the engine, one request at a time. The reader waits on
    `_wait()`, which returns after each parser event (headers, body bytes, end, failure)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float):
        self.loop = loop
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.slot: Any = None  # the slots semaphore the request on it holds (EngineClient._exchange)
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers = Headers()
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.headers_done = False
        self.done = False
        self.keep_alive = False
        self.error: EngineUnavailable | None = None
        self.got_bytes = False
        self.closed_by_engine = False  # the engine closed it (not a timeout or a malformed answer): see _exchange
        self.sent_at = 0.0  # loop time of the request's send; closed_at: of the engine's close
        self.closed_at = 0.0
        self._framed = False  # Content-Length or chunked: the end is known without a close
        self._interim = False  # parsing a 1xx answer, which is skipped
        self._paused = False
        self._deadline = float("inf")
        self._last_read = 0.0

    # ---- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._cancel_timer()
        if not self.done and self.error is None:
            if self.headers_done and not self._framed:
                self.done = True  # a body delimited by the close
            else:
                self.error = EngineUnavailable(str(exc) if exc else "the engine closed the connection")
                self.closed_by_engine = True
                self.closed_at = self.loop.time()
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"malformed HTTP response from the engine: {exc}")

    def eof_received(self):
        return False  # close the transport

    # ---- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        if key in ("content-length", "transfer-encoding"):
            self._framed = True
        self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if (
            100 <= self.status < 200 and self.status != 101
        ):  # an interim answer (100 Continue, 103): the real one follows
            self._interim = True
            self.headers = Headers()
            self._framed = False
            return
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()
        self._cancel_timer()
        self._wake()

    # ---- the client's side
    def send(self, request: bytes, timeout: float | None) -> None:
        self._reset()
        now = self.loop.time()
        self._last_read = self.sent_at = now
        if timeout:
            self._deadline = now + timeout
        self._arm(min(self._deadline, now + self.read_timeout))
        self.transport.write(request)

    def take_body(self) -> bytes:
        data = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def wait(self) -> None:
        """Until the next parser event; raises the connection's failure."""
        if self.error is not None:
            raise self.error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, why: str) -> None:
        if self.error is None and not self.done:
            self.error = EngineUnavailable(why)
        self.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self, when: float) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_at(when, self._check_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        """The total deadline (if any) and the read timeout (no byte for read_timeout s)."""
        self._timer = None
        if self.done:
            return
        now = self.loop.time()
        next_check = min(self._deadline, self._last_read + self.read_timeout)
        if now >= next_check:
            self._fail("TimeoutError")
        else:
            self._arm(next_check)


MAX_STREAM_LINE = 64 << 20  # one SSE line (one event's JSON); a longer one is the engine's failure


def _lines(conn: _Connection):
    """The body's lines (each with its newline; the last one without, at the end), or None when
    the caller must `await conn.wait()` for more bytes (a generator cannot await). Linear in the
    line's length: each chunk is searched once (a 50 MB line rescanned from its start on every
    chunk took 18 s of CPU); a line over MAX_STREAM_LINE raises EngineHTTPError 502."""
    parts: list[bytes] = []  # the current line's pieces from earlier chunks
    size = 0
    while True:
        if conn.body:
            chunk = conn.take_body()
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                if end < 0:
                    break
                if parts:
                    parts.append(chunk[start : end + 1])
                    yield b"".join(parts)
                    parts, size = [], 0
                else:
                    yield chunk[start : end + 1]
                start = end + 1
            if start < len(chunk):
                parts.append(chunk[start:] if start else chunk)
                size += len(chunk) - start
                if size > MAX_STREAM_LINE:
                    raise EngineHTTPError(
                        502, f"the engine sent a stream line over {MAX_STREAM_LINE} bytes", in_stream=True
                    )
            continue
        if conn.done or conn.error is not None:
            if conn.error is not None and not conn.done:
                raise conn.error
            if parts:
                yield b"".join(parts)
            return
        yield None
