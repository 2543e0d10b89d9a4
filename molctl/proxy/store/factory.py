"""The one place a `proxy.store` spec becomes stores: `parse_store_spec` / `resolve_store` (what
`sqlite`, `memory`, `sqlite:/abs/path` and `redis[s]://...` name), `open_store` (the record store
of a local spec), `open_stores` (everything `molctl proxy` serves from: `Stores`), and
`tenant_bounds` (a profile's per-tenant quotas, the same on every backend)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from molctl import profilechecks
from molctl.proxy.store.base import TENANT_SHARE, ConversationStore, RecordStore, ResponseStore
from molctl.proxy.store.memory import MemoryResponseStore
from molctl.proxy.store.sqlite.conversations import SqliteConversationStore
from molctl.proxy.store.sqlite.schema import store_path
from molctl.proxy.store.sqlite.store import SqliteResponseStore

log = logging.getLogger("molctl.proxy")


@dataclass
class Stores:
    """What a proxy serves from: the Responses records, chat's conversation state (None: the app's
    own MemoryStore), and a shared store's connection (`shared`: its heartbeat, closed by the app)."""

    responses: RecordStore | ResponseStore
    conversations: ConversationStore | None = None
    shared: Any = None

    def close(self) -> None:
        """Close a local record store (a shared one is closed by the app's shutdown)."""
        if self.shared is None:
            self.responses.close()


def open_stores(
    profile, state_dir: Path, upstream: str, port: int, replica_id: str | None, advertise_upstream: str | None
) -> Stores:
    """The stores of `molctl proxy` for this profile's `proxy.store`. A Redis store that does not
    answer, or a local store that cannot be opened, is one line and a non-zero exit (nothing served)."""
    shared = build_shared_state(profile, upstream, port, replica_id, advertise_upstream)
    if shared is not None:
        from molctl.proxy.store.redis.conversations import RedisConversationStore
        from molctl.proxy.store.redis.responses import RedisResponseStore

        return Stores(
            RedisResponseStore(shared),
            RedisConversationStore(shared, summary_wait_s=profile.proxy.summary_wait_s),
            shared,
        )
    store = build_response_store(profile, state_dir)
    try:
        return Stores(store, build_conversation_store(store))
    except BaseException:
        store.close()
        raise


