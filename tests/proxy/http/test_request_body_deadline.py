"""A request body has a total deadline, `proxy.request_body_timeout_s` (default 300 s), beside the
idle one (`proxy.stream_write_timeout_s` without a byte): a body trickled at one byte now and then
never passed the idle check, never got its 408 and held a drain to its deadline."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tests.helpers import free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import PUBLIC


def test_a_trickled_body_gets_a_408_at_the_total_deadline():
    engine_port, port = free_ports(2)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    body = json.dumps({"model": PUBLIC, "messages": [{"role": "user", "content": "x" * 40}]}).encode()
    argv = proxy_argv(
        "tiny",
        engine_url,
        port,
        "--allow-unauthenticated",
        "--store",
        "memory",
        "--set",
        "proxy.request_body_timeout_s=1",
    )
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(argv, url + "/health"),
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
    ):
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        sent = 0
        while sent < len(body) and not select.select([sock], [], [], 0)[0]:
            sock.sendall(body[sent : sent + 1])  # a byte every 0.2 s: never idle for long
            sent += 1
            time.sleep(0.2)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert sent < len(body), "the whole body was taken"
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    error = json.loads(rest[rest.index(b"{") : rest.rindex(b"}") + 1])  # chunked or not
    assert error["error"]["code"] == "request_timeout" and "1 s" in error["error"]["message"], error


def test_the_total_deadline_is_a_profile_field():
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    assert load_profile("tiny", profile_dirs()).proxy.request_body_timeout_s == 300
    with pytest.raises(ProfileError, match=r"proxy\.request_body_timeout_s"):
        load_profile("tiny", profile_dirs(), [("proxy.request_body_timeout_s", 0)])
