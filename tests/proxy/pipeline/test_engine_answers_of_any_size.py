"""A non-streamed engine answer is read to its end whatever its size (issue 40): the engine
connection pauses reading past READ_HIGH_WATER, so the body must be taken as it arrives, and a
body past the profile's `proxy.engine_body_max_bytes` is a clear 502, not a wait for the timeout."""

from __future__ import annotations

import asyncio
import json

import pytest

from molctl.proxy.engine_client import EngineClient
from molctl.proxy.engine_wire import READ_HIGH_WATER
from molctl.proxy.errors import EngineHTTPError

PAYLOAD = {"model": "L1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def one_answer_server(answer: bytes):
    """An HTTP server that answers one request (read up to its body) with `answer` as a JSON
    body with a Content-Length, as vLLM's uvicorn does, and closes the connection."""

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(answer))
        writer.write(answer)
        try:
            await writer.drain()
        except ConnectionError:  # the client closed it past its bound
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def big_completion(ids: int) -> bytes:
    """A vLLM completion with `return_token_ids`: the prompt's ids make the body large."""
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "prompt_token_ids": list(range(100_000, 100_000 + ids)),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "answer"},
                "finish_reason": "stop",
                "token_ids": [1, 2],
            }
        ],
    }
    return json.dumps(body).encode()


async def _ask(answer: bytes, **client_kw):
    server, url = await one_answer_server(answer)
    async with server:
        client = EngineClient(url, read_timeout=20.0, **client_kw)
        await client.start()
        try:
            return await client.chat(PAYLOAD, "answer")
        finally:
            await client.close()


@pytest.mark.parametrize("ids", [200_000, 600_000])
def test_an_answer_past_the_read_high_water_is_read_to_its_end(ids):
    """Guards the 1 MiB hang: the body was taken only once complete, so reading stayed paused."""
    answer = big_completion(ids)
    assert len(answer) > READ_HIGH_WATER
    body = asyncio.run(_ask(answer))
    assert len(body["prompt_token_ids"]) == ids and body["choices"][0]["message"]["content"] == "answer"


def test_an_answer_past_the_profiles_bound_is_a_502_naming_it():
    """Guards the bound: a body past engine_body_max_bytes fails at once, naming the field."""
    answer = big_completion(300_000)
    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(_ask(answer, max_body=2 * READ_HIGH_WATER))
    assert err.value.status == 502
    assert "proxy.engine_body_max_bytes" in err.value.body and str(2 * READ_HIGH_WATER) in err.value.body
