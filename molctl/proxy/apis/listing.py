"""OpenAI's list pages (`/v1/responses/{id}/input_items`, `/v1/conversations/{id}/items`): the
query's `limit` and `order`, and one page of items after an item id."""

from __future__ import annotations

from typing import Any

from molctl.proxy.errors import invalid


def page_params(query: dict[str, str]) -> tuple[int, str]:
    """`limit` (1 to 100, default 20) and `order` (`asc` or `desc`, default `desc`); a 400 names the bad one."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise invalid("'limit' must be an integer from 1 to 100.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'.", "order")
    return limit, order


def list_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page: `after` an item id (an unknown one: an empty page). OpenAI's list schemas require
    both ids as strings (not nullable): "" for an empty page."""
    ordered = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [i.get("id") for i in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else "",
        "last_id": page[-1]["id"] if page else "",
        "has_more": len(ordered) > limit,
    }
