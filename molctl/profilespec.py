"""A profile's shape: the YAML schema (`SCHEMA`, `REQUIRED`) and the typed, immutable `Profile`
it becomes. Validation and loading, which build it: `molctl.profiles`."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from molctl.profileyaml import _ListOf, _MapOf

# Placeholders substituted in prompt texts.
PH_MODEL = "{{MODEL_NAME}}"
PH_BASE = "{{BASE_MODEL}}"
PH_DESCRIPTIONS = "{{ROUTE_DESCRIPTIONS}}"
PH_LABELS = "{{ROUTE_LABELS}}"

# --------------------------------------------------------------------------------------------
# Every field is declared once, below, with `setting`: its YAML type spec (a Python type, a tuple
# of types (None allowed), `_ListOf(T)` or `_MapOf(T)`), its default (none: required), its range
# or choices, and the line the README's table shows. The schema (`SCHEMA`, `REQUIRED`), the
# generic range checks (`molctl.profiles`) and the README's table (tests/cli/test_readme_profile_fields.py
# prints its rows) are derived from the declarations; a section is a field declared with `section`.

SCALAR = (str, int, float, bool)
ARG_VALUE = (str, int, float, bool, _ListOf((str, int, float)))
ENGINE_KINDS = ("vllm", "sglang")
REASONING_STYLES = ("glm", "qwen", "none")
REQUEST_FIELD_MODES = ("ignore", "reject")
MAX_GPUS = 1024  # a huge count made `check` raise or build a list for minutes
MAX_LOG_FILES = 1000


def setting(
    spec: Any,
    default: Any = MISSING,
    *,
    doc: str,
    factory: Callable[[], Any] | None = None,
    positive: bool = False,
    between: tuple[float, float, str] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """One profile field: `spec` its YAML type, `default` (none: required), `doc` the README's
    line; `positive`: finite and > 0 when set; `between=(low, high, what)`: low <= value <= high;
    `choices`: one of these strings."""
    meta = {"spec": spec, "doc": doc, "positive": positive, "between": between, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, required: bool = False) -> Any:
    """A nested mapping of the profile, its fields declared by the dataclass `cls`."""
    if required:
        return field(metadata={"section": cls})
    return field(default_factory=cls, metadata={"section": cls})


def declared(cls: type) -> Iterator[tuple[str, Any]]:
    """(name, dataclass field) of each YAML field of `cls`, in declaration order (sections too)."""
    for f in fields(cls):
        if "spec" in f.metadata or "section" in f.metadata:
            yield f.name, f


def default_of(cls: type, name: str) -> Any:
    """The declared default of field `name` of `cls` (for code outside a profile that needs it)."""
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default is MISSING else f.default


def schema_of(cls: type) -> dict[str, Any]:
    """The nested schema mapping (key -> type spec or nested mapping) the declarations of `cls` give."""
    return {
        name: schema_of(f.metadata["section"]) if "section" in f.metadata else f.metadata["spec"]
        for name, f in declared(cls)
    }


def required_of(cls: type, prefix: str = "") -> set[str]:
    """The dotted names of the fields of `cls` without a default."""
    out = set()
    for name, f in declared(cls):
        if "section" in f.metadata:
            out |= required_of(f.metadata["section"], f"{prefix}{name}.")
        elif f.default is MISSING and f.default_factory is MISSING:
            out.add(prefix + name)
    return out


# --------------------------------------------------------------------------------------------
# Typed, immutable profile: the declarations.


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    model_type: str | None = setting(
        (str, type(None)), None, doc="the base's `config.json` `model_type` the checks expect"
    )
    shards: int | None = setting(
        (int, type(None)),
        None,
        doc="the number of safetensors shards the checks expect",
        between=(1, 100_000, "a shard count"),
    )
    hint: str | None = setting(
        (str, type(None)), None, doc="how to obtain the model, shown when `model_root` is missing"
    )


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    rank_equals: int | None = setting(
        (int, type(None)),
        None,
        doc="every adapter's LoRA rank must equal this (1 to 65536; not with `rank_max`)",
        between=(1, 2**16, "a LoRA rank"),
    )
    rank_max: int | None = setting(
        (int, type(None)),
        None,
        doc="every adapter's LoRA rank at most this (1 to 65536; not with `rank_equals`)",
        between=(1, 2**16, "a LoRA rank"),
    )
    base_names: tuple[str, ...] = setting(
        _ListOf(str), (), doc="base model names an adapter may declare (not blank, no surrounding spaces)"
    )
    effect_canary: bool = setting(
        bool, True, doc="`up` and `switch` prove each adapter changes the base's output (`check --live` too)"
    )


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    kind: str = setting(str, doc="`vllm` or `sglang`", choices=ENGINE_KINDS)
    version: str = setting(
        str, doc="a PEP 440 specifier of the installed engine; a local suffix like `+cu130` is ignored"
    )
    python: str = setting(
        (str, type(None)), "", doc="the engine environment's interpreter; empty: the one running molctl"
    )
    host: str = setting(str, "127.0.0.1", doc="the engine's listen address")
    port: int = setting(int, doc="the engine's port (not the proxy's)")
    gpus: int = setting(int, 0, doc="GPUs the engine uses, 0 to 1024", between=(0, MAX_GPUS, "a GPU count"))
    start_timeout_s: float = setting(
        (int, float), 3600, doc="how long `up` waits for the engine to be ready (finite, > 0)", positive=True
    )
    served_name: str = setting(str, doc="the base's name at the engine")
    args: Mapping[str, Any] = setting(
        _MapOf(ARG_VALUE), factory=dict, doc="engine flags, flag -> value, written without dashes; `true` = bare flag"
    )
    env: Mapping[str, str] = setting(
        _MapOf(SCALAR),
        factory=dict,
        doc="the engine's environment (numbers and booleans become strings, booleans `1`/`0`)",
    )
    unset_env: tuple[str, ...] = setting(
        _ListOf(str), (), doc="variables removed from the engine's environment (names not empty, without `=`)"
    )
    otlp_traces_endpoint: str | None = setting(
        (str, type(None)),
        None,
        doc=(
            "the engine's own OpenTelemetry traces go to this collector (vLLM `--otlp-traces-endpoint`; "
            "SGLang `--enable-trace --otlp-traces-endpoint`); the proxy's hop spans are their parents"
        ),
    )
    cache_dir: str | None = setting(  # molctl.enginecache; relative: below STATE/PROFILE
        (str, type(None)),
        None,
        doc=(
            "the engine's persistent cache directory (`null`: `STATE/PROFILE/engine-cache`) (vLLM "
            "`VLLM_CACHE_ROOT`; SGLang `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR` below it), kept "
            "across `down`/`up`; a relative path is below `STATE/PROFILE`; a variable set in `engine.env` "
            'wins (see "Start phases, ETA, engine cache, prefetch")'
        ),
    )


@dataclass(frozen=True, kw_only=True)
class ProxySpec:
    host: str = setting(str, "127.0.0.1", doc="the proxy's listen address")
    port: int = setting(int, doc="the proxy's port")
    default_route: str = setting(str, "L2", doc="the route (`L0`..`L3`) when the route hop fails or answers no label")
    max_output_tokens: int = setting(int, 131072, doc="the most tokens an answer may ask for", positive=True)
    route_max_tokens: int = setting(
        int,
        24,
        doc="the route hop's token budget; it never asks for more than the longest label has characters (2 with `L0`..`L3`)",
        positive=True,
    )
    summary_max_tokens: int = setting(int, 192, doc="a summary's token budget", positive=True)
    summary_wait_s: float = setting(
        (int, float),
        5.0,
        doc="how long a turn waits for a pending summary it would fold, 0 to 3600",
        between=(0, 3600, "seconds"),
    )
    summary_queue_max: int = setting(
        int, 256, doc="summaries waiting for a slot; more are dropped (counted)", positive=True
    )
    # What one queued summary keeps, at most (summary.SummaryJob.size): its continuation's token
    # ids as JSON, about 7 bytes each (a whole 262,144-token window: 1.8 MB), or the chat fallback's JSON; a
    # summary over it is dropped (counted). So the queue keeps at most summary_queue_max times it.
    summary_job_max_bytes: int = setting(
        int,
        4194304,
        doc=(
            "what one queued summary keeps at most: its continuation's token ids as JSON, about 7 bytes "
            "a token (a whole 262,144-token window: 1.8 MB), or the chat fallback's JSON; a summary "
            "over it is dropped (counted in `summaries_dropped_total`), so queued summaries keep at "
            "most `summary_queue_max` times this"
        ),
        positive=True,
    )
    route_timeout_s: float = setting(
        (int, float), 10.0, doc="the route hop's own deadline; then the default route", positive=True
    )
    route_max_input_chars: int = setting(
        int, 4000, doc="the most of a request the route hop sees (at least 200)", between=(200, 2**53, "characters")
    )
    # a follow-up turn's answer starts on the conversation's adapter alongside the route hop, held
    # until the route decides (molctl.proxy.pipeline.speculative)
    speculative_answer: bool = setting(
        bool,
        True,
        doc=(
            "a follow-up turn's answer starts on the conversation's adapter alongside the route hop, "
            "held until the route decides (on by default: most follow-ups keep their adapter, and a "
            'miss is cancelled at once; see "The speculative answer")'
        ),
    )
    stream_write_timeout_s: float = setting(
        (int, float), 60.0, doc="a stream client that reads nothing this long is dropped", positive=True
    )
    # a stream's 200 waits this long for the first token, then `: keepalive` comments this often
    # (keep it under the idle timeout of any load balancer between the clients and the proxy)
    sse_keepalive_s: float = setting(
        (int, float),
        10.0,
        doc="a stream's first-token wait and keep-alive interval: keep it under the idle timeout of a load balancer in front",
        positive=True,
    )
    reasoning: str = setting(str, "none", doc="`glm`, `qwen` or `none`", choices=REASONING_STYLES)
    sampling_defaults: Mapping[str, Any] = setting(
        _MapOf(SCALAR),
        factory=dict,
        doc="scalar sampling parameters such as `temperature` or `top_p` sent on the answer hop; a value the client sends wins",
    )
    store: str = setting(
        str,
        "sqlite",
        doc="the Responses API's and chat's state: `sqlite`, `memory`, `sqlite:/abs/path.sqlite3` or `redis://...`",
    )
    store_ttl_s: float = setting(
        (int, float), 2592000, doc="stored responses expire after this (30 days)", positive=True
    )
    store_max_bytes: int = setting(
        int, 1073741824, doc="stored JSON at most (1 GiB); then oldest first evicted", positive=True
    )
    store_max_entries: int = setting(int, 100000, doc="stored responses at most", positive=True)
    # one tenant's (API key's) quota: over it, its own oldest responses are evicted, never another
    # tenant's (None: a quarter of store_max_bytes / store_max_entries; at most those)
    store_tenant_max_bytes: int | None = setting(
        (int, type(None)), None, doc="one API key's share of `store_max_bytes` (null: a quarter of it)", positive=True
    )
    store_tenant_max_entries: int | None = setting(
        (int, type(None)), None, doc="one API key's share of `store_max_entries` (null: a quarter of it)", positive=True
    )
    store_password_file: str | None = setting(
        (str, type(None)), None, doc="a `redis://` store's password, never in the URL (else `$MOLCTL_STORE_PASSWORD`)"
    )
    store_call_timeout_s: float = setting(
        (int, float),
        0.5,
        doc="a `redis://` store: one call's round trip at most; past it the store is degraded (calls fail "
        "at once for 1 s; chat goes on without shared state, Responses requests that need it get 503)",
        between=(0.01, 60, "a number of seconds"),
    )
    # Chat conversation rows (folds, summaries, tool stickiness) go to the SQLite store in one
    # transaction per window of this many ms (a group commit: at 1 client a turn's row and its
    # summary share one commit, under load many turns do); a proxy crash loses at most this
    # window's rows (a drain or stop writes them). 0: at the end of each event-loop pass. Stored
    # Responses are committed before their body is sent, whatever this says.
    state_commit_ms: float = setting(
        (int, float),
        10.0,
        doc="chat state's group-commit window in ms, 0 to 1000",
        between=(0, 1000, "a number of milliseconds"),
    )
    advertise_upstream: str | None = setting(
        (str, type(None)), None, doc="proxy replicas: this host's engine as its peers reach it (default: `--upstream`)"
    )
    # admission control (molctl.proxy.pipeline.admission)
    max_inflight: int | None = setting(
        (int, type(None)),
        None,
        doc="answer hops at the engine at once (null: the engine's own limit); see Admission control",
        positive=True,
    )
    # /v1/responses `background: true`: each holds an answer slot while it runs, as a foreground request does
    background_max_per_tenant: int = setting(
        int,
        16,
        doc="one API key's `background: true` responses queued or in progress at once; more: 429 `rate_limit_exceeded`",
        positive=True,
    )
    max_queue: int = setting(int, 256, doc="requests waiting for a slot, all keys together; more: 429", positive=True)
    queue_timeout_s: float = setting((int, float), 30.0, doc="a request waiting longer for a slot: 429", positive=True)
    route_inflight: int = setting(int, 4, doc="route hops in flight (their own budget)", positive=True)
    summary_inflight: int = setting(int, 2, doc="summary hops in flight (their own budget)", positive=True)
    # Prometheus metrics on their own listener (none unless set)
    metrics_port: int | None = setting(
        (int, type(None)), None, doc="the Prometheus metrics listener's port (none unless set); see Metrics"
    )
    metrics_host: str = setting(str, "127.0.0.1", doc="the metrics listener's address")
    # Media a client names by URL is fetched by the engine (vLLM, SGLang), from the engine's host
    # and network: any URL a key holder sends would be a request from inside the cluster. Only
    # data: URLs unless the URL's host is listed here (lower case; "*": any http(s) URL).
    media_url_hosts: tuple[str, ...] = setting(
        _ListOf(str),
        (),
        doc=(
            "hosts the engine may fetch images, audio and video from when a client names them by URL "
            "(`*`: any); none: only inline `data:` URLs, see Media URLs"
        ),
    )
    # A request head (request line and headers) over this many bytes is answered 431 (414 for
    # the request line) as soon as the bytes pass it, before they are parsed (nginx, Envoy: 64 KiB)
    max_request_head_bytes: int = setting(
        int,
        65536,
        doc="a request's line and headers at most, 1024 to 64 MiB: past it a 431 (414 for the request line), before any key is checked",
        between=(1024, 64 * 1024 * 1024, "bytes"),
    )
    # A non-streamed engine answer's body is read whole up to this many bytes; past it the hop
    # fails with a 502 naming this field (molctl.proxy.engine_client.MAX_ENGINE_BODY: why 512 MiB)
    engine_body_max_bytes: int = setting(
        int,
        536870912,
        doc=(
            "a non-streamed engine answer's body is read whole up to this (512 MiB: a 262,144-token "
            "window's token ids are under 2.5 MB, the rest is room for logprobs); past it the hop is a "
            "502 naming this field"
        ),
        positive=True,
    )
    # A request body must arrive whole within this many seconds of its head (then 408), however
    # steadily it trickles (stream_write_timeout_s bounds the wait for each part of it)
    request_body_timeout_s: float = setting(
        (int, float), 300.0, doc="a request body must arrive whole within this of its head (then 408)", positive=True
    )
    # A request field the proxy does not know (nor the engine module, see Engine.request_extensions):
    # "ignore" accepts it, logs its name once and counts it, as vLLM itself does; "reject" is a 400.
    request_fields: str = setting(
        str,
        "ignore",
        doc="a request field neither the proxy nor the engine module knows: `ignore` (logged once, counted) or `reject` (a 400)",
        choices=REQUEST_FIELD_MODES,
    )
    # The chat_template_kwargs keys a client may set (others are a 400): the thinking switches of
    # the Qwen3.x and GLM templates. Any other variable reaches the template as is and can change
    # what every rendering of the conversation looks like.
    chat_template_kwargs: tuple[str, ...] = setting(
        _ListOf(str),
        ("enable_thinking", "thinking", "clear_thinking", "preserve_thinking"),
        doc="the `chat_template_kwargs` keys a client may set (others are a 400)",
    )
    # OpenTelemetry traces of the proxy to this collector (as OTEL_EXPORTER_OTLP_ENDPOINT; molctl.proxy.tracing)
    otlp_endpoint: str | None = setting(
        (str, type(None)),
        None,
        doc=(
            "OpenTelemetry traces of the proxy to this OTLP collector (its base URL, as "
            "`OTEL_EXPORTER_OTLP_ENDPOINT`: `http://HOST:4318`); unset: the standard "
            "`OTEL_EXPORTER_OTLP_*` variables decide, off without them"
        ),
    )
    # llm-d's scheduler between the proxy and the engines (render k8s --scheduler llm-d): the prefix
    # of its InferenceObjectives (PREFIX-route, -answer, -summary); set, the hops carry the headers
    # it reads (molctl.proxy.scheduler_hints) and the replicas' own affinity redirect is off
    scheduler_objectives: str | None = setting(
        (str, type(None)),
        None,
        doc=(
            "llm-d's scheduler sits between the proxies and the engines (`render k8s --scheduler llm-d` sets "
            "it to NAME): the prefix of its InferenceObjectives; each hop then carries `x-session-id`, "
            "`x-llm-d-inference-objective: PREFIX-route`/`-answer`/`-summary` and "
            "`x-llm-d-inference-fairness-id`, and the replicas' own affinity redirect is off (see \"Beyond "
            'one host on Kubernetes with llm-d")'
        ),
    )


DEFAULT_FOLD = "[This turn was handled by another specialist. Summary: {summary}]"


@dataclass(frozen=True, kw_only=True)
class LogSpec:
    keep: int = setting(
        int, 10, doc="the newest log files kept per component, 1 to 1000", between=(1, MAX_LOG_FILES, "a file count")
    )
    max_bytes: int = setting(
        int,
        104857600,
        doc="the proxy's own log is rotated at this size (100 MiB; 0 = never)",
        between=(0, 2**53, "bytes"),
    )
    backups: int = setting(
        int, 2, doc="rotated parts kept of it, 0 to 1000", between=(0, MAX_LOG_FILES, "a part count")
    )


@dataclass(frozen=True, kw_only=True)
class Prompts:
    identity: str = setting(str, doc="the system prompt of every hop (`{{MODEL_NAME}}`, `{{BASE_MODEL}}`)")
    route: str = setting(
        str, doc="the route hop's prompt; must contain `{{ROUTE_DESCRIPTIONS}}` and `{{ROUTE_LABELS}}`"
    )
    summary: str = setting(str, doc="the summary hop's prompt")
    # How another adapter's turn appears in an adapter's own view; {summary} is replaced.
    fold: str = setting(
        str, DEFAULT_FOLD, doc="how another adapter's turn appears in an adapter's view; must contain `{summary}`"
    )
    adapters: Mapping[str, str] = setting(_MapOf(str), doc="one description per route, exactly `L0`..`L3`")


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str = setting(str, doc="the profile's name, equal to its file name (`[a-z0-9][a-z0-9-]*`)")
    description: str = setting(str, "", doc="one line shown by `molctl profiles`")
    served_model_name: str = setting(str, doc="the model name clients send and see")
    base_model: str = setting(str, doc="the base model's name (`{{BASE_MODEL}}` in prompts)")
    model_root: Path = setting(str, doc="the folder holding `base/` and `loras/L0`..`L3`")
    model: ModelSpec = section(ModelSpec)
    adapters: AdapterSpec = section(AdapterSpec)
    engine: EngineSpec = section(EngineSpec, required=True)
    proxy: ProxySpec = section(ProxySpec, required=True)
    logs: LogSpec = section(LogSpec)
    prompts: Prompts = section(Prompts, required=True)
    source: Path | None = None  # the file it was read from (not a YAML field)

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


SCHEMA: dict[str, Any] = schema_of(Profile)
REQUIRED: set[str] = required_of(Profile)
