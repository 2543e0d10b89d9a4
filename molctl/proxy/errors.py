"""Errors the proxy returns, in the OpenAI error shape. Messages never name an adapter."""

from __future__ import annotations

import re
from typing import Any


class ProxyError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def shown(value: str, limit: int = 80) -> str:
    """A client-given id or path as an error message quotes it: cut at `limit` characters (a
    100 KB id is not echoed whole)."""
    return value if len(value) <= limit else value[:limit] + "..."


def invalid(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", "invalid_request_error", param)


def websocket_mode() -> ProxyError:
    """A WebSocket upgrade to /v1/responses: OpenAI's WebSocket mode (`response.create` events over
    one socket) is not served; the same requests go over HTTP."""
    return ProxyError(
        400,
        "WebSocket mode of the Responses API (response.create events over a WebSocket to /v1/responses) "
        "is not supported here; send each turn as POST /v1/responses with stream=true (Server-Sent Events) "
        "and previous_response_id.",
        "invalid_request_error",
        "websocket_mode_not_supported",
        None,
    )


def draining(rid: str | None = None) -> ProxyError:
    """503 `draining`: a new request during a drain, or (`rid`) one still running at its deadline."""
    message = (
        "The server reached its drain deadline before this request finished (request id "
        f"{rid}); retry on another instance."
        if rid
        else "The server is shutting down; retry on another instance."
    )
    return ProxyError(503, message, "server_error", "draining", headers={"retry-after": "5"})


def overloaded(exc) -> ProxyError:
    """Admission refused (molctl.proxy.pipeline.admission.Rejected): 429 with its Retry-After."""
    why = "too many requests are waiting" if exc.reason == "queue_full" else "no capacity freed up in time"
    return ProxyError(
        429,
        f"The server is overloaded ({why}); retry after {exc.retry_after} s.",
        "rate_limit_error",
        "rate_limit_exceeded",
        headers={"retry-after": str(exc.retry_after)},
    )


class EngineUnavailable(Exception):
    """The engine could not be reached (refused, reset, timed out)."""


class EngineHTTPError(Exception):
    """The engine answered an error: an HTTP status, or an error frame inside its stream (then
    `status` is the frame's numeric `code`, else 500, and `in_stream` is true)."""

    def __init__(self, status: int, body: Any, in_stream: bool = False):
        super().__init__(f"engine answered {'an error frame' if in_stream else 'HTTP'} {status}")
        self.status = status
        self.body = body
        self.in_stream = in_stream

    def message(self) -> str:
        b = self.body
        if isinstance(b, dict):
            err = b.get("error", b)
            if isinstance(err, dict):
                return str(err.get("message") or err.get("detail") or "")
            return str(err)
        return str(b or "")[:500]

    def one_line(self, limit: int = 200) -> str:
        """`message()` on one line, at most `limit` characters (for the proxy's log)."""
        return " ".join(self.message().split())[:limit]


CONTEXT_MARKERS = (
    "maximum context length",
    "maximum sequence length",
    "longer than the model's context length",
    "exceeds the context length",
)


NO_ROOM_LEFT = "max_tokens must be at least 1, got 0"


LORA_REQUEST_RE = re.compile(r"LoRARequest\([^)]*\)")
LORA_FIELD_RE = re.compile(
    r"\b(?:lora_int_id|lora_id|lora_name|lora_path|lora_local_path|lora_request)\s*[=:]\s*"
    r"(?:'[^']*'|\"[^\"]*\"|[\w./-]+)[,;]?\s*"
)
FILE_URL_RE = re.compile(r"file://[^\s'\"`<>]*")
URL_RE = re.compile(r"\b(?:https?|wss?|grpc)://[^\s'\"`<>]+")
# an IPv4 address or localhost (or a bracketed IPv6 one), with its port if any
ADDRESS_RE = re.compile(r"(?<![\w.])(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|\[[0-9A-Fa-f:]+\])(?::\d{1,5})?(?![\w.])")
# an IPv6 address without brackets: compressed (`::`, `fe80::1%eth0`) or all eight groups; a
# time such as 05:39:42 has neither
IPV6_RE = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4})*::[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4})*"
    r"|[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){7})(?:%[\w.-]+)?(?![\w:.])"
)
# a host name with its port: dotted with a letter in its last label (`engine-0.molctl.svc.cluster.local:8000`),
# or one label with a hyphen (`engine-0:8000`)
HOST_PORT_RE = re.compile(
    r"(?<![\w.-])(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z0-9-]*[A-Za-z][A-Za-z0-9-]*"
    r"|[A-Za-z][A-Za-z0-9]*-[A-Za-z0-9-]+):\d{1,5}(?![\w.])"
)
_PART = r"[\w.@+=,-]+"
# An absolute or home-relative path of two or more components, a component holding spaces when
# another follows it (`/srv/my models/L2`); URLs are left to URL_RE: their slashes follow ':' or '/'.
PATH_RE = re.compile(rf"(?<![\w.:/~-])~?(?:/{_PART}(?: {_PART})*(?=/))+/{_PART}/?")
# a relative path: three or more components (`loras/L2/adapter_config.json`), or any after ./ or ../
RELATIVE_PATH_RE = re.compile(rf"(?<![\w.:/~-])(?:\.\.?/{_PART}(?:/{_PART})*|{_PART}(?:/{_PART}){{2,}})/?")
# what a scrubbed message may still say of the engine's internals: then a generic message instead
DOUBT_RE = re.compile(r"(?i)lora|adapter|safetensors|<path>/")
# common decoration of a name in an engine's messages: lora-L2, adapter_L2, L2-v1, L2.3
_PREFIX = r"(?:(?:lora|adapter|model)[-_ ]?)?"
_SUFFIX = r"(?:[-_.]?v?\d+)?"


