"""The shared Redis store against SQLite (issue 13), on a real redis-server on this host.

1. Store work per request, measured on the stores directly with 2,000 records prefilled, at 1 and
   32 concurrent clients (asyncio tasks on one event loop, as in the proxy):
   - Responses: get the previous response + put the new one (a 2 KiB record);
   - chat: one turn's state: the history's turn records read (8 turns: SQLite 8 indexed reads past
     its cache, Redis one MGET) + the new turn written (Redis: written behind and flushed before
     the answer's last bytes, as the orchestrator does).
   SQLite calls run on the loop (they are short and synchronous); Redis calls are awaited, so at
   32 clients their latency includes waiting for the loop, as requests in the proxy do.
   Reported: p50 each and the p50 Redis adds (target: <= 0.5 ms at 1 client).
2. End to end: chat requests per second through one proxy replica against two, each replica with
   its own fake engine, both on the Redis store, 32 clients spread round-robin. On a 2-core host
   this measures the replicas' overhead (they share the CPUs), not scaling.
Run with `make bench`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.proxy.conversations import TurnRecord  # noqa: E402
from molctl.proxy.store.redis.connection import RedisState
from molctl.proxy.store.redis.conversations import RedisConversationStore
from molctl.proxy.store.redis.responses import RedisResponseStore
from molctl.proxy.store.redis.target import parse_redis_url  # noqa: E402
from molctl.proxy.store.sqlite.conversations import SqliteConversationStore
from molctl.proxy.store.sqlite.store import SqliteResponseStore  # noqa: E402
from tests.helpers import free_port  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

PREFILL = 2000
ROUNDS = 1500
TURNS = 8
TARGET_MS = 0.5
WALL: list[float] = []  # the last case's elapsed time per request (ms)
PUBLIC = "Macaron-Tiny-Demo"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def make_record(i: int, size: int = 2048) -> dict:
    words = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[: size // 2]
    return {
        "id": f"resp_{i:08d}",
        "tenant": "0123456789abcdef",
        "created_at": time.time(),
        "previous_response_id": None,
        "route": "L2",
        "messages": [{"role": "user", "content": words}, {"role": "assistant", "content": words}],
        "input_items": [],
        "response": {"id": f"resp_{i:08d}", "object": "response", "status": "completed"},
    }


async def _maybe(value):
    return await value if asyncio.iscoroutine(value) else value


async def clients(n: int, rounds: int, one, wall: list[float] | None = None) -> list[float]:
    """`n` tasks share `rounds` requests; each request's latency in ms (and, into `wall`, the
    elapsed time per request: the loop time a request costs when they run concurrently)."""
    out: list[float] = []
    todo = iter(range(rounds))

    async def worker():
        for i in todo:
            t0 = time.perf_counter()
            await one(i)
            out.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n)))
    if wall is not None:
        wall.append((time.perf_counter() - t0) * 1000 / rounds)
    return out


async def responses_case(store, n: int) -> list[float]:
    for i in range(PREFILL):
        await _maybe(store.put_response(make_record(i, 512)))

    async def one(i: int) -> None:
        await _maybe(store.get_response("0123456789abcdef", f"resp_{i:08d}"))
        await _maybe(store.put_response(make_record(PREFILL + i)))

    return await clients(n, ROUNDS, one, WALL)


async def chat_case(store, n: int, fresh) -> list[float]:
    """One turn's state work: TURNS earlier turns read (not cached in this process), one written."""
    history = [[os.urandom(32) for _ in range(TURNS)] for _ in range(ROUNDS)]
    for keys in history:
        for k in keys:
            store.put_turn(k, TurnRecord("L1", summary="s" * 200, summary_failed=False))
        await store.flush()
    store = fresh()  # a process that did not see those turns (another replica)

    async def one(i: int) -> None:
        keys = history[i]
        scope = store.open_scope()
        await store.load(keys, [], scope)  # a local store: nothing to read
        for k in keys:
            store.get_turn(k)
        store.put_turn(os.urandom(32), TurnRecord("L2"), scope)
        await store.flush(scope)

    return await clients(n, ROUNDS, one, WALL)


