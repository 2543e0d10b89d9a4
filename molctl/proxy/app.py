"""The proxy's raw ASGI application (no framework on the hot path; see performance-facts.md).

Endpoints: GET /health (liveness, no auth), GET /readyz (no auth; 503 unless the engine answers
and lists L0-L3 under the expected parent and the proxy is not draining; probe cached ~1 s),
GET /v1/models, GET /v1/models/{id} (the public model; 404 for any other id),
POST /v1/chat/completions, GET /metrics (plain counters; answered during a drain too).
Auth: `Authorization: Bearer <key>` against the keys of the key file, compared in constant time.
Drain: `start_drain()` (on SIGTERM) turns /readyz to 503 and answers new requests 503 with
Retry-After while in-flight requests, streams included, run to completion.

Streams and status codes: the `200` and the SSE headers are held back until the first chunk of
the answer exists (the engine's first event, i.e. its first token) or until `sse_keepalive_s`
passed, whichever comes first. Everything that fails before then (a 400 context overflow, a 503
with Retry-After, a 502 for an unreachable engine) is answered exactly as in non-stream mode:
same status, JSON body and headers. After `sse_keepalive_s` without a token (a slow route hop,
summaries being waited for, a long prefill) the 200 goes out with a keep-alive comment, then one
every `sse_keepalive_s`; a failure after that point, or after some deltas, is an OpenAI error
frame (`data: {"error": ...}`) followed by `data: [DONE]`. A stream client that reads nothing
for `proxy.stream_write_timeout_s` is dropped and its engine request cancelled.

Failures: a malformed request is a JSON 400 naming the field; anything unexpected is logged once
with its request id and answered as a JSON 500 in the OpenAI error shape naming that id (also in
the `x-request-id` header, which every chat response carries). Bodies over BIG_BODY bytes are
parsed and prepared in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from molctl.engines.base import Engine, adapter_problems
from molctl.profiles import Profile
from molctl.proxy.conversations import ConversationStore, MemoryStore
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import EngineUnavailable, ProxyError, invalid
from molctl.proxy.orchestrator import Counters, Orchestrator, Plan
from molctl.proxy.validation import parse_body

log = logging.getLogger("molctl.proxy")

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

MAX_BODY = 8 * 1024 * 1024
BIG_BODY = 128 * 1024  # parse + prepare larger bodies in a worker thread (20k content parts in 490 KiB cost ~130 ms)
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ProxyApp:
    def __init__(self, profile: Profile, engine: Engine, upstream: str, keys: list[str] | None,
                 store: ConversationStore | None = None, sse_keepalive_s: float = 10.0, ready_cache_s: float = 1.0):
        self.profile = profile
        self.engine = engine
        self.client = EngineClient(upstream)
        self.counters = Counters()
        self.orch = Orchestrator(profile, engine, self.client, store or MemoryStore(), self.counters)
        self.keys = [(k.encode(), hashlib.sha256(k.encode()).hexdigest()[:16]) for k in (keys or [])]
        self.sse_keepalive_s = sse_keepalive_s
        self.ready_cache_s = ready_cache_s
        self._ready: tuple[float, bool, str] = (0.0, False, "not probed")
        self._ready_lock = asyncio.Lock()
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._model = {"id": profile.served_model_name, "object": "model", "created": 0, "owned_by": "molctl"}
        self._models_body = json.dumps({"object": "list", "data": [self._model]}).encode()

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        await self.client.start()

    async def shutdown(self) -> None:
        for task in list(self.orch.background):
            task.cancel()
        await self.client.close()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        rid = "req-" + os.urandom(8).hex()
        state = {"started": False}

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self._route(scope, receive, tracked, rid)
        except ProxyError as exc:
            if not state["started"]:
                await self._error(tracked, exc, rid)
        except asyncio.CancelledError:
            raise
        except RecursionError:  # JSON the parser accepted (in a worker thread) but too deep to encode again
            if not state["started"]:
                await self._error(tracked, invalid("The body is nested too deeply to be a chat request."), rid)
        except Exception:  # a bug: logged once, answered in the OpenAI error shape
            self.counters.inc("internal_errors_total")
            log.exception("request %s failed", rid)
            if not state["started"]:
                await self._error(tracked, internal_error(rid), rid)

    async def _route(self, scope: dict, receive: Receive, send: Send, rid: str) -> None:
        path = scope["path"].rstrip("/") or "/"
        method = scope["method"]
        if path == "/health" and method == "GET":
            await self._json(send, 200, {"status": "draining" if self.draining else "ok"})
            return
        if path == "/readyz" and method == "GET":
            ok, why = await self.ready()
            await self._json(send, 200 if ok else 503, {"status": "ready" if ok else "not_ready", "detail": why})
            return
        tenant = self._authenticate(scope)
        if path == "/metrics" and method == "GET":  # scraped during a drain too
            await self._metrics(send)
            return
        if self.draining:
            raise ProxyError(503, "The server is shutting down; retry on another instance.", "server_error",
                             "draining", headers={"retry-after": "5"})
        if path == "/v1/models" and method == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": self._models_body})
            return
        if path.startswith("/v1/models/") and method == "GET":
            model_id = path[len("/v1/models/"):]
            if model_id != self.profile.served_model_name:
                raise ProxyError(404, f"The model '{model_id}' does not exist.", "invalid_request_error",
                                 "model_not_found", "model")
            await self._json(send, 200, self._model)
            return
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(scope, receive, send, tenant, rid)
            return
        raise ProxyError(404, f"Unknown endpoint: {method} {scope['path']}", "invalid_request_error", "not_found", "path")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ helpers
    def _authenticate(self, scope: dict) -> str:
        if not self.keys:
            return "anon"
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        tenant = None
        for key, tid in self.keys:  # compare against every key: timing does not tell which matched
            if hmac.compare_digest(token, key):
                tenant = tid
        if tenant is None:
            raise ProxyError(401, "Incorrect API key provided.", "authentication_error", "invalid_api_key",
                             headers={"www-authenticate": "Bearer"})
        return tenant

    async def _json(self, send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        hdrs = JSON_HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": raw})

    async def _error(self, send: Send, exc: ProxyError, rid: str | None = None) -> None:
        await self._json(send, exc.status, exc.body(), {**exc.headers, **({"x-request-id": rid} if rid else {})})

    async def _metrics(self, send: Send) -> None:
        lines = [f"molctl_proxy_{k} {v}" for k, v in sorted(self.counters.values.items())]
        lines += [f"molctl_proxy_state_{k} {v}" for k, v in self.orch.store.stats().items()]
        lines += [f"molctl_proxy_inflight_requests {self.inflight}", f"molctl_proxy_draining {int(self.draining)}"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": ("\n".join(lines) + "\n").encode()})

    async def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self._ready_cached():
            return self._ready[1:]
        async with self._ready_lock:
            if self._ready_cached():
                return self._ready[1:]
            ok, why = await self._probe_engine()
            self._ready = (time.monotonic(), ok, why)
            return ok, why

    def _ready_cached(self) -> bool:
        """A ready answer is reused for ready_cache_s; a not-ready one for at most 0.2 s, so
        readiness shows within moments of the engine serving."""
        stamp, ok, _ = self._ready
        return time.monotonic() - stamp < (self.ready_cache_s if ok else min(0.2, self.ready_cache_s))

    async def _probe_engine(self) -> tuple[bool, str]:
        try:
            status, _ = await self.client.get("/health")
            if status != 200:
                return False, f"engine /health answered {status}"
            status, body = await self.client.get("/v1/models")
        except EngineUnavailable:
            return False, "engine unreachable"
        if status != 200:
            return False, f"engine /v1/models answered {status}"
        problems = adapter_problems(self.profile, self.engine, body)
        if problems:  # counted, not named: adapter names never reach clients
            return False, f"{len(problems)} adapter(s) missing or misattached on the engine"
        return True, "engine ready"

    async def _read_body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            body = message.get("body", b"")
            size += len(body)
            if size > MAX_BODY:
                raise ProxyError(413, f"The request body exceeds {MAX_BODY} bytes.", "invalid_request_error", "request_too_large")
            chunks.append(body)
            if not message.get("more_body"):
                return b"".join(chunks)

    # ------------------------------------------------------------------ chat
    def _plan(self, raw: bytes, tenant: str) -> Plan:
        plan = self.orch.prepare(parse_body(raw, in_steps=len(raw) > BIG_BODY), tenant)
        plan.big = plan.big or len(raw) > BIG_BODY
        return plan

    async def _chat(self, scope: dict, receive: Receive, send: Send, tenant: str, rid: str) -> None:
        raw = await self._read_body(receive)
        plan = await asyncio.to_thread(self._plan, raw, tenant) if len(raw) > BIG_BODY else self._plan(raw, tenant)
        del raw
        self.counters.inc("requests_total")
        self.inflight += 1
        self._idle.clear()
        work = asyncio.ensure_future(self._stream(plan, send, rid) if plan.stream else self._complete(plan, send, rid))
        watch = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:  # the client went away: cancel the upstream request with it
                self.counters.inc("client_disconnects_total")
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                self.orch.abandon(plan)
            else:
                work.result()
        finally:
            watch.cancel()
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def _wait_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _complete(self, plan: Plan, send: Send, rid: str) -> None:
        await self.orch.route(plan)
        body = await self.orch.complete(plan)
        await self._json(send, 200, body, {"x-request-id": rid})
        self.orch.start_summary(plan)

    async def _chunks(self, plan: Plan):
        await self.orch.route(plan)
        answer = self.orch.stream(plan)
        try:
            async for chunk in answer:
                yield chunk
        finally:  # closing this generator closes the engine request now, not at garbage collection
            await answer.aclose()

    async def _stream(self, plan: Plan, send: Send, rid: str) -> None:
        """See the module docstring: headers wait for the first chunk or sse_keepalive_s."""
        write_timeout = self.profile.proxy.stream_write_timeout_s
        started = False

        async def write(data: bytes, more: bool = True) -> None:
            nonlocal started
            if not started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": SSE_HEADERS + [(b"x-request-id", rid.encode())]})
                started = True
            async with asyncio.timeout(write_timeout):
                await send({"type": "http.response.body", "body": data, "more_body": more})

        chunks = self._chunks(plan)
        pending: asyncio.Future | None = None
        failure: ProxyError | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(chunks.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=self.sse_keepalive_s)
                if not done:
                    await write(b": keepalive\n\n")
                    continue
                future, pending = pending, None
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    break
                await write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
        except ProxyError as exc:
            failure = exc
        except TimeoutError:  # the client stopped reading: drop it, cancel the engine request
            self.counters.inc("stream_write_timeouts_total")
            log.warning("request %s: stream client read nothing for %.0f s; dropped", rid, write_timeout)
            self.orch.abandon(plan)
            return
        except Exception:
            if not started:
                raise  # answered as a JSON 500 by __call__
            self.counters.inc("internal_errors_total")
            log.exception("request %s: stream failed", rid)
            failure = internal_error(rid)
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await chunks.aclose()
        if failure is not None:
            self.orch.abandon(plan)
            if not started:  # nothing sent yet: the same answer as without stream
                raise failure
        try:
            if failure is not None:
                await write(b"data: " + json.dumps(failure.body()).encode() + b"\n\n")
            await write(b"data: [DONE]\n\n", more=False)
        except TimeoutError:  # the client stopped reading just before the end: same as above
            self.counters.inc("stream_write_timeouts_total")
            log.warning("request %s: stream client read nothing for %.0f s; dropped", rid, write_timeout)
            self.orch.abandon(plan)
            return
        self.orch.start_summary(plan)


def internal_error(rid: str) -> ProxyError:
    return ProxyError(500, f"Internal proxy error (request id {rid}).", "server_error", "proxy_error")
