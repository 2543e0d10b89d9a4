"""The store contracts (molctl.proxy.store.base) against every backend: memory, SQLite and a real
Redis. Each test goes through the public contract only: a writer store and a reader (the same
memory store; a second SqliteConversationStore on the same file with a cold cache; another
replica on the same Redis), the reader's request opening its own scope and loading first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.base import ConversationStore, RecordStore, ResponseStore, StoreScope
from molctl.proxy.store.factory import open_store
from molctl.proxy.store.local import as_proxy_store
from molctl.proxy.store.memory import MemoryResponseStore, MemoryStore
from molctl.proxy.store.sqlite.conversations import SqliteConversationStore
from molctl.proxy.store.sqlite.store import SqliteResponseStore

BACKENDS = ("memory", "sqlite", "redis")


@dataclass
class Backend:
    kind: str
    writer: ConversationStore
    reader: ConversationStore
    responses: ResponseStore
    records: RecordStore | None = None  # the in-process record store behind `responses`
    closers: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)

    async def close(self) -> None:
        for close in self.closers:
            result = close()
            if result is not None:
                await result


def _redis_backend(url: str) -> Backend:
    from molctl.proxy.store.redis.connection import RedisState
    from molctl.proxy.store.redis.conversations import RedisConversationStore
    from molctl.proxy.store.redis.responses import RedisResponseStore
    from molctl.proxy.store.redis.target import parse_redis_url

    def state(replica: str) -> RedisState:
        return RedisState(
            parse_redis_url(url), None, "tiny", replica_id=replica, advertise_upstream=f"http://engine-{replica}"
        )

    a, b = state("a"), state("b")
    return Backend(
        "redis",
        RedisConversationStore(a),
        RedisConversationStore(b),
        RedisResponseStore(a),
        closers=[a.close, b.close],
    )


def make_backend(kind: str, tmp_path: Path, redis_url: str | None) -> Backend:
    """Inside the event loop (a Redis store's connection belongs to it)."""
    if kind == "memory":
        conversations, records = MemoryStore(), MemoryResponseStore()
        return Backend(kind, conversations, conversations, as_proxy_store(records), records)
    if kind == "sqlite":
        db = open_store("sqlite", tmp_path, "tiny")
        assert isinstance(db, SqliteResponseStore)
        return Backend(
            kind,
            SqliteConversationStore(db),
            SqliteConversationStore(db),  # its own (cold) cache: a miss reads the file
            as_proxy_store(db),
            db,
            closers=[db.close],
        )
    assert redis_url is not None
    return _redis_backend(redis_url)


@pytest.fixture(params=BACKENDS)
def run(request, tmp_path) -> Callable[[Callable[[Backend], Awaitable[Any]]], Any]:
    """`run(test)`: the test's coroutine against a fresh backend of this parameter, in one event loop."""
    url = request.getfixturevalue("r") and request.getfixturevalue("redis").url if request.param == "redis" else None

    def runner(test: Callable[[Backend], Awaitable[Any]]) -> Any:
        async def main():
            backend = make_backend(request.param, tmp_path, url)
            try:
                return await test(backend)
            finally:
                await backend.close()

        return asyncio.run(main())

    return runner


def record(rid: str, tenant: str = "t1", previous: str | None = None, messages: list | None = None) -> dict:
    return {
        "id": rid,
        "tenant": tenant,
        "created_at": time.time(),
        "previous_response_id": previous,
        "route": "L1",
        "messages": messages if messages is not None else [{"role": "user", "content": "hi"}],
        "input_items": [],
        "response": {"id": rid},
    }


async def read_back(store: ConversationStore, keys: list[bytes], calls: list[tuple[str, str]]) -> StoreScope:
    """What a request of `store` does first: open its scope and load (a no-op for a local store)."""
    scope = store.open_scope()
    assert isinstance(scope, StoreScope)
    await store.load(keys, calls, scope)
    return scope


def test_a_turn_put_in_a_request_is_found_by_its_key(run):
    async def test(b: Backend):
        key, absent = b"k" * 32, b"a" * 32
        scope = b.writer.open_scope()
        await b.writer.load([], [], scope)
        b.writer.put_turn(key, TurnRecord("L1"), scope)
        await b.writer.flush(scope)
        assert b.writer.get_turn(key).route == "L1"
        await read_back(b.reader, [key, absent], [])
        assert b.reader.get_turn(key).route == "L1"
        got = b.reader.get_turns([absent, key, absent])
        assert got[0] is None and got[1].route == "L1" and got[2] is None
        assert b.reader.get_turn(absent) is None

    run(test)


def test_a_tool_call_binding_is_found_by_tenant_and_id(run):
    async def test(b: Backend):
        scope = b.writer.open_scope()
        await b.writer.load([], [], scope)
        b.writer.put_call("t1", "call-1", CallBinding("L2", '{"x":1}', "get_weather"), scope)
        await b.writer.flush(scope)
        await read_back(b.reader, [], [("t1", "call-1"), ("t2", "call-1")])
        got = b.reader.get_call("t1", "call-1")
        assert (got.route, got.arguments, got.name) == ("L2", '{"x":1}', "get_weather")
        assert b.reader.get_call("t2", "call-1") is None  # another tenant's id

    run(test)


def test_a_summary_set_after_the_put_reaches_a_later_reader(run):
    async def test(b: Backend):
        key = b"s" * 32
        rec = TurnRecord("L1")
        b.writer.put_turn(key, rec)  # outside a request (scope None)
        rec.set_summary("the summary")
        b.writer.put_turn(key, rec)  # again, bound: recounts only
        await b.writer.flush()
        await read_back(b.reader, [key], [])
        seen = b.reader.get_turn(key)
        assert (seen.summary, seen.summary_failed, seen.stale) == ("the summary", False, False)

    run(test)


def test_a_turn_marked_stale_in_a_request_stays_without_a_summary(run):
    async def test(b: Backend):
        key = b"t" * 32
        rec = TurnRecord("L1")
        b.writer.put_turn(key, rec)
        await b.writer.flush()
        scope = await read_back(b.reader, [key], [])
        seen = b.reader.get_turn(key)
        b.reader.mark_stale(seen, scope)
        assert seen.stale
        await b.reader.flush(scope)
        assert b.reader.get_turn(key).stale
        if b.writer.shared:  # the writer's summary after another replica's stale mark: dropped
            rec.set_summary("too late")
            await b.writer.flush()
            await asyncio.sleep(0.05)  # its merged state comes back with the write's reply
            assert rec.stale and rec.summary is None

    run(test)


def test_stats_are_integer_counters_and_choose_engine_keeps_a_fresh_conversation_here(run):
    async def test(b: Backend):
        b.writer.put_turn(b"c" * 32, TurnRecord("L1"))
        await b.writer.flush()
        stats = b.writer.stats()
        assert stats and all(isinstance(v, int) for v in stats.values())
        scope = b.writer.open_scope()
        await b.writer.load([], [], scope)
        assert await b.writer.choose_engine(None, scope) is None  # nobody owns it: this replica's engine
        assert isinstance(b.writer.shared, bool) and b.writer.shared == (b.kind == "redis")

    run(test)


def test_responses_per_tenant_get_previous_and_delete(run):
    async def test(b: Backend):
        r = b.responses
        await r.available()
        assert r.health() is None
        scope = b.writer.open_scope()
        await r.put_response(record("resp_1"), scope=scope)
        got = await r.get_response("t1", "resp_1")
        assert got["id"] == "resp_1" and got["messages"] == [{"role": "user", "content": "hi"}]
        assert got["route"] == "L1" and got["response"] == {"id": "resp_1"}
        assert await r.get_response("t2", "resp_1") is None  # another tenant's id is unknown
        assert (await r.get_previous("t1", "resp_1", b.reader.open_scope()))["id"] == "resp_1"
        assert await r.get_previous("t1", "resp_none") is None
        assert await r.delete_response("t1", "resp_1") is True
        assert await r.delete_response("t1", "resp_1") is False
        assert await r.get_response("t1", "resp_1") is None
        assert all(isinstance(v, int) for v in r.stats().values())

    run(test)


def test_a_chained_response_reads_back_its_whole_conversation(run):
    async def test(b: Backend):
        r = b.responses
        first = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
        await r.put_response(record("resp_a", messages=first), big=False, scope=b.writer.open_scope())
        whole = [*first, {"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}]
        await r.put_response(record("resp_b", previous="resp_a", messages=whole), big=True)
        assert (await r.get_previous("t1", "resp_b"))["messages"] == whole
        assert (await r.get_response("t1", "resp_a"))["messages"] == first  # the earlier one unchanged

    run(test)


def test_a_shared_store_keeps_a_requests_keys_with_its_response_for_the_next_request(run):
    """The next request of a chain finds the conversation's turns loaded with the previous
    response (a local store reads them from its own cache or file: the same answer)."""

    async def test(b: Backend):
        key = b"n" * 32
        scope = b.writer.open_scope()
        await b.writer.load([], [], scope)
        b.writer.put_turn(key, TurnRecord("L3"), scope)
        await b.responses.put_response(record("resp_n"), scope=scope)
        await b.writer.flush(scope)
        nxt = b.reader.open_scope()
        assert (await b.responses.get_previous("t1", "resp_n", nxt))["id"] == "resp_n"
        await b.reader.load([key], [], nxt)
        assert b.reader.get_turn(key).route == "L3"

    run(test)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_local_record_store_is_synchronous_and_wrapped_for_the_proxy(kind, tmp_path):
    records = open_store(kind, tmp_path, "tiny")
    assert isinstance(records, RecordStore) and not isinstance(records, ResponseStore)
    assert records.slow_puts is (kind == "sqlite") and records.busy_timeout_s > 0
    try:
        records.put_response(record("resp_s"))
        assert records.get_response("t1", "resp_s")["id"] == "resp_s"
        assert records.health() is None
        assert records.stats()["responses"] == 1
        assert records.delete_response("t1", "resp_s") is True
        assert records.get_response("t1", "resp_s") is None
        assert isinstance(as_proxy_store(records), ResponseStore)
    finally:
        records.close()
