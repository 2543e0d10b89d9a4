"""Background responses' jobs in the SQLite store's file (molctl.proxy.store.background has the contract).

Two tables of their own, created on first use (`CREATE TABLE IF NOT EXISTS`: a file that never ran a
background response has none, and the schema version is unchanged: a molctl without background mode
opens the file and ignores them): `background_jobs` (one row a job: its status, owner lease and Response
JSON) and `background_events` (its stream events by sequence number). Calls run on the event loop
under the store's lock (each a few rows: ~0.1 ms, as a record's get); a terminal job and its events
are deleted `ttl_s` after they ended (by `lapsed`, which every replica calls every few seconds, at
most once a minute). Until a job was created, reads and sweeps find no table and write nothing.
"""

from __future__ import annotations

import json
from typing import Any

from molctl.proxy.store.background import BackgroundStore, Job

TABLES = """
CREATE TABLE IF NOT EXISTS background_jobs (
    tenant TEXT NOT NULL, id TEXT NOT NULL, status TEXT NOT NULL, owner TEXT NOT NULL,
    lease_until REAL NOT NULL, updated_at REAL NOT NULL, response TEXT NOT NULL,
    PRIMARY KEY (tenant, id)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS background_jobs_lease ON background_jobs (lease_until);
CREATE TABLE IF NOT EXISTS background_events (
    tenant TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL,
    PRIMARY KEY (tenant, id, seq)) WITHOUT ROWID;
"""
ACTIVE_SQL = "('queued', 'in_progress')"
CLEAN_S = 60.0  # expired jobs are deleted at most this often


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class SqliteBackground(BackgroundStore):
    def __init__(self, store: Any):
        self.store = store  # a SqliteResponseStore: its connection, lock, clock and ttl_s
        self._ready = False
        self._cleaned = float("-inf")  # when `lapsed` last deleted the expired jobs

    def _conn(self, what: str):
        """The store's lock (its errors a StoreError naming the file); `_tables` makes the tables once."""
        return self.store._locked(f"background {what}")

    def _tables(self, create: bool = False) -> bool:
        """Whether the tables exist (made here when `create`: only a new job makes them, so a store
        that never ran a background response is not written by the reads and sweeps)."""
        if not self._ready:
            conn = self.store._conn
            if create:
                for statement in filter(str.strip, TABLES.split(";")):
                    conn.execute(statement)
            self._ready = (
                conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'background_events'"
                ).fetchone()
                is not None
            )
        return self._ready

    async def create(self, job: Job, lease_until: float, limit: int) -> bool:
        with self._conn("create"):
            self._tables(create=True)
            conn = self.store._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                (active,) = conn.execute(
                    f"SELECT count(*) FROM background_jobs WHERE tenant = ? AND status IN {ACTIVE_SQL}",
                    (job["tenant"],),
                ).fetchone()
                if active >= limit:
                    conn.execute("ROLLBACK")
                    return False
                conn.execute(
                    "INSERT OR REPLACE INTO background_jobs VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        job["tenant"],
                        job["id"],
                        job["status"],
                        job["owner"],
                        lease_until,
                        self.store.clock(),
                        _dumps(job["response"]),
                    ),
                )
                conn.execute("COMMIT")
                return True
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    async def get(self, tenant: str, response_id: str) -> Job | None:
        with self._conn("get"):
            if not self._tables():
                return None
            row = self.store._conn.execute(
                "SELECT status, owner, response FROM background_jobs WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
        if row is None:
            return None
        return {"id": response_id, "tenant": tenant, "status": row[0], "owner": row[1], "response": json.loads(row[2])}

    async def set_state(self, tenant: str, response_id: str, status: str, response: dict[str, Any]) -> bool:
        with self._conn("update"):
            if not self._tables():
                return False
            cur = self.store._conn.execute(
                "UPDATE background_jobs SET status = ?, response = ?, updated_at = ? "
                f"WHERE tenant = ? AND id = ? AND status IN {ACTIVE_SQL}",
                (status, _dumps(response), self.store.clock(), tenant, response_id),
            )
            return cur.rowcount == 1

    async def append(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        with self._conn("events"):
            self._tables(create=True)
            self.store._conn.executemany(
                "INSERT OR REPLACE INTO background_events VALUES (?, ?, ?, ?)",
                [(tenant, response_id, e["sequence_number"], _dumps(e)) for e in events],
            )

    async def events(self, tenant: str, response_id: str, after: int) -> list[dict[str, Any]]:
        with self._conn("events"):
            if not self._tables():
                return []
            rows = self.store._conn.execute(
                "SELECT event FROM background_events WHERE tenant = ? AND id = ? AND seq > ? ORDER BY seq",
                (tenant, response_id, after),
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def renew(self, jobs: list[tuple[str, str]], lease_until: float) -> None:
        if not jobs:
            return
        with self._conn("lease"):
            if not self._tables():
                return
            self.store._conn.executemany(
                f"UPDATE background_jobs SET lease_until = ? WHERE tenant = ? AND id = ? AND status IN {ACTIVE_SQL}",
                [(lease_until, tenant, rid) for tenant, rid in jobs],
            )

    async def lapsed(self, now: float) -> list[Job]:
        with self._conn("sweep"):
            if not self._tables():
                return []
            conn = self.store._conn
            if now - self._cleaned >= CLEAN_S:  # the expired ones: a write, so not at every sweep
                self._cleaned, old = now, now - self.store.ttl_s
                conn.execute(
                    "DELETE FROM background_events WHERE (tenant, id) IN (SELECT tenant, id FROM background_jobs "
                    f"WHERE status NOT IN {ACTIVE_SQL} AND updated_at < ?)",
                    (old,),
                )
                conn.execute(f"DELETE FROM background_jobs WHERE status NOT IN {ACTIVE_SQL} AND updated_at < ?", (old,))
            rows = conn.execute(
                f"SELECT tenant, id, status, owner, response FROM background_jobs WHERE lease_until < ? "
                f"AND status IN {ACTIVE_SQL}",
                (now,),
            ).fetchall()
        return [{"tenant": t, "id": i, "status": s, "owner": o, "response": json.loads(r)} for t, i, s, o, r in rows]

    async def delete(self, tenant: str, response_id: str) -> bool:
        with self._conn("delete"):
            if not self._tables():
                return False
            conn = self.store._conn
            conn.execute("DELETE FROM background_events WHERE tenant = ? AND id = ?", (tenant, response_id))
            return (
                conn.execute("DELETE FROM background_jobs WHERE tenant = ? AND id = ?", (tenant, response_id)).rowcount
                == 1
            )
