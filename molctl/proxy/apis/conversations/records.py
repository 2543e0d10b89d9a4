"""Conversation records on the proxy's response store (memory, SQLite, Redis).

A conversation is one record of the store the Responses API uses (`ResponseStore`), under the
tenant that created it and the id `conv_` + 48 hex digits, so it lives where responses live and
under the same bounds: per-tenant quotas (`proxy.store_tenant_max_*`), the global caps, eviction
oldest first, the TTL, the SQLite file's transactions and the shared Redis store of replicas. No
table, key format or schema version is added. The record:

    {"id", "tenant", "created_at": its last write (the TTL and eviction count from it),
     "previous_response_id": None, "route": None, "messages": [], "input_items": [], "response": {},
     "kind": "conversation", "conversation": the public object, "items": the items, oldest first}

`ResponsesOnly` hides these records from the Responses endpoints (a conversation id is no
response id). Writes to one conversation are serialised per proxy process (`lock`); two replicas
writing the same conversation at the same instant keep the last write (docs/contract.md).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from typing import Any

from molctl.proxy.errors import ProxyError, invalid, shown
from molctl.proxy.store.base import ResponseRecord, ResponseStore, StoreScope

PREFIX = "conv_"
CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{48}")
KIND = "conversation"


def new_conversation_id() -> str:
    return PREFIX + os.urandom(24).hex()


def is_conversation_id(value: str) -> bool:
    return CONVERSATION_ID.fullmatch(value) is not None


def conversation_not_found(conversation_id: str, param: str | None = None) -> ProxyError:
    return ProxyError(
        404, f"Conversation with id '{shown(conversation_id)}' not found.", "invalid_request_error", "not_found", param
    )


class ConversationRecords:
    """Get, put and delete conversation records of a tenant; `lock(tenant, id)` serialises the
    read-modify-write of one conversation in this process."""

    def __init__(self, store: ResponseStore, clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    async def get(self, tenant: str, conversation_id: str) -> ResponseRecord | None:
        """The record, or None: an id of another shape is never looked up (nothing unvalidated
        from a request becomes a store key)."""
        if not is_conversation_id(conversation_id):
            return None
        await self.store.available()
        record = await self.store.get_response(tenant, conversation_id)
        return record if record is not None and record.get("kind") == KIND else None

    async def put(self, record: ResponseRecord, scope: StoreScope | None = None) -> None:
        record["created_at"] = self.clock()  # the last write: TTL and eviction count from it
        await self.store.put_response(record, big=len(record["items"]) > 200, scope=scope)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        if not is_conversation_id(conversation_id) or await self.get(tenant, conversation_id) is None:
            return False
        return await self.store.delete_response(tenant, conversation_id)

    def new(self, tenant: str, metadata: dict[str, Any], items: list[dict[str, Any]]) -> ResponseRecord:
        conversation_id = new_conversation_id()
        return {
            "id": conversation_id,
            "tenant": tenant,
            "created_at": self.clock(),
            "previous_response_id": None,
            "route": None,
            "messages": [],
            "input_items": [],
            "response": {},
            "kind": KIND,
            "conversation": {
                "id": conversation_id,
                "object": "conversation",
                "created_at": int(self.clock()),
                "metadata": metadata,
            },
            "items": items,
        }

    def lock(self, tenant: str, conversation_id: str) -> _Held:
        return _Held(self._locks, (tenant, conversation_id))


class _Held:
    """`async with`: the per-conversation lock, dropped from the table when nobody holds or waits."""

    def __init__(self, table: dict[tuple[str, str], tuple[asyncio.Lock, int]], key: tuple[str, str]):
        self.table, self.key = table, key

    async def __aenter__(self) -> None:
        lock, users = self.table.get(self.key) or (asyncio.Lock(), 0)
        self.table[self.key] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:  # cancelled while waiting (the client left): no longer a user
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.table[self.key][0].release()
        self._leave()

    def _leave(self) -> None:
        lock, users = self.table[self.key]
        if users <= 1:
            del self.table[self.key]
        else:
            self.table[self.key] = (lock, users - 1)


class ResponsesOnly(ResponseStore):
    """The response store as the Responses endpoints see it: a conversation's record (an id with
    the `conv_` prefix) is no response (a 404 on GET, DELETE, input_items, previous_response_id)."""

    def __init__(self, store: ResponseStore):
        self.inner = store

    def __getattr__(self, name: str) -> Any:
        """Whatever else the store offers (a method added to it later), from the store itself."""
        return getattr(self.inner, name)

    async def available(self) -> None:
        await self.inner.available()

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        return None if response_id.startswith(PREFIX) else await self.inner.get_response(tenant, response_id)

    async def get_previous(self, tenant: str, response_id: str, scope: StoreScope | None = None):
        return None if response_id.startswith(PREFIX) else await self.inner.get_previous(tenant, response_id, scope)

    async def put_response(self, record: ResponseRecord, big: bool = False, scope: StoreScope | None = None) -> None:
        await self.inner.put_response(record, big, scope)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        return False if response_id.startswith(PREFIX) else await self.inner.delete_response(tenant, response_id)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def health(self) -> str | None:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


def conversation_param(body: dict[str, Any]) -> str | None:
    """`conversation` of a Responses request (OpenAI's ConversationParam: an id, or `{"id": ...}`),
    checked; None when absent. It excludes `previous_response_id` (a 400, as OpenAI's)."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict):
        if set(value) - {"id"}:
            extra = sorted(str(k)[:40] for k in set(value) - {"id"})[0]
            raise invalid(f"Unknown parameter: 'conversation.{extra}'.", f"conversation.{extra}")
        value = value.get("id")
        if not isinstance(value, str):
            raise invalid("'conversation.id' must be a string.", "conversation.id")
    elif not isinstance(value, str):
        raise invalid("'conversation' must be a conversation id or an object with its 'id'.", "conversation")
    if body.get("previous_response_id") is not None:
        raise ProxyError(  # OpenAI's code; `param` names the field (OpenAI's is null)
            400,
            "Mutually exclusive parameters: Ensure you are only providing one of: 'previous_response_id' or "
            "'conversation'.",
            "invalid_request_error",
            "mutually_exclusive_parameters",
            "conversation",
        )
    return value
