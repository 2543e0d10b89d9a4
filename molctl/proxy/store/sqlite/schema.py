"""The SQLite file: its schema (SCHEMA_VERSION, the tables and triggers of each version), opening
and migrating it, the integrity check, and the errors an sqlite3 failure becomes.

`Schema` is the part of `SqliteResponseStore` (molctl.proxy.store.sqlite.store) that opens the
file; a version-1 or -2 file is migrated in place in one transaction, any other version is refused
with one line. Layout and history: docs/design/store.md ("SQLite")."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path

from molctl.proxy.store.base import StoreError

log = logging.getLogger("molctl.proxy")

SCHEMA_VERSION = 3  # 1: responses only; 2: + turns, calls (chat conversations); 3: + chains, tenants (issue 32)
STORE_FILE = "proxy-store.sqlite3"
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


def store_path(state_dir: Path, profile: str) -> Path:
    return Path(state_dir) / profile / STORE_FILE


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


class Schema:
    """Opening the file (a mixin of SqliteResponseStore): create, check, migrate; damage and write failures."""

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