def tenant_bounds(proxy: Any) -> dict[str, int]:
    """A profile's per-tenant quotas (its `proxy` section): `store_tenant_max_bytes` and
    `store_tenant_max_entries`, by default a quarter (TENANT_SHARE) of `store_max_bytes` and
    `store_max_entries` (at least 1), never above them."""
    out = {}
    for name, cap in (("bytes", proxy.store_max_bytes), ("entries", proxy.store_max_entries)):
        value = getattr(proxy, f"store_tenant_max_{name}", None)
        out[f"tenant_max_{name}"] = min(cap, value) if value is not None else max(1, cap // TENANT_SHARE)
    return out


def parse_store_spec(spec: str) -> tuple[str, Path | None]:
    """'sqlite' -> ('sqlite', None: the default file), 'memory' -> ('memory', None),
    'sqlite:/abs/file.sqlite3' -> ('sqlite', that path). ValueError names what is wrong."""
    if spec in ("sqlite", "memory"):
        return spec, None
    if spec.startswith(("redis://", "rediss://")):  # shared by proxy replicas
        from molctl.proxy.store.redis.target import parse_redis_url

        parse_redis_url(spec)
        return "redis", None
    if spec.startswith("sqlite:"):
        path = spec[len("sqlite:") :]
        if not path or not os.path.isabs(path):
            raise ValueError(f"{spec!r}: the path after 'sqlite:' must be absolute")
        return "sqlite", Path(path)
    shown = re.sub(r"^([^:/]*://).*@", r"\1***@", spec)  # a URL's user part may hold a password: never echoed
    raise ValueError(
        f"{shown!r}: expected 'sqlite', 'memory', 'sqlite:/absolute/path.sqlite3', redis://host:port/db "
        "or rediss://host:port/db"
    )


def _store_field_problem(proxy) -> tuple[str, str] | None:
    """`proxy.store` of a profile (registered with molctl.profilechecks)."""
    try:
        parse_store_spec(proxy["store"])
    except ValueError as exc:
        return "proxy.store", str(exc)
    return None


profilechecks.register("proxy.store", _store_field_problem)


def resolve_store(spec: str, state_dir: Path, profile: str) -> tuple[str, Path | None]:
    """The backend and (for sqlite) the file of a `proxy.store` value for this profile."""
    kind, path = parse_store_spec(spec)
    if kind == "sqlite" and path is None:
        path = store_path(state_dir, profile)
    return kind, path


def open_store(spec: str, state_dir: Path, profile: str, **bounds: Any) -> RecordStore:
    """The response store a proxy of this profile uses (`proxy.store` / `molctl proxy --store`)."""
    kind, path = resolve_store(spec, state_dir, profile)
    if kind == "memory":
        mem = {k: v for k, v in bounds.items() if k in ("max_entries", "ttl_s", "clock")}  # no disk: no commit delay
        return MemoryResponseStore(**mem)
    if path.parent == Path(state_dir) / profile:  # the default place: created like the rest of the state dir
        from molctl.state import ensure_state_dir

        ensure_state_dir(Path(state_dir))
        path.parent.mkdir(mode=0o700, exist_ok=True)
    return SqliteResponseStore(path, **bounds)


def build_response_store(profile, state_dir: Path):
    """The Responses API's store of this profile (`proxy.store` and its bounds): SQLite in
    STATE/PROFILE/proxy-store.sqlite3 by default (see molctl.proxy.store.sqlite.store)."""
    p = profile.proxy
    store = open_store(
        p.store,
        state_dir,
        profile.name,
        ttl_s=p.store_ttl_s,
        max_bytes=p.store_max_bytes,
        max_entries=p.store_max_entries,
        commit_delay_s=p.state_commit_ms / 1000,
        **tenant_bounds(p),
    )
    log.info("response store: %s", store.path if isinstance(store, SqliteResponseStore) else "memory (lost on restart)")
    return store


def build_conversation_store(response_store):
    """Stateless chat's conversation state in the same SQLite file when `proxy.store` is sqlite
    (durable across restarts); None for a memory store (the app keeps a MemoryStore)."""
    if isinstance(response_store, SqliteResponseStore):
        return SqliteConversationStore(response_store)
    return None


def build_shared_state(profile, upstream: str, port: int, replica_id: str | None, advertise_upstream: str | None):
    """For `proxy.store: redis://...` (replicas sharing their state): the RedisState of this
    replica, after one PING (2 s) so that an unreachable store fails the start with one line
    naming proxy.store and its address (exit 1). None for the local backends."""
    from molctl.proxy.store.redis.connection import RedisState
    from molctl.proxy.store.redis.replicas import default_replica_id
    from molctl.proxy.store.redis.target import (
        is_redis_spec,
        parse_redis_url,
        ping_sync,
        read_password,
        unreachable_error,
    )

    p = profile.proxy
    if not is_redis_spec(p.store):
        return None
    target = parse_redis_url(p.store)  # validated with the profile
    password = read_password(p.store_password_file)
    why = ping_sync(target, password)
    if why is not None:
        raise unreachable_error(target, why)
    advertised = advertise_upstream or p.advertise_upstream or upstream
    _check_advertised(
        advertised,
        "--advertise-upstream"
        if advertise_upstream
        else "proxy.advertise_upstream"
        if p.advertise_upstream
        else "--upstream",
    )
    state = RedisState(
        target,
        password,
        profile.name,
        replica_id=replica_id or default_replica_id(port),
        advertise_upstream=advertised,
        ttl_s=p.store_ttl_s,
        max_entries=p.store_max_entries,
        max_bytes=p.store_max_bytes,
        call_timeout_s=p.store_call_timeout_s,
        **tenant_bounds(p),
    )
    log.info(
        "state store: %s (shared; replica %s, engine advertised as %s)",
        target.address,
        state.replica_id,
        state.advertise_upstream,
    )
    return state


def _check_advertised(url: str, label: str) -> None:
    """The engine URL this replica registers for its peers: an http(s) URL with a host and at
    most a path (peers would fail every hop to anything else; a `user:password@` would be stored
    in the shared store in clear and read by every peer), else a UsageError (one line, exit 2)."""
    from urllib.parse import urlsplit

    from molctl.errors import UsageError

    expected = "expected http://HOST:PORT, this replica's engine as its peers reach it"
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"{label} {url!r}: {expected}")
    if parts.username is not None or parts.password is not None:
        shown = url.replace(parts.netloc, parts.netloc.rpartition("@")[2], 1)
        raise UsageError(
            f"{label} {shown!r} carries a user name or password: {expected} (peers read it from the "
            "shared store in clear), without credentials"
        )
    if parts.query or parts.fragment:
        raise UsageError(f"{label} {url!r} has a query or fragment: {expected}[/PATH]")
