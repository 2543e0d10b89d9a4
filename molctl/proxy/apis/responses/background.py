"""Background mode of /v1/responses (`background: true`): the answer runs in the proxy, not in the request.

`Background.create` stores the job (`queued`, in the state store: molctl.proxy.store.background) before
it answers, so an acknowledged response is never lost, then runs the request through the normal
pipeline (route -> answer -> summary, streamed internally) in a task of its own: the job goes
`in_progress`, its stream events are stored as they come (in batches of at most FLUSH_EVENTS or
FLUSH_S), and it ends `completed` / `incomplete` (the full record stored as any stored response),
`failed` (with the error) or `cancelled`. GET polls the job (`get`), `?stream=true&starting_after=N`
replays the stored events after N and follows the live ones (`follow`), POST /cancel stops it
(`cancel`: the task is cancelled, which closes the engine request: the engine aborts it).

Replicas and restarts: the replica running a job holds a lease on it (LEASE_S), renewed every BEAT_S.
Every replica sweeps the store every BEAT_S: an active job whose lease lapsed (its replica died:
a crash, a kill) is marked `failed` with the reason, so none stays `in_progress` forever; a replica
that stops cleanly fails its own at once. A job that failed so is not resumed: its engine request
died with its replica, and a client that resends gets a fresh answer. A cancel that reaches another
replica marks the job `cancelled` in the store; its owner sees it at its next beat and stops it.
Bounded: `proxy.background_max_per_tenant` active jobs per API key (429 past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.apis.responses import events
from molctl.proxy.apis.responses.convert import new_id
from molctl.proxy.errors import ProxyError, invalid
from molctl.proxy.http.body import BIG_ITEMS
from molctl.proxy.http.sse import SSE_HEADERS
from molctl.proxy.store.background import ACTIVE, BackgroundStore

log = logging.getLogger("molctl.proxy")

LEASE_S = 10.0  # a job's lease: a replica that has not renewed it this long is taken for dead
BEAT_S = 2.0  # leases renewed, lapsed jobs swept, remote cancels seen this often
FLUSH_EVENTS = 32  # stream events stored in one write at most...
FLUSH_S = 0.1  # ...or after this long (a follower sees them this much later at most)
POLL_S = 0.25  # a follower of a job running on another replica reads the store this often
END_EVENTS = ("response.completed", "response.incomplete", "response.failed")
Key = tuple[str, str]


def too_many(limit: int) -> ProxyError:
    return ProxyError(
        429,
        f"Too many background responses in progress for this API key (proxy.background_max_per_tenant: "
        f"{limit}); wait for one to finish or cancel one.",
        "rate_limit_error",
        "rate_limit_exceeded",
        headers={"retry-after": "5"},
    )


class Background:
    """The background jobs of one proxy process (see the module docstring)."""

    def __init__(
        self,
        jobs: BackgroundStore,
        limit: int,
        replica: str | None = None,
        clock: Callable[[], float] = time.time,
        lease_s: float = LEASE_S,
        beat_s: float = BEAT_S,
    ):
        self.jobs, self.limit, self.clock = jobs, limit, clock
        self.lease_s, self.beat_s = lease_s, beat_s
        self.replica = replica or "proxy-" + os.urandom(6).hex()  # a restarted process is a new owner
        self.tasks: dict[Key, asyncio.Task] = {}
        self._changed: dict[Key, asyncio.Event] = {}  # set (and replaced) at each store write of a job here
        self._beat_task: asyncio.Task | None = None
        self.closing = False
        self._beat_failed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._beat_task is None:
            self._beat_task = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        """Stop: every job running here is failed now, naming why (a drain waited for none of them)."""
        self.closing = True
        if self._beat_task is not None:
            self._beat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_task
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ create and run
    async def admit(self, tenant: str, queued: dict[str, Any]) -> None:
        """Store the `queued` job before its request is answered (429 past the tenant's limit)."""
        job = {"id": queued["id"], "tenant": tenant, "status": "queued", "owner": self.replica, "response": queued}
        if not await self.jobs.create(job, self.clock() + self.lease_s, self.limit):
            raise too_many(self.limit)

    def launch(
        self,
        tenant: str,
        response_id: str,
        stream: AsyncIterator[dict[str, Any]],
        snapshot: Callable[..., dict[str, Any]],
        finished: Callable[[bool], None],
    ) -> None:
        """Run `stream` (the request's Responses events) as the job: `snapshot(status, **fields)` makes
        its Response at a status, `finished(complete)` follows its end (the summary hop, or none)."""
        key = (tenant, response_id)
        self._changed[key] = asyncio.Event()
        self.tasks[key] = asyncio.get_running_loop().create_task(self._run(key, stream, snapshot, finished))

    async def _run(self, key: Key, stream: AsyncIterator[dict[str, Any]], snapshot, finished) -> None:
        tenant, rid = key
        complete = False
        try:
            if await self.jobs.set_state(tenant, rid, "in_progress", snapshot("in_progress")):
                await self._pump(key, stream, snapshot)
                complete = True  # else it was cancelled (or deleted) before it started: nothing runs
        except asyncio.CancelledError:
            why = "the proxy replica running it stopped" if self.closing else None
            if why is not None:
                await self._end(key, snapshot("failed", error={"code": "server_error", "message": f"{why}."}))
            else:  # a cancel: the job is `cancelled` in the store already (a no-op if so)
                await self._end(key, snapshot("cancelled"))
        except Exception as exc:  # the engine or the store failed before the first token, or a bug
            message = exc.message if isinstance(exc, ProxyError) else f"the proxy failed ({type(exc).__name__})"
            if not isinstance(exc, ProxyError):
                log.exception("background response %s failed", rid)
            await self._end(key, snapshot("failed", error={"code": "server_error", "message": message}))
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]
            finished(complete)
            self.tasks.pop(key, None)
            self._wake(key, last=True)

    async def _pump(self, key: Key, stream: AsyncIterator[dict[str, Any]], snapshot) -> None:
        loop = asyncio.get_running_loop()
        pending: list[dict[str, Any]] = []
        final: dict[str, Any] | None = None
        written = loop.time()
        async for event in stream:
            pending.append(event)
            if event["type"] in END_EVENTS:
                final = event["response"]
            if final is not None or len(pending) >= FLUSH_EVENTS or loop.time() - written >= FLUSH_S:
                await self.jobs.append(*key, pending)
                pending, written = [], loop.time()
                self._wake(key)
        if pending:
            await self.jobs.append(*key, pending)
        if final is None:  # the stream ended without its last event (not made by StreamTranslator)
            final = snapshot("failed", error={"code": "server_error", "message": "the answer ended early."})
        await self.jobs.set_state(*key, final["status"], final)

    async def _end(self, key: Key, response: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # a store down now: the lease lapses, a sweep fails it later
            await self.jobs.set_state(*key, response["status"], response)

    def _wake(self, key: Key, last: bool = False) -> None:
        event = self._changed.pop(key, None) if last else self._changed.get(key)
        if event is not None:
            if not last:
                self._changed[key] = asyncio.Event()
            event.set()

    # ------------------------------------------------------------------ the other endpoints
    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        job = await self.jobs.get(tenant, response_id)
        return job["response"] if job is not None else None

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The cancelled Response (None: no background job of that id). A finished one is a 400."""
        job = await self.jobs.get(tenant, response_id)
        if job is None:
            return None
        if job["status"] in ACTIVE:
            response = {**job["response"], "status": "cancelled", "completed_at": None}
            if await self.jobs.set_state(tenant, response_id, "cancelled", response):
                task = self.tasks.get((tenant, response_id))
                if task is not None:
                    task.cancel()
                return response
            job = await self.jobs.get(tenant, response_id) or job
        if job["status"] == "cancelled":
            return job["response"]
        raise invalid(
            f"Cannot cancel a response with status '{job['status']}': only a queued or in-progress "
            "background response can be cancelled.",
            "response_id",
        )

    async def cancel_quietly(self, tenant: str, response_id: str) -> None:
        """Stop a job being deleted (whatever its status)."""
        with contextlib.suppress(ProxyError):
            await self.cancel(tenant, response_id)

    async def follow(self, tenant: str, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The job's stored events after sequence number `after`, then the new ones until it ends."""
        key = (tenant, response_id)
        while True:
            changed = self._changed.get(key)
            batch = await self.jobs.events(tenant, response_id, after)
            for event in batch:
                yield event
                after = event["sequence_number"]
            if batch and batch[-1]["type"] in END_EVENTS:
                return
            job = await self.jobs.get(tenant, response_id)
            if job is None or job["status"] not in ACTIVE:
                last = None
                for last in await self.jobs.events(tenant, response_id, after):  # written just before it ended
                    yield last
                    after = last["sequence_number"]
                if job is not None and job["status"] == "failed" and (last is None or last["type"] not in END_EVENTS):
                    # failed by a sweep or a stop, not by its stream: the event says so (not stored)
                    yield {"type": "response.failed", "sequence_number": after + 1, "response": job["response"]}
                return  # a cancelled one ends with its last event: OpenAI's stream has no cancel event
            if changed is None:  # running on another replica (or not started yet): poll the store
                await asyncio.sleep(POLL_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), POLL_S * 4)

    # ------------------------------------------------------------------ leases
    async def _beat(self) -> None:
        while True:
            try:
                await self.beat()
                self._beat_failed = False
            except Exception as exc:  # a store down: the next beat tries again
                if not self._beat_failed:
                    log.warning("background responses: lease renewal or sweep failed: %s", exc)
                self._beat_failed = True
            await asyncio.sleep(self.beat_s)

    async def beat(self) -> None:
        """Renew this replica's leases, stop its jobs cancelled elsewhere, fail the lapsed jobs."""
        mine = list(self.tasks)
        await self.jobs.renew(mine, self.clock() + self.lease_s)
        for key in mine:
            job = await self.jobs.get(*key)
            task = self.tasks.get(key)
            if task is not None and (job is None or job["status"] == "cancelled"):
                task.cancel()
        for job in await self.jobs.lapsed(self.clock()):
            if (job["tenant"], job["id"]) in self.tasks:
                continue  # this replica's, renewed just now
            error = {
                "code": "server_error",
                "message": f"The proxy replica running this background response ({job['owner']}) stopped "
                "before it finished; send the request again.",
            }
            failed = {**job["response"], "status": "failed", "completed_at": None, "error": error}
            if await self.jobs.set_state(job["tenant"], job["id"], "failed", failed):
                log.warning("background response %s failed: its replica %s stopped", job["id"], job["owner"])


