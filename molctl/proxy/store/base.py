"""The store contracts: what the pipeline, the app and the CLI call on a state store.

- `ConversationStore`: stateless chat's turn records and tool-call bindings (sync lookups, so
  `prepare` may run in a worker thread; `load` / `flush` are the per-request hooks of a shared
  store, no-ops for a local one).
- `ResponseStore`: the Responses API's records as the proxy awaits them (`LocalResponses` in
  molctl.proxy.store.local wraps an in-process `RecordStore`; the Redis store implements it).
- `RecordStore`: an in-process backend's records (memory, SQLite), called synchronously.
- `StoreScope`: one request's store state (`open_scope()`), passed by the caller to the methods
  that take a `scope`; None there means "outside any request".
The errors every backend raises (`StoreError`, `QuotaExceeded`, `StoreBusy`) and the shared
defaults live here too. Record shapes: molctl.proxy.store.memory; design: docs/design/store.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from molctl.errors import MolctlError
from molctl.profilespec import ProxySpec, default_of

if TYPE_CHECKING:
    from molctl.proxy.affinity import EngineChoice
    from molctl.proxy.conversations import CallBinding, TurnRecord

ResponseRecord = dict[str, Any]

# the profile's declared defaults (proxy.store_ttl_s, store_max_bytes, store_max_entries)
DEFAULT_TTL_S = default_of(ProxySpec, "store_ttl_s")
DEFAULT_MAX_BYTES = default_of(ProxySpec, "store_max_bytes")
DEFAULT_MAX_ENTRIES = default_of(ProxySpec, "store_max_entries")
TENANT_SHARE = 4  # a tenant's default quota: a quarter of each global cap (proxy.store_tenant_max_*)


class StoreError(MolctlError):
    """The state store cannot be used (one line naming the file). `cause`: "damaged" (SQLite reports
    the file corrupt, or a record does not parse), an errno name for a failed write ("ENOSPC": the
    disk is full; "EIO"), "locked" (another process's write lock, past the busy timeout), or None."""

    cause: str | None = None

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause


class QuotaExceeded(StoreError):
    """A record that is over a byte cap (`setting`: proxy.store_tenant_max_bytes or store_max_bytes)
    on its own, with its conversation: not stored, nothing evicted (cause "quota"). The client's
    mistake, not the store's: a 400 naming the quota (molctl.proxy.errors.store_failure), and the
    store stays ready."""

    def __init__(self, message: str, size: int, cap: int, setting: str):
        super().__init__(message, cause="quota")
        self.size, self.cap, self.setting = size, cap, setting


class StoreBusy(Exception):
    """A put or delete told not to wait (`wait=False`) found the store's write lock held by another
    process; nothing was written (LocalResponses tries again a little later)."""


class StoreScope:
    """One request's store state, made by `open_scope()` and passed to the calls of that request.
    A local store keeps nothing in it; a shared one keeps its writes, reads and engine choice
    (molctl.proxy.store.redis.conversations.RedisScope)."""

    __slots__ = ()


NO_STATE = StoreScope()  # the scope of every request of a local store


class ConversationStore(ABC):
    """Stateless chat's state: turn records by prefix key, tool-call bindings by (tenant, call id)."""

    shared = False  # True: shared by proxy replicas (read once per request by `load`; affinity)

    @abstractmethod
    def get_turn(self, key: bytes) -> TurnRecord | None: ...

    def get_turns(self, keys: list[bytes]) -> list[TurnRecord | None]:
        """`get_turn` of every key (a durable store reads its misses in one query)."""
        return [self.get_turn(key) for key in keys]

    @abstractmethod
    def put_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None = None) -> None: ...

    @abstractmethod
    def get_call(self, tenant: str, call_id: str) -> CallBinding | None: ...

    @abstractmethod
    def put_call(self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None = None) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    def open_scope(self) -> StoreScope:
        """The state of one request (see StoreScope); a local store keeps none: one shared empty scope."""
        return NO_STATE

    def mark_stale(self, record: TurnRecord, scope: StoreScope | None = None) -> None:  # noqa: ARG002 - local
        """A later turn of `scope`'s request folded `record` without its summary."""
        record.mark_stale()

    async def load(self, turn_keys: list[bytes], calls: list[tuple[str, str]], scope: StoreScope) -> bool:  # noqa: ARG002
        """Read the history's turns and the trailing tool calls (a shared store); True when a turn was
        found that the lookups lacked (the history must be split again). Nothing for a local store."""
        return False

    async def flush(self, scope: StoreScope | None = None) -> None:  # noqa: ARG002 - nothing to wait for
        """Wait (bounded) for the request's writes (a shared store: the next turn may reach another replica)."""
        return None

    async def choose_engine(  # noqa: ARG002 - a local store: always this replica's
        self, owner: str | None, scope: StoreScope | None = None
    ) -> EngineChoice | None:
        """The engine of the replica `owner` (conversation affinity), else None: this replica's."""
        return None


class RecordStore(ABC):
    """An in-process backend of the Responses records (memory, SQLite): synchronous calls.
    `slow_puts`: a put encodes and writes (a large one goes to a worker thread); `busy_timeout_s`:
    how long a write that found another process's write lock is tried again."""

    slow_puts = True
    busy_timeout_s = 2.0

    @abstractmethod
    def put_response(self, record: ResponseRecord, wait: bool = True) -> None: ...

    @abstractmethod
    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    @abstractmethod
    def delete_response(self, tenant: str, response_id: str, wait: bool = True) -> bool: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    def health(self) -> str | None:
        """Why the store serves in part (the proxy's /readyz says "degraded" with it), else None."""
        return None

    def close(self) -> None:
        return None


class ResponseStore(ABC):
    """The Responses records as the proxy awaits them, per tenant (API key)."""

    async def available(self) -> None:
        """Raise StoreUnavailable when a shared store is down (a local one: returns at once)."""
        return None

    @abstractmethod
    async def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    async def get_previous(
        self, tenant: str, response_id: str, scope: StoreScope | None = None
    ) -> ResponseRecord | None:  # noqa: ARG002 - a local store reads nothing more
        """The record a request continues (a shared store reads the request's state with it, into `scope`)."""
        return await self.get_response(tenant, response_id)

    @abstractmethod
    async def put_response(self, record: ResponseRecord, big: bool = False, scope: StoreScope | None = None) -> None:
        """Store `record` (`big`: a hint, a large request; `scope`: the request that made it)."""

    @abstractmethod
    async def delete_response(self, tenant: str, response_id: str) -> bool: ...

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    def health(self) -> str | None:
        """Why the store serves in part (/readyz "degraded"), else None."""
        return None

    def close(self) -> None:
        return None
