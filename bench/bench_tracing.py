"""What OpenTelemetry tracing (issue 29, molctl/proxy/tracing.py) costs per request: off (the
default: no endpoint, the SDK never imported) and on (the real SDK, a batch processor exporting
OTLP/HTTP to a receiver in this process: tests/otlp_receiver.py).

1. In-process, the off path's only work on the hot path: `EngineClient.chat`'s `tracing is None`
   check and its one extra call, against calling the hop's body directly (ns per hop).
2. End to end: one client, non-streaming chat turns (route, answer and background summary hops)
   through proxies side by side in front of the same fake engine (tests/fake_engine.py, no delay),
   their requests interleaved (the order rotating) so all see the same machine noise: tracing off,
   tracing on, and with `--baseline-rev REV` molctl's proxy as it was at REV (`git archive`),
   "before" against "off". Reported: p50 and p90 per proxy, and p50 minus the off proxy's.

    python bench/bench_tracing.py [--requests 600] [--baseline-rev REV]

Run with `make bench`; figures in BENCHMARKS.md ("Tracing")."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from molctl.profiles import load_profile, profile_dirs  # noqa: E402
from molctl.proxy.engine_client import EngineClient  # noqa: E402
from molctl.proxy.tracing import CAPTURE_VARIABLE, ENDPOINT_VARIABLES  # noqa: E402
from tests.helpers import free_ports  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402
from tests.procs import fake_engine_argv, stop, wait_http  # noqa: E402

OFF = {v: "" for v in (*ENDPOINT_VARIABLES, CAPTURE_VARIABLE)}
BODY = {
    "model": load_profile("tiny", profile_dirs()).served_model_name,
    "messages": [{"role": "user", "content": "[route:L2] hello"}],
}


def micro(rounds: int = 200_000) -> tuple[float, float]:
    """ns per call: the hop's body called directly, and through `chat` with tracing off."""

    async def body(*args):
        return {}

    client = EngineClient("http://127.0.0.1:9")
    client._chat = body  # the hop itself is not measured: only what `chat` adds in front of it

    async def run() -> tuple[float, float]:
        payload = {"model": "m"}
        best_direct = best_chat = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(rounds):
                await body(payload, "answer", None, False, None, "/v1/chat/completions", None, None)
            t1 = time.perf_counter_ns()
            for _ in range(rounds):
                await client.chat(payload, "answer")
            t2 = time.perf_counter_ns()
            best_direct = min(best_direct, (t1 - t0) / rounds)
            best_chat = min(best_chat, (t2 - t1) / rounds)
        return best_direct, best_chat

    return asyncio.run(run())


@contextlib.contextmanager
def proxy(name: str, engine: str, port: int, env: dict[str, str], cwd: Path, logs: Path):
    """`molctl proxy tiny` from `cwd` (this checkout or a baseline), stopped (SIGTERM: drained,
    spans flushed) at the end."""
    argv = [sys.executable, "-m", "molctl", "proxy", "tiny", "--upstream", engine, "--port", str(port)]
    log = open(logs / f"{name}.log", "wb")
    state = logs / f"{name}-state"  # its own state dir and response store
    proc = subprocess.Popen(
        [*argv, "--allow-unauthenticated"],
        cwd=cwd,
        env={**os.environ, **env, "PYTHONPATH": str(cwd), "MOLCTL_STATE_DIR": str(state)},
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()


def baseline(rev: str, into: Path) -> Path:
    """molctl at `rev`, unpacked from `git archive` (its profiles and tests included)."""
    raw = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        tar.extractall(into, filter="data")
    return into


def end_to_end(requests: int, rev: str | None) -> tuple[dict[str, list[float]], int]:
    import httpx

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        engine_port, otlp_port, *ports = free_ports(5)
        engine = f"http://127.0.0.1:{engine_port}"
        receiver = stack.enter_context(OtlpReceiver(otlp_port))
        engine_proc = subprocess.Popen(
            fake_engine_argv(engine_port),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # stop() ends its process group
        )
        stack.callback(stop, engine_proc)
        wait_http(engine + "/health", proc=engine_proc)
        on = {**OFF, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        setups = {"off": (OFF, ROOT), "on": (on, ROOT)}
        if rev:
            setups["before"] = (OFF, baseline(rev, tmp / "before"))
        urls = {
            name: stack.enter_context(proxy(name, engine, port, env, cwd, tmp))
            for (name, (env, cwd)), port in zip(setups.items(), ports, strict=False)
        }
        clients = {name: stack.enter_context(httpx.Client(base_url=url, timeout=30)) for name, url in urls.items()}
        times: dict[str, list[float]] = {name: [] for name in urls}
        names = list(urls)
        for i in range(requests + 50):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                t0 = time.perf_counter()
                clients[name].post("/v1/chat/completions", json=BODY).raise_for_status()
                if i >= 50:  # the first 50 rounds warm every proxy up
                    times[name].append((time.perf_counter() - t0) * 1000)
        for client in clients.values():
            client.close()
        stack.close()  # the proxies stop: the "on" one flushes its spans
        return times, len(receiver.spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--baseline-rev", help="also molctl's proxy at this git revision")
    args = parser.parse_args()
    direct, chat = micro()
    print(
        f"micro: hop body direct {direct:.0f} ns, through chat() with tracing off {chat:.0f} ns: +{chat - direct:.0f} ns"
    )
    times, spans = end_to_end(args.requests, args.baseline_rev)
    off = statistics.median(times["off"])
    print(f"end to end, 1 client, {args.requests} non-streaming turns per proxy (3 hops each):")
    print("| proxy | p50 ms | p90 ms | p50 - off |")
    print("|---|---|---|---|")
    for name, values in times.items():
        p50 = statistics.median(values)
        p90 = sorted(values)[int(0.9 * len(values))]
        print(f"| {name} | {p50:.2f} | {p90:.2f} | {p50 - off:+.2f} |")
    print(f"spans received from the traced proxy: {spans}")


if __name__ == "__main__":
    main()
