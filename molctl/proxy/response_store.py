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
themselves by TTL and size; an evicted or deleted id is simply unknown (None)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

ResponseRecord = dict[str, Any]

DEFAULT_TTL_S = 30 * 24 * 3600  # as the OpenAI API keeps stored responses


class ResponseStore(Protocol):
    def put_response(self, record: ResponseRecord) -> None: ...

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    def delete_response(self, tenant: str, response_id: str) -> bool: ...

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class MemoryResponseStore:
    """Bounded by entry count and TTL (oldest first); lost on restart."""

    def __init__(self, max_entries: int = 10_000, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time):
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._items: OrderedDict[tuple[str, str], ResponseRecord] = OrderedDict()
        self.evicted = 0

    def put_response(self, record: ResponseRecord) -> None:
        key = (record["tenant"], record["id"])
        self._items[key] = record
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)
            self.evicted += 1

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        record = self._items.get((tenant, response_id))
        if record is not None and self.clock() - record["created_at"] > self.ttl_s:
            del self._items[(tenant, response_id)]
            return None
        return record

    def delete_response(self, tenant: str, response_id: str) -> bool:
        return self._items.pop((tenant, response_id), None) is not None

    def stats(self) -> dict[str, int]:
        return {"responses": len(self._items), "responses_evicted": self.evicted}

    def close(self) -> None:
        pass
