"""End to end against a real vLLM (the CPU build) serving the tiny model with four real LoRA
adapters: `molctl up tiny` once for the module, chat through the proxy with the openai SDK,
`status`, the orphaned-workers restart, and `down` leaving nothing behind.

Hops are told apart in the engine's own request log (`--enable-log-requests`): the route hop
is the one with structured outputs (guided choice; max_tokens = the longest label, 2), the
answer hop asks for the client's max_tokens (12 here), the summary hop for
proxy.summary_max_tokens (32).

What vLLM 0.32 logs per request (vllm/entrypoints/serve/utils/request_logger.py): at INFO only
"Received request ID: params: SamplingParams(...), lora_request: LoRARequest(...)"; at DEBUG also
"Request ID details: prompt: '<the rendered chat template text>', prompt_token_ids: [...]" and
"Request ID JSON body: {...}" (the request as received, i.e. the messages the proxy sent). The
stack here runs the engine with VLLM_LOGGING_LEVEL=DEBUG, so the tests read the engine's own
rendering of every hop (the Qwen3.6-like template of the tiny profile) and the exact messages,
which they also render with the demo's GLM-5-like template."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from molctl.checks.template import Template, render
from molctl.errors import ExitStatus
from molctl.probes import PortProbe
from molctl.processes import is_alive
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.errors import CONTEXT_MARKERS
from molctl.state import read_records
from tests.clients.cases import BASIC, RESPONSES
from tests.clients.drivers import js_client_argv, python_client_argv, run_driver
from tests.engine_versions import VLLM_CURRENT
from tests.helpers import free_port, free_ports
from tests.procs import ROOT, alive, fake_engine_argv, proxy_argv, running

PUBLIC = "Macaron-Tiny-Demo"
GLM5 = Template("glm5-like", {"default": (ROOT / "molctl" / "templates" / "glm5-like.jinja").read_text()}, {})
KEY = "sk-e2e-key"
ANSWER_TOKENS = 16  # OpenAI's floor for max_output_tokens (the Responses case uses it)
REQUEST_RE = re.compile(
    r"Received request (\S+): params: SamplingParams\(.*?max_tokens=(\d+),.*?structured_outputs=(\w+).*?"
    r"lora_request: LoRARequest\(lora_name='(L\d)'"
)
PROMPT_RE = re.compile(
    r"Request (\S+) details: prompt: ('(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"), prompt_token_ids:"
)
BODY_RE = re.compile(r"Request (\S+) JSON body: (\{.*)$", re.MULTILINE)


class Stack:
    def __init__(self, tmp: Path, engine: tuple[str, Path | None] = (VLLM_CURRENT, None)):
        self.tmp = tmp
        self.version, self.python = engine
        self.state = tmp / "state"
        self.model = tmp / "tiny"
        self.key = tmp / "key"
        self.key.write_text(KEY + "\n")
        self.key.chmod(0o600)
        self.engine_port, self.proxy_port, self.metrics_port = free_ports(3)
        self.engine = f"http://127.0.0.1:{self.engine_port}"
        self.endpoint = f"http://127.0.0.1:{self.proxy_port}/v1"
        self.client = openai.OpenAI(base_url=self.endpoint, api_key=KEY, max_retries=0, timeout=120)
        self.seen: dict[int, float] = {}  # pid -> create time of every stack process and descendant seen

    def molctl(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "molctl", "--state-dir", str(self.state), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )

    def up(self, *more: str, debug: bool = True) -> subprocess.CompletedProcess:
        # debug: the request log's DEBUG lines hold each request's rendered prompt and JSON body
        extra = ["--set", "engine.env.VLLM_LOGGING_LEVEL=DEBUG"] if debug else []
        if self.python is not None:  # another release's environment, as a GPU profile names its own
            extra += ["--set", f"engine.python={self.python}", "--set", f'engine.version="=={self.version}"']
            if debug and self.version != VLLM_CURRENT:  # its request log without the JSON body line
                extra += ["--set", f"engine.env.PYTHONPATH={ROOT / 'tests' / 'vllm_body_log'}"]
        return self.molctl(
            "up",
            "tiny",
            "--model-root",
            str(self.model),
            "--api-key-file",
            str(self.key),
            "--json",
            "--set",
            f"engine.port={self.engine_port}",
            "--set",
            f"proxy.port={self.proxy_port}",
            "--set",
            f"proxy.metrics_port={self.metrics_port}",
            *extra,
            *more,
        )

    def engine_log(self) -> str:
        return Path(read_records(self.state, "tiny")["engine"].log).read_text(errors="replace")

    def requests(self, log: str | None = None) -> list[tuple[str, int, bool, str]]:
        """(request id, max_tokens, structured outputs?, adapter) per request the engine received
        (in `log`, the engine log read once by the caller, else read now)."""
        return [
            (m.group(1), int(m.group(2)), m.group(3) != "None", m.group(4))
            for m in REQUEST_RE.finditer(self.engine_log() if log is None else log)
        ]

    def hops(self) -> list[dict]:
        """Per request the engine received, in order: id, hop (route/answer/summary), adapter, the
        prompt as the engine rendered it, and the JSON body the proxy sent."""
        log = self.engine_log()
        prompts = {m.group(1): ast.literal_eval(m.group(2)) for m in PROMPT_RE.finditer(log)}
        bodies = {m.group(1): m.group(2) for m in BODY_RE.finditer(log)}
        out = []
        # one read for the requests, prompts and bodies: a request logged between two reads would
        # be found without its body (a summary hop arriving just then)
        for rid, max_tokens, structured, adapter in self.requests(log):
            hop = "route" if structured else {ANSWER_TOKENS: "answer", 32: "summary"}.get(max_tokens, "other")
            # chat requests are logged as chatcmpl-ID, completions (the summary's continuation) as
            # cmpl-ID-N, N the prompt's index (vllm/entrypoints/openai/completion/serving.py)
            plain = re.sub(r"^(chat)?cmpl-", "", rid)
            body = bodies.get(rid) or bodies.get(plain) or bodies.get(re.sub(r"-\d+$", "", plain))
            body = json.loads(body) if body else None
            prompt = prompts.get(rid)
            if prompt is None and body is not None and isinstance(body.get("prompt"), list):
                # a token prompt (the summary continuing the answer's tokens), as text
                prompt = httpx.post(self.engine + "/detokenize", json={"tokens": body["prompt"]}, timeout=30).json()[
                    "prompt"
                ]
            out.append({"id": rid, "hop": hop, "adapter": adapter, "prompt": prompt, "body": body})
        return speculative_hops(out)

    def metric(self, name: str) -> float:
        text = httpx.get(self.engine + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    def stack_processes(self) -> list[psutil.Process]:
        from molctl.processes import members

        procs = [p for r in read_records(self.state, "tiny").values() for p in members(r)]
        self.remember(procs)
        return procs

    def remember(self, procs: list[psutil.Process]) -> None:
        for p in procs:
            try:
                for q in [p, *p.children(recursive=True)]:
                    self.seen[q.pid] = q.create_time()
            except psutil.Error:
                pass

    def kill_leftovers(self) -> list[str]:
        """Safety net after `down`: SIGKILL any process this module's stack started that still runs
        (same pid and create time), so a failing test leaves nothing behind."""
        left = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {p.name()}")
                    p.kill()
            except psutil.Error:
                pass
        return left


@pytest.fixture(scope="module")
def stack(tmp_path_factory, engine):
    s = Stack(tmp_path_factory.mktemp("e2e"), engine)
    r = s.molctl("demo", "init", str(s.model))
    assert r.returncode == ExitStatus.OK, r.stderr
    try:
        r = s.up()
        assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
        s.up_result = json.loads(r.stdout)
        s.stack_processes()
        yield s
    finally:
        s.molctl("down", "--stop-timeout", "20", "--drain-timeout", "20", "--force")
        left = s.kill_leftovers()
        if left:
            print(f"killed processes `down` left behind: {left}")


def speculative_hops(hops: list[dict]) -> list[dict]:
    """The proxy names each hop in its request id (`<client id>-<hop>`): a speculative answer that
    was the answer (a hit) is that request's answer hop; one followed by an answer hop of the same
    client request (a miss, aborted) is `speculative`."""
    answered = {m.group(1) for h in hops if (m := re.search(r"(req-[0-9a-f]+)-answer", h["id"]))}
    for h in hops:
        m = re.search(r"(req-[0-9a-f]+)-speculative", h["id"])
        if m:
            h["hop"] = "speculative" if m.group(1) in answered else "answer"
    return hops


def settled_hops(stack: Stack, before: int, timeout: float = 60) -> list[dict]:
    """The engine requests since `before` once the turn's summary hop is in (a missed speculative
    answer adds one request to the turn's three), without the missed speculative one."""
    deadline = time.monotonic() + timeout
    hops = stack.hops()[before:]
    while time.monotonic() < deadline and not any(h["hop"] == "summary" for h in hops):
        time.sleep(0.2)
        hops = stack.hops()[before:]
    return [h for h in hops if h["hop"] != "speculative"]


