"""OpenTelemetry traces: one server span per request, one client span per engine hop.

On when `proxy.otlp_endpoint` is set or the standard variables name a collector
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); off otherwise, and then the
SDK is never imported and the hot path pays one `None` check per request and per hop
(`ProxyApp.tracing`, `EngineClient.tracing`). `start(profile, engine)` builds a `Tracing` or None.
The span names and attributes follow the OpenTelemetry GenAI semantic conventions v1.37.0; the
reasoning (what goes on which span, the parentage, traceparent to the engine, content capture)
is in docs/design/tracing.md.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from molctl import profilechecks
from molctl.errors import ExitStatus, MolctlError
from molctl.proxy.engine_client import CHAT_PATH

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
CAPTURE_VARIABLE = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
CAPTURE_ON = ("true", "1", "span_only", "span_and_event")  # the variable's values that put content on spans
DEFAULT_SERVICE = "molctl-proxy"
PROTOCOLS = ("http/protobuf", "grpc")
# an endpoint variable's value and proxy.otlp_endpoint (`collector_address`); gRPC's exporter also takes HOST:PORT
ENDPOINT_URL = {"http/protobuf": r"https?://[^\s/?#]+(/[^\s?#]*)?", "grpc": r"(https?://)?[^\s/?#]+(/[^\s?#]*)?"}
EXTRA = "pip install 'molctl[otel]'"
PROVIDER = "molctl"  # gen_ai.provider.name of the server span: the proxy is what its clients call
UNTRACED = ("/health", "/readyz")  # probes: no span (they are neither counted nor logged either)
CLOSE_S = 2.0  # the proxy's shutdown waits this long at most for the last spans' export
# the OpenTelemetry API's loggers that warn about a malformed incoming traceparent/tracestate (its text included)
CLIENT_HEADER_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext")
# the SDK's loggers of a collector that is down or slow: a line per retry, per batch, and per span dropped from
# a full queue (that one on the event loop, as spans end): let through at most one record per EXPORT_LOG_EVERY_S
EXPORT_LOGGERS = (
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
)
EXPORT_LOG_EVERY_S = 60.0
# hops whose finish reasons and usage are the request's, copied onto the server span: the answer, or a
# speculative answer the route hop agreed with (a missed one is closed before it reports either)
ANSWER_HOPS = ("answer", "speculative")


def wanted(profile: Any, env: Mapping[str, str] = os.environ) -> bool:
    """Whether traces are on: the profile's endpoint, or a standard endpoint variable."""
    return bool(profile.proxy.otlp_endpoint) or any(env.get(v) for v in ENDPOINT_VARIABLES)


def start(profile: Any, engine: Any, env: Mapping[str, str] = os.environ) -> Tracing | None:
    """The proxy's tracing, or None when off. A missing SDK or exporter, or a protocol the proxy
    cannot export with, is a one-line MolctlError (exit 3) naming what to install or set."""
    if not wanted(profile, env):
        return None
    protocol = next((env[v].strip() for v in PROTOCOL_VARIABLES if env.get(v)), "http/protobuf")
    if protocol not in PROTOCOLS:
        name = next(v for v in PROTOCOL_VARIABLES if env.get(v))
        raise MolctlError(f"{name}={protocol!r}: expected one of {', '.join(PROTOCOLS)}", ExitStatus.CHECK_FAILED)
    if not profile.proxy.otlp_endpoint:  # the profile's own field is checked when the profile loads
        _check_endpoint_variable(env, protocol)
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            exporter = _grpc_exporter(profile.proxy.otlp_endpoint, next(v for v in PROTOCOL_VARIABLES if env.get(v)))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = profile.proxy.otlp_endpoint
            exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces" if endpoint else None)
    except ImportError as exc:
        raise MolctlError(
            f"tracing is on (proxy.otlp_endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT) but {exc.name} is missing: {EXTRA}",
            ExitStatus.CHECK_FAILED,
        ) from None
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # `close` does, bounded
    provider.add_span_processor(BatchSpanProcessor(exporter))
    capture = (env.get(CAPTURE_VARIABLE) or "").strip().lower() in CAPTURE_ON
    return Tracing(provider, profile, engine, capture)


def _check_endpoint_variable(env: Mapping[str, str], protocol: str) -> None:
    """The endpoint variable the exporter reads (the traces one first, as the SDK does) is a URL, as
    `proxy.otlp_endpoint` must be: else a one-line MolctlError (exit 3) rather than an export error
    logged for every batch while no span ever arrives."""
    name = next(v for v in ENDPOINT_VARIABLES if env.get(v))
    value = env[name]
    if not collector_address(value, protocol):
        example = "http://HOST:4318" if protocol == "http/protobuf" else "http://HOST:4317 or HOST:4317"
        raise MolctlError(f"{name}={value!r}: expected a collector URL such as {example}", ExitStatus.CHECK_FAILED)


