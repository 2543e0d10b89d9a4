"""The Responses API's requests: validation and translation to a chat request (`parse_request`).

A Responses request becomes a chat request (`ResponsesRequest.chat_body`): `instructions` become
a leading system message for this request only, the stored chain's chat messages
(`previous_response_id`) come next, then this request's input items as chat messages
(`convert`). The pipeline then runs it like any chat request, and `events` shapes its answer as a
Response object or as Responses stream events. `item_reference` inputs are fetched by the caller
(`NeedsReferences`, `referenced_items`); `check_chain` refuses what OpenAI refuses once the input
meets the chain. The choices where OpenAI's API leaves room (tools, input items, reasoning round
trip, text format, include, unknown fields, truncation, metadata, status) are in
docs/design/proxy.md, "The Responses API".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from molctl.proxy.apis.chat_validation import EFFORTS, SAMPLING_NUMBERS, check_model, finite_number
from molctl.proxy.apis.conversations.records import conversation_param
from molctl.proxy.apis.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.apis.responses.convert import (
    _convert_input,
    _convert_text,
    _convert_tool_choice,
    _convert_tools,
    duplicate_item,
    item_type,
)
from molctl.proxy.apis.responses.tool_echo import echo_tools
from molctl.proxy.errors import ProxyError, invalid, shown

ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "presence_penalty",
    "frequency_penalty",
    "prompt_cache_key",
    "safety_identifier",
    "temperature",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
)
ACCEPTED_IGNORED = (
    "service_tier",
    "stream_options",
    "prompt_cache_retention",
    "prompt_cache_options",
    "max_tool_calls",
    "moderation",
    "context_management",
    "background_options",
)
# ignoring these would drop what the client asked for: a 400 naming them when set
UNSERVED = {
    "prompt": "stored prompt templates are not served here; send the text as instructions",
}
KNOWN = frozenset(
    {
        "model",
        "input",
        "stream",
        "store",
        "tools",
        "tool_choice",
        "text",
        "reasoning",
        "include",
        "background",
        "conversation",
        *ECHOED,
        *ACCEPTED_IGNORED,
        *UNSERVED,
    }
)
REASONING_UNUSED = ("generate_summary", "context", "mode")  # OpenAI's Reasoning fields this proxy does not use
MIN_OUTPUT_TOKENS = 16  # OpenAI refuses a smaller max_output_tokens
INCLUDE_LOGPROBS, INCLUDE_REASONING = "message.output_text.logprobs", "reasoning.encrypted_content"


class ItemIds:
    """Output item ids of one response: `PREFIX` + the response id's hex + a counter, so an
    `item_reference` names the response that holds its item (`response_of_item`)."""

    def __init__(self, response_id: str):
        self.base = response_id.removeprefix("resp_")
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.base}{self.n:04x}"


def response_of_item(item_id: str) -> str | None:
    """The response id an output item id of this proxy's (ItemIds) came from, else None."""
    _, sep, rest = item_id.partition("_")
    if not sep or len(rest) != 28 or not all(c in "0123456789abcdef" for c in rest):
        return None
    return "resp_" + rest[:24]


class NeedsReferences(Exception):
    """The input holds item references: the caller fetches them (`referenced_items`) and parses
    `body` again with `refs`."""

    def __init__(self, body: dict[str, Any], ids: list[str]):
        super().__init__(ids)
        self.body, self.ids = body, ids


def item_not_found(item_id: str) -> ProxyError:
    return invalid(
        f"Item with id {shown(item_id)} not found (items of responses created with store=false are not kept).", "input"
    )


