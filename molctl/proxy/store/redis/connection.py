"""The connection of a proxy process to the shared store: `RedisState` (redis-py asyncio: every
call is awaited on the event loop, none blocks it), its health (degraded, retried), the batched
writes (the writes started in one turn of the loop go out in one pipeline) and the record writes
the Responses and chat views call (`put`, `put_response`, `merge_turn`). Keys are hash-tagged by
profile (PREFIX `molctl:{PROFILE}:`). The replica registry: molctl.proxy.store.redis.replicas.
Failure behaviour, costs and the key layout: docs/design/store.md ("Redis")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from molctl.proxy.store.base import DEFAULT_MAX_BYTES, DEFAULT_TTL_S
from molctl.proxy.store.redis.replicas import HEARTBEAT_S, HEARTBEAT_TTL_S, Replicas, check_replica_id
from molctl.proxy.store.redis.scripts import SCRIPT_SHA, SCRIPTS
from molctl.proxy.store.redis.target import CALL_TIMEOUT_S, RedisTarget, StoreUnavailable, _client_kwargs

log = logging.getLogger("molctl.proxy")

RETRY_S = 1.0  # while degraded, calls fail at once for this long, then one tries again
TENANT_SHARE = 4  # a tenant's default quota: a quarter of each global cap (as the SQLite store's)
MAX_CONNECTIONS = 64  # per proxy process
REFUSED_LOG_S = 60.0  # an error the server answers (OOM, NOPERM) is logged at most this often per kind


class RedisState(Replicas):
    """The connection, its health, the key layout and the replica registry (docs/design/store.md, "Redis").
    `clock`: wall time (records carry it; the caps and the heartbeats compare it across replicas)."""

    def __init__(
        self,
        target: RedisTarget,
        password: str | None,
        profile: str,
        *,
        replica_id: str,
        advertise_upstream: str,
        ttl_s: float = DEFAULT_TTL_S,
        max_entries: int = 100_000,
        call_timeout_s: float = CALL_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        heartbeat_s: float = HEARTBEAT_S,
        heartbeat_ttl_s: float = HEARTBEAT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        tenant_max_entries: int | None = None,
        tenant_max_bytes: int | None = None,
    ):
        self.target, self._password = target, password
        self.prefix = f"molctl:{{{profile}}}:"
        self.replica_id, self.advertise_upstream = check_replica_id(replica_id), advertise_upstream
        self.ttl_s, self.max_entries, self.call_timeout_s, self.clock = (
            int(max(1, ttl_s)),
            max_entries,
            call_timeout_s,
            clock,
        )
        self.heartbeat_s, self.heartbeat_ttl_s = heartbeat_s, heartbeat_ttl_s
        # the Responses records' bounds (see RESPONSES): global caps, and one tenant's (API key's) quota,
        # by default a quarter of each (as the SQLite store's: `tenant_bounds`), never above them
        self.max_bytes = max_bytes
        self.tenant_max_entries = min(
            max_entries, tenant_max_entries if tenant_max_entries is not None else max(1, max_entries // TENANT_SHARE)
        )
        self.tenant_max_bytes = min(
            max_bytes, tenant_max_bytes if tenant_max_bytes is not None else max(1, max_bytes // TENANT_SHARE)
        )
        self._pool = None  # redis-py's BlockingConnectionPool, made on first use (_connection_pool)
        self._scripts_loaded = False  # SCRIPT LOAD done on the current connection pool's server
        self._batch: list[tuple[str, list[str], list[Any], asyncio.Future]] = []
        self.degraded = False
        self.closed = False  # close() was called (see call())
        self.degraded_total = 0  # times the store went from healthy to degraded
        self.errors_total = 0  # failed or skipped calls
        self._retry_at = 0.0
        self._batches: set[asyncio.Task] = set()
        self._peers: dict[str, tuple[float, str | None]] = {}  # replica -> (checked at, upstream or None)
        self._heartbeat: asyncio.Task | None = None
        self._beat_pending: asyncio.Future | None = None  # the heartbeat's write in flight (see _beat_write)
        self._refused_logged: dict[str, float] = {}  # error kind -> when last logged (refused())
        # the last connection released while no call waited for the pool: the next call takes it
        # without the pool's locks and checks (see _exchange); (its pool, the connection)
        self._idle: tuple[Any, Any] | None = None
        self._pool_waiters = 0  # calls inside pool.get_connection()

    # ---------------------------------------------------------------- connection
    def _connection_pool(self):
        if self._pool is None:
            import redis
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff

            # one retry, on a dropped connection only (a pooled connection that died with a restarted
            # Redis reconnects instead of failing the call); no retry on a timeout: the call's own
            # timeout bounds it all, the degraded state paces the retries; at most MAX_CONNECTIONS,
            # a call waits for a free one within its own timeout (backpressure)
            kw = _client_kwargs(self.target, self._password)
            pool_kw = {k: v for k, v in kw.items() if k != "ssl"}
            pool_kw["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            # no socket read/write timeout: every use of a connection runs under the call's own timeout
            # (call()), which bounds the reads and writes already (a cancelled read disconnects); with
            # one, redis-py would run each send as a task of its own (asyncio.wait_for)
            pool_kw["socket_timeout"] = None
            if kw.get("ssl"):
                pool_kw["connection_class"] = aioredis.SSLConnection
            self._pool = aioredis.BlockingConnectionPool(
                max_connections=MAX_CONNECTIONS, timeout=self.call_timeout_s, **pool_kw
            )
            self._scripts_loaded = False
        return self._pool

    async def call(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """fn() (its commands through `command`, `transaction` or `_exchange`) awaited under
        call_timeout_s; StoreUnavailable on any failure (docs/design/store.md, "Failure behaviour")."""
        import redis

        if self.closed:
            self.errors_total += 1
            raise StoreUnavailable("closed")
        now = time.monotonic()
        if self.degraded and now < self._retry_at:
            self.errors_total += 1
            raise StoreUnavailable("degraded")
        if self.degraded:
            self._retry_at = now + RETRY_S  # this call is the one retry; the others keep failing fast
        try:
            async with asyncio.timeout(self.call_timeout_s):
                result = await fn()
        except redis.ResponseError as exc:
            # the server answered and refused this command (OOM, ACL, READONLY): it is reachable, only this call fails
            self.refused(what, exc)
            raise StoreUnavailable(str(exc)) from None
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed(what, exc)
            raise StoreUnavailable(str(exc)) from None
        if self.degraded:
            self.degraded = False
            log.warning("state store %s: reachable again; shared state restored", self.target.address)
        return result

    def refused(self, what: str, exc: BaseException) -> None:
        """Redis answered with an error (out of memory, no permission, a read-only replica): counted;
        logged once per kind of error and REFUSED_LOG_S. The store is not degraded: other calls
        (reads) still work. READONLY (the server is a replica: a failover, or proxy.store names a
        replica) also drops the connections, so the next call connects again: a promoted server, or
        a DNS name that moved to the new primary, is written at once. (Marking the store degraded
        instead made it flap: each write degraded it, the next read "recovered" it.)"""
        self.errors_total += 1
        why = str(exc) or type(exc).__name__
        # a script's errors read "Error running script ...: -READONLY ..." / "... OOM ... maxmemory"
        kind = "maxmemory" if "maxmemory" in why else "readonly" if "READONLY" in why else type(exc).__name__
        if kind == "readonly":
            self._drop_pool()
        now = time.monotonic()
        if now - self._refused_logged.get(kind, -REFUSED_LOG_S) >= REFUSED_LOG_S:
            self._refused_logged[kind] = now
            hint = ""
            if kind == "maxmemory":
                hint = (
                    "; Redis is at maxmemory and evicts nothing: set maxmemory-policy volatile-lru (every molctl key "
                    "has a TTL) or raise maxmemory"
                )
            elif kind == "readonly":
                hint = (
                    "; the server is a read-only replica (a failover?): proxy.store must name the primary; "
                    "reconnecting on every refusal, Responses requests that store state get 503 meanwhile"
                )
            log.warning(
                "state store %s: %s refused by the server (%s)%s; counted in store_errors_total",
                self.target.address,
                what,
                why,
                hint,
            )

    def unreadable(self, what: str, key: str) -> None:
        """A stored value that is not what molctl writes there: ignored (as absent), counted, and
        logged at most once per REFUSED_LOG_S."""
        self.errors_total += 1
        now = time.monotonic()
        if now - self._refused_logged.get("unreadable", -REFUSED_LOG_S) >= REFUSED_LOG_S:
            self._refused_logged["unreadable"] = now
            log.warning(
                "state store %s: an unreadable %s at %s was ignored (treated as absent; written by another "
                "molctl version or by hand?); counted in store_errors_total",
                self.target.address,
                what,
                key,
            )

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors_total += 1
        self._retry_at = time.monotonic() + RETRY_S
        if not self.degraded:
            self.degraded = True
            self.degraded_total += 1
            why = str(exc) or type(exc).__name__
            log.warning(
                "state store %s: %s failed (%s); degraded: chat continues without shared state, "
                "Responses requests that need it get 503 until it is back",
                self.target.address,
                what,
                why,
            )
        self._drop_pool()  # a timed-out connection may hold a half-read reply: the next call starts clean

    def _drop_pool(self) -> None:
        """Close the connections (in the background); the next call connects again."""
        pool, self._pool, self._idle = self._pool, None, None  # closing the pool disconnects the idle one too
        if pool is not None:
            asyncio.get_running_loop().create_task(_close_quietly(pool))

    async def available(self) -> None:
        """Raise StoreUnavailable unless a PING answers (fast when degraded: see call())."""
        await self.call("ping", lambda: self.command("PING"))

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
            pending, self._beat_pending = self._beat_pending, None
            if pending is not None:
                await asyncio.wait([pending], timeout=self.call_timeout_s * 2)
                if pending.done() and not pending.cancelled():
                    pending.exception()  # retrieved: a failed beat is counted by call() already
            try:
                await self.call("unregister", lambda: self.command("DEL", self._replica_key(self.replica_id)))
            except StoreUnavailable:
                pass
        if self._batches:  # writes started before close go out first (after it they reopened a client nobody closed)
            await asyncio.wait(list(self._batches), timeout=self.call_timeout_s * 2)
        self.closed = True  # from now on every call fails at once (StoreUnavailable): none reopens a client
        pool, self._pool, self._idle = self._pool, None, None
        if pool is not None:
            await _close_quietly(pool)

    def stats(self) -> dict[str, int]:
        return {
            "store_degraded": int(self.degraded),
            "store_degraded_total": self.degraded_total,
            "store_errors_total": self.errors_total,
        }

    # ---------------------------------------------------------------- records
    def put(self, key: str, group: str, value: bytes) -> asyncio.Future:
        """Store a record (TTL, the group's cap), started now: its future, to await (see _write)."""
        args = [value, self.ttl_s, self.clock(), self.max_entries, f"{group}_evicted"]
        return self._write("put", [key, self.prefix + "idx:" + group, self.prefix + "stats"], args)

    def put_response(
        self, key: str, tenant: str, value: bytes, previous: str = "", messages: list[bytes] | tuple[()] = ()
    ) -> asyncio.Future:
        """Store a Responses record under its tenant's quota and the global caps (RESPONSES), with
        its conversation `messages` (each one's JSON) in a chain (PUT_RESPONSE: only the new ones
        when `previous`, the key of the response it continues, is its chain's newest), started
        now: its future (how many responses it evicted; see _write)."""
        args = [
            self.prefix,
            value,
            self.ttl_s,
            self.clock(),
            tenant,
            self.max_entries,
            self.max_bytes,
            self.tenant_max_entries,
            self.tenant_max_bytes,
            previous,
            *messages,
        ]
        return self._write("rput", [key], args)

    def merge_turn(self, key: str, value: bytes) -> asyncio.Future:
        """Merge a turn's state (a later state is never overwritten), started now: its future, to
        await (the merged turn's JSON; see _write)."""
        args = [value, self.ttl_s, self.clock(), self.max_entries, "conv_evicted"]
        return self._write("turn", [key, self.prefix + "idx:conv", self.prefix + "stats"], args)

    def _write(self, script: str, keys: list[str], args: list[Any]) -> asyncio.Future:
        """Writes are batched: those started in one turn of the event loop (concurrent requests,
        summaries) go out in one pipeline, one round trip (each socket write costs CPU that
        concurrent requests would otherwise queue behind). The write's future: its script's reply,
        or StoreUnavailable. RuntimeError without a running loop in this thread."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._batch:  # the batch's task starts at the next turn of the loop, after this turn's writes
            self._track_batch(loop.create_task(self._send_batch()))
        self._batch.append((script, keys, args, future))
        return future

    async def _exchange(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send `commands` in one round trip on one connection of the pool and read their replies in
        order; an error the server answers (a ResponseError: NOSCRIPT, OOM, READONLY) is returned in
        its command's place, as a pipeline with raise_on_error=False does (what a redis-py pipeline
        does, without its command stack and callbacks: the replies are raw). Any other failure on
        the way (a timeout, a cancellation, a reply cut mid-way) disconnects the connection before it
        goes back to the pool: a half-read reply is never read by the next call. A connection that
        turns out dropped (ConnectionError: e.g. Redis restarted since it was last used) is
        connected again and the commands sent once more; a timeout is never retried. The connection
        comes from the pool (MAX_CONNECTIONS, a call waits for one within pool.timeout), or is the
        one the previous call kept aside (`_idle`: only while no call waits for the pool)."""
        import redis

        pool = self._connection_pool()
        idle, self._idle = self._idle, None
        if idle is not None and idle[0] is pool:
            conn = idle[1]
        else:
            self._pool_waiters += 1
            try:
                conn = await pool.get_connection()  # at most MAX_CONNECTIONS: waits within pool.timeout (backpressure)
            finally:
                self._pool_waiters -= 1
        try:
            packed = conn.pack_commands(commands)
            for attempt in (1, 2):
                try:
                    await conn.send_packed_command(packed, check_health=False)
                    replies: list[Any] = []
                    for _ in commands:
                        try:
                            replies.append(await conn.read_response())
                        except redis.ResponseError as exc:  # the whole reply was read: the connection is clean
                            replies.append(exc)
                    return replies
                except redis.ConnectionError:
                    await conn.disconnect(nowait=True)
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            current = self._pool is pool
            # kept for the next call only while nobody waits for the pool (it counts as in use there)
            if current and self._idle is None and not self._pool_waiters and conn.is_connected:
                self._idle = (pool, conn)
            else:
                if not current:  # a pool dropped meanwhile (_failed, close) closed its connections already
                    await conn.disconnect(nowait=True)  # this one reconnected since (the retry): closed too
                await pool.release(conn)

    async def command(self, *args: Any) -> Any:
        """One command, one round trip (see _exchange); its raw reply (bytes, a list, None...)."""
        reply = (await self._exchange([args]))[0]
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def transaction(self, *commands: tuple[Any, ...]) -> list[Any]:
        """`commands` in MULTI/EXEC, one round trip; their replies (EXEC's). A refused command
        (an error at queueing) raises it, as EXEC then aborts the whole transaction."""
        replies = await self._exchange([("MULTI",), *commands, ("EXEC",)])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies[-1]

    async def _load_scripts(self) -> None:
        shas = await self._exchange([("SCRIPT", "LOAD", source) for source in SCRIPTS.values()])
        for sha in shas:
            if isinstance(sha, BaseException):
                raise sha
        SCRIPT_SHA.update(zip(SCRIPTS, (sha.decode() for sha in shas), strict=True))
        self._scripts_loaded = True

    async def script(self, what: str, name: str, keys: list[str], args: list[Any]) -> Any:
        """One script call (a read: not batched), one round trip; a Redis that lost its scripts
        (restarted, SCRIPT FLUSH) gets them again within the same call."""
        import redis

        async def run():
            if not self._scripts_loaded:
                await self._load_scripts()
            try:
                return await self.command("EVALSHA", SCRIPT_SHA[name], len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                await self._load_scripts()
                return await self.command("EVALSHA", SCRIPT_SHA[name], len(keys), *keys, *args)

        return await self.call(what, run)

    def _track_batch(self, task: asyncio.Task) -> None:
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _send_batch(self) -> None:
        import redis

        batch, self._batch = self._batch, []

        def run(entries):
            return self._exchange(
                [("EVALSHA", SCRIPT_SHA[script], len(keys), *keys, *args) for script, keys, args, _ in entries]
            )

        async def send():
            if not self._scripts_loaded:
                await self._load_scripts()
            results = await run(batch)
            # NOSCRIPT: the server lost the scripts (restarted under a live connection, SCRIPT FLUSH,
            # a failover): load them again and send those writes once more, within this call
            missing = [i for i, result in enumerate(results) if isinstance(result, redis.exceptions.NoScriptError)]
            if missing:
                await self._load_scripts()
                for i, result in zip(missing, await run([batch[i] for i in missing]), strict=True):
                    results[i] = result
            return results

        try:
            results = await self.call("write", send)
        except StoreUnavailable as exc:
            results = [exc] * len(batch)
        for (_, _, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, redis.exceptions.NoScriptError):
                self._scripts_loaded = False  # lost again at once: loaded again by the next batch
            if isinstance(result, BaseException):
                if not isinstance(result, StoreUnavailable):
                    self.refused("write", result)
                future.set_exception(result if isinstance(result, StoreUnavailable) else StoreUnavailable(str(result)))
            else:
                future.set_result(result)


async def _close_quietly(pool) -> None:
    """Close the pool's connections."""
    try:
        await pool.aclose()
    except Exception:  # noqa: BLE001 - the connection is being dropped anyway
        pass