def collector_address(value: str, protocol: str = "http/protobuf") -> bool:
    """Whether `value` is a collector address the exporter of `protocol` can send to: a URL (gRPC
    also HOST:PORT) whose host and port parse (an unclosed [IPv6 or a port that is no number do not)."""
    from urllib.parse import urlsplit

    if not re.fullmatch(ENDPOINT_URL[protocol], value):
        return False
    try:
        port = urlsplit(value if "://" in value else "//" + value).port  # ValueError when it does not parse
    except ValueError:
        return False
    return port is None or port > 0


def _endpoint_field_problem(proxy) -> tuple[str, str] | None:
    """`proxy.otlp_endpoint` of a profile (registered with molctl.profilechecks)."""
    endpoint = proxy["otlp_endpoint"]
    if collector_address(endpoint):
        return None
    shown = endpoint if len(endpoint) <= 20 else endpoint[:20] + "..."  # as profile errors shorten values
    return "proxy.otlp_endpoint", f"{shown}: expected a collector URL such as http://HOST:4318"


profilechecks.register("proxy.otlp_endpoint", _endpoint_field_problem)


def _grpc_exporter(endpoint: str | None, variable: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise MolctlError(
            f"{variable}=grpc needs opentelemetry-exporter-otlp-proto-grpc: "
            "pip install opentelemetry-exporter-otlp-proto-grpc (or use http/protobuf)",
            ExitStatus.CHECK_FAILED,
        ) from None
    return OTLPSpanExporter(endpoint=endpoint or None)


class Tracing:
    """The tracer, the W3C propagator, and what every span of this proxy says."""

    def __init__(self, provider: Any, profile: Any, engine: Any, capture: bool):
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from molctl.routes import ROUTES

        self.provider = provider
        self.tracer = provider.get_tracer("molctl.proxy")
        self.trace, self.context = trace, context
        self.propagator = TraceContextTextMapPropagator()
        for name in CLIENT_HEADER_LOGGERS:  # their warnings quote a client's header verbatim, before any key check
            logging.getLogger(name).setLevel(logging.ERROR)
        for name in EXPORT_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _Sparse) for f in logger.filters):
                logger.addFilter(_Sparse())
        self.public = profile.served_model_name
        self.provider_name = engine.kind  # gen_ai.provider.name of the hops: the engine (vllm, sglang)
        self.labels = {engine.adapter_model(profile, r): r for r in ROUTES}  # engine model -> L0..L3
        self.capture = capture

    def close(self) -> None:
        """Export what is still buffered and stop (the proxy's shutdown), waiting at most CLOSE_S:
        a collector that is down (the exporter retries for ~10 s) does not hold the proxy's exit."""
        import threading

        closing = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        closing.start()
        closing.join(CLOSE_S)

    # ---------------------------------------------------------------- the server span
    def server(self, scope: dict) -> ServerSpan | None:
        """The request's server span, made current (its hops' parent), continuing an incoming
        `traceparent`/`tracestate`; None for the probes."""
        path = scope["path"].rstrip("/") or "/"
        if path in UNTRACED:
            return None
        carrier = {}
        for name, value in scope["headers"]:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        method = scope["method"]
        attributes = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")}
        route = http_route(path)
        if route is not None:
            attributes["http.route"] = route
        span = self.tracer.start_span(
            f"{method} {route}" if route else method,  # the HTTP conventions' low-cardinality name
            context=parent,
            kind=self.trace.SpanKind.SERVER,
            attributes=attributes,
        )
        token = self.context.attach(self.trace.set_span_in_context(span, parent))
        return ServerSpan(self, span, token)

    # ---------------------------------------------------------------- hop spans
    def hop(self, hop: str, path: str, payload: dict[str, Any], source: str | None, peer: tuple[str, int]) -> HopSpan:
        """A client span for one engine request, a child of the current (server) span; its
        `headers` carry it to the engine as W3C traceparent/tracestate."""
        operation = "chat" if path.endswith("/chat/completions") else "text_completion"
        model = payload.get("model")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": self.provider_name,
            "mol.hop": hop,
            "server.address": peer[0],
            "server.port": peer[1],
        }
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
            if model in self.labels:
                attributes["mol.adapter"] = self.labels[model]
        if source is not None:
            attributes["mol.route.source"] = source
        for field, key in (("max_tokens", "gen_ai.request.max_tokens"), ("temperature", "gen_ai.request.temperature")):
            if isinstance(payload.get(field), int | float) and not isinstance(payload.get(field), bool):
                attributes[key] = payload[field]
        if self.capture and isinstance(payload.get("messages"), list):
            attributes["gen_ai.input.messages"] = _json(input_messages(payload["messages"]))
        span = self.tracer.start_span(
            f"{operation} {model}" if isinstance(model, str) else operation,
            kind=self.trace.SpanKind.CLIENT,
            attributes=attributes,
        )
        headers: dict[str, str] = {}
        self.propagator.inject(headers, context=self.trace.set_span_in_context(span))
        return HopSpan(self, span, hop, headers)


