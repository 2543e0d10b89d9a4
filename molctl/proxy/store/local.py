"""In-process stores (memory, SQLite) behind the proxy's async `ResponseStore` interface.

`LocalResponses` wraps a `RecordStore`; `as_proxy_store` wraps what needs it (a shared store
implements `ResponseStore` itself). Costs and the busy-retry policy: docs/design/store.md."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from molctl.proxy.store.base import RecordStore, ResponseRecord, ResponseStore, StoreBusy, StoreScope

BUSY_RETRY_S = 0.02  # a write that found another process's write lock (StoreBusy) is tried again this much later
BIG_RECORD = 64 * 1024  # text bytes of a record LocalResponses writes from a worker thread (~2 ms at 256 KiB on SQLite)
MANY_MESSAGES = 200  # messages of a record written from a worker thread whatever their size


class LocalResponses(ResponseStore):
    """An in-process store (memory, SQLite) behind the proxy's async interface. Its calls run on
    the event loop (a get or a small put takes ~0.1 ms: too short for a thread hop to pay off,
    BENCHMARKS.md "Response store"), except the put of a large record (`big`, over BIG_RECORD
    text bytes or MANY_MESSAGES messages: the JSON encoding and the write take milliseconds),
    which runs in a worker thread when the store's `slow_puts` says its put encodes and writes
    (SQLite; the memory store's put is a dict insert: no thread hop pays there). A slow store's
    puts and deletes never wait for another process's write lock (a `molctl state prune`, a sqlite3
    shell) inside the store, which would hold the store's own lock and stall the loop's other calls:
    they are tried again while the loop runs (`_unless_busy`). Nothing to be unavailable:
    `available()` returns at once."""

    def __init__(self, store: RecordStore):
        self.store = store
        self._offload = store.slow_puts

    async def available(self) -> None:
        return None

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        return self.store.get_response(tenant, response_id)

    async def put_response(  # noqa: ARG002 - nothing kept per request
        self, record: ResponseRecord, big: bool = False, scope: StoreScope | None = None
    ) -> None:
        messages = record["messages"]
        if not self._offload:
            self.store.put_response(record)
            return
        offload = (
            big
            or len(messages) > MANY_MESSAGES
            or sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) > BIG_RECORD
        )
        await self._unless_busy(offload, self.store.put_response, record, False)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        if not self._offload:
            return self.store.delete_response(tenant, response_id)
        return await self._unless_busy(False, self.store.delete_response, tenant, response_id, False)

    async def _unless_busy(self, in_thread: bool, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (with wait=False among them), on the loop or in a worker thread; while another
        process holds the file's write lock (StoreBusy) it is tried again every BUSY_RETRY_S, the loop
        free meanwhile, up to the store's busy_timeout_s (then StoreBusy: a 500). No call waits for
        the lock while holding the store's own lock: the loop's other store calls (the chat state's
        flush, a get) never queue behind it."""
        loop = asyncio.get_running_loop()
        patience = self.store.busy_timeout_s
        deadline = loop.time() + patience
        while True:
            try:
                return await asyncio.to_thread(fn, *args) if in_thread else fn(*args)
            except StoreBusy as exc:
                if loop.time() >= deadline:
                    raise StoreBusy(f"{exc} (waited {patience:g} s)") from None
            await asyncio.sleep(BUSY_RETRY_S)

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def health(self) -> str | None:
        return self.store.health()

    def close(self) -> None:
        self.store.close()


def as_proxy_store(store: RecordStore | ResponseStore) -> ResponseStore:
    """The store as the proxy calls it: an async store as it is, an in-process one wrapped."""
    return store if isinstance(store, ResponseStore) else LocalResponses(store)
