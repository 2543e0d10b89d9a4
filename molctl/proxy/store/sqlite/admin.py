"""`molctl state stats|prune` on a SQLite store: `describe(store)` and `prune(store)` (the Redis
store's admin has the same two functions: molctl.proxy.store.redis.admin)."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from molctl.proxy.store.sqlite.schema import SCHEMA_VERSION, _rollback, _size
from molctl.proxy.store.sqlite.store import SqliteResponseStore


def prune(store: SqliteResponseStore) -> dict[str, int]:
    """Delete expired rows, then evict over the caps (responses, then the conversation rows on
    their own counts); returns what it removed."""
    store.flush()
    with store._locked("prune"):
        conn = store._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            now = store.clock()
            expired, evicted = store._expire_group("responses", now), store._evict_responses(None)
            conv_expired, conv_evicted = (
                store._expire_group("conversations", now),
                store._evict_group("conversations"),
            )
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
    return {
        "expired": expired,
        "evicted": evicted,
        "conversation_expired": conv_expired,
        "conversation_evicted": conv_evicted,
    }


def describe(store: SqliteResponseStore) -> dict[str, Any]:
    """stats() plus what `molctl state stats` shows: the file, its size on disk (with the WAL),
    the bounds, the rows already expired but not pruned."""
    out: dict[str, Any] = {
        "backend": "sqlite",
        "path": str(store.path),
        "exists": True,
        "schema_version": store.file_version,
        "integrity": store.integrity,
    }
    if store.file_version < SCHEMA_VERSION:
        out["migration_pending"] = (
            f"schema {store.file_version} -> {SCHEMA_VERSION} when a proxy or `state prune` "
            "next opens it (an older molctl then refuses the file: keep a copy to roll back)"
        )
    out.update(store.stats())
    with store._locked("stats"):
        cutoff = store.clock() - store.ttl_s
        out["responses_expired_pending"] = store._conn.execute(
            "SELECT count(*) FROM responses WHERE created_at < ?", (cutoff,)
        ).fetchone()[0]
        conv = ("turns", "calls") if store.file_version >= 2 else ()  # a v1 file has no conversation tables
        out["turns"], out["calls"] = (
            store._conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] if t in conv else 0
            for t in ("turns", "calls")
        )
        out["conversation_expired_pending"] = sum(
            store._conn.execute(f"SELECT count(*) FROM {t} WHERE stamp < ?", (cutoff,)).fetchone()[0] for t in conv
        )
    out["file_bytes"] = sum(_size(Path(str(store.path) + sfx)) for sfx in ("", "-wal", "-shm"))
    out["mode"] = f"{stat.S_IMODE(store.path.stat().st_mode):04o}"
    out["bounds"] = {
        "ttl_s": store.ttl_s,
        "max_bytes": store.max_bytes,
        "max_entries": store.max_entries,
        "tenant_max_bytes": store.tenant_max_bytes,
        "tenant_max_entries": store.tenant_max_entries,
    }
    return out
