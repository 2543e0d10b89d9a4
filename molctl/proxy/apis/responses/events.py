"""The Responses API's answers: Response objects (`complete_response`, `response_object`), the
stored record (`make_record`), `/input_items` pages, and the stream translator (`StreamTranslator`:
chat chunks -> Responses stream events, `sse` frames them).

A finish reason `length` gives `status: "incomplete"` with `incomplete_details.reason:
"max_output_tokens"`; the engine's `abort`/`error` give `status: "failed"` (not stored).
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

from molctl.proxy.apis.listing import list_page
from molctl.proxy.apis.responses.convert import encode_reasoning, flat_name, new_id
from molctl.proxy.apis.responses.protocol import ItemIds, ResponsesRequest
from molctl.proxy.errors import ProxyError


def shape_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        # cache_write_tokens: required by OpenAI's ResponseUsage; vLLM and SGLang report no cache writes
        "input_tokens_details": {
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
        "total_tokens": usage.get("total_tokens", 0),
    }


def shape_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    content = chat_logprobs.get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for lp in content or []:
        if isinstance(lp, dict) and isinstance(lp.get("token"), str):
            out.append(
                {
                    "token": lp["token"],
                    "logprob": lp.get("logprob", 0.0),
                    "bytes": lp.get("bytes") or [],
                    "top_logprobs": [
                        {"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes") or []}
                        for t in lp.get("top_logprobs") or []
                        if isinstance(t, dict)
                    ],
                }
            )
    return out


def status_of(finish: str | None) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """-> (status, incomplete_details, error) for a chat finish reason."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}, None
    if finish in ("abort", "error"):
        return "failed", None, {"code": "server_error", "message": f"The model backend stopped the answer ({finish})."}
    return "completed", None, None


def public_call(item: dict[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """A function_call item as the client named the function: a namespace's NAMESPACE__NAME
    -> `name` and `namespace` apart (ResponsesRequest.namespaced)."""
    split = req.namespaced.get(item["name"])
    if split is not None:
        item["namespace"], item["name"] = split
    return item


def engine_call_name(item: dict[str, Any]) -> str:
    """A function_call item's name as the engine knows it (the inverse of `public_call`)."""
    return flat_name(item["name"], item.get("namespace"))


def reasoning_item(text: str, status: str, req: ResponsesRequest | None, ids: Any = new_id) -> dict[str, Any]:
    item = {
        "id": ids("rs_"),
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }
    if req is not None and req.encrypted_reasoning:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def output_items(
    message: dict[str, Any],
    status: str,
    logprobs: list | None = None,
    req: ResponsesRequest | None = None,
    ids: Any = new_id,
) -> list[dict[str, Any]]:
    """A chat assistant message -> Responses output items (reasoning, message, function calls);
    `ids`: their ids (ItemIds of the response)."""
    items: list[dict[str, Any]] = []
    item_status = "completed" if status == "completed" else "incomplete"
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        items.append(reasoning_item(reasoning, item_status, req, ids))
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    if text or not message.get("tool_calls"):  # an empty answer is still one (empty) message item
        items.append(
            {
                "id": ids("msg_"),
                "type": "message",
                "role": "assistant",
                "status": item_status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}],
            }
        )
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        item = {
            "id": ids("fc_"),
            "type": "function_call",
            "status": item_status,
            "call_id": call.get("id"),
            "name": fn.get("name"),
            "arguments": fn.get("arguments") or "",
        }
        items.append(public_call(item, req) if req is not None else item)
    return items