class TracedEngineClient:
    """An `EngineClient` whose every chat hop is a client span of the request's server span
    (`Tracing.hop`), its traceparent sent to the engine; everything else is the wrapped client's.
    The proxy hands it to the pipeline when traces are on (`http.app`)."""

    def __init__(self, client: Any, tracing: Tracing):
        self.client, self.tracing = client, tracing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def chat(self, payload: dict[str, Any], hop: str, **kwargs: Any) -> dict[str, Any]:
        """`EngineClient.chat` in the hop's span: ended when the answer is read, with its usage."""
        path = kwargs.get("path", CHAT_PATH)
        span = self.tracing.hop(hop, path, payload, kwargs.get("source"), self.client.address(kwargs.get("engine")))
        try:
            body = await self.client.chat(payload, hop, trace=span.headers, **kwargs)
        except BaseException as exc:
            span.end(exc)
            raise
        span.answered(body)
        span.end()
        return body

    async def chat_stream(self, payload: dict[str, Any], hop: str, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """`EngineClient.chat_stream` in the hop's span, which starts with the first read and ends
        when the stream is closed."""
        span = self.tracing.hop(
            hop, CHAT_PATH, payload, kwargs.get("source"), self.client.address(kwargs.get("engine"))
        )
        inner = self.client.chat_stream(payload, hop, trace=span.headers, **kwargs)
        error: BaseException | None = None
        try:
            async for event in inner:
                span.event(event)
                yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            await inner.aclose()
            span.end(error)


class _Sparse(logging.Filter):
    """A logger's records, at most one per EXPORT_LOG_EVERY_S (the first at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.next = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        import time

        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + EXPORT_LOG_EVERY_S
        return True


class ServerSpan:
    """A request's server span until the request's log line (`end`)."""

    def __init__(self, tracing: Tracing, span: Any, token: Any):
        self.tracing, self.span, self.token = tracing, span, token

    def end(self, state: Any) -> None:
        """Detach it (the request task's context) and end it with the request's outcome."""
        self.tracing.context.detach(self.token)
        span = self.span
        span.set_attribute("http.response.status_code", state.status)
        span.set_attribute("mol.request.id", state.request_id)
        plan = state.plan
        if plan is not None:  # a chat or Responses answer: named as the GenAI inference span
            span.update_name(f"chat {self.tracing.public}")
            span.set_attributes(
                {
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": PROVIDER,
                    "gen_ai.request.model": self.tracing.public,
                }
            )
            if plan.responses.conversation_id:
                span.set_attribute("gen_ai.conversation.id", plan.responses.conversation_id)
        if state.status >= 500:  # a server span's error: a 5xx (a 4xx is the client's)
            span.set_attribute("error.type", state.error or str(state.status))
            span.set_status(self.tracing.trace.StatusCode.ERROR)
        elif state.error is not None:
            span.set_attribute("error.type", state.error)
        span.end()


class HopSpan:
    """One hop's client span: what the engine answered goes on it (`answered`, `event`), then `end`."""

    def __init__(self, tracing: Tracing, span: Any, hop: str, headers: dict[str, str]):
        self.tracing, self.span, self.hop, self.headers = tracing, span, hop, headers
        self.finish: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.text: list[str] | None = [] if tracing.capture else None
        self.message: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}

    def answered(self, body: dict[str, Any]) -> None:
        """A whole response: its finish reasons, usage, id and model."""
        self._meta(body)
        for choice in body.get("choices") or ():
            if isinstance(choice, dict):
                if choice.get("finish_reason"):
                    self.finish.append(str(choice["finish_reason"]))
                if self.text is not None and isinstance(choice.get("message"), dict):
                    self.message = choice["message"]

    def event(self, event: dict[str, Any]) -> None:
        """One stream event (the proxy asks for one choice: its index 0)."""
        self._meta(event)
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish.append(str(choice["finish_reason"]))
            delta = choice.get("delta") or {}
            if self.text is not None and isinstance(delta.get("content"), str):
                self.text.append(delta["content"])

    def _meta(self, body: dict[str, Any]) -> None:
        if isinstance(body.get("usage"), dict):
            self.usage = body["usage"]
        if "gen_ai.response.id" not in self.meta and isinstance(body.get("id"), str):
            self.meta["gen_ai.response.id"] = body["id"]
        if "gen_ai.response.model" not in self.meta and isinstance(body.get("model"), str):
            self.meta["gen_ai.response.model"] = body["model"]

    def end(self, error: BaseException | None = None) -> None:
        span = self.span
        found = dict(self.meta)
        if self.finish:
            found["gen_ai.response.finish_reasons"] = self.finish
        usage = self.usage or {}
        for field, key in (
            ("prompt_tokens", "gen_ai.usage.input_tokens"),
            ("completion_tokens", "gen_ai.usage.output_tokens"),
        ):
            if isinstance(usage.get(field), int):
                found[key] = usage[field]
        span.set_attributes(found)
        if self.text is not None and (self.message is not None or self.text):
            message = self.message or {"role": "assistant", "content": "".join(self.text)}
            span.set_attribute("gen_ai.output.messages", _json(output_messages(message, self.finish)))
        if isinstance(error, Exception):
            status = getattr(error, "status", None)
            span.set_attribute("error.type", str(status) if status is not None else type(error).__name__)
            span.set_status(self.tracing.trace.StatusCode.ERROR, str(error)[:200])
        span.end()
        if self.hop in ANSWER_HOPS:  # the request's answer: its outcome on the server span too
            parent = self.tracing.trace.get_current_span()
            if parent.is_recording():
                parent.set_attributes(
                    {k: v for k, v in found.items() if k.startswith(("gen_ai.usage", "gen_ai.response.finish"))}
                )


HTTP_ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/responses/compact", "/v1/models", "/v1/conversations")
ID_ROUTES = (  # (prefix, suffix, template) of the endpoints whose path holds an id
    ("/v1/conversations/", "/items", "/v1/conversations/{id}/items"),
    ("/v1/conversations/", "", "/v1/conversations/{id}"),
    ("/v1/responses/", "/input_items", "/v1/responses/{id}/input_items"),
    ("/v1/responses/", "/cancel", "/v1/responses/{id}/cancel"),
    ("/v1/responses/", "", "/v1/responses/{id}"),
    ("/v1/models/", "", "/v1/models/{id}"),
)


def http_route(path: str) -> str | None:
    """The endpoint's route template (`http.route`), or None for a path no endpoint serves."""
    if path in HTTP_ROUTES:
        return path
    parts = path.split("/")  # /v1/conversations/{id}/items/{item_id}: two ids
    if len(parts) == 6 and path.startswith("/v1/conversations/") and parts[4] == "items" and parts[3] and parts[5]:
        return "/v1/conversations/{id}/items/{item_id}"
    for prefix, suffix, template in ID_ROUTES:
        if path.startswith(prefix) and path.endswith(suffix):
            middle = path[len(prefix) : len(path) - len(suffix)]
            if middle and "/" not in middle:
                return template
    return None


def _json(value: Any) -> str:
    from molctl.proxy import fastjson

    return fastjson.dumps_bytes(value).decode()


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as GenAI `parts`: text as it is, other parts by their type only."""
    if isinstance(content, str):
        return [{"type": "text", "content": content}] if content else []
    parts = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append({"type": "text", "content": part.get("text")})
        elif isinstance(part, dict):
            parts.append({"type": str(part.get("type"))})
    return parts


def _calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        calls.append(
            {"type": "tool_call", "id": call.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")}
        )
    return calls


def input_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """gen_ai.input.messages: chat messages in the conventions' role + parts shape."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            parts = [
                {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": message.get("content")}
            ]
        else:
            parts = _parts(message.get("content")) + _calls(message)
        out.append({"role": message.get("role"), "parts": parts})
    return out


def output_messages(message: dict[str, Any], finish: list[str]) -> list[dict[str, Any]]:
    """gen_ai.output.messages: the answer, with its finish reason."""
    return [
        {
            "role": message.get("role") or "assistant",
            "parts": _parts(message.get("content")) + _calls(message),
            "finish_reason": finish[0] if finish else None,
        }
    ]
