"""POST /v1/responses/compact: a long context made short from what the proxy keeps already.

The context is the stored chain of `previous_response_id` (its chat messages) followed by `input`
(input items, which may end with the assistant's own output). Its turns are looked up as the
pipeline looks them up (their conversation keys: molctl.proxy.conversations), and each turn whose
summary the summary hop has written is *folded* as the answer hop folds it: its user, system and
developer messages are kept verbatim and the rest of it (the answer, its tool calls and their
outputs, its reasoning) becomes ONE `compaction` item carrying the fold text (profile
`prompts.fold` with the summary). A turn without a summary (its summary hop not run yet, failed,
or a turn the proxy never answered) and the turn in progress are kept verbatim. No model call is
made, so `usage` is all zeros.

The compaction item's `encrypted_content` is the fold text compressed, in the clear to whoever
decodes it (it is the client's own conversation); sent back as an input item it becomes that
assistant message again (`convert._Input`, `compaction_item`). An item of another server's
compaction is refused (400 naming it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from molctl.proxy.apis.chat_validation import check_model
from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.apis.request_fields import PERMISSIVE
from molctl.proxy.apis.responses.compaction_item import encode_compaction
from molctl.proxy.apis.responses.convert import _Input, new_id
from molctl.proxy.apis.responses.protocol import not_found
from molctl.proxy.errors import invalid
from molctl.proxy.http.body import BIG_ITEMS
from molctl.proxy.pipeline.views import fold_text

KNOWN = (
    "model",
    "input",
    "previous_response_id",
    "instructions",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "service_tier",
)
END = {"role": "user", "content": "."}  # stands for the next request: the last turn is then looked up too


def _check(body: Any, public_model: str) -> None:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    for key in body:
        if key not in KNOWN:
            raise invalid(f"Unrecognized request argument supplied: {str(key)[:80]}", str(key)[:80])
    check_model(body, public_model)
    for key in ("previous_response_id", "instructions", "prompt_cache_key", "service_tier"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise invalid(f"'{key}' must be a string.", key)
    value = body.get("input")
    if value is not None and not isinstance(value, (str, list)):
        raise invalid("'input' must be a string or an array of input items.", "input")
    if not value and body.get("previous_response_id") is None:
        raise invalid("Nothing to compact: send 'input', 'previous_response_id' or both.", "input")


def input_messages(value: Any, media_hosts: tuple[str, ...]) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    conv = _Input(media_hosts, PERMISSIVE)
    for i, item in enumerate(value):
        w = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{w}' must be an object.", w)
        conv.add(item, w)
    return conv.messages


def _parts(content: Any, kind: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    out = []
    for part in content or ():
        if part.get("type") == "image_url":
            image = {"type": "input_image", "image_url": part["image_url"]["url"]}
            image["detail"] = part["image_url"].get("detail", "auto")
            out.append(image)
        else:
            out.append({"type": kind, "text": part.get("text", "")})
    return out


def items_of(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message as Responses items (what `convert._Input` turns back into that message)."""
    role = msg["role"]
    if role == "tool":
        return [
            {
                "id": new_id("fco_"),
                "type": "function_call_output",
                "call_id": msg["tool_call_id"],
                "output": msg.get("content") or "",
                "status": "completed",
            }
        ]
    if role != "assistant":
        return [
            {"id": new_id("msg_"), "type": "message", "role": role, "content": _parts(msg["content"], "input_text")}
        ]
    items: list[dict[str, Any]] = []
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(
            {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{**p, "annotations": []} for p in _parts(msg.get("content") or "", "output_text")],
            }
        )
    for call in msg.get("tool_calls") or ():
        fn = call.get("function") or {}
        items.append(
            {
                "id": new_id("fc_"),
                "type": "function_call",
                "status": "completed",
                "call_id": call.get("id"),
                "name": fn.get("name"),
                "arguments": fn.get("arguments") or "",
            }
        )
    return items


async def compact(api: Any, ex: Exchange) -> None:
    """The endpoint (`api`: the ResponsesAPI: its orchestrator, profile and store)."""
    body, _ = await ex.json_body("input", lambda body: body)
    _check(body, api.profile.served_model_name)
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        await api.responses.available()
        record = await api.responses.get_response(ex.tenant, previous)
        if record is None:
            raise not_found(previous, "previous_response_id")
        history = list(record["messages"])
    messages = history + input_messages(body.get("input"), api.profile.proxy.media_url_hosts)
    output = await compacted(api, ex.tenant, messages)
    zero = {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }
    await ex.json(
        200,
        {
            "id": new_id("resp_"),
            "object": "response.compaction",
            "output": output,
            "created_at": int(time.time()),
            "usage": zero,
        },
    )


async def compacted(api: Any, tenant: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compacted items of `messages` (see the module docstring)."""
    body = {"model": api.profile.served_model_name, "messages": [*messages, END]}
    # linear in the messages: a long context is looked up off the event loop (prepare is thread-safe)
    plan = (
        await asyncio.to_thread(api.orch.prepare, body, tenant)
        if len(messages) > BIG_ITEMS
        else api.orch.prepare(body, tenant)
    )
    await api.orch.load(plan)  # a shared store: the turns read from it
    history = plan.history
    out: list[dict[str, Any]] = []
    for msg in messages[: history.head_end]:
        out += items_of(msg)
    for seg in history.segments:
        turn = messages[seg.start : seg.end]
        record = seg.record
        if record is None or not (record.summary or "").strip() or record.summary_failed:
            for msg in turn:
                out += items_of(msg)
            continue
        for msg in turn:
            if msg["role"] in ("user", "system", "developer"):
                out += items_of(msg)
        out.append(
            {
                "id": new_id("cmp_"),
                "type": "compaction",
                "encrypted_content": encode_compaction(fold_text(api.profile, record)),
            }
        )
    for msg in messages[history.tail_start :]:
        out += items_of(msg)
    return out
