"""Profiles: YAML files describing one MoL stack (engine, model layout, adapters, proxy prompts).

Loading is strict: an unknown key, a wrong type, a bad name or invalid YAML is a `ProfileError`
naming the file, the line (where YAML tells it) and the dotted field. `--set dotted.key=value`
and `--model-root` overrides are applied to the raw data *before* validation, so an override
is checked exactly like a value written in the file.

Built-in profiles live in the package (`molctl/profiles_builtin`, a link to the repository's
`profiles/` in a checkout, copies in a wheel); user folders given with
`--profiles-dir` or `MOLCTL_PROFILES_DIR` (os.pathsep-separated) are searched after it, and a
later folder's `NAME.yaml` replaces an earlier one of the same name.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molctl.errors import ProfileError
from molctl.profileyaml import _ListOf, _MapOf, _short, _Validator, apply_overrides, load_yaml_with_lines
from molctl.routes import ROUTES

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
ENGINE_KINDS = ("vllm", "sglang")
REASONING_STYLES = ("glm", "qwen", "none")

# Placeholders substituted in prompt texts.
PH_MODEL = "{{MODEL_NAME}}"
PH_BASE = "{{BASE_MODEL}}"
PH_DESCRIPTIONS = "{{ROUTE_DESCRIPTIONS}}"
PH_LABELS = "{{ROUTE_LABELS}}"


def builtin_profiles_dir() -> Path:
    """The shipped profiles: `profiles_builtin` beside this module, resolved (in a checkout or an
    editable install that is the repository's `profiles/`; in a wheel, the package's own copies)."""
    return (Path(__file__).parent / "profiles_builtin").resolve()


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

MAX_GPUS = 1024
REQUEST_FIELD_MODES = ("ignore", "reject")
# a DNS name or an IPv4 address, or an IPv6 one in brackets: a proxy.media_url_hosts entry, and
# the host part of a media URL the proxy lets through (molctl.proxy.apis.chat_validation)
MEDIA_HOST_PATTERN = (
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\]"
)
MEDIA_HOST = re.compile(f"(?:{MEDIA_HOST_PATTERN})")
NON_EMPTY = ("served_model_name", "base_model", "model_root", "engine.served_name", "engine.host", "proxy.host")

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


# --------------------------------------------------------------------------------------------
# Validation.


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _expand_path(raw: str, base: Path) -> Path:
    expanded = os.path.expanduser(os.path.expandvars(raw))
    path = Path(expanded)
    return path if path.is_absolute() else (base / path)


def build_profile(
    data: dict[str, Any],
    source: Path,
    lines: dict[str, int] | None = None,
    overrides: Iterable[tuple[str, Any]] = (),
    expected_name: str | None = None,
) -> Profile:
    """Validate raw profile data (after applying overrides) into an immutable `Profile`.

    The schema walk first (unknown keys, types, required fields), then each section's own rules
    in a fixed order (name, engine, proxy, prompts, adapters, logs): the first problem is raised.
    """
    overrides = list(overrides)
    apply_overrides(data, overrides)
    v = _Validator(source, lines or {}, {k for k, _ in overrides}, REQUIRED)
    v.walk(data, SCHEMA)
    for key in NON_EMPTY:  # `--set served_model_name=$UNSET_VAR` gave a stack serving model ''
        head, _, tail = key.partition(".")
        value = data.get(head, {}).get(tail) if tail else data.get(head)
        if isinstance(value, str) and not value.strip():
            raise v.fail(key, "must not be empty")

    name = _checked_name(data["name"], expected_name, v)
    for key, value in (("model_root", data["model_root"]), ("proxy.host", data["proxy"].get("host"))):
        problem = _exec_problem(value) if isinstance(value, str) else None  # both reach an argv
        if problem:
            raise v.fail(key, problem)
    engine = _engine_spec(data["engine"], data["proxy"], v)
    proxy = _proxy_spec(data["proxy"], v)
    prompts = _prompts(data["prompts"], v)
    adapters = _adapter_spec(data.get("adapters", {}), v)
    shards = data.get("model", {}).get("shards")
    if shards is not None and not 1 <= shards <= 100_000:  # the base's safetensors shard count
        raise v.fail("model.shards", f"{_short(shards)}: expected a shard count from 1 to 100000")
    base = source.parent if source else Path.cwd()
    return Profile(
        name=name,
        description=data.get("description", ""),
        served_model_name=data["served_model_name"],
        base_model=data["base_model"],
        model_root=_expand_path(data["model_root"], base),
        model=ModelSpec(**data.get("model", {})),
        adapters=adapters,
        engine=engine,
        proxy=proxy,
        prompts=prompts,
        source=source,
        logs=_log_spec(data.get("logs", {}), v),
    )


def _checked_name(name: str, expected_name: str | None, v: _Validator) -> str:
    """The profile's `name`: `[a-z0-9][a-z0-9-]*`, and equal to its file name when one is given."""
    if not NAME_RE.match(name):
        raise v.fail("name", f"bad name {name!r}: expected [a-z0-9][a-z0-9-]*")
    if expected_name is not None and name != expected_name:
        raise v.fail("name", f"{name!r} differs from the file name {expected_name!r}")
    return name


