"""The route hop and the one sticky tool-turn rule, for chat and Responses alike.

The two stages of the route sequence that decide the adapter (the sequence itself, with the answer
slot and the speculative answer between them, is `run.Orchestrator.route`):

- `Router.stick(plan, store)`: a trailing run of tool results continues on the adapter that issued
  the calls (`sticky_route`: the stored response a Responses request continues, else the store's
  call bindings);
- `Router.classify(plan)`: the route hop (L0 labels the turn, `parse_label`), with its fallback
  (the previous turn's route, else `proxy.default_route`) on a timeout, an engine error or an
  unparseable label.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from molctl.engines.base import Engine
from molctl.profiles import Profile, route_instruction
from molctl.proxy.conversations import canonical_arguments, tool_calls_of
from molctl.proxy.engine_client import EngineClient, checked_completion
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable
from molctl.proxy.pipeline.admission import Admission, Rejected
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.priority import PriorityPolicy
from molctl.proxy.pipeline.views import route_input, route_messages
from molctl.proxy.store.base import ConversationStore
from molctl.routes import ROUTES

log = logging.getLogger("molctl.proxy")

LABEL_RE = re.compile(r"(?<![A-Za-z0-9])(L[0-3])(?![0-9])", re.IGNORECASE)


def parse_label(message: dict[str, Any]) -> str | None:
    """Lenient: the first L0-L3 in content, else in the reasoning fields."""
    for field_name in ("content", "reasoning_content", "reasoning"):
        text = message.get(field_name)
        if isinstance(text, str):
            match = LABEL_RE.search(text)
            if match:
                label = match.group(1).upper()
                if label in ROUTES:
                    return label
    return None


def described(exc: Exception) -> str:
    """An engine failure for the log: an HTTP error with what the engine said."""
    said = exc.one_line() if isinstance(exc, EngineHTTPError) else ""
    return f"{exc}: {said}" if said else str(exc)


def trailing_calls(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls a trailing run of tool results answers (none without such a run)."""
    i = len(msgs)
    while i > 0 and msgs[i - 1].get("role") == "tool":
        i -= 1
    if i == len(msgs) or i == 0 or msgs[i - 1].get("role") != "assistant":
        return []
    return tool_calls_of(msgs[i - 1])


def sticky_route(plan: Plan, store: ConversationStore | None) -> str | None:
    """The one sticky tool-turn rule: tool results that answer the calls of one adapter continue on
    it. With `store` None, the stored response a Responses request continues says (so it holds
    across a proxy restart: its route, and the calls of its last message); else the store's call
    bindings (each call's name and arguments must match its binding)."""
    if store is None:
        prev, new = plan.responses.previous, plan.responses.new_messages
        if prev is None or not prev.get("route") or not new or not all(m["role"] == "tool" for m in new):
            return None
        last = prev["messages"][-1] if prev.get("messages") else {}
        calls = {c.get("id") for c in last.get("tool_calls") or []}
        return prev["route"] if calls and all(m.get("tool_call_id") in calls for m in new) else None
    calls = trailing_calls(plan.messages)
    if not calls:
        return None
    routes = set()
    for call in calls:
        binding = store.get_call(plan.tenant, str(call.get("id")))
        fn = call.get("function") or {}
        if (
            binding is None
            or binding.name != fn.get("name")
            or binding.arguments != canonical_arguments(fn.get("arguments"))
        ):
            return None
        routes.add(binding.route)
    return routes.pop() if len(routes) == 1 else None


