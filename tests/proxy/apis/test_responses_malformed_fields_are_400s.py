"""Malformed Responses input items, and wrong-typed fields accepted for OpenAI compatibility, are
400s naming the field, never 500s or silently taken (issue 42): a list or an
object as an item's `type`, or an `item_reference` whose `id` is a list, reached set and dict
lookups and answered 500 `proxy_error` with a TypeError in the log."""

from __future__ import annotations

import asyncio
import json

import pytest

from molctl.engines import get_engine
from molctl.proxy.http.app import ProxyApp
from molctl.proxy.store.memory import MemoryResponseStore
from tests.asgi import asgi_call
from tests.helpers import free_port
from tests.procs import fake_engine_argv, running
from tests.proxy_stack import PUBLIC, TINY

CASES = [
    ([{"type": [1, 2, 3], "role": "user", "content": "hi"}], "input[0].type"),
    ([{"type": {"a": 1}, "role": "user", "content": "hi"}], "input[0].type"),
    ([{"type": "item_reference", "id": ["x"]}, {"role": "user", "content": "hi"}], "input[0].id"),
    ([{"id": [1]}, {"role": "user", "content": "hi"}], "input[0].id"),
]


@pytest.fixture(scope="module")
def answers():
    """Each case's (status, body) from the proxy app in-process on the fake engine, and a valid
    request's status after them."""
    port = free_port()
    with running(fake_engine_argv(port), f"http://127.0.0.1:{port}/health"):
        app = ProxyApp(TINY, get_engine("vllm"), f"http://127.0.0.1:{port}", None, response_store=MemoryResponseStore())

        async def run():
            await app.startup()
            try:
                out = []
                for items, _ in CASES:
                    status, _, body = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": items})
                    out.append((status, json.loads(body)))
                valid = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "hi"})
                return out, valid[0], app.counters.values.get("internal_errors_total", 0)
            finally:
                await app.shutdown()

        return asyncio.run(run())


@pytest.mark.parametrize("index", range(len(CASES)), ids=[param for _, param in CASES])
def test_a_malformed_item_is_a_400_naming_its_field(answers, index):
    """Guards the 500 a non-string item type or a list reference id made."""
    status, body = answers[0][index]
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == CASES[index][1]


def test_the_proxy_serves_on_and_counts_no_internal_error(answers):
    _, valid_status, internal_errors = answers
    assert valid_status == 200 and internal_errors == 0


@pytest.mark.parametrize(
    "field, value",
    [("service_tier", "gold"), ("service_tier", 3), ("stream_options", []), ("max_tool_calls", "2")],
    ids=str,
)
def test_a_wrong_typed_accepted_field_is_a_400_naming_it(field, value):
    """Guards the accepted-but-unused fields that took any value unchecked (issue 42)."""
    from molctl.proxy.apis.responses.protocol import parse_request
    from molctl.proxy.errors import ProxyError

    with pytest.raises(ProxyError) as err:
        parse_request({"model": PUBLIC, "input": "hi", field: value}, PUBLIC)
    assert err.value.status == 400 and err.value.param == field


def test_the_accepted_fields_take_openai_values():
    from molctl.proxy.apis.responses.protocol import parse_request

    body = {"service_tier": "flex", "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3}
    assert parse_request({"model": PUBLIC, "input": "hi", **body}, PUBLIC).messages[-1]["content"] == "hi"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": {"format": {"type": "json_schema", "name": "", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x", "detail": 1}]}]},
            "input[0].content[0].detail",
        ),
    ],
    ids=str,
)
def test_a_schema_name_or_image_detail_openai_refuses_is_a_400(body, param):
    """Guards an empty schema name and an unknown image detail, which were forwarded or dropped."""
    from molctl.proxy.apis.responses.protocol import parse_request
    from molctl.proxy.errors import ProxyError

    with pytest.raises(ProxyError) as err:
        parse_request({"model": PUBLIC, "input": "hi", **body}, PUBLIC)
    assert err.value.status == 400 and err.value.param == param
