"""Request bodies and clients that go away: deeply nested JSON, declared bodies over the limit,
which requests are prepared in a worker thread, clients that leave mid-upload or stop reading, and
a cancelled request's answer ended before its slot is freed (against the strict fake engine, or
the proxy's ASGI app in-process)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import httpx
import pytest

from molctl.engines import get_engine
from molctl.proxy.http.app import Exchange
from tests.proxy_in_process import own_records
from tests.proxy_stack import KEY, PUBLIC, TINY

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_json_nested_just_below_the_parsers_limit_is_a_400_not_a_500(s):
    """A body over BIG_BODY is parsed in a worker thread, whose shallow stack lets the parser accept
    nesting that json.dumps (keys, payload) cannot encode again: that was a plain 500 (and a
    logged traceback). Any depth must be a JSON 400, or what the engine says about it."""
    from molctl.proxy.http.body import BIG_BODY

    pad = "x " * (BIG_BODY // 2 + 1000)
    statuses = {}
    for depth in range(950, 1000, 2):
        nest = "[" * depth + "]" * depth
        raw = (
            '{"model": "'
            + PUBLIC
            + '", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
            + nest
            + '}, {"type": "text", "text": "'
            + pad
            + '"}]}]}'
        ).encode()
        r = httpx.post(
            s.proxy_url + "/v1/chat/completions",
            headers={**AUTH, "content-type": "application/json"},
            content=raw,
            timeout=30,
        )
        statuses[depth] = r.status_code
        assert r.headers["content-type"].startswith("application/json")
    assert 500 not in statuses.values(), statuses


def test_a_write_timeout_on_the_last_frame_is_a_dropped_client_not_an_internal_error(caplog):
    """A client that stops reading just before `data: [DONE]` was logged as an internal error with
    a traceback, and its recorded turn was never released (a later turn waited summary_wait_s)."""
    from molctl.proxy.http.app import ProxyApp

    profile = dataclasses.replace(TINY, proxy=dataclasses.replace(TINY.proxy, stream_write_timeout_s=0.2))
    app = ProxyApp(profile, get_engine("vllm"), "http://127.0.0.1:9", None)
    plans = []

    async def route(plan):
        plan.route = "L2"
        plans.append(plan)

    async def stream(plan, persist=True):
        app.orch.record(plan, {"role": "assistant", "content": "hi"})
        yield {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}

    app.orch.route = route
    app.orch.stream = stream
    sent: list[dict] = []

    async def run():
        body = json.dumps({"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "x"}]}).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else await asyncio.sleep(3600)

        async def send(message):
            if message.get("body") == b"data: [DONE]\n\n":
                await asyncio.sleep(3600)  # the client's window is full: this write never completes
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await asyncio.wait_for(app(scope, receive, send), 5)

    with caplog.at_level(logging.WARNING, logger="molctl.proxy"):
        asyncio.run(run())
    assert sent[0]["status"] == 200
    assert app.counters.values["stream_write_timeouts_total"] == 1
    assert app.counters.values["internal_errors_total"] == 0
    assert not [r for r in own_records(caplog.records) if r.levelno >= logging.ERROR]
    assert plans[0].record is None  # abandoned: nobody waits for its summary
    assert not app.orch.background  # and no summary hop was started


class BodyExchange(Exchange):
    """The app's Exchange with its body given (json_body's policy, without a request)."""

    def __init__(self, raw: bytes):
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


def body_exchange(raw: bytes) -> BodyExchange:
    return BodyExchange(raw)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_leaves_mid_upload_is_a_disconnect_not_an_exception(path, caplog):
    """A client that closed its connection halfway through its request body (found with a raw socket:
    Content-Length 10, 2 bytes sent, closed) made the app raise CancelledError out of the ASGI call:
    uvicorn logged "Exception in ASGI application" with a traceback for each such client."""
    from molctl.proxy.http.app import ProxyApp

    app = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", None)
    sent: list[dict] = []

    async def run():
        messages = [{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}]

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        await asyncio.wait_for(app(scope, receive, send), 5)

    with caplog.at_level(logging.INFO, logger="molctl.proxy"):
        asyncio.run(run())  # raised CancelledError
    assert sent == []  # nobody to answer
    assert app.counters.values["client_disconnects_total"] == 1
    assert app.counters.values["internal_errors_total"] == 0
    records = own_records(caplog.records)  # not the module stack's proxy (in-process, on its own thread)
    assert not [r for r in records if r.levelno >= logging.WARNING]
    line = json.loads([r.getMessage() for r in records if r.name == "molctl.proxy.requests"][0])
    assert line["status"] == 499 and line["client_disconnect"] is True


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_declared_body_over_the_limit_is_a_413_before_the_upload(s, path):
    """A client that announced a 99 MB body with `Expect: 100-continue` got `100 Continue` (an
    invitation to upload it) and its 413 only after 8 MiB had arrived. Found with a raw socket."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(s.proxy_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 99999999\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        answer = b""
        while data := sock.recv(65536):  # until the proxy closes the connection
            answer += data
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large", answer[:200]
    assert b"connection: close" in head.lower()
    assert b'"code":"request_too_large"' in rest


