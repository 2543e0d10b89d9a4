"""The proxy's Prometheus metrics (prometheus-client), served on their own listener.

`ProxyMetrics` is `Counters` (the pipeline's plain counters) plus histograms, in a registry of its own (one
per app, so tests can run several). The counters are exported by a collector at scrape time
(the hot path only adds to a dict); gauges are read at scrape time from `gauges()`.
Every label takes values from a small fixed set (hop, adapter L0-L3, API, status code, reason):
no user data, no keys.

`MetricsListener` answers `GET /metrics` on `proxy.metrics_host:proxy.metrics_port` (loopback by
default) from the proxy's own event loop: no key, and during a drain too (it is not the public
app). Anything else is a 404.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("molctl.proxy")

PREFIX = "molctl_proxy_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# vLLM's own bucket boundaries of time_to_first_token_seconds and e2e_request_latency_seconds (vLLM 0.32:
# vllm/v1/metrics/buckets.py, used by loggers.py's PrometheusStatLogger), so proxy and engine histograms line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TTFT_BUCKETS += (80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
REQUEST_LATENCY_BUCKETS += (240.0, 480.0, 960.0, 1920.0, 7680.0)

# what each counter counts (HELP text); a counter not listed is still exported
HELP = {
    "requests_total": "Requests answered, by API (chat, responses, models, other), status code and stream flag.",
    "route_hops_total": "Route hops sent to the engine.",
    "route_decisions_total": "Routes chosen for answers (route hop or its fallback), by adapter.",
    "route_fallbacks_total": "Route hops whose label was not used, by reason (timeout, engine_error, no_slot, bad_label).",
    "route_timeouts_total": "Route hops that passed proxy.route_timeout_s.",
    "route_priority_refusals_total": "Route hops an engine refused for their priority (sent again without one).",
    "sticky_tool_turns_total": "Tool results continued on the adapter that made the calls.",
    "route_sources_total": "Routes decided, by source (classified, sticky, fallback) and a fallback's reason.",
    "speculative_total": "Speculative answers, by outcome (hit, miss, skipped) and a skip's reason.",
    "speculative_wasted_tokens_total": "Tokens missed speculative answers cost the engine, by kind (prompt, generated).",
    "unplaced_tool_turns_total": "Tool results whose calls were not found (routed afresh).",
    "summaries_total": "Summary hops done.",
    "summary_retries_total": "Summary hops retried.",
    "summary_failures_total": "Summary hops failed (after the retry).",
    "summaries_dropped_total": "Summaries dropped: their queue was full.",
    "summaries_stale_total": "Summaries dropped stale (waited too long, or their turn was already folded).",
    "summary_continuations_total": "Summary hops sent as a continuation of the answer's tokens (a token-prompt completion).",
    "summary_chat_fallbacks_total": "Summary hops sent as a chat request: the answer's token ids or the template probe were missing.",
    "summary_window_skips_total": "Summaries skipped: the answer's prompt, answer and instruction would not fit the engine window.",
    "summary_prompt_tokens_total": "Prompt tokens of summary hops, as the engine reported them.",
    "summary_cached_tokens_total": "Prompt tokens of summary hops the engine served from its prefix cache.",
    "admission_rejections_total": "Requests refused with 429, by reason (queue_full, deadline).",
    "engine_errors_total": "Answer hops the engine failed, by status (or unreachable).",
    "client_disconnects_total": "Clients that went away before their answer was complete.",
    "stream_write_timeouts_total": "Stream clients dropped for reading nothing for proxy.stream_write_timeout_s.",
    "internal_errors_total": "Unexpected proxy failures (answered 500).",
    "store_failures_total": "Requests failed by the response store, by cause (ENOSPC, EIO, damaged, locked, other).",
    "state_store_degraded_total": "Times the shared (Redis) store became unreachable while serving.",
    "state_store_errors_total": "Shared (Redis) store calls that failed or timed out.",
    "state_affinity_remote_total": "Turns whose engine hops went to the engine of the replica owning the conversation.",
    "state_affinity_takeovers_total": "Conversations taken over from a replica whose heartbeat had lapsed.",
    "prompt_tokens_total": "Prompt tokens of engine hops, by hop and adapter, as the engine reported them (usage).",
    "cached_tokens_total": "Prompt tokens of engine hops the engine served from its prefix cache "
    "(usage.prompt_tokens_details.cached_tokens), by hop and adapter.",
    "generation_tokens_total": "Tokens engine hops generated, by hop and adapter (usage.completion_tokens).",
    "ignored_request_fields_total": "Request fields accepted and not used (unknown ones included), by API.",
    "max_tokens_shortened_total": "Hops whose max_tokens was cut to the room their prompt left in the engine window, by hop.",
    "tool_arguments_repaired_total": "History tool calls whose arguments were not a JSON object, sent as {} (as vLLM 0.32).",
}


# counters that are always labelled: (label names); exported without samples until first counted
LABELLED = {
    "requests_total": ("api", "status", "stream"),
    "route_decisions_total": ("adapter",),
    "route_fallbacks_total": ("reason",),
    "route_sources_total": ("source", "reason"),
    "speculative_total": ("outcome", "reason"),
    "speculative_wasted_tokens_total": ("kind",),
    "admission_rejections_total": ("reason",),
    "engine_errors_total": ("status",),
    "store_failures_total": ("cause",),
    "ignored_request_fields_total": ("api",),
    "max_tokens_shortened_total": ("hop",),
    "prompt_tokens_total": ("adapter", "hop"),
    "cached_tokens_total": ("adapter", "hop"),
    "generation_tokens_total": ("adapter", "hop"),
}


@dataclass
class Counters:
    """Plain counters; `inc` with labels (a small fixed set of values each) also counts the
    labelled series. Exported by molctl.proxy.metrics (its ProxyMetrics adds the histograms
    `observe` feeds; here it is a no-op)."""

    values: dict[str, int] = field(
        default_factory=lambda: {
            "requests_total": 0,
            "route_hops_total": 0,
            "route_fallbacks_total": 0,
            "route_timeouts_total": 0,
            "route_priority_refusals_total": 0,
            "sticky_tool_turns_total": 0,
            "unplaced_tool_turns_total": 0,
            "summaries_total": 0,
            "summary_retries_total": 0,
            "summary_failures_total": 0,
            "summaries_dropped_total": 0,
            "summaries_stale_total": 0,
            "engine_errors_total": 0,
            "client_disconnects_total": 0,
            "stream_write_timeouts_total": 0,
            "internal_errors_total": 0,
            "ignored_request_fields_total": 0,
            "summary_continuations_total": 0,
            "summary_chat_fallbacks_total": 0,
            "summary_window_skips_total": 0,
            "summary_prompt_tokens_total": 0,
            "summary_cached_tokens_total": 0,
            "tool_arguments_repaired_total": 0,
        }
    )

    labelled: dict[tuple[str, tuple[tuple[str, str], ...]], int] = field(default_factory=dict)

    def inc(self, name: str, n: int = 1, **labels: str) -> None:
        self.values[name] = self.values.get(name, 0) + n
        if labels:
            key = (name, tuple(sorted(labels.items())))
            self.labelled[key] = self.labelled.get(key, 0) + n

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """A latency sample (hop_seconds, ttft_seconds, e2e_seconds, queue_wait_seconds); see ProxyMetrics."""

    def usage(self, hop: str, adapter: str | None, usage: Any) -> None:
        """One engine hop's token counts from its OpenAI usage: prompt, cached (prompt_tokens_details.
        cached_tokens, when the engine reports it) and generated tokens, by hop and adapter."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        labels = (("adapter", adapter or "none"), ("hop", hop))  # sorted, as `inc` keys them
        for name, n in (
            ("prompt_tokens_total", usage.get("prompt_tokens")),
            ("cached_tokens_total", details.get("cached_tokens") if isinstance(details, dict) else None),
            ("generation_tokens_total", usage.get("completion_tokens")),
        ):
            if type(n) is int and n >= 0:  # not a bool, not a float
                key = (name, labels)
                self.labelled[key] = self.labelled.get(key, 0) + n

    def finished(self, api: str, plan: Any, seconds: float) -> None:
        """A chat or Responses request that ran its answer hop ended after `seconds`: its end-to-end
        latency and, for a stream, its time to first token (`plan.timings["ttft_s"]`), by API and adapter."""
        if plan is None or "answer_s" not in plan.timings:
            return
        adapter = plan.route or "none"
        ttft = plan.timings.get("ttft_s")
        if ttft is not None:
            self.observe("ttft_seconds", ttft, api=api, adapter=adapter)
        self.observe("e2e_seconds", seconds, api=api, adapter=adapter)


