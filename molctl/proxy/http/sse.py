"""The held-back-200 SSE writer: a plan's events as a text/event-stream.

`SSEWriter.write(...)` sends the `200` and the SSE headers only with the first chunk of the answer
(the engine's first event, i.e. its first token) or once `sse_keepalive_s` passed, whichever comes
first; a failure before then is answered as without stream (same status, JSON body, headers), a
failure after it is an error frame (`error_frame`) and the stream's end. While the request waits
for an answer slot (`plan.slot.queued`) no keep-alive goes out, so a refusal there is a real 429. A
client that reads nothing for `proxy.stream_write_timeout_s` is dropped; the drain deadline
(`cut`) ends a stream with a `draining` error. docs/design/proxy.md, "Streams and status codes".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from molctl.proxy.errors import ProxyError, draining, store_cause, store_failure
from molctl.proxy.pipeline.plan import Plan, RequestState
from molctl.proxy.store.base import StoreBusy, StoreError

log = logging.getLogger("molctl.proxy")

Send = Callable[[dict], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
CHAT_END = b"data: [DONE]\n\n"


def timing_headers(plan: Plan | None) -> list[tuple[bytes, bytes]]:
    """An answer's `x-mol-route-ms` (the route decision's time; 0 without a route hop) and
    `x-mol-overhead-ms` (the time the proxy added before the answer's first token, or before a
    whole answer's body), each once known: a stream's head that a keep-alive sent early has
    only what was known then. No adapter names."""
    if plan is None or plan.route is None:
        return []
    out = [(b"x-mol-route-ms", b"%.1f" % (plan.timings.get("route_s", 0.0) * 1000))]
    if "overhead_s" in plan.timings:
        out.append((b"x-mol-overhead-ms", b"%.1f" % (plan.timings["overhead_s"] * 1000)))
    return out


def chat_frame(chunk: Any) -> bytes:
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"


def chat_error_frame(exc: ProxyError) -> bytes:
    return b"data: " + json.dumps(exc.body()).encode() + b"\n\n"


def internal_error(rid: str) -> ProxyError:
    return ProxyError(500, f"Internal proxy error (request id {rid}).", "server_error", "proxy_error")


class _Dropped(Exception):
    """The client read nothing for the write timeout: dropped."""


class SSEWriter:
    def __init__(self, counters: Any, keepalive_s: float, write_timeout_s: float, cut: Callable[[], asyncio.Future]):
        self.counters = counters
        self.keepalive_s = keepalive_s
        self.write_timeout_s = write_timeout_s
        self.cut = cut  # the drain deadline's future (ProxyApp.cut_requests)

    async def write(
        self,
        send: Send,
        state: RequestState,
        plan: Plan,
        chunks: AsyncIterator[Any],
        frame: Callable[[Any], bytes] = chat_frame,
        error_frame: Callable[[ProxyError], bytes] = chat_error_frame,
        end: bytes | None = CHAT_END,
        abandon: Callable[[], None] = lambda: None,
    ) -> bool:
        """Write `chunks` as SSE; True when the client has the whole stream. `abandon` is called
        as soon as the client will not get it whole (a failure, a dropped client)."""
        out = _Out(send, state.request_id, self.write_timeout_s, lambda: timing_headers(plan))
        state.streaming = True  # the drain deadline ends it here (cut_requests), not by a cancel
        try:
            failure = await self._pump(out, state, plan, chunks, frame)
        except _Dropped:
            self._dropped(state.request_id)
            abandon()
            return False
        if failure is not None:
            abandon()
            if not out.started:  # nothing sent yet: the same answer as without stream
                raise failure
            state.error = failure.code or failure.type  # a 200 that ended in an error frame
        try:
            if failure is not None:
                await out.write(error_frame(failure), more=end is not None)
            if end is not None:
                await out.write(end, more=False)
            elif failure is None:
                await out.write(b"", more=False)
        except TimeoutError:  # the client stopped reading just before the end: same as above
            self._dropped(state.request_id)
            abandon()
            return False
        return True

    def _dropped(self, rid: str) -> None:
        self.counters.inc("stream_write_timeouts_total")
        log.warning("request %s: stream client read nothing for %.0f s; dropped", rid, self.write_timeout_s)

    async def _pump(
        self, out: _Out, state: RequestState, plan: Plan, chunks: AsyncIterator[Any], frame: Callable[[Any], bytes]
    ) -> ProxyError | None:
        """Frame and write every chunk; the failure to end the stream with, if any."""
        rid = state.request_id
        pending: asyncio.Future | None = None
        cut = self.cut()
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(chunks.__anext__())
                done, _ = await asyncio.wait(
                    {pending, cut}, timeout=self.keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if cut in done:
                    raise draining(rid)
                if not done:
                    if not out.started and plan.slot.queued:
                        continue  # waiting for an answer slot (bounded): no 200 yet, a refusal stays a real 429
                    await out.write(b": keepalive\n\n")
                    continue
                future, pending = pending, None
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    break
                await out.write(frame(chunk))
        except ProxyError as exc:
            return exc
        except TimeoutError:  # the client stopped reading: drop it, cancel the engine request
            raise _Dropped from None
        except Exception as exc:
            if not out.started:
                raise  # answered as a JSON 500 by ProxyApp.__call__
            return self._unexpected(exc, rid)
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await chunks.aclose()
        return None

    def _unexpected(self, exc: Exception, rid: str) -> ProxyError:
        """A failure after the 200: logged and counted as ProxyApp.__call__ does, ended with a frame."""
        if isinstance(exc, (StoreError, StoreBusy)):  # an external fault: one line
            log.warning("request %s: stream failed: %s", rid, exc)
            self.counters.inc("store_failures_total", cause=store_cause(exc))
            failure = store_failure(exc, rid) or internal_error(rid)
            if failure.status >= 500:
                self.counters.inc("internal_errors_total")
            return failure
        self.counters.inc("internal_errors_total")
        log.exception("request %s: stream failed", rid, exc_info=exc)
        return internal_error(rid)


class _Out:
    """The stream's writes: the held-back head goes out with the first one; each write bounded."""

    def __init__(self, send: Send, rid: str, timeout_s: float, extra: Callable[[], list] = lambda: []):
        self.send, self.rid, self.timeout_s = send, rid, timeout_s
        self.extra = extra  # headers known when the head goes out (`timing_headers`)
        self.started = False

    async def write(self, data: bytes, more: bool = True) -> None:
        if not self.started:
            await self.send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": SSE_HEADERS + [(b"x-request-id", self.rid.encode()), *self.extra()],
                }
            )
            self.started = True
        async with asyncio.timeout(self.timeout_s):
            await self.send({"type": "http.response.body", "body": data, "more_body": more})
