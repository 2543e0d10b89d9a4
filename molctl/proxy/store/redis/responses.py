"""The Responses API's records in the shared store: `RedisResponseStore` (the `ResponseStore`
contract, async). A record and its chain's messages are read in one round trip (GET_CHAIN), a
chained request's conversation state with it (`get_previous`, into the request's RedisScope).
Each failure is a StoreUnavailable (503 + Retry-After)."""

from __future__ import annotations

import json

from molctl.proxy import fastjson
from molctl.proxy.store.base import QuotaExceeded, ResponseRecord, ResponseStore, StoreScope
from molctl.proxy.store.redis.connection import RedisState
from molctl.proxy.store.redis.conversations import RedisScope
from molctl.proxy.store.redis.target import _decode


def _record_json(raw: bytes) -> bytes:
    """A stored response's JSON (without the store keys kept before it: see GET_CHAIN)."""
    newline = raw.find(b"\n")
    return raw if raw[:1] == b"{" or newline < 0 else raw[newline + 1 :]


class RedisResponseStore(ResponseStore):
    """The Responses API's records in Redis (async methods; the app awaits them). Each failure is
    a StoreUnavailable (503 + Retry-After)."""

    def __init__(self, state: RedisState):
        self.state = state

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self.state.prefix}r:{tenant}:{response_id}"

    async def available(self) -> None:
        """Fails fast (503) while the store is degraded (a PING once the retry interval passed);
        free otherwise: a store lost since then fails the request's own call."""
        if self.state.degraded:
            await self.state.available()

    async def put_response(  # noqa: ARG002 - big: see below
        self, record: ResponseRecord, big: bool = False, scope: StoreScope | None = None
    ) -> None:
        """Stored with the store keys the next request of its chain reads (its conversation's
        turns, its tool calls: kept by RedisConversationStore during this request), so that
        `get_previous` returns them with it. (`big`, the proxy's hint of a large request, is not
        used: the record is encoded on the loop, as every record of this store.)"""
        messages = [
            json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() for m in record.get("messages") or ()
        ]
        raw = json.dumps({**record, "messages": []}, ensure_ascii=False, separators=(",", ":")).encode()
        if isinstance(scope, RedisScope) and scope.names:
            raw = " ".join(dict.fromkeys(scope.names)).encode() + b"\n" + raw
        st = self.state
        whole = len(raw) + sum(map(len, messages))  # what it holds with its conversation (its chain's share included)
        for cap, name in (
            (st.max_bytes, "proxy.store_max_bytes"),
            (st.tenant_max_bytes, "proxy.store_tenant_max_bytes"),
        ):
            if whole > cap:  # evicting every other record could not make room: refused before the write
                raise QuotaExceeded(
                    f"response store {st.target.address}: a record of {whole} bytes (with its "
                    f"conversation) is over {name} ({cap}): not stored",
                    whole,
                    cap,
                    name,
                )
        previous = record.get("previous_response_id")
        await st.put_response(
            self._key(record["tenant"], record["id"]),
            record["tenant"],
            raw,
            self._key(record["tenant"], previous) if isinstance(previous, str) else "",
            messages,
        )

    def _fresh(self, raw: bytes, key: str, chain: list | None = None) -> ResponseRecord | None:
        """The record, unless expired by its own clock or unreadable (then as absent: a 404), with its
        conversation from its chain (`chain`: GET_CHAIN's {COUNT, message...}; None: the record holds its own)."""
        record = _decode(_record_json(raw), created_at=(int, float))
        if record is not None and chain is not None:
            try:
                if len(chain) - 1 != int(chain[0]):
                    raise ValueError("chain shorter than the record")
                record["messages"] = fastjson.loads(b"[" + b",".join(chain[1:]) + b"]")
            except (ValueError, TypeError):
                self.state.unreadable("response conversation (its chain's list is missing or short)", key)
                return None
        if record is None:
            self.state.unreadable("response", key)
            return None
        return record if self.state.clock() - float(record["created_at"]) <= self.state.ttl_s else None

    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The record and its chain's messages in one round trip (GET_CHAIN)."""
        key = self._key(tenant, response_id)
        reply = await self.state.script("read", "chain", [key], [self.state.prefix])
        return None if reply[0] is None else self._fresh(reply[0], key, reply[1])

    async def get_previous(
        self, tenant: str, response_id: str, scope: StoreScope | None = None
    ) -> ResponseRecord | None:
        """The response a request continues, and in the same round trip (one script) the current
        state of its conversation's turns and tool calls, which this request's `load` then uses
        instead of reading them again. The keys come from the record, written by this tenant's
        own request (the record's key holds the tenant); `load` uses only the keys it computed itself."""
        reply = await self.state.script("read", "chain", [self._key(tenant, response_id)], [self.state.prefix])
        raw = reply[0]
        if raw is None:
            return None
        record = self._fresh(raw, self._key(tenant, response_id), reply[1])
        if record is None:
            return None
        names = raw[: raw.index(b"\n")].split() if raw[:1] != b"{" else []  # ASCII whitespace, as the script splits
        if len(names) == len(reply) - 2 and isinstance(scope, RedisScope):
            scope.prefetched = {n.decode(): v for n, v in zip(names, reply[2:], strict=True)}
        return record

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        """Deleted with its accounting (one script: RESPONSES)."""
        deleted = await self.state.script("delete", "rdel", [self._key(tenant, response_id)], [self.state.prefix])
        return bool(deleted)

    def stats(self) -> dict[str, int]:
        return dict(self.state.stats())

    def close(self) -> None:
        pass  # the RedisState is closed by the app's shutdown
