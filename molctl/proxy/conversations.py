"""Conversation state without a header: what earlier turns were, found from the history itself.

Plain clients (the `openai` SDK) resend the whole history every turn. Every message gets a
canonical form (role, text, tool calls with arguments re-serialised canonically, tool_call_id;
reasoning excluded since clients often drop it), and a running SHA-256 over those forms gives
one key per message prefix, seeded with the tenant (the API key that authenticated).
System and developer messages do not enter the keys: clients often put a timestamp or RAG
context in the system prompt, which changes every turn, and the conversation must still be
recognised (two conversations that differ only in their system text share their records, which
is harmless: the same dialogue was routed and summarised). When the proxy answers, it records
the key of "history + its answer"; a later request containing that
same prefix finds the record: which adapter answered that turn, and the turn's summary.

Tool calls are bound separately by (tenant, tool_call_id) with the canonical arguments, so a
client that re-serialises argument JSON still lands on the adapter that issued the call.

The records live in a `ConversationStore` (molctl.proxy.store.base: in memory, on SQLite or on
Redis); a `TurnRecord` tells its store when it changes later (`on_change`: its summary arrived or
failed, or it was marked stale) so a durable store can persist that too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson


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
    """JSON argument text re-serialised canonically; text that is not JSON, or whose strings decode
    to a lone surrogate (`"\\ud800"`: the text is valid UTF-8, what it decodes to is not, and could
    be neither hashed nor stored), is kept as sent, stripped."""
    if isinstance(arguments, str):
        try:
            out = json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except ValueError:
            return arguments.strip()
        if ("\\ud" in arguments or "\\uD" in arguments) and not _is_utf8(out):  # only an escape can make one
            return arguments.strip()
        return out
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def tool_calls_of(msg: dict[str, Any]) -> list[dict[str, Any]]:
    calls = msg.get("tool_calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


def canonical_message(msg: dict[str, Any]) -> bytes:
    calls = [
        [
            c.get("id"),
            (c.get("function") or {}).get("name"),
            canonical_arguments((c.get("function") or {}).get("arguments")),
        ]
        for c in tool_calls_of(msg)
    ]
    form = [msg.get("role"), text_of(msg.get("content")), calls, msg.get("tool_call_id")]
    call_id = form[3]
    if not calls and type(form[0]) is str and (call_id is None or type(call_id) is str):
        # strings and null only: orjson writes the very bytes of the json.dumps below (the keys
        # are stored: they must not change), ~10x faster
        try:
            return orjson.dumps(form)
        except orjson.JSONEncodeError:  # a lone surrogate: the json.dumps path decides
            pass
    return json.dumps(form, separators=(",", ":"), ensure_ascii=False).encode()


INSTRUCTION_ROLES = ("system", "developer")


def is_turn_end(msg: dict[str, Any]) -> bool:
    """An assistant's final answer (no tool calls) ends a turn."""
    return msg.get("role") == "assistant" and not tool_calls_of(msg)


class ConversationKeys:
    """One pass over the messages: the keys of the prefixes that end a turn (the only ones the
    store is asked about) and the running hash, so the key of "messages + answer" costs one
    message more, not another pass. Linear; about 3 us per message."""

    def __init__(self, tenant: str, messages: list[dict[str, Any]]):
        h = hashlib.sha256(tenant.encode())
        self.at: dict[int, bytes] = {}
        last = len(messages) - 1
        for i, msg in enumerate(messages):
            if msg.get("role") in INSTRUCTION_ROLES:
                continue
            h.update(canonical_message(msg))
            if i < last and is_turn_end(msg):
                self.at[i] = h.copy().digest()
        self._hash = h

    def extend(self, extra: dict[str, Any]) -> bytes:
        h = self._hash.copy()
        h.update(canonical_message(extra))
        return h.digest()


def prefix_keys(tenant: str, messages: list[dict[str, Any]]) -> list[bytes]:
    """keys[i] identifies messages[:i+1] for this tenant (system/developer text excluded)."""
    h = hashlib.sha256(tenant.encode())
    keys = []
    for msg in messages:
        if msg.get("role") not in INSTRUCTION_ROLES:
            h.update(canonical_message(msg))
        keys.append(h.copy().digest())
    return keys


def extend_key(tenant: str, messages: list[dict[str, Any]], extra: dict[str, Any]) -> bytes:
    return ConversationKeys(tenant, messages).extend(extra)


@dataclass(slots=True)
class TurnRecord:
    """One answered turn: which adapter answered, and (once the summary hop is done) its summary.

    Slotted, and its Event made only when someone waits for the summary (`done`): the proxy keeps
    up to 100,000 of these in memory, and an eager asyncio.Event (with its waiter deque) made each
    record ~1.4 KB where its accounted `size()` said ~200 bytes."""

    route: str
    summary: str | None = None
    summary_failed: bool = False
    stale: bool = False  # a later turn was folded without its summary; it must stay so
    replica: str | None = None  # a shared store (Redis): the proxy replica whose engine answered it
    # set by a durable store when the record is put: called after each later change (set_summary,
    # mark_stale) so the change reaches the disk too; in-memory stores leave it None
    on_change: Callable[[TurnRecord], None] | None = field(default=None, repr=False, compare=False)
    finished: bool = field(default=False, compare=False)  # the summary is settled (made, failed or given up)
    _event: asyncio.Event | None = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> asyncio.Event:
        """An Event set once the summary is settled, for waiters (made on first use); to test
        without waiting, read `finished`."""
        if self._event is None:
            self._event = asyncio.Event()
            if self.finished:
                self._event.set()
        return self._event

    def settle(self) -> None:
        """Nothing more will come for this turn's summary: wake whoever waits."""
        self.finished = True
        if self._event is not None:
            self._event.set()

    def set_summary(self, text: str | None) -> None:
        self.summary = text
        self.summary_failed = text is None
        self.settle()
        if self.on_change is not None:
            self.on_change(self)

    def mark_stale(self) -> None:
        """A later turn was folded without this turn's summary: it must stay without one."""
        self.stale = True
        if self.on_change is not None:
            self.on_change(self)

    def size(self) -> int:
        return 160 + len(self.summary or "")


@dataclass
class CallBinding:
    route: str
    arguments: str  # canonical
    name: str
    replica: str | None = None  # a shared store (Redis): the proxy replica whose engine issued the call

    def size(self) -> int:
        return 120 + len(self.arguments) + len(self.name)
