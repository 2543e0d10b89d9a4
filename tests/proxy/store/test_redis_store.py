"""The Redis backend of the proxy's state (molctl.proxy.store.redis) against a real redis-server:
records per tenant and profile, TTLs, the count cap, the atomic turn merge between replicas,
the replica heartbeat, and the failure behaviour (unreachable at start, lost while serving,
stuck) through real `molctl proxy` processes driven by the openai SDK."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from molctl.errors import ExitStatus
from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.redis.connection import RedisState
from molctl.proxy.store.redis.conversations import RedisConversationStore
from molctl.proxy.store.redis.responses import RedisResponseStore
from molctl.proxy.store.redis.scripts import SCRIPTS
from molctl.proxy.store.redis.target import StoreUnavailable, parse_redis_url, read_password
from tests.helpers import ROOT, free_port, free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import KEY, PUBLIC, RESPONSES_TOOLS
from tests.redis_helpers import PATIENT_STORE, SKIP_ALL_BUT_STATE, shared_profile, until_served
from tests.redis_server import RedisServer, redis_server

AUTH = {"Authorization": f"Bearer {KEY}"}


def state(redis, profile="tiny", **kw) -> RedisState:
    return RedisState(
        parse_redis_url(redis.url),
        None,
        profile,
        replica_id=kw.pop("replica_id", "a"),
        advertise_upstream=kw.pop("advertise_upstream", "http://engine-a"),
        **kw,
    )


def record(rid: str, tenant: str = "t1", created_at: float | None = None) -> dict:
    return {
        "id": rid,
        "tenant": tenant,
        "created_at": time.time() if created_at is None else created_at,
        "previous_response_id": None,
        "route": "L1",
        "messages": [{"role": "user", "content": "hi"}],
        "input_items": [],
        "response": {"id": rid},
    }


def other_clients(r) -> list[str]:
    """The commands of the server's clients other than `r`."""
    return [c["cmd"] for c in r.client_list() if c["id"] != str(r.client_id())]


async def no_other_clients(r, within_s: float = 2.0) -> list[str]:
    """Other clients left once none is, or after within_s (polled: never a fixed sleep). A socket
    redis-py closes without waiting (`disconnect(nowait=True)`) is closed by the event loop's next
    pass and the server notices it after that: a CLIENT LIST sent at once, from the loop's own thread
    (blocking that pass), still lists it. A connection that stays open is still caught."""
    deadline = time.monotonic() + within_s
    while (left := other_clients(r)) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return left


# ------------------------------------------------------------------------------ configuration


def test_url_parsing_refuses_a_password_and_bad_parts():
    t = parse_redis_url("rediss://app@cache.internal:6380/3")
    assert (t.host, t.port, t.db, t.tls, t.username, t.address) == (
        "cache.internal",
        6380,
        3,
        True,
        "app",
        "rediss://cache.internal:6380/3",
    )
    assert parse_redis_url("redis://localhost").address == "redis://localhost:6379/0"
    with pytest.raises(ValueError, match="holds a password.*store_password_file.*MOLCTL_STORE_PASSWORD") as err:
        parse_redis_url("redis://:s3cret@h:6379/0")
    assert "s3cret" not in str(err.value)
    for bad, why in [("redis://h:99999/0", "port"), ("redis://h:6379/x", "database"), ("redis:///0", "no host")]:
        with pytest.raises(ValueError, match=why):
            parse_redis_url(bad)
    # a password typed where the user name goes (redis://PASSWORD@host) is never echoed by an error
    for bad in (
        "redis://hunter2@h:99999/0",
        "redis://hunter2@h:x/0",
        "redis://hunter2@h:6379/x?db=1",
        "redis://hunter2@:6379/0",
    ):
        with pytest.raises(ValueError) as err:
            parse_redis_url(bad)
        assert "hunter2" not in str(err.value)
    # nor by proxy.store's own check, for a URL of an unknown scheme (Redis://, redis+sentinel://, valkey://)
    from molctl.proxy.store.factory import parse_store_spec

    for bad in (
        "Redis://:hunter2@h/0",
        "redis+sentinel://u:hunter2@h:26379/0",
        "valkey://hunter2@h/0",
        "Redis://:a/hunter2@h/0",
    ):
        with pytest.raises(ValueError, match="expected 'sqlite'") as err:
            parse_store_spec(bad)
        assert "hunter2" not in str(err.value) and "@h" in str(err.value)


def test_password_from_file_or_environment(tmp_path):
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    assert read_password(str(f), {"MOLCTL_STORE_PASSWORD": "env"}) == "from-file"
    assert read_password(None, {"MOLCTL_STORE_PASSWORD": "env"}) == "env"
    assert read_password(None, {}) is None


