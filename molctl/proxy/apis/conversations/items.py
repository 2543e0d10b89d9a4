"""Conversation items: validated as Responses input items (`parse_items`), turned back into the
chat messages a response continues from (`history_messages`), and paged (`apis.listing`).

Items are kept as the Responses API returns them (`/input_items`, a response's `output`): a
message, function_call, function_call_output or reasoning item, each with an `id`. The chat
messages of a conversation are made from its items by the same conversion as a request's input,
so a turn the proxy answered is found again by its conversation key (molctl.proxy.conversations):
its route and summary carry over as they do for a `previous_response_id` chain.
"""

from __future__ import annotations

from typing import Any

from molctl.proxy.apis.request_fields import PERMISSIVE, FieldPolicy
from molctl.proxy.apis.responses.convert import _Input, item_type, new_id
from molctl.proxy.errors import ProxyError, invalid, shown

MAX_ADDED = 20  # items per create or add, as OpenAI's CreateConversationBody and items.create
KINDS = ("message", "function_call", "function_call_output", "reasoning")
STATUSES = ("in_progress", "completed", "incomplete")  # an item's status, as OpenAI's items have it
ID_MAX = 128  # an item id's length (a longer one is never stored)


def duplicate(item_id: str, param: str) -> ProxyError:
    return invalid(f"Duplicate item found with id {shown(item_id)}.", param)


def parse_items(
    value: Any,
    param: str,
    existing: set[str],
    media_hosts: tuple[str, ...] = (),
    fields: FieldPolicy = PERMISSIVE,
    required: bool = False,
) -> list[dict[str, Any]]:
    """The items to add (`param`: "items"), each checked as a Responses input item and kept in its
    public shape with an id (the client's, else a new one); 400 naming the field for anything else."""
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise invalid(f"'{param}' must be a{' non-empty' if required else 'n'} array of input items.", param)
    if len(value) > MAX_ADDED:
        raise invalid(f"'{param}' holds {len(value)} items; at most {MAX_ADDED} can be added at a time.", param)
    conv = _Input(media_hosts, fields)
    out: list[dict[str, Any]] = []
    seen = set(existing)
    for i, item in enumerate(value):
        w = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{w}' must be an object.", w)
        kind = item_type(item)
        if not isinstance(kind, str):
            raise invalid(f"'{w}.type' must be a string.", f"{w}.type")
        if kind not in KINDS:
            raise invalid(
                f"The item type {shown(kind)!r} cannot be added to a conversation here (one of {', '.join(KINDS)}).",
                f"{w}.type",
            )
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= ID_MAX):
            raise invalid(f"'{w}.id' must be a string of 1 to {ID_MAX} characters.", f"{w}.id")
        if item.get("status") is not None and item["status"] not in STATUSES:
            raise invalid(f"'{w}.status' must be one of {', '.join(STATUSES)}.", f"{w}.status")
        before = len(conv.items)
        conv.add(item, w)  # validates it as an input item (400s name `w`)
        if kind == "reasoning":
            kept = {"id": item_id or new_id("rs_"), "type": "reasoning", "summary": item.get("summary") or []}
            for key in ("content", "encrypted_content"):
                if item.get(key) is not None:
                    kept[key] = item[key]
        else:
            kept = conv.items[before]
        if kept["id"] in seen:
            raise duplicate(kept["id"], f"{w}.id")
        seen.add(kept["id"])
        out.append(kept)
    return out


def history_messages(items: list[dict[str, Any]], media_hosts: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The chat messages of a conversation's stored items (validated when they were added;
    `media_hosts`: proxy.media_url_hosts, as when they were)."""
    conv = _Input(media_hosts, PERMISSIVE)
    for i, item in enumerate(items):
        conv.add(item, f"conversation.items[{i}]")
    return conv.messages


def item_not_found(item_id: str) -> ProxyError:
    return ProxyError(404, f"Item with id '{shown(item_id)}' not found.", "invalid_request_error", "not_found")