def server_names(profile: Any, upstream: str) -> list[str]:
    """What a profile tells of the server beside the engine's model names, for `scrub`: the model
    root, base and adapter folders, the base model's names, the engine's address and URL."""
    from urllib.parse import urlsplit

    from molctl.routes import ROUTES

    names = [
        profile.base_model,
        *getattr(profile.adapters, "base_names", ()),
        upstream.rstrip("/"),
        f"{profile.engine.host}:{profile.engine.port}",
    ]
    try:
        names.append(urlsplit(upstream).netloc)
    except ValueError:
        pass
    if profile.model_root is not None:
        names += [str(profile.model_root), str(profile.base_dir), *(str(profile.adapter_dir(r)) for r in ROUTES)]
    return [n for n in dict.fromkeys(names) if n and n.strip("./")]


def scrub(text: str, names: list[str], public: str) -> str:
    """Drop what an engine's message says about the server: every engine-side model, adapter and
    base name in `names` (in any case, with common decoration: `lora-L2`, `adapter_L2`, `L2-v1`)
    becomes the public model name; the paths and addresses in `names` (a configured folder, the
    engine's URL), any other file path (absolute, `~/`, `file://`, relative, with spaces), URL
    and IP address become `<path>` / `<address>`; LoRA internals (`LoRARequest(...)`,
    `lora_int_id=3`) go."""
    text = LORA_REQUEST_RE.sub(public, text)
    text = LORA_FIELD_RE.sub("", text)
    models = []
    for name in sorted(names, key=len, reverse=True):
        if "/" in name:  # a configured path or URL: as it is, and without its leading slash
            text = text.replace(name, "<path>" if "://" not in name else "<address>")
            if name.startswith("/"):
                text = text.replace(name.lstrip("/"), "<path>")
        elif re.fullmatch(r"[\w.-]+:\d+", name):  # host:port
            text = text.replace(name, "<address>")
        else:
            models.append(name)
    text = FILE_URL_RE.sub("<path>", text)
    text = URL_RE.sub("<address>", text)
    text = ADDRESS_RE.sub("<address>", text)
    text = IPV6_RE.sub("<address>", text)
    text = HOST_PORT_RE.sub("<address>", text)
    text = PATH_RE.sub("<path>", text)
    text = RELATIVE_PATH_RE.sub("<path>", text)
    for name in models:
        text = re.sub(rf"(?i)(?<![A-Za-z0-9]){_PREFIX}{re.escape(name)}{_SUFFIX}(?![A-Za-z0-9])", public, text)
    return text


STORE_CAUSES = {"ENOSPC": "its disk is full (no space left on the device)", "EIO": "a disk I/O error"}
STORE_RETRY_AFTER_S = 30


def store_cause(exc: Exception) -> str:
    """A failed store call's cause for `store_failures_total`: damaged, ENOSPC, EIO, locked or other."""
    cause = getattr(exc, "cause", None)
    if cause is None and type(exc).__name__ == "StoreBusy":  # another process's write lock (molctl.proxy.store.base)
        return "locked"
    return cause or "other"


