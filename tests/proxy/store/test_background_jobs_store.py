"""The background jobs' store contract (molctl.proxy.store.background), the same on each backend:
memory, SQLite (tables of its own in the store's file, made by the first job only) and a real
redis-server. A tenant's active jobs are capped, a status change applies to an active job only (a
cancelled one stays cancelled), events come back after a sequence number, an unrenewed lease lapses
while a renewed one does not, and the Response round-trips unchanged (empty lists stay lists)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from molctl.proxy.store.background import MemoryBackground
from molctl.proxy.store.background_backends import background_store_for
from molctl.proxy.store.local import LocalResponses
from molctl.proxy.store.sqlite.store import SqliteResponseStore

RESPONSE = {"id": "resp_1", "status": "queued", "output": [], "metadata": {}, "tools": [], "error": None}


def job(rid: str, tenant: str = "t1") -> dict:
    return {"id": rid, "tenant": tenant, "status": "queued", "owner": "A", "response": {**RESPONSE, "id": rid}}


@pytest.fixture(params=["memory", "sqlite", "redis"])
def jobs(request, tmp_path):
    if request.param == "memory":
        yield MemoryBackground()
    elif request.param == "sqlite":
        store = SqliteResponseStore(tmp_path / "store.sqlite3")
        yield background_store_for(LocalResponses(store))
        store.close()
    else:
        from molctl.proxy.store.redis.responses import RedisResponseStore
        from tests.redis_helpers import state
        from tests.redis_server import redis_server

        with redis_server() as server:
            st = state(server)
            yield background_store_for(RedisResponseStore(st))
            asyncio.run(st.close())


def run(coro):
    return asyncio.run(coro)


def test_a_tenant_s_active_jobs_are_capped(jobs):
    async def go():
        assert await jobs.create(job("resp_1"), 1e12, 2)
        assert await jobs.create(job("resp_2"), 1e12, 2)
        assert not await jobs.create(job("resp_3"), 1e12, 2)  # past the limit: nothing stored
        assert await jobs.get("t1", "resp_3") is None
        assert await jobs.create(job("resp_4", tenant="t2"), 1e12, 2)  # another tenant's own count
        assert await jobs.set_state("t1", "resp_1", "completed", {**RESPONSE, "status": "completed"})
        assert await jobs.create(job("resp_3"), 1e12, 2)  # an ended one no longer counts

    run(go())


def test_a_status_changes_only_while_active_and_the_response_round_trips(jobs):
    async def go():
        assert await jobs.create(job("resp_1"), 1e12, 5)
        got = await jobs.get("t1", "resp_1")
        assert got["status"] == "queued" and got["owner"] == "A" and got["response"] == {**RESPONSE, "id": "resp_1"}
        assert await jobs.set_state("t1", "resp_1", "in_progress", {**RESPONSE, "status": "in_progress"})
        assert await jobs.set_state("t1", "resp_1", "cancelled", {**RESPONSE, "status": "cancelled"})
        assert not await jobs.set_state("t1", "resp_1", "completed", {**RESPONSE, "status": "completed"})
        assert (await jobs.get("t1", "resp_1"))["status"] == "cancelled"
        assert not await jobs.set_state("t1", "resp_9", "completed", RESPONSE)  # no such job
        assert await jobs.get("t2", "resp_1") is None  # another tenant's id: not found

    run(go())


def test_events_come_back_after_a_sequence_number(jobs):
    async def go():
        assert await jobs.create(job("resp_1"), 1e12, 5)
        events = [{"type": "x", "sequence_number": n, "output": []} for n in range(5)]
        await jobs.append("t1", "resp_1", events[:3])
        await jobs.append("t1", "resp_1", events[3:])
        assert await jobs.events("t1", "resp_1", -1) == events
        assert await jobs.events("t1", "resp_1", 2) == events[3:]
        assert await jobs.events("t1", "resp_1", 4) == []

    run(go())


def test_a_lease_lapses_unless_renewed_and_a_delete_removes_the_job(jobs):
    async def go():
        assert await jobs.create(job("resp_1"), 100.0, 5)
        assert await jobs.create(job("resp_2"), 100.0, 5)
        await jobs.renew([("t1", "resp_2")], 300.0)
        assert [j["id"] for j in await jobs.lapsed(200.0)] == ["resp_1"]
        assert await jobs.set_state("t1", "resp_1", "failed", {**RESPONSE, "status": "failed"})
        assert await jobs.lapsed(200.0) == []  # an ended job is not active
        assert await jobs.delete("t1", "resp_2")
        assert await jobs.get("t1", "resp_2") is None and not await jobs.delete("t1", "resp_2")

    run(go())


def test_sqlite_makes_its_tables_with_the_first_job_only(tmp_path):
    store = SqliteResponseStore(tmp_path / "store.sqlite3")
    jobs = background_store_for(LocalResponses(store))

    def tables() -> set[str]:
        conn = sqlite3.connect(tmp_path / "store.sqlite3")
        try:
            return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()

    try:
        run(jobs.lapsed(1e12))
        assert run(jobs.get("t1", "resp_1")) is None and "background_jobs" not in tables()
        assert run(jobs.create(job("resp_1"), 1e12, 5))
        assert {"background_jobs", "background_events"} <= tables()
    finally:
        store.close()


def test_the_jobs_live_in_the_store_behind_its_wrappers(tmp_path):
    """A view of the response store (an object holding it as `inner`, as the Conversations API's
    ResponsesOnly does) around LocalResponses: the jobs still go to the SQLite file, not to memory."""
    from molctl.proxy.store.memory import MemoryResponseStore
    from molctl.proxy.store.sqlite.background import SqliteBackground

    class View:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    store = SqliteResponseStore(tmp_path / "store.sqlite3")
    try:
        assert isinstance(background_store_for(View(View(LocalResponses(store)))), SqliteBackground)
        assert isinstance(background_store_for(LocalResponses(MemoryResponseStore())), MemoryBackground)
    finally:
        store.close()
