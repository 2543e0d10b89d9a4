"""A held speculative stream is buffered within a bound (issue 40): `HeldHop.pump` put every
event in an unbounded queue, so a slow reader on a hit made the proxy hold a 100k-token answer
whole (90 MB); it now reads the engine's stream at most HELD_EVENTS_MAX events ahead."""

from __future__ import annotations

import asyncio

from molctl.engines.vllm import ENGINE
from molctl.proxy.pipeline.heldhop import HELD_EVENTS_MAX, HeldHop


class Upstream:
    """An engine stream of `n` events that counts how many were read from it."""

    def __init__(self, n: int):
        self.n, self.read, self.closed = n, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.read == self.n:
            raise StopAsyncIteration
        self.read += 1
        return {"choices": [{"index": 0, "delta": {"content": "w"}, "token_ids": [self.read]}]}

    async def aclose(self):
        self.closed = True


def test_a_held_stream_with_no_reader_stops_reading_the_engine_at_the_bound():
    """Guards the unbounded queue: without a reader the engine's stream is read no further."""

    async def go():
        upstream = Upstream(HELD_EVENTS_MAX * 10)
        hop = HeldHop("L1", ENGINE)
        hop.start(lambda h: h.pump(upstream))
        for _ in range(HELD_EVENTS_MAX * 20):  # every pass the pump could use, and more
            await asyncio.sleep(0)
        held, running = upstream.read, not hop.task.done()
        await hop.cancel()
        return held, running, upstream.closed

    held, running, closed = asyncio.run(go())
    assert held <= HELD_EVENTS_MAX + 1 and running and closed


def test_a_slow_reader_gets_every_event_in_order():
    """Guards the bound's correctness: the reader, however late, gets the whole stream and its end."""

    async def go():
        upstream = Upstream(HELD_EVENTS_MAX * 3 + 5)
        hop = HeldHop("L1", ENGINE)
        hop.start(lambda h: h.pump(upstream))
        got = []
        async for event in hop.events():
            got.append(event["choices"][0]["token_ids"][0])
            await asyncio.sleep(0)
        return got, hop.tokens.output, upstream.closed

    got, ids, closed = asyncio.run(go())
    assert got == list(range(1, HELD_EVENTS_MAX * 3 + 6)) and ids == got and closed
