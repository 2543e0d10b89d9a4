"""The CLI's HTTP to the stack (molctl.localhttp): one SSL context per process, however many
clients the readiness polls, status and top make. httpx makes a context per Client (about 37 ms of
CPU loading the CA bundle), and `up` made one per readiness poll."""

from __future__ import annotations

import ssl

import httpx._transports.default

from molctl import localhttp
from molctl.lifecycle import status
from molctl.lifecycle.readiness import http_status
from molctl.top import fetch_metrics
from tests import shared_ssl
from tests.http_server import Server


async def metrics_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"molctl_proxy_requests_total 3\n"})


def test_every_client_shares_one_ssl_context(monkeypatch):
    # httpx as it is, without the suite's shared context (tests/shared_ssl.py)
    monkeypatch.setattr(httpx._transports.default, "create_ssl_context", shared_ssl._make)
    made = []  # httpx makes a client's context with ssl.create_default_context (httpx/_config.py)
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: made.append(1) or real(*a, **kw))
    localhttp.ssl_context.cache_clear()
    try:
        with Server(metrics_app) as server:
            url = f"http://127.0.0.1:{server.port}"
            for _ in range(5):
                assert http_status(url + "/health") == 200
            assert status._probe(url + "/readyz", 2.0) == (200, None)
            text, why = fetch_metrics(url + "/metrics")
            assert why is None and "molctl_proxy_requests_total 3" in text
            with localhttp.client() as client:
                assert client.get(url + "/x").status_code == 200
        assert made == [1]
    finally:
        localhttp.ssl_context.cache_clear()  # the next user makes the real one again
