"""The one engine client: a lean keep-alive HTTP/1.1 client over asyncio (httptools parses the
responses; a pool of idle connections), every request labelled with `X-MoL-Hop`. It replaced
aiohttp's client, which cost about 3x the CPU per engine request on the proxy's hot path (three
engine requests per turn; BENCHMARKS.md, "Proxy overhead")."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from molctl.proxy import fastjson
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.engine_wire import _Connection, _lines
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable
from molctl.proxy.scheduler_hints import hop_headers

HOP_HEADER = "X-MoL-Hop"
REQUEST_ID_HEADER = "X-Request-Id"  # the client request's id on every hop, so engine logs can be joined


def hop_request_id(request_id: str, hop: str) -> str:
    """The id a hop of a client request carries to the engine: the request's id and the hop
    (`req-1f..-route`, `-answer`, `-summary`), so that engine log lines join to the proxy's
    request log by prefix and no two engine requests share an id."""
    return f"{request_id}-{hop}"


# a reused connection closed by the engine this soon after the send, without a byte, was closed
# as idle (the engine's keep-alive timeout) before the request reached it: retried once
STALE_CLOSE_S = 1.0


class _ConnectFailed(EngineUnavailable):
    """No connection to the engine could be made: nothing was sent."""


BIG_PAYLOAD_MESSAGES = 2000  # serialise larger payloads in a thread, off the event loop
CHAT_PATH = "/v1/chat/completions"
# A non-streamed answer's body, at most, by default (`proxy.engine_body_max_bytes`): a 262,144-token
# window's prompt and output token ids are under 2.5 MB, its text at most a few MB; the rest is
# room for logprobs (about 1.5 KB per token at top_logprobs 20, 131,072 tokens: 200 MB).
MAX_ENGINE_BODY = 512 << 20
LIFT_HOPS = ("answer", "speculative")  # hops whose answers' token ids go on to the summary as they came


def dumps_in_steps(payload: dict[str, Any], step: int = 1000) -> bytes:
    """The payload as JSON (`fastjson.dumps_bytes`), the messages `step` at a time: run in a worker
    thread, it lets the event loop take the GIL between steps (225k messages in one call hold it
    for ~25 ms with orjson, ~150 ms with the standard library, which this used before)."""
    rest = {k: v for k, v in payload.items() if k != "messages"}
    messages = payload.get("messages") or []
    parts = [fastjson.dumps_bytes(messages[i : i + step])[1:-1] for i in range(0, len(messages), step)]
    head = fastjson.dumps_bytes(rest)
    return head[:-1] + (b"," if rest else b"") + b'"messages":[' + b",".join(parts) + b"]}"


async def encode(payload: dict[str, Any], big: bool = False) -> bytes:
    if big or len(payload.get("messages") or ()) > BIG_PAYLOAD_MESSAGES:
        return await asyncio.to_thread(dumps_in_steps, payload)
    return fastjson.dumps_bytes(payload)


def http_error(status: int, raw: bytes, headers: Any) -> EngineHTTPError:
    try:
        body = fastjson.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    exc = EngineHTTPError(status, body)
    exc.retry_after = headers.get("Retry-After")
    return exc


def error_frame(event: dict[str, Any]) -> EngineHTTPError | None:
    """vLLM ends a failing stream with `data: {"error": {...}}` then `[DONE]`
    (vllm/entrypoints/openai/chat_completion/serving.py, create_streaming_error_response); so does
    SGLang (serving_base.py create_streaming_error_response: `{"error": {"object": "error",
    "message", "type", "param", "code"}}`; a scheduler abort's `code` is its HTTP status, 400, 500
    or 503, and may come as the first event under the 200: serving_chat.py, PR #19357); older
    versions send the error object flat (`"object": "error"`, SGLang's HTTP error body); a bare
    `{"error": "text"}` is an error too."""
    if isinstance(event.get("error"), dict):
        err = event["error"]
    elif isinstance(event.get("error"), str):
        err = {"message": event["error"]}
    elif event.get("object") == "error":
        err = event
    else:
        return None
    code = err.get("code")
    return EngineHTTPError(code if isinstance(code, int) and 400 <= code < 600 else 500, {"error": err}, in_stream=True)


def _text(value: Any) -> bool:
    return value is None or isinstance(value, str)


TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


def _bad_message(message: Any, streaming: bool) -> bool:
    """A message (or a stream's delta) the proxy cannot shape: not an object, a text field that is
    not a string, tool calls that are not a list of objects with string name/arguments (and, in a
    stream, an integer index)."""
    if not isinstance(message, dict) or not all(_text(message.get(k)) for k in TEXT_FIELDS):
        return True
    calls = message.get("tool_calls")
    if calls is None:
        return False
    if not isinstance(calls, list):
        return True
    for call in calls:
        if not isinstance(call, dict):
            return True
        index = call.get("index")
        if streaming and index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            return True
        fn = call.get("function")
        if fn is not None and (not isinstance(fn, dict) or not _text(fn.get("name")) or not _text(fn.get("arguments"))):
            return True
    return False


def checked_completion(body: dict[str, Any]) -> dict[str, Any]:
    """A 200 chat completion the proxy can use (its first choice holds a message it can shape);
    else EngineHTTPError 502: no choice, or a malformed one, is the engine's failure."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise EngineHTTPError(502, "the engine answered 200 without a choice")
    if not isinstance(choices[0], dict) or _bad_message(choices[0].get("message"), False):
        raise EngineHTTPError(502, "the engine answered 200 with a malformed choice")
    return body


def event_problem(event: dict[str, Any]) -> str | None:
    """Why a stream event is unusable, or None. No `choices` (a usage-only event) is fine, as is
    a null delta; choices that are not a list of objects, or a malformed delta, are not."""
    choices = event.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return "choices that are not a list"
    for choice in choices:
        if not isinstance(choice, dict):
            return "a choice that is not an object"
        delta = choice.get("delta")
        if delta is not None and _bad_message(delta, True):
            return "a malformed delta"
    return None


class _NoSlot:
    """The slot of a request that takes none (a probe)."""

    async def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


_NO_SLOT = _NoSlot()


class EngineClient:
    def __init__(
        self,
        base_url: str,
        connect_timeout: float = 5.0,
        read_timeout: float = 1800.0,
        max_connections: int = 512,
        keepalive_s: float = 15.0,
        request_id_field: str | None = None,
        request_id_unique: bool = False,
        max_body: int = MAX_ENGINE_BODY,
    ):
        self.max_body = max_body  # a non-streamed answer's body, at most (`_read_all`)
        self.request_id_field = request_id_field  # see Engine.request_id_field
        self.request_id_unique = request_id_unique  # see Engine.request_id_unique
        self.base_url = base_url.rstrip("/")
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"engine URL {base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = url.scheme == "https"
        self._prefix = url.path
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = host if url.port is None else f"{host}:{self._port}"
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.keepalive_s = keepalive_s
        self._max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None
        self._idle: deque[_Connection] = deque()
        self._busy: set[_Connection] = set()
        self._ssl_context: ssl.SSLContext | None = None
        self._peers: dict[str, EngineClient] = {}  # other replicas' engines (conversation affinity)

    async def start(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
            if self._ssl:
                self._ssl_context = ssl.create_default_context()

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()
        for conn in (*self._idle, *self._busy):
            conn.abort()
        self._idle.clear()
        self._busy.clear()
        self._slots = None

    # ---- connections
    def _request(
        self, method: str, path: str, body: bytes | None, hop: str | None, headers: dict[str, str] | None = None
    ) -> bytes:
        """The request's bytes. `headers`: extra ones (e.g. a request id), names and values that
        are header-safe (no CR/LF: refused with ValueError)."""
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
        if hop is not None:
            head += f"Content-Type: application/json\r\n{HOP_HEADER}: {hop}\r\n"
        for name, value in (headers or {}).items():
            if any(c in name or c in value for c in "\r\n") or ":" in name:
                raise ValueError(f"engine request header {name!r}: not a valid header name/value")
            head += f"{name}: {value}\r\n"
        if body is None:
            return (head + "\r\n").encode("latin-1")
        return (head + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body

    def _idle_connection(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely closed by the engine
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, self.read_timeout),
                    self._host,
                    self._port,
                    ssl=self._ssl_context,
                    server_hostname=self._host if self._ssl else None,
                )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise _ConnectFailed(
                f"cannot connect to the engine at {self._host}:{self._port}: {str(exc) or type(exc).__name__}"
            ) from None
        return conn

    async def _exchange(self, request: bytes, timeout: float | None, limited: bool = True) -> _Connection:
        """Send one request on a pooled (or new) connection and wait for the response's headers.
        A reused keep-alive connection that the engine closed before answering a byte, within
        STALE_CLOSE_S of the send, is retried once on a new one: the keep-alive race (the engine
        closed it as idle while the request was on its way). Not one closed later (the engine had
        the request and died on it: a retry would send it again, to a restarted engine too), nor
        one that timed out (the engine has that request). The caller must `_release` the connection.
        `limited`: the request waits for one of the `max_connections` slots (chat hops); a probe
        (`get`: /readyz's /health and /v1/models) does not, so that it answers within its own
        timeout while every slot is held by a long generation or an engine that stopped answering."""
        slots = self._slots  # its own: close() may drop the pool's while this request waits
        if slots is None:
            raise AssertionError("EngineClient.start() was not awaited")
        if not limited:
            slots = _NO_SLOT
        await slots.acquire()
        try:
            conn = self._idle_connection()
            reused = conn is not None
            while True:
                if conn is None:
                    conn = await self._connect()
                self._busy.add(conn)
                conn.slot = slots
                conn.send(request, timeout)
                try:
                    while not conn.headers_done:
                        await conn.wait()
                    return conn
                except EngineUnavailable:
                    self._drop(conn)
                    if (
                        reused
                        and conn.closed_by_engine
                        and not conn.got_bytes
                        and conn.closed_at - conn.sent_at <= STALE_CLOSE_S
                    ):
                        conn, reused = None, False
                        continue
                    if conn.closed_by_engine and not conn.got_bytes:  # it had the request: it died on it
                        raise EngineUnavailable(
                            f"the engine closed the connection {conn.closed_at - conn.sent_at:.1f} s "
                            "into the request without answering (it stopped or crashed)"
                        ) from None
                    raise
                except BaseException:
                    self._drop(conn)
                    raise
        except BaseException:
            slots.release()
            raise

    def _drop(self, conn: _Connection) -> None:
        conn.abort()
        self._busy.discard(conn)

    def _release(self, conn: _Connection) -> None:
        """Back to the pool when the response was read whole on a keep-alive connection; closed
        otherwise (a cancelled stream: the engine sees the close and aborts the request)."""
        self._busy.discard(conn)
        if conn.done and conn.keep_alive and not conn.closed and conn.error is None:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()
        if conn.slot is self._slots and self._slots is not None:  # not a probe's; not a pool that close() dropped
            self._slots.release()
        conn.slot = None

    async def _read_all(self, conn: _Connection) -> bytes:
        """The whole body, taken as it arrives: taking it resumes a connection paused past
        READ_HIGH_WATER, so a body of any size ends (a body left in the connection until the end
        waited out the read timeout past 1 MiB). Past `max_body` bytes the connection is closed
        and the answer is a 502 naming the bound (`proxy.engine_body_max_bytes`)."""
        parts: list[bytes] = []
        size = 0
        while True:
            if conn.body:
                part = conn.take_body()
                size += len(part)
                if size > self.max_body:
                    conn.abort()
                    raise EngineHTTPError(
                        502, f"the engine's answer passed {self.max_body} bytes (proxy.engine_body_max_bytes)"
                    )
                parts.append(part)
                continue
            if conn.done:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await conn.wait()

    # ---- requests
    async def get(self, path: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        conn = await self._exchange(self._request("GET", path, None, None, headers), timeout, limited=False)
        try:
            body = await self._read_all(conn)
        finally:
            self._release(conn)
        try:
            return conn.status, fastjson.loads(body) if body else None
        except ValueError:
            return conn.status, body.decode(errors="replace")

    def target_url(self, engine: EngineChoice | None = None) -> str:
        """The base URL of the engine a hop for `engine` (the request's choice) goes to (see `_peer`)."""
        if engine is None or engine.failed:
            return self.base_url
        return engine.url.rstrip("/")

    def address(self, engine: EngineChoice | None) -> tuple[str, int]:
        """The host and port a hop for `engine` goes to (its span's server.address/port)."""
        if engine is None or engine.failed:
            return self._host, self._port
        url = urlsplit(self.target_url(engine))
        return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)

    def _peer(self, engine: EngineChoice | None) -> EngineClient | None:
        """The client of the engine this request's conversation lives on (`engine`, chosen by the
        pipeline for proxy replicas on a shared store), or None for this proxy's own engine."""
        url = self.target_url(engine)
        if url == self.base_url:
            return None
        peer = self._peers.get(url)
        if peer is None:
            try:
                peer = EngineClient(
                    url,
                    connect_timeout=self.connect_timeout,
                    read_timeout=self.read_timeout,
                    max_connections=self._max_connections,
                    keepalive_s=self.keepalive_s,
                    request_id_field=self.request_id_field,
                    request_id_unique=self.request_id_unique,
                    max_body=self.max_body,
                )
            except ValueError:  # an unusable URL in the store: nothing can be sent there, take over
                engine.failed = True  # a choice: its URL is not this proxy's own
                return None
            peer._slots = asyncio.Semaphore(self._max_connections)
            self._peers[url] = peer
        return peer

    def _hop_ids(self, payload: dict[str, Any], hop: str, request_id: str | None) -> dict[str, str] | None:
        """The hop's id (see hop_request_id) as X-Request-Id, and in the body where the engine
        takes it there too; the extra headers (None without a request id)."""
        if not request_id:
            return None
        hop_id = hop_request_id(request_id, hop)
        if self.request_id_field:
            payload[self.request_id_field] = f"{hop_id}-{os.urandom(4).hex()}" if self.request_id_unique else hop_id
        return {REQUEST_ID_HEADER: hop_id}

    def _headers(
        self,
        payload: dict[str, Any],
        hop: str,
        request_id: str | None,
        trace: dict[str, str] | None,
        engine: EngineChoice | None = None,
    ) -> dict[str, str] | None:
        """The hop's extra headers: its ids (`_hop_ids`), with traces on its traceparent/tracestate,
        and with a scheduler in front (`engine.scheduler`) what it reads (`scheduler_hints`)."""
        headers = self._hop_ids(payload, hop, request_id)
        scheduler = hop_headers(hop, engine)
        if scheduler:
            headers = {**(headers or {}), **scheduler}
        return headers if not trace else {**(headers or {}), **trace}

    async def _open_chat(
        self,
        data: bytes,
        hop: str,
        headers: dict[str, str] | None,
        timeout: float | None,
        path: str = CHAT_PATH,
        engine: EngineChoice | None = None,
    ) -> tuple[EngineClient, _Connection]:
        """Send a chat hop to the request's engine (a peer's, see `_peer`, else the own one) and
        return the client that owns the connection. A peer engine that refuses the connection,
        never accepts it within the connect timeout or whose URL is unusable (nothing was sent in
        any case) is given up for the rest of the request: this replica takes over."""
        peer = self._peer(engine)
        if peer is not None:
            try:
                return peer, await peer._exchange(peer._request("POST", path, data, hop, headers), timeout)
            except _ConnectFailed:
                engine.failed = True
        return self, await self._exchange(self._request("POST", path, data, hop, headers), timeout)

    async def chat(
        self,
        payload: dict[str, Any],
        hop: str,
        *,
        timeout: float | None = None,
        big: bool = False,
        request_id: str | None = None,
        path: str = CHAT_PATH,
        engine: EngineChoice | None = None,
        source: str | None = None,  # read by the traced client (tracing.TracedEngineClient)
        trace: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Non-streaming chat completion; raises EngineHTTPError / EngineUnavailable. `big`:
        encode the payload in a worker thread; `request_id`: sent as X-Request-Id. `path`: another
        JSON endpoint of the same engine (the summary's token-prompt completion, the template
        probe: `Engine.continuation_path`, `Engine.probe_path`); `engine`: the request's engine
        choice (None: this proxy's own upstream); `source`: how the hop's adapter was chosen (its
        span's mol.route.source, with traces on); `trace`: the hop span's traceparent/tracestate."""
        headers = self._headers(payload, hop, request_id, trace, engine)
        data = await encode(payload, big)
        owner, conn = await self._open_chat(data, hop, headers, timeout, path, engine)
        try:
            raw = await self._read_all(conn)
        finally:
            owner._release(conn)
        status = conn.status
        if status != 200:
            raise http_error(status, raw, conn.headers)
        try:  # an answer's long token-id arrays are kept as their text (fastjson.loads_lifting)
            body = fastjson.loads_lifting(raw) if hop in LIFT_HOPS else fastjson.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise EngineHTTPError(502, raw.decode(errors="replace")[:500])
        return body

    def chat_stream(
        self,
        payload: dict[str, Any],
        hop: str,
        *,
        big: bool = False,
        request_id: str | None = None,
        engine: EngineChoice | None = None,
        source: str | None = None,  # read by the traced client (tracing.TracedEngineClient)
        trace: dict[str, str] | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Streaming chat completion: yields each SSE `data:` JSON object until `[DONE]`.

        Cancelling the consumer closes the connection, which makes the engine abort the request.
        `source`, `trace`: see `chat`."""
        return self._stream(payload, hop, big, request_id, engine, trace)

    async def _stream(
        self,
        payload: dict[str, Any],
        hop: str,
        big: bool,
        request_id: str | None,
        engine: EngineChoice | None,
        trace: dict[str, str] | None,
    ) -> AsyncIterator[dict[str, Any]]:
        headers = self._headers(payload, hop, request_id, trace, engine)
        data = await encode(payload, big)
        owner, conn = await self._open_chat(data, hop, headers, None, engine=engine)
        try:
            if conn.status != 200:
                raise http_error(conn.status, await owner._read_all(conn), conn.headers)
            data_lines: list[bytes] = []
            for line in _lines(conn):
                if line is None:
                    await conn.wait()
                    continue
                line = line.rstrip(b"\r\n")
                if line.startswith(b"data:"):
                    data_lines.append(line[5:].lstrip())
                    continue
                if line or not data_lines:
                    continue
                event_data = b"\n".join(data_lines)
                data_lines = []
                if event_data == b"[DONE]":
                    return
                try:  # vLLM's first event carries the prompt's ids: kept as text (fastjson.loads_lifting)
                    event = fastjson.loads_lifting(event_data) if hop in LIFT_HOPS else fastjson.loads(event_data)
                except ValueError:
                    event = None
                if not isinstance(event, dict):  # a lost or cut frame: the answer would be missing a piece
                    raise EngineHTTPError(
                        502, "the engine sent a stream event that is not a JSON object", in_stream=True
                    )
                failure = error_frame(event)
                if failure is not None:
                    raise failure
                problem = event_problem(event)
                if problem is not None:
                    raise EngineHTTPError(502, f"the engine sent a stream event with {problem}", in_stream=True)
                yield event
            if data_lines and b"\n".join(data_lines) == b"[DONE]":
                return
            raise EngineUnavailable("the engine's stream ended without [DONE]")
        finally:
            owner._release(conn)
