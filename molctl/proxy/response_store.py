"""The store of the Responses API's state: one record per stored response, per tenant (API key).

A record is what `previous_response_id` needs to continue a conversation and what
`GET /v1/responses/{id}` and `/input_items` return:
  - `id`: the public response id (`resp_...`);
  - `tenant`: the hash of the API key that created it (another key's id is a 404);
  - `created_at`: seconds since the epoch (the store's clock);
  - `previous_response_id`: the id it continued, or None;
  - `messages`: the whole conversation up to and including this response's output, as chat
    messages (what the next response in the chain is prepared from; `instructions` excluded,
    as they do not carry over);
  - `input_items`: this response's own input items as the API returns them (`/input_items`);
  - `response`: the response object as returned to the client;
  - `route`: the adapter that answered (internal: tool loops continue on it; never shown).

`MemoryResponseStore` is the in-process backend (unit tests, `proxy.store: memory`); a durable
backend (SQLite in the state dir) implements the same `ResponseStore` protocol. Backends bound
themselves by TTL and size; an evicted or deleted id is simply unknown (None).

The proxy calls every backend through one async interface (`ProxyResponses`): the shared Redis
store implements it itself; an in-process store is wrapped by `LocalResponses` (`as_proxy_store`)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

ResponseRecord = dict[str, Any]

DEFAULT_TTL_S = 30 * 24 * 3600  # as the OpenAI API keeps stored responses


class StoreBusy(Exception):
    """A put or delete told not to wait (`wait=False`) found the store's write lock held by another
    process; nothing was written (LocalResponses tries again a little later)."""


class ResponseStore(Protocol):
    def put_response(self, record: ResponseRecord, wait: bool = True) -> None: ...

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    def delete_response(self, tenant: str, response_id: str, wait: bool = True) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class ProxyResponses(Protocol):
    """What the proxy awaits (molctl.proxy.redis_store.RedisResponseStore, or LocalResponses)."""

    async def available(self) -> None: ...  # raises StoreUnavailable when a shared store is down

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    async def get_previous(
        self, tenant: str, response_id: str
    ) -> ResponseRecord | None: ...  # the record a request continues

    async def put_response(
        self, record: ResponseRecord, big: bool = False
    ) -> None: ...  # big: a hint (a large request)

    async def delete_response(self, tenant: str, response_id: str) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


BUSY_RETRY_S = 0.02  # a write that found another process's write lock (StoreBusy) is tried again this much later
BIG_RECORD = 64 * 1024  # text bytes of a record LocalResponses writes from a worker thread (~2 ms at 256 KiB on SQLite)
MANY_MESSAGES = 200  # messages of a record written from a worker thread whatever their size


class LocalResponses:
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

    def __init__(self, store: ResponseStore):
        self.store = store
        self._offload = getattr(store, "slow_puts", True)

    async def available(self) -> None:
        return None

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        return self.store.get_response(tenant, response_id)

    get_previous = get_response

    async def put_response(self, record: ResponseRecord, big: bool = False) -> None:
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
        patience = getattr(self.store, "busy_timeout_s", 2.0)
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

    def close(self) -> None:
        self.store.close()


def as_proxy_store(store: ResponseStore | ProxyResponses) -> ProxyResponses:
    """The store as the proxy calls it: an async store as it is, an in-process one wrapped."""
    return store if inspect.iscoroutinefunction(store.get_response) else LocalResponses(store)  # type: ignore[arg-type]


class MemoryResponseStore:
    """Bounded by entry count and TTL (oldest first); lost on restart. Thread-safe (a lock): a
    put may come from a worker thread while the loop reads (the proxy puts from the loop: a put
    here is a dict insert, `slow_puts` False)."""

    slow_puts = False

    def __init__(self, max_entries: int = 10_000, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.time):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._items: OrderedDict[tuple[str, str], ResponseRecord] = OrderedDict()
        self.evicted = 0
        self._lock = threading.Lock()

    def put_response(self, record: ResponseRecord, wait: bool = True) -> None:  # noqa: ARG002 - never waits
        key = (record["tenant"], record["id"])
        with self._lock:
            self._items[key] = record
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
                self.evicted += 1

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        with self._lock:
            record = self._items.get((tenant, response_id))
            if record is not None and self.clock() - record["created_at"] > self.ttl_s:
                del self._items[(tenant, response_id)]
                return None
            return record

    def delete_response(self, tenant: str, response_id: str, wait: bool = True) -> bool:  # noqa: ARG002 - never waits
        with self._lock:
            return self._items.pop((tenant, response_id), None) is not None

    def stats(self) -> dict[str, int]:
        return {"responses": len(self._items), "responses_evicted": self.evicted}

    def close(self) -> None:
        pass
