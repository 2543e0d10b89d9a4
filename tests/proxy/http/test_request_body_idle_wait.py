"""The request body's idle wait (`proxy.stream_write_timeout_s` without a byte) measures the client,
not the proxy's own event loop: a part that arrived while the loop was blocked is read, never a 408.
Guards a 408 "No part of the request body arrived for 2 s" seen on a loaded CI machine."""

from __future__ import annotations

import asyncio
import time

import pytest

from molctl.proxy.errors import ProxyError
from molctl.proxy.http.body import LOOP_STALL_S, read_body


def queued_receive(queue: asyncio.Queue):
    """A receive like uvicorn's: a message that arrives while the reader is cancelled stays queued
    (uvicorn/protocols/http/h11_impl.py RequestResponseCycle.receive keeps `self.body` until the next call)."""

    async def receive() -> dict:
        return await queue.get()

    return receive


def deliver(queue: asyncio.Queue, body: bytes, more: bool = False) -> None:
    queue.put_nowait({"type": "http.request", "body": body, "more_body": more})


def test_a_part_that_arrives_while_the_loop_is_blocked_is_read():
    async def main() -> bytes:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        deliver(queue, b'{"a":', more=True)
        # the loop blocks from 0.05 s to 0.05 + 0.2 + 2 x LOOP_STALL_S, past the idle deadline (0.2 s);
        # the rest of the body arrives at 0.1 s, while it is blocked: due before the idle timer
        loop.call_later(0.05, time.sleep, 0.2 + 2 * LOOP_STALL_S)
        loop.call_later(0.1, deliver, queue, b"1}")
        return await read_body([], queued_receive(queue), idle_s=0.2, total_s=30)

    assert asyncio.run(main()) == b'{"a":1}'


def test_a_client_that_sends_nothing_gets_the_idle_408():
    async def main() -> None:
        queue = asyncio.Queue()
        deliver(queue, b'{"a":', more=True)
        await read_body([], queued_receive(queue), idle_s=0.2, total_s=30)

    with pytest.raises(ProxyError) as caught:
        asyncio.run(main())
    assert caught.value.status == 408 and "No part of the request body arrived for 0.2 s" in str(caught.value)


def test_a_loop_that_stays_blocked_still_ends_at_the_total_deadline():
    async def main() -> None:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        deliver(queue, b'{"a":', more=True)

        def block_again() -> None:  # every idle timer fires late; the total deadline still ends the read
            time.sleep(0.1 + 2 * LOOP_STALL_S)
            loop.call_later(0.01, block_again)

        loop.call_later(0.01, block_again)
        await read_body([], queued_receive(queue), idle_s=0.1, total_s=1.5)

    with pytest.raises(ProxyError) as caught:
        asyncio.run(main())
    assert caught.value.status == 408 and "did not arrive whole within 1.5 s" in str(caught.value)
