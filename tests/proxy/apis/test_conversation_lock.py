"""The per-conversation lock of one proxy process (apis.conversations.records): writes to one
conversation take turns, other conversations do not wait, and the table forgets a conversation
once nobody holds or waits for it, a waiter cancelled while it waits included."""

from __future__ import annotations

import asyncio

from molctl.proxy.apis.conversations.records import ConversationRecords
from molctl.proxy.store.local import LocalResponses
from molctl.proxy.store.memory import MemoryResponseStore


def test_writes_take_turns_and_the_table_empties():
    records = ConversationRecords(LocalResponses(MemoryResponseStore()))
    order: list[str] = []

    async def write(name: str, conv: str, gate: asyncio.Event | None = None) -> None:
        async with records.lock("t", conv):
            order.append(f"{name}+")
            if gate is not None:
                await gate.wait()
            order.append(f"{name}-")

    async def run() -> None:
        gate = asyncio.Event()
        first = asyncio.create_task(write("a", "c1", gate))
        await asyncio.sleep(0)
        second = asyncio.create_task(write("b", "c1"))
        other = asyncio.create_task(write("x", "c2"))
        cancelled = asyncio.create_task(write("z", "c1"))
        await asyncio.sleep(0)
        await other  # another conversation does not wait for c1
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        gate.set()
        await asyncio.gather(first, second)

    asyncio.run(run())
    assert order == ["a+", "x+", "x-", "a-", "b+", "b-"]
    assert records._locks == {}