def wait_for_requests(stack: Stack, count: int, timeout: float = 60) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reqs = stack.requests()
        if len(reqs) >= count:
            return reqs
        time.sleep(0.2)
    return stack.requests()


def test_engine_lists_the_adapters_under_the_base(stack):
    models = httpx.get(stack.engine + "/v1/models").json()["data"]
    cards = {m["id"]: m for m in models}
    assert {"tiny-mol-base", "L0", "L1", "L2", "L3"} <= set(cards)
    assert all(cards[a]["parent"] == "tiny-mol-base" for a in ("L0", "L1", "L2", "L3"))
    assert cards["L2"]["root"] == str(stack.model / "loras" / "L2")


def test_adapters_change_greedy_output(stack):
    outputs = {}
    for model in ("tiny-mol-base", "L0", "L1", "L2", "L3"):
        r = httpx.post(
            stack.engine + "/v1/chat/completions",
            timeout=60,
            json={
                "model": model,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "hello there"}],
            },
        )
        outputs[model] = r.json()["choices"][0]["message"]["content"]
    assert len(set(outputs.values())) == 5, outputs


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_proxy_reaches_route_answer_and_summary_adapters(stack, stream):
    """Each chat: a route hop on L0, an answer hop and a summary hop on the adapter the router
    chose. The router is a random model, so a few requests run until one leaves L0."""
    chosen = []
    for topic in ("a small parser in Python", "a shell script", "a web page", "a game loop"):
        before = len(stack.requests())
        messages = [{"role": "user", "content": f"Please write {topic} ({stream})"}]
        if stream:
            chunks = list(
                stack.client.chat.completions.create(
                    model=PUBLIC,
                    messages=messages,
                    max_tokens=ANSWER_TOKENS,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            assert chunks[-1].usage.completion_tokens > 0
            assert all(c.model == PUBLIC for c in chunks)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = stack.client.chat.completions.create(model=PUBLIC, messages=messages, max_tokens=ANSWER_TOKENS)
            assert reply.model == PUBLIC and reply.usage.completion_tokens > 0
            text = reply.choices[0].message.content
        assert text
        new = wait_for_requests(stack, before + 3)[before:]
        route = [r for r in new if r[2]]
        answer = [r for r in new if r[1] == ANSWER_TOKENS]
        summary = [r for r in new if r[1] == 32]
        assert len(route) == 1 and len(answer) == 1 and len(summary) == 1, new
        assert route[0][3] == "L0"  # the router
        assert summary[0][3] == answer[0][3]  # the summary runs on the adapter that answered
        chosen.append(answer[0][3])
        if answer[0][3] != "L0":
            return
    pytest.fail(f"the router kept choosing L0: {chosen}")


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def chat_hops(stack: Stack, messages: list[dict], stream: bool = False, **extra) -> tuple[str, list[dict]]:
    """One chat through the proxy with the openai SDK (which raises on anything but a 200); returns
    the reply's text and the engine requests it caused, once its background summary hop is in."""
    before = len(stack.requests())
    if stream:
        chunks = list(
            stack.client.chat.completions.create(
                model=PUBLIC, messages=messages, max_tokens=ANSWER_TOKENS, stream=True, **extra
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    else:
        reply = stack.client.chat.completions.create(model=PUBLIC, messages=messages, max_tokens=ANSWER_TOKENS, **extra)
        text, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    assert finish in ("stop", "length"), finish  # a random model does not call tools
    hops = settled_hops(stack, before)
    assert sorted(h["hop"] for h in hops) == ["answer", "route", "summary"], hops
    return text, hops


def assert_one_leading_system(hop: dict) -> None:
    """The engine's own rendering (the Qwen3.6-like template) starts with the one system turn and
    has no other; the messages sent hold one system message, first, and no developer role; the
    GLM-5-like demo template renders the same messages with every system turn before the first
    user turn."""
    prompt, body = hop["prompt"], hop["body"]
    assert prompt is not None and body is not None, hop
    assert prompt.startswith("<|im_start|>system\n") and prompt.count("<|im_start|>system") == 1, (hop["hop"], prompt)
    if isinstance(body.get("prompt"), list):  # the summary: the answer hop's tokens continued, no messages
        return
    assert prompt.startswith("<|im_start|>system\n") and prompt.count("<|im_start|>system") == 1, (hop["hop"], prompt)
    roles = [m["role"] for m in body["messages"]]
    assert roles[0] == "system" and roles.count("system") == 1 and "developer" not in roles, (hop["hop"], roles)
    glm = render(GLM5, body)
    assert glm.startswith("[gMASK]<sop><|system|>") and "<|system|>" not in glm.split("<|user|>", 1)[1], (
        hop["hop"],
        glm,
    )


def by_hop(hops: list[dict]) -> dict[str, dict]:
    return {h["hop"]: h for h in hops}


def test_instructions_reach_every_hop_in_one_leading_system_message(stack):
    """A client system prompt and a developer message (leading), then a system message in the middle
    of the conversation: every request is answered 200, and every hop the engine renders starts
    with exactly one system message."""
    identity = "You are Macaron-Tiny-Demo"
    system = {"role": "system", "content": "You are the assistant of Example Corp. Today is Monday."}
    developer = {"role": "developer", "content": "Answer in plain text, no markdown."}
    convo = [system, developer, {"role": "user", "content": "Who are you?"}]
    text, hops = chat_hops(stack, convo)
    for hop in hops:
        assert_one_leading_system(hop)
    answer = by_hop(hops)["answer"]["prompt"]
    head = answer.split("<|im_end|>", 1)[0]  # identity, then the client's instructions in order
    assert head.index(identity) < head.index("Example Corp") < head.index("Answer in plain text"), head
    assert "You are the dispatcher" in by_hop(hops)["route"]["prompt"].split("<|im_end|>", 1)[0]
    # the tiny profile starts vLLM with --scheduling-policy priority: the route hop, and only it,
    # carries the urgent priority, and the real engine ran it (it is in the engine's request log)
    assert by_hop(hops)["route"]["body"]["priority"] == -1
    assert "priority" not in by_hop(hops)["answer"]["body"] and "priority" not in by_hop(hops)["summary"]["body"]

    convo += [
        {"role": "assistant", "content": text},
        {"role": "system", "content": "From now on, answer in French."},
        {"role": "user", "content": "Plan a trip to Kyoto."},
    ]
    text, hops = chat_hops(stack, convo, stream=True)
    for hop in hops:
        assert_one_leading_system(hop)
    for name in ("answer", "summary"):  # kept where it was said, as a note the templates accept
        prompt = by_hop(hops)[name]["prompt"]
        assert (
            "<|im_start|>user\n[system note] From now on, answer in French.<|im_end|>\n<|im_start|>user\nPlan a trip"
            in prompt
        )
        assert "Example Corp" in prompt.split("<|im_end|>", 1)[0]


def test_tool_call_loop_through_the_proxy(stack):
    """Tools offered; the assistant's tool call (built by the client: the tiny model is random) and
    the tool's result sent back; then a next question after the tool turn. All 200, one leading
    system message on every hop, tools and calls rendered in the Qwen3 XML form."""
    system = {"role": "system", "content": "Use the tools when they help."}
    convo = [system, {"role": "user", "content": "What is the weather in Paris?"}]
    _, hops = chat_hops(stack, convo, tools=WEATHER)
    for hop in hops:
        assert_one_leading_system(hop)
    answer = by_hop(hops)["answer"]
    assert answer["body"]["tools"][0]["function"]["name"] == "get_weather"
    assert "# Tools" in answer["prompt"].split("<|im_end|>", 1)[0]

    call = {
        "id": "call_e2e_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    convo += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_e2e_1", "content": '{"temp_c": 18, "sky": "sunny"}'},
    ]
    _, hops = chat_hops(stack, convo, tools=WEATHER)  # a call the proxy did not issue: routed, not sticky
    for hop in hops:
        assert_one_leading_system(hop)
    prompt = by_hop(hops)["answer"]["prompt"]
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        in prompt
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 18, "sky": "sunny"}\n</tool_response><|im_end|>' in prompt
    assert "What is the weather in Paris?" in by_hop(hops)["route"]["prompt"]  # the router sees the last user text

    convo += [
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "And in Rome?"},
    ]
    _, hops = chat_hops(stack, convo, tools=WEATHER)
    for hop in hops:
        assert_one_leading_system(hop)
    assert "And in Rome?" in by_hop(hops)["answer"]["prompt"]


RESPONSES_WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def responses_hops(stack: Stack, **kwargs) -> tuple[object, list[dict]]:
    """One Responses API call through the proxy (the SDK raises on anything but a 200); returns the
    Response and the engine requests it caused, once its summary hop is in."""
    before = len(stack.requests())
    resp = stack.client.responses.create(
        model=PUBLIC, max_output_tokens=ANSWER_TOKENS, tools=RESPONSES_WEATHER, **kwargs
    )
    assert resp.status in ("completed", "incomplete"), resp
    hops = settled_hops(stack, before)
    assert sorted(h["hop"] for h in hops) == ["answer", "route", "summary"], hops
    return resp, hops


def test_responses_chain_of_three_with_a_tool_call(stack):
    """Three chained responses (previous_response_id) with a function call and its output in the
    middle, through `molctl up tiny`: every hop renders one leading system message, the second
    answer hop sees the call and its output verbatim, and the third sees the whole chain (the tool
    turn verbatim on the same adapter, folded to its summary on another)."""
    r1, hops = responses_hops(
        stack, input="What is the weather in Paris?", instructions="Use the tools when they help."
    )
    for hop in hops:
        assert_one_leading_system(hop)
    assert "Use the tools when they help." in by_hop(hops)["answer"]["prompt"].split("<|im_end|>", 1)[0]
    call = {"type": "function_call", "call_id": "call_e2e_r", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_e2e_r", "output": '{"temp_c": 18}'}
    r2, hops = responses_hops(stack, previous_response_id=r1.id, input=[call, output])
    assert r2.previous_response_id == r1.id
    for hop in hops:
        assert_one_leading_system(hop)
    prompt = by_hop(hops)["answer"]["prompt"]
    assert (
        prompt.index("What is the weather in Paris?")
        < prompt.index("<function=get_weather>")
        < prompt.index('<tool_response>\n{"temp_c": 18}\n</tool_response>')
    )
    tool_turn_adapter = by_hop(hops)["answer"]["adapter"]
    r3, hops = responses_hops(stack, previous_response_id=r2.id, input="And in Rome?")
    for hop in hops:
        assert_one_leading_system(hop)
    prompt = by_hop(hops)["answer"]["prompt"]
    assert prompt.index("What is the weather in Paris?") < prompt.index("And in Rome?")
    # The tool turn is this adapter's own (verbatim) or another adapter's (folded to its summary).
    own = by_hop(hops)["answer"]["adapter"] == tool_turn_adapter
    assert ('<tool_response>\n{"temp_c": 18}\n</tool_response>' in prompt) == own, (own, prompt)
    assert "Use the tools when they help." not in prompt  # instructions do not carry over
    again = stack.client.responses.retrieve(r3.id)
    assert again.id == r3.id and again.previous_response_id == r2.id
    items = stack.client.responses.input_items.list(r2.id)
    assert [i.type for i in items.data] == ["function_call_output", "function_call"]  # newest first
    raw = json.dumps([r1.model_dump(), r2.model_dump(), r3.model_dump()])
    assert all(f'"L{i}"' not in raw for i in range(4)) and {r1.model, r2.model, r3.model} == {PUBLIC}


def test_later_turn_hits_the_prefix_cache(stack):
    """The router of a random model may move a conversation between adapters, so turns continue
    until one lands on an adapter that answered an earlier turn (by turn 5 at the latest); that
    turn's answer hop must reuse the conversation's prefix from the engine's cache."""
    # long enough to fill several KV-cache blocks (vLLM's CPU backend uses large blocks)
    trip = " ".join(f"On day {i} we visit temple {i}, eat dinner {i} and walk trail {i}." for i in range(25))
    convo = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": f"Plan a trip to Kyoto: {trip}"},
    ]
    follow_ups = ["Now make day two cheaper.", "Add a museum.", "Fewer temples.", "Print it as a list."]
    seen: list[str] = []
    cached: list[int] = []
    for turn in range(5):
        before = len(stack.requests())
        hits_before = stack.metric("vllm:prefix_cache_hits_total")
        reply = stack.client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=ANSWER_TOKENS)
        hits_after = stack.metric("vllm:prefix_cache_hits_total")
        (adapter,) = [h["adapter"] for h in settled_hops(stack, before) if h["hop"] == "answer"]
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        if adapter in seen:
            assert hits_after > hits_before, (hits_before, hits_after)
            assert cached[-1] > cached[0], (seen, adapter, cached)
            return
        seen.append(adapter)
        time.sleep(0.5)  # the summary hop runs after the reply
        convo += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": follow_ups[turn % len(follow_ups)]},
        ]
    pytest.fail(f"five turns on five different adapters out of four: {seen}")


