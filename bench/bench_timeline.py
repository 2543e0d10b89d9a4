"""Where the proxy's added latency goes, leg by leg, at 1 client: direct calls to the fake engine
(route hop, then answer hop), the floor proxy (bench/floor_proxy.py) and molctl's proxy, each in
rounds. The fake engine logs when each hop arrived; with the client's send and receive times:
  client send -> the engine has the route hop; route hop -> answer hop at the engine;
  answer hop -> the client has the answer (minus the engine's 50 ms answer delay).

    python bench/bench_timeline.py [--requests 200] [--gap-ms 2] [--baseline DIR]

`--gap-ms`: pause between a client's requests (0: back to back, as bench_proxy.py; with a pause
the previous request's background work, e.g. its summary hop, is done before the next arrives).
`--baseline DIR`: molctl's proxy from another checkout instead of this one. Not in `make bench`:
an analysis tool (BENCHMARKS.md, "Third pass")."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_proxy as bp  # noqa: E402

from tests.helpers import free_port  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402


async def measure(
    targets: dict, engine: str, requests: int, gap_s: float, rounds: int
) -> dict[str, list[tuple[float, ...]]]:
    legs: dict[str, list[tuple[float, ...]]] = {name: [] for name in targets}
    async with aiohttp.ClientSession() as session:
        for target in targets.values():
            for i in range(20):  # warm up
                await target(session, -1 - i)
        for _ in range(rounds):
            for name, target in targets.items():
                await session.post(engine + "/_reset")
                sent = []
                for i in range(requests):
                    t0 = time.time()
                    await target(session, i)
                    sent.append((t0, time.time()))
                    await asyncio.sleep(gap_s)
                async with session.get(engine + "/_log") as r:
                    log = await r.json()
                routes = [e["t"] for e in log if e.get("hop") == "route"]
                answers = [e["t"] for e in log if e.get("hop") == "answer"]
                for (t0, t1), route, answer in zip(sent, routes, answers, strict=False):
                    legs[name].append(
                        (
                            (route - t0) * 1e3,
                            (answer - route) * 1e3,
                            (t1 - answer) * 1e3 - bp.ANSWER_DELAY * 1e3,
                            (t1 - t0) * 1e3,
                        )
                    )
    return legs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--baseline", help="a folder holding another molctl checkout, measured instead of this one")
    args = parser.parse_args()
    engine_port, proxy_port, floor_port = free_port(), free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = Path(tmp) / "key"
        keyfile.write_text(bp.KEY)
        keyfile.chmod(0o600)
        argv = proxy_argv("tiny", engine, proxy_port, "--api-key-file", str(keyfile), "--set", "proxy.max_inflight=512")
        if args.baseline:
            boot = (
                f"import sys, runpy; sys.path.insert(0, {str(Path(args.baseline).resolve())!r}); sys.argv[0] = 'molctl'; "
                "runpy.run_module('molctl', run_name='__main__')"
            )
            argv = [sys.executable, "-c", boot, *argv[3:]]
        with (
            running(fake_engine_argv(engine_port, {"answer_delay": bp.ANSWER_DELAY}), engine + "/health"),
            running(
                argv,
                f"http://127.0.0.1:{proxy_port}/health",
                env=bp.proxy_env(tmp, "molctl"),
                log=Path(tmp) / "molctl.log",
            ),
            running(
                [
                    sys.executable,
                    str(ROOT / "bench" / "floor_proxy.py"),
                    "--port",
                    str(floor_port),
                    "--upstream",
                    engine,
                ],
                f"http://127.0.0.1:{floor_port}/health",
            ),
        ):
            targets = {
                "direct": bp.direct(engine),
                "floor": bp.via_proxy(f"http://127.0.0.1:{floor_port}", bp.MOLCTL_MODEL),
                "molctl": bp.via_proxy(f"http://127.0.0.1:{proxy_port}", bp.MOLCTL_MODEL),
            }
            legs = asyncio.run(measure(targets, engine, args.requests, args.gap_ms / 1000, args.rounds))
    print(
        f"1 client, {args.requests} requests x {args.rounds} rounds per path, {args.gap_ms:g} ms between requests; medians:"
    )
    direct_total = statistics.median(r[3] for r in legs["direct"])
    for name, rows in legs.items():
        med = [statistics.median(r[j] for r in rows) for j in range(4)]
        print(
            f"  {name:7s} send -> route hop {med[0]:.2f} ms, route -> answer hop {med[1]:.2f} ms, "
            f"answer -> client {med[2]:.2f} ms; total {med[3]:.2f} ms ({med[3] - direct_total:+.2f} ms over direct)"
        )


if __name__ == "__main__":
    main()
