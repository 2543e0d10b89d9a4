"""The Open Responses compliance cases, over HTTP against the proxy on the scripted engine (strict).

Ported from openresponses/openresponses `src/lib/compliance-tests.ts` (the cases `bin/compliance-test.ts`
runs; that runner needs bun and the repository's generated zod schemas, neither to be had offline
here): each case's request as that file sends it (POST {base}/responses, `stream` set per case,
Bearer auth), the answer parsed as Open Responses' ResponseResource (its OpenAPI 2026-04-24, as the
pydantic models of openresponses-types), each stream event as its streaming-event model (what the
suite's SSE parser checks), the final response of a stream taken from its terminal event, then
the case's own checks (output present, status completed, function_call items and events).

The cases of both of that file's versions are here (the newer adds `function-call-roundtrip` and
`previous-response-id`, two requests each); left out: `file-input` (a PDF as `input_file`: not a
text-only model's case; the proxy refuses file parts, a 400 naming them) and the optional
`file-search` / `offline-web-search`, which the suite itself skips unless configured with a vector
store or web search (hosted tools never run here).

One change, for the scripted engine: the tool-calling cases' user text ends with `[tool]`, the fake
engine's directive to answer with a call of the request's tool (a real model decides on its own).
The image case runs on the scripted engine, which takes the image part as vLLM's API does; tiny's
real base is text-only.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib

import httpx
import openresponses_types.types as open_types
import pydantic
import pytest

from tests.proxy_stack import KEY, PUBLIC

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"],
    },
}


def red_png(side: int = 32) -> str:
    """A red square PNG as a data URL (the suite sends a 32x32 icon of its own)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * side for _ in range(side))
    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def user(text) -> dict:
    return {"type": "message", "role": "user", "content": text}


CASES = {
    "basic-response": ({"input": [user("Say hello in exactly 3 words.")]}, False),
    "streaming-response": ({"input": [user("Count from 1 to 5.")]}, True),
    "system-prompt": (
        {
            "input": [
                {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
                user("Say hello."),
            ]
        },
        False,
    ),
    "tool-calling": ({"input": [user("What's the weather like in San Francisco? [tool]")], "tools": [WEATHER]}, False),
    "tool-calling-streaming": (
        {"input": [user("What's the weather like in San Francisco? [tool]")], "tools": [WEATHER]},
        True,
    ),
    "image-input": (
        {
            "input": [
                user(
                    [
                        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
                        {"type": "input_image", "image_url": red_png()},
                    ]
                )
            ]
        },
        False,
    ),
    "multi-turn": (
        {
            "input": [
                user("My name is Alice."),
                {
                    "type": "message",
                    "role": "assistant",
                    "content": "Hello Alice! Nice to meet you. How can I help you today?",
                },
                user("What is my name?"),
            ]
        },
        False,
    ),
}
EVENT_MODELS = {
    next(iter(cls.model_fields["type"].annotation)).value: cls
    for name, cls in vars(open_types).items()
    if name.endswith("StreamingEvent") and isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)
}
TERMINAL = ("response.completed", "response.failed", "response.incomplete")


def run_case(stack, body: dict, streaming: bool) -> tuple[dict, list[dict]]:
    """The case's request as the suite makes it -> (the final response, the stream's events)."""
    r = httpx.post(
        stack.proxy_url + "/v1/responses",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": PUBLIC, **body, "stream": streaming},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    if not streaming:
        return r.json(), []
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    final = next(e["response"] for e in reversed(events) if e["type"] in TERMINAL)
    return final, events


@pytest.mark.parametrize("case", list(CASES))
def test_open_responses_compliance_case(stack, case):
    body, streaming = CASES[case]
    final, events = run_case(stack, body, streaming)
    response = open_types.ResponseResource.model_validate(final)  # the suite's schema check
    if streaming:
        assert events, "No streaming events received"
        for event in events:
            EVENT_MODELS[event["type"]].model_validate(event)
    if case.startswith("tool-calling"):
        assert any(item.type == "function_call" for item in response.output)
    else:
        assert response.output and response.status == "completed", final
    if case == "tool-calling-streaming":
        kinds = [e["type"] for e in events]
        added = [e for e in events if e["type"] == "response.output_item.added"]
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert any(e["item"]["type"] == "function_call" for e in added)
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        assert any(e["item"]["type"] == "function_call" for e in done)


def two_turns(stack, first: dict, second) -> tuple[dict, dict]:
    """Two requests, the second built from the first's response (`second(response)`), each parsed as the suite does."""
    one, _ = run_case(stack, first, False)
    open_types.ResponseResource.model_validate(one)
    two, _ = run_case(stack, second(one), False)
    return one, two


def test_open_responses_previous_response_id_case(stack):
    first = {"input": "Remember this code word: papaya. Reply with only OK."}
    one, two = two_turns(
        stack, first, lambda r: {"previous_response_id": r["id"], "input": "What code word did I ask you to remember?"}
    )
    response = open_types.ResponseResource.model_validate(two)
    assert response.output and response.status == "completed" and two["previous_response_id"] == one["id"]


def test_open_responses_function_call_roundtrip_case(stack):
    first = {
        "input": "Use the weather tool to get the temperature in San Francisco. [tool]",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }

    def answer(response: dict) -> dict:
        call = next((i for i in response["output"] if i["type"] == "function_call"), None)
        assert call is not None and call.get("call_id"), "First response did not include a function_call with call_id"
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "64 degrees and clear"}
        return {"previous_response_id": response["id"], "input": [output]}

    _, two = two_turns(stack, first, answer)
    response = open_types.ResponseResource.model_validate(two)
    assert response.output and response.status == "completed", two
