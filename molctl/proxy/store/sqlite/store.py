"""The durable backend of the proxy's state: `SqliteResponseStore`, one SQLite file per profile
in the state dir (default `STATE/PROFILE/proxy-store.sqlite3`, mode 0600), with the stdlib `sqlite3`.

It holds the Responses records (a `RecordStore`: molctl.proxy.store.sqlite.responses) and
stateless chat's rows (molctl.proxy.store.sqlite.conversations) in one file: WAL journal,
`synchronous=NORMAL`, one writer at a time (a lock in the process, SQLite's own lock across
processes: `molctl state prune` may run beside the proxy). Thread-safe: one connection behind a
lock. A file that is not a database, is corrupted, has an unknown schema or stays locked raises
`StoreError` with one line naming the file (molctl.proxy.store.sqlite.schema). `molctl state`:
molctl.proxy.store.sqlite.admin. Design, bounds and measured costs: docs/design/store.md ("SQLite")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from molctl.proxy.store.base import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, RecordStore, StoreError
from molctl.proxy.store.sqlite.conversations import Rows
from molctl.proxy.store.sqlite.responses import Responses
from molctl.proxy.store.sqlite.schema import (
    BUSY_TIMEOUT_S,
    QUICK_CHECK_S,
    SCHEMA_VERSION,
    Schema,
    _cause,
    _identity,
    _size,
    _why,
)

log = logging.getLogger("molctl.proxy")


class SqliteResponseStore(Schema, Responses, Rows, RecordStore):
    """See the module docstring and docs/design/store.md. Thread-safe (one connection behind a lock)."""

    slow_puts = True  # a put encodes JSON and commits: LocalResponses sends large ones to a worker thread

    def __init__(
        self,
        path: Path | str,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Callable[[], float] = time.time,
        create: bool = True,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        commit_delay_s: float = 0.0,
        reads_only: bool = False,
        integrity_check_s: float = QUICK_CHECK_S,
        tenant_max_bytes: int | None = None,
        tenant_max_entries: int | None = None,
        migrate: bool | None = None,
    ):
        self.path = Path(path)
        # an older schema is migrated at open, except for a reader or a check (`migrate` False, the
        # default for reads_only): looking at a store never upgrades it, which an older molctl then
        # refuses; `file_version` is the schema the file has
        self.migrate = not reads_only if migrate is None else migrate
        self.file_version = SCHEMA_VERSION
        # one tenant's (API key's) quota: over it, that tenant's own oldest responses are evicted (None:
        # the global cap, i.e. no quota of its own; the proxy passes the profile's, by default a quarter
        # of the global caps: `tenant_bounds`); the global caps still hold as a last resort
        self.tenant_max_bytes = min(max_bytes, tenant_max_bytes) if tenant_max_bytes is not None else max_bytes
        self.tenant_max_entries = (
            min(max_entries, tenant_max_entries) if tenant_max_entries is not None else max_entries
        )
        self.integrity_check_s = integrity_check_s
        # the open's quick_check: "ok", "new file", or "not finished in N s (...)"
        self.integrity = "new file"
        self.damaged: str | None = None  # the damage found while serving (then no more writes)
        self.write_failure: str | None = None  # why the last write failed, no detail (cleared by the next commit)
        # a reader (`molctl state stats`): not checked for the write lock at open (WAL readers never
        # wait for a writer; a running proxy or a long prune holding the write lock made it fail)
        self.reads_only = reads_only
        # conversation rows: 0 writes them at the end of the loop pass that queued them; > 0 holds
        # them this long first, so the rows of that window share one transaction (a group commit)
        self.commit_delay_s = commit_delay_s
        self.busy_timeout_s = busy_timeout_s
        # the loop's flush found another process's write lock (time.monotonic()): it does not wait
        # for it on the event loop, it tries again until busy_timeout_s has passed (then the rows are lost)
        self._busy_since: float | None = None
        # rows lost since the last warning and when it was logged (a disk that stays full fails every
        # window: one warning per window would be ~100 lines a second)
        self._lost_unlogged, self._loss_logged_at = 0, float("-inf")
        self.ttl_s, self.max_bytes, self.max_entries, self.clock = ttl_s, max_bytes, max_entries, clock
        self._lock = threading.Lock()
        self._last_prune = float("-inf")
        self._last_conv_prune = float("-inf")
        # conversation rows written at the end of the event-loop pass that queued them (queue_*_row, flush)
        self._pending_turns: dict[bytes, tuple] = {}
        self._pending_calls: dict[tuple[str, str], tuple] = {}
        self._pending_lock = threading.Lock()  # apart from _lock: queueing never waits for a write in progress
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        self.conv_write_errors = 0  # conversation rows that a failed flush lost (logged)
        self.migrated_from: int | None = None  # the version a v1 file was migrated from when opened
        self._conn: sqlite3.Connection | None = None
        self._open(create)

    def _open(self, create: bool) -> None:
        """The file made (create) or checked, connected, set up (see Schema._setup)."""
        if not self.path.exists():
            if not create:
                raise StoreError(f"response store {self.path}: no such file")
            self._create_file()
        elif 0 < _size(self.path) < 100:  # shorter than SQLite's header: SQLite would take a 1-byte file for
            # an empty database and write a new store over it (a 50-byte one is "not a database")
            raise StoreError(
                f"response store {self.path}: {_size(self.path)} bytes, not a database "
                "(corrupted or not a molctl store: move it aside to start with an empty store)"
            )
        try:
            self._conn = sqlite3.connect(
                str(self.path), timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
            )
            self._setup()
            self._identity = _identity(self.path)  # the file this connection writes (see `file_replaced`)
            self._replaced_logged = False
        except sqlite3.Error as exc:
            self.close()
            raise StoreError(f"response store {self.path}: {_why(exc)}", cause=_cause(exc)) from None
        except StoreError:
            self.close()
            raise

    def stats(self) -> dict[str, int]:
        """Running totals (cheap: no scan): rows (expired ones not yet pruned included), bytes of
        record JSON, evicted and expired counts since the file was created, the oldest created_at
        (0 when empty); the same for the chat conversations' rows (`conversation_*`: turns + calls).
        On the event loop (a metrics scrape) the queued rows are written without waiting for another
        process's write lock (the loop's flush: tried again later), elsewhere (the CLI) as `flush`."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
        else:
            self._flush_on_loop()
        with self._locked("stats"):
            meta = dict(self._conn.execute("SELECT key, value FROM meta"))
            oldest = self._conn.execute("SELECT min(created_at) FROM responses").fetchone()[0]
        return {
            "responses": meta.get("rows", 0),
            "responses_bytes": meta.get("bytes", 0),
            "responses_evicted": meta.get("evicted", 0),
            "responses_expired": meta.get("expired", 0),
            "responses_oldest_created_at": int(oldest or 0),
            **_conv_stats(meta),
            "file_replaced": int(self.file_replaced()),
        }

    def file_replaced(self) -> bool:
        """Whether the store's path no longer names the file this connection writes (deleted or
        replaced while the proxy runs: SQLite goes on writing the unlinked file, and all of it is
        lost when the proxy restarts). Logged once as a warning; a gauge in `stats`."""
        replaced = _identity(self.path) != self._identity
        if replaced and not self._replaced_logged:
            self._replaced_logged = True
            log.warning(
                "response store %s was deleted or replaced while this proxy runs: what it stores from now "
                "on is lost when it restarts (restart it to use the file at that path)",
                self.path,
            )
        return replaced

    def close(self) -> None:
        """Writes the queued conversation rows (a drain or shutdown loses none), then closes,
        under the lock: a put in flight in a worker thread (LocalResponses) commits first."""
        if self._conn is not None:
            self.flush()
        if self._lost_unlogged:
            log.warning("conversation state not persisted (%d rows since the last warning)", self._lost_unlogged)
            self._lost_unlogged = 0
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _locked(self, what: str):
        with self._lock:
            if self._conn is None:
                raise StoreError(f"response store {self.path}: closed")
            try:
                yield
            except sqlite3.Error as exc:
                cause = _cause(exc)
                if cause == "damaged":
                    self._damage_seen((str(exc) or type(exc).__name__).split(" with text ", 1)[0])
                raise StoreError(f"response store {self.path}: {what} failed: {_why(exc)}", cause=cause) from None


def _conv_stats(meta: dict[str, int]) -> dict[str, int]:
    return {
        "conversation_rows": meta.get("conv_rows", 0),
        "conversation_bytes": meta.get("conv_bytes", 0),
        "conversation_evicted": meta.get("conv_evicted", 0),
        "conversation_expired": meta.get("conv_expired", 0),
    }
