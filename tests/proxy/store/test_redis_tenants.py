"""Issue 32 on the shared Redis store (molctl.proxy.store.redis, key format 2), against a real
redis-server: per-tenant quotas (entries and bytes) with eviction inside the tenant that went over,
the global caps as a last resort (from the tenant holding the most), byte totals that agree with
what is stored, two replicas on one Redis holding one tenant quota, data written by key format 1
still read (and evicted first), `state prune` applying the quotas, and a record over its quota on
its own refused before the write (the 400 of tests/proxy/store/test_store_quota_error.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from molctl.proxy.errors import store_failure
from molctl.proxy.store.base import QuotaExceeded
from molctl.proxy.store.redis import admin as redis_admin
from molctl.proxy.store.redis.responses import RedisResponseStore
from molctl.proxy.store.redis.scripts import KEY_FORMAT
from molctl.proxy.store.redis.target import parse_redis_url
from tests.redis_helpers import Clock, P, state, totals_agree
from tests.redis_server import load_dump

FORMAT1 = Path(__file__).parents[2] / "data" / "redis-format1.json"


def rec(rid: str, tenant: str, size: int = 100, t: float | None = None) -> dict:
    return {
        "id": rid,
        "tenant": tenant,
        "created_at": time.time() if t is None else t,
        "previous_response_id": None,
        "route": "L1",
        "messages": [{"role": "user", "content": "x" * size}],
        "input_items": [],
        "response": {"id": rid},
    }


def held(r, key: str) -> int:
    """What a response holds: its record and (key format 3) its chain's bytes, where it is the chain's only reference."""
    count_cid = r.hget(P + "rch", key)
    return r.strlen(key) + (int(r.hget(P + "chm", "b:" + count_cid.decode().split(":", 1)[1])) if count_cid else 0)


async def live(store: RedisResponseStore, tenant: str, ids: list[str]) -> list[bool]:
    return [await store.get_response(tenant, rid) is not None for rid in ids]


def test_one_tenants_bulk_never_evicts_another_tenants_responses(redis, r):
    """The issue's scenario at small scale: tenant B stores 20 responses, then tenant A writes ~400
    KiB of bodies (far over its quota, a quarter of each cap by default, and over the global byte
    cap). Before, eviction was global oldest-first and A's bulk evicted all of B's; now A evicts
    its own oldest only and every one of B's is still stored."""

    async def main():
        st = state(redis, clock=Clock(), max_entries=200, max_bytes=128 * 1024)
        store = RedisResponseStore(st)
        b_ids = [f"resp_b{i}" for i in range(20)]
        for rid in b_ids:
            await store.put_response(rec(rid, "tenant-b", size=500))
        a_ids = [f"resp_a{i}" for i in range(200)]
        for rid in a_ids:
            await store.put_response(rec(rid, "tenant-a", size=2000))
        assert st.tenant_max_entries == 50 and st.tenant_max_bytes == 32 * 1024
        b_live, a_live = await live(store, "tenant-b", b_ids), await live(store, "tenant-a", a_ids)
        await st.close()
        return b_live, a_live

    b_live, a_live = asyncio.run(main())
    assert all(b_live)
    k = sum(a_live)  # A keeps its newest that fit its 32 KiB (its oldest went first)
    assert a_live == [False] * (200 - k) + [True] * k
    totals = totals_agree(r)
    one = held(r, P + "r:tenant-a:resp_a199")
    assert totals["tenant-b"][0] == 20 and totals["tenant-a"][0] == k
    assert totals["tenant-a"][1] <= 32 * 1024 < totals["tenant-a"][1] + one
    assert int(r.hget(P + "stats", "r_evicted")) == 200 - k and int(r.hget(P + "stats", "format")) == KEY_FORMAT


def test_a_tenant_over_its_entry_quota_evicts_its_own_oldest(redis, r):
    async def main():
        st = state(redis, clock=Clock(), max_entries=100, tenant_max_entries=3)
        store = RedisResponseStore(st)
        await store.put_response(rec("resp_other", "tenant-b"))
        for i in range(6):
            await store.put_response(rec(f"resp_{i}", "tenant-a"))
        found = (
            await live(store, "tenant-a", [f"resp_{i}" for i in range(6)]),
            await live(store, "tenant-b", ["resp_other"]),
        )
        await st.close()
        return found

    assert asyncio.run(main()) == ([False, False, False, True, True, True], [True])
    assert totals_agree(r) == {
        "tenant-a": (3, sum(held(r, P + f"r:tenant-a:resp_{i}") for i in (3, 4, 5))),
        "tenant-b": (1, held(r, P + "r:tenant-b:resp_other")),
    }