def test_a_password_in_the_profile_url_is_one_line_naming_proxy_store(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "molctl",
            "proxy",
            "tiny",
            "--upstream",
            "http://127.0.0.1:9",
            "--allow-unauthenticated",
            "--set",
            "proxy.store=redis://:hunter2@127.0.0.1:6379/0",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == ExitStatus.CHECK_FAILED
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "proxy.store" in lines[0] and "password" in lines[0] and "hunter2" not in out.stderr


# ------------------------------------------------------------------------------ records


def test_responses_per_tenant_and_profile_with_ttl_and_delete(redis, r):
    async def main():
        st = state(redis)
        other = RedisResponseStore(state(redis, profile="venti"))
        store = RedisResponseStore(st)
        await store.put_response(record("resp_1"))
        got = await store.get_response("t1", "resp_1")
        assert got["id"] == "resp_1" and got["messages"] == [{"role": "user", "content": "hi"}]
        assert await store.get_response("t2", "resp_1") is None  # another tenant
        assert await other.get_response("t1", "resp_1") is None  # another profile
        assert await store.delete_response("t1", "resp_1") is True
        assert await store.delete_response("t1", "resp_1") is False
        assert await store.get_response("t1", "resp_1") is None
        await store.put_response(record("resp_2"))
        await st.close()
        await other.state.close()

    asyncio.run(main())
    [key] = r.keys("molctl:{tiny}:r:*")
    assert key == b"molctl:{tiny}:r:t1:resp_2"
    assert 0 < r.ttl(key) <= 30 * 24 * 3600  # every record expires by itself


def test_count_cap_evicts_the_oldest(redis, r):
    async def main():
        now = [time.time()]
        st = state(redis, max_entries=3, tenant_max_entries=3, clock=lambda: now[0])  # the global cap (one tenant)
        store = RedisResponseStore(st)
        for i in range(5):
            now[0] += 1
            await store.put_response(record(f"resp_{i}", created_at=now[0]))
        found = [await store.get_response("t1", f"resp_{i}") is not None for i in range(5)]
        await st.close()
        return found

    assert asyncio.run(main()) == [False, False, True, True, True]
    assert r.zcard("molctl:{tiny}:idx:r") == 3 and int(r.hget("molctl:{tiny}:stats", "r_evicted")) == 2


def test_turn_merge_never_lowers_a_turn_between_replicas(redis, r):
    """Replica B folded a turn without its summary (stale); A's summary arriving later is dropped,
    and A's local record learns it. A fresh put of the same turn never erases a summary."""

    async def main():
        a = RedisConversationStore(state(redis, replica_id="a"))
        b = RedisConversationStore(state(redis, replica_id="b"))
        key = b"k" * 32
        rec_a = TurnRecord("L1")
        a.put_turn(key, rec_a)
        await a.flush()
        assert await b.load([key], [], b.open_scope()) is True
        rec_b = b.get_turn(key)
        assert rec_b.route == "L1" and rec_b.replica == "a" and not rec_b.done.is_set()  # pending on A: B polls
        rec_b.mark_stale()
        await b.flush()
        rec_a.set_summary("late summary")
        await a.flush()
        await asyncio.sleep(0.05)
        assert rec_a.stale and rec_a.summary is None  # the stored (merged) state won
        stored = json.loads(r.get(a._tkey(key)))
        assert stored["state"] == "stale" and stored["summary"] is None and stored["replica"] == "a"
        # another key: summary first, then a replayed fresh put (same answer on another replica)
        key2 = b"z" * 32
        done = TurnRecord("L2")
        a.put_turn(key2, done)
        done.set_summary("S")
        await a.flush()
        b.put_turn(key2, TurnRecord("L3"))
        await b.flush()
        stored = json.loads(r.get(a._tkey(key2)))
        assert (stored["state"], stored["summary"], stored["route"]) == ("summary", "S", "L2")
        # tool-call bindings
        a.put_call("t1", "call-1", CallBinding("L2", "{}", "get_weather"))
        await a.flush()
        assert await b.load([], [("t1", "call-1")], b.open_scope()) is False
        assert b.get_call("t1", "call-1") == CallBinding("L2", "{}", "get_weather", "a")
        for s in (a, b):
            await s.state.close()

    asyncio.run(main())


def test_a_chained_read_brings_the_conversations_current_state_in_one_script(redis, r):
    """A stored response keeps the store keys of its conversation (turns, tool calls) before its
    JSON; `get_previous` reads the record and their current values in one script, and the next
    `load` of the same request uses them instead of reading again (only keys it lacks are read).
    Plain reads see the record as before; another tenant sees nothing; a record stored without
    keys (plain JSON) still reads."""

    async def main():
        a = RedisConversationStore(state(redis, replica_id="a"))
        b = RedisConversationStore(state(redis, replica_id="b"))
        on_a, on_b = RedisResponseStore(a.state), RedisResponseStore(b.state)
        turn, other = b"q" * 32, b"o" * 32

        async def request_on_a() -> TurnRecord:  # each request runs in a task of its own, as under uvicorn
            scope = a.open_scope()
            await a.load([], [], scope)
            rec = TurnRecord("L1")
            a.put_turn(turn, rec, scope)
            a.put_call("t1", "call-9", CallBinding("L1", "{}", "f"), scope)
            await on_a.put_response(record("resp_1"), scope=scope)
            await a.flush(scope)
            return rec

        rec = await asyncio.create_task(request_on_a())
        raw = r.get("molctl:{tiny}:r:t1:resp_1")
        assert raw.startswith(f"t:{turn.hex()} c:t1:call-9\n".encode())
        assert (await on_b.get_response("t1", "resp_1"))["messages"] == [{"role": "user", "content": "hi"}]
        rec.set_summary("S")  # the turn changes after the response was stored: its current state is read
        await a.flush()
        a.put_turn(other, TurnRecord("L2"))
        await a.flush()

        async def request_on_b() -> None:
            scope = b.open_scope()
            assert (await on_b.get_previous("t1", "resp_1", scope))["id"] == "resp_1"
            r.delete(a._tkey(turn), a._ckey("t1", "call-9"))  # gone now: what load finds came with the record
            assert await b.load([turn, other], [("t1", "call-9")], scope) is True
            seen = b.get_turn(turn)
            assert (seen.summary, seen.replica, seen.done.is_set()) == ("S", "a", True)
            assert b.get_turn(other).route == "L2"  # not kept with the record: read by the load
            assert b.get_call("t1", "call-9") == CallBinding("L1", "{}", "f", "a")

        await asyncio.create_task(request_on_b())
        r.script_flush()  # a restarted Redis lost the scripts: loaded again within the call
        assert await on_b.get_previous("t2", "resp_1") is None  # the key holds the tenant
        r.set("molctl:{tiny}:r:t1:resp_plain", json.dumps(record("resp_plain")))
        assert (await on_b.get_previous("t1", "resp_plain"))["id"] == "resp_plain"
        for s in (a, b):
            await s.state.close()

    asyncio.run(main())


def test_a_pending_turn_of_another_replica_is_awaited_until_its_summary_lands(redis, r):
    async def main():
        a = RedisConversationStore(state(redis, replica_id="a"))
        b = RedisConversationStore(state(redis, replica_id="b"), poll_s=0.02)
        key = b"p" * 32
        rec = TurnRecord("L1")
        a.put_turn(key, rec)
        await a.flush()
        await b.load([key], [], b.open_scope())
        seen = b.get_turn(key)
        assert not seen.done.is_set()
        rec.set_summary("it landed")
        await asyncio.wait_for(seen.done.wait(), 5)
        assert seen.summary == "it landed" and not seen.summary_failed
        for s in (a, b):
            await s.state.close()

    asyncio.run(main())


async def _registered(b, owner: str, timeout: float = 10.0):
    """b's view of `owner`'s registration, polled until it shows (its first heartbeat: a new Redis
    connection and a SET, which a loaded runner may not land within a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while (choice := await b.engine_for(owner)) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return choice


def test_heartbeat_registers_and_lapses(redis, r):
    async def main():
        # TTL 3 s: with 0.3 s the key expired on the server whenever this process stalled that long
        # between beats; the lapse tested here is close() unregistering, at once (well within 3 s)
        a = state(redis, replica_id="a", advertise_upstream="http://10.0.0.1:8000", heartbeat_s=0.05, heartbeat_ttl_s=3)
        b = state(redis, replica_id="b")

        async def healthy():
            return True

        a.start_heartbeat(healthy)
        choice = await _registered(b, "a")
        assert choice is not None and (choice.replica, choice.url) == ("a", "http://10.0.0.1:8000")
        assert await b.engine_for("b") is None  # its own conversations stay local
        assert await b.engine_for(None) is None
        await a.close()  # a clean stop unregisters at once
        b._peers.clear()
        assert await b.engine_for("a") is None
        await b.close()

    asyncio.run(main())


def test_a_heartbeat_is_fresh_by_its_redis_ttl_whatever_the_replicas_clocks(redis, r):
    """Replica b's wall clock runs 30 s ahead of a's: a's heartbeat (alive in Redis) still counts
    as fresh for b; its freshness is the key's TTL on the Redis server, not the writers' clocks."""

    async def main():
        # TTL 3 s (0.3 s could expire on the server during a stall): still far below b's 30 s lead,
        # so a freshness judged by the clocks would still call a's beat stale
        a = state(redis, replica_id="a", advertise_upstream="http://10.0.0.1:8000", heartbeat_s=0.05, heartbeat_ttl_s=3)
        b = state(redis, replica_id="b", clock=lambda: time.time() + 30)

        async def healthy():
            return True

        a.start_heartbeat(healthy)
        choice = await _registered(b, "a")
        assert choice is not None and choice.url == "http://10.0.0.1:8000"
        await a.close()
        await b.close()

    asyncio.run(main())


def test_two_proxies_under_one_replica_id_are_reported(redis, r, caplog):
    """Two processes heartbeat under one id (the default HOSTNAME:PORT on hosts cloned with one
    hostname): each takes the other's conversations for its own, affinity between them is lost.
    The heartbeat notices another writer and logs it once; a lone replica logs nothing."""

    async def main():
        async def healthy():
            return True

        lone = state(redis, replica_id="solo", heartbeat_s=0.02, heartbeat_ttl_s=1)
        lone.start_heartbeat(healthy)
        await asyncio.sleep(0.2)
        await lone.close()
        assert not [rec for rec in caplog.records if "replica id" in rec.getMessage()]
        a = state(
            redis,
            replica_id="gpu-node:8200",
            advertise_upstream="http://10.0.0.1:8000",
            heartbeat_s=0.02,
            heartbeat_ttl_s=1,
        )
        b = state(
            redis,
            replica_id="gpu-node:8200",
            advertise_upstream="http://10.0.0.2:8000",
            heartbeat_s=0.02,
            heartbeat_ttl_s=1,
        )
        a.start_heartbeat(healthy)
        b.start_heartbeat(healthy)
        deadline = time.monotonic() + 5  # until one says it (was a fixed 0.3 s)
        while not [rec for rec in caplog.records if "replica id" in rec.getMessage()] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # then more beats: each process must say it once, not at each beat
        await a.close()
        await b.close()

    with caplog.at_level("WARNING", logger="molctl.proxy"):
        asyncio.run(main())
    said = [rec.getMessage() for rec in caplog.records if "replica id" in rec.getMessage()]
    assert 1 <= len(said) <= 2  # each process says it once
    assert "gpu-node:8200" in said[0] and "--replica-id" in said[0]


def test_lost_store_fails_fast_then_recovers():
    server = RedisServer().start()
    try:

        async def main():
            st = state(server)
            store = RedisResponseStore(st)
            await store.put_response(record("resp_1"))
            server.stop()
            with pytest.raises(StoreUnavailable) as err:
                await store.get_response("t1", "resp_1")
            assert err.value.status == 503 and err.value.headers == {"retry-after": "2"}
            assert st.degraded and st.degraded_total == 1
            with pytest.raises(StoreUnavailable):  # within the retry interval: no network, at once
                await store.available()
            server.start()
            for _ in range(100):
                try:
                    await store.put_response(record("resp_2"))
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
            assert not st.degraded and st.degraded_total == 1
            assert (await store.get_response("t1", "resp_2"))["id"] == "resp_2"
            await st.close()

        asyncio.run(main())
    finally:
        server.stop()


def test_a_redis_restarted_while_the_proxy_was_idle_costs_no_call():
    """The pooled connections died with the old server: the first call after the restart
    reconnects once inside its timeout instead of failing (and failing every call for 1 s). The
    timeout is 5 s here: a reconnect on a loaded host can take longer than the default 0.5 s."""
    server = RedisServer().start()
    try:

        async def main():
            st = state(server, call_timeout_s=5.0)
            store = RedisResponseStore(st)
            await store.put_response(record("resp_1"))
            server.stop()
            server.start()  # nothing was asked meanwhile: the proxy has not noticed
            await store.put_response(record("resp_2"))
            assert (await store.get_response("t1", "resp_2"))["id"] == "resp_2"
            assert not st.degraded and st.degraded_total == 0
            await st.close()

        asyncio.run(main())
    finally:
        server.stop()


def test_a_script_flush_costs_no_write(redis, r):
    """SCRIPT FLUSH (an operator, a failover to a server without the scripts): the writes that
    met NOSCRIPT are sent again with the scripts loaded, none is lost."""

    async def main():
        st = state(redis)
        store = RedisResponseStore(st)
        await store.put_response(record("resp_1"))
        r.script_flush()
        await store.put_response(record("resp_2"))
        assert (await store.get_response("t1", "resp_2"))["id"] == "resp_2"
        assert not st.degraded and st.errors_total == 0
        await st.close()

    asyncio.run(main())


class _CuttingRelay:
    """A relay between the store and redis-server (asyncio, this loop) that can pass a reply only
    up to `cut(n)` bytes and hold the rest until `release()`: a reply half-read by its call."""

    def __init__(self, redis_port: int):
        self.redis_port, self._cut_at = redis_port, None
        self.cut_sent, self.released = asyncio.Event(), asyncio.Event()
        self.server = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def cut(self, n: int) -> None:
        self._cut_at = n

    def release(self) -> None:
        self.released.set()

    async def _handle(self, client_r, client_w):
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def pump(src, dst, replies: bool):
            try:
                while data := await src.read(65536):
                    if replies and self._cut_at is not None:
                        n, self._cut_at = self._cut_at, None
                        dst.write(data[:n])
                        await dst.drain()
                        self.cut_sent.set()
                        await self.released.wait()
                        data = data[n:]
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(client_r, redis_w, False), pump(redis_r, client_w, True))

    async def close(self) -> None:
        self.server.close()
        self.released.set()


def test_a_reply_cut_mid_way_is_never_read_by_the_next_call(redis, r):
    """A call cancelled while its reply was half-read (e.g. its request went away): that
    connection is disconnected, never pooled again; the next call gets its own reply, not the
    rest of the old one, and the store stays healthy (a cancellation is no outage)."""

    async def main():
        relay = _CuttingRelay(redis.port)
        port = await relay.start()
        st = RedisState(
            parse_redis_url(f"redis://127.0.0.1:{port}/0"),
            None,
            "tiny",
            replica_id="a",
            advertise_upstream="http://engine-a",
        )
        store = RedisResponseStore(st)
        big = record("resp_1")
        big["messages"][0]["content"] = "x" * 5000
        await store.put_response(big)
        await store.put_response(record("resp_2"))
        relay.cut(100)  # the next reply: its first 100 bytes, then nothing until released
        call = asyncio.create_task(store.get_response("t1", "resp_1"))
        await asyncio.wait_for(relay.cut_sent.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        relay.release()  # the rest of resp_1's reply reaches its socket if that is still open
        await asyncio.sleep(0.05)
        for _ in range(3):  # whichever pooled connection serves them
            assert (await store.get_response("t1", "resp_2"))["id"] == "resp_2"
            assert (await store.get_response("t1", "resp_1"))["messages"][0]["content"] == "x" * 5000
        assert not st.degraded and st.errors_total == 0
        await st.close()
        await relay.close()

    asyncio.run(main())


def test_an_error_reply_inside_a_write_batch_fails_that_write_only(redis, r, caplog):
    """Writes started together share one round trip; a command the server refuses (here a turn
    key holding another type) fails its own write (counted, logged), the others land, and the
    connection's later replies stay in order."""

    async def main():
        st = state(redis)
        bad, good = st.prefix + "t:bad", st.prefix + "c:t1:call_1"
        r.rpush(bad, "not a turn")
        merged, put = await asyncio.gather(
            st.merge_turn(
                bad, json.dumps({"route": "L1", "summary": None, "state": "pending", "replica": "a", "at": 1}).encode()
            ),
            st.put(good, "conv", b'{"route": "L1"}'),
            return_exceptions=True,
        )
        assert isinstance(merged, StoreUnavailable) and "WRONGTYPE" in merged.why
        assert put == 0 and r.get(good) == b'{"route": "L1"}'
        assert not st.degraded and st.errors_total == 1
        store = RedisResponseStore(st)
        await store.put_response(record("resp_1"))
        assert (await store.get_response("t1", "resp_1"))["id"] == "resp_1"
        await st.close()

    with caplog.at_level("WARNING", logger="molctl.proxy"):
        asyncio.run(main())
    assert "write refused by the server" in caplog.text and "WRONGTYPE" in caplog.text


def test_more_concurrent_calls_than_connections_wait_their_turn(redis, r, monkeypatch):
    """MAX_CONNECTIONS bounds the connections; calls beyond it wait for one (within their timeout),
    also while the store keeps its last connection aside for the next call: every call is answered."""
    import molctl.proxy.store.redis.connection as redis_store

    monkeypatch.setattr(redis_store, "MAX_CONNECTIONS", 1)

    async def main():
        st = state(redis)
        store = RedisResponseStore(st)
        await store.put_response(record("resp_1"))
        for _ in range(3):
            got = await asyncio.gather(
                *(store.get_response("t1", "resp_1") for _ in range(40)),
                *(store.put_response(record(f"resp_w{i}")) for i in range(20)),
            )
            assert [g["id"] for g in got[:40]] == ["resp_1"] * 40
        assert len(st._connection_pool()._in_use_connections) + len(st._connection_pool()._available_connections) == 1
        assert not st.degraded and st.errors_total == 0
        await st.close()

    asyncio.run(main())


def test_a_write_started_before_close_lands_before_the_connections_close(redis, r):
    """A write started in the pass that closes the store (a summary's turn at shutdown) goes out
    before close() returns; it was sent after, on a client reopened for it that nothing closed."""

    async def main():
        st = state(redis)
        await st.put(st.prefix + "c:t1:call_0", "conv", b"{}")
        written = st.put(st.prefix + "c:t1:call_1", "conv", b'{"route": "L1"}')
        await st.close()
        assert written.done() and written.result() == 0
        assert st._pool is None

    asyncio.run(main())
    assert r.get("molctl:{tiny}:c:t1:call_1") == b'{"route": "L1"}'


def test_close_and_a_degradation_close_the_pools_connections(redis, r):
    """The pool's connections are closed when the store closes and when a failure drops the pool
    (they stayed open: redis-py leaves a pool it was given open; a stalling Redis left up to
    MAX_CONNECTIONS sockets per degradation behind)."""
    import molctl.proxy.store.redis.connection as redis_store

    def others() -> list[str]:
        return [c["cmd"] for c in r.client_list() if c["id"] != str(r.client_id())]

    async def main():
        st = state(redis)
        await asyncio.gather(*(st.put(st.prefix + f"c:t1:call_{i}", "conv", b"{}") for i in range(3)))
        assert others()
        st._failed("test", TimeoutError("stalled"))  # what a timed-out call does
        assert await no_other_clients(r) == []  # the old pool closes in the background
        await asyncio.sleep(redis_store.RETRY_S)  # degraded until its one retry
        await st.put(st.prefix + "c:t1:call_9", "conv", b"{}")
        assert others()
        await st.close()
        assert await no_other_clients(r) == []

    asyncio.run(main())


def test_a_call_after_close_fails_at_once_and_opens_no_connection(redis, r):
    """A write or read started after close() (a summary finishing during shutdown) gets
    StoreUnavailable at once; it used to open a new client that nothing closed."""

    def others() -> list[str]:
        return [c["cmd"] for c in r.client_list() if c["id"] != str(r.client_id())]

    async def main():
        st = state(redis)
        await st.put(st.prefix + "c:t1:call_1", "conv", b"{}")
        await st.close()
        for attempt in (
            lambda: st.put(st.prefix + "c:t1:call_2", "conv", b"{}"),
            st.available,
            lambda: RedisResponseStore(st).get_response("t1", "resp_x"),
        ):
            with pytest.raises(StoreUnavailable):
                await attempt()
        await asyncio.sleep(0.1)
        assert others() == []
        assert not st.degraded  # closed is not an outage

    asyncio.run(main())
    assert r.exists("molctl:{tiny}:c:t1:call_1") and not r.exists("molctl:{tiny}:c:t1:call_2")


def test_a_call_in_flight_when_its_pool_is_dropped_leaves_no_connection_open(redis, r):
    """Another call's failure drops the pool while a call is in flight: that call's connection is
    closed with the pool, it reconnects once and is answered, and its connection is closed when it
    is done (it went back to the dropped pool, open, and stayed open for the process's life)."""

    async def main():
        st = state(redis, call_timeout_s=10.0)
        slow = asyncio.create_task(st.call("debug", lambda: st.command("DEBUG", "SLEEP", "0.3")))
        await asyncio.sleep(0.1)  # sent; Redis is sleeping on it
        st._failed("test", TimeoutError("stalled"))  # what another call's timeout does
        assert await slow == b"OK"
        await st.close()
        assert await no_other_clients(r) == []

    asyncio.run(main())


def test_a_connection_the_server_closed_while_idle_costs_no_call(redis, r):
    """Redis closed the store's idle connections (CLIENT KILL, its idle timeout): the next call
    reconnects once within its timeout and succeeds; the store stays healthy."""

    async def main():
        st = state(redis)
        store = RedisResponseStore(st)
        await store.put_response(record("resp_1"))
        assert r.client_kill_filter(_type="normal", skipme=True) >= 1
        assert (await store.get_response("t1", "resp_1"))["id"] == "resp_1"
        r.client_kill_filter(_type="normal", skipme=True)
        await store.put_response(record("resp_2"))
        assert (await store.get_response("t1", "resp_2"))["id"] == "resp_2"
        assert not st.degraded and st.errors_total == 0
        await st.close()

    asyncio.run(main())


def test_a_redis_out_of_memory_refuses_writes_but_is_not_lost(caplog):
    """maxmemory reached under `noeviction` (Redis's default policy): the server answers, refusing
    writes. A refused write fails alone (the request gets its 503) and is logged with the hint;
    the store is not marked lost, so reads (a retrieve, a chain's previous response) still work."""
    server = RedisServer(None, "--maxmemory-policy", "noeviction").start()
    try:

        async def main():
            st = state(server)
            store = RedisResponseStore(st)
            await store.put_response(record("resp_1"))
            admin = server.client()
            admin.set("filler", b"x" * 3_000_000)
            admin.config_set("maxmemory", "2mb")  # the server is now over it, and evicts nothing
            admin.close()
            with pytest.raises(StoreUnavailable):
                await store.put_response(record("resp_2"))
            with pytest.raises(StoreUnavailable):
                await st.call("heartbeat", lambda: st.command("SET", st.prefix + "replica:a", "{}", "PX", 6000))
            assert not st.degraded and st.degraded_total == 0
            assert (await store.get_response("t1", "resp_1"))["id"] == "resp_1"  # reads are served
            assert st.errors_total == 2
            await st.close()

        with caplog.at_level("WARNING", logger="molctl.proxy"):
            asyncio.run(main())
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 1 and "maxmemory" in refused[0] and "volatile-lru" in refused[0]  # once, not per call
    finally:
        server.stop()


# ------------------------------------------------------------------------------ the proxy


def test_proxy_refuses_to_start_when_redis_is_unreachable(keyfile):
    port, proxy_port = free_ports(2)  # nothing listens on the first (the store)
    out = subprocess.run(
        proxy_argv(
            "tiny",
            "http://127.0.0.1:9",
            proxy_port,
            "--api-key-file",
            str(keyfile),
            "--set",
            f"proxy.store=redis://127.0.0.1:{port}/0",
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == ExitStatus.ERROR
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert f"proxy.store redis://127.0.0.1:{port}/0: unreachable" in lines[0]


@pytest.fixture
def served(keyfile, tmp_path):
    """A fake engine, a Redis of its own (it gets stopped) and a proxy on it."""
    server = RedisServer().start()
    engine_port, proxy_port, metrics_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    try:
        with (
            running(fake_engine_argv(engine_port), engine_url + "/health", log=tmp_path / "engine.log"),
            running(
                proxy_argv(
                    "tiny",
                    engine_url,
                    proxy_port,
                    "--api-key-file",
                    str(keyfile),
                    "--metrics-port",
                    str(metrics_port),
                    "--set",
                    f"proxy.store={server.url}",
                ),
                proxy_url + "/health",
                log=tmp_path / "proxy.log",
            ),
        ):
            client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=15)
            yield server, proxy_url, f"http://127.0.0.1:{metrics_port}", client
    finally:
        server.stop()


def metrics(metrics_url: str) -> dict[str, float]:
    """The proxy's metrics listener's unlabelled samples (no key there)."""
    text = httpx.get(metrics_url + "/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")}


def test_redis_lost_while_serving_then_back(served, tmp_path):
    server, proxy_url, metrics_url, client = served
    first = client.responses.create(model=PUBLIC, input="[route:L1] hello")
    server.stop()
    # stateless chat keeps answering
    chat = client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] still there?"}]
    )
    assert chat.choices[0].message.content.startswith("answer-")
    # Responses requests that need state: 503 with Retry-After (a chain, a stored response, a retrieve)
    for call in (
        lambda: client.responses.create(model=PUBLIC, input="more", previous_response_id=first.id),
        lambda: client.responses.create(model=PUBLIC, input="[route:L1] new"),
        lambda: client.responses.retrieve(first.id),
    ):
        with pytest.raises(openai.APIStatusError) as err:
            call()
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "2"
        assert err.value.body["code"] == "store_unavailable"
    # a response that keeps no state is still served
    assert client.responses.create(model=PUBLIC, input="[route:L1] nothing kept", store=False).status == "completed"
    m = metrics(metrics_url)
    assert m["molctl_proxy_state_store_up"] == 0 and m["molctl_proxy_state_store_degraded_total"] == 1
    assert m["molctl_proxy_state_store_errors_total"] >= 1
    log_text = (tmp_path / "proxy.log").read_text()
    assert log_text.count("degraded: chat continues") == 1  # logged once, not per request
    # Redis is back (empty: it kept nothing): the proxy recovers without a restart
    server.start()
    for _ in range(100):
        try:
            again = client.responses.create(model=PUBLIC, input="[route:L1] back")
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            time.sleep(0.1)
    assert client.responses.create(model=PUBLIC, input="on", previous_response_id=again.id).status == "completed"
    assert metrics(metrics_url)["molctl_proxy_state_store_up"] == 1
    assert "reachable again" in (tmp_path / "proxy.log").read_text()


