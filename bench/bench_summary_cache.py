"""How much of the summary hop's prompt the engine's prefix cache serves (issue 30), on the real
engine (vLLM CPU build, tiny profile, `--enable-prefix-caching`, 32-token blocks,
`--enable-prompt-tokens-details`, all from profiles/tiny.yaml). The proxy's own Orchestrator runs
in-process against the engine: `prepare`, the answer hop (`complete`, or `stream` for the third
case) on L2, then the summary hop, and the share is the summary's
`usage.prompt_tokens_details.cached_tokens` / `usage.prompt_tokens`, as vLLM reports it.
Three conversations (a multi-turn history of about `--tokens` tokens each, the content fresh per
run so nothing is cached from an earlier one):
- plain chat;
- tools declared (the client's `tools`, as every agent client sends them);
- tools + tool calls + reasoning: the turn in progress has assistant tool calls with
  `reasoning_content` and their tool results (the answer is streamed).
Each case runs twice, on its own copy of the conversation:
- before: the chat summary of main before issue 30 (`Summaries.summary_payload`, unchanged:
  the answer hop's messages + the answer + the instruction as a user message, no tools);
- after: the proxy's summary hop (`Summaries.summary_request`: the answer's prompt and output
  token ids + the suffix, as a token-prompt /v1/completions on the same adapter).
The tiny profile's window (2048, its model's max_position_embeddings) is raised to `--window`
(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; a random model does not care): the summary instruction alone is
about 110 tokens of the tiny tokenizer, and the cache serves whole 32-token blocks, so the share
is (prompt + answer - up to one block) / (prompt + answer + ~120): above 95% only from about
3,000 tokens of conversation on, which agent conversations pass in their first turns.

    python bench/bench_summary_cache.py [--tokens 4000] [--window 8192] [--answer-tokens 48]"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bare_vllm import start_vllm, stop_group  # noqa: E402

from molctl.engines import get_engine  # noqa: E402
from molctl.proxy.engine_client import EngineClient  # noqa: E402
from molctl.proxy.pipeline.run import Orchestrator  # noqa: E402
from molctl.proxy.pipeline.summary import SummaryJob  # noqa: E402
from molctl.proxy.store.memory import MemoryStore  # noqa: E402

WORDS = (
    "the user asked to fix the failing test in the repository then run the benchmarks again with "
    "new settings and report which numbers changed since the last release of the service"
).split()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


def prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(case: str, rng: random.Random, words: int) -> dict:
    """A request body of about `words` words of history (fresh text: `rng`)."""
    nonce = f"session {rng.randrange(10**9)}"
    msgs: list[dict] = [{"role": "system", "content": f"You help with a code repository ({nonce})."}]
    turns = 4
    for _ in range(turns):
        msgs.append({"role": "user", "content": prose(rng, words // (2 * turns))})
        msgs.append({"role": "assistant", "content": prose(rng, words // (2 * turns))})
    msgs.append({"role": "user", "content": "Now " + prose(rng, 30)})
    body: dict = {"messages": msgs, "max_tokens": 48, "temperature": 0}
    if case != "plain chat":
        body["tools"] = TOOLS
    if case == "tools + tool calls + reasoning":
        for i in range(2):
            msgs.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "I should look: " + prose(rng, 40),
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "run", "arguments": json.dumps({"command": f"make test {i}"})},
                        }
                    ],
                }
            )
            msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": prose(rng, 60)})
        body["stream"] = True
    return body


def share(usage: dict | None) -> tuple[int, int]:
    usage = usage or {}
    return usage.get("prompt_tokens") or 0, ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def one(orch: Orchestrator, client: EngineClient, body: dict, mode: str, tenant: str) -> tuple[int, int, str]:
    body = {"model": orch.public, **body}
    plan = orch.prepare(body, tenant)
    plan.route = "L2"
    if plan.stream:
        async for _ in orch.stream(plan):
            pass
    else:
        await orch.complete(plan)
    assert plan.record is not None, "the answer was a tool call: no summary"
    if mode == "before":
        usage = (await client.chat(orch.summaries.summary_payload(plan), "summary"))["usage"]
        how = "chat"
    else:
        job = SummaryJob(orch.summaries.summary_payload(plan), orch.adapter_models["L2"], "L2", plan.tokens, {})
        hop = await orch.summaries.summary_request(job)
        assert hop is not None, "the summary did not fit the window"
        path, payload = hop
        usage = (await client.chat(payload, "summary", path=path))["usage"]
        how = path
    prompt, cached = share(usage)
    return prompt, cached, how


async def measure(url: str, profile, words: int, answer_tokens: int) -> list[dict]:
    engine = get_engine("vllm")
    client = EngineClient(url, request_id_field=engine.request_id_field)
    await client.start()
    orch = Orchestrator(profile, engine, client, MemoryStore())
    rng = random.Random(30)
    rows = []
    try:
        for case in ("plain chat", "tools declared", "tools + tool calls + reasoning"):
            for mode in ("before", "after"):
                body = conversation(case, rng, words)
                body["max_tokens"] = answer_tokens
                prompt, cached, how = await one(orch, client, body, mode, f"{case}-{mode}")
                rows.append(
                    {
                        "case": case,
                        "mode": mode,
                        "summary_prompt_tokens": prompt,
                        "cached_tokens": cached,
                        "share": cached / prompt if prompt else 0.0,
                        "sent_as": how,
                    }
                )
    finally:
        await client.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4000, help="about this many tokens of history per conversation")
    ap.add_argument("--window", type=int, default=8192, help="the engine's max-model-len")
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-summary-cache-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-m", "molctl", "demo", "init", str(model)], check=True, capture_output=True)
        proc, url, profile = start_vllm(
            model,
            Path(tmp) / "vllm.log",
            [("engine.args.max-model-len", args.window), ("engine.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")],
        )
        try:
            # the tiny tokenizer: about 3 tokens per word of this text
            rows = asyncio.run(measure(url, profile, args.tokens // 3, args.answer_tokens))
        finally:
            stop_group(proc)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"summary hop prompt tokens served from the prefix cache (vLLM CPU, tiny, window {args.window}, "
        f"~{args.tokens} tokens of history, answer <= {args.answer_tokens} tokens)"
    )
    print(f"{'case':32} {'mode':7} {'prompt':>7} {'cached':>7} {'share':>7}  sent as")
    for r in rows:
        print(
            f"{r['case']:32} {r['mode']:7} {r['summary_prompt_tokens']:7d} {r['cached_tokens']:7d} "
            f"{100 * r['share']:6.1f}%  {r['sent_as']}"
        )


if __name__ == "__main__":
    main()
