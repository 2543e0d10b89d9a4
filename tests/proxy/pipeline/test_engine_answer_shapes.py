"""Engine answers the proxy cannot use: a 200 whose choices are missing, empty or of the wrong
shape, on each hop (route, answer, summary) and for both APIs, and a stream choice with another
index. The proxy's ASGI app runs in-process against a small engine that answers each hop
(X-MoL-Hop) with a given body."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from molctl.engines import get_engine
from tests.proxy_stack import PUBLIC, TINY

GOOD_HOP = {
    "route": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "L2"}, "finish_reason": "stop"}]},
    "answer": {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]
    },
    "summary": {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a summary"}, "finish_reason": "stop"}]
    },
}


async def hop_engine(bodies: dict[str, bytes]):
    """An engine that answers each hop (X-MoL-Hop) with `bodies[hop]` (a 200 JSON body; a stream
    answer when it starts with b"data:"), or a well-formed answer for the hops not given. `server.handlers`:
    its connections' tasks, which end once the client closed them."""
    handlers: list[asyncio.Task] = []

    async def handle(reader, writer):
        handlers.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
                await reader.readexactly(int(fields[b"Content-Length"]))
                hop = fields[b"X-MoL-Hop"].decode()
                body = bodies.get(hop) or json.dumps(GOOD_HOP[hop]).encode()
                kind = b"text/event-stream" if body.startswith(b"data:") else b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (kind, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    server.handlers = handlers
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def asgi_post(app, path: str, body: dict) -> tuple[int, bytes]:
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


BAD_COMPLETIONS = [
    b'{"choices": [null]}',
    b'{"choices": "L2"}',
    b'{"choices": [{"message": "L2"}]}',
    b'{"choices": []}',
    b'{"choices": [{"message": {"role": "assistant", "content": ["L2"]}}]}',
]


@pytest.mark.parametrize("bad", BAD_COMPLETIONS)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_200_without_a_usable_choice_on_each_hop(bad, api, caplog):
    """Found injecting engine answers with unexpected shapes, one hop at a time: a 200 whose
    choices were not a list of objects with a message object failed the route hop and the answer
    hop with an AttributeError/KeyError (a 500 proxy_error and a traceback; the route hop must fall
    back) and killed the summary task ("Task exception was never retrieved"; its turn's summary never
    settled); an empty choices list was answered as an empty, complete answer, recorded and
    summarised. Now: route falls back (engine_error), answer is a 502 engine_error (not recorded),
    summary is a counted failure."""
    from molctl.proxy.http.app import ProxyApp

    path = "/v1/chat/completions" if api == "chat" else "/v1/responses"
    body = (
        {"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}]}
        if api == "chat"
        else {"model": PUBLIC, "input": "hi"}
    )

    async def hop(name: str):
        server, url = await hop_engine({name: bad})
        app = ProxyApp(TINY, get_engine("vllm"), url, None)
        await app.startup()
        try:
            status, content = await asgi_post(app, path, body)
            await asyncio.gather(*app.orch.background)  # the summary hop (raised before)
            return status, json.loads(content), app.counters, len(app.orch.store._items)
        finally:
            await app.shutdown()
            server.close()
            await asyncio.gather(*server.handlers)

    with caplog.at_level(logging.WARNING):
        route, answer, summary = (asyncio.run(hop(name)) for name in ("route", "answer", "summary"))
    status, _, counters, _ = route
    assert status == 200 and counters.labelled[("route_fallbacks_total", (("reason", "engine_error"),))] == 1
    status, content, counters, kept = answer
    assert status == 502 and content["error"]["code"] == "engine_error" and kept == 0
    assert counters.values["engine_errors_total"] == 1
    status, _, counters, _ = summary
    assert status == 200 and counters.values["summary_failures_total"] == 1 and counters.values["summaries_total"] == 0
    for counters in (route[2], answer[2], summary[2]):
        assert counters.values["internal_errors_total"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stream_choice_with_another_index_is_not_part_of_the_answer():
    """The proxy asks the engine for one choice; a delta for choice 1 was appended to the answer
    (and to what the client saw as choice 0). Found injecting stream events with unexpected shapes."""
    from molctl.proxy.http.app import ProxyApp

    frames = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "hel"}}, {"index": 1, "delta": {"content": "OTHER"}}]},
        {"choices": [{"index": 1, "delta": {"content": "MORE"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
    ]
    stream = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"

    async def go():
        server, url = await hop_engine({"answer": stream})
        app = ProxyApp(TINY, get_engine("vllm"), url, None)
        await app.startup()
        try:
            status, content = await asgi_post(
                app,
                "/v1/chat/completions",
                {"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            )
            await asyncio.gather(*app.orch.background)
            return status, content, [v for _, (_, v, _) in app.orch.store._items.items()]
        finally:
            await app.shutdown()
            server.close()
            await asyncio.gather(*server.handlers)

    status, content, _ = asyncio.run(go())
    assert status == 200
    text = "".join(
        c["delta"].get("content", "")
        for line in content.split(b"\n\n")
        if line.startswith(b"data: {")
        for c in json.loads(line[6:])["choices"]
    )
    assert text == "hello"


@pytest.mark.parametrize(
    "message,content",
    [
        ({"role": "assistant", "content": None}, ""),  # vLLM 0.32's empty answer
        ({"role": "assistant", "content": ""}, ""),  # vLLM 0.24's
        ({"role": "assistant"}, ""),
        ({"role": "assistant", "content": None, "refusal": "no"}, None),
    ],
)
def test_an_empty_text_answer_is_an_empty_string(message, content):
    """content is null only beside tool calls or a refusal: an empty text answer reaches the
    client as "" whichever way the engine wrote it."""
    from molctl.proxy.http.app import ProxyApp

    answer = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    async def go():
        server, url = await hop_engine({"answer": json.dumps(answer).encode()})
        app = ProxyApp(TINY, get_engine("vllm"), url, None)
        await app.startup()
        try:
            return await asgi_post(
                app, "/v1/chat/completions", {"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}]}
            )
        finally:
            await app.shutdown()
            server.close()
            await asyncio.gather(*server.handlers)

    status, body = asyncio.run(go())
    (choice,) = json.loads(body)["choices"]
    assert status == 200 and choice["message"]["content"] == content and choice["finish_reason"] == "stop"
