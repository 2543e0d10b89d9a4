"""POST /v1/chat/completions: the body to a plan (`chat_validation` via `Orchestrator.prepare`),
the pipeline's answer (`answer`, or `chunks` as SSE: `http.sse`) back to the client."""

from __future__ import annotations

import asyncio
from typing import Any

from molctl.proxy.apis.chat_validation import parse_body
from molctl.proxy.http.body import BIG_BODY, many_items, parse_on_loop
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.run import Orchestrator


class ChatAPI:
    def __init__(self, orch: Orchestrator):
        self.orch = orch

    def _plan(self, raw: bytes, tenant: str) -> Plan:
        """A body over BIG_BODY, in a worker thread: parsed in steps, then prepared."""
        plan = self.orch.prepare(parse_body(raw, in_steps=True), tenant)
        plan.big = True
        return plan

    async def plan(self, raw: bytes, tenant: str) -> Plan:
        if len(raw) > BIG_BODY:
            return await asyncio.to_thread(self._plan, raw, tenant)
        body = await parse_on_loop(raw)
        if many_items(body, "messages"):
            plan = await asyncio.to_thread(self.orch.prepare, body, tenant)
            plan.big = True
            return plan
        return self.orch.prepare(body, tenant)

    async def create(self, ex: Any) -> None:
        raw = await ex.body()
        plan = await self.plan(raw, ex.tenant)
        del raw
        ex.track(plan)
        await self.orch.load(plan)
        await ex.run(plan, self._stream(plan, ex) if plan.stream else self._complete(plan, ex))

    async def _complete(self, plan: Plan, ex: Any) -> None:
        body = await self.orch.answer(plan)
        await ex.json(200, body)
        self.orch.start_summary(plan)

    async def _stream(self, plan: Plan, ex: Any) -> None:
        if await ex.stream(plan, self.orch.chunks(plan), abandon=lambda: self.orch.abandon(plan)):
            self.orch.start_summary(plan)