def _check_ports(engine: dict[str, Any], proxy: dict[str, Any], v: _Validator) -> None:
    """Both ports are TCP ports, and they differ."""
    for port_key, section in (("engine.port", engine), ("proxy.port", proxy)):
        if not 1 <= section["port"] <= 65535:  # _short: a 4000-digit port was echoed whole
            raise v.fail(port_key, f"{_short(section['port'])} is not a TCP port (1-65535)")
    if engine["port"] == proxy["port"]:
        raise v.fail("proxy.port", f"{proxy['port']} is also engine.port; they must differ")
    metrics = proxy.get("metrics_port")
    if metrics is not None:
        if not 1 <= metrics <= 65535:
            raise v.fail("proxy.metrics_port", f"{_short(metrics)} is not a TCP port (1-65535)")
        for other in ("engine.port", "proxy.port"):
            if metrics == (engine if other == "engine.port" else proxy)["port"]:
                raise v.fail("proxy.metrics_port", f"{metrics} is also {other}; they must differ")


def _engine_spec(data: dict[str, Any], proxy: dict[str, Any], v: _Validator) -> EngineSpec:
    """The `engine` section: a known kind, a PEP 440 version pin, ports (with the proxy's), GPUs,
    a positive start timeout, flags written without dashes; env values become strings."""
    eng = dict(data)
    if eng["kind"] not in ENGINE_KINDS:
        raise v.fail("engine.kind", f"{eng['kind']!r}: expected one of {', '.join(ENGINE_KINDS)}")
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(eng["version"])
    except InvalidSpecifier:
        raise v.fail("engine.version", f"{eng['version']!r} is not a version specifier (e.g. ==0.24.0)") from None
    from molctl.engines import get_engine  # here: the engine modules import this one

    problem = get_engine(eng["kind"]).served_name_problem(eng["served_name"])
    if problem:
        raise v.fail("engine.served_name", problem)
    _check_ports(eng, proxy, v)
    if not 0 <= eng.get("gpus", 0) <= MAX_GPUS:  # a huge count made `check` raise or build a list for minutes
        raise v.fail("engine.gpus", f"{_short(eng['gpus'])}: expected 0 to {MAX_GPUS}")
    timeout = eng.get("start_timeout_s", 1)
    # the range alone: NaN fails it (.inf and huge ints made `render` raise and `up` wait forever)
    if not 0 < timeout <= 2**53:
        raise v.fail("engine.start_timeout_s", f"{_short(timeout)}: must be a finite number of seconds > 0")
    for flag in eng.get("args", {}):
        if flag.startswith("-") or not re.match(r"^[a-z0-9][a-z0-9-]*$", flag):
            raise v.fail(f"engine.args.{flag}", "flag names are written without dashes, e.g. max-model-len")
    _check_trace_endpoint(eng, get_engine(eng["kind"]).trace_flags, v)
    _check_exec_strings(eng, v)
    return EngineSpec(
        kind=eng["kind"],
        version=eng["version"],
        served_name=eng["served_name"],
        port=eng["port"],
        python=os.path.expanduser(eng["python"]) if eng.get("python") else "",
        host=eng.get("host", "127.0.0.1"),
        gpus=eng.get("gpus", 0),
        start_timeout_s=eng.get("start_timeout_s", 3600),
        args=dict(eng.get("args", {})),
        env={k: _env_str(val) for k, val in eng.get("env", {}).items()},
        unset_env=tuple(eng.get("unset_env", ())),
        otlp_traces_endpoint=eng.get("otlp_traces_endpoint") or None,
    )


