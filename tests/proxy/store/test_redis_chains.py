"""Issue 32 on the shared Redis store (key format 3): a chain's shared history stored once, against a
real redis-server. A continuation of its chain's newest response appends only its new messages to
the chain's list; reading rebuilds the conversation in one round trip; a chain's messages stay while
any response references it (evicted, deleted or expired ancestors keep their descendants whole); a
branch starts a chain of its own; two store objects on one Redis share one chain; data written by key
format 2 (tests/data/redis-format2.json) is still read, continued and deleted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from molctl.proxy.store.redis import admin as redis_admin
from molctl.proxy.store.redis.responses import RedisResponseStore
from molctl.proxy.store.redis.scripts import KEY_FORMAT
from molctl.proxy.store.redis.target import parse_redis_url
from tests.redis_helpers import Clock, P, state, totals_agree
from tests.redis_server import load_dump

FORMAT2 = Path(__file__).parents[2] / "data" / "redis-format2.json"
TEXT = "lorem ipsum " * 85  # ~1 KiB a message


def turn(rid: str, prev: dict | None, i: int, tenant: str = "tenant-a", t: float | None = None) -> dict:
    """The record the proxy stores for turn `i` continuing `prev`: its whole conversation."""
    messages = (prev["messages"] if prev else []) + [
        {"role": "user", "content": f"{i} {TEXT}"},
        {"role": "assistant", "content": f"answer {i}"},
    ]
    return {
        "id": rid,
        "tenant": tenant,
        "created_at": t if t is not None else Clock().t,
        "previous_response_id": prev["id"] if prev else None,
        "route": "L1",
        "messages": messages,
        "input_items": [],
        "response": {"id": rid},
    }


async def chain(
    store: RedisResponseStore,
    n: int,
    name: str = "c",
    tenant: str = "tenant-a",
    after: dict | None = None,
    t: float | None = None,
) -> list[dict]:
    out, prev = [], after
    for i in range(n):
        prev = turn(f"resp_{name}{i}", prev, i, tenant, t)
        await store.put_response(prev)
        out.append(prev)
    return out


def chains(r) -> int:
    return len(r.keys(P + "ch:*"))


def test_a_50_turn_chain_grows_linearly_and_reads_back_whole(redis, r):
    async def main():
        st = state(redis, clock=Clock(), max_bytes=64 * 1024 * 1024)
        store = RedisResponseStore(st)
        sizes, turns = [], []
        prev = None
        for i in range(50):
            prev = turn(f"resp_{i}", prev, i)
            await store.put_response(prev)
            turns.append(prev)
            sizes.append(int(r.hget(P + "stats", "r_bytes")))
        got = [await store.get_response("tenant-a", t["id"]) for t in turns]
        prev_read = await store.get_previous("tenant-a", "resp_49")
        await st.close()
        return sizes, turns, got, prev_read

    sizes, turns, got, prev_read = asyncio.run(main())
    steps = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert max(steps) - min(steps) < 64  # each write adds its own messages only: linear, not quadratic
    assert sizes[-1] < 50 * (steps[0] + 64)
    whole = sum(len(json.dumps(t, separators=(",", ":"))) for t in turns)  # what full copies would hold
    assert sizes[-1] * 10 < whole
    assert [g["messages"] for g in got] == [t["messages"] for t in turns] and prev_read["messages"] == turns[-1][
        "messages"
    ]
    assert chains(r) == 1 and r.llen(P + "ch:1") == 100
    totals_agree(r)


def test_evicting_or_deleting_ancestors_keeps_descendants_whole(redis, r):
    async def main():
        st = state(redis, clock=Clock(), max_entries=1000, tenant_max_entries=5)
        store = RedisResponseStore(st)
        turns = await chain(store, 12)  # over its quota of 5: the oldest 7 evicted, the chain stays
        live = [await store.get_response("tenant-a", t["id"]) is not None for t in turns]
        for t in turns[7:11]:
            assert await store.delete_response("tenant-a", t["id"]) is True
        last = await store.get_response("tenant-a", "resp_c11")
        totals_agree(r)
        nxt = turn("resp_c12", last, 12)  # the newest still continues the chain (appends)
        await store.put_response(nxt)
        again = await store.get_response("tenant-a", "resp_c12")
        assert chains(r) == 1
        await store.delete_response("tenant-a", "resp_c11")
        await store.delete_response("tenant-a", "resp_c12")
        await st.close()
        return live, last, turns, nxt, again

    live, last, turns, nxt, again = asyncio.run(main())
    assert live == [False] * 7 + [True] * 5
    assert last["messages"] == turns[11]["messages"] and again["messages"] == nxt["messages"]
    assert chains(r) == 0 and not r.hgetall(P + "chm") and not r.hgetall(P + "rch")  # the last reference took it
    assert totals_agree(r) == {} and int(r.hget(P + "stats", "r_bytes")) == 0


def test_a_branch_starts_a_chain_of_its_own_with_its_whole_conversation(redis, r):
    async def main():
        st = state(redis, clock=Clock())
        store = RedisResponseStore(st)
        turns = await chain(store, 5)
        branch = turn("resp_b", turns[2], 3)  # continues a response that is not its chain's newest
        await store.put_response(branch)
        tip = turn("resp_c5", turns[4], 5)  # the newest still appends to the first chain
        await store.put_response(tip)
        got = {rid: await store.get_response("tenant-a", rid) for rid in ("resp_b", "resp_c2", "resp_c5")}
        await store.delete_response("tenant-a", "resp_c2")
        after = await store.get_response("tenant-a", "resp_b")
        await st.close()
        return turns, branch, tip, got, after

    turns, branch, tip, got, after = asyncio.run(main())
    assert got["resp_b"]["messages"] == branch["messages"] == after["messages"]
    assert got["resp_c2"]["messages"] == turns[2]["messages"] and got["resp_c5"]["messages"] == tip["messages"]
    assert chains(r) == 2 and r.llen(P + "ch:1") == 12 and r.llen(P + "ch:2") == 8
    totals_agree(r)


def test_expiry_keeps_a_chain_while_a_response_lives_then_drops_it(redis, r):
    async def main():
        clock = Clock()
        st = state(redis, clock=clock, ttl_s=100)
        store = RedisResponseStore(st)
        old = await chain(store, 3, t=clock.t)
        ttl_first = r.ttl(P + "ch:1")
        clock.t += 60
        newer = await chain(store, 1, name="n", after=old[-1], t=clock.t)  # the chain's TTL refreshed: the max
        assert chains(r) == 1 and r.ttl(P + "ch:1") >= ttl_first - 2
        clock.t += 50  # the first three are past their TTL, the newest is not
        await store.put_response(turn("resp_other", None, 0, t=clock.t))  # a write forgets the expired entries
        kept = await store.get_response("tenant-a", "resp_n0")
        gone = [await store.get_response("tenant-a", t["id"]) for t in old]
        totals_agree(r)
        clock.t += 200
        await store.put_response(turn("resp_late", None, 0, t=clock.t))
        await st.close()
        return newer, kept, gone

    newer, kept, gone = asyncio.run(main())
    assert kept["messages"] == newer[0]["messages"] and gone == [None, None, None]
    assert r.hlen(P + "rch") == 1 and chains(r) == 1  # only resp_late's chain is left
    totals_agree(r)


def test_two_store_objects_on_one_redis_share_one_chain(redis, r):
    async def main():
        a, b = state(redis, clock=Clock(), replica_id="a"), state(redis, clock=Clock(), replica_id="b")
        sa, sb = RedisResponseStore(a), RedisResponseStore(b)
        prev = None
        for i in range(6):
            store = (sa, sb)[i % 2]
            prev_read = prev and await store.get_previous("tenant-a", prev["id"])
            assert prev is None or prev_read["messages"] == prev["messages"]
            prev = turn(f"resp_{i}", prev_read, i)
            await store.put_response(prev)
        # concurrent continuations of the same tip: one appends, the other branches; both read whole
        x, y = turn("resp_x", prev, 6), turn("resp_y", prev, 6)
        await asyncio.gather(sa.put_response(x), sb.put_response(y))
        got = [
            await sb.get_response("tenant-a", "resp_x"),
            await sa.get_response("tenant-a", "resp_y"),
            await sa.get_response("tenant-a", "resp_5"),
        ]
        await a.close()
        await b.close()
        return prev, x, y, got

    prev, x, y, got = asyncio.run(main())
    assert [g["messages"] for g in got] == [x["messages"], y["messages"], prev["messages"]]
    assert chains(r) == 2 and r.llen(P + "ch:1") == 14
    totals_agree(r)


def load_format2(r) -> float:
    """tests/data/redis-format2.json into the server: the keys molctl wrote with key format 2 (the
    tenant quotas, every record holding its whole conversation; written by redis_store.py at a3ee934
    through its own API: resp_a1 and its continuation resp_a2 of tenant-a, resp_b1 of tenant-b)."""
    return load_dump(r, FORMAT2)


def test_key_format_2_data_is_read_continued_and_deleted(redis, r):
    t0 = load_format2(r)
    target = parse_redis_url(redis.url)
    assert redis_admin.describe(target, None, "tiny")["key_format"] == 2

    async def main():
        st = state(redis, clock=Clock(t0))
        store = RedisResponseStore(st)
        first = await store.get_response("tenant-a", "resp_a1")
        prev = await store.get_previous("tenant-a", "resp_a2")
        nxt = turn("resp_a3", prev, 3, t=t0)
        await store.put_response(nxt)  # continues a format-2 record: a chain of its own, whole
        nxt2 = turn("resp_a4", nxt, 4, t=t0)
        await store.put_response(nxt2)  # and the next one appends to it
        got = [await store.get_response("tenant-a", rid) for rid in ("resp_a3", "resp_a4")]
        totals_agree(r)
        for tenant, rid in (("tenant-a", "resp_a1"), ("tenant-a", "resp_a2"), ("tenant-b", "resp_b1")):
            assert await store.delete_response(tenant, rid) is True
        await st.close()
        return first, prev, nxt, nxt2, got

    first, prev, nxt, nxt2, got = asyncio.run(main())
    assert [m["content"] for m in first["messages"]] == ["hello", "hi"] and len(prev["messages"]) == 4
    assert [g["messages"] for g in got] == [nxt["messages"], nxt2["messages"]]
    assert chains(r) == 1 and r.llen(P + "ch:1") == 8
    assert (
        set(totals_agree(r)) == {"tenant-a"} and redis_admin.describe(target, None, "tiny")["key_format"] == KEY_FORMAT
    )


def test_after_its_tip_goes_a_continuation_branches_and_a_lost_list_is_a_counted_404(redis, r):
    """The chain's newest deleted: the chain keeps its length (no response is its newest any more),
    so continuing the one before starts a chain of its own, whole; the old chain goes with its last
    reference. A list Redis dropped itself (maxmemory eviction): its responses are unreadable (None,
    counted), never a conversation with a gap, and a continuation of them starts afresh."""

    async def main():
        st = state(redis, clock=Clock())
        store = RedisResponseStore(st)
        turns = await chain(store, 3)
        await store.delete_response("tenant-a", "resp_c2")
        nxt = turn("resp_n", turns[1], 2)
        await store.put_response(nxt)
        got = await store.get_response("tenant-a", "resp_n")
        totals_agree(r)
        await store.delete_response("tenant-a", "resp_c0")
        await store.delete_response("tenant-a", "resp_c1")
        assert chains(r) == 1 and not r.exists(P + "ch:1")
        r.delete(P + "ch:2")  # as Redis's own eviction would
        errors = st.errors_total
        lost = await store.get_response("tenant-a", "resp_n")
        counted = st.errors_total - errors
        await store.put_response(turn("resp_after", turns[1], 2))  # resp_n's chain is unusable: a new one
        await store.delete_response("tenant-a", "resp_n")
        await st.close()
        return nxt, got, lost, counted

    nxt, got, lost, counted = asyncio.run(main())
    assert got["messages"] == nxt["messages"] and lost is None and counted == 1
    assert r.llen(P + "ch:3") == 6 and chains(r) == 1
    totals_agree(r)
