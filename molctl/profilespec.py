"""A profile's shape: the YAML schema (`SCHEMA`, `REQUIRED`) and the typed, immutable `Profile`
it becomes. Validation and loading, which build it: `molctl.profiles`."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molctl.profileyaml import _ListOf, _MapOf

# Placeholders substituted in prompt texts.
PH_MODEL = "{{MODEL_NAME}}"
PH_BASE = "{{BASE_MODEL}}"
PH_DESCRIPTIONS = "{{ROUTE_DESCRIPTIONS}}"
PH_LABELS = "{{ROUTE_LABELS}}"

# --------------------------------------------------------------------------------------------
# Schema: a nested mapping of key -> type spec. A type spec is a Python type, a tuple of types
# (None allowed), `list_of(T)`, `map_of(T)` or a nested dict. `REQUIRED` marks keys that must
# be present; everything else has a default in the dataclasses below.


SCALAR = (str, int, float, bool)
ARG_VALUE = (str, int, float, bool, _ListOf((str, int, float)))

SCHEMA: dict[str, Any] = {
    "name": str,
    "description": str,
    "served_model_name": str,
    "base_model": str,
    "model_root": str,
    "model": {
        "model_type": (str, type(None)),
        "shards": (int, type(None)),
        "hint": (str, type(None)),  # how to obtain the model, shown when model_root is missing
    },
    "adapters": {
        "rank_equals": (int, type(None)),
        "rank_max": (int, type(None)),
        "base_names": _ListOf(str),
        "effect_canary": bool,  # the adapter efficacy canary of `up`/`switch` (molctl.canary)
    },
    "engine": {
        "kind": str,
        "version": str,
        "python": (str, type(None)),
        "host": str,
        "port": int,
        "gpus": int,
        "start_timeout_s": (int, float),
        "served_name": str,
        "args": _MapOf(ARG_VALUE),
        "env": _MapOf(SCALAR),  # numbers and booleans become strings ("1"/"0" for booleans)
        "unset_env": _ListOf(str),
        "otlp_traces_endpoint": (str, type(None)),  # the engine's own OTLP traces (Engine.trace_argv)
        "cache_dir": (str, type(None)),  # molctl.enginecache; relative: below STATE/PROFILE
    },
    "proxy": {
        "host": str,
        "port": int,
        "default_route": str,
        "max_output_tokens": int,
        "route_max_tokens": int,
        "summary_max_tokens": int,
        "summary_wait_s": (int, float),
        "summary_queue_max": int,
        "summary_job_max_bytes": int,  # what one queued summary keeps, at most (then it is dropped)
        "route_timeout_s": (int, float),
        "route_max_input_chars": int,
        "speculative_answer": bool,  # the answer hop on the conversation's adapter alongside the route hop
        "stream_write_timeout_s": (int, float),
        "sse_keepalive_s": (int, float),
        "reasoning": str,
        "sampling_defaults": _MapOf(SCALAR),
        "store": str,  # the Responses API's state: sqlite (default), memory, sqlite:/abs/path.sqlite3
        "store_ttl_s": (int, float),
        "store_max_bytes": int,
        "store_max_entries": int,
        "store_tenant_max_bytes": (int, type(None)),  # one API key's share (None: a quarter of store_max_bytes)
        "store_tenant_max_entries": (int, type(None)),  # likewise of store_max_entries
        "store_password_file": (str, type(None)),  # a redis:// store's password (else $MOLCTL_STORE_PASSWORD)
        "state_commit_ms": (int, float),  # chat-state rows to SQLite: one transaction per this window
        "advertise_upstream": (str, type(None)),  # this replica's engine URL as peers reach it (default: --upstream)
        "max_inflight": (int, type(None)),  # answer hops at the engine at once (None: the engine's own limit)
        "max_queue": int,
        "queue_timeout_s": (int, float),
        "route_inflight": int,
        "summary_inflight": int,
        "metrics_port": (int, type(None)),
        "metrics_host": str,
        "media_url_hosts": _ListOf(str),  # hosts whose image/audio/video URLs the engine may fetch ("*": any)
        "max_request_head_bytes": int,  # a request's line and headers, at most (then 431/414)
        "engine_body_max_bytes": int,  # a non-streamed engine answer's body, at most (then 502)
        "request_body_timeout_s": (int, float),  # a request body's whole upload, at most (then 408)
        "request_fields": str,  # unknown request fields: "ignore" (logged once, counted) or "reject" (a 400)
        "chat_template_kwargs": _ListOf(str),  # the chat_template_kwargs keys a client may set
        "otlp_endpoint": (str, type(None)),  # the proxy's OTLP collector (molctl.proxy.tracing)
    },
    "logs": {  # retention of STATE/PROFILE/logs
        "keep": int,  # the N newest log files kept per component
        "max_bytes": int,  # the proxy's own log is rotated at this size (0 = never)
        "backups": int,  # rotated parts kept of it
    },
    "prompts": {
        "identity": str,
        "route": str,
        "summary": str,
        "fold": str,
        "adapters": _MapOf(str),
    },
}

REQUIRED = {
    "name",
    "served_model_name",
    "base_model",
    "model_root",
    "engine.kind",
    "engine.version",
    "engine.port",
    "engine.served_name",
    "proxy.port",
    "prompts.identity",
    "prompts.route",
    "prompts.summary",
    "prompts.adapters",
}


# --------------------------------------------------------------------------------------------
# Typed, immutable profile.


@dataclass(frozen=True)
class ModelSpec:
    model_type: str | None = None
    shards: int | None = None
    hint: str | None = None


@dataclass(frozen=True)
class AdapterSpec:
    rank_equals: int | None = None
    rank_max: int | None = None
    base_names: tuple[str, ...] = ()
    effect_canary: bool = True  # `up` proves each adapter changes the base's output (molctl.canary)


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    version: str
    served_name: str
    port: int
    python: str = ""
    host: str = "127.0.0.1"
    gpus: int = 0
    start_timeout_s: float = 3600
    args: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    otlp_traces_endpoint: str | None = None  # the engine exports its own spans here (Engine.trace_argv)
    cache_dir: str | None = (
        None  # the engine's persistent cache dir (molctl.enginecache); None: STATE/PROFILE/engine-cache
    )


@dataclass(frozen=True)
class ProxySpec:
    port: int
    host: str = "127.0.0.1"
    default_route: str = "L2"
    max_output_tokens: int = 131072
    route_max_tokens: int = 24
    summary_max_tokens: int = 192
    summary_wait_s: float = 5.0
    summary_queue_max: int = 256  # summaries waiting for a slot; more are dropped (counted)
    # What one queued summary keeps, at most (summary.SummaryJob.size): its continuation's token
    # ids as JSON, about 7 bytes each (a whole 262,144-token window: 1.8 MB), or the chat fallback's JSON; a
    # summary over it is dropped (counted). So the queue keeps at most summary_queue_max times it.
    summary_job_max_bytes: int = 4 * 1024 * 1024
    route_timeout_s: float = 10.0  # the route hop's own deadline; then the fallback route
    route_max_input_chars: int = 4000  # the router sees at most this much of the request
    # a follow-up turn's answer starts on the conversation's adapter alongside the route hop, held
    # until the route decides (molctl.proxy.pipeline.speculative)
    speculative_answer: bool = True
    stream_write_timeout_s: float = 60.0  # a stream client that reads nothing this long is dropped
    # a stream's 200 waits this long for the first token, then `: keepalive` comments this often
    # (keep it under the idle timeout of any load balancer between the clients and the proxy)
    sse_keepalive_s: float = 10.0
    reasoning: str = "none"
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    store: str = "sqlite"  # see molctl.proxy.store.factory.parse_store_spec
    store_ttl_s: float = 30 * 24 * 3600  # stored responses expire after this (as the API)
    store_max_bytes: int = 1024 * 1024 * 1024  # record JSON kept at most; then oldest first evicted
    store_max_entries: int = 100_000
    # one tenant's (API key's) quota: over it, its own oldest responses are evicted, never another
    # tenant's (None: a quarter of store_max_bytes / store_max_entries; at most those)
    store_tenant_max_bytes: int | None = None
    store_tenant_max_entries: int | None = None
    store_password_file: str | None = None  # proxy.store redis://...: the password's file (never in the URL)
    # Chat conversation rows (folds, summaries, tool stickiness) go to the SQLite store in one
    # transaction per window of this many ms (a group commit: at 1 client a turn's row and its
    # summary share one commit, under load many turns do); a proxy crash loses at most this
    # window's rows (a drain or stop writes them). 0: at the end of each event-loop pass. Stored
    # Responses are committed before their body is sent, whatever this says.
    state_commit_ms: float = 10.0
    advertise_upstream: str | None = None  # replicas: this proxy's engine as its peers reach it
    # admission control (molctl.proxy.pipeline.admission)
    max_inflight: int | None = None  # answer hops in flight; None: engine.args max-num-seqs / max-running-requests
    max_queue: int = 256  # requests waiting for a slot, all keys together; more: 429
    queue_timeout_s: float = 30.0  # a request waiting longer for a slot: 429
    route_inflight: int = 4  # route hops in flight (their own budget)
    summary_inflight: int = 2  # summary hops in flight (their own budget)
    # Prometheus metrics on their own listener (none unless set)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Media a client names by URL is fetched by the engine (vLLM, SGLang), from the engine's host
    # and network: any URL a key holder sends would be a request from inside the cluster. Only
    # data: URLs unless the URL's host is listed here (lower case; "*": any http(s) URL).
    media_url_hosts: tuple[str, ...] = ()
    # A request head (request line and headers) over this many bytes is answered 431 (414 for
    # the request line) as soon as the bytes pass it, before they are parsed (nginx, Envoy: 64 KiB)
    max_request_head_bytes: int = 64 * 1024
    # A non-streamed engine answer's body is read whole up to this many bytes; past it the hop
    # fails with a 502 naming this field (molctl.proxy.engine_client.MAX_ENGINE_BODY: why 512 MiB)
    engine_body_max_bytes: int = 512 * 1024 * 1024
    # A request body must arrive whole within this many seconds of its head (then 408), however
    # steadily it trickles (stream_write_timeout_s bounds the wait for each part of it)
    request_body_timeout_s: float = 300.0
    # A request field the proxy does not know (nor the engine module, see Engine.request_extensions):
    # "ignore" accepts it, logs its name once and counts it, as vLLM itself does; "reject" is a 400.
    request_fields: str = "ignore"
    # The chat_template_kwargs keys a client may set (others are a 400): the thinking switches of
    # the Qwen3.x and GLM templates. Any other variable reaches the template as is and can change
    # what every rendering of the conversation looks like.
    chat_template_kwargs: tuple[str, ...] = ("enable_thinking", "thinking", "clear_thinking", "preserve_thinking")
    # OpenTelemetry traces of the proxy to this collector (as OTEL_EXPORTER_OTLP_ENDPOINT; molctl.proxy.tracing)
    otlp_endpoint: str | None = None


DEFAULT_FOLD = "[This turn was handled by another specialist. Summary: {summary}]"


@dataclass(frozen=True)
class LogSpec:
    keep: int = 10
    max_bytes: int = 100 * 1024 * 1024
    backups: int = 2


@dataclass(frozen=True)
class Prompts:
    identity: str
    route: str
    summary: str
    adapters: Mapping[str, str]
    # How another adapter's turn appears in an adapter's own view; {summary} is replaced.
    fold: str = DEFAULT_FOLD


@dataclass(frozen=True)
class Profile:
    name: str
    served_model_name: str
    base_model: str
    model_root: Path
    engine: EngineSpec
    proxy: ProxySpec
    prompts: Prompts
    model: ModelSpec = ModelSpec()
    adapters: AdapterSpec = AdapterSpec()
    description: str = ""
    source: Path | None = None
    logs: LogSpec = LogSpec()

    @property
    def base_dir(self) -> Path:
        return self.model_root / "base"

    def adapter_dir(self, route: str) -> Path:
        return self.model_root / "loras" / route

    @property
    def engine_python(self) -> str:
        return self.engine.python or sys.executable

    def substitute(self, text: str) -> str:
        return text.replace(PH_MODEL, self.served_model_name).replace(PH_BASE, self.base_model)
