"""The durable backend of the proxy's state (the Responses API's records, and stateless chat's
conversations: `SqliteConversationStore`, below): `SqliteResponseStore`, one SQLite file per
profile in the state dir (default `STATE/PROFILE/proxy-store.sqlite3`, mode 0600).

It implements `molctl.proxy.response_store.ResponseStore` (records: see that module) with the
stdlib `sqlite3`:
  - WAL journal, `synchronous=NORMAL` (a committed response survives a proxy crash or restart;
    the last transactions may be lost on a power cut), one writer at a time (a lock in the process,
    SQLite's own lock across processes: `molctl state prune` may run beside the proxy);
  - one table `responses`: the record's scalar fields as columns (`tenant`, `id`, `created_at`,
    `previous_response_id`, `route`), its structured fields JSON-serialised (`messages`,
    `input_items`, `response`, and `extra` for any other key), `size` (the bytes of those JSON
    texts); a unique index on (tenant, id) for the hot-path lookup, an index on created_at for
    expiry and eviction; running totals (rows, bytes, evicted, expired) kept in a `meta` table by
    triggers, so the caps are checked without a scan;
  - the schema version in `PRAGMA user_version` (SCHEMA_VERSION = 3); a version-1 or -2 file is
    migrated in place in one transaction (tables added, see below and CHAIN_SCHEMA; every row kept
    and read in its own shape); a file with any other version is refused with one line;
  - a chain's shared history is stored once (schema 3, CHAIN_SCHEMA): a response continuing the
    newest response of its chain writes only its new messages (a segment), so a 50-turn chain's
    bytes and each write's cost grow linearly, not quadratically; reading a response joins its
    chain's segments. A chain's segments stay while any response of it lives (an evicted, expired
    or deleted ancestor is itself a 404; its descendants keep their whole conversation);
  - bounds: `ttl_s` (30 days by default, as the API: an expired record is invisible at once and
    deleted by the next `put_response` that passes the prune interval, or by `prune()`), and
    `max_entries` / `max_bytes`, and per tenant (API key) `tenant_max_entries` / `tenant_max_bytes`:
    a tenant over its quota evicts its own oldest responses, never another's; over a global cap the
    tenant holding the most evicts its oldest (`_evict_responses`; counted in `stats()`);
  - a file that is not a database, is corrupted, has an unknown schema or stays locked by another
    process raises `StoreError` with one line naming the file: the proxy refuses to start rather
    than serve from a silently empty store. An existing file is checked with `PRAGMA quick_check`
    when it is opened, for at most `integrity_check_s` (QUICK_CHECK_S; a larger file is checked in
    part, `integrity` says so): a damaged one raises StoreError (cause "damaged") saying what to
    do. Damage found later (a read SQLite reports corrupt, a record whose JSON does not parse)
    is a StoreError with cause "damaged" too, logged once; from then on the store takes no more
    writes (`damaged`), so nothing new goes into a damaged file.

Cost (bench/bench_store.py, BENCHMARKS.md; the CI host, 2 shared cores): per Responses request
(one get + one put: a committed transaction, WAL, synchronous=NORMAL) ~0.1 ms for a 2 KiB record
(get ~20 us) and ~0.22 ms for 32 KiB, i.e. within the 0.3 ms budget: these calls run ON THE EVENT
LOOP, a thread hop would cost about as much as the call. A record of hundreds of KiB (a long chain:
`messages` holds the whole conversation) costs ~2 ms at 256 KiB: the proxy puts large records from
a worker thread (`LocalResponses` in molctl.proxy.response_store); the store is thread-safe (one connection shared
across threads behind the lock). p99 is dominated by SQLite's automatic WAL checkpoints (an fsync
every ~4 MB written) and the garbage collector: 4-60 ms on that host.

Stateless chat's conversation state lives in the same file (schema version 2): `SqliteConversationStore`
(the `ConversationStore` of `molctl.proxy.conversations`) keeps a `MemoryStore` as its hot cache and
writes through to two more tables, `turns` (the 32-byte prefix key -> route, summary, summary_failed,
stale) and `calls` ((tenant, call_id) -> route, name, canonical arguments), so folds with their
summaries and tool stickiness survive a proxy restart and `molctl down`/`up`. A turn's later changes
(its summary arriving or failing, being marked stale) reach the disk through `TurnRecord.on_change`.
A record read back after a restart has `done` already set (a summary that was in flight when the old
process stopped never comes: the turn folds verbatim, as a failed summary does). The asyncio.Event
of an in-flight summary exists in memory only. Bounds: the same `ttl_s` (from the record's last
write), `max_entries` and `max_bytes`, counted for the conversation rows (turns + calls together)
apart from the responses, oldest write first; `stats()` and `molctl state stats` show them.
Cost, measured on the dev host (2000 calls each, a temp file): a put_turn / put_call / persisted
set_summary (one committed single-row transaction) ~65-110 us, a get that misses the memory cache
(one indexed single-row SELECT) ~10-25 us found, ~7-10 us absent, a cache hit ~1 us: on the event
loop (a thread hop costs as much). Since issue 10 these puts are queued and the rows of one
event-loop pass are written in one transaction at the end of the pass (`queue_turn_row`, `flush`;
SqliteConversationStore explains the guarantees): a chat turn no longer waits for SQLite, and at
128 clients a transaction carries several turns. A request whose history holds turns this proxy
never answered pays the absent lookup per turn.
A v1 file (responses only) is migrated in place when opened: the new tables are added in one
transaction, nothing is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molctl.errors import MolctlError
from molctl.proxy.conversations import CallBinding, MemoryStore, TurnRecord
from molctl.proxy.response_store import BUSY_RETRY_S, DEFAULT_TTL_S, MemoryResponseStore, ResponseRecord, StoreBusy

log = logging.getLogger("molctl.proxy")

SCHEMA_VERSION = 3  # 1: responses only; 2: + turns, calls (chat conversations); 3: + chains, tenants (issue 32)
STORE_FILE = "proxy-store.sqlite3"
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024  # 1 GiB of record JSON
DEFAULT_MAX_ENTRIES = 100_000
TENANT_SHARE = 4  # a tenant's default quota: a quarter of each global cap (proxy.store_tenant_max_*)
EVICT_BATCH = 64  # eviction reads its candidates this many at a time
BUSY_TIMEOUT_S = 2.0  # how long a call waits for another process's write lock before "locked"
PRUNE_EVERY_S = 60.0  # expired rows are deleted by a put at most this often (they are invisible anyway)
LOSS_LOG_EVERY_S = 10.0  # lost chat-state rows: one warning at once, then at most one per this many seconds
WRITE_CAUSES = {
    "ENOSPC": "ENOSPC: no space left on the device",
    "EIO": "EIO: a disk I/O error",
    "damaged": "the store is damaged",
}
QUICK_CHECK_S = 5.0  # PRAGMA quick_check at open, at most this long (a larger file is checked in part)
DAMAGED_ADVICE = (
    "stop the proxy, then move the file aside with its -wal and -shm files to start with an empty "
    "store, or recover what it holds with `sqlite3 FILE .recover | sqlite3 NEW`"
)

COLUMNS = ("tenant", "id", "created_at", "previous_response_id", "route")
JSON_COLUMNS = ("messages", "input_items", "response")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    previous_response_id TEXT,
    route TEXT,
    messages TEXT NOT NULL,
    input_items TEXT NOT NULL,
    response TEXT NOT NULL,
    extra TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS responses_tenant_id ON responses (tenant, id);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('rows', 0), ('bytes', 0), ('evicted', 0), ('expired', 0);
CREATE TRIGGER IF NOT EXISTS responses_ins AFTER INSERT ON responses BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'rows';
    UPDATE meta SET value = value + NEW.size WHERE key = 'bytes';
END;
CREATE TRIGGER IF NOT EXISTS responses_del AFTER DELETE ON responses BEGIN
    UPDATE meta SET value = value - 1 WHERE key = 'rows';
    UPDATE meta SET value = value - OLD.size WHERE key = 'bytes';
END;
"""