class ProxyMetrics(Counters):
    def __init__(
        self,
        gauges: Callable[[], dict[str, dict[tuple[tuple[str, str], ...], float]]] | None = None,
        external: Callable[[], dict[str, float]] | None = None,
    ):
        super().__init__()
        self.registry = CollectorRegistry(auto_describe=False)
        self.gauges = gauges or (lambda: {})
        # counters kept elsewhere (a shared store's degradations, affinity), read at scrape time
        self.external = external or (lambda: {})
        self.histograms = {
            "hop_seconds": Histogram(
                PREFIX + "hop_seconds",
                "Engine hop latency, by hop (route, answer, summary) and adapter.",
                ["hop", "adapter"],
                buckets=LATENCY_BUCKETS,
                registry=self.registry,
            ),
            "ttft_seconds": Histogram(
                PREFIX + "time_to_first_token_seconds",
                "Stream requests: from the parsed request to the engine's first token, by API and adapter.",
                ["api", "adapter"],
                buckets=TTFT_BUCKETS,
                registry=self.registry,
            ),
            "e2e_seconds": Histogram(
                PREFIX + "e2e_request_latency_seconds",
                "Chat and Responses requests that ran an answer hop: from the request to its end, by API and adapter.",
                ["api", "adapter"],
                buckets=REQUEST_LATENCY_BUCKETS,
                registry=self.registry,
            ),
            "queue_wait_seconds": Histogram(
                PREFIX + "queue_wait_seconds",
                "Time answers waited for an answer slot (admission).",
                buckets=LATENCY_BUCKETS,
                registry=self.registry,
            ),
        }
        self._children: dict[tuple, Any] = {}
        self.registry.register(_Collector(self))
        # the standard process_* series (CPU seconds, resident memory, open and max file
        # descriptors, start time), read from /proc at scrape time: what an operator alerts on
        # for a long-running proxy (a descriptor leak, memory growth); absent where /proc is not
        ProcessCollector(registry=self.registry)

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        # the labelled child cached per label set: prometheus_client's labels() validates and locks on every call
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            hist = self.histograms[name]
            child = self._children[key] = hist.labels(**labels) if labels else hist
        child.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: ProxyMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], int]]] = {}
        for (name, labels), value in list(m.labelled.items()):
            by_name.setdefault(name, []).append((labels, value))
        for name in dict.fromkeys([*m.values, *LABELLED]):
            family = name.removesuffix("_total")
            samples = by_name.get(name)
            if samples is not None or name in LABELLED:
                label_names = sorted(LABELLED.get(name) or {k for labels, _ in samples for k, _ in labels})
                metric = CounterMetricFamily(PREFIX + family, HELP.get(name, name), labels=label_names)
                for labels, value in samples or ():
                    d = dict(labels)
                    metric.add_metric([d.get(k, "") for k in label_names], value)
            else:
                metric = CounterMetricFamily(PREFIX + family, HELP.get(name, name), value=m.values.get(name, 0))
            yield metric
        for name, value in m.external().items():
            yield CounterMetricFamily(PREFIX + name.removesuffix("_total"), HELP.get(name, name), value=value)
        for name, samples in m.gauges().items():
            label_names = sorted({k for labels in samples for k, _ in labels})
            gauge = GaugeMetricFamily(PREFIX + name, name.replace("_", " "), labels=label_names)
            for labels, value in samples.items():
                d = dict(labels)
                gauge.add_metric([d.get(k, "") for k in label_names], value)
            yield gauge


