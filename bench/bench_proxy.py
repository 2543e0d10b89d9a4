"""Proxy overhead: molctl's proxy and the upstream harness's proxy (../shared/peers/mol-harness-*,
MIT, run as its README says: `python -m mol_harness.proxy` with its environment variables) in front
of the SAME fake engine (tests/fake_engine.py: answer hop 50 ms, route and summary hops instant),
compared in one run with calling the engine directly (route hop, then answer hop).

Each concurrency level runs in rounds; a round measures direct, molctl and upstream back to back,
the proxies' order alternating between rounds, so both see the same machine noise. Reported per
level: p50 of each (median over rounds), added p50 = proxy p50 - direct p50 of the same round, requests
per second, and the ratio molctl / upstream per round. Non-streaming chat; then the time to the
first streamed token. Run with `make bench` (which also prepares the upstream's interpreter).

    python bench/bench_proxy.py [--rounds 3] [--proxy-arg=--set --proxy-arg=proxy.max_inflight=512]
                                [--cprofile FILE] [--skip-upstream] [--baseline DIR] [--pin-client]

`--pin-client`: the client on the last CPU, the proxies on the others (see `pin_client`); the
default leaves placement to the kernel, which tends to wake the client on the answering proxy's core.

`--baseline DIR`: also molctl's proxy from another checkout (e.g. `git archive REV | tar -x -C DIR`),
measured in the same rounds ("before" against "after").

`floor` (left out with `--skip-floor`): bench/floor_proxy.py, a process that forwards two
pre-encoded hops and reads no JSON: what one more process on the way costs on this machine, the
floor under any proxy's added p50.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers import free_port  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402

ANSWER_DELAY = 0.05
KEY = "sk-bench"
MOLCTL_MODEL = "Macaron-Tiny-Demo"  # the tiny profile's public name
UPSTREAM_MODEL = "Macaron-V1-Tall"  # a profile directory of the upstream harness
UPSTREAM_IMPORTS = ("aiohttp", "prometheus_client", "uvicorn", "uvloop", "httptools")  # its requirements.txt
UPSTREAM_VENV = ROOT / "bench" / ".venv-upstream"
LEVELS = ((1, 150), (32, 640), (128, 1280))


def find_upstream() -> Path | None:
    """The upstream harness's release folder: MOL_HARNESS_DIR, or the newest ../shared/peers/mol-harness-*
    (None when there is none)."""
    if os.environ.get("MOL_HARNESS_DIR"):
        return Path(os.environ["MOL_HARNESS_DIR"])
    for peers in (ROOT.parent / "shared" / "peers", ROOT / ".." / ".." / "shared" / "peers"):
        found = sorted(peers.glob("mol-harness-*")) if peers.is_dir() else []
        if found:
            return found[-1].resolve()
    return None


def upstream_python(upstream: Path) -> str:
    """An interpreter with the upstream's requirements: this one when it has them, else
    bench/.venv-upstream, created and filled from the package index once (redone only when
    requirements.txt changes)."""
    probe = [sys.executable, "-c", "import " + ", ".join(UPSTREAM_IMPORTS)]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return sys.executable
    requirements = upstream / "requirements.txt"
    stamp = UPSTREAM_VENV / ".stamp"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    python = UPSTREAM_VENV / "bin" / "python"
    if not (stamp.is_file() and stamp.read_text() == digest):
        print(f"bench_proxy: installing the upstream's requirements into {UPSTREAM_VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(UPSTREAM_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(requirements)],
            check=True,
        )
        stamp.write_text(digest)
    return str(python)


def upstream_summary_marker(python: str, upstream: Path) -> str:
    """The upstream's summary-hop instruction (its last message), from its own code, so that the
    fake engine can tell its summary hops (they carry no hop header) from answer hops."""
    out = subprocess.run(
        [python, "-c", "from mol_harness.session import SUMMARY_SCAFFOLD; print(SUMMARY_SCAFFOLD, end='')"],
        cwd=upstream,
        env={**os.environ, "PYTHONPATH": str(upstream), "SERVED_MODEL_NAME": UPSTREAM_MODEL},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def cpu_seconds(pid: int | list[int]) -> float:
    """User + system CPU time of a process (or of several) so far (Linux /proc)."""
    if isinstance(pid, list):
        return sum(cpu_seconds(p) for p in pid)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proxy_env(tmp: str, name: str) -> dict[str, str]:
    """Each molctl proxy with a state folder of its own (its SQLite store), in the run's temporary folder."""
    state = Path(tmp) / f"state-{name}"
    state.mkdir(mode=0o700, exist_ok=True)
    return {"PYTHONWARNINGS": "ignore", "MOLCTL_STATE_DIR": str(state)}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


