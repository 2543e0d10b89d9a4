"""Stateless chat's conversation state on SQLite: the `turns` and `calls` tables.

`Rows` (a mixin of SqliteResponseStore) queues the rows and writes the rows of one commit window
(or event-loop pass) in one transaction; `SqliteConversationStore` is the `ConversationStore` of
`proxy.store: sqlite` on the write-behind front (molctl.proxy.store.writebehind). Guarantees and
costs: docs/design/store.md ("SQLite: chat state")."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.base import StoreError, StoreScope
from molctl.proxy.store.local import BUSY_RETRY_S
from molctl.proxy.store.memory import MemoryStore
from molctl.proxy.store.sqlite.schema import LOSS_LOG_EVERY_S, PRUNE_EVERY_S, _rollback
from molctl.proxy.store.writebehind import WriteBehind

log = logging.getLogger("molctl.proxy")


class Rows:
    """The conversation rows (a mixin of SqliteResponseStore)."""

    # ------------------------------------------------------------------ chat conversations (rows)
    # A row is queued (its values taken now) and written with every other row queued in the same
    # event-loop pass: one transaction, after the pass that sent the answer (`flush`, scheduled with
    # call_soon), or, with `commit_delay_s` (the proxy's `proxy.state_commit_ms`), with every row
    # queued in that window after the first (call_later: a group commit). Queued rows are readable
    # at once (get_*_row looks at the queue first). Without a running loop (a worker thread, a CLI)
    # the queue is written at once.
    def queue_turn_row(self, key: bytes, record: TurnRecord) -> None:
        size = 64 + len(key) + len(record.route) + len((record.summary or "").encode())
        with self._pending_lock:
            self._pending_turns[key] = (
                record.route,
                record.summary,
                int(record.summary_failed),
                int(record.stale),
                size,
            )
        self._schedule_flush()

    def queue_call_row(self, tenant: str, call_id: str, binding: CallBinding) -> None:
        size = (
            64
            + len(tenant.encode())
            + len(call_id.encode())
            + len(binding.name.encode())
            + len(binding.arguments.encode())
        )
        with self._pending_lock:
            self._pending_calls[(tenant, call_id)] = (binding.route, binding.name, binding.arguments, size)
        self._schedule_flush()

    def put_turn_row(self, key: bytes, record: TurnRecord) -> None:
        """Queue and write now (raises StoreError when the write fails)."""
        self.queue_turn_row(key, record)
        self._write_pending(raise_errors=True)

    def put_call_row(self, tenant: str, call_id: str, binding: CallBinding) -> None:
        self.queue_call_row(tenant, call_id, binding)
        self._write_pending(raise_errors=True)

    def get_turn_row(self, key: bytes) -> tuple[str, str | None, bool, bool] | None:
        queued = self._pending_turns.get(key)
        if queued is not None:
            return queued[0], queued[1], bool(queued[2]), bool(queued[3])
        with self._locked("get turn"):
            row = self._conn.execute(
                "SELECT route, summary, summary_failed, stale FROM turns WHERE key = ? AND stamp >= ?",
                (key, self.clock() - self.ttl_s),
            ).fetchone()
        return None if row is None else (row[0], row[1], bool(row[2]), bool(row[3]))

    def get_turn_rows(self, keys: list[bytes]) -> dict[bytes, tuple[str, str | None, bool, bool]]:
        """`get_turn_row` for many keys in one SELECT per 500 (the queued rows first); absent keys
        are not in the result."""
        found: dict[bytes, tuple[str, str | None, bool, bool]] = {}
        rest = []
        for key in keys:
            queued = self._pending_turns.get(key)
            if queued is not None:
                found[key] = (queued[0], queued[1], bool(queued[2]), bool(queued[3]))
            else:
                rest.append(key)
        oldest = self.clock() - self.ttl_s
        for i in range(0, len(rest), 500):  # well under SQLite's bound on a statement's parameters
            chunk = rest[i : i + 500]
            with self._locked("get turns"):
                rows = self._conn.execute(
                    "SELECT key, route, summary, summary_failed, stale FROM turns WHERE stamp >= ? AND key IN "
                    f"({','.join('?' * len(chunk))})",
                    (oldest, *chunk),
                ).fetchall()
            for key, route, summary, failed, stale in rows:
                found[bytes(key)] = (route, summary, bool(failed), bool(stale))
        return found

    def get_call_row(self, tenant: str, call_id: str) -> CallBinding | None:
        queued = self._pending_calls.get((tenant, call_id))
        if queued is not None:
            return CallBinding(queued[0], queued[2], queued[1])
        with self._locked("get call"):
            row = self._conn.execute(
                "SELECT route, arguments, name FROM calls WHERE tenant = ? AND call_id = ? AND stamp >= ?",
                (tenant, call_id, self.clock() - self.ttl_s),
            ).fetchone()
        return None if row is None else CallBinding(*row)

    def pending_rows(self) -> int:
        """Conversation rows queued and not yet written."""
        return len(self._pending_turns) + len(self._pending_calls)

    def flush(self) -> int:
        """Write the queued conversation rows in one transaction; returns how many a failure lost
        (logged and counted in `conv_write_errors`, never raised: the callers are the event loop and close)."""
        return self._write_pending(raise_errors=False)

    def _schedule_flush(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: write now
            self.flush()
            return
        if self._flush_loop is loop:  # scheduled already (on another loop, e.g. one that closed first: again)
            return
        self._flush_loop = loop
        if self.commit_delay_s > 0:
            loop.call_later(self.commit_delay_s, self._flush_on_loop)
        else:
            loop.call_soon(self._flush_on_loop)

    def _flush_on_loop(self) -> None:
        """The scheduled flush (on the event loop): as `flush`, but another process's write lock is not
        waited for (the whole proxy would stall, `busy_timeout_s` per window): the rows stay queued and
        it tries again BUSY_RETRY_S later, for at most `busy_timeout_s`, then counts them lost."""
        self._write_pending(raise_errors=False, wait=False)

    def _take_pending(self) -> tuple[dict[bytes, tuple], dict[tuple[str, str], tuple]]:
        """The queued rows, the queue emptied. Called under the connection's lock: a reader that
        misses the queue then waits for the commit that writes them."""
        with self._pending_lock:
            self._flush_loop = None
            turns, self._pending_turns = self._pending_turns, {}
            calls, self._pending_calls = self._pending_calls, {}
        return turns, calls

    def _insert_rows(self, turns: dict[bytes, tuple], calls: dict[tuple[str, str], tuple], now: float) -> None:
        """Inside a transaction: the rows replaced (the delete triggers keep the totals right),
        expiry at most every PRUNE_EVERY_S, eviction over the caps."""
        conn = self._conn
        if turns:
            conn.executemany("DELETE FROM turns WHERE key = ?", ((k,) for k in turns))
            conn.executemany(
                "INSERT INTO turns (key, stamp, route, summary, summary_failed, stale, size) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((k, now, *v) for k, v in turns.items()),
            )
        if calls:
            conn.executemany("DELETE FROM calls WHERE tenant = ? AND call_id = ?", calls.keys())
            conn.executemany(
                "INSERT INTO calls (tenant, call_id, stamp, route, name, arguments, size) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((*k, now, *v) for k, v in calls.items()),
            )
        if not 0 <= now - self._last_conv_prune < PRUNE_EVERY_S:  # also after the clock stepped back
            self._expire_group("conversations", now)
            self._last_conv_prune = now
        self._evict_group("conversations")

    def _write_pending(self, raise_errors: bool, wait: bool = True) -> int:
        turns: dict[bytes, tuple] = {}
        calls: dict[tuple[str, str], tuple] = {}
        try:
            with self._locked("put"):
                turns, calls = self._take_pending()
                if not turns and not calls:
                    return 0
                self._refuse_if_damaged("chat state")  # the rows are counted lost
                conn = self._conn
                if wait:
                    conn.execute("BEGIN IMMEDIATE")
                elif not self._begin_now(turns, calls):
                    return 0  # queued again, retried later
                try:
                    self._insert_rows(turns, calls, self.clock())
                    conn.execute("COMMIT")
                except BaseException:
                    _rollback(conn)
                    raise
                self._busy_since = None
                self.write_failure = None
        except StoreError as exc:
            self._write_failed(exc)
            if self._conn is None:  # closed: what is still queued cannot be written any more
                with self._pending_lock:
                    turns.update(self._pending_turns)
                    calls.update(self._pending_calls)
                    self._pending_turns, self._pending_calls = {}, {}
                    self._flush_loop = None  # the next pass's rows get their own (failing, counted) flush
            lost = len(turns) + len(calls)
            if not lost:
                return 0
            self.conv_write_errors += lost
            if raise_errors:
                raise
            self._log_loss(lost, str(exc))
            return lost
        return 0

    def _log_loss(self, lost: int, why: str) -> None:
        """A warning for lost chat-state rows: at once, then at most once per LOSS_LOG_EVERY_S with
        the rows lost meanwhile (every row is counted in conv_write_errors, the metric, regardless)."""
        now = time.monotonic()
        self._lost_unlogged += lost
        since = now - self._loss_logged_at
        if since < LOSS_LOG_EVERY_S:
            return
        # rows held back mean an earlier warning (the first loss is logged at once): `since` is finite
        what = f"{self._lost_unlogged} rows" + ("" if lost == self._lost_unlogged else f" in the last {since:.0f} s")
        log.warning("conversation state not persisted (%s): %s", what, why)
        self._lost_unlogged, self._loss_logged_at = 0, now

    def _begin_now(self, turns: dict[bytes, tuple], calls: dict[tuple[str, str], tuple]) -> bool:
        """Under the lock, on the event loop: BEGIN IMMEDIATE without waiting for another process's
        write lock. Held: the rows go back to the queue (newer values queued since win) and a retry
        is scheduled, False; held past busy_timeout_s since the first try: raises (the rows are lost)."""
        if self._try_begin():
            return True
        now = time.monotonic()
        if self._busy_since is None:
            self._busy_since = now
        elif now - self._busy_since >= self.busy_timeout_s:
            self._busy_since = None  # the rows queued from now on get their own busy_timeout_s
            raise sqlite3.OperationalError("database is locked")
        self._put_back(turns, calls)
        loop = asyncio.get_running_loop()
        with self._pending_lock:
            self._flush_loop = loop
        loop.call_later(max(self.commit_delay_s, BUSY_RETRY_S), self._flush_on_loop)
        return False

    def _try_begin(self) -> bool:
        """BEGIN IMMEDIATE without waiting for another process's write lock: False when it is held."""
        conn = self._conn
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            conn.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY:
                raise
            return False
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")