def _check_trace_endpoint(eng: dict[str, Any], flags: tuple[str, ...], v: _Validator) -> None:
    """engine.otlp_traces_endpoint: one word, and its flags not also among engine.args."""
    endpoint = eng.get("otlp_traces_endpoint")
    if not endpoint:
        return
    if not re.fullmatch(r"\S+", endpoint):
        raise v.fail("engine.otlp_traces_endpoint", f"{_short(endpoint)}: expected a collector address without spaces")
    for flag in flags:
        if flag[2:] in eng.get("args", {}):
            raise v.fail(
                "engine.otlp_traces_endpoint", f"the engine's {flag} is also set as engine.args.{flag[2:]}: set one"
            )


# One argv or environment string is at most 32 pages on Linux (MAX_ARG_STRLEN, 128 KiB with 4 KiB
# pages): a longer one (an inline chat template) made exec fail with E2BIG after the preflight passed.
MAX_ARG_BYTES = 32 * 4096 - 1  # without the terminating NUL


def _exec_problem(text: str) -> str | None:
    """Why exec would refuse this argv or environment string (subprocess raised ValueError or
    UnicodeEncodeError, a traceback after `check` passed and after `switch` stopped the old stack)."""
    if "\0" in text:
        return "contains a NUL byte: no command-line argument or environment variable can hold one"
    try:
        size = len(os.fsencode(text))
    except UnicodeError:
        return f"not encodable as {sys.getfilesystemencoding()} (a lone surrogate?): exec cannot pass it"
    if size > MAX_ARG_BYTES:
        return f"{size} bytes: one command-line argument or environment variable holds at most {MAX_ARG_BYTES}"
    return None


def _env_name_problem(name: str) -> str | None:
    if not name:
        return "an environment variable name must not be empty"
    if "=" in name:  # the environment's NAME=VALUE form (subprocess: "illegal environment variable name")
        return f"{_short(name)!r}: an environment variable name cannot contain '='"
    return _exec_problem(name)


def _check_exec_strings(eng: dict[str, Any], v: _Validator) -> None:
    """Every engine string that reaches exec (argv, environment) is one exec takes: env names
    without '=', no NUL byte, encodable, within MAX_ARG_BYTES (checked here, so that `check`
    fails and `up`/`switch` stop nothing)."""
    for key in ("python", "host", "served_name", "otlp_traces_endpoint"):
        problem = _exec_problem(eng[key]) if isinstance(eng.get(key), str) else None
        if problem:
            raise v.fail(f"engine.{key}", problem)
    for flag, value in eng.get("args", {}).items():
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            problem = _exec_problem(item) if isinstance(item, str) else None
            if problem:
                raise v.fail(f"engine.args.{flag}" + (f"[{i}]" if i is not None else ""), problem)
    for name, value in eng.get("env", {}).items():
        problem = _env_name_problem(name) or _exec_problem(f"{name}={_env_str(value)}")
        if problem:
            raise v.fail(f"engine.env.{name}", problem)
    for i, name in enumerate(eng.get("unset_env", ())):
        problem = _env_name_problem(name)
        if problem:
            raise v.fail(f"engine.unset_env[{i}]", problem)


