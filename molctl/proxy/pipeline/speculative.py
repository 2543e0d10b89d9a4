"""The speculative answer: a follow-up turn's answer hop on the conversation's adapter, started
alongside the route hop and held until the route decides.

`Speculation.start(plan, build)` decides (speculate, or skip with a reason, `skip_reason`) and
starts the held hop (`HeldHop`: the answer hop's request as `Orchestrator.answer_payload` builds
it for that adapter, its output buffered, nothing sent to the client); `settle(plan)` once the
route is decided: the same adapter is a hit (`plan.held` is the answer, streamed on from where it
is), another a miss (the engine request is closed at once, so the engine aborts it; its tokens
are counted as wasted); `discard(plan)` when the request ends before the route decided (a client
gone, a failure). The rules and signals: docs/design/proxy.md, "The speculative answer".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from molctl.engines.base import AnswerTokens, Engine
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable, ProxyError
from molctl.proxy.pipeline.admission import FairGate
from molctl.proxy.pipeline.plan import Plan

HOP = "speculative"  # the hop name the engine sees (X-MoL-Hop, the request id's suffix)
# why a turn was not speculated (the `reason` label of speculative_total{outcome="skipped"})
SKIP_REASONS = ("disabled", "first_turn", "tool_turn", "admission", "summary_pending")
# A held stream's events buffered ahead of its reader, at most: past it the hop stops reading the
# engine's stream, which backs up into the engine as a routed stream's slow client does (unbounded,
# a slow reader on a hit made the proxy hold 90 MB for a 100k-token answer). The route decides
# within a few events (a 2-token decode), so the engine is not held back before it.
HELD_EVENTS_MAX = 256
Build = Callable[[str], Awaitable[tuple[list[dict[str, Any]], dict[str, Any]]]]


def conversation_adapter(plan: Plan) -> str | None:
    """The adapter that answered the conversation's last turn: Responses, the stored response the
    request continues; chat, the last assistant turn's stored record. None on a first turn."""
    if plan.previous is not None:
        return plan.previous.get("route") or None
    record = plan.history.last_record()
    return record.route if record is not None else None


def summary_pending(plan: Plan, adapter: str) -> bool:
    """Whether the answer on `adapter` would wait for another adapter's summary
    (`Orchestrator._await_summaries`): its view is not final until then."""
    return any(
        s.record is not None and s.record.route != adapter and not s.record.finished for s in plan.history.segments
    )


def skip_reason(plan: Plan, enabled: bool, answers: FairGate, speculating: int) -> str | None:
    """Why this turn is not speculated (one of SKIP_REASONS), or None: speculate. Admission: the
    proxy's own answer gate (`admission.Admission.answers`); a held hop is one more sequence at
    the engine while the route hop runs, so it needs a free answer slot beyond the request's own
    and no request waiting for one. The engine's own waiting count is not known per request
    without a scrape of its metrics, so it is not asked."""
    if not enabled:
        return "disabled"
    if plan.messages[-1].get("role") == "tool":
        return "tool_turn"
    adapter = conversation_adapter(plan)
    if adapter is None:
        return "first_turn"
    if answers.waiting or answers.inflight + speculating >= answers.capacity:
        return "admission"
    if summary_pending(plan, adapter):
        return "summary_pending"
    return None


