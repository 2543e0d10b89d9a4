"""POST /v1/chat/completions: the body checked at this edge (`Orchestrator.check`) to a plan,
the pipeline's answer (`answer`, or `chunks` as SSE: `http.sse`) back to the client."""

from __future__ import annotations

from typing import Any

from molctl.proxy.apis.exchange import Exchange
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.run import Orchestrator


class ChatAPI:
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    def _plan(self, body: Any, tenant: str) -> Plan:
        """The body checked (`chat_validation.check_request`: the chat API's edge) and its plan."""
        self.orch.check(body)
        return self.orch.prepare(body, tenant)

    async def create(self, ex: Exchange) -> None:
        plan, big = await ex.json_body("messages", lambda body: self._plan(body, ex.tenant))
        plan.big = plan.big or big
        ex.track(plan)
        await self.orch.load(plan)
        await ex.run(plan, self._stream(plan, ex) if plan.stream else self._complete(plan, ex))

    async def _complete(self, plan: Plan, ex: Exchange) -> None:
        body = await self.orch.answer(plan)
        await ex.json(200, body)
        self.orch.start_summary(plan)

    async def _stream(self, plan: Plan, ex: Exchange) -> None:
        if await ex.stream(plan, self.orch.chunks(plan), abandon=lambda: self.orch.abandon(plan)):
            self.orch.start_summary(plan)