def store_bench(redis_url: str) -> list[dict]:
    rows = []
    for n in (1, 32):
        for case in ("responses", "chat"):

            async def run_sqlite(case=case, n=n) -> list[float]:
                with tempfile.TemporaryDirectory() as d:
                    db = SqliteResponseStore(Path(d) / "s.sqlite3")
                    try:
                        if case == "responses":
                            return await responses_case(db, n)
                        return await chat_case(SqliteConversationStore(db), n, lambda: SqliteConversationStore(db))
                    finally:
                        db.close()

            async def run_redis(case=case, n=n) -> list[float]:
                states = []

                def new_state() -> RedisState:
                    states.append(
                        RedisState(
                            parse_redis_url(redis_url),
                            None,
                            f"bench{n}{case}",
                            replica_id="a",
                            advertise_upstream="http://x",
                            max_entries=1_000_000,
                        )
                    )
                    return states[-1]

                try:
                    if case == "responses":
                        return await responses_case(RedisResponseStore(new_state()), n)
                    return await chat_case(
                        RedisConversationStore(new_state()), n, lambda: RedisConversationStore(new_state())
                    )
                finally:
                    for s in states:
                        await s.close()

            sql = asyncio.run(run_sqlite())
            sql_wall = WALL.pop()
            red = asyncio.run(run_redis())
            red_wall = WALL.pop()
            rows.append(
                {
                    "clients": n,
                    "case": case,
                    "sqlite_p50_ms": statistics.median(sql),
                    "sqlite_p99_ms": pct(sql, 0.99),
                    "redis_p50_ms": statistics.median(red),
                    "redis_p99_ms": pct(red, 0.99),
                    "added_p50_ms": statistics.median(red) - statistics.median(sql),
                    "sqlite_wall_ms": sql_wall,
                    "redis_wall_ms": red_wall,
                }
            )
    return rows