def test_byte_totals_follow_puts_rewrites_deletes_and_the_byte_quota(redis, r):
    """Every put, rewrite of an id, delete and eviction moves the totals by the stored value's bytes
    (the record with the store keys kept before it), in the script that does it."""

    async def main():
        st = state(redis, clock=Clock(), max_entries=100, tenant_max_bytes=3000)
        store = RedisResponseStore(st)
        await store.put_response(rec("resp_1", "tenant-a", size=500))
        one = held(r, P + "r:tenant-a:resp_1")
        assert totals_agree(r) == {"tenant-a": (1, one)}
        await store.put_response(rec("resp_1", "tenant-a", size=900))  # the same id again: its old bytes go
        assert totals_agree(r) == {"tenant-a": (1, held(r, P + "r:tenant-a:resp_1"))}
        assert await store.delete_response("tenant-a", "resp_1") is True
        assert totals_agree(r) == {} and await store.delete_response("tenant-a", "resp_1") is False
        for i in range(6):  # ~640 bytes each: the 3000-byte quota holds four
            await store.put_response(rec(f"resp_{i}", "tenant-a", size=500))
        found = await live(store, "tenant-a", [f"resp_{i}" for i in range(6)])
        await st.close()
        return found

    assert asyncio.run(main()) == [False, False, True, True, True, True]
    n, size = totals_agree(r)["tenant-a"]
    assert n == 4 and size <= 3000


def test_the_global_caps_hold_as_a_last_resort_evicting_from_the_biggest_tenant(redis, r):
    """Every tenant within its quota, the store over its cap: the tenant holding the most evicts its
    oldest (by responses over the entry cap, by bytes over the byte cap); the others keep theirs."""

    async def main():
        st = state(redis, clock=Clock(), max_entries=10, tenant_max_entries=6)
        store = RedisResponseStore(st)
        for i in range(6):
            await store.put_response(rec(f"big_{i}", "tenant-big"))
        for i in range(4):
            await store.put_response(rec(f"mid_{i}", "tenant-mid"))
        for i in range(2):
            await store.put_response(rec(f"new_{i}", "tenant-new"))
        by_count = (
            await live(store, "tenant-big", [f"big_{i}" for i in range(6)]),
            await live(store, "tenant-mid", [f"mid_{i}" for i in range(4)]),
            await live(store, "tenant-new", ["new_0", "new_1"]),
        )
        await st.close()
        r.flushall()
        st = state(redis, clock=Clock(), max_entries=100, max_bytes=8000, tenant_max_bytes=8000)
        store = RedisResponseStore(st)
        for i in range(3):
            await store.put_response(rec(f"fat_{i}", "tenant-fat", size=2000))  # ~6.5 KB in all
        for i in range(6):
            await store.put_response(rec(f"thin_{i}", "tenant-thin", size=100))  # ~1.3 KB
        await store.put_response(rec("last", "tenant-thin", size=1000))  # ~1.1 KB more: over 8000 by ~1 KB
        by_bytes = (
            await live(store, "tenant-fat", [f"fat_{i}" for i in range(3)]),
            await live(store, "tenant-thin", [f"thin_{i}" for i in range(6)] + ["last"]),
        )
        await st.close()
        return by_count, by_bytes

    by_count, by_bytes = asyncio.run(main())
    assert by_count == ([False, False, True, True, True, True], [True] * 4, [True, True])
    assert by_bytes == ([False, True, True], [True] * 7)  # the fat tenant held the most bytes
    totals_agree(r)


def test_two_replicas_on_one_redis_hold_one_tenant_quota(redis, r):
    """Two store objects (two proxy replicas) write the same tenant at once, interleaved in batches:
    the quota is checked and enforced inside each write's script, so the tenant ends at exactly
    its quota, the totals agree, and each replica reads the other's newest."""

    async def main():
        a = RedisResponseStore(state(redis, clock=Clock(), replica_id="a", max_entries=1000, tenant_max_entries=7))
        b = RedisResponseStore(state(redis, clock=Clock(), replica_id="b", max_entries=1000, tenant_max_entries=7))
        await b.put_response(rec("resp_other", "tenant-b"))
        for n in range(10):  # each round: 8 concurrent writes from each replica (each one pipeline)
            await asyncio.gather(
                *(
                    s.put_response(rec(f"resp_{s.state.replica_id}{n}_{i}", "tenant-a"))
                    for i in range(8)
                    for s in (a, b)
                )
            )
        newest = [
            await a.get_response("tenant-a", "resp_b9_7") is not None,
            await b.get_response("tenant-a", "resp_a9_7") is not None,
            await a.get_response("tenant-b", "resp_other") is not None,
        ]
        for s in (a, b):
            await s.state.close()
        return newest

    assert asyncio.run(main()) == [True, True, True]
    totals = totals_agree(r)
    assert totals["tenant-a"][0] == 7 and totals["tenant-b"][0] == 1
    assert len(r.keys(P + "r:tenant-a:*")) == 7 and int(r.hget(P + "stats", "r_evicted")) == 160 - 7


def load_format1(r) -> float:
    """tests/data/redis-format1.json into the server: the keys molctl wrote before the tenant quotas
    (key format 1, written by redis_store.py as of commit 2a074a0 through its own API: two chained
    responses of tenant-a, one of tenant-b, a turn and a tool-call binding). Returns the clock the
    dump was taken at."""
    return load_dump(r, FORMAT1)