# version 2: stateless chat's conversations (a v1 file gains these in place, see _setup)
CONVERSATION_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    key BLOB PRIMARY KEY,
    stamp REAL NOT NULL,
    route TEXT NOT NULL,
    summary TEXT,
    summary_failed INTEGER NOT NULL,
    stale INTEGER NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_stamp ON turns (stamp);
CREATE TABLE IF NOT EXISTS calls (
    tenant TEXT NOT NULL,
    call_id TEXT NOT NULL,
    stamp REAL NOT NULL,
    route TEXT NOT NULL,
    name TEXT NOT NULL,
    arguments TEXT NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (tenant, call_id)
);
CREATE INDEX IF NOT EXISTS calls_stamp ON calls (stamp);
INSERT OR IGNORE INTO meta (key, value) VALUES ('conv_rows', 0), ('conv_bytes', 0), ('conv_evicted', 0), ('conv_expired', 0);
CREATE TRIGGER IF NOT EXISTS turns_ins AFTER INSERT ON turns BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'conv_rows';
    UPDATE meta SET value = value + NEW.size WHERE key = 'conv_bytes';
END;
CREATE TRIGGER IF NOT EXISTS turns_del AFTER DELETE ON turns BEGIN
    UPDATE meta SET value = value - 1 WHERE key = 'conv_rows';
    UPDATE meta SET value = value - OLD.size WHERE key = 'conv_bytes';
END;
CREATE TRIGGER IF NOT EXISTS calls_ins AFTER INSERT ON calls BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'conv_rows';
    UPDATE meta SET value = value + NEW.size WHERE key = 'conv_bytes';
END;
CREATE TRIGGER IF NOT EXISTS calls_del AFTER DELETE ON calls BEGIN
    UPDATE meta SET value = value - 1 WHERE key = 'conv_rows';
    UPDATE meta SET value = value - OLD.size WHERE key = 'conv_bytes';