def store_failure(exc: Exception, rid: str) -> ProxyError | None:
    """What the client gets for a failed store call (molctl.proxy.store.base.StoreError) by its
    cause: a damaged store is a 500 `store_damaged`, a write the disk refused a 503
    `store_unavailable` naming why (with Retry-After), a record over its byte quota on its own a 400
    `store_quota_exceeded` naming the quota; None for any other (the caller's 500)."""
    cause = getattr(exc, "cause", None)
    if cause == "quota":  # the record with its conversation is over a byte cap on its own (QuotaExceeded)
        return ProxyError(
            400,
            f"The response cannot be stored: with its conversation it is {exc.size} bytes, over "
            f"this API key's stored-response quota ({exc.setting}: {exc.cap} bytes). Send `store: "
            f"false`, or start a new conversation (request id {rid}).",
            "invalid_request_error",
            "store_quota_exceeded",
            param="store",
        )
    if cause == "damaged":
        return ProxyError(
            500,
            f"The proxy's response store is damaged: the record could not be read or written (request id {rid}).",
            "server_error",
            "store_damaged",
        )
    if cause in STORE_CAUSES:
        return ProxyError(
            503,
            f"The proxy cannot store the response: {STORE_CAUSES[cause]} (request id {rid}). Retry "
            "later, or send `store: false`.",
            "server_error",
            "store_unavailable",
            headers={"retry-after": str(STORE_RETRY_AFTER_S)},
        )
    return None


RETRY_AFTER_MAX_S = 300


def _retry_after(exc: EngineHTTPError) -> str:
    """The engine's Retry-After (whole seconds) between 1 and RETRY_AFTER_MAX_S; 5 when it sent none."""
    value = getattr(exc, "retry_after", None)
    digits = value.strip() if isinstance(value, str) else ""
    if not (digits.isascii() and digits.isdigit()):
        return "5"
    return str(min(max(int(digits), 1), RETRY_AFTER_MAX_S))


def _client_param(exc: EngineHTTPError, client_params: frozenset[str]) -> str | None:
    """The engine's `param` (vLLM sets it from VLLMValidationError.parameter: vllm/entrypoints/serve/
    exception_handling/error_response.py) when it names a parameter the client sent and the proxy
    passed on as it was (`temperature`, `response_format.json_schema`); never one the proxy built
    (`model`: an adapter's name; `messages[3]`: an index into the rewritten conversation)."""
    err = exc.body.get("error") if isinstance(exc.body, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    if isinstance(param, str) and re.split(r"[.\[]", param, maxsplit=1)[0] in client_params:
        return param[:200]
    return None


def from_engine(
    exc: Exception, names: list[str], public: str, client_params: frozenset[str] = frozenset()
) -> ProxyError:
    """Map an engine failure to what the client sees."""
    if isinstance(exc, EngineUnavailable):
        return ProxyError(502, "The model backend is unavailable; retry later.", "server_error", "engine_unavailable")
    if isinstance(exc, EngineHTTPError):
        message = scrub(exc.message(), names, public)
        if DOUBT_RE.search(message):  # still about the engine's internals: nothing of it reaches the client
            message = ""
        code = (
            exc.body.get("error", {}).get("code")
            if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict)
            else None
        )
        if exc.status in (400, 413) and (
            code == "context_length_exceeded" or any(m in message.lower() for m in CONTEXT_MARKERS)
        ):
            return ProxyError(400, message, "invalid_request_error", "context_length_exceeded", "messages")
        if exc.status == 400 and message.startswith(NO_ROOM_LEFT):
            # vLLM 0.32 for a prompt of exactly max-model-len tokens: the room left for output is 0
            # (api_utils.py get_max_tokens, then SamplingParams' check); the proxy refuses a client
            # max_tokens below 1 itself, so this is always the window, not the client's limit
            return ProxyError(
                400,
                f"The prompt fills the model's context window, leaving no room for output ({message})",
                "invalid_request_error",
                "context_length_exceeded",
                "messages",
            )
        if exc.status in (400, 422):
            return ProxyError(
                400,
                message or "The request was rejected by the model backend.",
                "invalid_request_error",
                "invalid_request_error",
                _client_param(exc, client_params),
            )
        if exc.status == 503:
            return ProxyError(
                503,
                "The model backend is not ready; retry later.",
                "server_error",
                "engine_unavailable",
                headers={"retry-after": _retry_after(exc)},
            )
        if exc.in_stream:
            return ProxyError(
                502,
                "The model backend failed while answering" + (f": {message}" if message else "."),
                "server_error",
                "engine_error",
            )
        return ProxyError(502, "The model backend failed to answer.", "server_error", "engine_error")
    return ProxyError(500, "Internal proxy error.", "server_error", "proxy_error")