async def chained_response(session, url: str, i: int, previous: str | None) -> tuple[str, float]:
    """Request `i` of a /v1/responses chain (a new chain every 10th): its id and its time (ms)."""
    body = {"model": PUBLIC, "input": f"[route:L2] turn {i}", "max_output_tokens": 16}
    if previous and i % 10:
        body["previous_response_id"] = previous
    t0 = time.perf_counter()
    async with session.post(url + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        response_id = (await r.json())["id"]
    return response_id, (time.perf_counter() - t0) * 1000


def proxy_bench(redis_url: str, requests: int = 300) -> list[dict]:
    """End to end: a `--store sqlite` proxy and a Redis one side by side on one fake engine, their
    requests interleaved (the same noise for both): chained /v1/responses at 1 client (chains of
    10), and chat conversations (3 turns each) at 32 clients; p50 per request."""
    import aiohttp

    from tests.procs import fake_engine_argv, proxy_argv, running

    async def drive(urls: dict[str, str], concurrency: int) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {k: [] for k in urls}
        async with aiohttp.ClientSession() as session:

            async def responses_chain(kind: str, i: int, prev: dict) -> None:
                prev[kind], ms = await chained_response(session, urls[kind], i, prev.get(kind))
                times[kind].append(ms)

            async def chat(kind: str, i: int) -> None:
                history: list[dict] = []
                for t in range(3):
                    history.append({"role": "user", "content": f"[route:L{1 + t % 2}] conversation {i} turn {t}"})
                    t0 = time.perf_counter()
                    async with session.post(
                        urls[kind] + "/v1/chat/completions",
                        json={"model": PUBLIC, "messages": history, "max_tokens": 8},
                    ) as r:
                        assert r.status == 200, await r.text()
                        answer = (await r.json())["choices"][0]["message"]["content"]
                    times[kind].append((time.perf_counter() - t0) * 1000)
                    history.append({"role": "assistant", "content": answer})

            kinds = list(urls)
            if concurrency == 1:
                prev: dict = {}
                for i in range(requests + 20):
                    for kind in kinds if i % 2 else kinds[::-1]:
                        await responses_chain(kind, i, prev)
                for kind in kinds:
                    del times[kind][:40]  # warm-up
            else:
                todo = iter(range(requests // 3))

                async def worker():
                    for i in todo:
                        for kind in kinds if i % 2 else kinds[::-1]:
                            await chat(kind, i)

                await asyncio.gather(*(worker() for _ in range(concurrency)))
        return times

    out = []
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        engine_port = free_port()
        engine = f"http://127.0.0.1:{engine_port}"
        stack.enter_context(running(fake_engine_argv(engine_port), engine + "/health"))
        urls = {}
        for kind, spec in (("sqlite", "sqlite"), ("redis", redis_url)):
            port = free_port()
            argv = proxy_argv("tiny", engine, port, "--allow-unauthenticated", "--set", f"proxy.store={spec}")
            stack.enter_context(
                running([*argv[:3], "--state-dir", state, *argv[3:]], f"http://127.0.0.1:{port}/readyz")
            )
            urls[kind] = f"http://127.0.0.1:{port}"
        for concurrency in (1, 32):
            times = asyncio.run(drive(urls, concurrency))
            out.append(
                {
                    "clients": concurrency,
                    "requests": "responses chain" if concurrency == 1 else "chat turns",
                    "sqlite_p50_ms": statistics.median(times["sqlite"]),
                    "redis_p50_ms": statistics.median(times["redis"]),
                    "added_p50_ms": statistics.median(times["redis"]) - statistics.median(times["sqlite"]),
                }
            )
    return out


def replicas_bench(redis_url: str, total: int = 600, concurrency: int = 32) -> list[dict]:
    """Chat requests per second through 1 replica and through 2 (each its own fake engine)."""
    import aiohttp

    from tests.procs import fake_engine_argv, proxy_argv, running

    async def drive(urls: list[str]) -> float:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> None:
                body = {
                    "model": PUBLIC,
                    "messages": [{"role": "user", "content": f"[route:L2] request {i}"}],
                    "max_tokens": 8,
                }
                async with session.post(urls[i % len(urls)] + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            await asyncio.gather(*(one(i) for i in range(concurrency)))  # warm-up
            t0 = time.perf_counter()
            await clients(concurrency, total, one)
            return total / (time.perf_counter() - t0)

    out = []
    with tempfile.TemporaryDirectory() as state, contextlib.ExitStack() as stack:
        urls = []
        for name in ("A", "B"):
            engine_port, port = free_port(), free_port()
            engine = f"http://127.0.0.1:{engine_port}"
            stack.enter_context(running(fake_engine_argv(engine_port), engine + "/health"))
            argv = proxy_argv(
                "tiny",
                engine,
                port,
                "--allow-unauthenticated",
                "--set",
                f"proxy.store={redis_url}",
                "--replica-id",
                name,
            )
            stack.enter_context(
                running([*argv[:3], "--state-dir", state, *argv[3:]], f"http://127.0.0.1:{port}/readyz")
            )
            urls.append(f"http://127.0.0.1:{port}")
        for replicas in (1, 2):
            out.append({"replicas": replicas, "rps": asyncio.run(drive(urls[:replicas]))})
    return out


def main() -> None:
    server = RedisServer().start()
    try:
        rows = store_bench(server.url)
        print(
            f"Redis store vs SQLite, store work per request ({PREFILL} records prefilled; Redis {server.url} on this host):"
        )
        print(
            f"{'clients':>7} {'case':>9} {'sqlite p50':>11} {'p99':>8} {'redis p50':>10} {'p99':>8} {'added p50':>10}"
            f" {'wall/req sqlite':>16} {'redis':>9}"
        )
        for r in rows:
            mark = (
                f"  (target <= {TARGET_MS} ms: {'ok' if r['added_p50_ms'] <= TARGET_MS else 'OVER'})"
                if r["clients"] == 1
                else ""
            )
            print(
                f"{r['clients']:>7} {r['case']:>9} {r['sqlite_p50_ms']:>8.3f} ms {r['sqlite_p99_ms']:>5.2f} ms "
                f"{r['redis_p50_ms']:>7.3f} ms {r['redis_p99_ms']:>5.2f} ms {r['added_p50_ms']:>+7.3f} ms"
                f" {r['sqlite_wall_ms']:>13.3f} ms {r['redis_wall_ms']:>6.3f} ms{mark}"
            )
        e2e = proxy_bench(server.url)
        print("end to end through a proxy, --store sqlite and redis side by side (fake engine, no delay):")
        for r in e2e:
            mark = (
                f"  (target <= {TARGET_MS} ms: {'ok' if r['added_p50_ms'] <= TARGET_MS else 'OVER'})"
                if r["clients"] == 1
                else ""
            )
            print(
                f"  {r['clients']:>2} client(s), {r['requests']:<15} sqlite p50 {r['sqlite_p50_ms']:.2f} ms, "
                f"redis p50 {r['redis_p50_ms']:.2f} ms, added {r['added_p50_ms']:+.2f} ms{mark}"
            )
        reps = replicas_bench(server.url)
        print(
            f"chat through proxy replicas on the Redis store, 32 clients, fake engines (no delay), {os.cpu_count()} CPUs:"
        )
        for r in reps:
            print(f"  {r['replicas']} replica(s): {r['rps']:.0f} requests/s")
        print(f"  two / one: {reps[1]['rps'] / reps[0]['rps']:.2f}x (on a shared 2-core host: overhead, not scaling)")
        if "--json" in sys.argv:
            print(json.dumps({"store": rows, "proxy": e2e, "replicas": reps}))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
