"""Conversation state without a header: what earlier turns were, found from the history itself.

Plain clients (the `openai` SDK) resend the whole history every turn. Every message gets a
canonical form (role, text, tool calls with arguments re-serialised canonically, tool_call_id;
reasoning excluded since clients often drop it), and a running SHA-256 over those forms gives
one key per message prefix, seeded with the tenant (the API key that authenticated). When the
proxy answers, it records the key of "history + its answer"; a later request containing that
same prefix finds the record: which adapter answered that turn, and the turn's summary.

Tool calls are bound separately by (tenant, tool_call_id) with the canonical arguments, so a
client that re-serialises argument JSON still lands on the adapter that issued the call.

`ConversationStore` is the small interface the proxy (and later the Responses API) uses; the
in-memory implementation bounds entries, bytes and idle time, and lives as long as the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


def text_of(content: Any) -> str:
    """Flatten message content to text (string, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    parts.append(json.dumps(part, sort_keys=True))
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return json.dumps(content, sort_keys=True)


def canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except ValueError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tool_calls_of(msg: dict[str, Any]) -> list[dict[str, Any]]:
    calls = msg.get("tool_calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def canonical_message(msg: dict[str, Any]) -> bytes:
    calls = [[c.get("id"), (c.get("function") or {}).get("name"), canonical_arguments((c.get("function") or {}).get("arguments"))]
             for c in tool_calls_of(msg)]
    form = [msg.get("role"), text_of(msg.get("content")), calls, msg.get("tool_call_id")]
    return json.dumps(form, separators=(",", ":"), ensure_ascii=False).encode()


def prefix_keys(tenant: str, messages: list[dict[str, Any]]) -> list[bytes]:
    """keys[i] identifies messages[:i+1] for this tenant."""
    h = hashlib.sha256(tenant.encode())
    keys = []
    for msg in messages:
        h.update(canonical_message(msg))
        keys.append(h.copy().digest())
    return keys


def extend_key(tenant: str, messages: list[dict[str, Any]], extra: dict[str, Any]) -> bytes:
    h = hashlib.sha256(tenant.encode())
    for msg in messages:
        h.update(canonical_message(msg))
    h.update(canonical_message(extra))
    return h.digest()


@dataclass
class TurnRecord:
    """One answered turn: which adapter answered, and (once the summary hop is done) its summary."""

    route: str
    summary: str | None = None
    summary_failed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def set_summary(self, text: str | None) -> None:
        self.summary = text
        self.summary_failed = text is None
        self.done.set()

    def size(self) -> int:
        return 160 + len(self.summary or "")


@dataclass
class CallBinding:
    route: str
    arguments: str  # canonical
    name: str

    def size(self) -> int:
        return 120 + len(self.arguments) + len(self.name)


class ConversationStore(Protocol):
    def get_turn(self, key: bytes) -> TurnRecord | None: ...
    def put_turn(self, key: bytes, record: TurnRecord) -> None: ...
    def get_call(self, tenant: str, call_id: str) -> CallBinding | None: ...
    def put_call(self, tenant: str, call_id: str, binding: CallBinding) -> None: ...
    def stats(self) -> dict[str, int]: ...


class MemoryStore:
    """LRU with a cap on entries and approximate bytes, and an idle TTL checked on access."""

    def __init__(self, max_entries: int = 100_000, max_bytes: int = 256 * 1024 * 1024, ttl_s: float = 6 * 3600,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self._items: OrderedDict[Any, tuple[float, Any]] = OrderedDict()
        self._bytes = 0

    def _get(self, key: Any) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        stamp, value = item
        now = self.clock()
        if now - stamp > self.ttl_s:
            self._drop(key)
            return None
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        return value

    def _put(self, key: Any, value: Any) -> None:
        if key in self._items:
            self._drop(key)
        self._items[key] = (self.clock(), value)
        self._bytes += value.size()
        while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def _drop(self, key: Any) -> None:
        _, value = self._items.pop(key)
        self._bytes -= value.size()

    def get_turn(self, key: bytes) -> TurnRecord | None:
        return self._get(("t", key))

    def put_turn(self, key: bytes, record: TurnRecord) -> None:
        self._put(("t", key), record)

    def get_call(self, tenant: str, call_id: str) -> CallBinding | None:
        return self._get(("c", tenant, call_id))

    def put_call(self, tenant: str, call_id: str, binding: CallBinding) -> None:
        self._put(("c", tenant, call_id), binding)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._items), "bytes": self._bytes}
