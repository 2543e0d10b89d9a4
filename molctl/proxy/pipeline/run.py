"""The pipeline's entry points, shared by chat and the Responses API: one request's hops in order.

`Orchestrator.check(body)` validates a chat body (the chat API's edge); `prepare(body, tenant)`
finds the conversation's earlier turns (a Plan); `load(plan)` reads a shared store and chooses the engine; `answer(plan)` and
`chunks(plan)` route (`routing`) and run the answer hop, whole or streamed, recording the turn;
`start_summary(plan)` starts the background summary (`summary`) once the client has the answer,
`abandon(plan)` when it has not; `release_answer_slot(plan)` frees the answer slot (`admission`).
The defaults and choices behind the hops (output limits, reasoning controls, route fallback,
failed answers, summaries, large requests) are in docs/design/proxy.md, "The pipeline".
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

from molctl.engines.base import AnswerTokens, Engine
from molctl.profiles import Profile
from molctl.proxy import shaping
from molctl.proxy.apis.chat_validation import PASSTHROUGH, check_request
from molctl.proxy.apis.request_fields import FieldPolicy
from molctl.proxy.conversations import (
    CallBinding,
    ConversationKeys,
    TurnRecord,
    canonical_arguments,
    tool_calls_of,
)
from molctl.proxy.engine_client import EngineClient, checked_completion
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable, from_engine, invalid, overloaded
from molctl.proxy.metrics import Counters
from molctl.proxy.pipeline.admission import Admission, Rejected
from molctl.proxy.pipeline.plan import Plan
from molctl.proxy.pipeline.priority import PriorityPolicy
from molctl.proxy.pipeline.routing import Router, trailing_calls
from molctl.proxy.pipeline.speculative import Speculation
from molctl.proxy.pipeline.summary import Summaries
from molctl.proxy.pipeline.views import own_view, split_history
from molctl.proxy.pipeline.window import prompt_token_bound
from molctl.proxy.scheduler_hints import SchedulerHints
from molctl.proxy.store.base import ConversationStore
from molctl.proxy.tool_arguments import repair_history
from molctl.routes import ROUTES

log = logging.getLogger("molctl.proxy")

BIG_MESSAGES = 2000  # above this many messages, per-message work runs in a worker thread
FAILED_FINISH = ("abort", "error")
# what the answer hop passes to the engine as the client sent it: an engine 400 may name these
CLIENT_PARAMS = frozenset({*PASSTHROUGH, "tools"})


def sent_params(body: dict[str, Any], extensions: Iterable[str] = ()) -> frozenset[str]:
    """The CLIENT_PARAMS (and engine extensions) this request sent: the answer hop also carries
    the profile's proxy.sampling_defaults, which the proxy built (an engine 400 on one names no
    client param)."""
    return frozenset(k for k in (*CLIENT_PARAMS, *extensions) if body.get(k) is not None)


T = TypeVar("T")


def context_window(profile: Profile, engine: Engine) -> int | None:
    """The most prompt + max_tokens the engine takes, from its window flag in the profile's launch
    flags less the engine's margin (`Engine.window_flag`); `k`/`m` (x1000) and `K`/`M` (x1024)
    suffixes are understood, as vLLM reads them."""
    flag, margin = engine.window_flag
    value = profile.engine.args.get(flag)
    if isinstance(value, int) and not isinstance(value, bool):
        return value - margin
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", value)
        if m:
            scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[m.group(2)]
            return int(float(m.group(1)) * scale) - margin
    return None


# GLM-5.2 knows two thinking levels, `high` and `max` (its default): low and medium fold into
# high, xhigh and max are max (Z.ai's GLM-5.2 migration notes; OpenRouter: "xhigh maps to max
# reasoning"); none/minimal switch thinking off. Sending `low` as it was would not be "less than
# high" on a template that reads anything but `high` as `max`.
GLM_EFFORT = {
    "none": "none",
    "minimal": "none",
    "low": "high",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}


def answer_call(plan: Plan) -> dict[str, Any]:
    """The engine client's arguments of the request's answer hop, whole or streamed."""
    return {"big": plan.big, "request_id": plan.request_id, "engine": plan.engine, "source": plan.decision.source}


class Orchestrator:
    def __init__(
        self,
        profile: Profile,
        engine: Engine,
        client: EngineClient,
        store: ConversationStore,
        counters: Counters | None = None,
        summary_concurrency: int | None = None,
        summary_timeout_s: float = 120.0,
        admission: Admission | None = None,
    ):
        self.profile = profile
        self.engine = engine
        self.client = client
        self.hints = SchedulerHints.of(profile)
        self.store = store
        self.counters = counters or Counters()
        self.fields = FieldPolicy.of(profile, engine, self.counters)
        self.public = profile.served_model_name
        self.identity = profile.substitute(profile.prompts.identity).strip()
        self.adapter_models = {r: engine.adapter_model(profile, r) for r in ROUTES}
        self.engine_names = [*self.adapter_models.values(), *ROUTES, profile.engine.served_name]
        self.window = context_window(profile, engine)
        self.admission = admission or Admission.from_profile(profile, engine)
        self.priority = PriorityPolicy(profile, engine, client, self.counters)
        self.speculation = Speculation(
            profile.proxy.speculative_answer, engine, client, self.counters, self.admission.answers
        )
        self.summaries = Summaries(
            profile,
            engine,
            client,
            store,
            self.counters,
            self.fields,
            self.priority,
            self.window,
            summary_concurrency or profile.proxy.summary_inflight,
            summary_timeout_s,
        )
        self.background = self.summaries.background  # the summary hops running or queued
        self.window_fit = self.summaries.window_fit  # every chat hop's max_tokens within the window
        self.router = Router(
            profile, engine, client, store, self.counters, self.admission, self.priority, self.window_fit
        )

    # ---------------------------------------------------------------- validation
    def check(self, body: Any) -> None:
        """A chat body against everything that does not need the store (`apis.chat_validation`):
        the chat API's edge. A Responses body is checked at its own edge and translated into a
        valid chat body, so it is not checked again."""
        check_request(body, self.public, self.profile.proxy.media_url_hosts, self.fields)

    def prepare(self, body: dict[str, Any], tenant: str) -> Plan:
        """The plan of a checked chat body: the conversation's earlier turns found. Linear in the
        number of messages; thread-safe with the store, so an API may run it off the loop."""
        messages = body["messages"]
        keys = ConversationKeys(tenant, messages)
        history = split_history(messages, keys.at, self.store.get_turn, self.store.get_turns)
        # the conversation's keys are the client's own messages; every hop gets them repaired
        messages, repaired = repair_history(messages)
        if repaired:
            self.counters.inc("tool_arguments_repaired_total", len(repaired))
        opts = body.get("stream_options") or {}
        return Plan(
            body=body,
            messages=messages,
            tenant=tenant,
            stream=bool(body.get("stream")),
            include_usage=bool(opts.get("include_usage")),
            keys=keys,
            history=history,
            big=len(messages) > BIG_MESSAGES,
            scope=self.store.open_scope(),
            repaired=repaired,
        )

    async def load(self, plan: Plan) -> None:
        """A shared store (Redis: proxy replicas) is read here, once per request after `prepare`,
        and the engine of the request's hops is chosen (conversation affinity: the replica whose
        engine served the conversation last, when its heartbeat is fresh). Nothing for local stores.
        With a scheduler in front (`proxy.scheduler_objectives`) the hops go to the own upstream
        with its headers (`scheduler_hints`) and no replica's engine is chosen here."""
        if self.hints is not None:
            plan.engine = self.hints.choice(plan.tenant, plan.messages, self.client.base_url)
        if not self.store.shared:
            return
        calls = [(plan.tenant, str(c.get("id"))) for c in trailing_calls(plan.messages)]
        if await self.store.load(list(plan.keys.at.values()), calls, plan.scope):
            plan.history = await self._offload(
                plan,
                split_history,
                plan.messages,
                plan.keys.at,
                self.store.get_turn,
                self.store.get_turns,
            )
        if self.hints is not None:
            return
        owner = None
        bound = [self.store.get_call(t, c) for t, c in calls]
        if bound and bound[0] is not None:
            owner = bound[0].replica
        elif plan.history.last_record() is not None:
            owner = plan.history.last_record().replica
        plan.engine = await self.store.choose_engine(owner, plan.scope)

    async def persisted(self, plan: Plan) -> None:
        """A shared store's writes of this request are done (bounded): the next turn may reach another replica."""
        await self.store.flush(plan.scope)

    async def _offload(self, plan: Plan, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args) if plan.big else fn(*args)

    # ---------------------------------------------------------------- entry points
    async def answer(self, plan: Plan, persist: bool = True) -> dict[str, Any]:
        """Route, then the whole answer (`complete`): the chat completion the client gets."""
        await self.route(plan)
        try:
            return await self.complete(plan, persist)
        finally:
            await self._close_held(plan)

    async def chunks(self, plan: Plan, persist: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Route, then the streamed answer (`stream`); closing this generator closes the engine
        request now, not at garbage collection."""
        await self.route(plan)
        answer = self.stream(plan, persist)
        try:
            async for chunk in answer:
                yield chunk
        finally:
            await answer.aclose()
            await self._close_held(plan)

    async def _close_held(self, plan: Plan) -> None:
        """A held speculative answer is never left running past its request (a no-op once read whole)."""
        if plan.speculation.answer is not None:
            await plan.speculation.answer.cancel()

    async def route(self, plan: Plan) -> None:
        """The route sequence, in order: sticky -> admit -> speculate -> classify -> settle.

        1. sticky: tool results answering a stored response's calls continue on its adapter (no
           answer slot needed: `Router.stick`);
        2. admit: the request's answer slot is taken (`_admit`) before any hop, so the route hop
           runs only when the engine has room for this request's answer, never queued inside the
           engine behind `max-num-seqs` running answers (it would pass `route_timeout_s` and fall
           back to the wrong adapter); the engine sees at most `proxy.max_inflight` route and
           answer hops together, plus `summary_inflight` summaries. The slot is released once the
           answer hop ends (`release_answer_slot`) and given back while the request waits for
           another adapter's summary (`_await_summaries`). Then tool results bound to one
           adapter's calls in the store continue on it (`Router.stick`);
        3. speculate: the answer on the conversation's adapter starts, held (`speculative`);
        4. classify: the route hop decides the adapter (`Router.classify`);
        5. settle: the held answer is kept on a hit, closed on a miss (`Speculation.settle`);
           closed with the request if it ends first (`discard`)."""
        self._log_repaired(plan)
        try:
            if not (plan.responses.previous is not None and self.router.stick(plan, stored_chain=True)):
                await self._admit(plan)
                if not self._tool_turn_stuck(plan):
                    self._speculate(plan)
                    await self.router.classify(plan)
        except BaseException:
            await self.speculation.discard(plan)
            raise
        await self.speculation.settle(plan)

    def _tool_turn_stuck(self, plan: Plan) -> bool:
        if plan.messages[-1]["role"] != "tool":
            return False
        if self.router.stick(plan, stored_chain=False):
            return True
        self.counters.inc("unplaced_tool_turns_total")
        return False

    def _log_repaired(self, plan: Plan) -> None:
        if plan.repaired:
            log.warning(
                "request %s: tool-call arguments that are not a JSON object replaced by {} in message%s %s "
                "(as vLLM 0.32 does; counted in tool_arguments_repaired_total)",
                plan.request_id,
                "s" if len(plan.repaired) > 1 else "",
                ", ".join(map(str, plan.repaired)),
            )

    def _speculate(self, plan: Plan) -> None:
        self.speculation.start(plan, lambda adapter: self._speculative_fitted(plan, adapter))

    async def _speculative_fitted(self, plan: Plan, adapter: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        view, payload = await self._offload(plan, self._speculative_request, plan, adapter)
        await self.window_fit.fit(payload, "answer", plan.engine)
        return view, payload

    def _speculative_request(self, plan: Plan, adapter: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The answer hop's view and request on `adapter`, exactly as `_build_answer` makes them
        once the route says `adapter` (a copy of the plan: the route is not decided yet)."""
        draft = copy.copy(plan)
        draft.route = adapter
        payload = self._build_answer(draft)
        return draft.view, payload

    # ---------------------------------------------------------------- answer
    async def _admit(self, plan: Plan) -> None:
        """Take the request's answer slot unless it holds it (`release_answer_slot` frees it; the
        app's request wrapper does too, whatever happened); a refusal is the client's 429. The wait
        is kept on the plan (its log line) also when refused or abandoned while queued."""
        if plan.slot.held:
            return
        queued_at = time.monotonic()
        plan.slot.queued = True
        try:
            waited = await self.admission.answers.acquire(plan.tenant)
            plan.slot.held = True
            self.speculation.make_room()  # a held hop that counted on this slot is closed
        except Rejected as exc:
            plan.slot.wait_s += time.monotonic() - queued_at
            self.counters.inc("admission_rejections_total", reason=exc.reason)
            raise overloaded(exc) from None
        except asyncio.CancelledError:  # the client went away while queued
            plan.slot.wait_s += time.monotonic() - queued_at
            raise
        finally:
            plan.slot.queued = False
        plan.slot.wait_s += waited  # a request that gave its slot back for a summary waits twice
        self.counters.observe("queue_wait_seconds", waited)

    def release_answer_slot(self, plan: Plan) -> None:
        """Free the request's answer slot if it holds one (idempotent)."""
        if plan.slot.held:
            plan.slot.held = False
            self.admission.answers.release()

    def _engine_error(self, exc: Exception, plan: Plan) -> None:
        """Count an answer hop's engine failure and log it once with the request id: the request's
        own log line has only its status and error code, not what the engine said. A client 400
        (the engine refusing the request) is the client's business: counted, not logged."""
        status = exc.status if isinstance(exc, EngineHTTPError) else None
        self.counters.inc("engine_errors_total", status=str(status) if status is not None else "unreachable")
        if status is None or status >= 500 or getattr(exc, "in_stream", False):
            why = exc.one_line(300) if isinstance(exc, EngineHTTPError) else " ".join(str(exc).split())[:300]
            log.warning(
                "request %s: answer hop on %s failed: %s%s",
                plan.request_id,
                plan.route,
                f"HTTP {status}: " if status is not None else "",
                why or type(exc).__name__,
            )

    def _answered(self, plan: Plan, start: float) -> None:
        plan.timings["answer_s"] = elapsed = time.monotonic() - start
        self.counters.observe("hop_seconds", elapsed, hop="answer", adapter=plan.route or "none")

    async def _await_summaries(self, plan: Plan) -> None:
        """Wait (bounded) for pending summaries of turns this adapter will see folded; those still
        missing afterwards are folded without a summary, and stay so (marked stale)."""
        pending = [
            s.record
            for s in plan.history.segments
            if s.record is not None and s.record.route != plan.route and not s.record.finished
        ]
        if pending:
            # the slot goes back meanwhile (the answer hop's `_admit` takes one again): a request
            # that waits up to summary_wait_s for another adapter's summary must not keep an
            # answer slot idle while other requests queue for it. Until it has one again it counts
            # as queued: a stream sends no 200 or keep-alive, so a refusal then is a real 429.
            if plan.slot.held:
                self.release_answer_slot(plan)
                plan.slot.queued = True
            waits = [asyncio.ensure_future(r.done.wait()) for r in pending]
            try:  # asyncio.wait, not wait_for(gather): a client gone meanwhile left an unretrieved gather error logged
                await asyncio.wait(waits, timeout=self.profile.proxy.summary_wait_s)
            finally:
                for wait in waits:
                    wait.cancel()
            for record in pending:
                if not record.finished:
                    self.store.mark_stale(record, plan.scope)  # a durable store persists it

    def answer_payload(self, plan: Plan) -> dict[str, Any]:
        """The answer hop's request; `plan.view` must be set (`own_view`)."""
        body = plan.body
        payload: dict[str, Any] = dict(self.profile.proxy.sampling_defaults)
        payload.update({k: body[k] for k in PASSTHROUGH if body.get(k) is not None})
        payload.update(self.fields.forwarded(body))
        if body.get("tools"):
            payload["tools"] = body["tools"]
        elif payload.get("tool_choice") in ("auto", "none"):  # no tools: the same answer; vLLM would refuse it
            del payload["tool_choice"]
        limit = self.profile.proxy.max_output_tokens
        # as vLLM reads them (ChatCompletionRequest.build_tok_params): max_completion_tokens first
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        # ignore_eos / min_tokens (engine extensions) keep the model from ending the answer itself:
        # without a limit it would fill the engine's window, past the operator's proxy.max_output_tokens
        forced = body.get("ignore_eos") is True or bool(body.get("min_tokens"))
        if asked:
            payload["max_tokens"] = min(asked, limit)
        elif forced or (
            self.window is not None and prompt_token_bound(plan.view, body.get("tools")) + limit <= self.window
        ):
            payload["max_tokens"] = limit
        # else: no max_tokens; the engine fills the room actually left in its window
        least = body.get("min_tokens")
        if isinstance(least, int) and least > payload.get("max_tokens", least):
            raise invalid(
                f"'min_tokens' ({least}) must be at most the answer's token limit, {payload['max_tokens']} "
                "(max_tokens, at most this server's proxy.max_output_tokens).",
                "min_tokens",
            )
        kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort")
        style = self.profile.proxy.reasoning
        if effort is not None and style != "none":
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
            if style == "glm":
                payload["reasoning_effort"] = GLM_EFFORT[effort]
        if kwargs:
            payload["chat_template_kwargs"] = kwargs
        payload["model"] = self.adapter_models[plan.route]
        payload["messages"] = plan.view
        payload["stream"] = plan.stream
        # the prompt's and answer's token ids, for the summary hop's continuation (never shown to
        # the client: `shaping` keeps only standard fields)
        payload.update(self.engine.answer_token_fields(plan.stream))
        self.priority.mark(payload, "answer", plan.engine)
        if plan.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    def _build_answer(self, plan: Plan) -> dict[str, Any]:
        plan.view = own_view(self.profile, self.identity, plan.messages, plan.history, plan.route)
        return self.answer_payload(plan)

    async def _payload(self, plan: Plan) -> dict[str, Any] | None:
        """The answer hop's request, or None: the held speculative hop is the answer (a hit; its
        request was this one, built for the same adapter)."""
        held = plan.speculation.answer
        if held is not None:
            await held.ready.wait()
            if held.payload is not None and self._priority_holds(plan, held.payload):
                plan.view = held.view
                return None
            await held.cancel()
            plan.speculation.answer = (
                None  # its build refused the request (the routed build says why), or its priority is stale
            )
        await self._await_summaries(plan)
        payload = await self._offload(plan, self._build_answer, plan)
        await self.window_fit.fit(payload, "answer", plan.engine)
        return payload

    def _priority_holds(self, plan: Plan, payload: dict[str, Any]) -> bool:
        """Whether a held request carries the priority the answer hop would carry now: the route
        hop that ran beside it may have found the engine refusing priorities (`PriorityPolicy`),
        and the held request would then fail where the routed one does not."""
        now: dict[str, Any] = {}
        self.priority.mark(now, "answer", plan.engine)
        return now.get("priority") == payload.get("priority")

    def _overhead(self, plan: Plan, sent: float, engine_first: float | None) -> None:
        """The time the proxy added before the answer's first token (a whole answer: before its
        body): the client's wait so far less the engine's own time for the answer hop."""
        now = time.monotonic()
        plan.timings["overhead_s"] = max(0.0, (now - plan.started) - ((engine_first or now) - sent))

    async def complete(self, plan: Plan, persist: bool = True) -> dict[str, Any]:
        """Non-streaming answer; returns the client body and records the turn. `persist=False`:
        the caller awaits `persisted(plan)` itself (after its own writes: one round trip for both)."""
        payload = await self._payload(plan)
        await self._admit(plan)
        held = plan.speculation.answer
        start = held.sent_at if payload is None else time.monotonic()
        try:
            if payload is None:
                body = checked_completion(await held.result())
            else:
                body = checked_completion(await self.client.chat(payload, "answer", **answer_call(plan)))
            self._overhead(plan, start, held.done_at if payload is None else None)
        except (EngineHTTPError, EngineUnavailable) as exc:
            self._engine_error(exc, plan)
            raise from_engine(
                exc, self.engine_names, self.public, sent_params(plan.body, self.fields.extensions)
            ) from None
        finally:
            self.release_answer_slot(plan)
            self._answered(plan, start)
        plan.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        self.counters.usage("answer", plan.route, plan.usage)
        plan.tokens = held.tokens if payload is None else self.engine.answer_tokens(body)  # a hit's: read once
        shaped = shaping.shape_completion(body, self.public, shaping.new_id())
        if shaped["choices"][0]["finish_reason"] not in FAILED_FINISH:
            self.record(plan, shaped["choices"][0]["message"])
            if persist:
                await self.persisted(plan)
        return shaped

    async def stream(self, plan: Plan, persist: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Streaming answer: yields client chunks (role first, live deltas, final, usage). The
        first chunk comes with the engine's first event, i.e. once the first token exists; an
        engine failure raises ProxyError, before or after the first chunk. `persist=False`: the
        answer is only kept in `plan.answer`; the caller records it (`record`) and awaits
        `persisted(plan)` with its own writes (one round trip for all)."""
        payload = await self._payload(plan)
        said = shaping.StreamedAnswer(shaping.new_id(), int(time.time()), self.public)
        tokens = plan.tokens = AnswerTokens()
        await self._admit(plan)
        held = plan.speculation.answer
        start = held.sent_at if payload is None else time.monotonic()
        upstream = held.events() if payload is None else self.client.chat_stream(payload, "answer", **answer_call(plan))
        try:
            first = True
            async for event in upstream:
                if first:
                    self._overhead(plan, start, held.first_at if payload is None else None)
                    plan.timings["ttft_s"] = time.monotonic() - plan.started  # observed at the end (`finished`)
                    yield said.chunk(shaping.role_delta())
                    first = False
                for chunk in said.feed(event, self.engine, tokens):
                    yield chunk
            if first:
                yield said.chunk(shaping.role_delta())
            if said.finish is None:  # vLLM and SGLang always end a choice with one: the answer may be cut short
                raise EngineHTTPError(502, "the engine's stream ended without a finish_reason", in_stream=True)
        except (EngineHTTPError, EngineUnavailable) as exc:
            self._engine_error(exc, plan)
            raise from_engine(
                exc, self.engine_names, self.public, sent_params(plan.body, self.fields.extensions)
            ) from None
        finally:
            self.release_answer_slot(plan)
            self._answered(plan, start)
            plan.usage = said.usage
            self.counters.usage("answer", plan.route, said.usage)
            await upstream.aclose()
        finish = shaping.finish_reason(said.finish, bool(said.calls))
        if finish not in FAILED_FINISH:
            if persist:
                self.record(plan, said.message())  # before the final frames: the client's next turn may follow at once
                await self.persisted(plan)
            else:
                plan.answer = said.message()
        yield said.chunk({}, finish)
        if plan.include_usage and said.usage:
            yield shaping.usage_chunk(said.rid, self.public, said.created, said.usage)

    # ---------------------------------------------------------------- record + summary
    def record(self, plan: Plan, message: dict[str, Any]) -> None:
        """Remember the turn. A tool-call answer binds its calls; a final answer gets a summary
        hop, to be started with `start_summary` once the client has the whole response."""
        plan.answer = message
        calls = tool_calls_of(message)
        if calls:
            for call in calls:
                fn = call.get("function") or {}
                self.store.put_call(
                    plan.tenant,
                    str(call.get("id")),
                    CallBinding(plan.route, canonical_arguments(fn.get("arguments")), str(fn.get("name"))),
                    plan.scope,
                )
            return
        record = TurnRecord(plan.route)
        plan.record_key = plan.keys.extend(message)
        self.store.put_turn(plan.record_key, record, plan.scope)
        plan.record = record

    def abandon(self, plan: Plan) -> None:
        """The client did not get the whole answer: no summary for it (and nobody waits for one)."""
        if plan.record is not None:
            plan.record.set_summary(None)
            plan.record = None

    def start_summary(self, plan: Plan) -> None:
        """Called once the client has the complete response (body sent, or after [DONE]): the
        turn's summary hop (`summary.Summaries.start`)."""
        self.summaries.start(plan)