def test_a_stuck_redis_never_hangs_a_request(served):
    """CLIENT PAUSE holds every command for 30 s: each request still ends (chat answered, Responses
    503) well within the client's 15 s timeout."""
    server, proxy_url, metrics_url, client = served
    first = client.responses.create(model=PUBLIC, input="[route:L1] hello")
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", "30000", "ALL")
    try:
        chat = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] hi"}])
        assert chat.choices[0].message.content.startswith("answer-")
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.create(model=PUBLIC, input="more", previous_response_id=first.id)
        assert err.value.status_code == 503
        # the event loop was never blocked: health answers at once
        assert httpx.get(proxy_url + "/health", timeout=2).status_code == 200
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()


# ------------------------------------------------------------------------------ check, state stats|prune


def test_check_and_state_stats_prune_on_redis(redis, r, tmp_path, state_dir):
    from tests.helpers import Molctl

    cli = Molctl(state_dir, [shared_profile(tmp_path, redis.url)], in_process=True)

    async def seed():
        st = state(redis, profile="shared", max_entries=100)
        store = RedisResponseStore(st)
        for i in range(3):
            await store.put_response(record(f"resp_{i}"))
        await st.close()

    asyncio.run(seed())
    result = cli("check", "shared", *SKIP_ALL_BUT_STATE, "--json")
    [check] = [c for c in result.json()["checks"] if c["id"] == "state.store"]
    assert check["status"] == "pass" and f"proxy.store {redis.url} reachable" in check["detail"]
    assert "3 stored response(s)" in check["detail"]
    data = cli("state", "stats", "shared", "--json").json()
    assert data["backend"] == "redis" and data["redis"]["responses"] == 3 and data["redis"]["address"] == redis.url
    text = cli("state", "stats", "shared").stdout
    assert redis.url in text and "3 response(s)" in text
    r.zadd("molctl:{shared}:idx:r", {"molctl:{shared}:r:t1:gone": 1.0})  # an index entry whose record expired long ago
    pruned = cli("state", "prune", "shared", "--json").json()
    assert pruned["removed"] == {"expired": 1, "evicted": 0, "conversation_expired": 0, "conversation_evicted": 0}
    assert "pruned: 0 expired" in cli("state", "prune", "shared").stdout
    # unreachable: the check fails with the address; stats is one line, exit 1
    down = Molctl(state_dir, [shared_profile(tmp_path / "x", f"redis://127.0.0.1:{free_port()}/0")], in_process=True)
    [check] = [
        c for c in down("check", "shared", *SKIP_ALL_BUT_STATE, "--json").json()["checks"] if c["id"] == "state.store"
    ]
    assert (
        check["status"] == "fail"
        and "unreachable" in check["detail"]
        and "proxy.store redis://127.0.0.1:" in check["detail"]
    )
    result = down("state", "stats", "shared")
    assert result.exit_code == ExitStatus.ERROR and result.stderr.count("\n") == 1 and "unreachable" in result.stderr