def _or(value: Any, default: Any) -> Any:
    """A request field echoed in the response: an explicit null is "not set", echoed as the default
    (OpenAI's Response object carries the effective values: temperature and top_p 1.0, penalties 0)."""
    return default if value is None else value


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list,
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    b = req.body
    fmt = (b.get("text") or {}).get("format") or {"type": "text"}
    reasoning = b.get("reasoning") or {}
    # `user` and `usage` null while unset: OpenAI's own examples (ResponseCreatedEvent) and Open
    # Responses' ResponseResource (both required, nullable) have them so; openai-openapi's schema
    # types them non-null, the one place the two specs disagree
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        # when the answer completed (OpenAI sets it on `completed` only); a stored record keeps it
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": bool(b.get("background")),
        "error": error,
        "incomplete_details": incomplete,
        "instructions": b.get("instructions"),
        "max_output_tokens": b.get("max_output_tokens"),
        "model": b["model"],
        "output": output,
        "parallel_tool_calls": _or(b.get("parallel_tool_calls"), True),
        "previous_response_id": b.get("previous_response_id"),
        "prompt_cache_key": b.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": b.get("safety_identifier"),
        "store": req.store,
        "temperature": _or(b.get("temperature"), 1.0),
        "text": {"format": fmt, "verbosity": _or((b.get("text") or {}).get("verbosity"), "medium")},
        "tool_choice": _or(b.get("tool_choice"), "auto"),
        "tools": req.tools,
        "top_logprobs": _or(b.get("top_logprobs"), 0),
        "top_p": _or(b.get("top_p"), 1.0),
        "presence_penalty": _or(b.get("presence_penalty"), 0.0),
        "frequency_penalty": _or(b.get("frequency_penalty"), 0.0),
        "max_tool_calls": b.get("max_tool_calls"),
        "service_tier": "default",
        "truncation": _or(b.get("truncation"), "disabled"),
        "usage": usage,
        "user": b.get("user"),
        "metadata": b.get("metadata") or {},
    }


def assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """The chat message kept in the chain (reasoning left out, as clients resend it in chat)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") if message.get("content") else None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments") or "",
                },
            }
            for c in message["tool_calls"]
        ]
    elif out["content"] is None:
        out["content"] = ""
    return out


def conversation_of(previous: dict[str, Any] | None) -> str | None:
    """The chain a request continues, named by its first response's id (the record of `previous`
    keeps it; a record written before it was kept names itself); None for a chain's first response."""
    if previous is None:
        return None
    return previous.get("conversation_id") or previous.get("id")


def make_record(
    req: ResponsesRequest, tenant: str, response: dict[str, Any], answer: dict[str, Any], route: str
) -> dict[str, Any]:
    return {
        "id": response["id"],
        "tenant": tenant,
        "created_at": response["created_at"],
        "previous_response_id": req.body.get("previous_response_id"),
        "conversation_id": conversation_of(req.prev) or response["id"],
        "messages": [*req.history, *req.messages, assistant_message(answer)],
        "input_items": req.input_items,
        "response": response,
        "route": route,
    }


def complete_response(req: ResponsesRequest, response_id: str, created_at: int, chat: dict[str, Any]) -> dict[str, Any]:
    choice = chat["choices"][0]
    status, incomplete, error = status_of(choice.get("finish_reason"))
    logprobs = shape_logprobs(choice.get("logprobs")) if req.logprobs else None
    return response_object(
        req,
        response_id,
        created_at,
        status,
        output_items(choice["message"], status, logprobs, req, ItemIds(response_id)),
        shape_usage(chat.get("usage")),
        error,
        incomplete,
    )


def list_input_items(record: dict[str, Any], limit: int, order: str, after: str | None) -> dict[str, Any]:
    return list_page(list(record.get("input_items") or []), limit, order, after)


# ------------------------------------------------------------------------ stream


def error_event(tr: StreamTranslator, exc: ProxyError, param: str | None) -> dict[str, Any]:
    """The stream's `error` event: OpenAI's fields flat (ResponseErrorEvent) and Open Responses'
    `error` object (ErrorStreamingEvent), so a client of either spec reads it."""
    error = {"type": exc.type, "code": exc.code, "message": exc.message, "param": param}
    return tr.ev("error", code=exc.code, message=exc.message, param=param, error=error)


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


