"""Every shape /v1/responses emits validates against OpenAI's published schema (issue 42): the Response
object (plain, with reasoning, with a function call, incomplete, every tool kind echoed), each
streamed event type, an input_items page, the delete result and the error body. The schemas are
openai-openapi's own (tests/data/openai_responses_schemas.json names the commit), validated with
`jsonschema`; the proxy runs in-process on the scripted fake engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from molctl.engines import get_engine
from molctl.proxy.apis.responses import events
from molctl.proxy.apis.responses.convert import new_id
from molctl.proxy.apis.responses.protocol import parse_request
from molctl.proxy.errors import ProxyError
from molctl.proxy.http.app import ProxyApp
from molctl.proxy.store.memory import MemoryResponseStore
from tests.asgi import asgi_call
from tests.helpers import free_port
from tests.procs import fake_engine_argv, running
from tests.proxy_stack import PUBLIC, TINY
from tests.response_schemas import check

FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
HOSTED = [
    {"type": "web_search", "search_context_size": "low", "typo_key": 1},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "local_shell"},
    {"type": "mcp", "server_label": "x", "server_url": "https://mcp.example.com"},
    {"type": "custom", "name": "apply_patch"},
    {"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "lookup", "unknown": True}]},
]


def sse_events(body: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def shapes():
    """name -> (status, body) of each request, from the proxy app in-process on the fake engine."""
    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    with running(fake_engine_argv(port), engine + "/health"):
        app = ProxyApp(TINY, get_engine("vllm"), engine, None, response_store=MemoryResponseStore())

        def config(**cfg):
            httpx.post(engine + "/_config", json=cfg).raise_for_status()

        async def call(method, path, body=None):
            status, _, raw = await asgi_call(app, method, path, body)
            return status, raw

        async def run():
            await app.startup()
            out = {}
            base = {"model": PUBLIC, "input": "[route:L2] hi"}
            try:
                out["plain"] = await call("POST", "/v1/responses", base)
                out["tools"] = await call("POST", "/v1/responses", {**base, "tools": [FN, *HOSTED]})
                out["call"] = await call("POST", "/v1/responses", {**base, "input": "[route:L2] [tool]", "tools": [FN]})
                out["stream_call"] = await call(
                    "POST", "/v1/responses", {**base, "input": "[route:L2] [tool]", "tools": [FN], "stream": True}
                )
                config(answer_reasoning="thinking it over")
                out["reasoning"] = await call(
                    "POST", "/v1/responses", {**base, "include": ["reasoning.encrypted_content"]}
                )
                out["stream"] = await call("POST", "/v1/responses", {**base, "stream": True})
                config(answer_reasoning=None, answer_finish="length")
                out["incomplete"] = await call("POST", "/v1/responses", {**base, "stream": True})
                config(answer_finish=None, stream_error_after=1, answer_words=4)
                out["failed"] = await call("POST", "/v1/responses", {**base, "stream": True})
                config(stream_error_after=None)
                rid = json.loads(out["plain"][1])["id"]
                out["get"] = await call("GET", f"/v1/responses/{rid}")
                out["items"] = await call("GET", f"/v1/responses/{rid}/input_items")
                out["delete"] = await call("DELETE", f"/v1/responses/{rid}")
                out["404"] = await call("GET", f"/v1/responses/{rid}")
                out["400"] = await call("POST", "/v1/responses", {**base, "max_output_tokens": 12})
                return out
            finally:
                await app.shutdown()

        return asyncio.run(run())


@pytest.mark.parametrize("name", ["plain", "tools", "call", "reasoning", "get"])
def test_each_response_object_matches_openai_schema(shapes, name):
    status, body = shapes[name]
    assert status == 200, body
    check("Response", json.loads(body), open_responses=name != "tools")


def test_tools_are_echoed_normalized_as_openai_does(shapes):
    tools = json.loads(shapes["tools"][1])["tools"]
    assert tools[0] == {**FN, "description": None, "strict": True}  # strict defaults to true
    assert tools[1] == {"type": "web_search", "search_context_size": "low"}  # an unknown key dropped
    assert tools[-1]["tools"] == [
        {"type": "function", "name": "lookup", "description": None, "parameters": None, "strict": True}
    ]
    assert tools[-1]["description"] == ""


def test_every_streamed_event_matches_openai_schema(shapes):
    seen = set()
    for name in ("stream", "stream_call", "incomplete", "failed"):
        status, body = shapes[name]
        assert status == 200, body
        stream = sse_events(body)
        assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
        for event in stream:
            check("ResponseStreamEvent", event)
            seen.add(event["type"])
    # each kind of event the translator makes (the error event: test_error_event_matches_openai_schema)
    assert seen >= {
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }, seen


def test_error_event_matches_openai_schema():
    req = parse_request({"model": PUBLIC, "input": "hi", "stream": True}, PUBLIC)
    tr = events.StreamTranslator(req, new_id("resp_"))
    exc = ProxyError(503, "engine gone", "server_error", "engine_unavailable")
    event = events.error_event(tr, exc, None)
    check("ResponseStreamEvent", event)
    assert event["type"] == "error" and event["code"] == "engine_unavailable"
    assert event["error"] == {
        "type": "server_error",
        "code": "engine_unavailable",
        "message": "engine gone",
        "param": None,
    }
    with pytest.raises((AssertionError, ValueError)):  # the check can fail: an error event without its message
        check("ResponseStreamEvent", {k: v for k, v in event.items() if k != "message"})


def test_input_items_page_and_error_bodies_match_openai_schema(shapes):
    status, body = shapes["items"]
    assert status == 200
    check("ResponseItemList", json.loads(body))
    for name in ("404", "400"):
        status, body = shapes[name]
        assert status == int(name)
        check("ErrorResponse", json.loads(body))
    assert json.loads(shapes["400"][1])["error"]["code"] == "integer_below_min_value"


def test_delete_result_is_openai_s_example_shape(shapes):
    """The spec gives the delete's 200 no schema, only an example: {"id", "object", "deleted"}."""
    status, body = shapes["delete"]
    assert status == 200
    out = json.loads(body)
    assert set(out) == {"id", "object", "deleted"} and out["deleted"] is True and out["id"].startswith("resp_")
