"""Proxy CPU per request as the conversation grows: molctl's proxy in front of the fake engine
(tests/fake_engine.py, every hop instant), one client sending the same conversation of N earlier
turns (each user message ~1.2 KB, each answer ~1.4 KB: N=100 is a 260 KiB body) plus a new
question, back to back. The turns are the client's own (not made by this proxy), so each is
looked up in the store and missed, as after a restart or for a client that rewrites its history.

    python bench/bench_long_conversation.py [--turns 0 20 100] [--requests 100] [--baseline DIR]

Reports, per size: the proxy process's CPU time per request (user + system, psutil) and the
client's wall time per request. `--baseline DIR`: also molctl's proxy from another checkout
(`git archive REV | tar -x -C DIR`), measured in the same run, sizes alternating."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers import free_port  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402

KEY = "sk-bench"
MODEL = "Macaron-Tiny-Demo"  # the tiny profile's public name


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are helpful. " * 20}]
    for i in range(turns):
        messages.append(
            {"role": "user", "content": f"question {i}: " + "please look at this code and explain it " * 30}
        )
        messages.append({"role": "assistant", "content": f"answer {i}: " + "the code does the following thing " * 40})
    return messages


def measure(checkout: Path, turns: int, requests: int) -> tuple[float, float, int]:
    """(proxy CPU ms per request, wall ms per request, body bytes) for one proxy from `checkout`."""
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = Path(tmp) / "key"
        keyfile.write_text(KEY)
        keyfile.chmod(0o600)
        state = Path(tmp) / "state"
        state.mkdir(mode=0o700)
        engine_port, proxy_port = free_port(), free_port()
        args = proxy_argv(
            "tiny",
            f"http://127.0.0.1:{engine_port}",
            proxy_port,
            "--api-key-file",
            str(keyfile),
            "--set",
            "proxy.max_inflight=512",
        )[3:]
        # the checkout's molctl first on the path (as bench_proxy.py's --baseline)
        boot = (
            f"import sys, runpy; sys.path.insert(0, {str(checkout)!r}); sys.argv[0] = 'molctl'; "
            "runpy.run_module('molctl', run_name='__main__')"
        )
        argv = [sys.executable, "-c", boot, *args]
        env = {"PYTHONWARNINGS": "ignore", "MOLCTL_STATE_DIR": str(state)}
        with (
            running(fake_engine_argv(engine_port, {"answer_delay": 0.0}), f"http://127.0.0.1:{engine_port}/health"),
            running(argv, f"http://127.0.0.1:{proxy_port}/health", env=env, log=Path(tmp) / "proxy.log") as proxy,
        ):
            proc = psutil.Process(proxy.pid)
            history = conversation(turns)
            url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"

            def body(k: int) -> dict:
                return {"model": MODEL, "messages": [*history, {"role": "user", "content": f"new question {k}"}]}

            with httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as client:
                for k in range(10):  # warm up
                    client.post(url, json=body(k)).raise_for_status()
                time.sleep(0.5)  # background summaries done
                cpu0, wall0 = sum(proc.cpu_times()[:2]), time.perf_counter()
                for k in range(requests):
                    client.post(url, json=body(1000 + k)).raise_for_status()
                wall = time.perf_counter() - wall0
                time.sleep(0.5)
                cpu = sum(proc.cpu_times()[:2]) - cpu0
            return cpu / requests * 1000, wall / requests * 1000, len(json.dumps(body(0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[0, 20, 100])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--baseline", help="a folder holding another molctl checkout, measured as `before`")
    args = parser.parse_args()
    checkouts = {"molctl": ROOT, **({"before": Path(args.baseline).resolve()} if args.baseline else {})}
    print(f"fake engine (hops instant), 1 client back to back, {args.requests} requests per size and proxy")
    print("| earlier turns | body | " + " | ".join(f"{name} CPU / wall per request" for name in checkouts) + " |")
    print("|---|---|" + "---|" * len(checkouts))
    for turns in args.turns:
        cells, size = [], 0
        for checkout in checkouts.values():
            cpu, wall, size = measure(checkout, turns, args.requests)
            cells.append(f"{cpu:.2f} / {wall:.2f} ms")
        print(f"| {turns} | {size / 1024:.0f} KiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
