"""The floor of the proxy benchmark: the least any proxy process can add to a chat request that
needs a route hop and an answer hop. Not a proxy anyone should run: it reads no JSON, checks no
key, keeps no state and sends the same two pre-encoded engine requests (a route hop, then an
answer hop, over one kept-alive connection per client connection) for whatever it receives,
then returns the answer hop's body. What it adds over calling the engine directly is the price
of one more process on the way (a loopback write and a wake-up in each direction, the HTTP
parsing) on the machine that runs the benchmark; `bench/bench_proxy.py` measures it in the same
rounds as molctl's proxy, so the two can be compared (BENCHMARKS.md).

    python bench/floor_proxy.py --port PORT --upstream http://127.0.0.1:ENGINE_PORT
"""

from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit

import httptools
import uvloop


def engine_request(host: str, hop: str, body: bytes) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"X-MoL-Hop: {hop}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Engine(asyncio.Protocol):
    """One kept-alive connection to the engine; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        body, self.body = b"".join(self.body), []
        if waiter is not None and not waiter.done():
            waiter.set_result(body)

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("engine closed the connection"))

    async def call(self, raw: bytes) -> bytes:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


class Client(asyncio.Protocol):
    def __init__(self, upstream: tuple[str, int], route: bytes, answer: bytes) -> None:
        self.upstream, self.route, self.answer = upstream, route, answer
        self.parser = httptools.HttpRequestParser(self)
        self.engine: Engine | None = None
        self.transport: asyncio.Transport | None = None
        self.url = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        if self.url == b"/health":  # readiness for the benchmark's start-up
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            return
        asyncio.get_running_loop().create_task(self.handle())

    def connection_lost(self, exc) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.close()

    async def handle(self) -> None:
        if self.engine is None:
            _, self.engine = await asyncio.get_running_loop().create_connection(Engine, *self.upstream)
        await self.engine.call(self.route)
        body = await self.engine.call(self.answer)
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )


async def serve(port: int, upstream: str) -> None:
    url = urlsplit(upstream)
    host = f"{url.hostname}:{url.port}"
    route = engine_request(
        host,
        "route",
        b'{"model":"L0","max_tokens":8,"messages":[{"role":"system","content":"route"},'
        b'{"role":"user","content":"[route:L2] request"}]}',
    )
    answer = engine_request(
        host, "answer", b'{"model":"L2","max_tokens":16,"messages":[{"role":"user","content":"request"}]}'
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client((url.hostname, url.port), route, answer), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