class StreamTranslator:
    """Chat chunks (from `Orchestrator.stream`) -> Responses stream events, each numbered."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int | None = None):
        self.req = req
        self.id = response_id
        self.ids = ItemIds(response_id)
        self.created_at = created_at if created_at is not None else int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the open reasoning or message item
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> open function_call item
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.message: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": ""}

    def ev(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def snapshot(self, status: str, **kw: Any) -> dict[str, Any]:
        return response_object(self.req, self.id, self.created_at, status, kw.pop("output", []), **kw)

    def start(self) -> list[dict[str, Any]]:
        return [
            self.ev("response.created", response=self.snapshot("in_progress")),
            self.ev("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        # a copy of the item as it is now (empty): the translator goes on filling it, and the event is
        # serialised later, after the rest of its chunk was fed; clients build the item on this one
        return [self.ev("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))]

    def _close_open(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = self.output.index(item)
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "reasoning":
            if self.req.encrypted_reasoning:
                item["encrypted_content"] = encode_reasoning(part["text"])
            events = [
                self.ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                ),
                self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        else:
            events = [
                self.ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                ),
                self.ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
            ]
        return events + [self.ev("response.output_item.done", output_index=idx, item=item)]

    def _close_calls(self, status: str = "completed") -> list[dict[str, Any]]:
        events = []
        for _, item in sorted(self.calls.items()):
            idx = self.output.index(item)
            item["status"] = status
            if "namespace" not in item:
                public_call(item, self.req)
            events.append(
                self.ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    name=item["name"],
                    output_index=idx,
                    arguments=item["arguments"],
                )
            )
            events.append(self.ev("response.output_item.done", output_index=idx, item=item))
        self.calls = {}
        return events

    def _open(self, kind: str) -> list[dict[str, Any]]:
        """Close the open item, open a reasoning or message item with its one (empty) part."""
        events = self._close_open()
        if kind == "reasoning":
            item = {"id": self.ids("rs_"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": self.ids("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += self._add(item)
        events.append(
            self.ev(
                "response.content_part.added",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                part=copy.deepcopy(part),
            )
        )
        item["content"].append(part)
        self.open = item
        return events

    def _text(self, kind: str, delta: str, logprobs: list) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            events += self._open(kind)
        item = self.open
        idx = self.output.index(item)
        part = item["content"][0]
        part["text"] += delta
        if kind == "reasoning":
            events.append(
                self.ev(
                    "response.reasoning_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=delta
                )
            )
        else:
            part["logprobs"].extend(logprobs)
            events.append(
                self.ev(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    delta=delta,
                    logprobs=logprobs,
                )
            )
        return events

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat chunk -> the events it makes."""
        if chunk.get("usage"):
            self.usage = shape_usage(chunk["usage"])
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self.message["reasoning_content"] += reasoning
                events += self._text("reasoning", reasoning, [])
            if isinstance(delta.get("content"), str) and delta["content"]:
                self.message["content"] += delta["content"]
                lp = shape_logprobs(choice.get("logprobs")) if self.req.logprobs else []
                events += self._text("message", delta["content"], lp)
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                fn = call.get("function") or {}
                item = self.calls.get(index)
                if item is None:
                    events += self._close_open()
                    item = {
                        "id": self.ids("fc_"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call.get("id"),
                        "name": fn.get("name") or "",
                        "arguments": "",
                    }
                    if item["name"] in self.req.namespaced:  # engines send the whole name in the first delta
                        public_call(item, self.req)
                    self.calls[index] = item
                    events += self._add(item)
                else:
                    item["call_id"] = item["call_id"] or call.get("id")
                    item["name"] += fn.get("name") or ""
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    events.append(
                        self.ev(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=self.output.index(item),
                            delta=fn["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def answer(self) -> dict[str, Any]:
        """The chat message the stream made (for the chain)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.message["content"]}
        calls = [i for i in self.output if i["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = [
                {
                    "id": c["call_id"],
                    "type": "function",
                    "function": {"name": engine_call_name(c), "arguments": c["arguments"]},
                }
                for c in calls
            ]
        return msg

    def finish_events(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """-> (the closing events, the final response object)."""
        status, incomplete, error = status_of(self.finish)
        item_status = "completed" if status == "completed" else "incomplete"
        events: list[dict[str, Any]] = []
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            events += self._open("message")  # no text, no call: one empty message item, as `output_items` makes
        events += self._close_open(item_status) + self._close_calls(item_status)
        final = self.snapshot(status, output=self.output, usage=self.usage, error=error, incomplete=incomplete)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}[
            status
        ]
        return events + [self.ev(kind, response=final)], final

    def failed(self, exc: ProxyError) -> list[dict[str, Any]]:
        """The engine failed after the stream started: close what is open and say so."""
        events = self._close_open("incomplete") + self._close_calls("incomplete")
        error = {"code": "server_error", "message": exc.message}
        return events + [
            self.ev(
                "response.failed", response=self.snapshot("failed", output=self.output, error=error, usage=self.usage)
            )
        ]
