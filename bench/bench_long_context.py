"""Conversations at the real windows (issue 40): 32k, 128k and 256k tokens through molctl's proxy
and directly to the engine, streamed and not, a first turn and its follow-up (a speculative hit),
with the engine reporting token ids (vLLM's `return_token_ids`) and without.

The engine is the scripted one (tests/fake_engine.py in its `token_ids` mode: one word is one
token, every hop instant), with its window and the tiny profile's `engine.args.max-model-len`
set to 262,144 + the output, so nothing is clamped or skipped for the window. A conversation of N
tokens is a system message and 8 earlier turns the client made (N words in all), then a question
routed to L2; the follow-up resends it with the answer and a new question on L2, so its answer
hop is the speculative one, held and handed on.

    python bench/bench_long_context.py [--sizes 32768 131072 262144] [--output 4096] [--inflight 4]

Reports per size, stream mode and turn: the proxy's CPU per request (user + system, psutil,
background summary included: read once the proxy counted it; after one warm-up turn, which
runs the template probe a proxy runs once) with token ids
and without, their ratio; the client's wall time through the proxy and directly (the answer
hop's request alone, to the engine) and the difference. Then the proxy's RSS growth per
in-flight 256k-token request (`--inflight` requests held at the engine at once), and the bytes a
queued summary keeps (`SummaryJob.size`, in-process) per size.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers import free_port  # noqa: E402
from tests.procs import fake_engine_argv, proxy_argv, running  # noqa: E402

KEY = "sk-bench"
MODEL = "Macaron-Tiny-Demo"
EARLIER_TURNS = 8


def conversation(tokens: int) -> list[dict]:
    """A system message and EARLIER_TURNS client-made turns: `tokens` words (= fake tokens) in all."""
    per = tokens // (2 * EARLIER_TURNS + 1)
    body = lambda k: " ".join(f"w{k}x{i % 997}" for i in range(per))  # noqa: E731
    messages = [{"role": "system", "content": body(0)}]
    for t in range(EARLIER_TURNS):
        messages += [{"role": "user", "content": body(2 * t + 1)}, {"role": "assistant", "content": body(2 * t + 2)}]
    return messages


class Stack:
    """The fake engine and the tiny profile's proxy in front of it, one pair per token-id mode."""

    def __init__(self, tmp: Path, token_ids: bool, output: int, window: int):
        self.cfg = {"token_ids": token_ids, "answer_words": output, "max_model_len": window}
        keyfile = tmp / "key"
        keyfile.write_text(KEY)
        keyfile.chmod(0o600)
        state = tmp / "state"
        state.mkdir(mode=0o700, exist_ok=True)
        self.engine_port, self.proxy_port, self.metrics_port = free_port(), free_port(), free_port()
        self.engine = f"http://127.0.0.1:{self.engine_port}"
        self.proxy = f"http://127.0.0.1:{self.proxy_port}"
        sets = [
            f"engine.args.max-model-len={window}",
            "proxy.max_inflight=64",
            f"proxy.max_output_tokens={output + 64}",
        ]
        argv = proxy_argv(
            "tiny",
            self.engine,
            self.proxy_port,
            "--api-key-file",
            str(keyfile),
            "--metrics-port",
            str(self.metrics_port),
        )
        for s in sets:
            argv += ["--set", s]
        self._engine_cm = running(fake_engine_argv(self.engine_port, self.cfg), self.engine + "/health")
        self._proxy_cm = running(
            argv,
            self.proxy + "/health",
            env={"PYTHONWARNINGS": "ignore", "MOLCTL_STATE_DIR": str(state)},
            log=tmp / f"proxy-{token_ids}.log",
        )

    def __enter__(self) -> Stack:
        self._engine_cm.__enter__()
        proc = self._proxy_cm.__enter__()
        self.proc = psutil.Process(proc.pid)
        self.http = httpx.Client(headers={"authorization": f"Bearer {KEY}"}, timeout=600)
        self.turn([{"role": "user", "content": "[route:L2] warm up"}], False)  # the template probe, once per proxy
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self._proxy_cm.__exit__(*exc)
        self._engine_cm.__exit__(*exc)

    def reset(self) -> None:
        httpx.post(self.engine + "/_reset")
        httpx.post(self.engine + "/_config", json=self.cfg)

    def summaries_done(self) -> float:
        """Summaries recorded, skipped or failed so far (the proxy's counters)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        names = ("summaries_total", "summary_window_skips_total", "summary_failures_total", "summaries_dropped_total")
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if any(line.startswith(f"molctl_proxy_{n}") for n in names)
        )

    def cpu(self) -> float:
        return sum(self.proc.cpu_times()[:2])

    def ask(self, url: str, body: dict, stream: bool) -> tuple[float, str]:
        """(wall seconds, the answer's text) of one request."""
        start = time.perf_counter()
        if not stream:
            r = self.http.post(url, json=body)
            r.raise_for_status()
            return time.perf_counter() - start, r.json()["choices"][0]["message"]["content"]
        text = []
        with self.http.stream("POST", url, json={**body, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    for c in json.loads(line[6:]).get("choices") or ():
                        text.append((c.get("delta") or {}).get("content") or "")
        return time.perf_counter() - start, "".join(text)

    def turn(self, messages: list[dict], stream: bool) -> tuple[float, float, str]:
        """(proxy CPU s, wall s, answer) of one request, its background summary included."""
        before = self.summaries_done()
        cpu0 = self.cpu()
        wall, answer = self.ask(self.proxy + "/v1/chat/completions", {"model": MODEL, "messages": messages}, stream)
        deadline = time.monotonic() + 120
        while self.summaries_done() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.cpu() - cpu0, wall, answer

    def direct(self, messages: list[dict], stream: bool) -> float:
        body = {"model": "L2", "messages": messages, "return_token_ids": self.cfg["token_ids"]}
        return self.ask(self.engine + "/v1/chat/completions", body, stream)[0]


def run_sizes(stack: Stack, sizes: list[int], repeat: int) -> dict:
    """{(size, stream, turn): (cpu, wall, direct wall)} for one token-id mode, each the mean of
    `repeat` conversations (psutil's CPU times tick in 10 ms)."""
    out: dict = {}
    for size in sizes:
        history = conversation(size)
        for stream in (False, True):
            for r in range(repeat):
                stack.reset()
                first = [*history, {"role": "user", "content": f"[route:L2] question s{int(stream)} r{r}"}]
                cpu, wall, answer = stack.turn(first, stream)
                add(out, (size, stream, "first"), (cpu, wall, stack.direct(first, stream)), repeat)
                follow = [
                    *first,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "[route:L2] more"},
                ]
                cpu, wall, _ = stack.turn(follow, stream)
                add(out, (size, stream, "hit"), (cpu, wall, stack.direct(follow, stream)), repeat)
                log = httpx.get(stack.engine + "/_log", timeout=60).json()
                assert any(e.get("hop") == "speculative" for e in log), "the follow-up was not speculated"
    return out


def add(out: dict, key: tuple, values: tuple[float, ...], repeat: int) -> None:
    old = out.get(key, (0.0,) * len(values))
    out[key] = tuple(o + v / repeat for o, v in zip(old, values, strict=True))


def rss_per_inflight(stack: Stack, size: int, inflight: int) -> float:
    """The proxy's RSS growth (bytes) per request while `inflight` requests of `size` tokens are
    held at the engine at once (its answer delayed 3 s), non-streamed."""
    stack.reset()
    httpx.post(stack.engine + "/_config", json={"answer_delay": 3.0})
    history = conversation(size)
    base = stack.proc.memory_info().rss
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], stack.proc.memory_info().rss)
            time.sleep(0.02)

    def one(k: int):
        messages = [*history, {"role": "user", "content": f"[route:L2] q{k}"}]
        stack.ask(stack.proxy + "/v1/chat/completions", {"model": MODEL, "messages": messages}, False)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(inflight)]
    sampler = threading.Thread(target=sample)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    httpx.post(stack.engine + "/_config", json={"answer_delay": 0.0})
    return (peak[0] - base) / inflight