HELD_TOKENS = 200  # a follow-up's answer in the missed-speculation test: long enough to be running at the route's end


def seeding_proxy(stack: Stack, adapter: str):
    """A second proxy on the stack's engine and conversation store whose route hop always falls
    back (a 1 ms route deadline) to `adapter` (its `proxy.default_route`): a first turn sent through
    it is answered on `adapter` and stored as that conversation's adapter, which the stack's own
    proxy reads for the next turn. The engine log and the store are the stack's."""
    port = free_port()
    store = stack.state / "tiny" / "proxy-store.sqlite3"
    argv = [
        *proxy_argv("tiny", stack.engine, port, "--api-key-file", str(stack.key)),
        *("--set", f"model_root={stack.model}", "--set", f"proxy.store=sqlite:{store}"),
        *("--set", f"proxy.default_route={adapter}", "--set", "proxy.route_timeout_s=0.001"),
    ]
    url = f"http://127.0.0.1:{port}"
    return running(argv, url + "/health", log=stack.tmp / f"seeding-proxy-{adapter}.log"), url + "/v1"


def test_a_missed_speculative_answer_is_aborted_in_the_engine_and_never_shown(stack):
    """A follow-up turn's answer starts on the conversation's adapter alongside the route hop (the
    speculative answer, held). The conversation's adapter is set, not left to the random router:
    its first turn goes through a proxy whose route always falls back to a chosen adapter, so a
    follow-up the router classifies as any other adapter misses, whatever the tiny model's weights
    make of the text. Four seeds cover every label the router may give. On a miss the held request
    is aborted in vLLM (its request log says so) and the client's text is the routed adapter's
    greedy answer, not the held adapter's. The follow-ups ask for HELD_TOKENS tokens with
    `ignore_eos`, so the held answer is still generating when the route decides (a 12-token one
    could finish first on a fast engine, and a finished request is not aborted). Guards the miss
    that depended on the router's choice."""
    follow_ups = ["Now a limerick about a cat.", "Write a SQL query.", "Plan a trip to Rome."]
    long_answer = {"max_tokens": HELD_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for seeded in ("L0", "L1", "L2", "L3"):
        first = [{"role": "user", "content": f"Write a haiku about the rain in spring ({seeded})."}]
        seeder, seeder_url = seeding_proxy(stack, seeded)
        with seeder:
            client = openai.OpenAI(base_url=seeder_url, api_key=KEY, max_retries=0, timeout=120)
            before = len(stack.requests())
            reply = client.chat.completions.create(
                model=PUBLIC, messages=first, max_tokens=ANSWER_TOKENS, temperature=0
            )
            (answered,) = [h for h in settled_hops(stack, before) if h["hop"] == "answer"]
            assert answered["adapter"] == seeded
        convo = [*first, {"role": "assistant", "content": reply.choices[0].message.content}]
        for text in follow_ups:
            before = len(stack.requests())
            messages = [*convo, {"role": "user", "content": text}]
            chunks = stack.client.chat.completions.create(model=PUBLIC, messages=messages, stream=True, **long_answer)
            said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            settled_hops(stack, before)
            hops = stack.hops()[before:]
            held = [h for h in hops if h["hop"] == "speculative"]
            if not held:
                continue  # a hit (or a turn not speculated): no held request to abort
            (answer,) = [h for h in hops if re.search(r"req-[0-9a-f]+-answer", h["id"])]  # by id: not 12 tokens
            assert held[0]["adapter"] == seeded != answer["adapter"]
            client_id = re.search(r"(req-[0-9a-f]+)-speculative", held[0]["id"]).group(1)
            aborted = re.findall(r"Aborted request\(s\) (\S+)\.", stack.engine_log())
            assert any(f"{client_id}-speculative" in rid for rid in aborted), aborted
            assert not any(f"{client_id}-answer" in rid for rid in aborted)

            def direct(body: dict) -> str:
                body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "request_id")}
                r = httpx.post(stack.engine + "/v1/chat/completions", json=body, timeout=120)
                return r.json()["choices"][0]["message"]["content"] or ""

            assert said == direct(answer["body"])  # the routed adapter's greedy answer, whole
            assert said != direct(held[0]["body"])  # not the held adapter's (adapters change greedy output)
            return
    pytest.fail("the router gave each seeded adapter's follow-ups that same adapter: no miss to observe")