def _proxy_spec(data: dict[str, Any], v: _Validator) -> ProxySpec:
    """The `proxy` section: a known default route and reasoning style, positive limits, and a
    route input bound of at least 200 characters."""
    proxy = dict(data)
    if proxy.get("default_route", "L2") not in ROUTES:
        raise v.fail("proxy.default_route", f"{proxy['default_route']!r}: expected one of {', '.join(ROUTES)}")
    if proxy.get("reasoning", "none") not in REASONING_STYLES:
        raise v.fail("proxy.reasoning", f"{proxy['reasoning']!r}: expected one of {', '.join(REASONING_STYLES)}")
    _check_proxy_limits(proxy, v)
    hosts = []
    for i, host in enumerate(proxy.get("media_url_hosts", ())):
        if host != "*" and not MEDIA_HOST.fullmatch(host):
            raise v.fail(
                f"proxy.media_url_hosts[{i}]",
                f"{_short(host)}: expected a host name such as images.example.com "
                '(no scheme, port or path), an IP address, or "*" for any',
            )
        hosts.append(host.lower().strip("[]"))
    proxy["media_url_hosts"] = tuple(hosts)
    if proxy.get("request_fields", "ignore") not in REQUEST_FIELD_MODES:
        raise v.fail(
            "proxy.request_fields",
            f"{_short(proxy['request_fields'])}: expected one of {', '.join(REQUEST_FIELD_MODES)}",
        )
    if "chat_template_kwargs" in proxy:
        proxy["chat_template_kwargs"] = tuple(proxy["chat_template_kwargs"])
    if "store" in proxy:
        from molctl.proxy.store.factory import parse_store_spec

        try:
            parse_store_spec(proxy["store"])
        except ValueError as exc:
            raise v.fail("proxy.store", str(exc)) from None
    from molctl.proxy.tracing import collector_address

    endpoint = proxy.get("otlp_endpoint")
    if endpoint is not None and not collector_address(endpoint):
        raise v.fail("proxy.otlp_endpoint", f"{_short(endpoint)}: expected a collector URL such as http://HOST:4318")
    return ProxySpec(**proxy)


def _check_proxy_limits(proxy: dict[str, Any], v: _Validator) -> None:
    """Positive, finite limits and timers; the ranges of state_commit_ms, summary_wait_s,
    route_max_input_chars and max_request_head_bytes."""
    for key in (
        "max_output_tokens",
        "route_max_tokens",
        "summary_max_tokens",
        "summary_queue_max",
        "route_timeout_s",
        "stream_write_timeout_s",
        "request_body_timeout_s",
        "sse_keepalive_s",
        "store_ttl_s",
        "store_max_bytes",
        "store_max_entries",
        "store_tenant_max_bytes",
        "store_tenant_max_entries",
        "max_inflight",
        "max_queue",
        "queue_timeout_s",
        "route_inflight",
        "summary_inflight",
        "engine_body_max_bytes",
        "summary_job_max_bytes",
    ):
        if proxy.get(key) is not None and proxy[key] <= 0:
            raise v.fail(f"proxy.{key}", "must be > 0")
        if isinstance(proxy.get(key), float) and not math.isfinite(proxy[key]):  # YAML .inf / .nan
            raise v.fail(f"proxy.{key}", f"{proxy[key]}: must be a finite number > 0")
        if isinstance(proxy.get(key), int) and proxy[key] > 2**53:  # a timer or a size past any float
            raise v.fail(f"proxy.{key}", f"{_short(proxy[key])}: too large (at most {2**53})")
    commit = proxy.get("state_commit_ms", 10.0)
    # the range alone: NaN fails it, and math.isfinite would raise on an int too large for a float
    if isinstance(commit, bool) or not (isinstance(commit, (int, float)) and 0 <= commit <= 1000):
        raise v.fail("proxy.state_commit_ms", f"{_short(commit)}: expected a number of milliseconds from 0 to 1000")
    wait = proxy.get("summary_wait_s", 5.0)
    if not 0 <= wait <= 3600:  # NaN fails the range too; 0: the next turn never waits for a summary
        raise v.fail("proxy.summary_wait_s", f"{_short(wait)}: expected seconds from 0 to 3600")
    if proxy.get("route_max_input_chars", 4000) < 200:
        raise v.fail("proxy.route_max_input_chars", "must be >= 200")
    head = proxy.get("max_request_head_bytes", 64 * 1024)
    if not 1024 <= head <= 64 * 1024 * 1024:
        raise v.fail("proxy.max_request_head_bytes", f"{_short(head)}: expected bytes from 1024 to {64 * 1024 * 1024}")


