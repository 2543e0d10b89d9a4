"""The in-memory backends (`proxy.store: memory`, unit tests; the hot cache of the others).

- `MemoryResponseStore`: the Responses API's records, bounded by entry count and TTL.
- `MemoryStore`: stateless chat's turn records and tool-call bindings (an LRU bounded by
  entries, bytes and idle time), lost on restart.

A Responses record is what `previous_response_id` needs to continue a conversation and what
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
Backends bound themselves by TTL and size; an evicted or deleted id is simply unknown (None)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.base import DEFAULT_TTL_S, ConversationStore, RecordStore, ResponseRecord, StoreScope


class MemoryResponseStore(RecordStore):
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


# what an entry costs beside its value's own size(): the key (32-byte digest and its tuple), the
# LRU's (stamp, value, size) tuple and the OrderedDict's node; measured with tracemalloc
ENTRY_OVERHEAD = 270


class MemoryStore(ConversationStore):
    """LRU with a cap on entries and approximate bytes (the values' size() plus ENTRY_OVERHEAD
    each: close to the memory really held), and an idle TTL checked on access.

    Each entry remembers the size it was counted with, so a value that grows after it was
    stored (a turn whose summary arrives later) never drives the byte count negative; putting
    the same key again recounts it (the orchestrator does so once a summary is set)."""

    def __init__(
        self,
        max_entries: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        ttl_s: float = 6 * 3600,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self._items: OrderedDict[Any, tuple[float, Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # large requests look turns up from a worker thread

    def _get(self, key: Any) -> Any:
        with self._lock:
            return self._get_locked(key)

    def _get_locked(self, key: Any) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        stamp, value, size = item
        now = self.clock()
        if now - stamp > self.ttl_s:
            self._drop(key)
            return None
        self._items[key] = (now, value, size)
        self._items.move_to_end(key)
        return value

    def _put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._put_locked(key, value)

    def _put_locked(self, key: Any, value: Any) -> None:
        if key in self._items:
            self._drop(key)
        size = value.size() + ENTRY_OVERHEAD
        self._items[key] = (self.clock(), value, size)
        self._bytes += size
        while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def _drop(self, key: Any) -> None:
        _, _, size = self._items.pop(key)
        self._bytes -= size

    def get_turn(self, key: bytes) -> TurnRecord | None:
        return self._get(("t", key))

    def put_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None = None) -> None:  # noqa: ARG002
        self._put(("t", key), record)

    def get_call(self, tenant: str, call_id: str) -> CallBinding | None:
        return self._get(("c", tenant, call_id))

    def put_call(  # noqa: ARG002 - no request state
        self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None = None
    ) -> None:
        self._put(("c", tenant, call_id), binding)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self._bytes}