def test_a_summary_after_a_tool_declaring_answer_is_served_from_the_cache(stack):
    """Issue 30: the summary hop continues the answer hop's tokens (a token-prompt completion on the
    adapter that answered), so vLLM serves everything before the instruction suffix from the prefix
    cache, with tools declared too (the chat summary of before shared only the tokens before the
    tools block). Read from the proxy's summary_{prompt,cached}_tokens_total (the usage vLLM
    reported). In the tiny 2048 window the ~120-token suffix (the tiny tokenizer spells the
    summary instruction in 110 tokens) is over 5% of any prompt that fits, so the bound is on the
    rest: at least 95% of it and all but its last partial 32-token block (BENCHMARKS.md: 96-97% of
    the whole prompt at 4,000 tokens)."""
    from molctl.proxy.pipeline.views import PROBE_ANSWER, PROBE_USER, suffix_after
    from tests.proxy_stack import parse_prometheus

    def proxy_metric(name: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics").text
        return sum(v for k, v in parse_prometheus(text).items() if k == name)

    step = " ".join(f"Step {i}: read file {i}, run test {i} and note result {i}." for i in range(25))
    messages = [
        {"role": "system", "content": "Use the tools when they help."},
        {"role": "user", "content": f"Fix the build of service {time.time_ns()}: {step}"},
    ]

    def settled(name: str) -> float:
        """The counter once no summary of an earlier test is still adding to it (unchanged for 2 s)."""
        value, since = proxy_metric(name), time.monotonic()
        while time.monotonic() - since < 2:
            time.sleep(0.2)
            now = proxy_metric(name)
            if now != value:
                value, since = now, time.monotonic()
        return value

    prompt0 = settled("molctl_proxy_summary_prompt_tokens_total")
    cached0 = proxy_metric("molctl_proxy_summary_cached_tokens_total")
    _, hops = chat_hops(stack, messages, tools=WEATHER)
    summary = by_hop(hops)["summary"]
    assert isinstance(summary["body"]["prompt"], list) and summary["adapter"] == by_hop(hops)["answer"]["adapter"]
    deadline = time.monotonic() + 30
    while proxy_metric("molctl_proxy_summary_prompt_tokens_total") == prompt0 and time.monotonic() < deadline:
        time.sleep(0.2)
    prompt = proxy_metric("molctl_proxy_summary_prompt_tokens_total") - prompt0
    assert prompt == len(summary["body"]["prompt"]), (prompt, len(summary["body"]["prompt"]))  # this summary's alone
    cached = proxy_metric("molctl_proxy_summary_cached_tokens_total") - cached0
    probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
    instruction = summary_instruction(stack)
    left_open = httpx.post(
        stack.engine + "/tokenize",
        json={"model": "L2", "messages": probe, "add_generation_prompt": False, "continue_final_message": True},
    ).json()["tokens"]
    closed = httpx.post(
        stack.engine + "/tokenize",
        json={
            "model": "L2",
            "add_generation_prompt": True,
            "messages": [*probe, {"role": "user", "content": instruction}],
        },
    ).json()["tokens"]
    suffix = suffix_after(left_open, closed)
    assert suffix and summary["body"]["prompt"][-len(suffix) + 1 :] == suffix[1:], (
        suffix,
        summary["body"]["prompt"][-40:],
    )
    answered = prompt - len(suffix)
    assert cached >= 0.95 * answered and cached >= answered - 32, (prompt, cached, len(suffix))


def summary_instruction(stack: Stack) -> str:
    profile = load_profile("tiny", profile_dirs(), [("model_root", str(stack.model))])
    return profile.substitute(profile.prompts.summary).strip()


# The client libraries on the real engine: every case whose features the tiny random model allows.
# It calls no tool of its own accord, and a call forced by tool_choice ends at the token limit
# (finish_reason "length", also directly: vLLM's structured outputs let it write whitespace), so
# the clients that run the loop themselves stop there: pydantic-ai (which picks its own
# tool_choice) and the AI SDK (which takes the next step only after finish "tool-calls").
REAL_CLIENTS = {
    ("py", "openai-chat"): BASIC,
    ("py", "openai-responses"): RESPONSES,
    ("py", "litellm-completion"): BASIC,
    ("py", "litellm-responses"): RESPONSES,
    ("py", "langchain-chat"): BASIC,
    ("py", "langchain-responses"): RESPONSES,
    ("py", "pydantic-ai-chat"): ("plain", "stream", "multi_turn"),
    ("py", "pydantic-ai-responses"): ("plain", "stream", "multi_turn", "chain", "store_false"),
    ("js", "ai-sdk-responses"): ("plain", "stream", "multi_turn", "chain"),
    ("js", "ai-sdk-chat"): ("plain", "stream", "multi_turn"),
    ("js", "openai-chat"): BASIC,
    ("js", "openai-responses"): RESPONSES,
}


CLIENTS_AT_ONCE = 6  # under the tiny profile's 8 engine slots: no answer waits out proxy.queue_timeout_s
CLIENT_ANSWER_TOKENS = 64  # the second proxy's proxy.max_output_tokens (tiny: 256); a forced call's tag+name: ~30


@pytest.fixture(scope="module")
def real_client_runs(stack):
    """Every REAL_CLIENTS driver against the stack's engine, CLIENTS_AT_ONCE of them at a time (each
    its own process, as the clients of one deployment are; the engine batches their requests), each
    tagging its tool result with its name: (lang, client) -> its results (or the driver's failure),
    and the engine's hops of the whole run. They go through a second proxy of the same profile whose
    only change is proxy.max_output_tokens (CLIENT_ANSWER_TOKENS: the drivers set no limit, and the
    random model writes to it), on a store of its own: what a client sees does not depend on the
    answer's length, and the engine's time does."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        *proxy_argv("tiny", stack.engine, port, "--api-key-file", str(stack.key)),
        *("--set", f"model_root={stack.model}", "--set", f"proxy.store=sqlite:{stack.tmp / 'clients.sqlite3'}"),
        *("--set", f"proxy.max_output_tokens={CLIENT_ANSWER_TOKENS}"),
    ]

    def drive(lang: str, client: str) -> dict | str:
        argv = (python_client_argv if lang == "py" else js_client_argv)(client)
        tag = f" ({lang}-{client})"
        try:
            cases = REAL_CLIENTS[lang, client]
            return run_driver([*argv, *cases], url + "/v1", KEY, PUBLIC, 600, MOL_FORCE_TOOL="1", MOL_WEATHER_TAG=tag)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"

    before = len(stack.requests())
    with (
        running(argv, url + "/health", log=stack.tmp / "clients-proxy.log"),
        ThreadPoolExecutor(CLIENTS_AT_ONCE) as pool,
    ):
        runs = {key: pool.submit(drive, *key) for key in REAL_CLIENTS}
        results = {key: run.result() for key, run in runs.items()}
    return results, stack.hops()[before:]


@pytest.mark.parametrize("lang,client", REAL_CLIENTS)
def test_client_libraries_run_unchanged_against_the_real_vllm(real_client_runs, lang, client):
    """Each case ran without an error; a multi-turn case's second request reached the engine with
    the first answer in an assistant message (verbatim, or folded into the profile's fold text when
    the random router chose another adapter for the second turn); a tool loop's result, tagged with
    this driver's name, reached it in a tool message."""
    runs, hops = real_client_runs
    results, cases = runs[lang, client], REAL_CLIENTS[lang, client]
    assert isinstance(results, dict), results  # else: how the driver failed
    assert set(results) == set(cases)
    sent = [m for h in hops if h["body"] for m in h["body"].get("messages", ())]
    folded = load_profile("tiny", profile_dirs()).prompts.fold.split("{summary}")[0]
    for case, result in results.items():
        assert "error" not in result, f"{case}: {result['error']}\n{result.get('trace', '')}"
        assert isinstance(result["text"], str), (case, result)
        if "first" in result:
            assert any(
                m["role"] == "assistant"
                and (result["first"] in str(m.get("content")) or str(m.get("content")).startswith(folded))
                for m in sent
            ), case
        if "called" in result:
            assert result["called"] == "get_weather", result
            tagged = f"sunny in Paris ({lang}-{client})"
            assert any(m["role"] == "tool" and tagged in str(m.get("content")) for m in sent), case


def conversation_of(stack: Stack, tokens: int) -> list[dict]:
    """A conversation whose messages render to `tokens` tokens or a few more on the engine's own
    template (its /tokenize on the base model, without the proxy's identity prompt)."""

    def count(messages: list[dict]) -> int:
        body = {"model": "tiny-mol-base", "messages": messages, "add_generation_prompt": True}
        return httpx.post(stack.engine + "/tokenize", json=body, timeout=60).json()["count"]

    turns: list[dict] = []
    while True:
        turns += [
            {"role": "user", "content": f"Tell me about city number {len(turns)} and its old harbour."},
            {"role": "assistant", "content": "It has a harbour, a market and a long history of trade. " * 4},
        ]
        messages = [*turns, {"role": "user", "content": "Which of them is the oldest?"}]
        n = count(messages)
        if n >= tokens:
            return messages


def test_the_six_everyday_requests_answer_200_on_every_engine_version(stack):
    """Issue 38's six requests, through the proxy on the tiny profile's 2048-token window: a plain
    chat and its follow-up; a ~1,850-token conversation with the client's max_tokens 200 (vLLM 0.24
    refuses prompt + max_tokens over the window, 0.32 cuts it); the same with ignore_eos (the
    proxy adds its proxy.max_output_tokens): the answer fills the window and ends with "length";
    a history tool call whose arguments are malformed JSON (0.24 json.loads them). The openai SDK
    raises on anything but a 200."""
    first = stack.client.chat.completions.create(model=PUBLIC, messages=HI, max_tokens=ANSWER_TOKENS)
    follow = [*HI, {"role": "assistant", "content": first.choices[0].message.content}]
    follow.append({"role": "user", "content": "And then?"})
    assert stack.client.chat.completions.create(model=PUBLIC, messages=follow, max_tokens=ANSWER_TOKENS).choices

    long = conversation_of(stack, 1850)
    reply = stack.client.chat.completions.create(model=PUBLIC, messages=long, max_tokens=200)
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= WINDOW
    forced = stack.client.chat.completions.create(model=PUBLIC, messages=long, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length"
    assert forced.usage.prompt_tokens + forced.usage.completion_tokens == WINDOW, forced.usage

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}
    broken = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]
    before = len(stack.requests())
    reply = stack.client.chat.completions.create(
        model=PUBLIC, messages=broken, tools=WEATHER, tool_choice="none", max_tokens=ANSWER_TOKENS
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    (answer,) = [h for h in settled_hops(stack, before) if h["hop"] == "answer"]
    (sent,) = [m for m in answer["body"]["messages"] if m.get("tool_calls")]
    assert sent["tool_calls"][0]["function"]["arguments"] == "{}"  # as vLLM 0.32 reads it, on every release


def test_an_empty_answer_is_an_empty_string_on_every_engine_version(stack):
    """An answer that ends at once (its first token the end of turn) is content "" for the client,
    streamed or not: vLLM 0.24 sends "", 0.32 null (a JS client's `.content` was null when the
    random model wrote nothing)."""
    eos = httpx.post(stack.engine + "/tokenize", json={"model": "L2", "prompt": "<|im_end|>"}).json()["tokens"][-1]
    ends = {"logit_bias": {str(eos): 100}, "max_tokens": 8}
    engine = httpx.post(stack.engine + "/v1/chat/completions", json={"model": "L2", "messages": HI, **ends}).json()
    assert engine["choices"][0]["message"]["content"] == (None if stack.version == VLLM_CURRENT else "")
    reply = stack.client.chat.completions.create(model=PUBLIC, messages=HI, **ends)
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "stop"
    chunks = list(stack.client.chat.completions.create(model=PUBLIC, messages=HI, stream=True, **ends))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[0].choices[0].delta.content == ""


def test_status_shows_ready(stack):
    r = stack.molctl("status", "tiny", "--json")
    assert r.returncode == ExitStatus.OK, r.stderr
    (s,) = json.loads(r.stdout)["stacks"]
    assert s["state"] == "ready" and s["endpoint"] == stack.endpoint
    assert {c["name"]: c["health"] for c in s["components"]} == {"engine": 200, "proxy": 200}


@pytest.mark.engines(f"vllm-{VLLM_CURRENT}")  # the dashboard graphs the current release's series
def test_top_and_the_dashboards_engine_series_read_the_real_stack(stack):
    """The real vLLM's usage (cached tokens included, streams too) reaches the proxy's per-adapter
    token counters and `molctl top --json`; every vLLM series the Grafana dashboard graphs exists
    on the real engine. One long conversation sent five times: whichever adapters the router picks,
    one answers it twice (four adapters), the second time from its prefix cache."""
    from prometheus_client.parser import text_string_to_metric_families

    trip = " ".join(f"On day {i} we visit temple {i}, eat dinner {i} and walk trail {i}." for i in range(25))
    convo = [{"role": "user", "content": f"Plan a trip to Kyoto: {trip}"}]
    for i in range(5):
        if i % 2:
            for _ in stack.client.chat.completions.create(
                model=PUBLIC, messages=convo, max_tokens=ANSWER_TOKENS, stream=True
            ):
                pass
        else:
            stack.client.chat.completions.create(model=PUBLIC, messages=convo, max_tokens=ANSWER_TOKENS)
    for _ in range(10):  # a scrape past top's own deadline (a loaded machine) shows no metrics: again
        r = stack.molctl("top", "tiny", "--json")
        assert r.returncode == ExitStatus.OK, r.stderr
        top = json.loads(r.stdout)
        if top["metrics"] is not None:
            break
        time.sleep(1)
    assert top["state"] == "ready" and top["engine_phase"] == "serving"
    m = top["metrics"]
    assert m["hops"]["answer"]["count"] >= 5 and m["ttft"]["count"] >= 2
    assert any(ratio for ratio in m["cache_hit_ratio"].values()), m["cache_hit_ratio"]
    dashboard = (ROOT / "docs" / "grafana" / "molctl-proxy.json").read_text()
    graphed = set(re.findall(r"vllm:[a-z_]+", dashboard))
    exported = {
        s.name for f in text_string_to_metric_families(httpx.get(stack.engine + "/metrics").text) for s in f.samples
    }
    assert graphed and graphed <= exported, graphed - exported


def test_the_demo_passes_the_adapter_efficacy_canary(stack):
    """`up` ran the canary (base and L0-L3 on /v1/completions, greedy, top-5 logprobs) before the
    proxy started: every adapter changes the real engine's output; status and the engine log say
    so; `check --live` runs it again against the running stack."""
    canary = stack.up_result["canary"]
    assert canary["status"] == "pass" and canary["no_effect"] == [] and canary["identical"] == [], canary
    assert all(a["effect"] for a in canary["adapters"].values()) and len(canary["adapters"]) == 4
    assert stack.up_result["timings"]["canary_s"] < 60
    (s,) = json.loads(stack.molctl("status", "tiny", "--json").stdout)["stacks"]
    assert s["canary"]["status"] == "pass"
    assert "molctl: adapter efficacy canary pass" in stack.engine_log()
    r = stack.molctl(
        "check",
        "tiny",
        "--live",
        "--model-root",
        str(stack.model),
        "--skip",
        "port",
        "--json",
        "--set",
        f"engine.port={stack.engine_port}",
        "--set",
        f"proxy.port={stack.proxy_port}",
    )
    checks = {c["id"]: c["status"] for c in json.loads(r.stdout)["checks"]}
    assert [checks[f"adapter-effect.{x}"] for x in ("running", "L0", "L1", "L2", "L3", "distinct")] == ["pass"] * 6, (
        checks
    )


@pytest.mark.engines(f"vllm-{VLLM_CURRENT}")  # the benchmark's numbers are the current release's
def test_bench_runs_every_series_against_the_real_engine(stack):
    """`molctl bench tiny` briefly (2 requests per series): the report's shape and samples in every
    series; no speed is asserted."""
    r = stack.molctl(
        "bench",
        "tiny",
        "--requests",
        "2",
        "--concurrency",
        "1",
        "--max-tokens",
        "4",
        "--api-key-file",
        str(stack.key),
        "--json",
        timeout=300,
    )
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert [c["series"] for c in s["results"]] == ["base", "L0", "L1", "L2", "L3", "mix", "proxy", "canary"]
    canary = s["results"].pop()  # the adapter efficacy canary, once: base and L0-L3
    assert canary["requests"] == canary["ok"] == 5 and canary["canary"]["status"] == "pass", canary
    for c in s["results"]:
        assert c["requests"] == 2 and c["ok"] == 2, c
        assert c["total_s"]["p50"] is not None and c["vs_base"]["total_p50"] is not None
        assert c["engine_metrics"]["available"] and "prefix_cache_queries" in c["engine_metrics"]["deltas"], c
    assert s["engine"]["base_model"] == "tiny-mol-base"
    run = Path(s["run_dir"])
    assert (run / "summary.json").is_file() and len((run / "samples.jsonl").read_text().splitlines()) == 14 + 5


# ------------------------------------------------------------- the fake engine against the real one

WINDOW = load_profile("tiny", profile_dirs()).engine.args["max-model-len"]
HI = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "word " * 3000}]  # past the window (vLLM counts ~2 tokens a word here)
FITS = [{"role": "user", "content": "word " * 1000}]  # fits (2019 tokens for vLLM, ~1004 for the fake)
# (name, request body): what the proxy's contract tests ask of the strict fake; a prompt of exactly
# the window ("max_tokens must be at least 1, got 0.") is left out: the fake only estimates tokens
CONFORMANCE = [
    ("window", {"messages": LONG, "max_tokens": 4}),
    ("window-no-limit-stream", {"messages": LONG, "stream": True}),
    ("limit-clamped-to-the-room-left", {"messages": FITS, "max_tokens": 2000}),
    ("limit-over-the-window", {"messages": HI, "max_tokens": 5000}),
    ("completion-limit-over-the-window", {"messages": HI, "max_completion_tokens": 3000}),
    ("limit-zero", {"messages": HI, "max_tokens": 0}),
    ("developer-role", {"messages": [{"role": "developer", "content": "d"}, *HI], "max_tokens": 2}),
    ("late-system", {"messages": [*HI, {"role": "system", "content": "late"}, *HI], "max_tokens": 2}),
    ("no-user", {"messages": [{"role": "system", "content": "s"}], "max_tokens": 2}),
    ("no-messages", {"messages": [], "max_tokens": 2}),
    ("unknown-model", {"model": "L9", "messages": HI, "max_tokens": 2}),
    ("required-without-tools", {"messages": HI, "tool_choice": "required", "max_tokens": 2}),
    ("auto-without-tools", {"messages": HI, "tool_choice": "auto", "max_tokens": 2}),
    ("empty-tools", {"messages": HI, "tools": [], "max_tokens": 2}),
    ("top-logprobs-without-logprobs", {"messages": HI, "top_logprobs": 2, "max_tokens": 2}),
    (
        "limit-over-the-window-before-the-template",
        {"messages": [{"role": "developer", "content": "d"}, *HI], "max_tokens": 5000},
    ),
    ("tool-choice-before-the-model", {"model": "L9", "messages": HI, "tool_choice": "required"}),
]


