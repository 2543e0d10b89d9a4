"""The proxy test stack: a fake engine (tests/fake_engine.py) and a tiny-profile proxy in front of
it, driven by the official `openai` SDK (`Stack`), and the constants the proxy tests share. The
module-scoped fixtures `keyfile`, `stack` and `s` (in tests/conftest.py) start and hand out one."""

from __future__ import annotations

import contextlib
import re
import time

import httpx
import openai

from molctl.profiles import load_profile, profile_dirs
from tests.helpers import free_ports
from tests.procs import fake_engine_argv, running
from tests.proxy_in_process import proxy_in_process

KEY, KEY2 = "sk-test-one", "sk-test-two"
TINY = load_profile("tiny", profile_dirs())
PUBLIC = TINY.served_model_name
IDENTITY = {"role": "system", "content": TINY.substitute(TINY.prompts.identity).strip()}
LEAK = re.compile(r"(?<![A-Za-z0-9])L[0-3](?![0-9])|tiny-mol-base|glm52-fp8-official")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
RESPONSES_TOOLS = [  # the same tool in the Responses API's shape
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


STRICT = {"strict": True, "max_model_len": TINY.engine.args["max-model-len"]}


def fold(summary: str) -> dict:
    return {"role": "assistant", "content": TINY.prompts.fold.replace("{summary}", summary)}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, labelled samples summed per name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0) + float(value)
    return out


def answers_of(log: list[dict]) -> list[dict]:
    """The engine requests of a fake engine's log that answered a client request, in order: its
    answer hop, or the held speculative hop where there was none (a hit; a miss's held hop is
    followed by the answer hop of the same client request id)."""
    sent = [e for e in log if e.get("hop") in ("answer", "speculative") and "event" not in e]
    answered = {e["request_id"].rsplit("-", 1)[0] for e in sent if e["hop"] == "answer" and e.get("request_id")}
    return [e for e in sent if e["hop"] == "answer" or (e.get("request_id") or "").rsplit("-", 1)[0] not in answered]


class Stack:
    def __init__(self, engine_url: str, proxy_url: str, metrics_url: str | None = None, proxy=None):
        self.engine_url, self.proxy_url, self.metrics_url = engine_url, proxy_url, metrics_url
        self.proxy = proxy  # an InProcessProxy, when the proxy is served in this process (tests/proxy_in_process.py)
        self.client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def config(self, **cfg):
        httpx.post(self.engine_url + "/_config", json=cfg).raise_for_status()

    def reset(self):
        httpx.post(self.engine_url + "/_reset").raise_for_status()

    def log(self, hop: str | None = None) -> list[dict]:
        entries = httpx.get(self.engine_url + "/_log").json()
        return [e for e in entries if hop is None or e["hop"] == hop]

    @property
    def app(self):
        """The in-process proxy's ProxyApp."""
        return self.proxy.app

    def settle(self) -> None:
        """Wait until the in-process proxy has finished its requests and their summary hops."""
        self.proxy.settle()

    def answers(self) -> list[dict]:
        return answers_of(self.log())

    def metrics(self) -> dict[str, float]:
        """The proxy's metrics listener (no key), labelled series summed per name (0 for a
        labelled counter with no series yet)."""
        from collections import defaultdict

        return defaultdict(float, parse_prometheus(httpx.get(self.metrics_url + "/metrics").text))

    def chat(self, messages, stream=False, **kw):
        if not stream:
            return self.client.chat.completions.create(model=PUBLIC, messages=messages, **kw)
        content, calls, chunks = "", {}, []
        for chunk in self.client.chat.completions.create(model=PUBLIC, messages=messages, stream=True, **kw):
            chunks.append((time.monotonic(), chunk))
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    acc = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    acc["id"] = tc.id or acc["id"]
                    acc["name"] += (tc.function.name or "") if tc.function else ""
                    acc["arguments"] += (tc.function.arguments or "") if tc.function else ""
        return content, calls, chunks


@contextlib.contextmanager
def own_stack(keyfile, logs, *proxy_args: str, scheduling_policy: str = "priority"):
    """A fake engine (a process) and a tiny-profile proxy served in this process
    (tests/proxy_in_process.py) with `molctl proxy`'s `--set K=V` and `--metrics-port N`
    arguments, for a test module's own stack; the logs go to `logs` (engine.log, proxy.log)."""
    sets, metrics_port, rest = [], None, list(proxy_args)
    while rest:
        flag, value = rest.pop(0), rest.pop(0)
        if flag == "--set":
            sets.append(value)
        elif flag == "--metrics-port":
            metrics_port = int(value)
        else:
            raise ValueError(f"own_stack: {flag} needs the proxy's own process (tests/procs.py proxy_argv)")
    engine_port = free_ports(1)[0]
    engine_url = f"http://127.0.0.1:{engine_port}"
    with (
        running(
            fake_engine_argv(engine_port, scheduling_policy=scheduling_policy),
            engine_url + "/health",
            log=logs / "engine.log",
        ),
        proxy_in_process(
            "tiny",
            engine_url,
            logs / "state",
            key_file=keyfile,
            sets=tuple(sets),
            metrics_port=metrics_port,
            log=logs / "proxy.log",
        ) as proxy,
    ):
        stack_ = Stack(engine_url, proxy.url, proxy=proxy)
        stack_.reset()
        yield stack_
