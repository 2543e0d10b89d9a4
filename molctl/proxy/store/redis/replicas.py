"""The replica registry of proxy replicas sharing one Redis: each registers its engine under its
id (`replica:ID`, a heartbeat with a TTL) while its engine is healthy; a conversation's next
request goes to the engine of the replica that served it last while that one's heartbeat is
fresh (`engine_for`: conversation affinity), else this replica takes it over.
`Replicas` is that part of `RedisState` (molctl.proxy.store.redis.connection)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from molctl.errors import UsageError
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.store.redis.target import StoreUnavailable, _decode

log = logging.getLogger("molctl.proxy")

HEARTBEAT_S = 2.0  # a replica refreshes its registration this often...
HEARTBEAT_TTL_S = 6.0  # ...and it lapses this long after the last refresh


def default_replica_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


MAX_REPLICA_ID = 200


def check_replica_id(replica_id: str) -> str:
    """The id as given, else a UsageError (one line, exit 2): 1 to MAX_REPLICA_ID printable
    characters without whitespace. It is copied into every turn and tool-call binding, named in
    log lines and keys (a newline would forge a log line; a blank or spaced id is a templating slip)."""
    if (
        not 0 < len(replica_id) <= MAX_REPLICA_ID
        or not replica_id.isprintable()
        or any(c.isspace() for c in replica_id)
    ):
        shown = replica_id if len(replica_id) <= 40 else replica_id[:40] + "..."
        raise UsageError(
            f"--replica-id {shown!r}: expected 1 to {MAX_REPLICA_ID} printable characters without "
            "whitespace (e.g. the pod or host name)"
        )
    return replica_id


class Replicas:
    """Registration and affinity (a mixin of RedisState)."""

    async def _beat_write(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """A heartbeat write that a cancelled heartbeat does not interrupt (shielded): close()
        waits for it, so that its SET cannot reach Redis after the unregistering DEL (two
        connections: their commands are not ordered) and register a stopped replica again."""
        self._beat_pending = asyncio.ensure_future(self.call("heartbeat", fn))
        return await asyncio.shield(self._beat_pending)

    # ---------------------------------------------------------------- replicas
    def _replica_key(self, replica: str) -> str:
        return f"{self.prefix}replica:{replica}"

    def start_heartbeat(self, healthy: Callable[[], Any]) -> None:
        """Register this replica (its advertised engine) every heartbeat_s while `await healthy()`
        is true; an unhealthy engine is unregistered, so peers take its conversations over."""
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(healthy))

    async def _beat(self, healthy: Callable[[], Any]) -> None:
        """`instance` (random per process) tells another writer under this id apart: what the
        key held at our next beat must be our own previous beat (SET ... GET), else two proxies
        share the id (logged once; each then takes the other's conversations for its own)."""
        key = self._replica_key(self.replica_id)
        instance = os.urandom(8).hex()
        wrote, warned = False, False
        while True:
            try:
                ok = bool(await healthy())
                beat = json.dumps({"upstream": self.advertise_upstream, "at": self.clock(), "instance": instance})
                if ok:
                    old = await self._beat_write(
                        lambda beat=beat: self.command("SET", key, beat, "PX", int(self.heartbeat_ttl_s * 1000), "GET")
                    )
                    prior = _decode(old) if old else None
                    if wrote and old and not warned and (prior is None or prior.get("instance") != instance):
                        warned = True
                        log.warning(
                            "replica id %s is also used by another proxy (engine %s): give each replica its own "
                            "--replica-id; until then each takes the other's conversations for its own (no affinity)",
                            self.replica_id,
                            (prior or {}).get("upstream"),
                        )
                    wrote = True
                else:
                    await self._beat_write(lambda: self.command("DEL", key))
                    wrote = False
            except StoreUnavailable:
                pass
            except Exception:  # a bug here must not end the heartbeat for good
                log.exception("replica heartbeat failed")
            await asyncio.sleep(self.heartbeat_s)

    async def engine_for(self, owner: str | None) -> EngineChoice | None:
        """The engine of the replica that served the conversation last, when that is another
        replica with a fresh heartbeat; None: this replica's own engine (it takes over)."""
        if owner is None or owner == self.replica_id:
            return None
        now = time.monotonic()
        checked = self._peers.get(owner)
        if checked is None or now - checked[0] > min(1.0, self.heartbeat_s):
            try:
                raw = await self.call("heartbeat read", lambda: self.command("GET", self._replica_key(owner)))
            except StoreUnavailable:
                return None
            # fresh while the key lives: its TTL runs on the Redis server's clock (the replicas'
            # wall clocks may disagree; `at` is informational)
            beat = _decode(raw, upstream=str) if raw else None
            if raw and beat is None:
                self.unreadable("heartbeat", self._replica_key(owner))
            upstream = beat["upstream"] if beat else None
            checked = (now, upstream)
            self._peers[owner] = checked
        return EngineChoice(owner, checked[1]) if checked[1] else None