@pytest.fixture(scope="module")
def strict_fake(stack):
    """The proxy tests' fake engine in strict mode with the tiny window (started after `stack`, so
    it runs beside the real engine, never before it)."""
    port = free_port()
    with running(fake_engine_argv(port, {"strict": True, "max_model_len": WINDOW}), f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


def send(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"model": "L1", **body}, timeout=60)


def error_view(r: httpx.Response) -> dict:
    """What the proxy reads of an engine answer (molctl/proxy/errors.py from_engine, _client_param)."""
    if r.status_code == 200:
        return {"status": 200}
    err = r.json()["error"]
    message = err["message"]
    return {
        "status": r.status_code,
        "keys": sorted(err),
        "type": err["type"],
        "code": err["code"],
        "param": err["param"],
        "context": any(m in message.lower() for m in CONTEXT_MARKERS),
        # the template's own wording differs (molctl's demo template names the role); the rest is vLLM's
        "message": "Unexpected message role" if message.startswith("Unexpected message role") else message,
    }


@pytest.mark.engines(f"vllm-{VLLM_CURRENT}")  # the strict fake engine scripts vLLM 0.32
def test_strict_fake_engine_agrees_with_vllm(stack, strict_fake):
    """Each request the proxy's tests send the strict fake engine, sent to the real vLLM 0.32 too:
    the same status, error body shape, type, code and param, the same message (the context-length
    marker the proxy matches included), and the same order of checks."""
    differ = {}
    for name, body in CONFORMANCE:
        real, fake = error_view(send(stack.engine, body)), error_view(send(strict_fake, body))
        if real != fake:
            differ[name] = {"vllm": real, "fake": fake}
    assert not differ, json.dumps(differ, indent=1)