def _prompts(data: dict[str, Any], v: _Validator) -> Prompts:
    """The `prompts` section: exactly one description per route, no empty text, `{summary}` in
    `fold`, and the route prompt's description and label placeholders."""
    prompts = dict(data)
    if sorted(prompts["adapters"]) != list(ROUTES):
        got = ", ".join(sorted(prompts["adapters"])) or "none"
        raise v.fail("prompts.adapters", f"expected exactly the routes {', '.join(ROUTES)}, got {got}")
    for key in ("identity", "route", "summary"):
        if not prompts[key].strip():
            raise v.fail(f"prompts.{key}", "must not be empty")
    for route, text in prompts["adapters"].items():
        if not text.strip():
            raise v.fail(f"prompts.adapters.{route}", "must not be empty")
    if "fold" in prompts and "{summary}" not in prompts["fold"]:
        raise v.fail("prompts.fold", "must contain the placeholder {summary}")
    for ph in (PH_DESCRIPTIONS, PH_LABELS):
        if ph not in prompts["route"]:
            raise v.fail("prompts.route", f"must contain the placeholder {ph}")
    return Prompts(
        identity=prompts["identity"],
        route=prompts["route"],
        summary=prompts["summary"],
        adapters=dict(prompts["adapters"]),
        fold=prompts.get("fold", DEFAULT_FOLD),
    )


def _adapter_spec(data: dict[str, Any], v: _Validator) -> AdapterSpec:
    """The `adapters` section: at most one of the two rank rules."""
    adapters = dict(data)
    if adapters.get("rank_equals") is not None and adapters.get("rank_max") is not None:
        raise v.fail("adapters.rank_max", "set either rank_equals or rank_max, not both")
    for key in ("rank_equals", "rank_max"):  # a LoRA rank is at least 1
        if adapters.get(key) is not None and not 1 <= adapters[key] <= 2**16:
            raise v.fail(f"adapters.{key}", f"{_short(adapters[key])}: expected a LoRA rank from 1 to {2**16}")
    for i, name in enumerate(adapters.get("base_names", ())):
        if not name.strip() or name != name.strip():  # "" is in every declared base: every adapter would pass
            raise v.fail(
                f"adapters.base_names[{i}]",
                f"{_short(name)}: expected a base model name such as GLM-5.2, not blank and without surrounding spaces",
            )
    return AdapterSpec(
        rank_equals=adapters.get("rank_equals"),
        rank_max=adapters.get("rank_max"),
        base_names=tuple(adapters.get("base_names", ())),
        effect_canary=adapters.get("effect_canary", True),
    )


# Retention counts: the proxy's rotation renames part by part over `backups` names (a huge count
# was a thread spinning at 100% CPU and a log never rotated), and `up` keeps `keep` files per
# component; 1000 parts or files is more history than any operator reads, and cheap to walk.
MAX_LOG_FILES = 1000


def _log_spec(logs: dict[str, Any], v: _Validator) -> LogSpec:
    """The `logs` section: keep 1 to MAX_LOG_FILES, backups 0 to MAX_LOG_FILES, max_bytes >= 0."""
    if logs.get("max_bytes", 0) < 0:
        raise v.fail("logs.max_bytes", "must be >= 0")
    for key, low in (("keep", 1), ("backups", 0)):
        if key in logs and not low <= logs[key] <= MAX_LOG_FILES:
            raise v.fail(f"logs.{key}", f"{_short(logs[key])}: expected {low} to {MAX_LOG_FILES}")
    return LogSpec(**logs)