@pytest.mark.parametrize(
    "shape, in_thread",
    [
        ("a short chat", False),
        ("2100 messages", True),
        ("one message of 2100 parts", True),
        ("one assistant message of 2100 tool calls", True),
        ("2100 tools", True),
        ("a body over BIG_BODY", True),
    ],
)
def test_only_big_requests_are_prepared_in_a_worker_thread(shape, in_thread):
    """Parsing runs on the loop below BIG_BODY (orjson: ~10-20 ms for 1 MiB of tiny items); the
    per-message preparation goes to a worker thread when the body holds over BIG_ITEMS messages
    and content parts (a 1 MiB body of 4,000 tool-call turns takes ~50 ms of it), else it stays on
    the loop: a worker thread's hand-offs cost more than a conversation of a few hundred KiB."""
    import threading

    from molctl.proxy.http.app import ProxyApp
    from molctl.proxy.http.body import BIG_BODY

    user = {"role": "user", "content": "x"}
    messages = {
        "a short chat": [user],
        "2100 messages": [user] * 2100,
        "one message of 2100 parts": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2100}],
        "one assistant message of 2100 tool calls": [
            user,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    for i in range(2100)
                ],
            },
            user,
        ],
        "2100 tools": [user],
        "a body over BIG_BODY": [{"role": "user", "content": "x" * (BIG_BODY + 1)}],
    }[shape]
    body = {"model": PUBLIC, "messages": messages}
    if shape == "2100 tools":
        body["tools"] = [
            {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(2100)
        ]
    raw = json.dumps(body).encode()
    app = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", None)
    seen = []
    prepare = app.orch.prepare

    def recording(body, tenant):
        seen.append(threading.current_thread() is threading.main_thread())
        return prepare(body, tenant)

    app.orch.prepare = recording
    plan, big = asyncio.run(body_exchange(raw).json_body("messages", lambda body: app.chat._plan(body, "t")))
    assert seen == [not in_thread] and big is in_thread


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_what_only_the_standard_library_reads_is_parsed_in_a_worker_thread(api, monkeypatch):
    """Guards a found bug: bodies up to BIG_BODY are parsed on the loop, and the
    standard library's fallback (NaN, 19-digit numbers, invalid JSON) ran there too: a MiB of
    floats with one NaN held the loop ~100 ms (/health p50 62 ms against 8 ms). orjson stays on
    the loop; the fallback goes to a worker thread, and its answer is the same."""
    import threading

    from molctl.proxy.http import body as app_module
    from molctl.proxy.http.app import ProxyApp

    calls = []
    parse = app_module.parse_body

    def recording(raw, *args, **kwargs):
        calls.append((threading.current_thread() is threading.main_thread(), kwargs.get("fast_only", False)))
        return parse(raw, *args, **kwargs)

    monkeypatch.setattr(app_module, "parse_body", recording)
    proxy = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", None)
    field = "messages" if api == "chat" else "input"
    for text, fallback in (
        ('[{"role": "user", "content": "x"}], "temperature": 0.5', False),
        ('[{"role": "user", "content": "x"}], "temperature": NaN', True),
        ('[{"role": "user", "content": "x"}], "seed": 12345678901234567890', True),
        ('[{"role": "user", "content": "x"}', True),
    ):
        calls.clear()
        raw = ('{"model": "' + PUBLIC + '", "' + field + '": ' + text + "}").encode()
        try:
            asyncio.run(app_module.parse_on_loop(raw))
        except Exception as exc:  # the invalid one: a JSON 400 as before
            assert getattr(exc, "code", None) == "invalid_json", exc
        assert calls[0] == (True, True)  # orjson, on the loop
        assert calls[1:] == ([(False, False)] if fallback else []), (text, calls)
    assert proxy is not None


def test_a_cancelled_request_cancels_its_answer_before_its_slot_is_freed():
    """Guards a found bug: when uvicorn cancels request tasks at the drain
    deadline, `_run` freed the request's answer slot while its answer task ran on (orphaned: it
    then took slots and sent hops through a closing client, "Task exception was never
    retrieved"). The answer is now cancelled and ended first."""
    import types

    from molctl.proxy.http.app import ProxyApp
    from molctl.proxy.pipeline.plan import RequestState

    app = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", None)
    events = []

    async def answer():
        try:
            await asyncio.sleep(30)
        finally:
            events.append("answer ended")

    async def receive():
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def main():
        plan = types.SimpleNamespace(answer_slot=False)
        release = app.orch.release_answer_slot
        app.orch.release_answer_slot = lambda p: (events.append("slot freed"), release(p))
        task = asyncio.ensure_future(app.run(plan, receive, RequestState("r"), answer()))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert events == ["answer ended", "slot freed"]  # was: slot freed, the answer still running
