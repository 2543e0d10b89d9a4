"""A request head (request line and headers) is bounded: `proxy.max_request_head_bytes` (64 KiB by
default, as nginx and Envoy). Over it, the proxy answers 431 (414 while the request line is still
arriving) in its JSON error shape as soon as the bound is passed, counting bytes as they arrive,
before they are parsed, then closes the connection. An unbounded head (a 64 MiB header or URL) grew
the proxy by 100+ MB and stalled every client for seconds, before any key was checked."""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path

import httpx
import pytest

from molctl.proxy.http.protocol import HeadHoldingHttpToolsProtocol
from tests.helpers import free_ports, wait_for
from tests.http_server import Server
from tests.procs import fake_engine_argv, proxy_argv, running

LIMIT = 4096


async def _ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = json.dumps({"path": scope["path"], "body_bytes": size}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _limited(refused: list[int] | None = None):
    return HeadHoldingHttpToolsProtocol.configured(
        max_head_bytes=LIMIT, on_refused=refused.append if refused is not None else None
    )


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends on `sock` until it closes it."""
    sock.settimeout(10)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _split(data: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}, body


def _read_response(sock: socket.socket, have: bytes = b"") -> tuple[bytes, bytes]:
    """One response with a content-length; (it, what followed)."""
    while b"\r\n\r\n" not in have:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-head: {have!r}"
        have += chunk
    head, _, rest = have.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def test_a_header_past_the_bound_is_answered_431_before_the_head_ends() -> None:
    """The head never ends: the answer comes from the bytes counted as they arrived."""
    refused: list[int] = []
    with (
        Server(_ok_app, http=_limited(refused)) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * LIMIT))
        status, headers, body = _split(_answer(sock))
    assert status == "HTTP/1.1 431 Request Header Fields Too Large"
    assert headers["content-type"] == "application/json" and headers["connection"] == "close", headers
    assert int(headers["content-length"]) == len(body)
    rid = headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{16}", rid), rid
    assert json.loads(body) == {
        "error": {
            "message": f"The request head (request line and headers) exceeds {LIMIT} bytes "
            f"(proxy.max_request_head_bytes; request id {rid}).",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_header_too_large",
        }
    }
    assert refused == [431]


def test_a_request_line_past_the_bound_is_answered_414() -> None:
    refused: list[int] = []
    with (
        Server(_ok_app, http=_limited(refused)) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /" + b"a" * (2 * LIMIT))
        status, headers, body = _split(_answer(sock))
    assert status.startswith("HTTP/1.1 414 "), status
    error = json.loads(body)["error"]
    assert error["code"] == "url_too_long" and error["type"] == "invalid_request_error", error
    assert headers["x-request-id"] in error["message"] and str(LIMIT) in error["message"]
    assert refused == [414]


def test_heads_within_the_bound_are_served_and_bodies_do_not_count() -> None:
    """A head just under the bound, a body many times the bound sent with its head in one write,
    and then, on the same kept-alive connection, a head over the bound: only that one is refused
    (the count starts again with each request)."""
    refused: list[int] = []
    with (
        Server(_ok_app, http=_limited(refused)) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        head = b"GET /near HTTP/1.1\r\nHost: x\r\nX-Pad: "
        near = head + b"p" * (LIMIT - len(head) - 4) + b"\r\n\r\n"
        assert len(near) == LIMIT
        sock.sendall(near)
        answer, rest = _read_response(sock)
        assert answer.startswith(b"HTTP/1.1 200 ") and json.loads(answer.partition(b"\r\n\r\n")[2])["path"] == "/near"
        body = b"b" * (64 * LIMIT)
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        answer, rest = _read_response(sock, rest)
        assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"path": "/upload", "body_bytes": len(body)}
        for i in range(3):  # several small requests: the count is per request, not per connection
            sock.sendall(b"GET /again HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"q" * (LIMIT // 2) + b"\r\n\r\n")
            answer, rest = _read_response(sock, rest)
            assert answer.startswith(b"HTTP/1.1 200 "), (i, answer)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"z" * (2 * LIMIT) + b"\r\n\r\n")
        status, _, _ = _split(rest + _answer(sock))
    assert status == "HTTP/1.1 431 Request Header Fields Too Large"
    assert refused == [431]


def test_a_head_past_the_bound_behind_a_running_response_is_refused_after_it() -> None:
    """Pipelined behind a request still being answered: the running answer is whole, then the 431."""
    release = threading.Event()

    async def slow_app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        import asyncio

        await asyncio.to_thread(release.wait, 10)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"done"})

    with (
        Server(slow_app, http=_limited()) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        sock.sendall(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /big HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * LIMIT)
        )
        release.set()
        data = _answer(sock)
    head, _, after = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and after.startswith(b"done"), data[:300]
    assert after[4:].startswith(b"HTTP/1.1 431 "), data[:600]


# ---------------------------------------------------------------- the real proxy


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("head")
    engine_port, proxy_port, metrics_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv(
                "tiny",
                engine_url,
                proxy_port,
                "--allow-unauthenticated",
                "--store",
                "memory",
                "--metrics-port",
                str(metrics_port),
            ),
            proxy_url + "/health",
            log=tmp / "proxy.log",
        ) as proc,
    ):
        yield proc, proxy_url, f"http://127.0.0.1:{metrics_port}/metrics"


def _requests_total(metrics_url: str, status: str) -> float:
    total = 0.0
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith("molctl_proxy_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_64_mib_header_costs_the_proxy_no_more_than_a_small_bounded_size(proxy) -> None:
    """The reproduction: one request with a 64 MiB header. The proxy's peak resident size grows by
    less than 16 MiB (unbounded, it grew by 100+ MB), it answers 431 in JSON and counts it in
    requests_total, and serves on."""
    proc, proxy_url, metrics_url = proxy
    assert httpx.get(proxy_url + "/v1/models").status_code == 200
    before = _peak_rss_bytes(proc.pid)
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 * 1024 * 1024) + b"\r\n\r\n"
    host, port = proxy_url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:

        def send(data: bytes) -> None:
            try:
                sock.sendall(data)
            except OSError:  # refused part-way: the proxy closed the connection
                pass

        sender = threading.Thread(target=send, args=(request,), daemon=True)
        sender.start()
        data = _answer(sock)
        sender.join(30)
    status, headers, body = _split(data)
    assert status == "HTTP/1.1 431 Request Header Fields Too Large", data[:300]
    assert json.loads(body)["error"]["code"] == "request_header_too_large"
    assert headers["x-request-id"] in json.loads(body)["error"]["message"]
    grown = _peak_rss_bytes(proc.pid) - before
    assert grown < 16 * 1024 * 1024, f"the proxy's peak RSS grew by {grown / 2**20:.1f} MiB"
    assert httpx.get(proxy_url + "/health").status_code == 200
    assert wait_for(lambda: _requests_total(metrics_url, "431") == 1, 5)


def test_the_bound_is_a_profile_field_from_1_kib_to_64_mib() -> None:
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    assert load_profile("tiny", profile_dirs()).proxy.max_request_head_bytes == 64 * 1024
    assert (
        load_profile("tiny", profile_dirs(), [("proxy.max_request_head_bytes", 8192)]).proxy.max_request_head_bytes
        == 8192
    )
    for bad in (0, 1023, 64 * 1024 * 1024 + 1):
        with pytest.raises(ProfileError, match=r"proxy\.max_request_head_bytes"):
            load_profile("tiny", profile_dirs(), [("proxy.max_request_head_bytes", bad)])