class SqliteConversationStore(WriteBehind):
    """The `ConversationStore` of `proxy.store: sqlite`: a MemoryStore as the hot cache, every put
    written to the `turns` / `calls` tables of the profile's SQLite file (docs/design/store.md, "SQLite"),
    a cache miss read from there (and cached). A put queues the row; the rows queued in one
    window of the store's `commit_delay_s` (the profile's `proxy.state_commit_ms`, 10 ms) are
    written in ONE transaction when it ends (`loop.call_later`; with 0, those of one event-loop pass
    at the end of that pass, `loop.call_soon`; for a non-streamed answer after its bytes were handed
    to the socket): the request does not wait for SQLite, and the next turn of the conversation
    (which cannot come before the client has the answer) finds the record in the cache or, queued,
    in the queue. A crash loses at most the rows of the window (or pass) that was running;
    close() (the proxy's shutdown, after a drain) writes what is queued. A record's later changes are queued by its
    `on_change`; putting a record again that is already bound to the same key only recounts the
    cache (the orchestrator does so after a summary). A failed write is logged and counted
    (`write_errors`: rows lost), never a failed chat request: the cache still holds the state.

    Cost on the event loop (dev host, 2 shared cores): a queued put ~1 us; the flush, one
    transaction for all the rows queued, ~180 us for 1 row measured inside the proxy on the
    benchmark VM (2026-11-30), ~65 us for 1 row in a tight loop, ~120 us for 4, ~250 us for 16 (15 us
    a row: the commit is what a batch shares); get_turn on a cache miss
    ~10-25 us (one indexed SELECT; ~7-10 us for a key that is not there), a cache hit ~1 us."""

    def __init__(self, db: Rows, cache: MemoryStore | None = None):
        """`db`: the SqliteResponseStore that mixes `Rows` in (named by its mixin: the store
        module imports this one)."""
        super().__init__(cache)
        self.db = db
        self.read_errors = 0

    @property
    def write_errors(self) -> int:
        """Rows a failed write lost (the cache still has them for this process)."""
        return self.db.conv_write_errors

    def write_queued(self) -> int:
        """Write the queued rows now (the event loop does so at the end of the pass that queued them).
        Not named `flush`: `flush` is the contract's wait for a shared store's writes."""
        return self.db.flush()

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as exc:
            self.read_errors += 1
            log.warning("conversation state not read: %s", exc)
            return None

    def fetch_turn(self, key: bytes) -> TurnRecord | None:
        row = self._read(self.db.get_turn_row, key)
        return None if row is None else self._cached(key, row)

    def fetch_turns(self, keys: list[bytes]) -> dict[bytes, TurnRecord]:
        rows = self._read(self.db.get_turn_rows, keys) or {}
        return {key: self._cached(key, rows[key]) for key in keys if key in rows}

    def _cached(self, key: bytes, row: tuple[str, str | None, bool, bool]) -> TurnRecord:
        route, summary, failed, stale = row
        # the summary of a turn recorded by an earlier process is final: one still in flight then never comes
        record = TurnRecord(route, summary, failed or summary is None, stale)
        record.settle()
        self.bind(key, record)
        self.cache.put_turn(key, record)
        return record

    def new_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:  # noqa: ARG002
        self.db.queue_turn_row(key, record)

    def changed_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:  # noqa: ARG002
        self.db.queue_turn_row(key, record)

    def fetch_call(self, tenant: str, call_id: str) -> CallBinding | None:
        return self._read(self.db.get_call_row, tenant, call_id)

    def new_call(self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None) -> None:  # noqa: ARG002
        self.db.queue_call_row(tenant, call_id, binding)

    def backend_stats(self) -> dict[str, int]:
        """The durable rows and bytes, the errors (beside the cache's entries and bytes)."""
        out: dict[str, int] = {}
        try:
            s = self.db.stats()
            out.update(durable_rows=s["conversation_rows"], durable_bytes=s["conversation_bytes"])
        except StoreError:
            pass
        out.update(write_errors=self.db.conv_write_errors, read_errors=self.read_errors)
        return out