def test_key_format_1_data_is_read_continued_deleted_and_evicted_first(redis, r):
    """Records of key format 1 (no tenant totals: an `idx:r` entry without an `rsz` field) read as
    before, with the store keys kept before their JSON; a new write is accounted beside them; they
    count towards the global entry cap only and are its first victims; a delete or a prune
    handles them. `state stats` tells the formats apart."""
    from molctl.proxy.store.redis import admin as redis_admin

    t0 = load_format1(r)
    target = parse_redis_url(redis.url)
    assert redis_admin.describe(target, None, "tiny")["key_format"] == 1

    async def main():
        st = state(redis, clock=Clock(t0), max_entries=4, tenant_max_entries=4)
        store = RedisResponseStore(st)
        first = await store.get_response("tenant-a", "resp_a1")
        prev = await store.get_previous("tenant-a", "resp_a2")
        assert first["messages"][0]["content"] == "hello" and len(prev["messages"]) == 4
        await store.put_response(
            {
                **rec("resp_a3", "tenant-a", t=t0),
                "previous_response_id": "resp_a2",
                "messages": prev["messages"] + [{"role": "user", "content": "again"}],
            }
        )
        assert (await live(store, "tenant-a", ["resp_a1", "resp_a2", "resp_a3"])) == [True, True, True]
        await store.put_response(rec("resp_c1", "tenant-c", t=t0))  # 5 over a global cap of 4: the oldest old one goes
        after_cap = (
            await live(store, "tenant-a", ["resp_a1", "resp_a2", "resp_a3"]),
            await live(store, "tenant-b", ["resp_b1"]),
            await live(store, "tenant-c", ["resp_c1"]),
        )
        assert await store.delete_response("tenant-b", "resp_b1") is True
        await st.close()
        return after_cap

    assert asyncio.run(main()) == ([False, True, True], [True], [True])
    assert r.zcard(P + "idx:r") == 3 and totals_agree(r) == {
        "tenant-a": (1, held(r, P + "r:tenant-a:resp_a3")),
        "tenant-c": (1, held(r, P + "r:tenant-c:resp_c1")),
    }
    assert redis_admin.describe(target, None, "tiny")["key_format"] == KEY_FORMAT


def test_prune_applies_the_tenant_quotas_and_expires_with_the_totals(redis, r):
    """`molctl state prune` (redis admin.prune): index entries past the TTL are forgotten with their bytes;
    a quota lowered since the writes is applied now, per tenant, as a write would."""

    async def main():
        st = state(redis, clock=Clock(), max_entries=1000)
        store = RedisResponseStore(st)
        for i in range(5):
            await store.put_response(rec(f"resp_a{i}", "tenant-a"))
        for i in range(2):
            await store.put_response(rec(f"resp_b{i}", "tenant-b"))
        await st.close()

    asyncio.run(main())
    r.zadd(P + "idx:r", {P + "r:tenant-a:gone": 1.0})  # an entry whose record expired long ago
    removed = redis_admin.prune(parse_redis_url(redis.url), None, "tiny", 3600, 1000, tenant_max_entries=3)
    assert removed == {"expired": 1, "evicted": 2, "conversation_expired": 0, "conversation_evicted": 0}
    totals = totals_agree(r)
    assert totals["tenant-a"][0] == 3 and totals["tenant-b"][0] == 2
    assert not r.exists(P + "r:tenant-a:resp_a0") and r.exists(P + "r:tenant-a:resp_a4")


def test_a_record_over_its_quota_on_its_own_is_refused_before_the_write(redis, r):
    """On Redis the size is known before the write: nothing is sent, nothing evicted; the error is
    the one SQLite raises (cause "quota"), which the proxy answers with a 400 naming the quota."""

    async def main():
        st = state(redis, max_entries=100, tenant_max_bytes=2000)
        store = RedisResponseStore(st)
        await store.put_response(rec("resp_keep", "tenant-a"))
        with pytest.raises(QuotaExceeded, match=r"over proxy.store_tenant_max_bytes \(2000\): not stored") as err:
            await store.put_response(rec("resp_big", "tenant-a", size=3000))
        assert await store.get_response("tenant-a", "resp_keep") is not None
        assert not st.degraded and st.errors_total == 0
        await st.close()
        return err.value

    exc = asyncio.run(main())
    assert not r.exists(P + "r:tenant-a:resp_big") and totals_agree(r)["tenant-a"][0] == 1
    failure = store_failure(exc, "req_1")
    assert (failure.status, failure.type, failure.code, failure.param) == (
        400,
        "invalid_request_error",
        "store_quota_exceeded",
        "store",
    )
    assert "proxy.store_tenant_max_bytes: 2000 bytes" in failure.message and "`store: false`" in failure.message
    assert "req_1" in failure.message and "\n" not in failure.message
