"""What llm-d's scheduler buys over per-pod stacks (issue 43), simulated: no cluster runs here.

A discrete-event simulation, here and in tests/llmd_picker.py (never in the product), of N engine
replicas and
three ways to place a conversation's hops on them:
- `stack-rr`: per-pod stacks (`render k8s`, default scheduler) behind a round-robin Service, each
  turn's hops on the engine of the pod the turn reached, no affinity redirect (a sqlite store, or
  a Redis store without `--advertise-upstream`);
- `stack-affinity`: the same with the shared store's redirect: every hop on the engine of the
  replica that served the conversation's first turn (molctl's own affinity, `--advertise-upstream`);
- `llm-d`: one pool behind a stand-in for llm-d-router v0.10.0's Endpoint Picker
  (tests/llmd_picker.py `Picker`: queue, KV-cache, prefix-cache and session-affinity scorers with
  the weights the render writes, the max-score picker; its docstring cites where the EPP does
  each), every hop (answer and summary) placed on its own.

Each replica is a vLLM-like engine (tests/llmd_picker.py `Replica`): a prefix cache of 16-token
blocks (hash chained, seeded with the adapter, as vLLM's includes the LoRA), LRU with `--cache-blocks` blocks; prefills one at a time
(its queue is the waiting queue), `--prefill-us` per uncached prompt token plus 20 ms; decodes in
the batch (not serialised), 15 ms a token; a request's prompt and output blocks are cached when it
ends. TTFT = queue wait + prefill. Workload: `--conversations` conversations, started over the
first 10 s, of `--turns` turns (a shared 1,500-token system prompt; 150-token user turns; 250-token
answers on one of L0-L3; then the summary hop: history + answer + a 100-token instruction, 100
tokens out), a user think time of 2-6 s between turns. `--heavy F`: that share of the
conversations (every 1/F-th group of four, one on each adapter) sends 2,000-token user turns
(pasted files, tool results) instead. Route hops (a few hundred tokens, no history) are left out.
Seeded: the same arguments give the same table.

    python bench/bench_llmd_scheduler.py [--replicas 1 2 4] [--conversations 64] [--turns 6] [--heavy F]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.llmd_picker import Picker, Replica, block_hashes  # noqa: E402

SYSTEM, USER, HEAVY_USER, ANSWER, INSTRUCTION, SUMMARY_OUT = 1500, 150, 2000, 250, 100, 100
DECODE_S = 0.015
ADAPTERS = ("L0", "L1", "L2", "L3")


def simulate(policy: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    replicas = [Replica(args.cache_blocks, args.prefill_us) for _ in range(n)]
    picker = Picker(replicas, args.cache_blocks, random.Random(args.seed + 1))
    system = [rng.randrange(1 << 30) for _ in range(SYSTEM)]
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, hop, conversation, turn)
    seq = [0]

    def push(t: float, hop: str, c: int, turn: int) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], hop, c, turn))

    history: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    reached: dict[int, int] = {}  # the pod each conversation's current turn reached (stacks)
    rr = [0]
    for c in range(args.conversations):
        history[c] = list(system)
        push(rng.uniform(0, 10), "answer", c, 0)
    hits = {"first": [0, 0], "follow": [0, 0], "summary": [0, 0]}
    ttft_follow: list[float] = []

    def place(now: float, c: int, model: str, prompt: list[int]) -> Replica:
        if policy == "llm-d":
            return replicas[picker.pick(now, f"conv-{c}", model, prompt)]
        if policy == "stack-affinity":
            return replicas[owner.setdefault(c, reached[c])]
        return replicas[reached[c]]

    while events:
        now, _, hop, c, turn = heapq.heappop(events)
        crng = random.Random(f"{args.seed}-{c}-{turn}")
        model = ADAPTERS[c % len(ADAPTERS)]
        if hop == "summary":  # the answer is done: history + answer + the instruction
            prompt = history[c] + [7] * INSTRUCTION
            _, cached, _ = place(now, c, model, prompt).admit(now, model, prompt, SUMMARY_OUT, DECODE_S)
            hits["summary"][0] += cached
            hits["summary"][1] += len(prompt)
            continue
        heavy = args.heavy > 0 and (c // len(ADAPTERS)) % round(1 / args.heavy) == 0  # on every adapter
        history[c] += [crng.randrange(1 << 30) for _ in range(HEAVY_USER if heavy else USER)]
        reached[c] = rr[0] % n  # the Service's round robin: the pod this turn reached
        rr[0] += 1
        prompt = list(history[c])
        engine = place(now, c, model, prompt)
        ttft, cached, prefilled = engine.admit(now, model, prompt, ANSWER, DECODE_S)
        kind = "first" if turn == 0 else "follow"
        hits[kind][0] += cached
        hits[kind][1] += len(prompt)
        if turn > 0:
            ttft_follow.append(ttft)
        answer = [crng.randrange(1 << 30) for _ in range(ANSWER)]
        done = prefilled + ANSWER * DECODE_S
        engine.cache.add(block_hashes(model, prompt + answer))  # cached when it ends (approximated: now)
        history[c] += answer
        push(done, "summary", c, turn)
        if turn + 1 < args.turns:
            push(done + crng.uniform(2, 6), "answer", c, turn + 1)
    ratio = {k: v[0] / v[1] if v[1] else 0.0 for k, v in hits.items()}
    ttft_follow.sort()
    return {
        "follow_hit": ratio["follow"],
        "summary_hit": ratio["summary"],
        "ttft_p50": statistics.median(ttft_follow),
        "ttft_p90": ttft_follow[int(0.9 * (len(ttft_follow) - 1))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--cache-blocks", type=int, default=8000, help="prefix-cache blocks per replica (16 tokens each)")
    ap.add_argument("--prefill-us", type=float, default=100.0, help="prefill time per uncached prompt token")
    ap.add_argument("--heavy", type=float, default=0.0, help="share of conversations with 2,000-token turns")
    ap.add_argument("--seed", type=int, default=43)
    args = ap.parse_args()
    print("| replicas | placement | follow-up turns' prefix-cache hit | summary hops' hit | follow-up TTFT p50 | p90 |")
    print("|---|---|---|---|---|---|")
    for n in args.replicas:
        for policy in ("stack-rr", "stack-affinity", "llm-d"):
            r = simulate(policy, n, args)
            print(
                f"| {n} | {policy} | {r['follow_hit']:.1%} | {r['summary_hit']:.1%} | "
                f"{r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p90'] * 1000:.0f} ms |"
            )


if __name__ == "__main__":
    main()
