"""A full disk is visible: a stored Response the disk refuses is a 503 `store_unavailable` naming
the cause (ENOSPC) and the request id, `/readyz` says "degraded" with the reason until a write
commits again, and `store_failures_total{cause="ENOSPC"}` counts it. Before, `/readyz` stayed
ready and every stored Responses write failed as a generic 500. The disk is "full" here through
SQLite's `max_page_count`, which fails a write with SQLITE_FULL as a full disk does."""

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


def test_a_full_disk_is_a_503_naming_the_cause_a_degraded_readiness_and_a_counted_cause(tmp_path):
    port = free_port()
    store = SqliteResponseStore(tmp_path / "store.sqlite3")
    with running(fake_engine_argv(port), f"http://127.0.0.1:{port}/health"):
        app = ProxyApp(TINY, get_engine("vllm"), f"http://127.0.0.1:{port}", None, response_store=store)

        async def run():
            await app.startup()
            try:
                status, _, body = await asgi_call(app, "GET", "/readyz")
                assert (status, json.loads(body)["status"]) == (200, "ready"), body
                pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
                store._conn.execute(f"PRAGMA max_page_count = {pages}")  # no page more: SQLITE_FULL
                full = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "x" * 20000})
                degraded = await asgi_call(app, "GET", "/readyz")
                unstored = await asgi_call(
                    app, "POST", "/v1/responses", {"model": PUBLIC, "input": "y", "store": False}
                )
                store._conn.execute(f"PRAGMA max_page_count = {pages * 1000}")  # room again
                stored = await asgi_call(app, "POST", "/v1/responses", {"model": PUBLIC, "input": "z" * 20000})
                ready = await asgi_call(app, "GET", "/readyz")
                return full, degraded, unstored, stored, ready
            finally:
                await app.shutdown()

        full, degraded, unstored, stored, ready = asyncio.run(run())
    status, headers, body = full
    assert status == 503, body
    error = json.loads(body)["error"]
    assert error["code"] == "store_unavailable" and error["type"] == "server_error", error
    assert "disk is full" in error["message"] and headers["x-request-id"] in error["message"], error
    assert headers["retry-after"] == "30"
    assert degraded[0] == 200 and json.loads(degraded[2]) == {
        "status": "degraded",
        "detail": "response store writes failing (ENOSPC: no space left on the device)",
    }
    assert unstored[0] == 200  # a request that stores nothing is served as before
    assert stored[0] == 200 and json.loads(ready[2])["status"] == "ready"  # a write commits: ready again
    assert app.counters.labelled[("store_failures_total", (("cause", "ENOSPC"),))] == 1
