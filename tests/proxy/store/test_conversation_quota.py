"""Issue 42: a conversation is a record of the response store, under its tenant's byte quota
(`proxy.store_tenant_max_bytes`): items that would take it over are a 400 `store_quota_exceeded`
naming the quota, and the conversation stays as it was (no half-written record)."""

from __future__ import annotations

import asyncio
import json

from molctl.engines import get_engine
from molctl.proxy.http.app import ProxyApp
from molctl.proxy.store.sqlite.store import SqliteResponseStore
from tests.asgi import asgi_call
from tests.proxy_stack import TINY


def test_items_over_the_tenant_quota_are_a_400_and_change_nothing(tmp_path):
    store = SqliteResponseStore(tmp_path / "store.sqlite3", tenant_max_bytes=4000)
    app = ProxyApp(TINY, get_engine("vllm"), "http://127.0.0.1:9", None, response_store=store)

    async def run():
        conv = await asgi_call(app, "POST", "/v1/conversations", {"items": [{"role": "user", "content": "hi"}]})
        cid = json.loads(conv[2])["id"]
        big = [{"role": "user", "content": "x" * 6000}]
        over = await asgi_call(app, "POST", f"/v1/conversations/{cid}/items", {"items": big})
        created = await asgi_call(app, "POST", "/v1/conversations", {"items": big})
        items = await asgi_call(app, "GET", f"/v1/conversations/{cid}/items")
        return conv, over, created, items

    conv, over, created, items = asyncio.run(run())
    assert conv[0] == 200
    for status, _, body in (over, created):
        assert status == 400, body
        error = json.loads(body)["error"]
        assert error["code"] == "store_quota_exceeded" and "proxy.store_tenant_max_bytes" in error["message"]
    assert [i["content"] for i in json.loads(items[2])["data"]] == [[{"type": "input_text", "text": "hi"}]]
    assert store.stats()["responses"] == 1  # the one conversation, nothing else