def sse(r: httpx.Response) -> list:
    frames = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def stream_shape(frames: list) -> list:
    """Per frame: its kind (role / content / finish / usage / [DONE]) and the keys the proxy may read."""
    shape = []
    for f in frames:
        if f == "[DONE]":
            shape.append(("[DONE]",))
        elif not f["choices"]:
            shape.append(("usage", sorted(f), sorted(f["usage"]), sorted(f["usage"]["prompt_tokens_details"])))
        else:
            (c,) = f["choices"]
            kind = "role" if "role" in c["delta"] else "finish" if c["finish_reason"] else "content"
            lp = c["logprobs"] and sorted(c["logprobs"]["content"][0])
            # a content chunk's delta may be empty (a token that ends inside a UTF-8 character is
            # held back by vLLM's detokenizer, its logprobs still sent): its keys are not compared
            shape.append((kind, sorted(f), sorted(c), None if kind == "content" else sorted(c["delta"]), lp))
    # content chunks are as many as the tokens: one of each run is kept
    return [s for i, s in enumerate(shape) if i == 0 or s != shape[i - 1]]


@pytest.mark.engines(f"vllm-{VLLM_CURRENT}")  # the strict fake engine scripts vLLM 0.32
def test_fake_engine_streams_and_bodies_are_shaped_as_vllms(stack, strict_fake):
    """A short answer ended by the EOS token (finish "stop"; the real engine is pushed to it once
    min_tokens allows), streamed with usage and with logprobs, and not streamed: the same chunk sequence
    (role chunk first, content chunks, the finish reason on an empty delta with the EOS token's
    logprobs, the usage chunk with no choices, [DONE]) and the same fields; /v1/models' cards too."""
    httpx.post(strict_fake + "/_config", json={"answer_logprobs": True}).raise_for_status()
    eos = {"min_tokens": 2, "logit_bias": {"4": 100}}  # the tiny tokenizer's <|im_end|> is token 4
    shapes = {}
    for name, body in [
        ("usage", {"stream": True, "stream_options": {"include_usage": True}}),
        ("logprobs", {"stream": True, "logprobs": True}),
    ]:
        for who, base in (("vllm", stack.engine), ("fake", strict_fake)):
            r = send(base, {"messages": HI, "max_tokens": 4, **eos, **body})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
            frames = sse(r)
            shapes[name, who] = stream_shape(frames)
            if name == "logprobs":
                assert frames[-2]["choices"][0]["logprobs"]["content"][0]["token"] == "<|im_end|>", frames[-2]
                assert frames[-2]["choices"][0]["finish_reason"] == "stop"
        # how many content chunks come depends on the random model's tokens: vLLM sends none for a
        # token that ends inside a UTF-8 character when there are no logprobs to send (a clean
        # clone's CI saw role, finish, usage, [DONE]); the rest of the sequence and the content
        # chunks' keys, where both sent one, must agree
        # and text vLLM held back (a token ending inside a UTF-8 character) comes in the finish
        # chunk's delta when the EOS token completes it: its delta may carry `content` (seen in a
        # `make test` run), the fake's never does
        real, fake = shapes[name, "vllm"], shapes[name, "fake"]

        def without_content(shape):
            return [
                x[:3] + ([k for k in x[3] if k != "content"],) + x[4:] if x[0] == "finish" else x
                for x in shape
                if x[0] != "content"
            ]

        assert without_content(real) == without_content(fake), (name, real, fake)
        real_content, fake_content = ({repr(x) for x in shape if x[0] == "content"} for shape in (real, fake))
        assert not (real_content and fake_content) or real_content == fake_content, (name, real, fake)
    assert [x[0] for x in shapes["usage", "vllm"] if x[0] != "content"] == ["role", "finish", "usage", "[DONE]"]

    def body_keys(base):
        b = send(base, {"messages": HI, "max_tokens": 2, **eos}).json()
        (c,) = b["choices"]
        return (
            sorted(b),
            sorted(c),
            sorted(c["message"]),
            sorted(b["usage"]),
            sorted(b["usage"]["prompt_tokens_details"]),
        )

    assert body_keys(stack.engine) == body_keys(strict_fake)

    def card_keys(base):
        cards = httpx.get(base + "/v1/models").json()["data"]
        return (
            sorted(cards[0]),
            sorted(cards[0]["permission"][0]),
            cards[0]["parent"],
            cards[-1]["parent"],
            cards[-1]["max_model_len"],
            cards[0]["max_model_len"],
        )

    assert card_keys(stack.engine) == card_keys(strict_fake)


