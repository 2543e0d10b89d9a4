"""The proxy's raw ASGI application (no framework on the hot path: BENCHMARKS.md has the numbers).

Endpoints: GET|HEAD /health (liveness, no auth), GET|HEAD /readyz (no auth; 503 unless the engine answers
and lists L0-L3 under the expected parent and the proxy is not draining; probe cached ~1 s),
GET /v1/models, GET /v1/models/{id} (the public model; 404 for any other id),
POST /v1/chat/completions, POST /v1/responses, GET|DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items (the Responses API: `responses`). Metrics are not here: they
are on their own listener (molctl.proxy.metrics, `proxy.metrics_port`).
Auth: `Authorization: Bearer <key>` against the keys of the key file, compared in constant time.
Drain: `start_drain()` (on SIGTERM) turns /readyz to 503 and answers new requests 503 with
Retry-After while in-flight requests, streams included, run to completion; at the drain deadline
`cut_requests()` answers those still running itself: a 503 `draining` naming the request id (an
error frame `draining` and the stream's end for a stream already started).

Streams and status codes: the `200` and the SSE headers are held back until the first chunk of
the answer exists (the engine's first event, i.e. its first token) or until `sse_keepalive_s`
passed, whichever comes first. Everything that fails before then (a 400 context overflow, a 503
with Retry-After, a 502 for an unreachable engine) is answered exactly as in non-stream mode:
same status, JSON body and headers. After `sse_keepalive_s` without a token (a slow route hop,
summaries being waited for, a long prefill; not while the request waits for an answer slot, at
most proxy.queue_timeout_s, so that a refusal there is a real 429) the 200 goes out with a keep-alive comment, then one
every `sse_keepalive_s`; a failure after that point, or after some deltas, is an OpenAI error
frame (`data: {"error": ...}`) followed by `data: [DONE]`. A stream client that reads nothing
for `proxy.stream_write_timeout_s` is dropped and its engine request cancelled.

Failures: a malformed request is a JSON 400 naming the field; anything unexpected is logged once
with its request id and answered as a JSON 500 in the OpenAI error shape naming that id (also in
the `x-request-id` header, which every response carries). Bodies over BIG_BODY bytes are
parsed (in steps) and prepared in a worker thread, and so is the preparation of a smaller body
holding over BIG_ITEMS messages, content parts, tool calls and tools, so the event loop keeps serving; everything
else runs on the loop, where orjson parses a MiB in 1-25 ms and a worker thread's hand-offs
would cost more than the work (1.5 ms of CPU for a 260 KiB conversation, BENCHMARKS.md); a body
orjson cannot read (NaN, 19-digit numbers, invalid JSON) is read by the standard library in a
worker thread, whatever its size.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from molctl.engines.base import READYZ_ENGINE_PROBE_MIN_S, Engine, adapter_problems
from molctl.profiles import Profile
from molctl.proxy import fastjson, responses
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import (
    EngineUnavailable,
    ProxyError,
    draining,
    invalid,
    server_names,
    shown,
    store_cause,
    store_failure,
)
from molctl.proxy.metrics import MetricsListener, ProxyMetrics, store_gauges
from molctl.proxy.orchestrator import BIG_MESSAGES, Orchestrator, Plan
from molctl.proxy.store.base import ConversationStore, RecordStore, ResponseStore, StoreBusy, StoreError, StoreScope
from molctl.proxy.store.local import as_proxy_store
from molctl.proxy.store.memory import MemoryResponseStore, MemoryStore
from molctl.proxy.validation import parse_body

log = logging.getLogger("molctl.proxy")
request_log = logging.getLogger("molctl.proxy.requests")  # one JSON line per request (see request_line)
REQUEST: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("molctl_proxy_request")
REQUEST_ID_RE = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")  # an incoming X-Request-Id we pass on as it is
UNCOUNTED = ("/health", "/readyz")  # probes (GET or HEAD): neither counted nor logged per request
PROBE_METHODS = ("GET", "HEAD")  # another method on a probe path is a request like any other (401 without a key)

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

MAX_BODY = 8 * 1024 * 1024
BIG_BODY = 1024 * 1024  # parse + prepare larger bodies in a worker thread, the parse in steps
BIG_ITEMS = (
    BIG_MESSAGES  # prepare in a worker thread above this many messages, parts, tool calls and tools (many_items)
)
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class ProxyApp:
    def __init__(
        self,
        profile: Profile,
        engine: Engine,
        upstream: str,
        keys: list[str] | None,
        store: ConversationStore | None = None,
        sse_keepalive_s: float = 10.0,
        ready_cache_s: float = 1.0,
        response_store: RecordStore | ResponseStore | None = None,
        shared_state: Any = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_sock=None,
    ):
        self.profile = profile
        self.engine = engine
        self.client = EngineClient(
            upstream, request_id_field=engine.request_id_field, request_id_unique=engine.request_id_unique
        )
        self.counters = ProxyMetrics(self._gauges, self._store_counters)
        self.orch = Orchestrator(profile, engine, self.client, store or MemoryStore(), self.counters)
        self.orch.engine_names.extend(server_names(profile, upstream))  # scrubbed from engine messages too
        self.metrics_listener = (
            MetricsListener(self.counters, metrics_host, metrics_port, metrics_sock) if metrics_port else None
        )
        self.responses = as_proxy_store(response_store if response_store is not None else MemoryResponseStore())
        # a shared store (molctl.proxy.store.redis): a heartbeat, closed on shutdown
        self.shared_state = shared_state
        self.keys: dict[bytes, str] = {}
        self.set_keys(keys or [])
        self.sse_keepalive_s = sse_keepalive_s
        self.ready_cache_s = ready_cache_s
        self._ready: tuple[float, bool, str] = (0.0, False, "not probed")
        self._ready_lock = asyncio.Lock()
        self.draining = False
        self.inflight = 0  # answers running (the inflight_requests gauge)
        # requests admitted (past the draining check) and not finished, their body still being read
        # included: what a drain waits for (_idle)
        self.admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._running: dict[asyncio.Task, dict[str, Any]] = {}  # admitted requests' tasks, with their state
        self._cut: asyncio.Future | None = None  # done at the drain deadline (cut_requests): streams end with it
        self._model = {"id": profile.served_model_name, "object": "model", "created": 0, "owned_by": "molctl"}
        self._models_body = json.dumps({"object": "list", "data": [self._model]}).encode()

    def set_keys(self, keys: list[str]) -> None:
        """The accepted keys (see `key_table`), replaced at once."""
        self.keys = key_table(keys)

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        await self.client.start()
        if self.metrics_listener is not None:
            await self.metrics_listener.start()
        if self.shared_state is not None:
            self.shared_state.start_heartbeat(self._engine_healthy)

    async def _engine_healthy(self) -> bool:
        return (await self.ready())[0]

    async def shutdown(self) -> None:
        for task in list(self.orch.background):
            task.cancel()
        if self.metrics_listener is not None:
            await self.metrics_listener.close()
        await self.client.close()
        self.responses.close()
        if self.shared_state is not None:
            await self.shared_state.close()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_background(self, timeout: float) -> bool:
        """Wait for the background summary hops (a drain: a turn answered just before SIGTERM keeps
        its summary, written to the state store before exit); False when some outlast `timeout`
        (they are cancelled at shutdown: their turns stay without a summary, as after a failed one)."""
        tasks = list(self.orch.background)
        if not tasks:
            return True
        log.info("drain: waiting for %d summary hop(s)", len(tasks))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, timeout))
        return not pending

    def cut_requests(self) -> int:
        """The drain deadline: every admitted request still running is answered now, a 503
        `draining` naming its request id. A stream sees the cut in its own loop (an error frame once
        its 200 went out); any other request's task is cancelled and answered by `__call__`.
        Returns how many were running; `wait_idle` then waits for their answers."""
        cut = self._cut_future()
        if not cut.done():
            cut.set_result(None)
        for task, state in list(self._running.items()):
            if not state.get("streaming") and not task.done():
                state["cut"] = True
                task.cancel()
        return len(self._running)

    def _cut_future(self) -> asyncio.Future:
        if self._cut is None:
            self._cut = asyncio.get_running_loop().create_future()
        return self._cut

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
            if scope["type"] == "websocket":
                await self._websocket(scope, send)
            return
        rid = incoming_request_id(scope["headers"]) or "req-" + os.urandom(8).hex()
        state: dict[str, Any] = {"started": False, "status": 499, "t0": time.monotonic(), "tenant": None, "plan": None}
        REQUEST.set(state)

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                state["status"] = message["status"]
                headers = message.get("headers") or []
                if not any(name == b"x-request-id" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self._route(scope, receive, tracked, rid)
        except ProxyError as exc:
            state["error"] = exc.code or exc.type
            if not state["started"]:
                await self._error(tracked, exc, rid)
        except ClientGone:  # left while sending its body: nothing to answer, nothing to log but its line
            self.counters.inc("client_disconnects_total")
            state["disconnected"] = True
        except asyncio.CancelledError:
            if not state.get("cut"):
                raise
            asyncio.current_task().uncancel()  # cancelled by cut_requests (the drain deadline): answered here
            state["error"] = "draining"
            if not state["started"]:
                await self._error(tracked, draining(rid), rid)
        except RecursionError:  # JSON the parser accepted (in a worker thread) but too deep to encode again
            if not state["started"]:
                await self._error(tracked, invalid("The body is nested too deeply to be a chat request."), rid)
        except (StoreError, StoreBusy) as exc:  # an external fault (a full disk, another process's lock): one line
            failure = store_failure(exc, rid) or internal_error(rid)
            state["error"] = failure.code
            if failure.status >= 500:  # not a record over its quota (a 400: the client's to change)
                self.counters.inc("internal_errors_total")
            self.counters.inc("store_failures_total", cause=store_cause(exc))
            log.warning("request %s failed: %s", rid, exc)
            if not state["started"]:
                await self._error(tracked, failure, rid)
        except Exception:  # a bug: logged once, answered in the OpenAI error shape
            state["error"] = "proxy_error"
            self.counters.inc("internal_errors_total")
            log.exception("request %s failed", rid)
            if not state["started"]:
                await self._error(tracked, internal_error(rid), rid)
        finally:
            if scope["method"] not in PROBE_METHODS or (scope["path"].rstrip("/") or "/") not in UNCOUNTED:  # as _route
                self._count(scope, state, rid)

    async def _websocket(self, scope: dict, send: Send) -> None:
        """A WebSocket upgrade: there is no WebSocket endpoint, so it is answered over HTTP as a
        request to an unknown endpoint (401 without a key, else 404 `not_found`, JSON; counted and
        logged), with the ASGI denial response. Returning without an answer was uvicorn's plain-text
        500 and an ERROR line per upgrade attempt, without any key. A server without the denial
        extension gets a close before the handshake (its 403). uvicorn's websockets-sansio protocol
        still logs "ASGI callable returned without completing handshake." after a denial response
        (Kludex/uvicorn PR 3138); `ws="none"` in server.py would not load a WebSocket protocol at all."""
        denial = "websocket.http.response" in (scope.get("extensions") or {})

        async def as_denial(message: dict) -> None:
            if denial:
                await send({**message, "type": "websocket." + message["type"]})  # websocket.http.response.*
            elif message["type"] == "http.response.start":
                await send({"type": "websocket.close", "code": 1008})

        async def no_body() -> dict:  # never read: no endpoint takes the WEBSOCKET method
            return {"type": "http.disconnect"}

        await self({**scope, "type": "http", "method": "WEBSOCKET"}, no_body, as_denial)

    def _count(self, scope: dict, state: dict[str, Any], rid: str) -> None:
        """requests_total by API, status and stream, and the request's log line."""
        plan: Plan | None = state["plan"]
        path = scope["path"]
        api = (
            "chat"
            if path.startswith("/v1/chat/")
            else "responses"
            if path.startswith("/v1/responses")
            else "models"
            if path.startswith("/v1/models")
            else "other"
        )
        stream = bool(plan is not None and plan.stream)
        self.counters.inc("requests_total", api=api, status=str(state["status"]), stream="true" if stream else "false")
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(request_line(rid, state, api, plan, time.monotonic() - state["t0"]))

    async def _route(self, scope: dict, receive: Receive, send: Send, rid: str) -> None:
        path = scope["path"].rstrip("/") or "/"
        method = scope["method"]
        if path == "/health" and method in PROBE_METHODS:  # uvicorn sends no body to a HEAD
            await self._json(send, 200, {"status": "draining" if self.draining else "ok"})
            return
        if path == "/readyz" and method in PROBE_METHODS:
            ok, why = await self.ready()
            degraded = self.responses_degraded() if ok else None  # still serving: 200, with the reason
            await self._json(
                send,
                200 if ok else 503,
                {"status": "degraded" if degraded else "ready" if ok else "not_ready", "detail": degraded or why},
            )
            return
        tenant = self._authenticate(scope)
        REQUEST.get()["tenant"] = tenant
        if self.draining:
            raise draining()
        # admitted: a drain that starts from now on waits for this request, even while its body is
        # still arriving (counted from _run only, it was cut at uvicorn's 5 s shutdown grace: a 500)
        self.admitted += 1
        self._idle.clear()
        task = asyncio.current_task()
        self._running[task] = REQUEST.get()
        try:
            await self._dispatch(scope, receive, send, rid, tenant, path, method)
        finally:
            self._running.pop(task, None)
            self.admitted -= 1
            if self.admitted == 0:
                self._idle.set()

    async def _dispatch(
        self, scope: dict, receive: Receive, send: Send, rid: str, tenant: str, path: str, method: str
    ) -> None:
        if path == "/v1/models" and method == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": self._models_body})
            return
        if path.startswith("/v1/models/") and method == "GET":
            model_id = path[len("/v1/models/") :]
            if model_id != self.profile.served_model_name:
                raise ProxyError(
                    404,
                    f"The model '{shown(model_id)}' does not exist.",
                    "invalid_request_error",
                    "model_not_found",
                    "model",
                )
            await self._json(send, 200, self._model)
            return
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(scope, receive, send, tenant, rid)
            return
        if path == "/v1/responses" and method == "POST":
            await self._responses_create(scope, receive, send, tenant, rid)
            return
        if path.startswith("/v1/responses/"):
            rest = path[len("/v1/responses/") :]
            if rest.endswith("/input_items") and "/" not in rest[: -len("/input_items")] and method == "GET":
                await self._responses_input_items(scope, send, tenant, rest[: -len("/input_items")], rid)
                return
            if rest and "/" not in rest and method in ("GET", "DELETE"):
                if method == "GET":
                    stream = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("stream", ["false"])[-1]
                    if stream.strip().lower() not in ("false", "0", ""):  # the SDK may send False, 0
                        raise invalid("Streaming a stored response (stream=true) is not supported.", "stream")
                await self._responses_get(send, tenant, rest, rid, delete=method == "DELETE")
                return
            if rest.endswith("/cancel") and "/" not in rest[: -len("/cancel")] and method == "POST":
                # OpenAI cancels only background responses (400 for the others); this proxy runs none
                if await self.responses.get_response(tenant, rest[: -len("/cancel")]) is None:
                    raise responses.not_found(rest[: -len("/cancel")])
                raise invalid(
                    "Only responses created with background=true can be cancelled; this proxy runs no "
                    "background responses (each is complete when its request returns).",
                    "response_id",
                )
        raise ProxyError(
            404, f"Unknown endpoint: {method} {shown(scope['path'])}", "invalid_request_error", "not_found", "path"
        )

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
        tenant = self.keys.get(hashlib.sha256(token).digest()) if token else None
        if tenant is None:
            raise ProxyError(
                401,
                "Incorrect API key provided.",
                "authentication_error",
                "invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
        return tenant

    async def _json(self, send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = fastjson.dumps_bytes(body)
        hdrs = JSON_HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": raw})

    async def _error(self, send: Send, exc: ProxyError, rid: str | None = None) -> None:
        await self._json(send, exc.status, exc.body(), {**exc.headers, **({"x-request-id": rid} if rid else {})})

    def _gauges(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Read at scrape time (on the event loop): in-flight hops, queue depth, store sizes."""
        adm = self.orch.admission
        conversations = self.orch.store.stats()  # one read per scrape (SQLite: a query)
        return {
            "inflight_hops": {
                (("hop", "answer"),): adm.answers.inflight,
                (("hop", "route"),): adm.routes.inflight,
                (("hop", "summary"),): self.orch._summary_running,
            },
            "queue_depth": {
                (("hop", "answer"),): adm.answers.waiting,
                (("hop", "route"),): adm.routes.waiting,
                (("hop", "summary"),): self.orch._summary_waiting,
            },
            "inflight_requests": {(): self.inflight},
            "admitted_requests": {(): self.admitted},
            "draining": {(): int(self.draining)},
            "store": {
                **store_gauges(conversations, "conversations"),
                **store_gauges(self.responses.stats(), "responses"),
            },
            "state_store_up": {(): 1 - conversations.get("store_degraded", 0)},
        }

    def _store_counters(self) -> dict[str, float]:
        """The conversation store's own counters (a shared store: degradations, errors, affinity)."""
        return {"state_" + k: v for k, v in self.orch.store.stats().items() if k.endswith("_total")}

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

    def responses_degraded(self) -> str | None:
        """Why the local response store serves in part (damaged; writes failing), else None."""
        return self.responses.health()

    def _ready_cached(self) -> bool:
        """A ready answer is reused for ready_cache_s; a not-ready one for at most 0.2 s, so
        readiness shows within moments of the engine serving."""
        stamp, ok, _ = self._ready
        return time.monotonic() - stamp < (self.ready_cache_s if ok else min(0.2, self.ready_cache_s))

    async def _probe_engine(self) -> tuple[bool, str]:
        try:
            status, _ = await self.client.get(
                "/health", timeout=max(READYZ_ENGINE_PROBE_MIN_S, self.engine.health_timeout_s)
            )
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

    async def _read_body(self, scope: dict, receive: Receive) -> bytes:
        """The body; a client that sends nothing of it for `proxy.stream_write_timeout_s`, or not all
        of it within `proxy.request_body_timeout_s`, gets a 408 (an admitted request holds a drain:
        a stalled or trickled upload must not hold it to its deadline). A Content-Length over
        MAX_BODY is a 413 before any of it is read (no `100 Continue` is sent)."""
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY:
                raise too_large(unread=True)
        chunks, size = [], 0
        idle_s = self.profile.proxy.stream_write_timeout_s
        total_s = self.profile.proxy.request_body_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s
        try:
            async with asyncio.timeout(min(idle_s, total_s)) as idle:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    body = message.get("body", b"")
                    size += len(body)
                    if size > MAX_BODY:
                        raise too_large()
                    chunks.append(body)
                    if not message.get("more_body"):
                        return b"".join(chunks)
                    idle.reschedule(min(loop.time() + idle_s, deadline))
        except TimeoutError:
            why = (
                f"The request body did not arrive whole within {total_s:g} s."
                if loop.time() >= deadline
                else f"No part of the request body arrived for {idle_s:g} s."
            )
            raise ProxyError(
                408, why, "invalid_request_error", "request_timeout", headers={"connection": "close"}
            ) from None

    # ------------------------------------------------------------------ chat
    def _plan(self, raw: bytes, tenant: str) -> Plan:
        """A body over BIG_BODY, in a worker thread: parsed in steps, then prepared."""
        plan = self.orch.prepare(parse_body(raw, in_steps=True), tenant)
        plan.big = True
        return plan

    async def _chat_plan(self, raw: bytes, tenant: str) -> Plan:
        if len(raw) > BIG_BODY:
            return await asyncio.to_thread(self._plan, raw, tenant)
        body = await parse_on_loop(raw)
        if many_items(body, "messages"):
            plan = await asyncio.to_thread(self.orch.prepare, body, tenant)
            plan.big = True
            return plan
        return self.orch.prepare(body, tenant)

    @staticmethod
    def _track(plan: Plan, rid: str) -> None:
        plan.request_id = rid
        REQUEST.get()["plan"] = plan

    async def _chat(self, scope: dict, receive: Receive, send: Send, tenant: str, rid: str) -> None:
        raw = await self._read_body(scope, receive)
        plan = await self._chat_plan(raw, tenant)
        del raw
        self._track(plan, rid)
        await self.orch.load(plan)
        await self._run(
            plan, receive, self._stream(plan, send, rid) if plan.stream else self._complete(plan, send, rid)
        )

    async def _run(self, plan: Plan, receive: Receive, coro: Awaitable[None]) -> None:
        """Run one answer (`coro`) while watching the client: a disconnect cancels it."""
        self.inflight += 1
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:  # the client went away: cancel the upstream request with it
                self.counters.inc("client_disconnects_total")
                REQUEST.get()["disconnected"] = True
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                self.orch.abandon(plan)
            else:
                work.result()
        except asyncio.CancelledError:  # this request cancelled (uvicorn at the drain deadline): its answer too
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)  # ended before its slot is freed below
            raise
        finally:
            watch.cancel()
            self.orch.release_answer_slot(plan)  # taken before the route hop: freed however the answer ended
            self.inflight -= 1

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

    @staticmethod
    def _chat_frame(chunk: Any) -> bytes:
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    @staticmethod
    def _chat_error_frame(exc: ProxyError) -> bytes:
        return b"data: " + json.dumps(exc.body()).encode() + b"\n\n"

    async def _stream(
        self,
        plan: Plan,
        send: Send,
        rid: str,
        events: AsyncIterator[Any] | None = None,
        frame: Callable[[Any], bytes] | None = None,
        error_frame: Callable[[ProxyError], bytes] | None = None,
        end: bytes | None = b"data: [DONE]\n\n",
    ) -> None:
        """See the module docstring: headers wait for the first chunk or sse_keepalive_s. Chat by
        default; the Responses API passes its own events, framing and end (no [DONE])."""
        frame = frame or self._chat_frame
        error_frame = error_frame or self._chat_error_frame
        write_timeout = self.profile.proxy.stream_write_timeout_s
        started = False

        async def write(data: bytes, more: bool = True) -> None:
            nonlocal started
            if not started:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": SSE_HEADERS + [(b"x-request-id", rid.encode())],
                    }
                )
                started = True
            async with asyncio.timeout(write_timeout):
                await send({"type": "http.response.body", "body": data, "more_body": more})

        chunks = events if events is not None else self._chunks(plan)
        pending: asyncio.Future | None = None
        failure: ProxyError | None = None
        REQUEST.get()["streaming"] = True  # the drain deadline ends it here (cut_requests), not by a cancel
        cut = self._cut_future()
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(chunks.__anext__())
                done, _ = await asyncio.wait(
                    {pending, cut}, timeout=self.sse_keepalive_s, return_when=asyncio.FIRST_COMPLETED
                )
                if cut in done:
                    raise draining(rid)
                if not done:
                    if not started and plan.queued:
                        continue  # waiting for an answer slot (bounded): no 200 yet, a refusal stays a real 429
                    await write(b": keepalive\n\n")
                    continue
                future, pending = pending, None
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    break
                await write(frame(chunk))
        except ProxyError as exc:
            failure = exc
        except TimeoutError:  # the client stopped reading: drop it, cancel the engine request
            self.counters.inc("stream_write_timeouts_total")
            log.warning("request %s: stream client read nothing for %.0f s; dropped", rid, write_timeout)
            self.orch.abandon(plan)
            return
        except Exception as exc:
            if not started:
                raise  # answered as a JSON 500 by __call__
            if isinstance(exc, (StoreError, StoreBusy)):  # an external fault: one line (see __call__)
                log.warning("request %s: stream failed: %s", rid, exc)
                self.counters.inc("store_failures_total", cause=store_cause(exc))
                failure = store_failure(exc, rid) or internal_error(rid)
                if failure.status >= 500:
                    self.counters.inc("internal_errors_total")
            else:
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
            REQUEST.get()["error"] = failure.code or failure.type  # a 200 that ended in an error frame
        try:
            if failure is not None:
                await write(error_frame(failure), more=end is not None)
            if end is not None:
                await write(end, more=False)
            elif failure is None:
                await write(b"", more=False)
        except TimeoutError:  # the client stopped reading just before the end: same as above
            self.counters.inc("stream_write_timeouts_total")
            log.warning("request %s: stream client read nothing for %.0f s; dropped", rid, write_timeout)
            self.orch.abandon(plan)
            return
        self.orch.start_summary(plan)

    # ------------------------------------------------------------------ Responses API
    def _responses_parse(self, raw: bytes) -> responses.ResponsesRequest:
        """A body over BIG_BODY, in a worker thread."""
        return responses.parse_request(
            parse_body(raw, in_steps=True),
            self.profile.served_model_name,
            self.profile.proxy.media_url_hosts,
            self.orch.fields,
        )

    async def _responses_previous(self, req: responses.ResponsesRequest, tenant: str, scope: StoreScope) -> None:
        """The stored chain a request continues; a shared store that is down fails a request that
        needs state (a chain, or store=true) here, before any engine work (503 + Retry-After)."""
        previous = req.body.get("previous_response_id")
        if previous is not None or req.store:
            await self.responses.available()
        if previous is not None:
            # a shared store reads the chain's conversation state in the same round trip
            record = await self.responses.get_previous(tenant, previous, scope)
            if record is None:
                raise responses.not_found(previous, "previous_response_id")
            req.prev, req.history = record, list(record["messages"])

    async def _responses_with_references(
        self, need: responses.NeedsReferences, tenant: str
    ) -> responses.ResponsesRequest:
        """Parse again with the output items the request's `item_reference`s name (each a stored
        response of this tenant, found by the item's id: responses.ItemIds)."""
        await self.responses.available()
        records: dict[str, Any] = {}
        for response_id in dict.fromkeys(filter(None, map(responses.response_of_item, need.ids))):
            records[response_id] = await self.responses.get_response(tenant, response_id)
        refs = responses.referenced_items(need.ids, records)
        return responses.parse_request(
            need.body, self.profile.served_model_name, self.profile.proxy.media_url_hosts, self.orch.fields, refs
        )

    def _responses_plan(self, req: responses.ResponsesRequest, tenant: str, big: bool) -> Plan:
        plan = self.orch.prepare(req.chat_body(), tenant)
        plan.big = plan.big or big
        plan.include_usage = True  # the Response's usage
        return plan

    async def _responses_create(self, scope: dict, receive: Receive, send: Send, tenant: str, rid: str) -> None:
        try:
            await self._responses_create_or_fail(scope, receive, send, tenant, rid)
        except ProxyError as exc:
            exc.param = responses.public_param(exc.param)
            raise

    async def _responses_create_or_fail(self, scope: dict, receive: Receive, send: Send, tenant: str, rid: str) -> None:
        raw = await self._read_body(scope, receive)
        big = len(raw) > BIG_BODY
        try:
            if big:
                req = await asyncio.to_thread(self._responses_parse, raw)
            else:
                body = await parse_on_loop(raw)
                big = many_items(body, "input")
                args = (body, self.profile.served_model_name, self.profile.proxy.media_url_hosts, self.orch.fields)
                req = await asyncio.to_thread(responses.parse_request, *args) if big else responses.parse_request(*args)
        except responses.NeedsReferences as need:  # item_reference inputs: their items from the store
            req = await self._responses_with_references(need, tenant)
        del raw
        store_scope = self.orch.store.open_scope()  # the chain's state read with it, used by load
        await self._responses_previous(req, tenant, store_scope)
        big = big or len(req.history) > BIG_ITEMS  # a long stored chain: prepared off the loop too
        plan = (
            await asyncio.to_thread(self._responses_plan, req, tenant, big)
            if big
            else self._responses_plan(req, tenant, big)
        )
        plan.scope = store_scope
        await self.orch.load(plan)
        self._track(plan, rid)
        if not plan.stream:
            await self._run(plan, receive, self._responses_complete(plan, req, send, tenant, rid))
            return
        translator = responses.StreamTranslator(req, responses.new_id("resp_"))

        def error_event(exc: ProxyError) -> bytes:
            return responses.sse(
                translator.ev("error", code=exc.code, message=exc.message, param=responses.public_param(exc.param))
            )

        events = self._responses_events(plan, req, translator, tenant)
        await self._run(plan, receive, self._stream(plan, send, rid, events, responses.sse, error_event, end=None))

    async def _responses_route(self, plan: Plan, req: responses.ResponsesRequest) -> None:
        """Tool results that answer the previous response's calls continue on the adapter that
        made them (from the stored record, so it holds across a proxy restart); else as chat."""
        prev = req.prev
        if prev is not None and prev.get("route") and req.messages and all(m["role"] == "tool" for m in req.messages):
            last = prev["messages"][-1] if prev.get("messages") else {}
            calls = {c.get("id") for c in last.get("tool_calls") or []}
            if calls and all(m.get("tool_call_id") in calls for m in req.messages):
                plan.route = prev["route"]
                plan.sticky = True
                self.counters.inc("sticky_tool_turns_total")
                return
        await self.orch.route(plan)

    async def _responses_keep(
        self, req: responses.ResponsesRequest, plan: Plan, tenant: str, response: dict[str, Any]
    ) -> None:
        """Store a complete (or incomplete) answer (a large one from a worker thread: LocalResponses)."""
        if req.store and response["status"] != "failed" and plan.answer is not None and plan.route is not None:
            await self.responses.put_response(
                responses.make_record(req, tenant, response, plan.answer, plan.route), big=plan.big, scope=plan.scope
            )

    async def _responses_complete(
        self, plan: Plan, req: responses.ResponsesRequest, send: Send, tenant: str, rid: str
    ) -> None:
        await self._responses_route(plan, req)
        chat = await self.orch.complete(plan, persist=False)  # a shared store writes the turn and the record together
        response = responses.complete_response(req, responses.new_id("resp_"), int(time.time()), chat)
        await self._responses_keep(req, plan, tenant, response)
        await self.orch.persisted(plan)
        await self._json(send, 200, response, {"x-request-id": rid})
        self.orch.start_summary(plan)

    async def _responses_events(
        self, plan: Plan, req: responses.ResponsesRequest, tr: responses.StreamTranslator, tenant: str
    ) -> AsyncIterator[dict[str, Any]]:
        """Nothing is yielded before the engine's first token, so an early failure keeps its
        status (see `_stream`); a failure after that is a `response.failed` event."""
        await self._responses_route(plan, req)
        answer = self.orch.stream(plan, persist=False)  # recorded below: the turn and the response in one write
        started = False
        try:
            async for chunk in answer:
                if not started:
                    started = True
                    for event in tr.start():
                        yield event
                for event in tr.feed(chunk):
                    yield event
        except ProxyError as exc:
            if not started:
                raise
            REQUEST.get()["error"] = exc.code or exc.type  # a 200 that ended in response.failed
            for event in tr.failed(exc):
                yield event
            return
        finally:
            await answer.aclose()
        closing, final = tr.finish_events()
        if plan.answer is not None:
            self.orch.record(plan, plan.answer)
        await self._responses_keep(
            req, plan, tenant, final
        )  # before the last event: the next request may follow at once
        await self.orch.persisted(plan)
        for event in closing:
            yield event

    async def _responses_get(self, send: Send, tenant: str, response_id: str, rid: str, delete: bool) -> None:
        if delete:
            if not await self.responses.delete_response(tenant, response_id):
                raise responses.not_found(response_id)
            await self._json(
                send, 200, {"id": response_id, "object": "response.deleted", "deleted": True}, {"x-request-id": rid}
            )
            return
        record = await self.responses.get_response(tenant, response_id)
        if record is None:
            raise responses.not_found(response_id)
        await self._json(send, 200, record["response"], {"x-request-id": rid})

    async def _responses_input_items(self, scope: dict, send: Send, tenant: str, response_id: str, rid: str) -> None:
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        for key in query:
            if key not in ("limit", "order", "after", "include", "include[]"):  # the SDK sends include[]=…
                raise invalid(f"Unrecognized query parameter: {key}", key)
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise invalid("'limit' must be an integer from 1 to 100.", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid("'order' must be 'asc' or 'desc'.", "order")
        record = await self.responses.get_response(tenant, response_id)
        if record is None:
            raise responses.not_found(response_id)
        await self._json(
            send, 200, responses.list_input_items(record, limit, order, query.get("after")), {"x-request-id": rid}
        )


def incoming_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """A client's X-Request-Id when it is 1-128 characters of [A-Za-z0-9._:/+=-]; else None
    (the proxy makes one)."""
    for name, value in headers:
        if name == b"x-request-id":
            return value.decode("ascii") if REQUEST_ID_RE.fullmatch(value) else None
    return None


def request_line(rid: str, state: dict[str, Any], api: str, plan: Plan | None, total_s: float) -> str:
    """The request's log line: JSON with fixed keys (null where a field does not apply). The
    tenant is the key's short hash (never the key); no message content."""
    usage = (plan.usage if plan is not None else None) or {}
    details = usage.get("prompt_tokens_details") or {}
    timings = plan.timings if plan is not None else {}
    return orjson.dumps(
        {  # orjson: the same JSON as json.dumps for these str/int/float/bool/None values, ~10x faster
            "ts": round(time.time(), 3),
            "request_id": rid,
            "tenant": state["tenant"],
            "api": api,
            "stream": plan.stream if plan is not None else None,
            "status": state["status"],
            "route": plan.route if plan is not None else None,
            "fallback": plan.fallback if plan is not None else None,
            "sticky": plan.sticky if plan is not None else None,
            "queue_s": round(plan.queue_wait_s, 4) if plan is not None else None,
            "route_s": _round4(timings.get("route_s")),
            "answer_s": _round4(timings.get("answer_s")),
            "ttft_s": _round4(timings.get("ttft_s")),
            "total_s": round(total_s, 4),
            "tokens_in": usage.get("prompt_tokens"),
            "tokens_out": usage.get("completion_tokens"),
            "tokens_cached": details.get("cached_tokens") if isinstance(details, dict) else None,
            "client_disconnect": bool(state.get("disconnected")),
            # the error code the client got (its status, or the error frame ending a 200 stream); null if none
            "error": state.get("error"),
        }
    ).decode()


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def key_table(keys: list[str]) -> dict[bytes, str]:
    """The accepted keys by their SHA-256 digest, each with its tenant id (a short hash). A
    request's key is looked up by its digest: one hash per request whatever the number of keys,
    and the lookup's timing says nothing about the keys. Pure: SIGHUP builds it in a worker thread."""
    return {d: d.hex()[:16] for d in {hashlib.sha256(k.encode()).digest() for k in keys}}


def too_large(unread: bool = False) -> ProxyError:
    """413; `unread`: the body was not read, so the connection is closed after the answer."""
    return ProxyError(
        413,
        f"The request body exceeds {MAX_BODY} bytes.",
        "invalid_request_error",
        "request_too_large",
        headers={"connection": "close"} if unread else None,
    )


def internal_error(rid: str) -> ProxyError:
    return ProxyError(500, f"Internal proxy error (request id {rid}).", "server_error", "proxy_error")


async def parse_on_loop(raw: bytes) -> Any:
    """A body up to BIG_BODY: orjson on the event loop; what only the standard library reads (NaN,
    19-digit numbers, invalid JSON: ~100 ms for a MiB of floats) in a worker thread."""
    body = parse_body(raw, fast_only=True)
    if body is fastjson.FALLBACK:
        body = await asyncio.to_thread(parse_body, raw)
    return body


def many_items(body: Any, field: str) -> bool:
    """Whether `body[field]` (a request's messages or input items) holds over BIG_ITEMS items,
    content parts and tool calls, with the request's tools: its preparation then runs in a worker
    thread. Any shape; validation comes later."""
    if not isinstance(body, dict):
        return False
    items, tools = body.get(field), body.get("tools")
    count = len(tools) if isinstance(tools, list) else 0
    if not isinstance(items, list):
        return count > BIG_ITEMS
    count += len(items)
    if count > BIG_ITEMS:
        return True
    for item in items:
        if not isinstance(item, dict):
            continue
        for nested in (item.get("content"), item.get("tool_calls")):
            if isinstance(nested, list):
                count += len(nested)
        if count > BIG_ITEMS:
            return True
    return False