def queued_summary_bytes(size: int, output: int) -> tuple[int, int]:
    """(bytes a queued summary keeps with the summary suffix known, without it), in-process."""
    from molctl.engines.base import AnswerTokens
    from molctl.engines.vllm import ENGINE
    from molctl.proxy.apis.request_fields import PERMISSIVE
    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.pipeline.priority import PriorityPolicy
    from molctl.proxy.pipeline.summary import Summaries
    from tests.proxy_stack import TINY as profile

    profile = dataclasses.replace(profile, proxy=dataclasses.replace(profile.proxy, summary_job_max_bytes=1 << 30))
    history = conversation(size)
    plan = SimpleNamespace(
        body={},
        route="L2",
        view=history,
        answer={"role": "assistant", "content": "word " * output},
        tokens=AnswerTokens(list(range(size)), list(range(output)), True),
        engine=None,
        record=TurnRecord("L2"),
        record_key=b"k",
    )
    counters = SimpleNamespace(inc=lambda *a, **k: None)
    s = Summaries(
        profile, ENGINE, None, None, counters, PERMISSIVE, PriorityPolicy(profile, ENGINE, None, counters), None, 1, 5
    )
    without = s._job(plan).size()
    s._suffixes[s.adapter_models["L2"]] = [2, 4, 5]
    return s._job(plan).size(), without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 131072, 262144])
    parser.add_argument("--output", type=int, default=4096, help="answer tokens (words)")
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="conversations per size, mode and token-id setting")
    args = parser.parse_args()
    window = max(args.sizes) + args.output + 1024
    results, rss = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for ids in (True, False):
            with Stack(Path(tmp), ids, args.output, window) as stack:
                results[ids] = run_sizes(stack, args.sizes, args.repeat)
                rss[ids] = rss_per_inflight(stack, max(args.sizes), args.inflight)
    print(f"fake engine (token_ids mode, hops instant), answers of {args.output} tokens, window {window}")
    print(
        "| tokens | stream | turn | proxy CPU, ids on | ids off | on / off | wall via proxy (ids on) | direct | added |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, stream, turn in results[True]:
        on, off = results[True][(size, stream, turn)], results[False][(size, stream, turn)]
        ratio = on[0] / off[0] if off[0] else float("nan")
        mode = "yes" if stream else "no"
        print(
            f"| {size // 1024}k | {mode} | {turn} | {on[0] * 1000:.0f} ms | {off[0] * 1000:.0f} ms | {ratio:.2f}x "
            f"| {on[1] * 1000:.0f} ms | {on[2] * 1000:.0f} ms | {(on[1] - on[2]) * 1000:+.0f} ms |"
        )
    print(
        f"\nproxy RSS growth per in-flight {max(args.sizes) // 1024}k-token request ({args.inflight} at once): "
        f"ids on {rss[True] / 2**20:.1f} MiB, ids off {rss[False] / 2**20:.1f} MiB"
    )
    for size in args.sizes:
        known, unknown = queued_summary_bytes(size, args.output)
        print(
            f"queued summary at {size // 1024}k tokens: {known / 2**20:.2f} MiB (suffix known), "
            f"{unknown / 2**20:.2f} MiB (before the template probe: ids + chat JSON)"
        )


if __name__ == "__main__":
    main()