class _End:
    """The held stream's end: normal (`error` None) or the engine's failure."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class HeldHop:
    """One speculative answer hop: a task sending the answer hop's request on `adapter`, its
    output (a stream's events, or the whole completion) held until `events` / `result`."""

    def __init__(self, adapter: str, engine: Engine):
        self.adapter = adapter
        self.engine = engine
        self.view: list[dict[str, Any]] = []
        self.payload: dict[str, Any] | None = None
        self.sent_at: float | None = None  # when its request went to the engine
        self.first_at: float | None = None  # its first event (stream) or its whole body
        self.done_at: float | None = None
        self.tokens = AnswerTokens()
        self.generated = 0  # events with generated output (a stream without token ids: ~1 token each)
        self.usage: dict[str, Any] | None = None
        self.queue: asyncio.Queue[Any] = asyncio.Queue(HELD_EVENTS_MAX)
        self.body: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.preempted = False  # closed before the route decided: a request took the slot it counted on
        self.ready = asyncio.Event()  # `view` and `payload` are built (payload None: the build refused)

    def start(self, run: Callable[[HeldHop], Awaitable[None]]) -> None:
        self.task = asyncio.ensure_future(run(self))

    async def pump(self, upstream: AsyncIterator[dict[str, Any]]) -> None:
        """Buffer a stream's events, at most HELD_EVENTS_MAX ahead of the reader (then the
        client's pace holds the engine back, as on a routed stream), and how the stream ended:
        the reader (`events`) raises its failure, whatever it was."""
        try:
            async for event in upstream:
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self._count(event)
                await self.queue.put(event)
        except Exception as exc:  # any failure reaches the reader: it never waits on a queue nobody fills
            await self.queue.put(_End(exc))
        else:
            await self.queue.put(_End())
        finally:
            self.done_at = time.monotonic()
            await upstream.aclose()  # not read whole: the connection closes, the engine aborts it

    async def whole(self, answer: Awaitable[dict[str, Any]]) -> None:
        """Hold a non-streamed answer's body (or its failure)."""
        try:
            self.body = await answer
            self.usage = self.body.get("usage") if isinstance(self.body.get("usage"), dict) else None
            self.tokens = self.engine.answer_tokens(self.body)
        except (EngineHTTPError, EngineUnavailable, ProxyError) as exc:
            self.error = exc
        finally:
            self.first_at = self.done_at = time.monotonic()

    def _count(self, event: dict[str, Any]) -> None:
        self.engine.stream_tokens(event, self.tokens)
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning", "tool_calls")):
                self.generated += 1

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The held stream, from its first event on (the hit's answer); closing it cancels the hop."""
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            await self.cancel()

    async def result(self) -> dict[str, Any]:
        """The held completion (the hit's answer), once the engine sent it."""
        try:
            await asyncio.shield(self.task)  # type: ignore[arg-type]
        finally:
            await self.cancel()  # a no-op once done; the request cancelled: the hop with it
        if self.error is not None:
            raise self.error
        return self.body  # type: ignore[return-value]

    async def cancel(self) -> None:
        """Close the engine request now (a cancelled read closes its connection)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def wasted(self) -> tuple[int, int]:
        """(prompt, generated) tokens the engine spent on this hop, as far as it reported them:
        the usage when it finished, else the prompt's token ids (vLLM's first stream event) and the
        generated token ids (or the generating events). 0 where nothing was reported."""
        usage = self.usage or {}
        prompt = usage.get("prompt_tokens") or len(self.tokens.prompt or ())
        generated = usage.get("completion_tokens") or len(self.tokens.output or ()) or self.generated
        return int(prompt), int(generated)


class Speculation:
    """The speculative answers of one orchestrator: the decision, the held hops, their counters."""

    def __init__(self, enabled: bool, engine: Engine, client: EngineClient, counters: Any, answers: FairGate):
        self.enabled = enabled
        self.engine = engine
        self.client = client
        self.counters = counters
        self.answers = answers
        self.held: list[HeldHop] = []  # held hops not yet settled, oldest first

    @property
    def inflight(self) -> int:
        return len(self.held)

    def _skip(self, plan: Plan, reason: str) -> None:
        plan.speculative, plan.speculative_reason = "skipped", reason
        self.counters.inc("speculative_total", outcome="skipped", reason=reason)

    def start(self, plan: Plan, build: Build) -> None:
        """Speculate on the conversation's adapter, or count why not; called just before the
        route hop, with the request's answer slot held. `build(adapter)`: (view, answer payload)."""
        reason = skip_reason(plan, self.enabled, self.answers, self.inflight)
        if reason is not None:
            self._skip(plan, reason)
            return
        held = plan.speculation = HeldHop(conversation_adapter(plan), self.engine)  # type: ignore[arg-type]
        self.held.append(held)
        held.start(lambda hop: self._run(plan, hop, build))

    async def _run(self, plan: Plan, hop: HeldHop, build: Build) -> None:
        await asyncio.sleep(0)  # the route hop's request goes out first
        try:
            hop.view, hop.payload = await build(hop.adapter)
        except ProxyError:  # the answer on any adapter fails the same way: the routed answer says so
            return
        finally:
            hop.ready.set()
        hop.sent_at = time.monotonic()
        call = dict(big=plan.big, request_id=plan.request_id, engine=plan.engine)
        if plan.stream:
            await hop.pump(self.client.chat_stream(hop.payload, HOP, **call))
        else:
            await hop.whole(self.client.chat(hop.payload, HOP, **call))

    def _unheld(self, plan: Plan) -> HeldHop | None:
        held, plan.speculation = plan.speculation, None
        if held in self.held:
            self.held.remove(held)
        return held

    def make_room(self) -> None:
        """A request took an answer slot: while the running held hops and the slots taken are
        more than the gate's capacity, the newest running held hop is closed (a held hop never
        keeps an engine sequence a real request's slot counts on; its request's routed answer is
        built as without speculation, `settle`). A held hop the engine finished holds none."""
        running = [h for h in self.held if h.task is not None and not h.task.done()]
        while running and self.answers.inflight + len(running) > self.answers.capacity:
            hop = running.pop()
            self.held.remove(hop)
            hop.preempted = True
            hop.task.cancel()  # type: ignore[union-attr]  # its connection closes: the engine aborts it

    async def settle(self, plan: Plan) -> None:
        """The route is decided: a hit keeps the held hop as the answer (`plan.held`), a miss
        closes its engine request before the routed answer starts, a tool turn that never reached
        the route hop is counted as skipped."""
        held = self._unheld(plan)
        if held is None:
            if plan.speculative is None:
                self._skip(plan, "disabled" if not self.enabled else "tool_turn")
            return
        if held.preempted:
            await held.cancel()
            self._skip(plan, "admission")
            self._waste(plan, held)
            return
        if held.adapter == plan.route:
            plan.speculative = "hit"
            plan.held = held
            self.counters.inc("speculative_total", outcome="hit", reason="")
            return
        await held.cancel()
        plan.speculative = "miss"
        self.counters.inc("speculative_total", outcome="miss", reason="")
        self._waste(plan, held)

    def _waste(self, plan: Plan, held: HeldHop) -> None:
        prompt, generated = held.wasted()
        plan.speculative_wasted = (prompt, generated)
        self.counters.inc("speculative_wasted_tokens_total", prompt, kind="prompt")
        self.counters.inc("speculative_wasted_tokens_total", generated, kind="generated")

    async def discard(self, plan: Plan) -> None:
        """The request ended before the route decided (the client left, a failure): nothing of
        the held hop is left running."""
        held = self._unheld(plan)
        if held is not None:
            plan.speculative = "cancelled"
            await held.cancel()
