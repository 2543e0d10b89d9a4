"""A stored Response as the proxy hands it to a response store: `record(rid, tenant=..., text=...,
prev=..., **extra)`, for the SQLite store tests (tests/proxy/store/)."""

from __future__ import annotations


def record(
    rid: str, tenant: str = "tenant-a", created_at: float = 1_800_000_000.0, text: str = "hello", **extra
) -> dict:
    return {
        "id": rid,
        "tenant": tenant,
        "created_at": created_at,
        "previous_response_id": extra.pop("prev", None),
        "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "hi"}],
        "input_items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}],
        "response": {"id": rid, "object": "response", "output_text": "hi"},
        "route": "L2",
        **extra,
    }
