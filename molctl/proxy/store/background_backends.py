"""The background jobs' store beside a proxy's response store (molctl.proxy.store.background)."""

from __future__ import annotations

from typing import Any

from molctl.proxy.store.background import BackgroundStore, MemoryBackground
from molctl.proxy.store.local import LocalResponses
from molctl.proxy.store.sqlite.background import SqliteBackground
from molctl.proxy.store.sqlite.store import SqliteResponseStore


def background_store_for(responses: Any) -> BackgroundStore:
    """The jobs' store beside a proxy's response store: the same SQLite file or Redis, else in memory."""
    inner = responses.store if isinstance(responses, LocalResponses) else responses
    if isinstance(inner, SqliteResponseStore):
        return SqliteBackground(inner)
    if type(inner).__name__ == "RedisResponseStore":  # imported only then: redis is an optional dependency
        from molctl.proxy.store.redis.background import RedisBackground

        return RedisBackground(inner.state)
    return MemoryBackground()