class MetricsListener:
    """A minimal HTTP/1.1 server for `GET /metrics` (one request per connection).

    Bounded: at most MAX_CONNECTIONS open at once (a scraper needs one; more are closed at
    once, before anything is read), each with IO_TIMEOUT_S to send its request head and to read
    the answer, so clients that open connections and send nothing, or never read, cannot
    exhaust the proxy's file descriptors or memory."""

    MAX_CONNECTIONS = 32
    IO_TIMEOUT_S = 10.0

    def __init__(self, metrics: ProxyMetrics, host: str, port: int, sock: socket.socket | None = None):
        self.metrics, self.host, self.port, self.sock = metrics, host, port, sock
        self._server: asyncio.Server | None = None
        self.open_connections = 0
        self.refused_connections = 0

    async def start(self) -> None:
        if self.sock is not None:  # bound before the server started (see bind_metrics)
            self._server = await asyncio.start_server(self._handle, sock=self.sock)
        else:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.MAX_CONNECTIONS:
            self.refused_connections += 1
            if self.refused_connections == 1 or self.refused_connections % 1000 == 0:
                log.warning(
                    "metrics listener: %d connections open, closing new ones (%d so far)",
                    self.open_connections,
                    self.refused_connections,
                )
            writer.transport.abort()
            return
        self.open_connections += 1
        try:
            await self._serve(reader, writer)
        finally:
            self.open_connections -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.IO_TIMEOUT_S)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method == "GET" and path.split("?", 1)[0] == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.metrics.exposition()
            else:
                status, ctype, body = "404 Not Found", "text/plain; charset=utf-8", b"only GET /metrics here\n"
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
                f"connection: close\r\n\r\n".encode()
                + body
            )
            await asyncio.wait_for(writer.drain(), self.IO_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, ValueError):
            writer.transport.abort()  # close() would wait to flush to a client that does not read
        finally:
            writer.close()


