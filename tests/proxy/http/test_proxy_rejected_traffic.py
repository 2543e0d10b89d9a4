"""Traffic the proxy turns away before or at its key check, against a real `molctl proxy` (key file,
metrics listener) in front of the fake engine, with raw sockets: a connection that never completes
its request head is closed, a request that is not valid HTTP gets the JSON error shape, and key
guesses on the probe paths are logged and counted."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest

from tests.helpers import free_ports, wait_for
from tests.http_server import Server
from tests.procs import fake_engine_argv, proxy_argv, running

KEY = "sk-rejected-traffic"


class Stack:
    """A real `molctl proxy` (key file, metrics listener) in front of the fake engine."""

    def __init__(self, engine_url: str, proxy_url: str, metrics_url: str, log):
        self.engine_url, self.proxy_url, self.metrics_url, self.log = engine_url, proxy_url, metrics_url, log

    def counter(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.metrics_url).text.splitlines():
            m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
            if m and m.group(1) == name:
                got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if all(got.get(k) == v for k, v in labels.items()):
                    total += float(m.group(3))
        return total

    def request_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    keyfile = tmp / "keys"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    engine_port, proxy_port, metrics_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    log = tmp / "proxy.log"
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv(
                "tiny",
                engine_url,
                proxy_port,
                "--api-key-file",
                str(keyfile),
                "--store",
                "memory",
                "--metrics-port",
                str(metrics_port),
            ),
            proxy_url + "/health",
            log=log,
        ),
    ):
        yield Stack(engine_url, proxy_url, f"http://127.0.0.1:{metrics_port}/metrics", log)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """True when the server closes `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_never_completes_its_request_head_is_closed():
    """Found holding 100 connections to a real proxy's public port, half sending nothing and half a
    request head cut before its blank line (slowloris): after 20 s all 100 were still open (and
    the proxy's 100 file descriptors with them). uvicorn arms its keep-alive timeout only after a
    response, so a connection that never completes a request head was held for ever, before any
    key is checked: anyone who can reach the port could use up the proxy's descriptors. Now a
    request head must be complete within the keep-alive timeout (15 s in the proxy) of the
    connection opening or of its first byte; a response in progress is never cut by it."""
    release = threading.Event()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":  # a long answer (a stream): longer than the head deadline
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await asyncio.to_thread(release.wait, 10)
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with Server(app, timeout_keep_alive=1.0) as server:
        addr = ("127.0.0.1", server.port)
        silent = socket.create_connection(addr)
        partial = socket.create_connection(addr)
        partial.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        second = socket.create_connection(addr)  # one whole request, then half of the next one's head
        second.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert second.recv(65536).startswith(b"HTTP/1.1 200")
        second.sendall(b"GET / HTTP/1.1\r\nHo")
        slow = socket.create_connection(addr)  # a response in progress for longer than the deadline
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert _closed_by_peer(silent, 4), "a connection that sent nothing was kept"
            assert _closed_by_peer(partial, 4), "a connection with half a request head was kept"
            assert _closed_by_peer(second, 4), "half a head after a kept-alive request was kept"
            time.sleep(0.5)
            release.set()
            slow.settimeout(5)
            data = b""
            while not data.endswith(b"0\r\n\r\n"):
                chunk = slow.recv(65536)
                assert chunk, f"the running response was cut: {data!r}"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and b"ok" in data
            # a request whose head arrives in time is served as before, on a new connection too
            with socket.create_connection(addr, timeout=5) as ok:
                ok.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                assert ok.recv(65536).startswith(b"HTTP/1.1 200")
        finally:
            release.set()
            for s in (silent, partial, second, slow):
                s.close()


def _answer_to_raw(url: str, request: bytes) -> bytes:
    """Everything the server sends back to `request` on a new connection, until it closes."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(
    ("request_bytes", "detail"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "Invalid character in Content-Length"),
        (b"BLAH\r\n\r\n", "Invalid method encountered"),
        (b"GET /health HTTP/1.1\r\nHo\x01st: x\r\n\r\n", "Invalid header token"),
        (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", "Invalid char in url path"),
    ],
    ids=["content-length", "method", "header-name", "path"],
)
def test_a_request_that_is_not_valid_http_gets_a_json_error_like_every_other_400(stack, request_bytes, detail):
    """Found sending a raw request with `Content-Length: abc` (and a bad method, a control
    character in a header name, a non-ASCII byte in the path) to a real proxy: each was answered
    by uvicorn's own `text/plain` "Invalid HTTP request received.", the one error of the proxy not
    in the OpenAI shape (an SDK client reports it as an unparsable body). Now it is a 400 with
    `code: invalid_http`, the parser's reason, `x-request-id`, and the connection closed; uvicorn's
    warning is still logged."""
    data = _answer_to_raw(stack.proxy_url, request_bytes)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert lines[0] == "HTTP/1.1 400 Bad Request", data
    assert headers["content-type"] == "application/json", headers
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body), headers
    assert headers["x-request-id"].startswith("req-"), headers
    assert json.loads(body) == {
        "error": {
            "message": f"The request is not valid HTTP/1.1: {detail}.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_http",
        }
    }
    assert "Invalid HTTP request received." in stack.log.read_text()
    assert httpx.get(stack.proxy_url + "/health").status_code == 200  # the proxy serves on


def test_key_guesses_on_the_probe_paths_are_logged_and_counted_and_head_is_a_probe(stack):
    """Found sending POST, HEAD and DELETE to /health and /readyz with made-up keys: each was
    answered 401, and none had a request log line or a requests_total count (the probe
    exemption went by path alone), so key guessing there was invisible to the operator, and a
    valid key there got a 404 (the 401/404 difference: a key oracle) unseen too. And HEAD /health,
    the probe of some load balancers, was a 401. Now only GET and HEAD of /health and /readyz
    are probes (not counted, not logged; HEAD answers as GET without a body); any other method
    there is a request like any other: 401 without a key, logged and counted."""
    before = stack.counter("molctl_proxy_requests_total", api="other", status="401")
    lines_before = len(stack.request_lines())
    for method in ("POST", "DELETE"):
        for path in ("/health", "/readyz"):
            r = httpx.request(method, stack.proxy_url + path, headers={"Authorization": "Bearer guess"})
            assert r.status_code == 401, (method, path, r.status_code)
    assert httpx.head(stack.proxy_url + "/health").status_code == 200
    r = httpx.head(stack.proxy_url + "/readyz")
    assert r.status_code in (200, 503) and r.content == b""
    assert httpx.get(stack.proxy_url + "/health").status_code == 200
    # the proxy counts and logs a request after its response: polled (was a fixed 0.2 s), then exact
    wait_for(lambda: stack.counter("molctl_proxy_requests_total", api="other", status="401") >= before + 4, 5)
    wait_for(lambda: len(stack.request_lines()) >= lines_before + 4, 5)
    assert stack.counter("molctl_proxy_requests_total", api="other", status="401") == before + 4
    new = stack.request_lines()[lines_before:]
    assert [(line["status"], line["error"], line["tenant"]) for line in new] == [(401, "invalid_api_key", None)] * 4, (
        new
    )
