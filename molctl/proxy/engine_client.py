"""The one engine client: aiohttp (about 1 ms cheaper per call than httpx on the 2-core machine
the project was measured on; BENCHMARKS.md), one pooled session, every request labelled with
`X-MoL-Hop`."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from molctl.proxy.errors import EngineHTTPError, EngineUnavailable

HOP_HEADER = "X-MoL-Hop"
REQUEST_ID_HEADER = "X-Request-Id"  # the client request's id on every hop, so engine logs can be joined


def hop_headers(hop: str, request_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", HOP_HEADER: hop}
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return headers
BIG_PAYLOAD_MESSAGES = 2000  # serialise larger payloads in a thread, off the event loop
CHAT_PATH = "/v1/chat/completions"


@dataclass
class EngineChoice:
    """Conversation affinity (proxy replicas on a shared store): the request's chat hops go to
    `url`, the engine of `replica`, instead of this proxy's own upstream. `failed` is set when
    that engine refused the connection: the remaining hops go to the own engine (a takeover)."""

    replica: str
    url: str
    failed: bool = False


# Set once per request by the orchestrator (`Orchestrator.load`); tasks started by the request
# (its summary hop) inherit it. None: this proxy's own upstream.
ENGINE: contextvars.ContextVar[EngineChoice | None] = contextvars.ContextVar("molctl_engine", default=None)


def dumps_in_steps(payload: dict[str, Any], step: int = 1000) -> bytes:
    """json.dumps(payload), the messages `step` at a time: run in a worker thread, it lets the
    event loop take the GIL between steps (one json.dumps of 8 MiB holds it for about 100 ms)."""
    rest = {k: v for k, v in payload.items() if k != "messages"}
    messages = payload.get("messages") or []
    parts = [json.dumps(messages[i:i + step])[1:-1] for i in range(0, len(messages), step)]
    head = json.dumps(rest)
    return (head[:-1] + (", " if rest else "") + '"messages": [' + ", ".join(parts) + "]}").encode()


async def encode(payload: dict[str, Any], big: bool = False) -> bytes | str:
    if big or len(payload.get("messages") or ()) > BIG_PAYLOAD_MESSAGES:
        return await asyncio.to_thread(dumps_in_steps, payload)
    return json.dumps(payload)


def http_error(status: int, raw: bytes, headers: Any) -> EngineHTTPError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = raw.decode(errors="replace")
    exc = EngineHTTPError(status, body)
    exc.retry_after = headers.get("Retry-After")
    return exc


def error_frame(event: dict[str, Any]) -> EngineHTTPError | None:
    """vLLM ends a failing stream with `data: {"error": {...}}` then `[DONE]`
    (vllm/entrypoints/openai/chat_completion/serving.py, create_streaming_error_response);
    older versions and SGLang send the error object flat (`"object": "error"`)."""
    if isinstance(event.get("error"), dict):
        err = event["error"]
    elif event.get("object") == "error":
        err = event
    else:
        return None
    code = err.get("code")
    return EngineHTTPError(code if isinstance(code, int) and 400 <= code < 600 else 500, {"error": err}, in_stream=True)


class EngineClient:
    def __init__(self, base_url: str, connect_timeout: float = 5.0, read_timeout: float = 1800.0,
                 max_connections: int = 512):
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout,
                                              sock_read=read_timeout)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=15, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, trust_env=False,
                                                  json_serialize=json.dumps)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "EngineClient.start() was not awaited"
        return self._session

    async def get(self, path: str, timeout: float = 2.0) -> tuple[int, Any]:
        try:
            async with self.session.get(self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
                try:
                    return resp.status, json.loads(body) if body else None
                except ValueError:
                    return resp.status, body.decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(str(exc) or type(exc).__name__) from None

    async def _post(self, data: bytes | str, hop: str, request_id: str | None = None, **kw: Any) -> aiohttp.ClientResponse:
        """POST a chat hop to the request's engine (ENGINE, else the own upstream). A peer's engine
        that refuses the connection, never accepts it within the connect timeout or whose URL is
        unusable (nothing was sent in any case) is given up for the rest of the request."""
        headers = hop_headers(hop, request_id)
        choice = ENGINE.get()
        if choice is not None and not choice.failed:
            try:
                return await self.session.post(choice.url.rstrip("/") + CHAT_PATH, data=data, headers=headers, **kw)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL,
                    aiohttp.NonHttpUrlClientError):  # nothing was sent: this request's hops go to the own engine
                choice.failed = True
        return await self.session.post(self.base_url + CHAT_PATH, data=data, headers=headers, **kw)

    async def chat(self, payload: dict[str, Any], hop: str, timeout: float | None = None, big: bool = False,
                   request_id: str | None = None) -> dict[str, Any]:
        """Non-streaming chat completion; raises EngineHTTPError / EngineUnavailable. `big`:
        encode the payload in a worker thread."""
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        data = await encode(payload, big)
        try:
            async with await self._post(data, hop, request_id, **kw) as resp:
                raw = await resp.read()
                status = resp.status
                headers = resp.headers
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(str(exc) or type(exc).__name__) from None
        if status != 200:
            raise http_error(status, raw, headers)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise EngineHTTPError(502, raw.decode(errors="replace")[:500])
        return body

    async def chat_stream(self, payload: dict[str, Any], hop: str, big: bool = False,
                          request_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Streaming chat completion: yields each SSE `data:` JSON object until `[DONE]`.

        Cancelling the consumer closes the connection, which makes the engine abort the request."""
        data = await encode(payload, big)
        try:
            resp = await self._post(data, hop, request_id)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(str(exc) or type(exc).__name__) from None
        try:
            if resp.status != 200:
                raise http_error(resp.status, await resp.read(), resp.headers)
            data_lines: list[bytes] = []
            try:
                async for line in resp.content:
                    line = line.rstrip(b"\r\n")
                    if line.startswith(b"data:"):
                        data_lines.append(line[5:].lstrip())
                        continue
                    if line or not data_lines:
                        continue
                    data = b"\n".join(data_lines)
                    data_lines = []
                    if data == b"[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    failure = error_frame(event)
                    if failure is not None:
                        raise failure
                    yield event
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise EngineUnavailable(str(exc) or type(exc).__name__) from None
            if data_lines and b"\n".join(data_lines) == b"[DONE]":
                return
            raise EngineUnavailable("the engine's stream ended without [DONE]")
        finally:
            resp.close()