LISTEN_BACKLOG = 2048  # uvicorn's default, kept now that the proxy binds its own sockets


def bind_listeners(host: str, port: int, host_field: str, port_field: str) -> list[socket.socket]:
    """The proxy's public sockets, bound before anything is served, so a port in use is one clear
    error (ConflictError, exit 4, naming the field) instead of uvicorn's multi-line failed start-up.
    Every address `host` resolves to is bound, as uvicorn's own bind (asyncio's create_server) did:
    both 127.0.0.1 and ::1 for `localhost`, an IPv6 socket IPv6-only; SO_REUSEADDR and uvicorn's
    backlog, as there."""
    from molctl.errors import ConflictError

    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConflictError(f"{host_field} {host}: {exc.strerror or exc}") from None
    socks: list[socket.socket] = []
    try:
        for family, _type, _proto, _name, addr in dict.fromkeys(infos):  # each address once, in order
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        for sock in socks:
            sock.close()
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConflictError(f"{port_field} {host}:{port}: {why}") from None
    return socks


def bind_metrics(host: str, port: int) -> socket.socket:
    """Bind the metrics listener's socket before anything is served, so a port in use is one
    clear error (ConflictError, exit 4) instead of a failed application start-up."""
    from molctl.errors import ConflictError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 literal such as ::1
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        if exc.errno is not None and exc.errno < 0:  # the resolver's (a name that does not resolve), not os.strerror's
            why = (exc.strerror or str(exc)).split(" (while attempting", 1)[0]
            raise ConflictError(f"proxy.metrics_host {host}: {why}") from None
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConflictError(f"proxy.metrics_port {host}:{port}: {why}") from None


def store_gauges(stats: dict[str, Any], store: str) -> dict[tuple[tuple[str, str], ...], float]:
    """A store's numeric stats as gauge samples labelled by store and field."""
    return {
        (("field", k), ("store", store)): float(v)
        for k, v in stats.items()
        if isinstance(v, (int, float)) and not k.endswith("_total") and k != "store_degraded"
    }