async def run_level(session, target, concurrency: int, total: int) -> tuple[list[float], float]:
    latencies: list[float] = []
    queue = list(range(total))

    async def worker():
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            await target(session, i)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, total / (time.perf_counter() - t0)


def via_proxy(url: str | list[str], model: str):
    urls = url if isinstance(url, list) else [url]

    async def call(session, i):
        url = urls[i % len(urls)]  # several processes: as SO_REUSEPORT would spread the connections
        body = {"model": model, "messages": [{"role": "user", "content": f"[route:L2] request {i}"}], "max_tokens": 16}
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status == 200, await r.text()
            await r.read()

    return call


def direct(url: str):
    async def call(session, i):
        route = {
            "model": "L0",
            "max_tokens": 8,
            "stream": False,
            "messages": [
                {"role": "system", "content": "route"},
                {"role": "user", "content": f"[route:L2] request {i}"},
            ],
        }
        async with session.post(url + "/v1/chat/completions", json=route, headers={"X-MoL-Hop": "route"}) as r:
            label = (await r.json())["choices"][0]["message"]["content"]
        answer = {"model": label, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
        async with session.post(url + "/v1/chat/completions", json=answer, headers={"X-MoL-Hop": "answer"}) as r:
            await r.read()

    return call


async def first_token(session, url, headers, body) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        async for line in r.content:
            if line.startswith(b"data: ") and b'"content": "answer' in line.replace(b'":"', b'": "'):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


async def ttft(session, engine, proxies: dict[str, tuple[str, str]], n=30) -> dict[str, float]:
    proxies = {name: p for name, p in proxies.items() if name != "floor"}  # the floor does not stream
    times: dict[str, list[float]] = {name: [] for name in (*proxies, "direct")}
    for i in range(n):
        for name, (url, model) in proxies.items():
            url = url[0] if isinstance(url, list) else url
            body = {"model": model, "stream": True, "messages": [{"role": "user", "content": f"[route:L2] t {i}"}]}
            times[name].append(await first_token(session, url, {"Authorization": f"Bearer {KEY}"}, body))
        t0 = time.perf_counter()
        route = {"model": "L0", "messages": [{"role": "user", "content": f"[route:L2] t {i}"}], "stream": False}
        async with session.post(engine + "/v1/chat/completions", json=route, headers={"X-MoL-Hop": "route"}) as r:
            await r.read()
        d = time.perf_counter() - t0
        body = {"model": "L2", "stream": True, "messages": [{"role": "user", "content": f"t {i}"}]}
        times["direct"].append(d + await first_token(session, engine, {"X-MoL-Hop": "answer"}, body))
    return {name: statistics.median(v) for name, v in times.items()}


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves its main thread only) to `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def pin_client(pids: dict) -> str:
    """`--pin-client`: the benchmark's client on the last CPU, every proxy on the others, the engine
    anywhere (as a load generator is kept off the cores of the system it measures). Without it the
    kernel tends to wake the client on the core of the proxy that just answered it (a loopback send
    is a synchronous wake-up), where it preempts the proxy's work after the response."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("bench_proxy: --pin-client needs at least 2 CPUs")
    client, rest = {cpus[-1]}, set(cpus[:-1])
    for name, pid in pids.items():
        if name not in ("client", "engine"):
            for one in pid if isinstance(pid, list) else [pid]:
                pin(one, rest)
    pin(os.getpid(), client)
    return f"client pinned to CPU {cpus[-1]}, proxies to CPU(s) {','.join(map(str, sorted(rest)))}, engine unpinned"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


async def main_async(
    engine_url: str, proxies: dict[str, tuple[str, str]], rounds: int, pids: dict[str, int], pinned: bool = False
) -> None:
    if pinned:
        print(pin_client(pids))
    connector = aiohttp.TCPConnector(limit=1024)
    targets = {"direct": direct(engine_url), **{name: via_proxy(url, model) for name, (url, model) in proxies.items()}}
    async with aiohttp.ClientSession(connector=connector) as session:
        for k in range(30):  # warm up every path (and every process)
            for target in targets.values():
                await target(session, -1 - k)
        names = list(proxies)
        print(
            f"fake engine: answer hop {ANSWER_DELAY * 1000:.0f} ms, route and summary hops instant; non-streaming chat; "
            f"{rounds} rounds per level, the proxies' order alternating"
        )
        summary_rows = []
        for conc, total in LEVELS:
            per_round: list[dict[str, tuple[float, float]]] = []
            for r in range(rounds):
                order = ["direct", *(names if r % 2 == 0 else names[::-1])]
                result = {}
                for name in order:
                    before = {n: cpu_seconds(pid) for n, pid in pids.items()}
                    lat, rps = await run_level(session, targets[name], conc, total)
                    cpu = {n: (cpu_seconds(pid) - before[n]) / total for n, pid in pids.items()}
                    result[name] = (
                        pct(lat, 0.5),
                        rps,
                        cpu.get(name, 0.0),
                        cpu["engine"],
                        cpu["client"],
                        sum(cpu.values()) * rps,
                    )
                per_round.append(result)
                line = ", ".join(
                    f"{n} p50 {ms(result[n][0])} {result[n][1]:.0f} req/s"
                    + (f" cpu/req {result[n][2] * 1000:.2f} ms" if n != "direct" else "")
                    + f" engine cpu/req {result[n][3] * 1000:.2f} ms client cpu/req {result[n][4] * 1000:.2f} ms"
                    f" (cores busy {result[n][5]:.2f})"
                    for n in order
                )
                print(f"  {conc} clients, round {r + 1}: {line}", flush=True)
            row = {"conc": conc}
            for name in targets:
                row[name + "_p50"] = statistics.median(res[name][0] for res in per_round)
                row[name + "_rps"] = statistics.median(res[name][1] for res in per_round)
                row[name + "_engine_cpu"] = statistics.median(res[name][3] for res in per_round)
                row[name + "_cores"] = statistics.median(res[name][5] for res in per_round)
                if name != "direct":
                    row[name + "_added"] = statistics.median(res[name][0] - res["direct"][0] for res in per_round)
                    row[name + "_cpu"] = statistics.median(res[name][2] for res in per_round)
            row["ratios"] = {
                other: [res["molctl"][1] / res[other][1] for res in per_round] for other in names if other != "molctl"
            }
            summary_rows.append(row)
        head = (
            "| clients | direct p50 | "
            + " | ".join(f"{n} p50 | {n} added p50" for n in names)
            + " | direct req/s | "
            + " | ".join(f"{n} req/s" for n in names)
            + "".join(f" | molctl / {n} req/s (per round)" for n in names if n != "molctl")
            + " |"
        )
        print()
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for row in summary_rows:
            cells = [str(row["conc"]), ms(row["direct_p50"])]
            for n in names:
                cells += [ms(row[n + "_p50"]), f"{row[n + '_added'] * 1000:+.2f} ms"]
            cells.append(f"{row['direct_rps']:.0f}")
            cells += [f"{row[n + '_rps']:.0f}" for n in names]
            for ratios in row["ratios"].values():
                cells.append(f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")
            print("| " + " | ".join(cells) + " |")
        print(
            "\nCPU time per request (median over rounds): "
            + "; ".join(
                f"{row['conc']} clients: "
                + ", ".join(
                    f"{n} {row[n + '_cpu'] * 1000:.2f} ms (engine {row[n + '_engine_cpu'] * 1000:.2f} ms)"
                    for n in names
                )
                + f", direct: engine {row['direct_engine_cpu'] * 1000:.2f} ms"
                for row in summary_rows
            )
        )
        print(
            "cores kept busy by client + engine + proxy (of the machine's 2; median over rounds): "
            + "; ".join(
                f"{row['conc']} clients: " + ", ".join(f"{n} {row[n + '_cores']:.2f}" for n in targets)
                for row in summary_rows
            )
        )
        first = await ttft(session, engine_url, proxies)
        print(
            "\ntime to first streamed token (median of 30): "
            + ", ".join(
                f"{n} {ms(first[n])} ({(first[n] - first['direct']) * 1000:+.1f} ms)" for n in names if n in first
            )
            + f", route hop + direct stream {ms(first['direct'])}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--proxy-arg", action="append", default=[], help="an extra argument of `molctl proxy`")
    parser.add_argument("--cprofile", help="run molctl's proxy under cProfile, its stats written here")
    parser.add_argument("--skip-upstream", action="store_true", help="measure molctl's proxy only")
    parser.add_argument(
        "--molctl-procs",
        type=int,
        default=1,
        help="molctl's proxy as this many processes sharing one state folder (one SQLite file), the client "
        "spreading its requests over them: what `--workers N` with SO_REUSEPORT would give",
    )
    parser.add_argument("--baseline", help="a folder holding another molctl checkout, measured as `before`")
    parser.add_argument(
        "--pin-client",
        action="store_true",
        help="keep the client off the proxies' cores (client on the last CPU, proxies on the others); "
        "reported beside the default method, which leaves placement to the kernel",
    )
    parser.add_argument(
        "--skip-floor",
        action="store_true",
        help="leave out `floor` (bench/floor_proxy.py: the least any proxy process adds on this machine)",
    )
    args = parser.parse_args()

    upstream = None if args.skip_upstream else find_upstream()
    if upstream is None and not args.skip_upstream:
        print(
            "bench_proxy: the upstream harness was not found (../shared/peers/mol-harness-*; MOL_HARNESS_DIR names "
            "another folder): measuring molctl's proxy only"
        )
    python = upstream_python(upstream) if upstream else None
    marker = upstream_summary_marker(python, upstream) if upstream else None
    engine_port, molctl_port, upstream_port, metrics_port, before_port = (free_port() for _ in range(5))
    engine_url = f"http://127.0.0.1:{engine_port}"
    molctl_url = f"http://127.0.0.1:{molctl_port}"
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = Path(tmp) / "key"
        keyfile.write_text(KEY)
        keyfile.chmod(0o600)
        argv = proxy_argv("tiny", engine_url, molctl_port, "--api-key-file", str(keyfile), *args.proxy_arg)
        if args.cprofile:
            argv[1:1] = ["-m", "cProfile", "-o", str(Path(args.cprofile).resolve())]
        # both proxies log to a file, as in production
        engine_config = {"answer_delay": ANSWER_DELAY, "summary_marker": marker}
        with (
            running(fake_engine_argv(engine_port, engine_config), engine_url + "/health") as engine,
            running(argv, molctl_url + "/health", env=proxy_env(tmp, "molctl"), log=Path(tmp) / "molctl.log") as molctl,
        ):
            proxies = {"molctl": (molctl_url, MOLCTL_MODEL)}
            pids = {"engine": engine.pid, "molctl": molctl.pid, "client": os.getpid()}
            with contextlib.ExitStack() as stack:
                if args.molctl_procs > 1:
                    urls, procs = [molctl_url], [molctl.pid]
                    for _ in range(args.molctl_procs - 1):
                        port = free_port()
                        more = proxy_argv("tiny", engine_url, port, "--api-key-file", str(keyfile), *args.proxy_arg)
                        proc = stack.enter_context(
                            running(
                                more,
                                f"http://127.0.0.1:{port}/health",
                                env=proxy_env(tmp, "molctl"),
                                log=Path(tmp) / f"molctl-{port}.log",
                            )
                        )
                        urls.append(f"http://127.0.0.1:{port}")
                        procs.append(proc.pid)
                    proxies["molctl"], pids["molctl"] = (urls, MOLCTL_MODEL), procs
                if args.baseline:
                    before_url = f"http://127.0.0.1:{before_port}"
                    before = Path(args.baseline).resolve()
                    boot = (
                        f"import sys, runpy; sys.path.insert(0, {str(before)!r}); sys.argv[0] = 'molctl'; "
                        "runpy.run_module('molctl', run_name='__main__')"
                    )
                    before_argv = [
                        sys.executable,
                        "-c",
                        boot,
                        *proxy_argv("tiny", engine_url, before_port, "--api-key-file", str(keyfile), *args.proxy_arg)[
                            3:
                        ],
                    ]
                    proc = stack.enter_context(
                        running(
                            before_argv,
                            before_url + "/health",
                            env=proxy_env(tmp, "before"),
                            log=Path(tmp) / "before.log",
                        )
                    )
                    proxies["before"], pids["before"] = (before_url, MOLCTL_MODEL), proc.pid
                if not args.skip_floor:
                    floor_port = free_port()
                    floor_url = f"http://127.0.0.1:{floor_port}"
                    proc = stack.enter_context(
                        running(
                            [
                                sys.executable,
                                str(ROOT / "bench" / "floor_proxy.py"),
                                "--port",
                                str(floor_port),
                                "--upstream",
                                engine_url,
                            ],
                            floor_url + "/health",
                            log=Path(tmp) / "floor.log",
                        )
                    )
                    proxies["floor"], pids["floor"] = (floor_url, MOLCTL_MODEL), proc.pid
                if upstream is None:
                    asyncio.run(main_async(engine_url, proxies, args.rounds, pids, args.pin_client))
                else:
                    run_with_upstream(
                        args, python, upstream, engine_url, upstream_port, metrics_port, tmp, proxies, pids
                    )


def run_with_upstream(
    args,
    python,
    upstream: Path,
    engine_url: str,
    upstream_port: int,
    metrics_port: int,
    tmp: str,
    proxies: dict,
    pids: dict,
) -> None:
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    env = {
        "PYTHONPATH": str(upstream),
        "PYTHONDONTWRITEBYTECODE": "1",
        "UPSTREAM": engine_url,
        "PROXY_PORT": str(upstream_port),
        "SERVED_MODEL_NAME": UPSTREAM_MODEL,
        "MOL_API_KEY": KEY,
        "MOL_METRICS_PORT": str(metrics_port),
        "ENTRY_ROUTE": "L0",
        "MOL_USE_MODEL_ROUTER": "1",
        "MOL_PURE_MODEL_ROUTE": "1",
    }
    with running(
        [python, "-m", "mol_harness.proxy"], upstream_url + "/health", env=env, log=Path(tmp) / "upstream.log"
    ) as upstream_proc:
        proxies["upstream"] = (upstream_url, UPSTREAM_MODEL)
        pids["upstream"] = upstream_proc.pid
        print(f"upstream: {upstream.name} ({python}); molctl proxy args: {' '.join(args.proxy_arg) or '(none)'}")
        asyncio.run(main_async(engine_url, proxies, args.rounds, pids, args.pin_client))
        log = asyncio.run(engine_log(engine_url))
        print(f"engine hops seen in the run: {json.dumps(log)}")


async def engine_log(engine_url: str) -> dict[str, int]:
    """Hops by kind, as a check that both proxies ran route, answer and summary hops."""
    async with aiohttp.ClientSession() as session, session.get(engine_url + "/_log") as r:
        entries = await r.json()
    counts: dict[str, int] = {}
    for e in entries:
        counts[str(e.get("hop"))] = counts.get(str(e.get("hop")), 0) + 1
    return counts


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
