"""The proxy's raw ASGI application (no framework on the hot path: BENCHMARKS.md has the numbers).

`ProxyApp` turns bytes into request plans and a plan's events into bytes: auth (`Authorization:
Bearer <key>` against the key file's keys, by digest), request ids (`x-request-id` on every
response), drain, body limits (`body`), the SSE writer (`sse`), OpenAI error shapes (`errors`),
the request log line and `requests_total`. It dispatches to the APIs (`apis.chat`, `apis.models`,
`apis.responses.handlers`) through an `Exchange`; it never decides routes, stickiness,
persistence or retries (`pipeline`).
Endpoints: GET|HEAD /health (liveness, no auth), GET|HEAD /readyz (no auth; 503 unless the engine
answers and lists L0-L3 under the expected parent and the proxy is not draining; probe cached
~1 s), GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/responses,
GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel,
POST /v1/responses/compact, and the Conversations API under /v1/conversations (apis.conversations).
Metrics are on their own listener (`metrics`, `proxy.metrics_port`).
Drain: `start_drain()` (on SIGTERM) turns /readyz to 503 and answers new requests 503 with
Retry-After while in-flight requests run to completion; at the drain deadline `cut_requests()`
answers those still running itself (a 503 `draining` naming the request id; an error frame for a
stream already started). Failures: a malformed request is a JSON 400 naming the field; anything
unexpected is logged once with its request id and answered as a JSON 500 naming that id.
docs/design/proxy.md, "The HTTP layer", has the reasoning.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs

from molctl.engines.base import READYZ_ENGINE_PROBE_MIN_S, Engine, adapter_problems
from molctl.profiles import Profile
from molctl.proxy import fastjson, tracing
from molctl.proxy.apis.chat import ChatAPI
from molctl.proxy.apis.chat_validation import parse_body
from molctl.proxy.apis.conversations.handlers import ConversationsAPI
from molctl.proxy.apis.conversations.records import ConversationRecords, ResponsesOnly
from molctl.proxy.apis.models import ModelsAPI
from molctl.proxy.apis.responses.handlers import ResponsesAPI
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
    websocket_mode,
)
from molctl.proxy.http.body import BIG_BODY, ClientGone, many_items, parse_on_loop, read_body
from molctl.proxy.http.requestlog import request_line
from molctl.proxy.http.sse import SSEWriter, internal_error, timing_headers
from molctl.proxy.metrics import MetricsListener, ProxyMetrics, store_gauges
from molctl.proxy.pipeline.plan import Plan, RequestState
from molctl.proxy.pipeline.run import Orchestrator
from molctl.proxy.store.base import ConversationStore, RecordStore, ResponseStore, StoreBusy, StoreError
from molctl.proxy.store.local import as_proxy_store
from molctl.proxy.store.memory import MemoryResponseStore, MemoryStore

log = logging.getLogger("molctl.proxy")
request_log = logging.getLogger("molctl.proxy.requests")  # one JSON line per request (`requestlog`)
REQUEST_ID_RE = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")  # an incoming X-Request-Id we pass on as it is
UNCOUNTED = ("/health", "/readyz")  # probes (GET or HEAD): neither counted nor logged per request
PROBE_METHODS = ("GET", "HEAD")  # another method on a probe path is a request like any other (401 without a key)

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

JSON_HEADERS = [(b"content-type", b"application/json")]


async def write_json(send: Send, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
    raw = fastjson.dumps_bytes(body)
    hdrs = JSON_HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


T = TypeVar("T")


class Exchange:
    """One request as an API handler sees it (`apis.exchange.Exchange`): its body, query, state,
    and the ways to answer."""

    def __init__(self, app: ProxyApp, scope: dict, receive: Receive, send: Send, state: RequestState):
        self.app, self.scope, self.receive, self.send, self.state = app, scope, receive, send, state

    @property
    def tenant(self) -> str:
        return self.state.tenant  # type: ignore[return-value]  # set once authenticated

    async def body(self) -> bytes:
        proxy = self.app.profile.proxy
        return await read_body(
            self.scope["headers"], self.receive, proxy.stream_write_timeout_s, proxy.request_body_timeout_s
        )

    async def json_body(self, items_key: str, build: Callable[[Any], T]) -> tuple[T, bool]:
        """See `apis.exchange.Exchange.json_body`: the one body policy of every API."""
        raw = await self.body()
        if len(raw) > BIG_BODY:  # parsed in steps, and built, in a worker thread
            return await asyncio.to_thread(lambda: build(parse_body(raw, in_steps=True))), True
        body = await parse_on_loop(raw)
        if many_items(body, items_key):
            return await asyncio.to_thread(build, body), True
        return build(body), False

    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.scope.get("query_string", b"").decode("latin-1"))

    def track(self, plan: Plan) -> None:
        plan.request_id = self.state.request_id
        self.state.plan = plan

    async def json(self, status: int, body: Any, raw: bytes | None = None) -> None:
        timing = timing_headers(self.state.plan)  # an answer's x-mol-route-ms, x-mol-overhead-ms
        if raw is not None:
            await self.send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + timing})
            await self.send({"type": "http.response.body", "body": raw})
            return
        extra = {k.decode(): v.decode() for k, v in timing}
        await write_json(self.send, status, body, {"x-request-id": self.state.request_id, **extra})

    async def run(self, plan: Plan, coro: Awaitable[None]) -> None:
        """Run one answer while watching the client (`ProxyApp.run`)."""
        await self.app.run(plan, self.receive, self.state, coro)

    async def stream(self, plan: Plan, chunks: Any, **framing: Any) -> bool:
        """Write `chunks` as SSE (`sse.SSEWriter.write`); True when the client has all of it."""
        return await self.app.sse.write(self.send, self.state, plan, chunks, **framing)


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
            upstream,
            request_id_field=engine.request_id_field,
            request_id_unique=engine.request_id_unique,
            max_body=profile.proxy.engine_body_max_bytes,
        )
        self.tracing = tracing.start(profile, engine)  # None: traces are off
        # the pipeline's hops: each a span of its request's when traces are on
        hops = self.client if self.tracing is None else tracing.TracedEngineClient(self.client, self.tracing)
        self.counters = ProxyMetrics(self._gauges, self._store_counters)
        self.orch = Orchestrator(profile, engine, hops, store or MemoryStore(), self.counters)
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
        self.clock = time.monotonic  # the readiness cache's clock (a test moves its own)
        self._ready: tuple[float, bool, str] = (-math.inf, False, "not probed")
        self._ready_lock = asyncio.Lock()
        self.draining = False
        self.inflight = 0  # answers running (the inflight_requests gauge)
        # requests admitted (past the draining check) and not finished, their body still being read
        # included: what a drain waits for (_idle)
        self.admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._running: dict[asyncio.Task, RequestState] = {}  # admitted requests' tasks, with their state
        self._cut: asyncio.Future | None = None  # done at the drain deadline (cut_requests): streams end with it
        self.sse = SSEWriter(self.counters, sse_keepalive_s, profile.proxy.stream_write_timeout_s, self._cut_future)
        self.chat = ChatAPI(self.orch)
        self.models = ModelsAPI(profile.served_model_name)
        conversations = ConversationRecords(self.responses)  # conversations: records of the same store
        self.responses_api = ResponsesAPI(self.orch, profile, ResponsesOnly(self.responses), conversations)
        self.conversations_api = ConversationsAPI(conversations, profile, self.orch.fields)

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
        self.responses_api.background.start()  # background responses' leases and sweep

    async def _engine_healthy(self) -> bool:
        return (await self.ready())[0]

    async def shutdown(self) -> None:
        for task in list(self.orch.background):
            task.cancel()
        await self.responses_api.background.close()  # its running jobs failed, naming why, while the store is open
        if self.metrics_listener is not None:
            await self.metrics_listener.close()
        await self.client.close()
        self.responses.close()
        if self.tracing is not None:
            self.tracing.close()
        if self.shared_state is not None:
            await self.shared_state.close()

    def start_drain(self) -> None:
        self.draining = True

    async def wait_background(self, timeout: float) -> bool:
        """Wait for the background summary hops (a drain: a turn answered just before SIGTERM keeps
        its summary, written to the state store before exit); False when some outlast `timeout`
        (they are cancelled at shutdown: their turns stay without a summary, as after a failed one).
        Background responses running here are waited for too (those still running at shutdown fail,
        naming why: apis.responses.background)."""
        tasks = list(self.orch.background) + list(self.responses_api.background.tasks.values())
        if not tasks:
            return True
        log.info("drain: waiting for %d summary hop(s) and background response(s)", len(tasks))
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
            if not state.streaming and not task.done():
                state.cut = True
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
        state = RequestState(rid)
        span = self.tracing.server(scope) if self.tracing is not None else None  # made current: the hops' parent

        async def tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                state.started = True
                state.status = message["status"]
                headers = message.get("headers") or []
                if not any(name == b"x-request-id" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self._route(scope, receive, tracked, state)
        except Exception as exc:  # ProxyError, ClientGone, RecursionError, a store fault, a bug: see _failure
            failure = self._failure(exc, state)
            if failure is not None and not state.started:
                await self._error(tracked, failure, rid)
        except asyncio.CancelledError:
            if not state.cut:
                raise
            asyncio.current_task().uncancel()  # cancelled by cut_requests (the drain deadline): answered here
            state.error = "draining"
            if not state.started:
                await self._error(tracked, draining(rid), rid)
        finally:
            if scope["method"] not in PROBE_METHODS or (scope["path"].rstrip("/") or "/") not in UNCOUNTED:  # as _route
                self._count(scope, state)
            if span is not None:
                span.end(state)

    def _failure(self, exc: Exception, state: RequestState) -> ProxyError | None:
        """What a request that raised `exc` is answered (None: nothing, the client left), counted and logged."""
        rid = state.request_id
        if isinstance(exc, ProxyError):
            state.error = exc.code or exc.type
            return exc
        if isinstance(exc, ClientGone):  # left while sending its body: nothing to answer, nothing to log but its line
            self.counters.inc("client_disconnects_total")
            state.disconnected = True
            return None
        if isinstance(
            exc, RecursionError
        ):  # JSON the parser accepted (in a worker thread) but too deep to encode again
            return invalid("The body is nested too deeply to be a chat request.")
        if isinstance(
            exc, (StoreError, StoreBusy)
        ):  # an external fault (a full disk, another process's lock): one line
            failure = store_failure(exc, rid) or internal_error(rid)
            state.error = failure.code
            if failure.status >= 500:  # not a record over its quota (a 400: the client's to change)
                self.counters.inc("internal_errors_total")
            self.counters.inc("store_failures_total", cause=store_cause(exc))
            log.warning("request %s failed: %s", rid, exc)
            return failure
        state.error = "proxy_error"  # a bug: logged once, answered in the OpenAI error shape
        self.counters.inc("internal_errors_total")
        log.exception("request %s failed", rid, exc_info=exc)
        return internal_error(rid)

    async def _websocket(self, scope: dict, send: Send) -> None:
        """A WebSocket upgrade: there is no WebSocket endpoint, so it is answered over HTTP (401
        without a key; to /v1/responses a 400 naming OpenAI's WebSocket mode; else 404 `not_found`;
        JSON, counted and logged), with the ASGI denial response; a server without the denial extension gets a close
        before the handshake (its 403). docs/design/proxy.md, "WebSocket upgrades"."""
        denial = "websocket.http.response" in (scope.get("extensions") or {})

        async def as_denial(message: dict) -> None:
            if denial:
                await send({**message, "type": "websocket." + message["type"]})  # websocket.http.response.*
            elif message["type"] == "http.response.start":
                await send({"type": "websocket.close", "code": 1008})

        async def no_body() -> dict:  # never read: no endpoint takes the WEBSOCKET method
            return {"type": "http.disconnect"}

        await self({**scope, "type": "http", "method": "WEBSOCKET"}, no_body, as_denial)

    def _count(self, scope: dict, state: RequestState) -> None:
        """requests_total by API, status and stream, and the request's log line."""
        plan = state.plan
        path = scope["path"]
        api = (
            "chat"
            if path.startswith("/v1/chat/")
            else "responses"
            if path.startswith(("/v1/responses", "/v1/conversations"))
            else "models"
            if path.startswith("/v1/models")
            else "other"
        )
        stream = bool(plan is not None and plan.stream)
        self.counters.inc("requests_total", api=api, status=str(state.status), stream="true" if stream else "false")
        self.counters.finished(api, plan, time.monotonic() - state.t0)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(request_line(state, api, time.monotonic() - state.t0))

    async def _route(self, scope: dict, receive: Receive, send: Send, state: RequestState) -> None:
        path = scope["path"].rstrip("/") or "/"
        method = scope["method"]
        if path == "/health" and method in PROBE_METHODS:  # uvicorn sends no body to a HEAD
            await write_json(send, 200, {"status": "draining" if self.draining else "ok"})
            return
        if path == "/readyz" and method in PROBE_METHODS:
            ok, why = await self.ready()
            degraded = self.responses_degraded() if ok else None  # still serving: 200, with the reason
            await write_json(
                send,
                200 if ok else 503,
                {"status": "degraded" if degraded else "ready" if ok else "not_ready", "detail": degraded or why},
            )
            return
        state.tenant = self._authenticate(scope)
        if self.draining:
            raise draining()
        # admitted: a drain that starts from now on waits for this request, even while its body is
        # still arriving (counted from run only, it was cut at uvicorn's 5 s shutdown grace: a 500)
        self.admitted += 1
        self._idle.clear()
        task = asyncio.current_task()
        self._running[task] = state
        try:
            await self._dispatch(Exchange(self, scope, receive, send, state), path, method)
        finally:
            self._running.pop(task, None)
            self.admitted -= 1
            if self.admitted == 0:
                self._idle.set()

    async def _dispatch(self, ex: Exchange, path: str, method: str) -> None:
        if path == "/v1/models" and method == "GET":
            await self.models.list(ex)
        elif path.startswith("/v1/models/") and method == "GET":
            await self.models.get(ex, path[len("/v1/models/") :])
        elif path == "/v1/chat/completions" and method == "POST":
            await self.chat.create(ex)
        elif path == "/v1/responses" and method == "POST":
            await self.responses_api.create(ex)
        elif path == "/v1/responses/compact" and method == "POST":
            await self.responses_api.compact(ex)
        elif path.startswith("/v1/conversations") and await self.conversations_api.dispatch(ex, path, method):
            pass
        elif path == "/v1/responses" and method == "WEBSOCKET":
            raise websocket_mode()
        elif not (path.startswith("/v1/responses/") and await self._dispatch_response(ex, path, method)):
            raise ProxyError(
                404,
                f"Unknown endpoint: {method} {shown(ex.scope['path'])}",
                "invalid_request_error",
                "not_found",
                "path",
            )

    async def _dispatch_response(self, ex: Exchange, path: str, method: str) -> bool:
        """/v1/responses/{id}[/input_items|/cancel]; False: no such endpoint."""
        rest = path[len("/v1/responses/") :]
        if rest.endswith("/input_items") and "/" not in rest[: -len("/input_items")] and method == "GET":
            await self.responses_api.input_items(ex, rest[: -len("/input_items")])
        elif rest and "/" not in rest and method == "GET":
            await self.responses_api.get(ex, rest)
        elif rest and "/" not in rest and method == "DELETE":
            await self.responses_api.delete(ex, rest)
        elif rest.endswith("/cancel") and "/" not in rest[: -len("/cancel")] and method == "POST":
            await self.responses_api.cancel(ex, rest[: -len("/cancel")])
        else:
            return False
        return True

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

    async def _error(self, send: Send, exc: ProxyError, rid: str | None = None) -> None:
        await write_json(send, exc.status, exc.body(), {**exc.headers, **({"x-request-id": rid} if rid else {})})

    def _gauges(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """Read at scrape time (on the event loop): in-flight hops, queue depth, store sizes."""
        adm = self.orch.admission
        conversations = self.orch.store.stats()  # one read per scrape (SQLite: a query)
        return {
            "inflight_hops": {
                (("hop", "answer"),): adm.answers.inflight,
                (("hop", "route"),): adm.routes.inflight,
                (("hop", "summary"),): self.orch.summaries.running,
            },
            "queue_depth": {
                (("hop", "answer"),): adm.answers.waiting,
                (("hop", "route"),): adm.routes.waiting,
                (("hop", "summary"),): self.orch.summaries.waiting,
            },
            "num_requests_running": {(): adm.answers.inflight},  # vLLM's names: answer slots held
            "num_requests_waiting": {(): adm.answers.waiting},  # and requests waiting for one
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
            self._ready = (self.clock(), ok, why)
            return ok, why

    def responses_degraded(self) -> str | None:
        """Why the local response store serves in part (damaged; writes failing), else None."""
        return self.responses.health()

    def _ready_cached(self) -> bool:
        """A ready answer is reused for ready_cache_s; a not-ready one for at most 0.2 s, so
        readiness shows within moments of the engine serving."""
        stamp, ok, _ = self._ready
        return self.clock() - stamp < (self.ready_cache_s if ok else min(0.2, self.ready_cache_s))

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

    async def run(self, plan: Plan, receive: Receive, state: RequestState, coro: Awaitable[None]) -> None:
        """Run one answer (`coro`) while watching the client: a disconnect cancels it."""
        self.inflight += 1
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:  # the client went away: cancel the upstream request with it
                self.counters.inc("client_disconnects_total")
                state.disconnected = True
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


def incoming_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """A client's X-Request-Id when it is 1-128 characters of [A-Za-z0-9._:/+=-]; else None
    (the proxy makes one)."""
    for name, value in headers:
        if name == b"x-request-id":
            return value.decode("ascii") if REQUEST_ID_RE.fullmatch(value) else None
    return None


def key_table(keys: list[str]) -> dict[bytes, str]:
    """The accepted keys by their SHA-256 digest, each with its tenant id (a short hash). A
    request's key is looked up by its digest: one hash per request whatever the number of keys,
    and the lookup's timing says nothing about the keys. Pure: SIGHUP builds it in a worker thread."""
    return {d: d.hex()[:16] for d in {hashlib.sha256(k.encode()).digest() for k in keys}}