END;
"""
TABLES = {"responses", "meta", "turns", "calls", "chains", "segments", "tenants"}

# version 3 (issue 32): a chain's shared history stored once, and per-tenant totals. A response that
# continues the newest response of its chain (`previous_response_id` naming the chain's tip) stores
# only its new messages as one `segments` row ([start, stop) of the conversation) in that chain; any
# other response (a first one, a fork from an older response, a continuation of a v2 row) starts a
# chain of its own with its whole conversation as one segment. `responses.messages` of such a row
# is '[]' (a v2 row keeps its whole conversation there, chain NULL: both shapes are read). A chain
# lives while a response references it (`refs`); when its tip goes, the segments past the newest
# response left are dropped (`length`). `tenants`: rows and bytes (responses + segments) per tenant,
# kept by the triggers as `meta` is, so the quotas are checked without a scan.
CHAIN_SCHEMA = """
ALTER TABLE responses ADD COLUMN chain INTEGER;
ALTER TABLE responses ADD COLUMN n_messages INTEGER;
CREATE TABLE IF NOT EXISTS chains (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    length INTEGER NOT NULL,
    refs INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS segments (
    chain INTEGER NOT NULL,
    start INTEGER NOT NULL,
    stop INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    messages TEXT NOT NULL,
    size INTEGER NOT NULL,
    PRIMARY KEY (chain, start)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tenants (tenant TEXT PRIMARY KEY, rows INTEGER NOT NULL, bytes INTEGER NOT NULL) WITHOUT ROWID;
INSERT INTO tenants (tenant, rows, bytes) SELECT tenant, count(*), sum(size) FROM responses GROUP BY tenant;
CREATE INDEX IF NOT EXISTS responses_tenant_created_at ON responses (tenant, created_at);
CREATE INDEX IF NOT EXISTS responses_chain ON responses (chain, n_messages) WHERE chain IS NOT NULL;
DROP TRIGGER IF EXISTS responses_ins;
DROP TRIGGER IF EXISTS responses_del;
CREATE TRIGGER responses_ins AFTER INSERT ON responses BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'rows';
    UPDATE meta SET value = value + NEW.size WHERE key = 'bytes';
    INSERT INTO tenants (tenant, rows, bytes) VALUES (NEW.tenant, 1, NEW.size)
        ON CONFLICT (tenant) DO UPDATE SET rows = rows + 1, bytes = bytes + NEW.size;
    UPDATE chains SET refs = refs + 1 WHERE id = NEW.chain;
END;
CREATE TRIGGER responses_del AFTER DELETE ON responses BEGIN
    UPDATE meta SET value = value - 1 WHERE key = 'rows';
    UPDATE meta SET value = value - OLD.size WHERE key = 'bytes';
    UPDATE tenants SET rows = rows - 1, bytes = bytes - OLD.size WHERE tenant = OLD.tenant;
    UPDATE chains SET refs = refs - 1 WHERE id = OLD.chain;
    DELETE FROM chains WHERE id = OLD.chain AND refs <= 0;
    UPDATE chains SET length = (SELECT coalesce(max(n_messages), 0) FROM responses WHERE chain = OLD.chain)
        WHERE id = OLD.chain AND length = OLD.n_messages;
    DELETE FROM segments WHERE chain = OLD.chain AND start >= (SELECT length FROM chains WHERE id = OLD.chain);
END;
CREATE TRIGGER chains_del AFTER DELETE ON chains BEGIN
    DELETE FROM segments WHERE chain = OLD.id;
END;
CREATE TRIGGER segments_ins AFTER INSERT ON segments BEGIN
    UPDATE meta SET value = value + NEW.size WHERE key = 'bytes';
    INSERT INTO tenants (tenant, rows, bytes) VALUES (NEW.tenant, 0, NEW.size)
        ON CONFLICT (tenant) DO UPDATE SET bytes = bytes + NEW.size;
END;
CREATE TRIGGER segments_del AFTER DELETE ON segments BEGIN
    UPDATE meta SET value = value - OLD.size WHERE key = 'bytes';
    UPDATE tenants SET bytes = bytes - OLD.size WHERE tenant = OLD.tenant;
END;
"""


class StoreError(MolctlError):
    """The state store cannot be used (one line naming the file). `cause`: "damaged" (SQLite reports
    the file corrupt, or a record does not parse), an errno name for a failed write ("ENOSPC": the
    disk is full; "EIO"), "locked" (another process's write lock, past the busy timeout), or None."""

    cause: str | None = None

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


class QuotaExceeded(StoreError):
    """A record that is over a byte cap (`setting`: proxy.store_tenant_max_bytes or store_max_bytes)
    on its own, with its conversation: not stored, nothing evicted (cause "quota"). The client's
    mistake, not the store's: a 400 naming the quota (molctl.proxy.errors.store_failure), and the
    store stays ready."""

    def __init__(self, message: str, size: int, cap: int, setting: str):
        super().__init__(message, cause="quota")
        self.size, self.cap, self.setting = size, cap, setting


def _cause(exc: BaseException) -> str | None:
    """StoreError.cause for an sqlite3 error (its extended error name, Python 3.11+)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or str(exc).startswith(UNDECODABLE):
        return "damaged"
    if name == "SQLITE_FULL":
        return "ENOSPC"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return "locked"
    if name.startswith("SQLITE_IOERR"):
        return "EIO"
    return None


def tenant_bounds(proxy: Any) -> dict[str, int]:
    """A profile's per-tenant quotas (its `proxy` section): `store_tenant_max_bytes` and
    `store_tenant_max_entries`, by default a quarter (TENANT_SHARE) of `store_max_bytes` and
    `store_max_entries` (at least 1), never above them."""
    out = {}
    for name, cap in (("bytes", proxy.store_max_bytes), ("entries", proxy.store_max_entries)):
        value = getattr(proxy, f"store_tenant_max_{name}", None)
        out[f"tenant_max_{name}"] = min(cap, value) if value is not None else max(1, cap // TENANT_SHARE)
    return out


def store_path(state_dir: Path, profile: str) -> Path:
    return Path(state_dir) / profile / STORE_FILE


def parse_store_spec(spec: str) -> tuple[str, Path | None]:
    """'sqlite' -> ('sqlite', None: the default file), 'memory' -> ('memory', None),
    'sqlite:/abs/file.sqlite3' -> ('sqlite', that path). ValueError names what is wrong."""
    if spec in ("sqlite", "memory"):
        return spec, None
    if spec.startswith(("redis://", "rediss://")):  # shared by proxy replicas: molctl.proxy.redis_store
        from molctl.proxy.redis_store import parse_redis_url

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


def resolve_store(spec: str, state_dir: Path, profile: str) -> tuple[str, Path | None]:
    """The backend and (for sqlite) the file of a `proxy.store` value for this profile."""
    kind, path = parse_store_spec(spec)
    if kind == "sqlite" and path is None:
        path = store_path(state_dir, profile)
    return kind, path


def open_store(spec: str, state_dir: Path, profile: str, **bounds: Any):
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


UNDECODABLE = "Could not decode to UTF-8"  # the sqlite3 module's error for a TEXT value that is not UTF-8


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if text.startswith(UNDECODABLE):  # "... column 'messages' with text '<the record's text>'": never quoted
        return f"damaged ({text.split(' with text ', 1)[0]}): {DAMAGED_ADVICE}"
    if "locked" in text or "busy" in text:
        return f"{text} (another process holds its write lock; is another proxy or `molctl state prune` using it?)"
    if _cause(exc) == "damaged" and "malformed" in text:
        return f"damaged ({text}): {DAMAGED_ADVICE}"
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return f"{text} (corrupted or not a molctl store: move it aside to start with an empty store)"
    return text


class SqliteResponseStore:
    """See the module docstring. Thread-safe (one connection behind a lock)."""

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
                str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
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

    def _create_file(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        except OSError as exc:
            raise StoreError(f"response store {self.path}: cannot create it: {exc.strerror or exc}") from None
        os.close(fd)

    def _setup(self) -> None:
        conn = self._conn
        version = conn.execute("PRAGMA user_version").fetchone()[0]  # reads the header: garbage fails here
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if version == 0 and not tables:  # a new (empty) file
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _statements(SCHEMA) + _statements(CONVERSATION_SCHEMA) + _statements(CHAIN_SCHEMA):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        elif version not in (1, 2, SCHEMA_VERSION):
            raise StoreError(
                f"response store {self.path}: schema version {version}, this molctl knows {SCHEMA_VERSION} "
                f"(written by another molctl version; move it aside or use that version)"
            )
        else:
            needed = {1: {"responses", "meta"}, 2: {"responses", "meta", "turns", "calls"}}.get(version, TABLES)
            if not needed <= tables:
                raise StoreError(
                    f"response store {self.path}: schema version {version} but tables missing "
                    f"({', '.join(sorted(needed - tables))}): corrupted"
                )
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise StoreError(f"response store {self.path}: cannot switch to WAL (journal mode {mode})")
            self._quick_check()  # before anything is written to it (a migration included)
            self.file_version = version
            if version < SCHEMA_VERSION and self.migrate:
                self._migrate(version)
                self.file_version = SCHEMA_VERSION
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=OFF")
        if not self.reads_only:
            # writable and not locked by another writer (beyond busy_timeout): found now, not on the first request
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("COMMIT")

    def _quick_check(self) -> None:
        """`PRAGMA quick_check` (the b-trees' structure, every page; not the indexes' contents), cut
        off after integrity_check_s by a progress handler: a file too large to check in that time
        is checked in part (said in `integrity` and logged); 0 skips it. Damage raises StoreError."""
        conn = self._conn
        if self.integrity_check_s <= 0:
            self.integrity = "not checked"
            return
        deadline = time.monotonic() + self.integrity_check_s
        conn.set_progress_handler(lambda: time.monotonic() >= deadline, 1000)
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
        except sqlite3.OperationalError as exc:
            if "interrupt" not in str(exc):
                raise
            mib = _size(self.path) / 2**20
            self.integrity = f"not finished in {self.integrity_check_s:g} s (a {mib:.1f} MiB file): checked in part"
            log.warning("response store %s: integrity check %s", self.path, self.integrity)
            return
        finally:
            conn.set_progress_handler(None, 0)
        if problems != ["ok"]:
            found = "; ".join(" ".join(p.split()) for p in problems)
            raise StoreError(
                f"response store {self.path}: damaged (PRAGMA quick_check: {found[:300]}): {DAMAGED_ADVICE}",
                cause="damaged",
            )
        self.integrity = "ok"

    def health(self) -> str | None:
        """Why the store serves in part (the proxy's /readyz says "degraded" with it), else None:
        damage found while serving, or the last write failed (a full disk: every stored response
        and chat-state row is refused until a write commits again)."""
        if self.damaged is not None:
            return "response store damaged (the proxy's log says where): restart it on a repaired or new store"
        if self.write_failure is not None:
            return f"response store writes failing ({self.write_failure})"
        return None

    def _write_failed(self, exc: BaseException) -> None:
        cause = getattr(exc, "cause", None)
        if cause not in (None, "locked", "quota"):  # locked: another process's transaction, not this store's state
            self.write_failure = WRITE_CAUSES.get(cause, cause)

    def _damage_seen(self, why: str) -> None:
        """Damage found while serving: logged once; the store takes no more writes."""
        if self.damaged is None:
            self.damaged = why
            log.error("response store %s is damaged (%s): it takes no more writes; %s", self.path, why, DAMAGED_ADVICE)

    def _refuse_if_damaged(self, what: str) -> None:
        if self.damaged is not None:
            raise StoreError(
                f"response store {self.path}: {what} not written: the store is damaged ({self.damaged})",
                cause="damaged",
            )

    def _migrate(self, version: int) -> None:
        """v1 (responses only) -> v2 (the conversation tables added) -> v3 (chains, segments, per-tenant
        totals; the triggers replaced), all in one transaction: a crash leaves the old version whole.
        Every response stays as it is (a v2 row keeps its whole conversation and is read as such; the
        first response continuing it starts a chain). Idempotent (another process may have migrated
        it meanwhile: the version is read again under the write lock)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = conn.execute("PRAGMA user_version").fetchone()[0]
            if found < SCHEMA_VERSION:
                steps = ([CONVERSATION_SCHEMA] if found == 1 else []) + [CHAIN_SCHEMA]
                for script in steps:
                    for statement in _statements(script):
                        conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self.migrated_from = found
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        if self.migrated_from:
            log.info(
                "state store %s: migrated from schema version %d to %d (a chain's history stored once, "
                "per-tenant quotas)",
                self.path,
                self.migrated_from,
                SCHEMA_VERSION,
            )

    # ------------------------------------------------------------------ protocol
    def put_response(self, record: ResponseRecord, wait: bool = True) -> None:
        """Committed before it returns (the proxy sends the response after it: readable at once,
        from any process), in one transaction with its chain's new segment and the evictions it
        causes. The chat rows queued so far go in the same transaction (one commit).
        `wait=False` (the proxy's puts): another process's write lock is not waited for; StoreBusy
        is raised at once, nothing written (LocalResponses tries again a little later).

        `record["messages"]` is the whole conversation; when `previous_response_id` names the
        newest response of a chain of this tenant, the record's messages start with that one's
        (as the proxy builds them: `make_record`) and only the rest is written."""
        self._refuse_if_damaged("response")
        head = _row({**record, "messages": []})
        messages = record.get("messages") or []
        turns: dict[bytes, tuple] = {}
        calls: dict[tuple[str, str], tuple] = {}
        try:
            with self._locked("put"):
                turns, calls = self._take_pending()
                conn = self._conn
                if wait:
                    conn.execute("BEGIN IMMEDIATE")
                elif not self._try_begin():
                    if turns or calls:
                        self._put_back(turns, calls)
                    raise StoreBusy(f"response store {self.path}: another process holds the write lock")
                try:
                    new = self._insert_response(head, messages)
                    now = self.clock()
                    if not 0 <= now - self._last_prune < PRUNE_EVERY_S:  # also after the clock stepped back
                        self._expire_group("responses", now)
                        self._last_prune = now
                    self._evict_responses(head[0], keep=new)
                    if turns or calls:
                        self._insert_rows(turns, calls, now)
                    conn.execute("COMMIT")
                    self.write_failure = None
                except BaseException:
                    _rollback(conn)
                    if turns or calls:  # back in the queue while the lock is held (see _put_back)
                        self._put_back(turns, calls)
                    raise
        except (StoreError, StoreBusy) as exc:
            self._write_failed(exc)
            if turns or calls:  # not this put's own rows: their own flush writes them (or counts them lost)
                self._schedule_flush()
            raise

    def _insert_response(self, head: tuple, messages: list) -> int:
        """Inside the put's transaction: the row (replacing one of the same id), its messages as a
        segment of its chain (see CHAIN_SCHEMA); its rowid. A record whose whole conversation is
        over a cap on its own is refused (StoreError) before anything is evicted."""
        conn = self._conn
        tenant, rid, previous = head[0], head[1], head[3]
        conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
        chain, base, inherited = None, 0, 0
        if previous is not None:
            tip = conn.execute(
                "SELECT r.chain, r.n_messages FROM responses r JOIN chains c ON c.id = r.chain "
                "WHERE r.tenant = ? AND r.id = ? AND c.length = r.n_messages",
                (tenant, previous),
            ).fetchone()
            if tip is not None and tip[1] <= len(messages):
                chain, base = tip
                inherited = conn.execute(
                    "SELECT coalesce(sum(size), 0) FROM segments WHERE chain = ?", (chain,)
                ).fetchone()[0]
        text = _json(messages[base:]) if len(messages) > base else None
        seg_size = len(text.encode()) if text is not None else 0
        whole = head[-1] + seg_size + inherited  # what this response holds: its row and its conversation
        for cap, name in (
            (self.max_bytes, "proxy.store_max_bytes"),
            (self.tenant_max_bytes, "proxy.store_tenant_max_bytes"),
        ):
            if whole > cap:  # evicting every other record could not make room: nothing is evicted
                raise QuotaExceeded(
                    f"response store {self.path}: a record of {whole} bytes (with its conversation) is over "
                    f"{name} ({cap}): not stored",
                    whole,
                    cap,
                    name,
                )
        if chain is None:
            chain = conn.execute("INSERT INTO chains (tenant, length, refs) VALUES (?, 0, 0)", (tenant,)).lastrowid
        if text is not None:
            conn.execute(
                "INSERT INTO segments (chain, start, stop, tenant, messages, size) VALUES (?, ?, ?, ?, ?, ?)",
                (chain, base, len(messages), tenant, text, seg_size),
            )
        conn.execute("UPDATE chains SET length = ? WHERE id = ?", (len(messages), chain))
        return conn.execute(
            "INSERT INTO responses (tenant, id, created_at, previous_response_id, route, messages, "
            "input_items, response, extra, size, chain, n_messages) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*head, chain, len(messages)),
        ).lastrowid

    def _put_back(self, turns: dict[bytes, tuple], calls: dict[tuple[str, str], tuple]) -> None:
        """Rows taken for a transaction that failed, back in the queue (a row queued again since keeps
        its newer values): a failed Response put does not lose the window's chat rows; if their own
        write fails too, it counts them lost. Called under the connection's lock: a flush waiting for
        that lock (the loop's, while the put ran in a worker thread) then takes them with the newer
        values; put back after the lock was released, an older row could land after that flush had
        written a newer one (a summary overwritten by the turn's earlier state)."""
        with self._pending_lock:
            for key, value in turns.items():
                self._pending_turns.setdefault(key, value)
            for key, value in calls.items():
                self._pending_calls.setdefault(key, value)

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        with self._locked("get"):
            row = self._conn.execute(
                "SELECT tenant, id, created_at, previous_response_id, route, messages, input_items, response, extra, "
                "chain, n_messages FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, self.clock() - self.ttl_s),
            ).fetchone()
            segments = None
            if row is not None and row[9] is not None:  # its conversation: the chain's segments up to it
                segments = self._conn.execute(
                    "SELECT start, stop, messages FROM segments WHERE chain = ? AND start < ? ORDER BY start",
                    (row[9], row[10]),
                ).fetchall()
        if row is None:
            return None
        try:
            record: ResponseRecord = json.loads(row[8])
            record.update(zip(COLUMNS, row[:5], strict=True))
            record.update((k, json.loads(v)) for k, v in zip(JSON_COLUMNS, row[5:8], strict=True))
            if segments is not None:
                record["messages"] = _conversation(segments, row[10])
        except (ValueError, TypeError, AttributeError) as exc:  # JSON that does not parse, or not an object
            why = (
                f"the conversation of {response_id[:80]} is incomplete ({exc})"
                if isinstance(exc, ChainGap)
                else f"the record of {response_id[:80]} does not parse ({type(exc).__name__})"
            )
            self._damage_seen(why)
            raise StoreError(f"response store {self.path}: {why}: damaged", cause="damaged") from None
        return record

    def delete_response(self, tenant: str, response_id: str, wait: bool = True) -> bool:
        """`wait=False`: as put_response's (StoreBusy at once when another process holds the write lock)."""
        self._refuse_if_damaged("delete")
        with self._locked("delete"):
            conn = self._conn
            if wait:
                conn.execute("BEGIN IMMEDIATE")
            elif not self._try_begin():
                raise StoreBusy(f"response store {self.path}: another process holds the write lock")
            try:
                cur = conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
            return cur.rowcount > 0

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

    def prune(self) -> dict[str, int]:
        """Delete expired rows, then evict over the caps (responses, then the conversation rows on
        their own counts); returns what it removed."""
        self.flush()
        with self._locked("prune"):
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                now = self.clock()
                expired, evicted = self._expire_group("responses", now), self._evict_responses(None)
                conv_expired, conv_evicted = (
                    self._expire_group("conversations", now),
                    self._evict_group("conversations"),
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

    def describe(self) -> dict[str, Any]:
        """stats() plus what `molctl state stats` shows: the file, its size on disk (with the WAL),
        the bounds, the rows already expired but not pruned."""
        out: dict[str, Any] = {
            "backend": "sqlite",
            "path": str(self.path),
            "exists": True,
            "schema_version": self.file_version,
            "integrity": self.integrity,
        }
        if self.file_version < SCHEMA_VERSION:
            out["migration_pending"] = (
                f"schema {self.file_version} -> {SCHEMA_VERSION} when a proxy or `state prune` "
                "next opens it (an older molctl then refuses the file: keep a copy to roll back)"
            )
        out.update(self.stats())
        with self._locked("stats"):
            cutoff = self.clock() - self.ttl_s
            out["responses_expired_pending"] = self._conn.execute(
                "SELECT count(*) FROM responses WHERE created_at < ?", (cutoff,)
            ).fetchone()[0]
            conv = ("turns", "calls") if self.file_version >= 2 else ()  # a v1 file has no conversation tables
            out["turns"], out["calls"] = (
                self._conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] if t in conv else 0
                for t in ("turns", "calls")
            )
            out["conversation_expired_pending"] = sum(
                self._conn.execute(f"SELECT count(*) FROM {t} WHERE stamp < ?", (cutoff,)).fetchone()[0] for t in conv
            )
        out["file_bytes"] = sum(_size(Path(str(self.path) + sfx)) for sfx in ("", "-wal", "-shm"))
        out["mode"] = f"{stat.S_IMODE(self.path.stat().st_mode):04o}"
        out["bounds"] = {
            "ttl_s": self.ttl_s,
            "max_bytes": self.max_bytes,
            "max_entries": self.max_entries,
            "tenant_max_bytes": self.tenant_max_bytes,
            "tenant_max_entries": self.tenant_max_entries,
        }
        return out

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

    # Responses (column created_at) and chat state (turns and calls, column stamp) are bounded
    # alike, each group with its own counters in `meta` (prefix '' or 'conv_').
    _GROUPS = {
        "responses": ("", (("responses", "created_at"),)),
        "conversations": ("conv_", (("turns", "stamp"), ("calls", "stamp"))),
    }

    def _expire_group(self, group: str, now: float) -> int:
        prefix, tables = self._GROUPS[group]
        n = sum(
            self._conn.execute(f"DELETE FROM {t} WHERE {col} < ?", (now - self.ttl_s,)).rowcount for t, col in tables
        )
        if n:
            self._conn.execute("UPDATE meta SET value = value + ? WHERE key = ?", (n, prefix + "expired"))
        return n

    def _evict_responses(self, tenant: str | None, keep: int | None = None) -> int:
        """Inside a transaction: a tenant over its quota (`tenant_max_entries` responses or
        `tenant_max_bytes`, its responses and their chains' segments) evicts its OWN oldest responses
        (by created_at, then insertion order) until it is within it; then, as a last resort, while
        the store is over a global cap, the tenant holding the most (bytes or responses, whichever
        cap is exceeded) evicts its oldest. Never the response of rowid `keep` (the one being put:
        its id goes to the client; after the clock stepped back it is the "oldest"). `tenant` None
        (a prune): every tenant over its quota. Evicting a response never cuts another one's
        conversation: a chain's segments go with the last response that needs them (CHAIN_SCHEMA).
        Returns how many responses it evicted (counted in `meta`)."""
        conn = self._conn
        tenants = (
            [tenant]
            if tenant is not None
            else [
                r[0]
                for r in conn.execute(
                    "SELECT tenant FROM tenants WHERE rows > ? OR bytes > ?",
                    (self.tenant_max_entries, self.tenant_max_bytes),
                )
            ]
        )
        n = 0
        for who in tenants:
            n += self._evict_while(
                lambda who=who: conn.execute(
                    "SELECT rows > ? OR bytes > ? FROM tenants WHERE tenant = ?",
                    (self.tenant_max_entries, self.tenant_max_bytes, who),
                ).fetchone(),
                lambda who=who: who,
                keep,
            )

        def over() -> tuple | None:
            meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('rows', 'bytes')"))
            return (meta["rows"] > self.max_entries or meta["bytes"] > self.max_bytes,)

        def biggest() -> str | None:
            meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('rows', 'bytes')"))
            by = "bytes" if meta["bytes"] > self.max_bytes else "rows"
            # the biggest tenant with a response to evict (not only the one being put)
            row = conn.execute(
                "SELECT t.tenant FROM tenants t WHERE EXISTS (SELECT 1 FROM responses r WHERE "
                "r.tenant = t.tenant AND r.rowid IS NOT ?) ORDER BY t." + by + " DESC, t.tenant LIMIT 1",
                (keep,),
            ).fetchone()
            return None if row is None else row[0]

        n += self._evict_while(over, biggest, keep)
        if n:
            conn.execute("UPDATE meta SET value = value + ? WHERE key = 'evicted'", (n,))
        return n

    def _evict_while(self, over: Callable[[], tuple | None], tenant: Callable[[], str | None], keep: int | None) -> int:
        """Delete the oldest response of `tenant()` while `over()` holds (one at a time: a chain's
        segments may go with one, so the totals are read again after each); stops when nothing but
        `keep` is left to evict (the store then stays over by that one response's conversation)."""
        conn, n = self._conn, 0
        while True:
            state = over()
            if state is None or not state[0]:
                return n
            who = tenant()
            if who is None:
                return n
            victim = conn.execute(
                "SELECT rowid FROM responses WHERE tenant = ? AND rowid IS NOT ? ORDER BY created_at, rowid LIMIT 1",
                (who, keep),
            ).fetchone()
            if victim is None:  # nothing of this tenant's left to evict but the response being put
                return n
            conn.execute("DELETE FROM responses WHERE rowid = ?", victim)
            n += 1

    def _evict_group(self, group: str, keep: int | None = None) -> int:
        """Oldest first (time, then insertion order) across the group's tables until both caps hold;
        never the response of rowid `keep` (the one being put: its id goes to the client, and after
        the clock stepped back it is the "oldest")."""
        prefix, tables = self._GROUPS[group]
        meta = dict(
            self._conn.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (prefix + "rows", prefix + "bytes"))
        )
        over_rows = meta[prefix + "rows"] - self.max_entries
        over_bytes = meta[prefix + "bytes"] - self.max_bytes
        if over_rows <= 0 and over_bytes <= 0:
            return 0
        victims: dict[str, list[int]] = {t: [] for t, _ in tables}
        union = " UNION ALL ".join(f"SELECT '{t}', rowid, size, {col} FROM {t}" for t, col in tables)
        for table, rowid, size, _ in self._conn.execute(union + " ORDER BY 4, 2"):
            if over_rows <= 0 and over_bytes <= 0:
                break
            if rowid == keep and table == "responses":
                continue
            victims[table].append(rowid)
            over_rows -= 1
            over_bytes -= size
        for table, rowids in victims.items():
            for i in range(0, len(rowids), 500):
                chunk = rowids[i : i + 500]
                self._conn.execute(f"DELETE FROM {table} WHERE rowid IN ({','.join('?' * len(chunk))})", chunk)
        n = sum(len(r) for r in victims.values())
        self._conn.execute("UPDATE meta SET value = value + ? WHERE key = ?", (n, prefix + "evicted"))
        return n


class _Persist:
    """A TurnRecord's on_change, set by SqliteConversationStore: writes the record's new state."""

    __slots__ = ("key", "store")

    def __init__(self, store: SqliteConversationStore, key: bytes):
        self.store, self.key = store, key

    def __call__(self, record: TurnRecord) -> None:
        self.store.db.queue_turn_row(self.key, record)


class SqliteConversationStore:
    """The `ConversationStore` of `proxy.store: sqlite`: a MemoryStore as the hot cache, every put
    written to the `turns` / `calls` tables of the profile's SQLite file (see the module docstring),
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

    def __init__(self, db: SqliteResponseStore, cache: MemoryStore | None = None):
        self.db = db
        self.cache = cache if cache is not None else MemoryStore()
        self.read_errors = 0

    @property
    def write_errors(self) -> int:
        """Rows a failed write lost (the cache still has them for this process)."""
        return self.db.conv_write_errors

    def write_queued(self) -> int:
        """Write the queued rows now (the event loop does so at the end of the pass that queued them).
        Not named `flush`: the orchestrator awaits a shared store's async `flush` before answering."""
        return self.db.flush()

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as exc:
            self.read_errors += 1
            log.warning("conversation state not read: %s", exc)
            return None

    def get_turn(self, key: bytes) -> TurnRecord | None:
        record = self.cache.get_turn(key)
        if record is not None:
            return record
        row = self._read(self.db.get_turn_row, key)
        return None if row is None else self._cached(key, row)

    def get_turns(self, keys: list[bytes]) -> list[TurnRecord | None]:
        """`get_turn` of every key, the cache misses read in one query (a client's 100 earlier turns
        that this proxy never saw cost one SELECT, not 100)."""
        records = [self.cache.get_turn(key) for key in keys]
        missing = [key for key, record in zip(keys, records, strict=True) if record is None]
        if not missing:
            return records
        rows = self._read(self.db.get_turn_rows, missing) or {}
        return [
            record if record is not None else (self._cached(key, rows[key]) if key in rows else None)
            for key, record in zip(keys, records, strict=True)
        ]

    def _cached(self, key: bytes, row: tuple[str, str | None, bool, bool]) -> TurnRecord:
        route, summary, failed, stale = row
        # the summary of a turn recorded by an earlier process is final: one still in flight then never comes
        record = TurnRecord(route, summary, failed or summary is None, stale)
        record.settle()
        record.on_change = _Persist(self, key)
        self.cache.put_turn(key, record)
        return record

    def put_turn(self, key: bytes, record: TurnRecord) -> None:
        bound = record.on_change
        already = isinstance(bound, _Persist) and bound.store is self and bound.key == key
        if not already:
            record.on_change = _Persist(self, key)
            self.db.queue_turn_row(key, record)
        self.cache.put_turn(key, record)

    def get_call(self, tenant: str, call_id: str) -> CallBinding | None:
        binding = self.cache.get_call(tenant, call_id)
        if binding is not None:
            return binding
        binding = self._read(self.db.get_call_row, tenant, call_id)
        if binding is not None:
            self.cache.put_call(tenant, call_id, binding)
        return binding

    def put_call(self, tenant: str, call_id: str, binding: CallBinding) -> None:
        self.db.queue_call_row(tenant, call_id, binding)
        self.cache.put_call(tenant, call_id, binding)

    def stats(self) -> dict[str, int]:
        """The cache's entries and bytes (as MemoryStore), the durable rows and bytes, the errors."""
        out = dict(self.cache.stats())
        try:
            s = self.db.stats()
            out.update(durable_rows=s["conversation_rows"], durable_bytes=s["conversation_bytes"])
        except StoreError:
            pass
        out.update(write_errors=self.db.conv_write_errors, read_errors=self.read_errors)
        return out


def _conv_stats(meta: dict[str, int]) -> dict[str, int]:
    return {
        "conversation_rows": meta.get("conv_rows", 0),
        "conversation_bytes": meta.get("conv_bytes", 0),
        "conversation_evicted": meta.get("conv_evicted", 0),
        "conversation_expired": meta.get("conv_expired", 0),
    }


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction. SQLite may have rolled it back by itself already (a full disk or an
    I/O error while writing): the ROLLBACK's own "no transaction is active" must not replace the
    failure being raised."""
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")


def _statements(script: str) -> list[str]:
    """SCHEMA split into statements (triggers keep their inner semicolons)."""
    out, buf = [], []
    for line in script.strip().splitlines():
        buf.append(line)
        text = "\n".join(buf).strip()
        if text.endswith(";") and sqlite3.complete_statement(text):
            out.append(text)
            buf = []
    return out


class ChainGap(ValueError):
    """A chained response's segments do not cover its conversation (the file was edited or damaged:
    the store itself never removes a segment a live response needs)."""


def _conversation(segments: list[tuple[int, int, str]], n: int) -> list:
    """The conversation of a chained response: its chain's segments [start, stop) up to `n`
    messages, joined into one JSON text and parsed once. ChainGap when they leave a hole."""
    texts, at = [], 0
    for start, stop, text in segments:
        if start != at:
            raise ChainGap(f"messages {at}-{start - 1} missing")
        if text != "[]":
            texts.append(text[1:-1])
        at = stop
    if at < n:
        raise ChainGap(f"messages {at}-{n - 1} missing")
    messages = json.loads("[" + ",".join(texts) + "]")
    if len(messages) != at:
        raise ChainGap(f"{len(messages)} messages where its chain counts {at}")
    return messages[:n]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _row(record: ResponseRecord) -> tuple:
    extra = {k: v for k, v in record.items() if k not in COLUMNS and k not in JSON_COLUMNS}
    texts = [
        json.dumps(record.get(k, [] if k != "response" else {}), ensure_ascii=False, separators=(",", ":"))
        for k in JSON_COLUMNS
    ]
    extra_text = json.dumps(extra, ensure_ascii=False, separators=(",", ":"))
    size = sum(len(t.encode()) for t in texts) + len(extra_text.encode())
    return (
        record["tenant"],
        record["id"],
        float(record["created_at"]),
        record.get("previous_response_id"),
        record.get("route"),
        *texts,
        extra_text,
        size,
    )


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
