"""Sample client conversations run through the proxy's own code, to see the exact engine requests
each hop sends: `molctl check`'s template category renders them with the model's chat template,
and tests/proxy/pipeline/test_hop_templates.py renders them with both demo templates.

Nothing here copies a message list by hand: each sample is a client request that goes through
`Orchestrator.prepare`, `route`, `complete` and `start_summary` with a recording engine client
that answers with scripted labels, answers and tool calls, so a change to what the proxy sends
(views, folding, system messages, tools, template kwargs) shows up here by itself.

Shapes (one client situation each; every one yields its route, answer and summary requests where
the proxy sends them):
- first turn; folded turn (another adapter answered the previous turn);
- system and developer instructions (leading), developer instructions only;
- mid-conversation system and developer messages, then that turn folded for another adapter;
- tool call (two parallel calls), tool result (sticky: no route hop), tool turn folded;
- multi-part: system, user and tool content as lists of text parts, a tool call and its result.
Reasoning effort is set on some turns, so profiles with `proxy.reasoning` glm/qwen also send
`chat_template_kwargs.enable_thinking` true and false.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from molctl.profiles import Profile

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a restaurant table.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "people": {"type": "integer"}},
                "required": ["name", "people"],
            },
        },
    },
]


@dataclass(frozen=True)
class HopRequest:
    """One request the proxy sent to the engine."""

    hop: str  # route | answer | summary
    shape: str  # the client situation that produced it
    payload: dict[str, Any]
    conversation: str = ""  # the sample conversation (tenant) the turn belongs to; turns in order


@dataclass
class _Turn:
    shape: str
    messages: list[dict[str, Any]]
    label: str | None  # what the router answers (None: no route hop expected)
    answer: dict[str, Any]
    extra: dict[str, Any]


class _RecordingClient:
    """Stands in for EngineClient: records each request and answers from the current turn's script."""

    def __init__(self) -> None:
        self.sent: list[HopRequest] = []
        self.turn: _Turn | None = None
        self.conversation = ""

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def chat(self, payload: dict[str, Any], hop: str, **_: Any) -> dict[str, Any]:
        turn = self.turn
        assert turn is not None
        self.sent.append(HopRequest(hop, turn.shape, copy.deepcopy(payload), self.conversation))
        if hop == "route":
            message = {"role": "assistant", "content": turn.label or "L0"}
        elif hop == "answer":
            message = copy.deepcopy(turn.answer)
        else:
            message = {"role": "assistant", "content": f"Summary: {turn.shape}; nothing left open."}
        return {
            "id": "chatcmpl-sample",
            "object": "chat.completion",
            "created": 0,
            "model": payload.get("model"),
            "choices": [
                {"index": 0, "message": message, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    async def chat_stream(self, payload: dict[str, Any], hop: str, **kwargs: Any):
        """The same reply as `chat`, as the engine streams it: one delta, then finish and usage."""
        body = await self.chat(payload, hop, **kwargs)
        choice = body["choices"][0]
        delta = {k: v for k, v in choice["message"].items() if v is not None}
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        yield {"id": body["id"], "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        yield {
            "id": body["id"],
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
            "usage": body["usage"],
        }


def _u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _a(text: str | None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _conversations() -> dict[str, list[_Turn]]:
    """tenant -> turns; each turn's messages are what the client resends (history + new message)."""
    instructions, developer_only = _instruction_turns()
    return {
        "sample-chat": _chat_turns(),
        "sample-instructions": instructions,
        "sample-developer": developer_only,
        "sample-tools": _tool_turns(),
        "sample-parts": _multipart_turns(),
    }


def _chat_turns() -> list[_Turn]:
    u1, a1 = (
        _u("Plan a weekend trip to Kyoto for two."),
        _a("Day 1: Fushimi Inari early, then Gion. Day 2: Arashiyama."),
    )
    u2, a2 = (
        _u("Now write a Python function that prints that itinerary."),
        _a("def itinerary():\n    print('Day 1 ...')"),
    )
    s_mid = {"role": "system", "content": "From now on, answer in French."}
    d_mid = {"role": "developer", "content": "Keep answers under 50 words."}
    u3, a3 = _u("Add type hints to it."), _a("def itinerary() -> None: ...")
    u4 = _u("Which hotel should we book near Gion?")
    chat = [
        _Turn("first turn", [u1], "L1", a1, {}),
        _Turn("folded turn", [u1, a1, u2], "L2", a2, {"reasoning_effort": "high"}),
        _Turn("mid-conversation system and developer", [u1, a1, u2, a2, s_mid, d_mid, u3], "L2", a3, {}),
        _Turn(
            "folded turn with mid-conversation system and developer",
            [u1, a1, u2, a2, s_mid, d_mid, u3, a3, u4],
            "L1",
            _a("Try a ryokan near Hanamikoji."),
            {},
        ),
    ]
    return chat


def _instruction_turns() -> tuple[list[_Turn], list[_Turn]]:
    sys_ = {"role": "system", "content": "You are the assistant of Example Corp. Today is Monday."}
    dev = {"role": "developer", "content": "Answer in plain text, no markdown."}
    ui1, ai1 = _u("Who are you?"), _a("I am the Example Corp assistant.")
    instructions = [
        _Turn("system and developer instructions", [sys_, dev, ui1], "L0", ai1, {"reasoning_effort": "none"}),
        _Turn(
            "system and developer instructions, next turn",
            [sys_, dev, ui1, ai1, _u("Build me a signup form.")],
            "L3",
            _a("<form>...</form>"),
            {"reasoning_effort": "medium"},
        ),
    ]
    developer_only = [
        _Turn(
            "developer instructions only",
            [dev, _u("Fix the failing test in utils.py.")],
            "L2",
            _a("The assertion compares str to int; cast first."),
            {},
        )
    ]
    return instructions, developer_only


def _tool_turns() -> list[_Turn]:
    calls = [
        {
            "id": "call_paris",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
        },
        {
            "id": "call_book",
            "type": "function",
            "function": {"name": "book_table", "arguments": '{"name": "Chez Marie", "people": 2}'},
        },
    ]
    ut, at = _u("What is the weather in Paris, and book Chez Marie for two."), _a(None, calls)
    results = [
        {"role": "tool", "tool_call_id": "call_paris", "content": '{"temp": 18, "sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_book", "content": "booked: table 7 at 20:00"},
    ]
    final = _a("It is 18 C and sunny in Paris; Chez Marie is booked for two at 20:00 (table 7).")
    tool_sys = {"role": "system", "content": "Use the tools when they help."}
    tools = [
        _Turn("tool call", [tool_sys, ut], "L1", at, {"tools": TOOLS}),
        _Turn("tool result", [tool_sys, ut, at, *results], None, final, {"tools": TOOLS}),
        _Turn(
            "folded tool turn",
            [tool_sys, ut, at, *results, final, _u("Write a script that checks the weather daily.")],
            "L2",
            _a("import requests ..."),
            {"tools": TOOLS},
        ),
    ]
    return tools


def _multipart_turns() -> list[_Turn]:
    # content as lists of text parts, as agent clients send it: the engine's content format decides
    # whether the template gets a string or the parts (vLLM's --chat-template-content-format)
    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": t} for t in texts]

    p_sys = {"role": "system", "content": parts("You are a coding agent.", "Run tests before you answer.")}
    p_user = {"role": "user", "content": parts("Read config.toml", "and tell me the port.")}
    p_call = _a(
        None,
        [
            {
                "id": "call_read",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "config.toml"}'},
            }
        ],
    )
    p_result = {"role": "tool", "tool_call_id": "call_read", "content": parts("port = 8200", "host = 127.0.0.1")}
    multipart = [
        _Turn("multi-part tool call", [p_sys, p_user], "L2", p_call, {"tools": TOOLS}),
        _Turn(
            "multi-part tool result", [p_sys, p_user, p_call, p_result], None, _a("The port is 8200."), {"tools": TOOLS}
        ),
    ]
    return multipart


async def collect_async(profile: Profile, stream: bool = False) -> list[HopRequest]:
    """Every engine request the proxy sends for the sample conversations, in order (the clients
    streaming or not: the hops' messages are the same either way)."""
    from molctl.engines import get_engine
    from molctl.proxy.pipeline.run import Orchestrator
    from molctl.proxy.store.memory import MemoryStore

    # without the speculative answer: its request is the answer hop's own, byte for byte, so it
    # adds no rendering to check, and a held hop would make the turns' hops depend on timing
    profile = dataclasses.replace(profile, proxy=dataclasses.replace(profile.proxy, speculative_answer=False))
    client = _RecordingClient()
    orch = Orchestrator(profile, get_engine(profile.engine.kind), client, MemoryStore())  # type: ignore[arg-type]
    for tenant, turns in _conversations().items():
        for turn in turns:
            client.turn, client.conversation = turn, tenant
            body = {
                "model": profile.served_model_name,
                "messages": copy.deepcopy(turn.messages),
                **copy.deepcopy(turn.extra),
            }
            if stream:
                body["stream"] = True
            orch.check(body)
            plan = orch.prepare(body, tenant)
            await orch.route(plan)
            if stream:
                async for _ in orch.stream(plan):
                    pass
            else:
                await orch.complete(plan)
            orch.start_summary(plan)
            if plan.record is not None:
                await asyncio.wait_for(plan.record.done.wait(), 10)
    if orch.background:
        await asyncio.gather(*orch.background, return_exceptions=True)
    return client.sent


def collect(profile: Profile) -> list[HopRequest]:
    """Synchronous `collect_async`, on its own event loop (in a worker thread when the caller
    already runs one). The proxy's warnings about the sample run itself (its recorded answers carry
    no token ids, so a summary falls back to a chat request) are not shown: they would read, in
    `molctl check`, as if the engine had answered so."""
    with _proxy_warnings_off():
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(collect_async(profile))
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, collect_async(profile)).result()


@contextlib.contextmanager
def _proxy_warnings_off():
    logger = logging.getLogger("molctl.proxy")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