@pytest.mark.engines(f"vllm-{VLLM_CURRENT}")  # the strict fake engine scripts vLLM 0.32
def test_fake_engine_reports_token_ids_as_vllm(stack, strict_fake):
    """The fake's `token_ids` mode (tests/proxy/pipeline/test_hop_summary.py) against vLLM 0.32's
    `return_token_ids`: the prompt's ids on the body (streamed: on the role chunk), the generated
    ids on the choice (streamed: per chunk), the EOS the answer stopped on included, with
    `stop_reason` null; and /tokenize answering `tokens`."""
    from tests.fake_engine import IM_END

    httpx.post(strict_fake + "/_config", json={"token_ids": True}).raise_for_status()
    eos = {"min_tokens": 2, "logit_bias": {"4": 100}, "return_token_ids": True}  # the tiny tokenizer's <|im_end|> is 4
    try:
        for who, base, eos_id in (("vllm", stack.engine, 4), ("fake", strict_fake, IM_END)):
            b = send(base, {"messages": HI, "max_tokens": 4, **eos}).json()
            (c,) = b["choices"]
            assert isinstance(b["prompt_token_ids"], list) and c["token_ids"][-1] == eos_id, (who, b)
            assert c["finish_reason"] == "stop" and c["stop_reason"] is None, (who, c)
            frames = [
                f for f in sse(send(base, {"messages": HI, "max_tokens": 4, "stream": True, **eos})) if f != "[DONE]"
            ]
            assert isinstance(frames[0]["prompt_token_ids"], list), (who, frames[0])
            ids = [t for f in frames[1:] for ch in f["choices"] for t in ch.get("token_ids") or ()]
            assert ids[-1] == eos_id and frames[-1]["choices"][0]["finish_reason"] == "stop", (who, frames)
            tokens = httpx.post(
                base + "/tokenize", json={"model": "L1", "messages": HI, "add_generation_prompt": True}
            ).json()
            assert isinstance(tokens["tokens"], list) and tokens["count"] == len(tokens["tokens"]), (who, tokens)
    finally:
        httpx.post(strict_fake + "/_config", json={"token_ids": False}).raise_for_status()


