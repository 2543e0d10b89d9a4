"""The speculative answer: a follow-up turn's answer hop on the conversation's adapter, started
alongside the route hop and held until the route decides.

`Speculation.start(plan, build)` decides (speculate, or skip with a reason, `skip_reason`) and
starts the held hop (`HeldHop`: the answer hop's request as `Orchestrator.answer_payload` builds
it for that adapter, its output buffered, nothing sent to the client); `settle(plan)` once the
route is decided: the same adapter is a hit (`plan.speculation.answer` is the answer, streamed on from where it
is), another a miss (the engine request is closed at once, so the engine aborts it; its tokens
are counted as wasted); `discard(plan)` when the request ends before the route decided (a client
gone, a failure). The rules and signals: docs/design/proxy.md, "The speculative answer".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from molctl.engines.base import Engine
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import ProxyError
from molctl.proxy.pipeline.admission import FairGate
from molctl.proxy.pipeline.heldhop import HeldHop
from molctl.proxy.pipeline.plan import Plan

HOP = "speculative"  # the hop name the engine sees (X-MoL-Hop, the request id's suffix)
# why a turn was not speculated (the `reason` label of speculative_total{outcome="skipped"})
SKIP_REASONS = ("disabled", "first_turn", "tool_turn", "admission", "summary_pending")
Build = Callable[[str], Awaitable[tuple[list[dict[str, Any]], dict[str, Any]]]]


def conversation_adapter(plan: Plan) -> str | None:
    """The adapter that answered the conversation's last turn: Responses, the stored response the
    request continues; chat, the last assistant turn's stored record. None on a first turn."""
    if plan.responses.previous is not None:
        return plan.responses.previous.get("route") or None
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
        plan.speculation.outcome, plan.speculation.reason = "skipped", reason
        self.counters.inc("speculative_total", outcome="skipped", reason=reason)

    def start(self, plan: Plan, build: Build) -> None:
        """Speculate on the conversation's adapter, or count why not; called just before the
        route hop, with the request's answer slot held. `build(adapter)`: (view, answer payload)."""
        reason = skip_reason(plan, self.enabled, self.answers, self.inflight)
        if reason is not None:
            self._skip(plan, reason)
            return
        held = plan.speculation.pending = HeldHop(conversation_adapter(plan), self.engine)  # type: ignore[arg-type]
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
        held, plan.speculation.pending = plan.speculation.pending, None
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
        """The route is decided: a hit keeps the held hop as the answer (`plan.speculation.answer`), a miss
        closes its engine request before the routed answer starts, a tool turn that never reached
        the route hop is counted as skipped."""
        held = self._unheld(plan)
        if held is None:
            if plan.speculation.outcome is None:
                self._skip(plan, "disabled" if not self.enabled else "tool_turn")
            return
        if held.preempted:
            await held.cancel()
            self._skip(plan, "admission")
            self._waste(plan, held)
            return
        if held.adapter == plan.route:
            plan.speculation.outcome = "hit"
            plan.speculation.answer = held
            self.counters.inc("speculative_total", outcome="hit", reason="")
            return
        await held.cancel()
        plan.speculation.outcome = "miss"
        self.counters.inc("speculative_total", outcome="miss", reason="")
        self._waste(plan, held)

    def _waste(self, plan: Plan, held: HeldHop) -> None:
        prompt, generated = held.wasted()
        plan.speculation.wasted = (prompt, generated)
        self.counters.inc("speculative_wasted_tokens_total", prompt, kind="prompt")
        self.counters.inc("speculative_wasted_tokens_total", generated, kind="generated")

    async def discard(self, plan: Plan) -> None:
        """The request ended before the route decided (the client left, a failure): nothing of
        the held hop is left running."""
        held = self._unheld(plan)
        if held is not None:
            plan.speculation.outcome = "cancelled"
            await held.cancel()
