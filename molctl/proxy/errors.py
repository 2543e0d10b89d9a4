"""Errors the proxy returns, in the OpenAI error shape. Messages never name an adapter."""

from __future__ import annotations

import re
from typing import Any


class ProxyError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
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


def draining(rid: str | None = None) -> ProxyError:
    """503 `draining`: a new request during a drain, or (`rid`) one still running at its deadline."""
    message = ("The server reached its drain deadline before this request finished (request id "
               f"{rid}); retry on another instance." if rid else "The server is shutting down; retry on another instance.")
    return ProxyError(503, message, "server_error", "draining", headers={"retry-after": "5"})


def overloaded(exc) -> ProxyError:
    """Admission refused (molctl.proxy.admission.Rejected): 429 with its Retry-After."""
    why = "too many requests are waiting" if exc.reason == "queue_full" else "no capacity freed up in time"
    return ProxyError(429, f"The server is overloaded ({why}); retry after {exc.retry_after} s.", "rate_limit_error",
                      "rate_limit_exceeded", headers={"retry-after": str(exc.retry_after)})


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


CONTEXT_MARKERS = ("maximum context length", "maximum sequence length", "longer than the model's context length",
                   "exceeds the context length")


NO_ROOM_LEFT = "max_tokens must be at least 1, got 0"


LORA_REQUEST_RE = re.compile(r"LoRARequest\([^)]*\)")
LORA_FIELD_RE = re.compile(r"\b(?:lora_int_id|lora_id|lora_name|lora_path|lora_local_path|lora_request)\s*[=:]\s*"
                           r"(?:'[^']*'|\"[^\"]*\"|[\w./-]+)[,;]?\s*")
# An absolute or home-relative path of two or more components (URLs are left alone: their
# slashes follow ':' or another '/').
PATH_RE = re.compile(r"(?<![\w.:/~-])~?(?:/[\w.@+=,-]+){2,}/?")


def scrub(text: str, names: list[str], public: str) -> str:
    """Replace every engine-side model/adapter name in `text` with the public model name, and
    drop what the engine's messages say about the server: file paths (`/srv/models/.../loras/L2`)
    and LoRA internals (`LoRARequest(...)`, `lora_int_id=3`)."""
    text = LORA_REQUEST_RE.sub(public, text)
    text = LORA_FIELD_RE.sub("", text)
    text = PATH_RE.sub("<path>", text)
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", public, text)
    return text


STORE_CAUSES = {"ENOSPC": "its disk is full (no space left on the device)", "EIO": "a disk I/O error"}
STORE_RETRY_AFTER_S = 30


def store_cause(exc: Exception) -> str:
    """A failed store call's cause for `store_failures_total`: damaged, ENOSPC, EIO, locked or other."""
    cause = getattr(exc, "cause", None)
    if cause is None and type(exc).__name__ == "StoreBusy":  # another process's write lock (response_store)
        return "locked"
    return cause or "other"


def store_failure(exc: Exception, rid: str) -> ProxyError | None:
    """What the client gets for a failed store call (molctl.proxy.sqlite_store.StoreError) by its
    cause: a damaged store is a 500 `store_damaged`, a write the disk refused a 503
    `store_unavailable` naming why (with Retry-After); None for any other (the caller's 500)."""
    cause = getattr(exc, "cause", None)
    if cause == "damaged":
        return ProxyError(500, f"The proxy's response store is damaged: the record could not be read or written "
                          f"(request id {rid}).", "server_error", "store_damaged")
    if cause in STORE_CAUSES:
        return ProxyError(503, f"The proxy cannot store the response: {STORE_CAUSES[cause]} (request id {rid}). Retry "
                          "later, or send `store: false`.", "server_error", "store_unavailable",
                          headers={"retry-after": str(STORE_RETRY_AFTER_S)})
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


def from_engine(exc: Exception, names: list[str], public: str, client_params: frozenset[str] = frozenset()) -> ProxyError:
    """Map an engine failure to what the client sees."""
    if isinstance(exc, EngineUnavailable):
        return ProxyError(502, "The model backend is unavailable; retry later.", "server_error", "engine_unavailable")
    if isinstance(exc, EngineHTTPError):
        message = scrub(exc.message(), names, public)
        code = exc.body.get("error", {}).get("code") if isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict) else None
        if exc.status in (400, 413) and (code == "context_length_exceeded" or any(m in message.lower() for m in CONTEXT_MARKERS)):
            return ProxyError(400, message, "invalid_request_error", "context_length_exceeded", "messages")
        if exc.status == 400 and message.startswith(NO_ROOM_LEFT):
            # vLLM 0.32 for a prompt of exactly max-model-len tokens: the room left for output is 0
            # (api_utils.py get_max_tokens, then SamplingParams' check); the proxy refuses a client
            # max_tokens below 1 itself, so this is always the window, not the client's limit
            return ProxyError(400, "The prompt fills the model's context window, leaving no room for output "
                              f"({message})", "invalid_request_error", "context_length_exceeded", "messages")
        if exc.status in (400, 422):
            return ProxyError(400, message or "The request was rejected by the model backend.", "invalid_request_error",
                              "invalid_request_error", _client_param(exc, client_params))
        if exc.status == 503:
            return ProxyError(503, "The model backend is not ready; retry later.", "server_error", "engine_unavailable",
                              headers={"retry-after": _retry_after(exc)})
        if exc.in_stream:
            return ProxyError(502, "The model backend failed while answering" + (f": {message}" if message else "."),
                              "server_error", "engine_error")
        return ProxyError(502, "The model backend failed to answer.", "server_error", "engine_error")
    return ProxyError(500, "Internal proxy error.", "server_error", "proxy_error")
