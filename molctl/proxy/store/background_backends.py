"""The background jobs' store beside a proxy's response store (molctl.proxy.store.background)."""

from __future__ import annotations

import logging
from typing import Any

from molctl.proxy.store.background import BackgroundStore, MemoryBackground
from molctl.proxy.store.local import LocalResponses
from molctl.proxy.store.memory import MemoryResponseStore
from molctl.proxy.store.sqlite.background import SqliteBackground
from molctl.proxy.store.sqlite.store import SqliteResponseStore

log = logging.getLogger("molctl.proxy")


def background_store_for(responses: Any) -> BackgroundStore:
    """The jobs' store beside a proxy's response store: the same SQLite file or Redis, else in memory
    (the memory store's: lost with the process, as its records). Wrappers are looked through: an
    in-process store's `LocalResponses` (`.store`), a view of a store (`.inner`)."""
    inner = responses
    for _ in range(8):  # a wrapper of a wrapper...
        if isinstance(inner, LocalResponses):
            inner = inner.store
        elif "inner" in getattr(inner, "__dict__", {}):  # not through a wrapper's __getattr__
            inner = inner.__dict__["inner"]
        else:
            break
    if isinstance(inner, SqliteResponseStore):
        return SqliteBackground(inner)
    if type(inner).__name__ == "RedisResponseStore":  # imported only then: redis is an optional dependency
        from molctl.proxy.store.redis.background import RedisBackground

        return RedisBackground(inner.state)
    if not isinstance(inner, MemoryResponseStore):
        log.warning("background responses are kept in this process only: no durable store for %s", type(inner).__name__)
    return MemoryBackground()
