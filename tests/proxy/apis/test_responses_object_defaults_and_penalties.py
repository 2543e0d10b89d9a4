"""The Response object carries OpenAI's effective values, and the sampling fields the chat endpoint
forwards reach the engine from /v1/responses too (issue 42): temperature and top_p were null
(OpenAI: 1.0), top_logprobs null (0), completed_at, service_tier, the penalties, max_tool_calls and
text.verbosity absent; the penalties were logged as unknown and dropped; a null metadata value
was refused where OpenAI accepts it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from molctl.engines import get_engine
from molctl.proxy.http.app import ProxyApp
from molctl.proxy.store.memory import MemoryResponseStore
from tests.asgi import asgi_call
from tests.helpers import free_port
from tests.procs import fake_engine_argv, running
from tests.proxy_stack import PUBLIC, TINY


@pytest.fixture(scope="module")
def answers():
    """(plain response, penalised response, the penalised request's answer hop payload, metadata
    response) from the proxy app in-process on the fake engine."""
    port = free_port()
    engine = f"http://127.0.0.1:{port}"
    with running(fake_engine_argv(port), engine + "/health"):
        app = ProxyApp(TINY, get_engine("vllm"), engine, None, response_store=MemoryResponseStore())

        async def run():
            await app.startup()
            try:
                plain = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "[route:L2] hi"})
                httpx.post(engine + "/_reset").raise_for_status()
                penalised = await asgi_call(
                    app,
                    "POST",
                    "/v1/responses",
                    {"model": PUBLIC, "input": "[route:L2] hi", "presence_penalty": 0.5, "frequency_penalty": -0.25},
                )
                log = httpx.get(engine + "/_log").json()
                metadata = await asgi_call(
                    app, "POST", "/v1/responses", {"model": PUBLIC, "input": "[route:L2] hi", "metadata": {"k": None}}
                )
                return plain, penalised, log, metadata
            finally:
                await app.shutdown()

        return asyncio.run(run())


def test_the_response_object_carries_the_effective_sampling_values(answers):
    status, _, body = answers[0]
    assert status == 200, body
    r = json.loads(body)
    assert (r["temperature"], r["top_p"], r["top_logprobs"]) == (1.0, 1.0, 0)
    assert (r["presence_penalty"], r["frequency_penalty"], r["max_tool_calls"]) == (0.0, 0.0, None)
    assert r["service_tier"] == "default" and r["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert r["status"] == "completed" and r["completed_at"] >= r["created_at"]


def test_the_penalties_reach_the_answer_hop_and_are_echoed(answers):
    status, _, body = answers[1]
    assert status == 200, body
    r = json.loads(body)
    assert (r["presence_penalty"], r["frequency_penalty"]) == (0.5, -0.25)
    (answer,) = [e for e in answers[2] if e["hop"] == "answer"]
    assert answer["payload"]["presence_penalty"] == 0.5 and answer["payload"]["frequency_penalty"] == -0.25


def test_a_null_metadata_value_is_accepted_and_echoed(answers):
    status, _, body = answers[3]
    assert status == 200, body
    assert json.loads(body)["metadata"] == {"k": None}
