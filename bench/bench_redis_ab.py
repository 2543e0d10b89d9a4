"""Before/after for the Redis store, end to end: chained /v1/responses at 1 client (chains of 10)
through three proxies side by side on one fake engine and one Redis, their requests interleaved
in rotating order (the same noise for all): `--store sqlite` and Redis from this tree, and Redis
from another tree (the code before a change, e.g. `git archive BASE | tar -x -C /tmp/before`).

    python bench/bench_redis_ab.py /tmp/before [REQUESTS]

Prints each proxy's p50 and what it adds over SQLite (BENCHMARKS.md, "Shared Redis store")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import aiohttp  # noqa: E402
import httpx  # noqa: E402
from bench_redis import chained_response  # noqa: E402 - this folder is on sys.path when run as a script

from tests.helpers import free_port  # noqa: E402
from tests.procs import fake_engine_argv, stop  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

PUBLIC = "Macaron-Tiny-Demo"


def start(argv: list[str], cwd: str, ready_url: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    for _ in range(300):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return proc
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"not ready: {' '.join(argv)}")


async def drive(urls: dict[str, str], requests: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in urls}
    prev: dict[str, str] = {}
    kinds = list(urls)
    async with aiohttp.ClientSession() as session:
        for i in range(requests + 20):
            for kind in kinds[i % 3 :] + kinds[: i % 3]:
                prev[kind], ms = await chained_response(session, urls[kind], i, prev.get(kind))
                times[kind].append(ms)
    return {k: v[20:] for k, v in times.items()}  # warm-up


def main() -> None:
    before, requests = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400
    procs: list[subprocess.Popen] = []
    server = RedisServer().start()
    try:
        with tempfile.TemporaryDirectory() as state:
            engine_port = free_port()
            engine = f"http://127.0.0.1:{engine_port}"
            procs.append(start(fake_engine_argv(engine_port), str(ROOT), engine + "/health"))
            urls = {}
            for kind, cwd, spec in (
                ("sqlite", str(ROOT), "sqlite"),
                ("redis-before", before, server.url),
                ("redis-after", str(ROOT), server.url),
            ):
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
                    "--set",
                    f"proxy.store={spec}",
                ]
                procs.append(
                    start(
                        argv + (["--replica-id", kind] if spec != "sqlite" else []),
                        cwd,
                        f"http://127.0.0.1:{port}/readyz",
                    )
                )
                urls[kind] = f"http://127.0.0.1:{port}"
            times = asyncio.run(drive(urls, requests))
        base = statistics.median(times["sqlite"])
        print(
            f"chained /v1/responses, 1 client, {requests} requests per proxy, interleaved; load {os.getloadavg()[0]:.2f}"
        )
        for kind, values in times.items():
            print(
                f"  {kind:13} p50 {statistics.median(values):.2f} ms, added over sqlite {statistics.median(values) - base:+.2f} ms"
            )
    finally:
        for proc in procs:
            stop(proc)
        server.stop()


if __name__ == "__main__":
    main()
