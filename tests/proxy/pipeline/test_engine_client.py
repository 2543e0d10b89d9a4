"""The proxy's engine client (molctl.proxy.engine_client) against real servers: the fake engine in
a subprocess, and small scripted HTTP servers in the test's loop for what an engine rarely does
(closing a kept-alive connection, a body ended by the close, a malformed answer). And the hot-path
JSON (molctl.proxy.fastjson): the same values as the standard library, the same errors."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from molctl.proxy import fastjson
from molctl.proxy.engine_client import STALE_CLOSE_S, EngineClient, checked_completion
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable
from tests.helpers import free_port, wait_for
from tests.procs import fake_engine_argv, running

PAYLOAD = {"model": "L1", "messages": [{"role": "user", "content": "héllo [route:L2]"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def engine():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(fake_engine_argv(port), url + "/health"):
        yield url


def engine_log(client_url: str) -> list[dict]:
    import httpx

    return httpx.get(client_url + "/_log").json()


def run(coro):
    return asyncio.run(coro)


async def with_client(url: str, fn, **kw):
    client = EngineClient(url, **kw)
    await client.start()
    try:
        return await fn(client)
    finally:
        await client.close()


def test_hops_reuse_one_connection_and_carry_the_hop_header(engine):
    import httpx

    httpx.post(engine + "/_reset")

    async def go(client):
        answers = [await client.chat(PAYLOAD, hop) for hop in ("route", "answer", "summary")]
        return answers, len(client._idle), len(client._busy)

    answers, idle, busy = run(with_client(engine, go))
    assert answers[0]["choices"][0]["message"]["content"] == "L2"
    assert answers[1]["choices"][0]["message"]["content"].startswith("answer-")
    assert (idle, busy) == (1, 0)  # three requests, one kept-alive connection
    log = engine_log(engine)
    assert [e["hop"] for e in log] == ["route", "answer", "summary"]
    assert log[1]["payload"] == PAYLOAD  # the body arrives as sent (UTF-8 text included)


def test_engine_error_status_body_and_retry_after(engine):
    import httpx

    httpx.post(engine + "/_reset")
    httpx.post(
        engine + "/_config",
        json={"answer_error": {"status": 503, "body": {"error": {"message": "busy"}}, "headers": {"Retry-After": "7"}}},
    )
    try:
        with pytest.raises(EngineHTTPError) as err:
            run(with_client(engine, lambda c: c.chat(PAYLOAD, "answer")))
    finally:
        httpx.post(engine + "/_reset")
    assert err.value.status == 503 and err.value.body == {"error": {"message": "busy"}}
    assert err.value.retry_after == "7"


def test_stream_events_until_done_and_a_cancelled_stream_closes_the_request(engine):
    import httpx

    httpx.post(engine + "/_reset")

    async def whole(client):
        return [e async for e in client.chat_stream({**PAYLOAD, "stream": True}, "answer")]

    events = run(with_client(engine, whole))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"

    httpx.post(engine + "/_config", json={"answer_words": 50, "token_delay": 0.05})

    async def first_then_cancel(client):
        stream = client.chat_stream({**PAYLOAD, "stream": True}, "answer")
        first = await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.5)
        return first, len(client._idle)

    try:
        first, idle = run(with_client(engine, first_then_cancel))
    finally:
        # the engine (another process) logs the close at its next token write: polled, not assumed
        # done within the 0.5 s above
        wait_for(lambda: any(e.get("event") == "client_gone" for e in engine_log(engine)), 5)
        log = engine_log(engine)
        httpx.post(engine + "/_reset")
    assert "delta" in first["choices"][0] and idle == 0  # the unfinished connection is not pooled
    assert any(e.get("event") == "client_gone" for e in log)  # the engine saw the close


def test_timeout_and_refused_connection_are_engine_unavailable(engine):
    import httpx

    httpx.post(engine + "/_config", json={"answer_delay": 2.0})
    try:
        with pytest.raises(EngineUnavailable, match="TimeoutError"):
            run(with_client(engine, lambda c: c.chat(PAYLOAD, "answer", timeout=0.2)))
    finally:
        httpx.post(engine + "/_reset")
    with pytest.raises(EngineUnavailable, match="cannot connect to the engine"):
        run(with_client(f"http://127.0.0.1:{free_port()}", lambda c: c.chat(PAYLOAD, "answer")))


async def scripted_server(answers: list[bytes]):
    """An HTTP server that answers each request (read up to its body) with the next scripted bytes;
    an answer ending in b"<close>" is sent without it and the connection closed."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            answer = answers.pop(0)
            if answer.endswith(b"<close>"):
                writer.write(answer[: -len(b"<close>")])
                await writer.drain()
                writer.close()
                return
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_a_kept_alive_connection_closed_by_the_engine_is_retried_once_on_a_new_one():
    async def go():
        # the first connection answers once and is then closed by the server while idle in the pool
        server, url, connections = await scripted_server([ok(b'{"n": 1}') + b"<close>", ok(b'{"n": 2}')])
        async with server:
            client = EngineClient(url)
            await client.start()
            try:
                first = await client.chat(PAYLOAD, "answer")
                await asyncio.sleep(0.1)  # the close reaches the client
                second = await client.chat(PAYLOAD, "answer")
            finally:
                await client.close()
        return first, second, len(connections)

    first, second, opened = run(go())
    assert (first, second, opened) == ({"n": 1}, {"n": 2}, 2)


