"""Background responses' jobs in the SQLite store's file (molctl.proxy.store.background has the contract).

Two tables of their own, created on first use (`CREATE TABLE IF NOT EXISTS`: a file that never ran a
background response has none, and the schema version is unchanged: a molctl without background mode
opens the file and ignores them): `background_jobs` (one row a job: its status, owner lease and Response
JSON) and `background_events` (its stream events by sequence number). Calls run on the event loop
under the store's lock (each a few rows: ~0.1 ms, as a record's get); a terminal job and its events
are deleted `ttl_s` after they ended (in `lapsed`, which every replica calls every few seconds).
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


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class SqliteBackground(BackgroundStore):
    def __init__(self, store: Any):
        self.store = store  # a SqliteResponseStore: its connection, lock, clock and ttl_s
        self._ready = False

    def _conn(self, what: str):
        """The store's lock (its errors a StoreError naming the file); `_tables` makes the tables once."""
        return self.store._locked(f"background {what}")

    def _tables(self) -> None:
        if not self._ready:
            for statement in filter(str.strip, TABLES.split(";")):
                self.store._conn.execute(statement)
            self._ready = True

    async def create(self, job: Job, lease_until: float, limit: int) -> bool:
        with self._conn("create"):
            self._tables()
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
            self._tables()
            row = self.store._conn.execute(
                "SELECT status, owner, response FROM background_jobs WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
        if row is None:
            return None
        return {"id": response_id, "tenant": tenant, "status": row[0], "owner": row[1], "response": json.loads(row[2])}

    async def set_state(self, tenant: str, response_id: str, status: str, response: dict[str, Any]) -> bool:
        with self._conn("update"):
            self._tables()
            cur = self.store._conn.execute(
                "UPDATE background_jobs SET status = ?, response = ?, updated_at = ? "
                f"WHERE tenant = ? AND id = ? AND status IN {ACTIVE_SQL}",
                (status, _dumps(response), self.store.clock(), tenant, response_id),
            )
            return cur.rowcount == 1

    async def append(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        with self._conn("events"):
            self._tables()
            self.store._conn.executemany(
                "INSERT OR REPLACE INTO background_events VALUES (?, ?, ?, ?)",
                [(tenant, response_id, e["sequence_number"], _dumps(e)) for e in events],
            )

    async def events(self, tenant: str, response_id: str, after: int) -> list[dict[str, Any]]:
        with self._conn("events"):
            self._tables()
            rows = self.store._conn.execute(
                "SELECT event FROM background_events WHERE tenant = ? AND id = ? AND seq > ? ORDER BY seq",
                (tenant, response_id, after),
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    async def renew(self, jobs: list[tuple[str, str]], lease_until: float) -> None:
        if not jobs:
            return
        with self._conn("lease"):
            self._tables()
            self.store._conn.executemany(
                f"UPDATE background_jobs SET lease_until = ? WHERE tenant = ? AND id = ? AND status IN {ACTIVE_SQL}",
                [(lease_until, tenant, rid) for tenant, rid in jobs],
            )

    async def lapsed(self, now: float) -> list[Job]:
        with self._conn("sweep"):
            self._tables()
            conn = self.store._conn
            old = now - self.store.ttl_s
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
            self._tables()
            conn = self.store._conn
            conn.execute("DELETE FROM background_events WHERE tenant = ? AND id = ?", (tenant, response_id))
            return (
                conn.execute("DELETE FROM background_jobs WHERE tenant = ? AND id = ?", (tenant, response_id)).rowcount
                == 1
            )
