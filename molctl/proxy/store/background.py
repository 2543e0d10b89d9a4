"""Background responses' jobs (`background: true` on /v1/responses) in the state store: `BackgroundStore`.

A job is one background response while the proxy runs it and after: `{"id", "tenant", "status",
"owner", "response"}` (`response`: the Response object as GET shows it before the full record is
stored), and its stream's events in order (`events`, each with its `sequence_number`, so a stream
resumes with `starting_after`). An active job (`queued`, `in_progress`) carries its owner's lease: the
replica running it renews it (`renew`); one whose lease lapsed (its replica died) is found by any
replica (`lapsed`) and failed with a reason, never left `in_progress`. A tenant has at most `limit`
active jobs (`create` refuses past it). Terminal jobs are kept `ttl_s`, as stored responses.

Backends: `MemoryBackground` (here: one process, lost with it), SQLite
(molctl.proxy.store.sqlite.background, tables of their own in the store's file) and Redis
(molctl.proxy.store.redis.background). molctl.proxy.store.background_backends picks the one of a response store.
Design: docs/design/store.md is the store's; the API's behaviour: docs/contract.md, "Background mode".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

ACTIVE = ("queued", "in_progress")
TERMINAL = ("completed", "incomplete", "failed", "cancelled")
Job = dict[str, Any]


class BackgroundStore(ABC):
    """Background jobs by (tenant, response id); every call is awaited on the event loop."""

    @abstractmethod
    async def create(self, job: Job, lease_until: float, limit: int) -> bool:
        """Store a new active job; False (nothing stored) when its tenant has `limit` active already."""

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> Job | None: ...

    @abstractmethod
    async def set_state(self, tenant: str, response_id: str, status: str, response: dict[str, Any]) -> bool:
        """The job's status and Response, if it is still active (False: it ended already, e.g. cancelled)."""

    @abstractmethod
    async def append(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        """Add stream events (in sequence order, numbered on from the last)."""

    @abstractmethod
    async def events(self, tenant: str, response_id: str, after: int) -> list[dict[str, Any]]:
        """The stored events whose sequence_number is over `after` (-1: all)."""

    @abstractmethod
    async def renew(self, jobs: list[tuple[str, str]], lease_until: float) -> None:
        """Extend the leases of these active jobs (tenant, id): their replica is alive."""

    @abstractmethod
    async def lapsed(self, now: float) -> list[Job]:
        """Active jobs whose lease ended before `now` (their replica stopped renewing them)."""

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool: ...


class MemoryBackground(BackgroundStore):
    """In-process jobs: the proxy's memory store's companion (lost with the process, as its records)."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], Job] = {}
        self.leases: dict[tuple[str, str], float] = {}
        self.logs: dict[tuple[str, str], list[dict[str, Any]]] = {}

    async def create(self, job: Job, lease_until: float, limit: int) -> bool:
        active = sum(1 for (tenant, _), j in self.jobs.items() if tenant == job["tenant"] and j["status"] in ACTIVE)
        if active >= limit:
            return False
        key = (job["tenant"], job["id"])
        self.jobs[key], self.leases[key], self.logs[key] = dict(job), lease_until, []
        return True

    async def get(self, tenant: str, response_id: str) -> Job | None:
        job = self.jobs.get((tenant, response_id))
        return dict(job) if job is not None else None

    async def set_state(self, tenant: str, response_id: str, status: str, response: dict[str, Any]) -> bool:
        job = self.jobs.get((tenant, response_id))
        if job is None or job["status"] not in ACTIVE:
            return False
        job["status"], job["response"] = status, response
        return True

    async def append(self, tenant: str, response_id: str, events: list[dict[str, Any]]) -> None:
        self.logs.setdefault((tenant, response_id), []).extend(events)

    async def events(self, tenant: str, response_id: str, after: int) -> list[dict[str, Any]]:
        return [e for e in self.logs.get((tenant, response_id), ()) if e["sequence_number"] > after]

    async def renew(self, jobs: list[tuple[str, str]], lease_until: float) -> None:
        for key in jobs:
            if key in self.leases:
                self.leases[key] = lease_until

    async def lapsed(self, now: float) -> list[Job]:
        return [dict(j) for k, j in self.jobs.items() if j["status"] in ACTIVE and self.leases.get(k, 0) < now]

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = (tenant, response_id)
        self.leases.pop(key, None)
        self.logs.pop(key, None)
        return self.jobs.pop(key, None) is not None