class Router:
    def __init__(
        self,
        profile: Profile,
        engine: Engine,
        client: EngineClient,
        store: ConversationStore,
        counters: Any,
        admission: Admission,
        priority: PriorityPolicy,
        window_fit: Any,
    ):
        self.profile = profile
        self.engine = engine
        self.client = client
        self.store = store
        self.counters = counters
        self.admission = admission
        self.priority = priority
        self.window_fit = window_fit  # `window.WindowFit`: the route hop's max_tokens within the window
        self.route_instruction = route_instruction(profile)
        self.router_model = engine.adapter_model(profile, "L0")
        self.route_tokens = min(profile.proxy.route_max_tokens, max(len(r) for r in ROUTES))

    def stick(self, plan: Plan, stored_chain: bool) -> bool:
        """The sticky tool-turn rule (`sticky_route`) on the stored response a Responses request
        continues (`stored_chain`), else on the store's call bindings: True when it decided."""
        sticky = sticky_route(plan, None if stored_chain else self.store)
        if sticky is None:
            return False
        plan.route = sticky
        plan.decision.sticky = True
        plan.decision.source = "sticky"
        self.counters.inc("sticky_tool_turns_total")
        self.counters.inc("route_sources_total", source="sticky", reason="")
        return True

    async def classify(self, plan: Plan) -> None:
        """The route hop decides the adapter; on a timeout, an engine error, a refused slot or no
        label, the fallback: the previous turn's route, else `proxy.default_route`."""
        previous = plan.history.last_record()
        payload = self.route_payload(plan)
        self.counters.inc("route_hops_total")
        await self.window_fit.fit(payload, "route", plan.engine)
        label = None
        reason = "bad_label"
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.profile.proxy.route_timeout_s):  # no task per call (wait_for makes one)
                body = await self._route_hop(plan, payload)
            label = parse_label(((body.get("choices") or [{}])[0]).get("message") or {})
            self.counters.usage("route", "L0", body.get("usage"))
        except TimeoutError:
            reason = "timeout"
            self.counters.inc("route_timeouts_total")
            log.warning("route hop timed out after %.1f s", self.profile.proxy.route_timeout_s)
        except (EngineHTTPError, EngineUnavailable, Rejected) as exc:
            reason = "no_slot" if isinstance(exc, Rejected) else "engine_error"
            log.warning("route hop failed: %s", described(exc))
        plan.timings["route_s"] = elapsed = time.monotonic() - start
        self.counters.observe("hop_seconds", elapsed, hop="route", adapter="L0")
        if label is None:
            plan.decision.fallback = reason
            self.counters.inc("route_fallbacks_total", reason=reason)
            label = previous.route if previous is not None else self.profile.proxy.default_route
        plan.decision.source = "classified" if plan.decision.fallback is None else "fallback"
        self.counters.inc("route_sources_total", source=plan.decision.source, reason=plan.decision.fallback or "")
        self.counters.inc("route_decisions_total", adapter=label)
        plan.route = label

    def route_payload(self, plan: Plan) -> dict[str, Any]:
        previous = plan.history.last_record()
        payload: dict[str, Any] = {
            "model": self.router_model,
            "messages": route_messages(
                self.route_instruction, route_input(plan.messages, self.profile.proxy.route_max_input_chars), previous
            ),
            "max_tokens": self.route_tokens,
            "temperature": 0,
            "stream": False,
            **self.engine.guided_choice(list(ROUTES)),
        }
        if self.profile.proxy.reasoning != "none":
            payload["chat_template_kwargs"] = {"enable_thinking": False}
        self.priority.mark(payload, "route", plan.engine)
        return payload

    async def _route_hop(self, plan: Plan, payload: dict[str, Any]) -> dict[str, Any]:
        async with self.admission.routes.slot(plan.tenant):
            try:
                body = await self.client.chat(payload, "route", request_id=plan.request_id, engine=plan.engine)
                self.priority.took(payload, plan.engine)
                return checked_completion(body)
            except EngineHTTPError as exc:
                if not self.priority.refuses(exc, payload):
                    raise
                self.priority.refused(exc, plan.engine)
                payload = {k: v for k, v in payload.items() if k != "priority"}
                body = await self.client.chat(payload, "route", request_id=plan.request_id, engine=plan.engine)
                return checked_completion(body)
