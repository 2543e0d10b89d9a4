"""One request to an ASGI app in-process: `asgi_call(app, method, path, body)` -> (status, headers,
body), a JSON body sent whole, the app given 20 s. Used by the store tests that run ProxyApp."""

from __future__ import annotations

import asyncio
import json


async def asgi_call(app, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    messages = [{"type": "http.request", "body": json.dumps(body).encode() if body else b"", "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    await asyncio.wait_for(app(scope, receive, send), 20)
    headers = {k.decode(): v.decode() for k, v in sent[0].get("headers", [])}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])
