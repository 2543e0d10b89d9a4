"""The write-behind front of the durable and shared conversation stores (SQLite, Redis).

`WriteBehind` keeps a `MemoryStore` as the hot cache: every lookup is answered from it (a miss
read from the backend where the backend can: `fetch_turn(s)`, `fetch_call`), every put goes to
the cache and is handed to the backend to write behind (`new_turn`, `new_call`). A record's
later changes (its summary, a stale mark) reach the backend through its `on_change`, a
`Persist` bound to the store and key (`changed_turn`). Subclasses: SqliteConversationStore
(molctl.proxy.store.sqlite.conversations), RedisConversationStore (molctl.proxy.store.redis.conversations)."""

from __future__ import annotations

from abc import abstractmethod

from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.base import ConversationStore, StoreScope
from molctl.proxy.store.memory import MemoryStore


class Persist:
    """A TurnRecord's on_change, set by a WriteBehind store: writes the record's new state."""

    __slots__ = ("key", "store")

    def __init__(self, store: WriteBehind, key: bytes):
        self.store, self.key = store, key

    def __call__(self, record: TurnRecord) -> None:
        self.store.changed_turn(self.key, record, self.store.changing)


class WriteBehind(ConversationStore):
    """See the module docstring. `changing`: the scope of the request whose change is being
    written (`mark_stale`), None for a change outside a request (a summary)."""

    def __init__(self, cache: MemoryStore | None = None):
        self.cache = cache if cache is not None else MemoryStore()
        self.changing: StoreScope | None = None

    # ---------------------------------------------------------------- the backend's side
    @abstractmethod
    def new_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:
        """Write a record put for the first time under `key` (its on_change is bound already)."""

    @abstractmethod
    def changed_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:
        """Write a bound record's new state."""

    @abstractmethod
    def new_call(self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None) -> None:
        """Write a tool-call binding."""

    @abstractmethod
    def backend_stats(self) -> dict[str, int]:
        """The backend's counters, shown beside the cache's."""

    def fetch_turn(self, key: bytes) -> TurnRecord | None:  # noqa: ARG002 - a backend read per request only
        """A cache miss read from the backend (cached by the implementation), else None."""
        return None

    def fetch_turns(self, keys: list[bytes]) -> dict[bytes, TurnRecord]:  # noqa: ARG002
        """`fetch_turn` of many keys at once; the keys found."""
        return {}

    def fetch_call(self, tenant: str, call_id: str) -> CallBinding | None:  # noqa: ARG002
        return None

    # ---------------------------------------------------------------- the contract
    def bind(self, key: bytes, record: TurnRecord) -> None:
        """Make the backend hear of the record's later changes (a record read back from it)."""
        record.on_change = Persist(self, key)

    def get_turn(self, key: bytes) -> TurnRecord | None:
        record = self.cache.get_turn(key)
        return record if record is not None else self.fetch_turn(key)

    def get_turns(self, keys: list[bytes]) -> list[TurnRecord | None]:
        """`get_turn` of every key, the cache misses read in one go (a client's 100 earlier turns
        that this proxy never saw cost one query, not 100)."""
        records = [self.cache.get_turn(key) for key in keys]
        missing = [key for key, record in zip(keys, records, strict=True) if record is None]
        if not missing:
            return records
        found = self.fetch_turns(missing)
        return [record if record is not None else found.get(key) for key, record in zip(keys, records, strict=True)]

    def put_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None = None) -> None:
        """Putting a record again that is bound to the same key only recounts the cache (the
        orchestrator does so after a summary)."""
        bound = record.on_change
        if not (isinstance(bound, Persist) and bound.store is self and bound.key == key):
            self.bind(key, record)
            self.new_turn(key, record, scope)
        self.cache.put_turn(key, record)

    def get_call(self, tenant: str, call_id: str) -> CallBinding | None:
        binding = self.cache.get_call(tenant, call_id)
        if binding is not None:
            return binding
        binding = self.fetch_call(tenant, call_id)
        if binding is not None:
            self.cache.put_call(tenant, call_id, binding)
        return binding

    def put_call(self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None = None) -> None:
        self.new_call(tenant, call_id, binding, scope)
        self.cache.put_call(tenant, call_id, binding)

    def mark_stale(self, record: TurnRecord, scope: StoreScope | None = None) -> None:
        self.changing = scope
        try:
            record.mark_stale()
        finally:
            self.changing = None

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), **self.backend_stats()}