def test_check_warns_of_maxmemory_under_noeviction(redis, r, tmp_path, state_dir):
    """`molctl check`'s state.store: maxmemory under `noeviction` (Redis's default policy) is a
    warning (at the limit every write is refused)."""
    from tests.helpers import Molctl

    cli = Molctl(state_dir, [shared_profile(tmp_path, redis.url)], in_process=True)
    r.config_set("maxmemory", "512mb")
    r.config_set("maxmemory-policy", "noeviction")
    try:
        [check] = [
            c
            for c in cli("check", "shared", *SKIP_ALL_BUT_STATE, "--json").json()["checks"]
            if c["id"] == "state.store"
        ]
    finally:
        r.config_set("maxmemory", "0")
    assert check["status"] == "warn" and "noeviction" in check["detail"] and "volatile-lru" in check["detail"]


def test_check_fails_a_store_password_file_readable_by_others(redis, r, tmp_path, state_dir):
    """As an API key file: a store password file readable by group or others fails state.store."""
    from tests.helpers import Molctl

    cli = Molctl(state_dir, [shared_profile(tmp_path, redis.url)], in_process=True)
    pw = tmp_path / "store-password"
    pw.write_text("s3cret\n")
    pw.chmod(0o644)
    result = cli("check", "shared", *SKIP_ALL_BUT_STATE, "--set", f"proxy.store_password_file={pw}", "--json")
    [check] = [c for c in result.json()["checks"] if c["id"] == "state.store"]
    assert check["status"] == "fail" and f"proxy.store_password_file {pw} has mode 0644" in check["detail"]
    assert "s3cret" not in result.stdout + result.stderr