# --------------------------------------------------------------------------------------------
# Discovery.


def profile_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Built-in folder first, then MOLCTL_PROFILES_DIR entries, then --profiles-dir entries."""
    dirs = [builtin_profiles_dir()]
    env = os.environ.get("MOLCTL_PROFILES_DIR", "")
    dirs += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    dirs += [Path(p).expanduser() for p in extra]
    return dirs


def profile_files(dirs: Iterable[Path]) -> dict[str, Path]:
    """Name -> file, later folders replacing earlier ones. A NAME.yaml that is not a readable
    file (a directory, a dangling symlink) is listed too, so that loading it says so: it was
    skipped, and `up NAME` said "no profile named". Such an entry whose stem is no profile name
    (an editor's `.#NAME.yaml` lock link) is still skipped."""
    found: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted(d.iterdir()):
            if f.suffix in (".yaml", ".yml") and (f.is_file() or NAME_RE.match(f.stem)):
                found[f.stem] = f
    return found


def load_profile_file(path: Path, overrides: Iterable[tuple[str, Any]] = ()) -> Profile:
    data, lines = load_yaml_with_lines(path)
    return build_profile(data, path, lines, overrides, expected_name=path.stem)


def check_profile_name(name: str) -> str:
    """A PROFILE argument of any command: a profile name, the rule of a profile's own `name`
    (`[a-z0-9][a-z0-9-]*`), so that it is never a path joined onto the state dir or a profiles
    folder (`..`, `tiny/../tiny`). Exit 3 naming the value; a valid name no profile has is the
    caller's "no profile named" answer."""
    if not NAME_RE.fullmatch(name):
        shown = repr(name) if len(name) <= 80 else repr(name[:80]) + "..."
        raise ProfileError(
            f"bad profile name {shown}: expected [a-z0-9][a-z0-9-]* (a profile's name, see `molctl profiles`)"
        )
    return name


def load_profile(name: str, dirs: Iterable[Path], overrides: Iterable[tuple[str, Any]] = ()) -> Profile:
    check_profile_name(name)
    dirs = list(dirs)
    files = profile_files(dirs)
    if name not in files:
        known = ", ".join(sorted(files)) or "none"
        searched = ", ".join(str(d) for d in dirs)
        raise ProfileError(f"no profile named {name!r} (known: {known}; searched: {searched})")
    return load_profile_file(files[name], overrides)


def list_profiles(dirs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """`molctl profiles`: a row per profile found, and a one-line problem per file that does not load.
    No profile file at all is a ProfileError naming the folders searched (an install without its
    built-in profiles listed an empty table and exited 0)."""
    rows, problems = [], []
    files = profile_files(dirs)
    if not files:
        searched = ", ".join(str(d) for d in dirs)
        raise ProfileError(
            f"no profile found (searched: {searched}); give a folder of NAME.yaml files with --profiles-dir"
        )
    for _name, path in sorted(files.items()):
        try:
            p = load_profile_file(path)
        except ProfileError as exc:
            problems.append(str(exc))
            continue
        rows.append(
            {
                "name": p.name,
                "engine": p.engine.kind,
                "engine_version": p.engine.version,
                "served_model_name": p.served_model_name,
                "gpus": p.engine.gpus,
                "engine_port": p.engine.port,
                "proxy_port": p.proxy.port,
                "source": str(path),
                "description": p.description,
            }
        )
    return rows, problems


def route_instruction(profile: Profile) -> str:
    """The router's instruction, built once per profile from the adapter descriptions."""
    descriptions = "\n".join(
        f"{route} = {' '.join(profile.substitute(profile.prompts.adapters[route]).split())}" for route in ROUTES
    )
    text = profile.substitute(profile.prompts.route)
    return text.replace(PH_DESCRIPTIONS, descriptions).replace(PH_LABELS, " ".join(ROUTES)).strip()
