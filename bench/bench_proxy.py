"""Proxy overhead against the fake engine with a fixed per-hop latency (answer 50 ms, route 0 ms),
compared in the same run with calling the engine directly (route hop, then answer hop).

added latency = proxy total - direct total (both include the engine's own hop time), reported as
p50/p99 per concurrency level, plus requests per second; and time to first streamed token via
the proxy versus route hop + direct stream. Run with `make bench`."""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import free_port  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402

ANSWER_DELAY = 0.05
PUBLIC = "Macaron-Tiny-Demo"
KEY = "sk-bench"


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


async def run_level(session, url, make_request, concurrency: int, total: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    queue = list(range(total))

    async def worker():
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            await make_request(session, url, i)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, total / (time.perf_counter() - t0)


async def via_proxy(session, url, i):
    body = {"model": PUBLIC, "messages": [{"role": "user", "content": f"[route:L2] request {i}"}], "max_tokens": 16}
    async with session.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def direct(session, url, i):
    route = {"model": "L0", "messages": [{"role": "system", "content": "route"}, {"role": "user", "content": f"[route:L2] request {i}"}],
             "max_tokens": 8, "stream": False}
    async with session.post(url + "/v1/chat/completions", json=route, headers={"X-MoL-Hop": "route"}) as r:
        label = (await r.json())["choices"][0]["message"]["content"]
    answer = {"model": label, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
    async with session.post(url + "/v1/chat/completions", json=answer, headers={"X-MoL-Hop": "answer"}) as r:
        await r.read()


async def first_token(session, url, headers, body) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.content:
            if line.startswith(b"data: ") and b'"content": "answer' in line.replace(b'":"', b'": "'):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


async def ttft(session, engine, proxy, n=30) -> tuple[float, float]:
    via, dir_ = [], []
    for i in range(n):
        body = {"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": f"[route:L2] t {i}"}]}
        via.append(await first_token(session, proxy, {"Authorization": f"Bearer {KEY}"}, body))
        t0 = time.perf_counter()
        route = {"model": "L0", "messages": [{"role": "user", "content": f"[route:L2] t {i}"}], "stream": False}
        async with session.post(engine + "/v1/chat/completions", json=route, headers={"X-MoL-Hop": "route"}) as r:
            await r.read()
        d = time.perf_counter() - t0
        body = {"model": "L2", "stream": True, "messages": [{"role": "user", "content": f"t {i}"}]}
        dir_.append(d + await first_token(session, engine, {"X-MoL-Hop": "answer"}, body))
    return statistics.median(via), statistics.median(dir_)


async def main_async(engine_url, proxy_url):
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):  # warm up both paths
            await via_proxy(session, proxy_url, -1)
            await direct(session, engine_url, -1)
        print(f"fake engine: answer hop {ANSWER_DELAY * 1000:.0f} ms, route and summary hops instant; non-streaming chat")
        print("| concurrency | direct p50 | proxy p50 | added p50 | added p99 | direct req/s | proxy req/s |")
        print("|---|---|---|---|---|---|---|")
        for conc, total in ((1, 200), (32, 640), (128, 1280)):
            d_lat, d_rps = await run_level(session, engine_url, direct, conc, total)
            p_lat, p_rps = await run_level(session, proxy_url, via_proxy, conc, total)
            d50, p50 = pct(d_lat, 0.5), pct(p_lat, 0.5)
            d99, p99 = pct(d_lat, 0.99), pct(p_lat, 0.99)
            print(f"| {conc} | {d50 * 1000:.1f} ms | {p50 * 1000:.1f} ms | {(p50 - d50) * 1000:+.1f} ms | "
                  f"{(p99 - d99) * 1000:+.1f} ms | {d_rps:.0f} | {p_rps:.0f} |")
        via, dir_ = await ttft(session, engine_url, proxy_url)
        print(f"\ntime to first streamed token (median of 30): proxy {via * 1000:.1f} ms, "
              f"route hop + direct stream {dir_ * 1000:.1f} ms, difference {(via - dir_) * 1000:+.1f} ms")


def main() -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = Path(tmp) / "key"
        keyfile.write_text(KEY)
        keyfile.chmod(0o600)
        with running(fake_engine_argv(engine_port, {"answer_delay": ANSWER_DELAY}), engine_url + "/health"), \
                running(proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keyfile)), proxy_url + "/health",
                        env={"PYTHONWARNINGS": "ignore"}):
            asyncio.run(main_async(engine_url, proxy_url))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