def test_password_file_authenticates_and_a_wrong_one_is_one_line(tmp_path, keyfile):
    server = RedisServer(None, "--requirepass", "s3cret").start()
    try:
        pw = tmp_path / "store-password"
        pw.write_text("s3cret\n")
        engine_port, proxy_port = free_ports(2)
        engine_url = f"http://127.0.0.1:{engine_port}"
        with (
            running(fake_engine_argv(engine_port), engine_url + "/health"),
            running(
                proxy_argv(
                    "tiny",
                    engine_url,
                    proxy_port,
                    "--api-key-file",
                    str(keyfile),
                    "--set",
                    f"proxy.store={server.url}",
                    "--set",
                    f"proxy.store_password_file={pw}",
                ),
                f"http://127.0.0.1:{proxy_port}/readyz",
            ) as proc,
        ):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key=KEY, max_retries=0, timeout=15)
            first = client.responses.create(model=PUBLIC, input="[route:L1] hi")
            assert client.responses.retrieve(first.id).id == first.id
            assert "s3cret" not in " ".join(proc.args)  # never on argv
        pw.write_text("wrong\n")
        out = subprocess.run(
            proxy_argv(
                "tiny",
                engine_url,
                free_port(),
                "--api-key-file",
                str(keyfile),
                "--set",
                f"proxy.store={server.url}",
                "--set",
                f"proxy.store_password_file={pw}",
            ),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == ExitStatus.ERROR and len(lines) == 1
        assert f"proxy.store {server.url}: unreachable: authentication failed" in lines[0] and "wrong" not in out.stderr
    finally:
        server.stop()


# ------------------------------------------------------------------------------ round trips per request

BACKGROUND = {"heartbeat", "turn summary", "turn failed", "client", "select", "auth", "hello", "script"}


def label(argv: list[bytes]) -> str:
    """What one command sent to Redis was for (see tests/redis_relay.py)."""
    name = argv[0].upper()
    if name == b"EVALSHA":
        nkeys, key = int(argv[2]), argv[3]
        if b":r:" in key:  # a response's scripts: told apart by their SHA1
            return RESPONSE_SCRIPTS.get(argv[1].decode(), "evalsha r")
        if b":c:" in key:
            return "put call"
        if b":t:" in key:
            return f"turn {json.loads(argv[3 + nkeys])['state']}"
    if name in (b"SET", b"DEL") and len(argv) > 1 and b":replica:" in argv[1]:
        return "heartbeat"
    return name.decode().lower()


def request_trips(flights: list[list[list[bytes]]]) -> list[list[str]]:
    """The round trips of the request itself: each as its sorted commands, without the background
    ones (heartbeats, the summary hop's write, a new pooled connection's set-up)."""
    trips = [sorted(x for x in map(label, flight) if x not in BACKGROUND) for flight in flights]
    return [t for t in trips if t]


RESPONSE_SCRIPTS = {
    hashlib.sha1(SCRIPTS[name].encode()).hexdigest(): shown
    for name, shown in (("chain", "chain"), ("rput", "put r"), ("rdel", "delete r"))
}


@pytest.fixture
def relayed(keyfile, tmp_path):
    """A proxy whose Redis connections pass through a relay that counts round trips."""
    from tests.redis_relay import redis_relay

    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    with (
        redis_server() as server,
        redis_relay(server.port) as relay,
        running(fake_engine_argv(engine_port), engine_url + "/health", log=tmp_path / "engine.log"),
        running(
            proxy_argv(
                "tiny",
                engine_url,
                proxy_port,
                "--api-key-file",
                str(keyfile),
                "--set",
                f"proxy.store={relay.url}",
                *PATIENT_STORE,
            ),
            proxy_url + "/health",
            log=tmp_path / "proxy.log",
        ),
    ):
        yield relay, openai.OpenAI(base_url=proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=15)


def test_round_trips_of_a_chained_responses_request_and_a_chat_turn(relayed):
    """A chained Responses request makes two round trips to Redis: one script reads the previous
    response and its conversation's turns (or tool calls) together, one pipeline writes the new
    turn and the new response; a chat turn with history two: the turns' MGET and the write.
    Counted at the socket (a relay), not timed: before, a chained request made three."""
    relay, client = relayed
    summaries_expected = 0

    def trips_of(call):
        """The request's round trips, counted once the earlier turns' summaries were written."""
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and sum(label(c) in ("turn summary", "turn failed") for f in relay.since(0) for c in f) < summaries_expected
        ):
            time.sleep(0.02)
        mark = relay.snapshot()
        result = call()
        return result, request_trips(relay.since(mark))

    # warm-up: scripts loaded, connections made (on a loaded host, past the first calls' timeout: 503s)
    first = until_served(lambda: client.responses.create(model=PUBLIC, input="[route:L1] hello"))
    until_served(
        lambda: client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] warm"}])
    )
    summaries_expected = 2

    second, trips = trips_of(
        lambda: client.responses.create(model=PUBLIC, input="[route:L1] more", previous_response_id=first.id)
    )
    assert trips == [["chain"], ["put r", "turn pending"]]
    summaries_expected += 1
    # streamed: the turn and the response are written in one pipeline too
    _, trips = trips_of(
        lambda: list(
            client.responses.create(model=PUBLIC, input="[route:L2] again", previous_response_id=second.id, stream=True)
        )
    )
    assert trips == [["chain"], ["put r", "turn pending"]]
    summaries_expected += 1
    # a tool call: its binding is kept with the response, so the tool result's request reads it in the same script
    called, trips = trips_of(
        lambda: client.responses.create(
            model=PUBLIC, input="[tool:get_weather] Paris?", tools=RESPONSES_TOOLS, previous_response_id=second.id
        )
    )
    assert trips == [["chain"], ["put call", "put r"]]
    call = next(item for item in called.output if item.type == "function_call")
    answered, trips = trips_of(
        lambda: client.responses.create(
            model=PUBLIC,
            previous_response_id=called.id,
            tools=RESPONSES_TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C sunny"}],
        )
    )
    assert answered.status == "completed" and trips == [["chain"], ["put r", "turn pending"]]
    summaries_expected += 1
    # chat: the first turn writes once; the next turn reads its history's turns once and writes once
    messages = [{"role": "user", "content": "[route:L2] first"}]
    reply, trips = trips_of(lambda: client.chat.completions.create(model=PUBLIC, messages=messages))
    assert trips == [["turn pending"]]
    summaries_expected += 1
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "[route:L3] next"},
    ]
    _, trips = trips_of(lambda: client.chat.completions.create(model=PUBLIC, messages=messages))
    assert trips == [["mget"], ["turn pending"]]


def test_the_count_cap_never_evicts_the_record_being_written(redis, r):
    """The index is ordered by the writing replica's clock: a replica whose clock stepped back (NTP)
    or lags its peers wrote the "oldest" entry, and at the cap its own write evicted it at once: the
    client got an id that was already a 404. Found with an injected clock at the cap (as the SQLite
    store's put). The write's own key is never its victim; the cap still holds."""

    async def main():
        now = [time.time()]
        st = state(redis, max_entries=3, tenant_max_entries=3, clock=lambda: now[0])  # the global cap (one tenant)
        store = RedisResponseStore(st)
        for i in range(3):
            now[0] += 1
            await store.put_response(record(f"resp_{i}", created_at=now[0]))
        now[0] -= 3600
        await store.put_response(record("after_the_step", created_at=now[0]))
        found = [
            await store.get_response("t1", rid) is not None for rid in ("resp_0", "resp_1", "resp_2", "after_the_step")
        ]
        await st.close()
        return found

    assert asyncio.run(main()) == [False, True, True, True]
    assert r.zcard("molctl:{tiny}:idx:r") == 3 and int(r.hget("molctl:{tiny}:stats", "r_evicted")) == 1