def test_up_after_sigkill_of_the_api_server(stack):
    record = read_records(stack.state, "tiny")["engine"]
    old = {p.pid for p in stack.stack_processes()}
    workers = {p.pid for p in psutil.Process(record.pid).children(recursive=True)}
    assert workers, "vLLM runs EngineCore/worker processes beside its API server"
    os.kill(record.pid, signal.SIGKILL)
    time.sleep(1.0)
    r = stack.up()
    assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
    for pid in old:
        assert not alive(pid)
    reply = stack.client.chat.completions.create(
        model=PUBLIC, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content is not None


def test_down_leaves_no_process_and_frees_the_ports(stack):
    procs = stack.stack_processes()
    names = " ".join(p.name() for p in procs)
    assert len(procs) >= 3, names  # API server, EngineCore, worker(s) and the proxy
    r = stack.molctl("down", "--drain-timeout", "30")
    assert r.returncode == ExitStatus.OK, r.stderr
    deadline = time.monotonic() + 10
    # is_alive: one guarded check (is_running() then status() raised NoSuchProcess when the zombie was
    # reaped between the two), keeping psutil's pid-reuse check
    while time.monotonic() < deadline and any(is_alive(p) for p in procs):
        time.sleep(0.1)
    survivors = [p.pid for p in procs if is_alive(p)]
    assert not survivors, survivors
    probe = PortProbe()
    assert probe.is_free("127.0.0.1", stack.engine_port) and probe.is_free("127.0.0.1", stack.proxy_port)
    assert read_records(stack.state, "tiny") == {}


def test_up_fails_with_exit_7_on_adapters_with_no_effect_and_leaves_no_process(tmp_path_factory):
    """One more real vLLM start (last in the module: after its stack is down): the demo with L1's lora_B all
    zero and L3 on o_proj only, served with --lora-target-modules q_proj v_proj (vllm#55193: L3
    loads, is listed, answers 200, and changes nothing). `up` exits 7 naming both, before any
    proxy starts, and leaves no process and no record."""
    from molctl.processes import marked_by_path

    s = Stack(tmp_path_factory.mktemp("e2e-no-effect"))
    r = s.molctl("demo", "init", str(s.model), "--no-effect", "L1=zero-b", "--no-effect", "L3=off-target", "--json")
    assert r.returncode == ExitStatus.OK and json.loads(r.stdout)["no_effect"] == {"L1": "zero-b", "L3": "off-target"}
    try:
        r = s.up("--set", "engine.args.lora-target-modules=[q_proj, v_proj]", debug=False)
        assert r.returncode == ExitStatus.ADAPTERS, r.stdout + r.stderr
        error = json.loads(r.stdout)["error"]
        assert "adapter L1 has no effect" in error and "adapter L3 has no effect" in error, error
        assert "adapter L0" not in error and "adapter L2" not in error, error
        assert "it was stopped" in error and "\n" not in error
        assert read_records(s.state, "tiny") == {}
        assert marked_by_path(s.state) == []
        assert not list((s.state / "tiny" / "logs").glob("proxy-*"))  # no proxy was ever started
        log = next((s.state / "tiny" / "logs").glob("engine-*")).read_text(errors="replace")
        assert "molctl: adapter efficacy canary fail" in log
        probe = PortProbe()
        assert probe.is_free("127.0.0.1", s.engine_port) and probe.is_free("127.0.0.1", s.proxy_port)
    finally:
        s.molctl("down", "--stop-timeout", "20", "--force")
        left = [f"{p.pid} {p.name()}" for p, _ in marked_by_path(s.state)]
        for p, _ in marked_by_path(s.state):
            p.kill()
        assert not left, left
