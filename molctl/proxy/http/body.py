"""Request bodies: read within the bounds (`read_body`), parsed where it is cheapest (`parse_on_loop`).

Bodies over BIG_BODY bytes are parsed (in steps) and prepared in a worker thread, and so is the
preparation of a smaller body holding over BIG_ITEMS messages, content parts, tool calls and tools
(`many_items`), so the event loop keeps serving; everything else runs on the loop, where orjson
parses a MiB in 1-25 ms and a worker thread's hand-offs would cost more than the work (1.5 ms of
CPU for a 260 KiB conversation, BENCHMARKS.md); a body orjson cannot read (NaN, 19-digit numbers,
invalid JSON) is read by the standard library in a worker thread, whatever its size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from molctl.proxy import fastjson
from molctl.proxy.apis.chat_validation import parse_body
from molctl.proxy.errors import ProxyError
from molctl.proxy.pipeline.run import BIG_MESSAGES

Receive = Callable[[], Awaitable[dict]]

MAX_BODY = 8 * 1024 * 1024
BIG_BODY = 1024 * 1024  # parse + prepare larger bodies in a worker thread, the parse in steps
BIG_ITEMS = (
    BIG_MESSAGES  # prepare in a worker thread above this many messages, parts, tool calls and tools (many_items)
)


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


def too_large(unread: bool = False) -> ProxyError:
    """413; `unread`: the body was not read, so the connection is closed after the answer."""
    return ProxyError(
        413,
        f"The request body exceeds {MAX_BODY} bytes.",
        "invalid_request_error",
        "request_too_large",
        headers={"connection": "close"} if unread else None,
    )


LOOP_STALL_S = 0.25  # an idle timer that fires this late measured the loop's stall, not the client


async def read_body(headers: list[tuple[bytes, bytes]], receive: Receive, idle_s: float, total_s: float) -> bytes:
    """The body; a client that sends nothing of it for `idle_s` (`proxy.stream_write_timeout_s`), or
    not all of it within `total_s` (`proxy.request_body_timeout_s`), gets a 408 (an admitted
    request holds a drain: a stalled or trickled upload must not hold it to its deadline). A
    Content-Length over MAX_BODY is a 413 before any of it is read (no `100 Continue` is sent).

    An idle timer that fires over LOOP_STALL_S late ran on a loop that was itself stalled (a
    blocking call, the process descheduled): the part that arrived meanwhile may be waiting behind
    the timer, so the idle wait starts again instead of answering 408; the total deadline holds."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY:
            raise too_large(unread=True)
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_s
    while True:
        idle = asyncio.timeout_at(min(loop.time() + idle_s, deadline))
        try:
            async with idle:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    body = message.get("body", b"")
                    size += len(body)
                    if size > MAX_BODY:
                        raise too_large()
                    chunks.append(body)
                    if not message.get("more_body"):
                        return b"".join(chunks)
                    idle.reschedule(min(loop.time() + idle_s, deadline))
        except TimeoutError:
            now = loop.time()
            if now >= deadline:
                why = f"The request body did not arrive whole within {total_s:g} s."
            elif now - (idle.when() or now) > LOOP_STALL_S:
                continue
            else:
                why = f"No part of the request body arrived for {idle_s:g} s."
            raise ProxyError(
                408, why, "invalid_request_error", "request_timeout", headers={"connection": "close"}
            ) from None


async def parse_on_loop(raw: bytes) -> Any:
    """A body up to BIG_BODY: orjson on the event loop; what only the standard library reads (NaN,
    19-digit numbers, invalid JSON: ~100 ms for a MiB of floats) in a worker thread."""
    body = parse_body(raw, fast_only=True)
    if body is fastjson.FALLBACK:
        body = await asyncio.to_thread(parse_body, raw)
    return body


def many_items(body: Any, field: str) -> bool:
    """Whether `body[field]` (a request's messages or input items) holds over BIG_ITEMS items,
    content parts and tool calls, with the request's tools: its preparation then runs in a worker
    thread. Any shape; validation comes later."""
    if not isinstance(body, dict):
        return False
    items, tools = body.get(field), body.get("tools")
    count = len(tools) if isinstance(tools, list) else 0
    if not isinstance(items, list):
        return count > BIG_ITEMS
    count += len(items)
    if count > BIG_ITEMS:
        return True
    for item in items:
        if not isinstance(item, dict):
            continue
        for nested in (item.get("content"), item.get("tool_calls")):
            if isinstance(nested, list):
                count += len(nested)
        if count > BIG_ITEMS:
            return True
    return False