def referenced_items(ids: list[str], records: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """item id -> the output item it names, from the stored records by response id (the first
    id not found is a 400, as OpenAI's)."""
    out: dict[str, dict[str, Any]] = {}
    for item_id in ids:
        record = records.get(response_of_item(item_id) or "")
        item = next(
            (i for i in ((record or {}).get("response") or {}).get("output") or () if i.get("id") == item_id), None
        )
        if item is None:
            raise item_not_found(item_id)
        out[item_id] = item
    return out


def public_param(param: str | None) -> str | None:
    """An error's `param` as a Responses client knows it: the chat request the proxy builds has
    `messages` where the client sent `input` (a context overflow names `messages`), and
    `response_format` where it sent `text.format`; chat's function tools and named tool_choice
    nest under `function` where the Responses request has the fields flat
    (`tools[0].function.parameters` -> `tools[0].parameters`, `tool_choice.function.name` ->
    `tool_choice.name`)."""
    if param is None:
        return None
    if param == "messages" or param.startswith("messages["):
        return "input"
    if param == "response_format" or param.startswith("response_format."):
        return "text.format"  # the Responses request's text.format became chat's response_format
    if param.startswith(("tools[", "tool_choice.")):
        return re.sub(r"^(tools\[\d+\]|tool_choice)\.function(?=\.|$)", r"\1", param)
    return param


def not_found(response_id: str, param: str | None = None) -> ProxyError:
    if param == "previous_response_id":
        # Each stored response holds its whole conversation, so a chain never needs its earlier
        # responses; only the one named here must still be stored.
        return ProxyError(
            404,
            f"Previous response with id '{shown(response_id)}' not found (deleted, created with "
            "store=false, or expired or evicted from the proxy's store).",
            "invalid_request_error",
            "previous_response_not_found",
            "previous_response_id",
        )
    return ProxyError(404, f"Response with id '{shown(response_id)}' not found.", "invalid_request_error", "not_found")


@dataclass
class ResponsesRequest:
    body: dict[str, Any]
    chat: dict[str, Any]  # the chat request without its messages
    messages: list[dict[str, Any]]  # this request's input as chat messages
    input_items: list[dict[str, Any]]
    stream: bool = False
    store: bool = True
    logprobs: bool = False
    encrypted_reasoning: bool = False  # include: reasoning.encrypted_content
    # a namespace's functions as the engine knows them: NAMESPACE__NAME -> (namespace, name)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    prev: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)  # the chain's chat messages
    conversation_id: str | None = None  # `conversation` (apis.conversations): its items are the history
    tools: list[dict[str, Any]] = field(default_factory=list)  # the Response's `tools` (tool_echo)

    def chat_body(self) -> dict[str, Any]:
        """The chat request (after the stored chain, if any, was loaded into `prev` / `history`)."""
        self.check_chain()
        head = []
        if self.body.get("instructions"):
            head.append({"role": "system", "content": self.body["instructions"]})
        return {**self.chat, "messages": head + self.history + self.messages}

    def check_chain(self) -> None:
        """What OpenAI refuses once the input meets the stored chain (400s, `param: "input"`):
        - an input item with the id of an item the previous response holds already (its output, or
          its own input): the client resent what `previous_response_id` brings (it would reach the
          engine twice). Only the previous response's items are known by id; echoed `reasoning`
          items are ignored anyway.
        - a function call left without its output: the previous response's calls and the input's
          own must each be answered by a `function_call_output` of this input;
        - a `function_call_output` whose `call_id` matches no call of the chain or of the input.
        Calls answered, or left unanswered, earlier in the chain are not looked at again (a chain
        stored before these checks continues)."""
        if self.prev is not None:
            known = {i.get("id") for i in self.prev.get("input_items") or [] if isinstance(i, dict)}
            known |= {i.get("id") for i in (self.prev.get("response") or {}).get("output") or [] if isinstance(i, dict)}
            known.discard(None)
            for item in self.input_items:
                if item["id"] in known:
                    raise duplicate_item(item["id"])
        seen: set[str] = set()
        for msg in self.history:
            seen.update(c.get("id") for c in msg.get("tool_calls") or [])
        last = self.history[-1] if self.history else {}
        pending = {c.get("id"): None for c in last.get("tool_calls") or []}  # the previous response's calls
        for msg in self.messages:
            for call in msg.get("tool_calls") or []:
                seen.add(call["id"])
                pending[call["id"]] = None
            if msg["role"] == "tool":
                if msg["tool_call_id"] not in seen:
                    raise invalid(
                        f"No tool call found for function call output with call_id {shown(msg['tool_call_id'])}.",
                        "input",
                    )
                pending.pop(msg["tool_call_id"], None)
        if pending:
            raise invalid(f"No tool output found for function call {shown(str(next(iter(pending))))}.", "input")


def references(body: Any) -> list[str]:
    """The ids of the `item_reference` input items (what `NeedsReferences` asks the caller for)."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return []
    return [
        i["id"]
        for i in items
        if isinstance(i, dict) and item_type(i) == "item_reference" and isinstance(i.get("id"), str)
    ]


def parse_request(
    body: Any,
    public_model: str,
    media_hosts: tuple[str, ...] = (),
    fields: FieldPolicy = PERMISSIVE,
    refs: dict[str, dict[str, Any]] | None = None,
) -> ResponsesRequest:
    """Validate a Responses request and translate what does not depend on the stored chain.
    `media_hosts`: `proxy.media_url_hosts` (chat_validation.check_media_url); `fields`: the engine's
    extensions and what to do with unknown fields (request_fields); `refs`: see NeedsReferences."""
    _check_top(body, public_model, fields, refs)
    messages, items = _convert_input(body["input"], media_hosts, fields, refs)
    chat: dict[str, Any] = {"model": public_model, **fields.forwarded(body)}
    _sampling(body, chat)
    namespaced: dict[str, tuple[str, str]] = {}
    if body.get("tools") is not None:
        tools, namespaced = _convert_tools(body["tools"], fields)
        if tools:
            chat["tools"] = tools
    echoed = echo_tools(body.get("tools"))
    if body.get("tool_choice") is not None:
        _convert_tool_choice(body["tool_choice"], chat, fields)
    if body.get("text") is not None:
        fmt = _convert_text(body["text"], fields)
        if fmt is not None:
            chat["response_format"] = fmt
    _reasoning(body.get("reasoning"), chat, fields)
    _check_echoed(body)
    _check_accepted(body)
    include = body.get("include")
    logprobs = _logprobs(body, include, chat, fields)
    if body.get("user") is not None:
        chat["user"] = body["user"]
    return ResponsesRequest(
        body=body,
        chat=chat,
        messages=messages,
        input_items=items,
        stream=bool(body.get("stream")),
        store=body.get("store", True) is not False,
        logprobs=logprobs,
        encrypted_reasoning=INCLUDE_REASONING in (include or ()),
        namespaced=namespaced,
        conversation_id=conversation_param(body),
        tools=echoed,
    )


def _check_top(body: Any, public_model: str, fields: FieldPolicy, refs: dict[str, dict[str, Any]] | None) -> None:
    """What refuses the request before its input is read (and the references it must fetch first)."""
    if refs is None:
        ids = references(body)
        if ids:
            raise NeedsReferences(body, ids)
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise invalid("'background' must be a boolean.", "background")
    if background and body.get("store") is False:  # as OpenAI: a background response is polled from the store
        raise invalid("Background mode requires store=true: a background response is retrieved by its id.", "store")
    for key, why in UNSERVED.items():
        if body.get(key) is not None:
            raise invalid(f"'{key}' is not supported: {why}.", key)
    fields.check_extra(body, KNOWN, "responses")
    check_model(body, public_model)
    if "input" not in body:
        raise invalid("'input' is required.", "input")


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """The flags, strings and sampling fields, checked; those the engine takes, into `chat`."""
    for key in ("stream", "store"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise invalid(f"'{key}' must be a boolean.", key)
    for key in ("instructions", "previous_response_id", "user", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise invalid(f"'{key}' must be a string.", key)
    if body.get("stream"):
        chat["stream"] = True
    for key in SAMPLING_NUMBERS:  # the penalties too, as the chat endpoint forwards them
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise invalid(f"'{key}' must be a number.", key)
            if not finite_number(v):  # NaN/Infinity: vLLM's range checks are false for NaN (chat_validation)
                raise invalid(f"'{key}' must be a finite number.", key)
            chat[key] = v
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise invalid("'max_output_tokens' must be an integer.", "max_output_tokens")
        if limit < MIN_OUTPUT_TOKENS:  # OpenAI's floor: integer_below_min_value
            raise ProxyError(
                400,
                f"Invalid 'max_output_tokens': integer below minimum value. Expected a value >= "
                f"{MIN_OUTPUT_TOKENS}, but got {limit} instead.",
                "invalid_request_error",
                "integer_below_min_value",
                "max_output_tokens",
            )
        chat["max_tokens"] = limit
    if body.get("parallel_tool_calls") is not None:
        if not isinstance(body["parallel_tool_calls"], bool):
            raise invalid("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def _reasoning(reasoning: Any, chat: dict[str, Any], fields: FieldPolicy) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise invalid("'reasoning' must be an object.", "reasoning")
    # OpenAI's other Reasoning fields, explicit null: "not set", even with request_fields: reject
    fields.check_extra(
        {k: v for k, v in reasoning.items() if v is not None or k not in REASONING_UNUSED},
        ("effort", "summary"),
        "responses",
        "reasoning.",
    )
    if reasoning.get("effort") is not None:
        if reasoning["effort"] not in EFFORTS:
            raise invalid(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}.", "reasoning.effort")
        chat["reasoning_effort"] = reasoning["effort"]
    if reasoning.get("summary") not in (None, "auto", "concise", "detailed"):
        raise invalid("'reasoning.summary' must be auto, concise or detailed.", "reasoning.summary")


SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's Response service_tier values


def _check_accepted(body: dict[str, Any]) -> None:
    """Accepted fields that have no effect here are still checked for OpenAI's types, so a client's
    typo is a 400 naming it rather than silently taken."""
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        raise invalid(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}.", "service_tier")
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict) or not isinstance(options.get("include_obfuscation", False), bool)
    ):
        raise invalid("'stream_options' must be an object; its 'include_obfuscation' a boolean.", "stream_options")
    calls = body.get("max_tool_calls")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
        raise invalid("'max_tool_calls' must be a non-negative integer.", "max_tool_calls")


def _check_echoed(body: dict[str, Any]) -> None:
    """`truncation` and `metadata`: echoed, never sent to the engine."""
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise invalid("'truncation' must be 'auto' or 'disabled'.", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            # a null value is accepted, as OpenAI does (it is echoed as sent)
            isinstance(k, str) and len(k) <= 64 and (v is None or isinstance(v, str) and len(v) <= 512)
            for k, v in metadata.items()
        )
    ):
        raise invalid(
            "'metadata' must be an object of at most 16 pairs: string keys of up to 64 characters, "
            "string values of up to 512.",
            "metadata",
        )


def _logprobs(body: dict[str, Any], include: Any, chat: dict[str, Any], fields: FieldPolicy) -> bool:
    """`include` and `top_logprobs`: whether the output text carries logprobs."""
    logprobs = False
    if include is not None:
        if not isinstance(include, list):
            raise invalid("'include' must be an array.", "include")
        for i, value in enumerate(include):
            if not isinstance(value, str):
                raise invalid(f"'include[{i}]' must be a string.", f"include[{i}]")
            if value not in (INCLUDE_LOGPROBS, INCLUDE_REASONING):
                fields.note_ignored(f"include[].{value}"[:80], "responses", "nothing of it exists here")
        logprobs = INCLUDE_LOGPROBS in include
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise invalid("'top_logprobs' must be an integer from 0 to 20.", "top_logprobs")
        logprobs = True
        chat["top_logprobs"] = top
    if logprobs:
        chat["logprobs"] = True
    return logprobs