def test_a_body_ended_by_the_close_and_a_malformed_answer():
    async def go():
        server, url, _ = await scripted_server(
            [
                b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"n": 3}<close>',
                b"NOT HTTP AT ALL\r\n\r\n<close>",
            ]
        )
        async with server:
            client = EngineClient(url)
            await client.start()
            try:
                body = await client.chat(PAYLOAD, "answer")
                with pytest.raises(EngineUnavailable, match="malformed HTTP response"):
                    await client.chat(PAYLOAD, "answer")
            finally:
                await client.close()
        return body

    assert run(go()) == {"n": 3}


def test_a_non_json_answer_is_a_502():
    async def go():
        server, url, _ = await scripted_server([ok(b"<html>oops</html>")])
        async with server:
            client = EngineClient(url)
            await client.start()
            try:
                await client.chat(PAYLOAD, "answer")
            finally:
                await client.close()

    with pytest.raises(EngineHTTPError) as err:
        run(go())
    assert err.value.status == 502 and "oops" in err.value.body


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "b": [1.5, -0.0, 1e-07, 1e16, true, null], "s": "h\\u00e9 \\ud83d\\ude00 \\n"}',
        '{"big": 123456789012345678901234567890, "neg": -9223372036854775809}',
        '[18446744073709551616, 1234567890123456789, 123456789012345678, "12345678901234567890"]',
        '{"x": NaN, "y": [Infinity, -Infinity, 1e400]}',
        '"\\ud800"',
    ],
)
def test_fastjson_gives_the_standard_librarys_values(text):
    ours = fastjson.loads(text.encode())
    theirs = json.loads(text)
    assert json.dumps(ours) == json.dumps(theirs)  # same values, NaN and infinities included
    if "\\ud800" not in text:  # orjson cannot write a lone surrogate: the standard library does
        assert json.dumps(json.loads(fastjson.dumps_bytes(ours))) == json.dumps(theirs)
    else:
        assert fastjson.dumps_bytes(ours) == json.dumps(theirs).encode()


def test_fastjson_keeps_non_finite_numbers_as_the_standard_library_writes_them():
    value = fastjson.loads(b'{"t": NaN, "u": -Infinity}')
    assert math.isnan(value["t"]) and value["u"] == -math.inf
    assert fastjson.dumps_bytes(value) in (b'{"t":NaN,"u":-Infinity}', b'{"t": NaN, "u": -Infinity}')


@pytest.mark.parametrize("bad", [b"{bad", b'{"a": 1,}', b"\xff\xfe{", b""])
def test_fastjson_refuses_what_the_standard_library_refuses_with_its_message(bad):
    with pytest.raises(ValueError) as ours:
        fastjson.loads(bad)
    with pytest.raises(ValueError) as theirs:
        json.loads(bad)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "msg",
    [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": 'tab\there "quoted" back\\slash \x00\x1f\x7f é 中文 \U0001f600 \u2028 \ufeff'},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 1e16}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "tool", "tool_call_id": 7, "content": "an integer id"},
    ],
)
def test_conversation_keys_keep_their_bytes(msg):
    """The keys are stored (SQLite): the fast canonical form is byte for byte the json.dumps one."""
    from molctl.proxy.conversations import canonical_arguments, canonical_message, text_of, tool_calls_of

    calls = [
        [
            c.get("id"),
            (c.get("function") or {}).get("name"),
            canonical_arguments((c.get("function") or {}).get("arguments")),
        ]
        for c in tool_calls_of(msg)
    ]
    form = [msg.get("role"), text_of(msg.get("content")), calls, msg.get("tool_call_id")]
    assert canonical_message(msg) == json.dumps(form, separators=(",", ":"), ensure_ascii=False).encode()


