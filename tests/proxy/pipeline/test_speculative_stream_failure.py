"""A held speculative stream that fails in any way hands its failure to its reader: a hit's answer
raises it (the client gets an error, as without speculation) instead of waiting for ever."""

from __future__ import annotations

import asyncio

import pytest

from molctl.engines import get_engine
from molctl.proxy.pipeline.heldhop import HeldHop


def test_a_held_stream_failing_unexpectedly_raises_in_its_reader():
    """Guards a found bug: a failure other than the engine's left the hit's reader waiting on the held queue for ever."""

    async def upstream():
        yield {"choices": [{"index": 0, "delta": {"content": "held"}}]}
        raise ValueError("a bug in the stream reader")

    async def main() -> list[str]:
        hop = HeldHop("L2", get_engine("vllm"))
        hop.start(lambda h: h.pump(upstream()))
        seen = []
        with pytest.raises(ValueError, match="a bug"):
            async for event in hop.events():
                seen.append(event["choices"][0]["delta"]["content"])
        return seen

    assert asyncio.run(asyncio.wait_for(main(), 10)) == ["held"]
