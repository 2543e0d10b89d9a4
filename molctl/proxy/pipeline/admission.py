"""Admission control: how many hops of each kind the proxy has in flight at the engine, and who
waits for a free slot.

A `FairGate` holds `capacity` slots. A request that finds none free waits in its key's queue;
when a slot frees, the keys that wait take turns (round-robin: one waiter of the next key in
line), so one key's burst cannot starve the others. The wait is bounded twice:
- at most `max_queue` requests wait in all; when the queue is full, the newcomer is refused,
  unless another key has more requests waiting than the newcomer's key: then that key's newest
  waiter is refused instead and the newcomer takes its place (a burst fills the queue, it does
  not lock others out of it);
- a waiter that got no slot within `timeout_s` is refused.
A refusal is `Rejected` with a `retry_after` in whole seconds, estimated from the gate's recent
service rate (slots released per second over the last `rate_window_s`) and the queue ahead.

`Admission` holds the proxy's gates: answer hops (`proxy.max_inflight`, default the engine's
own limit), route hops (`proxy.route_inflight`), each with the same queue bounds. A request takes
its answer slot before its route hop (`routing.Router.route`), so route and answer hops together
never outnumber the engine's own limit, and a route hop never waits inside the engine behind
running answers. Summary hops have their own slots (`summary.Summaries`, `proxy.summary_inflight`),
so summaries never take an answer's slot. The clock is injected (tests drive it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

Clock = Callable[[], float]
RETRY_AFTER_MAX_S = 300  # a refused client is never told to come back later than this


class Rejected(Exception):
    """No slot: the queue was full (`reason` "queue_full") or the wait deadline passed ("deadline")."""

    def __init__(self, reason: str, retry_after: int):
        super().__init__(f"admission refused ({reason}); retry after {retry_after} s")
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class _Waiter:
    key: str
    future: asyncio.Future
    queued_at: float


@dataclass
class GateStats:
    inflight: int = 0
    waiting: int = 0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: {"queue_full": 0, "deadline": 0})


class FairGate:
    def __init__(
        self,
        capacity: int,
        max_queue: int,
        timeout_s: float,
        clock: Clock = time.monotonic,
        rate_window_s: float = 30.0,
    ):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.clock = clock
        self.rate_window_s = rate_window_s
        self.inflight = 0
        self.queues: dict[str, deque[_Waiter]] = {}  # insertion order = the round-robin order
        self.waiting = 0
        self.stats = GateStats()
        self._releases: deque[float] = deque()  # release times within rate_window_s

    # ---------------------------------------------------------------- estimate
    def service_rate(self) -> float | None:
        """Slots released per second over the recent window; None before the first release."""
        now = self.clock()
        while self._releases and now - self._releases[0] > self.rate_window_s:
            self._releases.popleft()
        if not self._releases:
            return None
        span = max(now - self._releases[0], 1.0)
        return len(self._releases) / span

    def retry_after(self) -> int:
        """Seconds until the queue ahead has likely drained: (waiting + 1) / service rate,
        between 1 and the wait deadline (the deadline itself when nothing was served lately),
        and at most RETRY_AFTER_MAX_S."""
        rate = self.service_rate()
        ceiling = max(1, min(RETRY_AFTER_MAX_S, math.ceil(self.timeout_s)))
        if rate is None:
            return ceiling
        return max(1, min(ceiling, math.ceil((self.waiting + 1) / rate)))

    # ---------------------------------------------------------------- slots
    def _reject(self, reason: str) -> Rejected:
        self.stats.rejected[reason] += 1
        return Rejected(reason, self.retry_after())

    async def acquire(self, key: str) -> float:
        """Take a slot for `key`; returns the seconds waited. Raises Rejected."""
        if self.inflight < self.capacity and not self.waiting:
            self.inflight += 1
            self.stats.admitted += 1
            return 0.0
        if self.waiting >= self.max_queue:
            self._make_room(key)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(key, loop.create_future(), self.clock())
        self.queues.setdefault(key, deque()).append(waiter)
        self.waiting += 1
        timer = loop.call_later(self.timeout_s, self._expire, waiter)
        try:
            await waiter.future  # a slot (the result) or Rejected (queue_full, deadline)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release()  # granted, but the caller went away: pass the slot on
            else:
                self._forget(waiter)
            raise
        finally:
            timer.cancel()
        return self.clock() - waiter.queued_at

    def _expire(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._forget(waiter)
            waiter.future.set_exception(self._reject("deadline"))

    def _make_room(self, key: str) -> None:
        mine = len(self.queues.get(key, ()))
        fullest = max(self.queues, key=lambda k: len(self.queues[k]), default=None)
        if fullest is None or len(self.queues[fullest]) <= mine + 1:
            raise self._reject("queue_full")
        victim = self.queues[fullest].pop()  # the fullest key's newest waiter
        self._drop_empty(fullest)
        self.waiting -= 1
        victim.future.set_exception(self._reject("queue_full"))

    def _forget(self, waiter: _Waiter) -> None:
        queue = self.queues.get(waiter.key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.waiting -= 1
            self._drop_empty(waiter.key)

    def _drop_empty(self, key: str) -> None:
        if not self.queues.get(key):
            self.queues.pop(key, None)

    def release(self) -> None:
        """Free a slot: the next key in turn gets it (its oldest waiter), else it is free."""
        now = self.clock()
        releases = self._releases
        releases.append(now)
        while now - releases[0] > self.rate_window_s:  # keep only the window (bounded memory)
            releases.popleft()
        while self.queues:
            key = next(iter(self.queues))
            queue = self.queues.pop(key)
            waiter = queue.popleft()
            if queue:
                self.queues[key] = queue  # to the back of the line
            self.waiting -= 1
            if not waiter.future.done():
                waiter.future.set_result(None)
                self.stats.admitted += 1
                return  # the slot passes on: inflight stays
        self.inflight -= 1

    @asynccontextmanager
    async def slot(self, key: str) -> AsyncIterator[float]:
        waited = await self.acquire(key)
        try:
            yield waited
        finally:
            self.release()


class Admission:
    """The proxy's gates (see the module docstring)."""

    def __init__(
        self,
        max_inflight: int,
        max_queue: int,
        queue_timeout_s: float,
        route_inflight: int,
        clock: Clock = time.monotonic,
    ):
        self.answers = FairGate(max_inflight, max_queue, queue_timeout_s, clock)
        self.routes = FairGate(route_inflight, max_queue, queue_timeout_s, clock)

    @classmethod
    def from_profile(cls, profile, engine, clock: Clock = time.monotonic) -> Admission:
        p = profile.proxy
        return cls(
            p.max_inflight or engine.max_running(profile), p.max_queue, p.queue_timeout_s, p.route_inflight, clock
        )