def test_extra_request_headers_reach_the_engine_and_unsafe_ones_are_refused():
    heads: list[bytes] = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(ok(b'{"n": 1}'))
        await writer.drain()
        writer.close()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            client = EngineClient(url)
            await client.start()
            try:
                body = await client.chat(PAYLOAD, "route", request_id="req-123")
                with pytest.raises(ValueError, match="not a valid header"):
                    await client.chat(PAYLOAD, "route", request_id="a\r\nX-Evil: 1")
            finally:
                await client.close()
        return body

    assert run(go()) == {"n": 1}
    assert len(heads) == 1
    lines = heads[0].split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    assert b"X-MoL-Hop: route" in lines and b"X-Request-Id: req-123-route" in lines


def test_an_interim_1xx_answer_sent_apart_is_skipped_for_the_final_one():
    async def go():
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            for interim in (b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"):
                writer.write(interim)
                await writer.drain()
                await asyncio.sleep(0.05)  # its own read on the client's side
            writer.write(ok(b'{"n": 5}'))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            return await with_client(
                f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", lambda c: c.chat(PAYLOAD, "answer")
            )

    assert run(go()) == {"n": 5}


def one_answer_then(later):
    """A server connection handler that answers the first request with {"n": 1} and hands the
    connection to `later(reader, writer)` on the second; and the list of request heads it read."""
    requests = []

    async def handle(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            requests.append(head)
            if len(requests) > 1:
                await later(reader, writer)
                return
            writer.write(ok(b'{"n": 1}'))
            await writer.drain()

    return handle, requests


def test_a_timeout_on_a_kept_alive_connection_is_not_sent_again():
    """Only a connection that the engine closed before answering is retried: an engine that took
    the request and stays silent past the deadline has it (sending it again would double the wait
    and the engine's work)."""

    async def go():
        async def silent(reader, writer):  # from the second request on
            await reader.read()  # until the client closes
            writer.close()

        handle, requests = one_answer_then(silent)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            client = EngineClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            await client.start()
            try:
                first = await client.chat(PAYLOAD, "summary", timeout=5)
                with pytest.raises(EngineUnavailable, match="TimeoutError"):
                    await client.chat(PAYLOAD, "summary", timeout=0.3)
            finally:
                await client.close()
        return first, len(requests)

    assert run(go()) == ({"n": 1}, 2)


def test_an_engine_that_dies_on_a_request_is_not_sent_it_again():
    """A kept-alive connection the engine closes without a byte is retried once only when the close
    came right after the send (the keep-alive race). An engine that had the request for a while and
    then went away (killed, crashed: maybe by this request) is not sent it again, and the error
    says what happened, not "cannot connect" from the retry (the SRE review)."""

    async def go():
        async def dies(reader, writer):  # works on the second request, then dies
            await asyncio.sleep(STALE_CLOSE_S + 0.3)
            writer.transport.abort()

        handle, requests = one_answer_then(dies)
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            client = EngineClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            await client.start()
            try:
                first = await client.chat(PAYLOAD, "answer")
                with pytest.raises(EngineUnavailable, match="into the request without answering"):
                    await client.chat(PAYLOAD, "answer")
            finally:
                await client.close()
        return first, len(requests)

    assert run(go()) == ({"n": 1}, 2)


def test_a_request_cancelled_after_the_client_closed_ends_cancelled():
    """Shutdown closes the client while a summary hop waits for the engine, then cancels it: the
    task ends cancelled (no AttributeError from the closed pool, logged as an error at exit)."""

    async def go():
        async def handle(reader, writer):
            await reader.read()  # takes the request, never answers; returns once the client closed
            writer.close()  # (Python 3.12's Server.wait_closed waits for every connection to close)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            client = EngineClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            await client.start()
            task = asyncio.ensure_future(client.chat(PAYLOAD, "summary", timeout=30))
            await asyncio.sleep(0.2)  # sent, waiting for the answer
            await client.close()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(go())


def sse_answer(*frames: bytes) -> bytes:
    body = b"".join(b"data: " + f + b"\n\n" for f in frames)
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


ROLE = b'{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
STOP = b'{"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}]}'


@pytest.mark.parametrize(
    "frame",
    [
        b"<html>oops</html>",  # not JSON
        b'{"choices": [{"index": 0, "delta": {"content": "cut',  # a frame cut short
        b"[1, 2]",  # JSON, not an object
        b'{"choices": [null]}',
        b'{"choices": {"index": 0}}',
        b'{"choices": [{"index": 0, "delta": "text"}]}',
        b'{"choices": [{"index": 0, "delta": {"content": 5}}]}',
        b'{"choices": [{"index": 0, "delta": {"tool_calls": "f"}}]}',
        b'{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": 5}}]}}]}',
        b'{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "a", "function": {"name": "f"}}]}}]}',
        b'{"error": "boom"}',  # an error frame with a bare message
    ],
)
def test_a_malformed_stream_event_fails_the_stream(frame):
    """A data frame that is not a JSON object was skipped (the answer went on without that piece,
    and was recorded and summarised); an event whose choices or delta have the wrong types reached
    the orchestrator and failed it with a TypeError/AttributeError (a 500 and a traceback). Both are
    the engine's failure: EngineHTTPError inside the stream (a 502 engine_error, or an SSE error frame)."""

    async def go():
        server, url, _ = await scripted_server([sse_answer(ROLE, frame, STOP, b"[DONE]")])
        async with server:
            return await with_client(url, lambda c: _drain(c.chat_stream({**PAYLOAD, "stream": True}, "answer")))

    with pytest.raises(EngineHTTPError) as err:
        run(go())
    assert err.value.in_stream and err.value.status in (500, 502)


@pytest.mark.parametrize(
    "frame",
    [
        b'{"id": "x"}',  # no choices
        b'{"choices": []}',
        b'{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}',
        b'{"choices": [{"index": 0, "delta": null}]}',
        b'{"choices": [{"index": 0, "delta": {"content": null, "tool_calls": null}}]}',
    ],
)
def test_events_without_a_delta_are_not_failures(frame):
    async def go():
        server, url, _ = await scripted_server([sse_answer(ROLE, frame, STOP, b"[DONE]")])
        async with server:
            return await with_client(url, lambda c: _drain(c.chat_stream({**PAYLOAD, "stream": True}, "answer")))

    assert run(go()) == [json.loads(ROLE), json.loads(frame), json.loads(STOP)]


def test_a_stream_line_split_over_many_reads_is_whole_and_a_line_past_the_cap_is_a_502(monkeypatch):
    """A line in pieces over many reads is joined once (the splitter kept rescanning it from its
    start: a 50 MB line took 18 s of CPU) and a line with no end is bounded: past MAX_STREAM_LINE it
    is the engine's failure, not memory without limit."""
    from molctl.proxy import engine_wire

    class Conn:  # what _lines reads: body chunks, then done
        def __init__(self, chunks):
            self.chunks, self.done, self.error = list(chunks), False, None

        @property
        def body(self):
            return bool(self.chunks)

        def take_body(self):
            chunk = self.chunks.pop(0)
            self.done = not self.chunks
            return chunk

    line = b"data: " + b"x" * 5000 + b"\n"
    pieces = [line[i : i + 7] for i in range(0, len(line), 7)] + [b"\ndata: [DONE]\n"]
    assert list(engine_wire._lines(Conn(pieces))) == [line, b"\n", b"data: [DONE]\n"]
    monkeypatch.setattr(engine_wire, "MAX_STREAM_LINE", 4000)
    with pytest.raises(EngineHTTPError) as err:
        list(engine_wire._lines(Conn(pieces)))
    assert err.value.status == 502 and err.value.in_stream


async def _drain(stream) -> list:
    return [event async for event in stream]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"choices": None},
        {"choices": []},
        {"choices": "abc"},
        {"choices": {"0": {}}},
        {"choices": [None]},
        {"choices": [{"message": "hi"}]},
        {"choices": [{"finish_reason": "stop"}]},
        {"choices": [{"message": {"role": "assistant", "content": ["x"]}}]},
        {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": "f"}}]},
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
                    }
                }
            ]
        },
    ],
)
def test_a_completion_without_a_usable_choice_is_a_502(body):
    with pytest.raises(EngineHTTPError) as err:
        checked_completion(body)
    assert err.value.status == 502 and not err.value.in_stream
    good = {
        "choices": [{"message": {"role": "assistant", "content": "hi", "tool_calls": None}, "finish_reason": "stop"}]
    }
    assert checked_completion(good) is good
