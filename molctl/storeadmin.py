"""`molctl state stats|prune PROFILE`: the proxy's store of a profile (stored responses and
stateless chat's conversations: turns and tool-call bindings), inspected and pruned from outside
the proxy (it may be running: SQLite's own locking and WAL let both work).

Neither creates a missing store file. Both check the file's integrity when they open it (see
molctl.proxy.store.sqlite.schema): a damaged store is one line, exit 1, and nothing is written to it. The
shapes are in docs/contract.md."""

from __future__ import annotations

from typing import Any

from molctl.profiles import Profile, load_profile
from molctl.proxy.store.factory import resolve_store, tenant_bounds
from molctl.proxy.store.sqlite import admin as sqlite_admin
from molctl.proxy.store.sqlite.store import SqliteResponseStore


def _open(profile: Profile, state_dir, reads_only: bool = False) -> tuple[dict[str, Any], SqliteResponseStore | None]:
    p = profile.proxy
    kind, path = resolve_store(p.store, state_dir, profile.name)
    base: dict[str, Any] = {
        "profile": profile.name,
        "backend": kind,
        "path": str(path) if path else None,
        "exists": bool(path and path.exists()),
        "bounds": {
            "ttl_s": p.store_ttl_s,
            "max_bytes": p.store_max_bytes,
            "max_entries": p.store_max_entries,
            **tenant_bounds(p),
        },
    }
    if not base["exists"]:
        return base, None
    if reads_only and path.stat().st_size == 0:  # created, never written: a reader leaves it so (no schema)
        return base, None
    return base, SqliteResponseStore(
        path,
        ttl_s=p.store_ttl_s,
        max_bytes=p.store_max_bytes,
        max_entries=p.store_max_entries,
        create=False,
        reads_only=reads_only,
        **tenant_bounds(p),
    )


def _profile(name: str, ctx) -> Profile:
    """The profile as its stack was started (the records' configuration: `up --set proxy.store=...`
    or other bounds are the store the proxy uses, as `status` reads them), else the file."""
    from molctl import stackconfig
    from molctl.lifecycle.stacks import recorded_config
    from molctl.state import read_records

    if name and "/" not in name and not name.startswith("."):
        try:
            records = read_records(ctx.state_dir, name)
        except OSError:
            records = {}
        recorded = stackconfig.profile_from(recorded_config(records))
        if recorded is not None:
            return recorded
    return load_profile(name, ctx.dirs())


def _counts(store: SqliteResponseStore | None) -> dict[str, Any]:
    if store is None:
        return {
            "schema_version": None,
            "integrity": None,
            "responses": 0,
            "bytes": 0,
            "file_bytes": 0,
            "evicted": 0,
            "expired": 0,
            "expired_pending": 0,
            "oldest_created_at": None,
            "conversations": {"turns": 0, "calls": 0, "bytes": 0, "evicted": 0, "expired": 0, "expired_pending": 0},
        }
    d = sqlite_admin.describe(store)
    pending = {"migration_pending": d["migration_pending"]} if "migration_pending" in d else {}
    return {
        **pending,
        "schema_version": d["schema_version"],
        "integrity": d["integrity"],
        "responses": d["responses"],
        "bytes": d["responses_bytes"],
        "file_bytes": d["file_bytes"],
        "evicted": d["responses_evicted"],
        "expired": d["responses_expired"],
        "expired_pending": d["responses_expired_pending"],
        "oldest_created_at": d["responses_oldest_created_at"] or None,
        "conversations": {
            "turns": d["turns"],
            "calls": d["calls"],
            "bytes": d["conversation_bytes"],
            "evicted": d["conversation_evicted"],
            "expired": d["conversation_expired"],
            "expired_pending": d["conversation_expired_pending"],
        },
    }


def _redis(profile: Profile, prune: bool) -> dict[str, Any]:
    """A shared Redis store (`proxy.store: redis://...`): its counts from the server (and, for
    prune, the index trimmed and the caps applied); one line naming proxy.store when unreachable."""
    from molctl.proxy.store.redis import admin as redis_admin
    from molctl.proxy.store.redis.target import parse_redis_url, read_password

    p = profile.proxy
    target = parse_redis_url(p.store)
    password = read_password(p.store_password_file)
    bounds = {
        "ttl_s": p.store_ttl_s,
        "max_bytes": p.store_max_bytes,
        "max_entries": p.store_max_entries,
        **tenant_bounds(p),
    }
    out: dict[str, Any] = {"profile": profile.name, "backend": "redis", "path": None, "exists": True, "bounds": bounds}
    if prune:
        out["removed"] = redis_admin.prune(
            target,
            password,
            profile.name,
            p.store_ttl_s,
            p.store_max_entries,
            max_bytes=p.store_max_bytes,
            tenant_max_entries=bounds["tenant_max_entries"],
            tenant_max_bytes=bounds["tenant_max_bytes"],
        )
    out["redis"] = redis_admin.describe(target, password, profile.name)
    return out


def store_stats(name: str, ctx) -> dict[str, Any]:
    """Counts, bytes (record JSON, and the file on disk with its WAL), oldest created_at, the
    evicted/expired totals and the bounds. A memory store (`proxy.store: memory`) keeps nothing
    on disk: its counts are zeros. A Redis store: `_redis`."""
    profile = _profile(name, ctx)
    if profile.proxy.store.startswith(("redis://", "rediss://")):
        return _redis(profile, prune=False)
    base, store = _open(profile, ctx.state_dir, reads_only=True)
    try:
        return {**base, **_counts(store)}
    finally:
        if store is not None:
            store.close()


def store_prune(name: str, ctx) -> dict[str, Any]:
    """Delete the expired responses and conversation rows, then evict oldest first over the size
    caps (each on its own counts); what was removed and what remains. Opening a schema-1 file
    migrates it (the conversation tables are added; nothing is removed)."""
    from molctl.state import check_own_state_dir

    check_own_state_dir(ctx.state_dir)  # deleting from another user's store (and its records decide the profile)
    profile = _profile(name, ctx)
    if profile.proxy.store.startswith(("redis://", "rediss://")):
        return _redis(profile, prune=True)
    base, store = _open(profile, ctx.state_dir)
    try:
        removed = (
            sqlite_admin.prune(store)
            if store is not None
            else {"expired": 0, "evicted": 0, "conversation_expired": 0, "conversation_evicted": 0}
        )
        return {**base, "removed": removed, **_counts(store)}
    finally:
        if store is not None:
            store.close()
