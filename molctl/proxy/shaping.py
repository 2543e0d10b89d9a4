"""The one place that shapes what clients see: the public model name, the proxy's own ids, only
standard fields (engine extras such as stop_reason, prompt_logprobs or kv_transfer_params are
dropped), and never an adapter name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from molctl.engines.base import AnswerTokens, Engine

MESSAGE_KEYS = ("role", "content", "refusal", "tool_calls", "reasoning_content", "reasoning", "annotations", "audio")
DELTA_KEYS = ("role", "content", "refusal", "tool_calls", "reasoning_content", "reasoning")
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
# vLLM's own: a request aborted by the engine, or failed during generation. Kept, so a client
# never takes a cut-off answer for a complete one (the SDK accepts any string here).
FAILED_FINISH_REASONS = ("abort", "error")


def finish_reason(engine_reason: Any, has_tool_calls: bool) -> str:
    if engine_reason in FAILED_FINISH_REASONS:
        return engine_reason
    if has_tool_calls and engine_reason not in ("length", "content_filter"):
        return "tool_calls"
    return engine_reason if engine_reason in FINISH_REASONS else "stop"


def new_id() -> str:
    return "chatcmpl-" + os.urandom(12).hex()


def shape_tool_call(call: dict[str, Any], streaming: bool = False) -> dict[str, Any]:
    fn = call.get("function") or {}
    out: dict[str, Any] = {}
    if streaming:
        out["index"] = call.get("index", 0)
    if call.get("id"):
        out["id"] = call["id"]
    if call.get("type") or not streaming:
        out["type"] = "function"
    f: dict[str, Any] = {}
    if "name" in fn and fn["name"] is not None:
        f["name"] = fn["name"]
    if "arguments" in fn and fn["arguments"] is not None:
        f["arguments"] = fn["arguments"]
    if f or not streaming:
        out["function"] = f
    return out


def shape_usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if not all(isinstance(usage.get(k), int) for k in keys):
        return None
    out: dict[str, Any] = {k: usage[k] for k in keys}
    ptd = usage.get("prompt_tokens_details")
    if isinstance(ptd, dict) and isinstance(ptd.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {"cached_tokens": ptd["cached_tokens"]}
    ctd = usage.get("completion_tokens_details")
    if isinstance(ctd, dict) and isinstance(ctd.get("reasoning_tokens"), int):
        out["completion_tokens_details"] = {"reasoning_tokens": ctd["reasoning_tokens"]}
    return out


def shape_message(message: dict[str, Any]) -> dict[str, Any]:
    """The client's message: `role`, `content` and `refusal` always there (OpenAI's
    ChatCompletionResponseMessage requires all three). `content` is null only beside tool calls or
    a refusal; an empty text answer is "" on every engine version (vLLM 0.24 sends "", 0.32's
    parser engine sends null for it: `content or None` in vllm/parser/engine/parser_engine.py)."""
    out = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
    out["role"] = "assistant"
    out.setdefault("refusal", None)
    if message.get("tool_calls"):
        out["tool_calls"] = [shape_tool_call(c) for c in message["tool_calls"]]
    else:
        out.pop("tool_calls", None)
    out.setdefault("content", None if "tool_calls" in out or out["refusal"] is not None else "")
    return out


def shape_completion(body: dict[str, Any], public_model: str, response_id: str) -> dict[str, Any]:
    choice = (body.get("choices") or [{}])[0]
    message = shape_message(choice.get("message") or {})
    finish = finish_reason(choice.get("finish_reason"), bool(message.get("tool_calls")))
    out: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": public_model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": choice.get("logprobs")}],
    }
    usage = shape_usage(body.get("usage"))
    if usage:
        out["usage"] = usage
    return out


def role_delta() -> dict[str, Any]:
    """The first delta of a stream, as OpenAI sends it: the role, empty content, a null refusal."""
    return {"role": "assistant", "content": "", "refusal": None}


def chunk(
    response_id: str,
    public_model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    logprobs: Any = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": public_model,
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


def usage_chunk(response_id: str, public_model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": public_model,
        "choices": [],
        "usage": usage,
    }


def shape_delta(delta: dict[str, Any]) -> dict[str, Any]:
    out = {k: delta[k] for k in DELTA_KEYS if delta.get(k) is not None and k != "role"}
    if "tool_calls" in out:
        out["tool_calls"] = [shape_tool_call(c, streaming=True) for c in out["tool_calls"]]
    return out


class StreamedAnswer:
    """What a streamed answer said so far (its text, tool calls, finish reason, usage), and its
    chunks as the client gets them."""

    def __init__(self, rid: str, created: int, public: str):
        self.rid, self.created, self.public = rid, created, public
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return chunk(self.rid, self.public, self.created, delta, finish, logprobs)

    def feed(self, event: dict[str, Any], engine: Engine, tokens: AnswerTokens) -> Iterator[dict[str, Any]]:
        """The client chunks of one engine event (its usage and token ids kept)."""
        if event.get("usage"):
            self.usage = shape_usage(event["usage"])
        engine.stream_tokens(event, tokens)
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:  # the proxy asks for one choice: another is not this answer
                continue
            delta = shape_delta(choice.get("delta") or {})
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls", ()):
                acc = self.calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                acc["id"] = call.get("id") or acc["id"]
                fn = call.get("function") or {}
                acc["name"] += fn.get("name") or ""
                acc["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            # an empty delta may still carry logprobs: vLLM's last chunk for a token its
            # parser swallowed (an end token) has them with the finish_reason
            if delta or choice.get("logprobs"):
                yield self.chunk(delta, logprobs=choice.get("logprobs"))

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())
            ]
        return message
