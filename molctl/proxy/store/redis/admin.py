"""`molctl state stats|prune` and `molctl check` on a Redis store: `describe` and `prune` (the SQLite
store's admin has the same two functions: molctl.proxy.store.sqlite.admin), each with its own
blocking client; RedisConfigError (one line naming proxy.store) when unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from molctl.proxy.store.base import DEFAULT_MAX_BYTES
from molctl.proxy.store.redis.connection import TENANT_SHARE
from molctl.proxy.store.redis.scripts import KEY_FORMAT, PRUNE_BATCH, PRUNE_RESPONSES, RESPONSES
from molctl.proxy.store.redis.target import RedisTarget, _sync_client, _why, unreachable_error


def describe(target: RedisTarget, password: str | None, profile: str) -> dict[str, Any]:
    """What `molctl state stats` shows for a Redis store: this profile's indexed records per group
    (expired ones not yet trimmed from the index included), evicted totals, registered replicas,
    and the server's memory settings. RedisConfigError (one line) when unreachable."""
    import redis

    prefix = f"molctl:{{{profile}}}:"
    client = _sync_client(target, password)
    try:
        info = client.info("server")
        memory = client.info("memory")
        replication = client.info("replication")
        evicted = {k.decode(): int(v) for k, v in (client.hgetall(prefix + "stats") or {}).items()}
        replicas = sorted(
            k.decode()[len(prefix) + len("replica:") :] for k in client.scan_iter(prefix + "replica:*", count=100)
        )
        return {
            "address": target.address,
            "redis_version": info.get("redis_version"),
            "maxmemory": int(memory.get("maxmemory", 0)),
            "maxmemory_policy": memory.get("maxmemory_policy"),
            "used_memory": int(memory.get("used_memory", 0)),
            "responses": client.zcard(prefix + "idx:r"),
            "conversation_rows": client.zcard(prefix + "idx:conv"),
            "responses_bytes": evicted.get("r_bytes", 0),
            "tenants": client.zcard(prefix + "tn"),
            "key_format": evicted.get("format", 1 if client.exists(prefix + "idx:r") else KEY_FORMAT),
            "responses_evicted": evicted.get("r_evicted", 0),
            "conversation_evicted": evicted.get("conv_evicted", 0),
            "replicas": replicas,
            # "slave": a read-only replica (what a primary becomes after a failover); every write refused
            "role": replication.get("role"),
            "primary": (
                f"{replication.get('master_host')}:{replication.get('master_port')}"
                if replication.get("role") == "slave"
                else None
            ),
        }
    except redis.RedisError as exc:
        raise unreachable_error(target, _why(exc, password)) from None
    finally:
        client.close()


def prune(
    target: RedisTarget,
    password: str | None,
    profile: str,
    ttl_s: float,
    max_entries: int,
    clock: Callable[[], float] = time.time,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tenant_max_entries: int | None = None,
    tenant_max_bytes: int | None = None,
) -> dict[str, int]:
    """Redis expires the records itself (TTL) and each write evicts over the caps; this trims the
    index entries of expired records and evicts what is over the caps now (e.g. after a cap was
    lowered): responses under the same tenant quotas and global caps as a write (RESPONSES, in
    script calls of at most PRUNE_BATCH each), chat state over `max_entries`. Returns what it removed."""
    import redis

    prefix = f"molctl:{{{profile}}}:"
    client = _sync_client(target, password)
    out: dict[str, int] = {"expired": 0, "evicted": 0}
    t_entries = min(
        max_entries, tenant_max_entries if tenant_max_entries is not None else max(1, max_entries // TENANT_SHARE)
    )
    t_bytes = min(max_bytes, tenant_max_bytes if tenant_max_bytes is not None else max(1, max_bytes // TENANT_SHARE))
    try:
        prune = client.register_script(RESPONSES + PRUNE_RESPONSES)
        more = 1
        while more:
            expired, evicted, more = prune(
                keys=[prefix + "idx:r"],
                args=[prefix, clock(), int(max(1, ttl_s)), max_entries, max_bytes, t_entries, t_bytes, PRUNE_BATCH],
            )
            out["expired"] += expired
            out["evicted"] += evicted
        for group, name in (("conv", "conversation_"),):
            idx = prefix + "idx:" + group
            out[name + "expired"] = client.zremrangebyscore(idx, "-inf", clock() - ttl_s)
            over = client.zcard(idx) - max_entries
            victims = client.zrange(idx, 0, over - 1) if over > 0 else []
            for i in range(0, len(victims), 500):
                chunk = victims[i : i + 500]
                client.delete(*chunk)
                client.zrem(idx, *chunk)
            if victims:
                client.hincrby(prefix + "stats", f"{group}_evicted", len(victims))
            out[name + "evicted"] = len(victims)
        return out
    except redis.RedisError as exc:
        raise unreachable_error(target, _why(exc, password)) from None
    finally:
        client.close()
