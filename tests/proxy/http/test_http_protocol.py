"""The proxy's HTTP protocol (molctl/proxy/http_protocol.py): a response head leaves with its
body in one write, never later than the end of the event-loop pass that wrote it."""

from __future__ import annotations

import asyncio
import socket
import threading

from molctl.proxy.http.protocol import HeadHoldingTransport
from tests.http_server import Server

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


def test_a_head_and_its_body_written_in_one_pass_leave_in_one_write() -> None:
    async def main() -> list[bytes]:
        inner = RecordingTransport()
        t = HeadHoldingTransport(inner, asyncio.get_running_loop())
        t.write(HEAD)
        assert inner.writes == []  # held for its body
        t.write(b"ok")
        await asyncio.sleep(0)  # the end-of-pass flush finds nothing more to send
        return inner.writes

    assert asyncio.run(main()) == [HEAD + b"ok"]


def test_a_head_without_a_body_yet_leaves_at_the_end_of_the_pass() -> None:
    async def main() -> list[list[bytes]]:
        inner = RecordingTransport()
        t = HeadHoldingTransport(inner, asyncio.get_running_loop())
        t.write(HEAD)
        before = list(inner.writes)
        await asyncio.sleep(0)
        after_pass = list(inner.writes)
        t.write(b"data: 1\n\n")  # a later chunk goes straight through, in order
        return [before, after_pass, inner.writes]

    before, after_pass, final = asyncio.run(main())
    assert before == []
    assert after_pass == [HEAD]
    assert final == [HEAD, b"data: 1\n\n"]


def test_close_sends_a_held_head_first_and_a_closing_transport_gets_no_write() -> None:
    async def main() -> tuple[list[bytes], list[bytes]]:
        loop = asyncio.get_running_loop()
        inner = RecordingTransport()
        t = HeadHoldingTransport(inner, loop)
        t.write(HEAD)
        t.close()
        await asyncio.sleep(0)  # the scheduled flush has nothing left
        gone = RecordingTransport()
        t2 = HeadHoldingTransport(gone, loop)
        t2.write(HEAD)
        gone.closed = True  # the peer went away before the end of the pass
        await asyncio.sleep(0)
        return inner.writes, gone.writes

    closed, gone = asyncio.run(main())
    assert closed == [HEAD]
    assert gone == []


def test_other_writes_pass_through_and_the_rest_of_the_interface_is_the_transports() -> None:
    async def main() -> tuple[list[bytes], object, int]:
        inner = RecordingTransport()
        t = HeadHoldingTransport(inner, asyncio.get_running_loop())
        t.write(b"0\r\n\r\n")
        t.write(HEAD)
        return list(inner.writes), t.get_extra_info("peername"), t.get_write_buffer_size()

    writes, peer, buffered = asyncio.run(main())
    assert writes == [b"0\r\n\r\n"]
    assert peer == ("127.0.0.1", 1)
    assert buffered == len(HEAD)  # the held head counts as buffered


def _read_until(sock: socket.socket, marker: bytes, have: bytes = b"") -> bytes:
    while marker not in have:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before {marker!r}; got {have!r}")
        have += chunk
    return have


def test_under_uvicorn_keep_alive_responses_are_whole_and_a_stream_head_is_not_held_for_its_body() -> None:
    first_chunk = threading.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/json":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"ok": true}'})
            return
        # a stream whose first chunk waits for the client to have the head (as a slow first token would)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.to_thread(first_chunk.wait, 10)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    with Server(app) as server, socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(3):  # keep-alive: several responses on one connection
            sock.sendall(b"GET /json HTTP/1.1\r\nHost: x\r\n\r\n")
            data = _read_until(sock, b'{"ok": true}')
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b'\r\n\r\n{"ok": true}')
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        head = _read_until(sock, b"\r\n\r\n")  # arrives while the app still waits: not held for the body
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head
        first_chunk.set()
        rest = _read_until(sock, b"0\r\n\r\n", head.split(b"\r\n\r\n", 1)[1])
        assert b"data: 1" in rest


def test_an_http_1_0_client_gets_a_close_delimited_body_never_chunked() -> None:
    """RFC 9112 section 6.1: no Transfer-Encoding to an HTTP/1.0 client; a body without a length
    is delimited by closing the connection. HTTP/1.1 clients still get chunked streams."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/event-stream")]
        if scope["path"] == "/sized":
            headers.append((b"content-length", b"2"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["path"] == "/sized":
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def exchange(port: int, request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    with Server(app) as server:
        streamed = exchange(server.port, b"GET /stream HTTP/1.0\r\n\r\n")
        sized = exchange(server.port, b"GET /sized HTTP/1.0\r\n\r\n")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            chunked = _read_until(sock, b"0\r\n\r\n")
    head, _, body = streamed.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), streamed
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower(), head
    assert body == b"data: 1\n\ndata: 2\n\n"
    assert sized.endswith(b"\r\n\r\nok") and b"content-length: 2" in sized
    assert b"transfer-encoding: chunked" in chunked
