"""A stored response over its tenant's byte quota on its own (`proxy.store_tenant_max_bytes`, or
`store_max_bytes`), issue 32: it was the request's 500 with no word why; now a 400
`invalid_request_error` `store_quota_exceeded` naming the quota and suggesting `store: false`,
no internal error counted, readiness unchanged."""

from __future__ import annotations

import asyncio
import json

from molctl.engines import get_engine
from molctl.proxy.http.app import ProxyApp
from molctl.proxy.store.sqlite.store import SqliteResponseStore
from tests.asgi import asgi_call
from tests.helpers import free_port
from tests.procs import fake_engine_argv, running
from tests.proxy_stack import PUBLIC, TINY


def test_the_proxy_answers_a_record_over_its_quota_with_a_400_and_stays_ready(tmp_path):
    """Through the proxy (SQLite store): a stored response over `store_tenant_max_bytes` on its own
    was the request's 500; now a 400 `store_quota_exceeded` naming the quota and `store: false`,
    no internal error counted, readiness unchanged, and `store: false` is served."""
    port = free_port()
    store = SqliteResponseStore(tmp_path / "store.sqlite3", tenant_max_bytes=4000)
    with running(fake_engine_argv(port), f"http://127.0.0.1:{port}/health"):
        app = ProxyApp(TINY, get_engine("vllm"), f"http://127.0.0.1:{port}", None, response_store=store)

        async def run():
            await app.startup()
            try:
                over = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "x" * 6000})
                ready = await asgi_call(app, "GET", "/readyz")
                unstored = await asgi_call(
                    app, "POST", "/v1/responses", {"model": PUBLIC, "input": "x" * 6000, "store": False}
                )
                small = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "hi"})
                streamed = await asgi_call(
                    app, "POST", "/v1/responses", {"model": PUBLIC, "input": "x" * 6000, "stream": True}
                )
                return over, ready, unstored, small, streamed
            finally:
                await app.shutdown()

        over, ready, unstored, small, streamed = asyncio.run(run())
    status, headers, body = over
    assert status == 400, body
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "store_quota_exceeded", "store")
    assert "proxy.store_tenant_max_bytes: 4000 bytes" in error["message"] and "`store: false`" in error["message"]
    assert headers["x-request-id"] in error["message"]
    assert json.loads(ready[2])["status"] == "ready" and unstored[0] == 200 and small[0] == 200
    # streamed: the answer had started, so its last frame is the error event of the same code
    assert streamed[0] == 200 and b"event: error" in streamed[2] and b"store_quota_exceeded" in streamed[2]
    assert app.counters.labelled[("store_failures_total", (("cause", "quota"),))] == 2
    assert app.counters.values.get("internal_errors_total", 0) == 0
