"""The response store's cost per Responses request: one `get_response` (the previous response of
the chain) + one `put_response` (the new one), in-process (`MemoryResponseStore`) against SQLite
(`SqliteResponseStore`: WAL, synchronous=NORMAL, a file in a temp dir), side by side, for three
record sizes, with the store already holding PREFILL records. Reports p50/p99 in microseconds and
the p50 SQLite adds (target: <= 300 us, i.e. 0.3 ms per request). Then one long chain (50 and
200 turns, `chain_bench`): the store's bytes and the per-write cost (`--chain`: only that;
`--redis`: the same chain on the Redis store too, `redis_chain_bench`, a redis-server started for it).

Then, when the proxy serves /v1/responses, the same comparison end to end: one client sending
chained requests (`previous_response_id`) through a `molctl proxy --store memory` and a
`--store sqlite` against the fake engine (no delay), p50 per request. Run with `make bench`."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.proxy.store.memory import MemoryResponseStore  # noqa: E402
from molctl.proxy.store.sqlite.store import SqliteResponseStore  # noqa: E402

PREFILL = 5000
ROUNDS = 2000
SIZES = {"2 KiB": 2 * 1024, "32 KiB": 32 * 1024, "256 KiB": 256 * 1024}
TARGET_US = 300.0


def make_record(i: int, size: int) -> dict:
    words = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[: size // 2]
    return {
        "id": f"resp_{i:08d}",
        "tenant": "0123456789abcdef",
        "created_at": time.time(),
        "previous_response_id": f"resp_{i - 1:08d}" if i else None,
        "route": "L2",
        "messages": [{"role": "user", "content": words}, {"role": "assistant", "content": words}],
        "input_items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]}],
        "response": {
            "id": f"resp_{i:08d}",
            "object": "response",
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "ok"}]}],
        },
    }


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def measure(store, size: int, rounds: int) -> list[float]:
    """Per request: get the previous response, put the new one (a fresh dict each time, as the
    proxy builds one per response)."""
    for i in range(PREFILL):
        store.put_response(make_record(i, 512))
    records = [make_record(PREFILL + i, size) for i in range(rounds)]
    out = []
    for i, rec in enumerate(records):
        t0 = time.perf_counter()
        store.get_response(rec["tenant"], f"resp_{PREFILL + i - 1:08d}")
        store.put_response(rec)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def store_bench() -> list[dict]:
    rows = []
    for label, size in SIZES.items():
        rounds = ROUNDS if size < 100_000 else ROUNDS // 4
        mem = measure(MemoryResponseStore(max_entries=1_000_000), size, rounds)
        with tempfile.TemporaryDirectory() as d:
            sql_store = SqliteResponseStore(Path(d) / "store.sqlite3")
            sql = measure(sql_store, size, rounds)
            get_only = []
            for i in range(rounds):
                t0 = time.perf_counter()
                sql_store.get_response("0123456789abcdef", f"resp_{PREFILL + i:08d}")
                get_only.append((time.perf_counter() - t0) * 1e6)
            sql_store.close()
        rows.append(
            {
                "record": label,
                "memory_p50_us": statistics.median(mem),
                "memory_p99_us": pct(mem, 0.99),
                "sqlite_p50_us": statistics.median(sql),
                "sqlite_p99_us": pct(sql, 0.99),
                "sqlite_get_p50_us": statistics.median(get_only),
                "added_p50_us": statistics.median(sql) - statistics.median(mem),
            }
        )
    return rows


def chain_bench(turns: int = 50, text_bytes: int = 1024) -> dict:
    """One conversation of `turns` chained responses, as the proxy stores it: each turn gets the
    previous record, then puts one whose `messages` are the previous conversation plus this
    turn's user message and answer (`text_bytes` each). Reports the store's bytes (the records'
    JSON as the store counts it, and the file with its WAL) and the per-write cost (get + put) of
    the first and the last 10 turns: with the shared history stored once, both stay flat."""
    with tempfile.TemporaryDirectory() as d:
        store = SqliteResponseStore(Path(d) / "store.sqlite3")
        tenant, prev, times, puts = "0123456789abcdef", None, [], []
        word = ("lorem ipsum dolor sit amet " * (text_bytes // 27 + 1))[:text_bytes]
        for i in range(turns):
            t0 = time.perf_counter()
            history = store.get_response(tenant, prev)["messages"] if prev else []
            rid = f"resp_{i:08d}"
            t1 = time.perf_counter()
            store.put_response(
                {
                    "id": rid,
                    "tenant": tenant,
                    "created_at": time.time(),
                    "previous_response_id": prev,
                    "route": "L2",
                    "messages": [
                        *history,
                        {"role": "user", "content": f"{i} {word}"},
                        {"role": "assistant", "content": f"{i} {word}"},
                    ],
                    "input_items": [
                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{i} {word}"}]}
                    ],
                    "response": {
                        "id": rid,
                        "object": "response",
                        "status": "completed",
                        "output": [{"type": "message", "content": [{"type": "output_text", "text": f"{i} {word}"}]}],
                    },
                }
            )
            t2 = time.perf_counter()
            times.append((t2 - t0) * 1e6)
            puts.append((t2 - t1) * 1e6)
            prev = rid
        assert len(store.get_response(tenant, prev)["messages"]) == 2 * turns
        stats = store.stats()
        store.close()
        file_bytes = sum(p.stat().st_size for p in Path(d).iterdir())
    return {
        "turns": turns,
        "store_bytes": stats["responses_bytes"],
        "file_bytes": file_bytes,
        "first10_us": statistics.mean(times[:10]),
        "last10_us": statistics.mean(times[-10:]),
        "put_first10_us": statistics.mean(puts[:10]),
        "put_last10_us": statistics.mean(puts[-10:]),
    }


def redis_chain_bench(turns: int = 50, text_bytes: int = 1024) -> dict:
    """`chain_bench` on the Redis store (RedisResponseStore, key format 3) against a redis-server of
    its own (tests/redis_server.py): the store's accounted bytes, the server's used_memory growth,
    what key format 2 held for the same chain (every record its whole conversation) and the
    per-write cost (get previous + put) of the first and the last 10 turns."""
    import asyncio

    from molctl.proxy.store.redis.connection import RedisState
    from molctl.proxy.store.redis.responses import RedisResponseStore
    from molctl.proxy.store.redis.target import parse_redis_url
    from tests.redis_server import redis_server

    word = ("lorem ipsum dolor sit amet " * (text_bytes // 27 + 1))[:text_bytes]
    with redis_server() as server:
        client = server.client()
        client.flushall()
        used0 = int(client.info("memory")["used_memory"])

        async def run() -> tuple[list[float], int]:
            st = RedisState(
                parse_redis_url(server.url),
                None,
                "bench",
                replica_id="bench",
                advertise_upstream="http://x",
                max_bytes=1 << 40,
                tenant_max_bytes=1 << 40,
            )
            store = RedisResponseStore(st)
            tenant, prev, times, whole = "0123456789abcdef", None, [], 0
            for i in range(turns):
                t0 = time.perf_counter()
                history = (await store.get_previous(tenant, prev))["messages"] if prev else []
                rid = f"resp_{i:08d}"
                record = {
                    "id": rid,
                    "tenant": tenant,
                    "created_at": time.time(),
                    "previous_response_id": prev,
                    "route": "L2",
                    "messages": [
                        *history,
                        {"role": "user", "content": f"{i} {word}"},
                        {"role": "assistant", "content": f"{i} {word}"},
                    ],
                    "input_items": [
                        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{i} {word}"}]}
                    ],
                    "response": {
                        "id": rid,
                        "object": "response",
                        "status": "completed",
                        "output": [{"type": "message", "content": [{"type": "output_text", "text": f"{i} {word}"}]}],
                    },
                }
                await store.put_response(record)
                times.append((time.perf_counter() - t0) * 1e6)
                whole += len(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode())
                prev = rid
            assert len((await store.get_response(tenant, prev))["messages"]) == 2 * turns
            await st.close()
            return times, whole

        times, whole = asyncio.run(run())
        stored = int(client.hget("molctl:{bench}:stats", "r_bytes"))
        used = int(client.info("memory")["used_memory"]) - used0
        client.close()
    return {
        "turns": turns,
        "store_bytes": stored,
        "used_memory": used,
        "format2_bytes": whole,
        "first10_us": statistics.mean(times[:10]),
        "last10_us": statistics.mean(times[-10:]),
    }


def proxy_bench(requests: int = 400) -> list[dict] | None:
    """End to end through the proxy, one client, chained requests; None when the proxy has no
    /v1/responses endpoint yet."""
    import httpx

    from molctl.proxy.http import app as app_module

    if "/v1/responses" not in Path(app_module.__file__).read_text():
        return None
    import contextlib

    from tests.helpers import free_port
    from tests.procs import fake_engine_argv, running

    engine_port = free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    specs = ("memory", "sqlite")
    with (
        tempfile.TemporaryDirectory() as state,
        running(fake_engine_argv(engine_port), engine + "/health"),
        contextlib.ExitStack() as stack,
        httpx.Client(timeout=30) as client,
    ):
        urls = {}
        for spec in specs:  # both proxies at once, their requests interleaved: the same noise for both
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "molctl",
                "--state-dir",
                state,
                "proxy",
                "tiny",
                "--upstream",
                engine,
                "--port",
                str(port),
                "--allow-unauthenticated",
                "--store",
                spec,
            ]
            stack.enter_context(running(argv, f"http://127.0.0.1:{port}/health"))
            urls[spec] = f"http://127.0.0.1:{port}/v1/responses"
        prev: dict[str, str | None] = dict.fromkeys(specs)
        times: dict[str, list[float]] = {spec: [] for spec in specs}
        for i in range(requests + 20):
            for spec in specs if i % 2 else specs[::-1]:
                body = {"model": "Macaron-Tiny-Demo", "input": f"turn {i}", "max_output_tokens": 16}
                if prev[spec] and i % 10:  # chains of 10 turns
                    body["previous_response_id"] = prev[spec]
                t0 = time.perf_counter()
                r = client.post(urls[spec], json=body)
                dt = (time.perf_counter() - t0) * 1000
                r.raise_for_status()
                prev[spec] = r.json()["id"]
                if i >= 20:  # warm-up excluded
                    times[spec].append(dt)
    return [
        {"store": spec, "p50_ms": statistics.median(times[spec]), "p99_ms": pct(times[spec], 0.99)} for spec in specs
    ]


def main() -> None:
    rows = [] if "--chain" in sys.argv else store_bench()  # --chain: the chain figures only
    if rows:
        print(f"response store, per request (get previous + put new), {PREFILL} records prefilled:")
        print(
            f"{'record':>8} {'memory p50':>11} {'p99':>8} {'sqlite p50':>11} {'p99':>8} {'get p50':>8} {'added p50':>10}  target"
        )
    for r in rows:
        ok = "ok" if r["added_p50_us"] <= TARGET_US else "OVER"
        print(
            f"{r['record']:>8} {r['memory_p50_us']:>9.1f}us {r['memory_p99_us']:>6.0f}us {r['sqlite_p50_us']:>9.1f}us "
            f"{r['sqlite_p99_us']:>6.0f}us {r['sqlite_get_p50_us']:>6.1f}us {r['added_p50_us']:>8.1f}us  <= {TARGET_US:.0f}us {ok}"
        )
    chains = [chain_bench(n) for n in (50, 200)]
    print("one chain of N turns (1 KiB user message + 1 KiB answer a turn), SQLite:")
    for c in chains:
        print(
            f"  {c['turns']:>4} turns: store bytes {c['store_bytes']:>10,}  file {c['file_bytes']:>10,}  "
            f"get+put first 10 {c['first10_us']:>6.0f} us, last 10 {c['last10_us']:>6.0f} us; "
            f"put alone {c['put_first10_us']:>5.0f} / {c['put_last10_us']:>5.0f} us"
        )
    if "--redis" in sys.argv:
        print("the same chain on Redis (key format 3; format 2 held every record's whole conversation):")
        for c in (redis_chain_bench(n) for n in (50, 200)):
            print(
                f"  {c['turns']:>4} turns: store bytes {c['store_bytes']:>10,}  used_memory +{c['used_memory']:>10,}  "
                f"format 2 {c['format2_bytes']:>12,}  get+put first 10 {c['first10_us']:>6.0f} us, "
                f"last 10 {c['last10_us']:>6.0f} us"
            )
    if "--chain" in sys.argv:
        return
    e2e = proxy_bench()
    if e2e is None:
        print("proxy end to end: skipped (no /v1/responses endpoint in this proxy)")
    else:
        print("proxy end to end, one client, chained /v1/responses (fake engine, no delay):")
        for r in e2e:
            print(f"  --store {r['store']:<7} p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms")
        print(f"  sqlite adds {e2e[1]['p50_ms'] - e2e[0]['p50_ms']:+.2f} ms p50 (target <= 0.3 ms)")
    if "--json" in sys.argv:
        print(json.dumps({"store": rows, "chains": chains, "proxy": e2e}))


if __name__ == "__main__":
    main()
