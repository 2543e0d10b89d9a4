"""Stateless chat's state shared by the replicas: `RedisConversationStore` (the `ConversationStore`
contract on the write-behind front, molctl.proxy.store.writebehind) and `RedisScope`, one
request's writes, prefetched reads and engine choice. A turn's state is merged by rank in one
script (MERGE_TURN: pending < summary|failed < stale): a write never lowers it. Design and races:
docs/design/store.md ("Redis")."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from molctl.proxy import fastjson
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.conversations import CallBinding, TurnRecord
from molctl.proxy.store.base import StoreScope
from molctl.proxy.store.memory import MemoryStore
from molctl.proxy.store.redis.connection import RedisState
from molctl.proxy.store.redis.target import StoreUnavailable, _decode
from molctl.proxy.store.writebehind import WriteBehind

_NAME_SPACES = frozenset(b" \t\n\r\x0b\x0c")  # what the chain script splits names on


_STATES = ("pending", "summary", "failed", "stale")


class RedisScope(StoreScope):
    """One request's state in the shared store. `writes`: the write futures of this request
    (`flush` waits for these only); `prefetched`: store keys (without the prefix) read together
    with the previous response (value None: absent), used once by the next `load`; `names`: the
    store keys the next request of this conversation will read (the history's turns, this
    answer's turn or tool calls), kept with the response this request stores; `engine`: the
    engine chosen for its hops (`choose_engine`; None: this replica's own)."""

    __slots__ = ("engine", "names", "prefetched", "writes")

    def __init__(self) -> None:
        self.writes: list[asyncio.Future] = []
        self.prefetched: dict[str, bytes | None] | None = None
        self.names: list[str] = []
        self.engine: EngineChoice | None = None

    def keep(self, name: str) -> None:
        """Remember a store key the next request of this conversation reads."""
        if not _NAME_SPACES.intersection(name.encode()):
            self.names.append(name)


def _turn_state(record: TurnRecord) -> str:
    if record.stale:
        return "stale"
    if record.summary is not None:
        return "summary"
    return "failed" if record.summary_failed or record.finished else "pending"


def _apply(record: TurnRecord, data: dict[str, Any]) -> None:
    """Bring a local record to the merged state (without writing it back)."""
    state = data.get("state")
    if state == "stale":
        record.stale, record.summary = True, None
    elif state == "summary":
        record.summary, record.summary_failed = data.get("summary"), False
    elif state == "failed":
        record.summary, record.summary_failed = None, True
    if state != "pending":
        record.settle()
    record.replica = data.get("replica") or record.replica


class RedisConversationStore(WriteBehind):
    """Stateless chat's state shared by the replicas. The orchestrator's lookups stay synchronous
    (they run in `prepare`, possibly in a worker thread) and read a local MemoryStore; Redis is
    read once per request by `load` (one MGET of the history's turn keys and the pending tool
    calls, into the cache: Redis is the source of truth, a cached record is brought to the
    stored state) and written behind: each put starts a write task, `flush` awaits the writes of
    this request before its answer's last bytes go out (the client's next turn may go to another
    replica at once). A turn still pending on another replica is polled until its summary lands
    or `summary_wait_s` passes. Failures are counted by the RedisState (degraded) and never fail
    a chat request."""

    shared = True

    def __init__(
        self, state: RedisState, cache: MemoryStore | None = None, summary_wait_s: float = 5.0, poll_s: float = 0.05
    ):
        super().__init__(cache)
        self.state = state
        self.summary_wait_s, self.poll_s = summary_wait_s, poll_s
        self._writes: set[asyncio.Future] = set()
        self._polls: set[asyncio.Task] = set()
        self.affinity_remote_total = 0  # requests whose hops went to another replica's engine
        self.affinity_takeovers_total = 0  # conversations taken over from a replica without a heartbeat

    def _tkey(self, key: bytes) -> str:
        return f"{self.state.prefix}t:{key.hex()}"

    def _ckey(self, tenant: str, call_id: str) -> str:
        return f"{self.state.prefix}c:{tenant}:{call_id}"

    @staticmethod
    def _tname(key: bytes) -> str:  # a turn's store key without the prefix
        return f"t:{key.hex()}"

    @staticmethod
    def _cname(tenant: str, call_id: str) -> str:
        return f"c:{tenant}:{call_id}"

    def open_scope(self) -> RedisScope:
        return RedisScope()

    # ---------------------------------------------------------------- the write-behind front's side
    def new_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:
        if record.replica is None:
            record.replica = _serving(self.state.replica_id, scope)
        self._write_turn(key, record, scope)
        if isinstance(scope, RedisScope):
            scope.keep(self._tname(key))

    def changed_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:
        self._write_turn(key, record, scope)

    def new_call(self, tenant: str, call_id: str, binding: CallBinding, scope: StoreScope | None) -> None:
        if binding.replica is None:
            binding.replica = _serving(self.state.replica_id, scope)
        raw = json.dumps(
            {"route": binding.route, "arguments": binding.arguments, "name": binding.name, "replica": binding.replica}
        ).encode()
        self._start_write(lambda: self.state.put(self._ckey(tenant, call_id), "conv", raw), scope)
        if isinstance(scope, RedisScope):
            scope.keep(self._cname(tenant, call_id))

    def backend_stats(self) -> dict[str, int]:
        return {
            **self.state.stats(),
            "affinity_remote_total": self.affinity_remote_total,
            "affinity_takeovers_total": self.affinity_takeovers_total,
        }

    # ---------------------------------------------------------------- writes
    def _write_turn(self, key: bytes, record: TurnRecord, scope: StoreScope | None) -> None:
        # the script decodes it and stores its own encoding (cjson): orjson's bytes store the same turn
        raw = fastjson.dumps_bytes(
            {
                "route": record.route,
                "summary": record.summary,
                "state": _turn_state(record),
                "replica": record.replica,
                "at": self.state.clock(),
            }
        )

        def written(future: asyncio.Future) -> None:
            if future.cancelled() or future.exception() is not None:  # StoreUnavailable: counted by the state
                return
            merged = fastjson.loads(future.result())
            if merged.get("state") != _turn_state(record):  # another replica's state won: take it
                _apply(record, merged)

        self._start_write(lambda: self.state.merge_turn(self._tkey(key), raw), scope, written)

    def _start_write(
        self,
        start: Callable[[], asyncio.Future],
        scope: StoreScope | None,
        then: Callable[[asyncio.Future], None] | None = None,
    ) -> None:
        """Start a batched write (its future joins this request's writes: see flush); `then` runs
        when it is done, before `flush` returns. A failed write is counted by the state, never raised."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread (a worker thread): write from the loop is not possible
            self.state.errors_total += 1
            return
        future = start()
        future.add_done_callback(then or _retrieve)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)
        if isinstance(scope, RedisScope):
            scope.writes.append(future)

    def _track(self, task: asyncio.Task) -> None:
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)

    async def flush(self, scope: StoreScope | None = None) -> None:
        """Wait (bounded by the call timeout) for this request's writes (outside a request: all)."""
        mine = scope.writes if isinstance(scope, RedisScope) else None
        pending = [t for t in (mine if mine is not None else self._writes) if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.state.call_timeout_s * 2)

    # ---------------------------------------------------------------- per request
    async def load(self, turn_keys: list[bytes], calls: list[tuple[str, str]], scope: StoreScope) -> bool:
        """Read the history's turns and the trailing tool calls into the cache (one MGET; none
        when `get_previous` read them all in this request already); True when a turn was found
        that the cache lacked (the history must be split again)."""
        assert isinstance(scope, RedisScope), "a scope of this store (open_scope)"
        scope.writes = []
        prefetched = scope.prefetched or {}
        scope.prefetched = None  # the prefetched values serve this load only
        scope.names = [self._tname(k) for k in turn_keys]
        if not turn_keys and not calls:
            return False
        names = scope.names + [self._cname(t, c) for t, c in calls]
        missing = [n for n in names if n not in prefetched]
        if missing:
            full = [self.state.prefix + n for n in missing]
            try:
                got = await self.state.call("read", lambda: self.state.command("MGET", *full))
            except StoreUnavailable:
                return False
            prefetched = {**prefetched, **dict(zip(missing, got, strict=True))}
        values = [prefetched[n] for n in names]
        added = False
        for key, raw in zip(turn_keys, values[: len(turn_keys)], strict=True):
            if raw is None:
                continue
            data = _decode(raw, route=str, state=str)
            if data is None or data["state"] not in _STATES:
                self.state.unreadable("turn", self._tkey(key))
                continue
            record = self.cache.get_turn(key)
            if record is None:
                record = TurnRecord(data["route"], replica=data.get("replica"))
                self.bind(key, record)
                self.cache.put_turn(key, record)
                added = True
                if (
                    data.get("state") == "pending"
                    and self.state.clock() - float(data.get("at", 0)) < self.summary_wait_s
                ):
                    self._track(asyncio.get_running_loop().create_task(self._poll(key, record)))
                elif data.get("state") == "pending":
                    data["state"] = "failed"  # its summary never came in time: fold without it
            _apply(record, data)
        for (tenant, call_id), raw in zip(calls, values[len(turn_keys) :], strict=True):
            if raw is not None and self.cache.get_call(tenant, call_id) is None:
                data = _decode(raw, route=str, name=(str, type(None)))
                if data is None or "arguments" not in data:
                    self.state.unreadable("tool-call binding", self._ckey(tenant, call_id))
                    continue
                self.cache.put_call(
                    tenant, call_id, CallBinding(data["route"], data["arguments"], data["name"], data.get("replica"))
                )
        return added

    async def _poll(self, key: bytes, record: TurnRecord) -> None:
        """Another replica's turn whose summary is still being made: read it until it lands."""
        deadline = time.monotonic() + self.summary_wait_s
        while not record.finished and time.monotonic() < deadline:
            await asyncio.sleep(self.poll_s)
            try:
                raw = await self.state.call("read", lambda: self.state.command("GET", self._tkey(key)))
            except StoreUnavailable:
                return
            if raw is not None and not record.finished:
                data = _decode(raw, route=str, state=str)
                if data is None or data["state"] not in _STATES:  # replaced by something unreadable: fold without it
                    self.state.unreadable("turn", self._tkey(key))
                    data = {"state": "failed"}
                if data.get("state") != "pending":
                    _apply(record, data)

    async def choose_engine(self, owner: str | None, scope: StoreScope | None = None) -> EngineChoice | None:
        """Affinity: the owner's engine when its heartbeat is fresh, else None (this replica's); kept
        in `scope` (the replica named in the request's records, see `_serving`)."""
        choice = await self.state.engine_for(owner)
        if isinstance(scope, RedisScope):
            scope.engine = choice
        if choice is not None:
            self.affinity_remote_total += 1
        elif owner is not None and owner != self.state.replica_id:
            self.affinity_takeovers_total += 1
        return choice


def _serving(default: str, scope: StoreScope | None) -> str:
    """The replica whose engine answers the request of `scope` (affinity), else this one."""
    choice = scope.engine if isinstance(scope, RedisScope) else None
    return choice.replica if choice is not None and not choice.failed else default


def _retrieve(future: asyncio.Future) -> None:
    """A write nobody awaits: its StoreUnavailable is retrieved (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()