async def write_followed(send: Callable, request_id: str, events: AsyncIterator[dict[str, Any]], frame) -> None:
    """An SSE answer of a job's events (GET ?stream=true, or a background create with stream=true)."""
    headers = SSE_HEADERS + [(b"x-request-id", request_id.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    async for event in events:
        await send({"type": "http.response.body", "body": frame(event), "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def create(api: Any, ex: Exchange, req: Any, big: bool) -> None:
    """POST /v1/responses with `background: true` (`api`: the ResponsesAPI): the chain loaded and the
    request planned as a foreground one, the job stored `queued`, the answer started in its task;
    the answer is the `queued` Response (or, with `stream: true`, the job's events as they come)."""
    tenant = ex.tenant
    scope = api.orch.store.open_scope()
    await api._previous(req, tenant, scope)
    req.chat["stream"] = True  # the job streams internally: its events are stored for `starting_after`
    plan = api._plan(req, tenant, big or len(req.history) > BIG_ITEMS)
    plan.scope = scope
    await api.orch.load(plan)
    ex.track(plan)
    tr = events.StreamTranslator(req, new_id("resp_"))
    plan.responses.conversation_id = plan.responses.conversation_id or tr.id
    queued = tr.snapshot("queued")
    await api.background.admit(tenant, queued)
    shim = SimpleNamespace(tenant=tenant, state=SimpleNamespace(error=None))

    def snapshot(status: str, **fields: Any) -> dict[str, Any]:
        return tr.snapshot(status, output=copy.deepcopy(tr.output), usage=tr.usage, **fields)

    def finished(complete: bool) -> None:
        if complete:
            api.orch.start_summary(plan)
        else:
            api.orch.abandon(plan)

    api.background.launch(tenant, tr.id, api._events(plan, req, tr, shim), snapshot, finished)
    if req.stream:
        await write_followed(ex.send, ex.state.request_id, api.background.follow(tenant, tr.id, -1), events.sse)
    else:
        await ex.json(200, queued)


def starting_after(query: dict[str, list[str]]) -> int:
    """GET's `starting_after`: the last sequence number the client has (-1, the default: none)."""
    raw = query.get("starting_after", ["-1"])[-1]
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < -1:
        raise invalid("'starting_after' must be an integer sequence number (0 or more).", "starting_after")
    return value
