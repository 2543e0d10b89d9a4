"""One chat request: validate -> (tool stickiness | route hop) -> answer hop -> record the turn ->
summary hop in the background. The HTTP layer (`app`) only parses, writes and watches the client.

Defaults and choices, where the issue leaves room:
- `n` other than 1, legacy `functions`, audio/prediction/web-search options and unknown
  parameters are rejected with 400 (never silently dropped); `store`, `metadata`,
  `service_tier` are accepted and ignored (they do not change the answer).
- No temperature or thinking default is imposed; a profile may set `proxy.sampling_defaults`.
- `max_tokens` (or `max_completion_tokens`) is clamped to `proxy.max_output_tokens`, which is
  also sent when the client gives none.
- Reasoning controls per profile (`proxy.reasoning`): `glm`/`qwen` map `reasoning_effort`
  none|minimal to `chat_template_kwargs.enable_thinking=false` and any other effort to `true`;
  `none` drops `reasoning_effort`. Client `chat_template_kwargs` are passed through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from molctl.engines.base import Engine
from molctl.profiles import ROUTES, Profile, route_instruction
from molctl.proxy import shaping
from molctl.proxy.conversations import (CallBinding, ConversationStore, TurnRecord, canonical_arguments, extend_key,
                                        prefix_keys, text_of, tool_calls_of)
from molctl.proxy.engine_client import EngineClient
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable, ProxyError, from_engine, invalid
from molctl.proxy.views import History, last_user_text, own_view, parse_label, route_messages, split_history, summary_messages

log = logging.getLogger("molctl.proxy")

PASSTHROUGH = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "logprobs",
               "top_logprobs", "response_format", "tool_choice", "parallel_tool_calls", "logit_bias", "user",
               "top_k", "min_p", "repetition_penalty")
ACCEPTED_IGNORED = ("store", "metadata", "service_tier")
REJECTED = {"functions": "use 'tools' instead of the legacy 'functions'",
            "function_call": "use 'tool_choice' instead of the legacy 'function_call'",
            "audio": "audio output is not supported", "modalities": "only text output is supported",
            "prediction": "predicted outputs are not supported",
            "web_search_options": "web search is not supported"}
KNOWN = {"model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
         "reasoning_effort", "chat_template_kwargs", "tools", *PASSTHROUGH, *ACCEPTED_IGNORED, *REJECTED}
ROLES = ("system", "developer", "user", "assistant", "tool")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass
class Counters:
    """Plain counters (exported on /metrics)."""

    values: dict[str, int] = field(default_factory=lambda: {
        "requests_total": 0, "route_hops_total": 0, "route_fallbacks_total": 0, "sticky_tool_turns_total": 0,
        "unplaced_tool_turns_total": 0, "summaries_total": 0, "summary_retries_total": 0,
        "summary_failures_total": 0, "engine_errors_total": 0, "client_disconnects_total": 0,
    })

    def inc(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


@dataclass
class Plan:
    """Everything decided about one request."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tenant: str
    stream: bool
    include_usage: bool
    keys: list[bytes]
    history: History
    route: str | None = None
    view: list[dict[str, Any]] = field(default_factory=list)
    answer: dict[str, Any] | None = None
    record: TurnRecord | None = None  # set for a final answer; its summary hop is still to run


class Orchestrator:
    def __init__(self, profile: Profile, engine: Engine, client: EngineClient, store: ConversationStore,
                 counters: Counters | None = None, summary_concurrency: int = 4, summary_timeout_s: float = 120.0):
        self.profile = profile
        self.engine = engine
        self.client = client
        self.store = store
        self.counters = counters or Counters()
        self.public = profile.served_model_name
        self.identity = profile.substitute(profile.prompts.identity).strip()
        self.route_instruction = route_instruction(profile)
        self.summary_instruction = profile.substitute(profile.prompts.summary).strip()
        self.adapter_models = {r: engine.adapter_model(profile, r) for r in ROUTES}
        self.engine_names = [*self.adapter_models.values(), *ROUTES, profile.engine.served_name]
        self._summary_slots = asyncio.Semaphore(summary_concurrency)
        self.summary_timeout_s = summary_timeout_s
        self.background: set[asyncio.Task] = set()

    # ---------------------------------------------------------------- validation
    def prepare(self, body: Any, tenant: str) -> Plan:
        if not isinstance(body, dict):
            raise invalid("The request body must be a JSON object.")
        model = body.get("model")
        if model is None:
            raise invalid("'model' is required.", "model")
        if model != self.public:
            raise ProxyError(404, f"The requested model does not exist; this endpoint serves '{self.public}'.",
                             "invalid_request_error", "model_not_found", "model")
        for key in body:
            if key in REJECTED:
                raise invalid(f"'{key}' is not supported: {REJECTED[key]}.", key)
            if key not in KNOWN:
                raise invalid(f"Unrecognized request argument supplied: {key}", key)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a non-empty array.", "messages")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES:
                raise invalid(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}.", f"messages[{i}]")
        if messages[-1]["role"] not in ("user", "tool"):
            raise invalid(f"The last message must be from the user or a tool, not '{messages[-1]['role']}'.", "messages")
        n = body.get("n")
        if n is not None and n != 1:
            raise invalid("Only n=1 is supported.", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise invalid("'stream' must be a boolean.", "stream")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise invalid("'stream_options' must be an object and requires stream=true.", "stream_options")
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise invalid(f"'{key}' must be a positive integer.", key)
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise invalid(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}.", "reasoning_effort")
        if body.get("chat_template_kwargs") is not None and not isinstance(body["chat_template_kwargs"], dict):
            raise invalid("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list) or not all(
                    isinstance(t, dict) and t.get("type") == "function" and isinstance((t.get("function") or {}).get("name"), str)
                    for t in tools):
                raise invalid("'tools' must be an array of function tools with a name.", "tools")
        keys = prefix_keys(tenant, messages)
        history = split_history(messages, keys, self.store.get_turn)
        return Plan(body=body, messages=messages, tenant=tenant, stream=stream,
                    include_usage=bool((opts or {}).get("include_usage")), keys=keys, history=history)

    # ---------------------------------------------------------------- route
    def _sticky_route(self, plan: Plan) -> str | None:
        """A trailing run of tool results continues on the adapter that issued the calls."""
        msgs = plan.messages
        i = len(msgs)
        while i > 0 and msgs[i - 1].get("role") == "tool":
            i -= 1
        if i == len(msgs) or i == 0:
            return None
        calls = tool_calls_of(msgs[i - 1])
        if msgs[i - 1].get("role") != "assistant" or not calls:
            return None
        routes = set()
        for call in calls:
            binding = self.store.get_call(plan.tenant, str(call.get("id")))
            fn = call.get("function") or {}
            if binding is None or binding.name != fn.get("name") or binding.arguments != canonical_arguments(fn.get("arguments")):
                return None
            routes.add(binding.route)
        return routes.pop() if len(routes) == 1 else None

    async def route(self, plan: Plan) -> None:
        if plan.messages[-1]["role"] == "tool":
            sticky = self._sticky_route(plan)
            if sticky is not None:
                plan.route = sticky
                self.counters.inc("sticky_tool_turns_total")
                return
            self.counters.inc("unplaced_tool_turns_total")
        previous = plan.history.last_record()
        payload: dict[str, Any] = {
            "model": self.adapter_models["L0"],
            "messages": route_messages(self.route_instruction, last_user_text(plan.messages), previous),
            "max_tokens": self.profile.proxy.route_max_tokens,
            "temperature": 0,
            "stream": False,
            **self.engine.guided_choice(list(ROUTES)),
        }
        if self.profile.proxy.reasoning != "none":
            payload["chat_template_kwargs"] = {"enable_thinking": False}
        self.counters.inc("route_hops_total")
        label = None
        try:
            body = await self.client.chat(payload, "route")
            label = parse_label(((body.get("choices") or [{}])[0]).get("message") or {})
        except (EngineHTTPError, EngineUnavailable) as exc:
            log.warning("route hop failed: %s", exc)
        if label is None:
            self.counters.inc("route_fallbacks_total")
            label = previous.route if previous is not None else self.profile.proxy.default_route
        plan.route = label

    # ---------------------------------------------------------------- answer
    async def _await_summaries(self, plan: Plan) -> None:
        """Wait (bounded) for pending summaries of turns this adapter will see folded."""
        pending = [s.record.done.wait() for s in plan.history.segments
                   if s.record is not None and s.record.route != plan.route and not s.record.done.is_set()]
        if pending:
            try:
                await asyncio.wait_for(asyncio.gather(*pending), self.profile.proxy.summary_wait_s)
            except asyncio.TimeoutError:
                pass

    def answer_payload(self, plan: Plan) -> dict[str, Any]:
        body = plan.body
        payload: dict[str, Any] = dict(self.profile.proxy.sampling_defaults)
        payload.update({k: body[k] for k in PASSTHROUGH if body.get(k) is not None})
        if body.get("tools"):
            payload["tools"] = body["tools"]
        limit = self.profile.proxy.max_output_tokens
        asked = body.get("max_tokens") or body.get("max_completion_tokens") or limit
        payload["max_tokens"] = min(asked, limit)
        kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort")
        style = self.profile.proxy.reasoning
        if effort is not None and style != "none":
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
            if style == "glm":
                payload["reasoning_effort"] = "none" if effort in ("none", "minimal") else ("high" if effort in ("xhigh", "max") else effort)
        if kwargs:
            payload["chat_template_kwargs"] = kwargs
        payload["model"] = self.adapter_models[plan.route]
        payload["messages"] = plan.view
        payload["stream"] = plan.stream
        if plan.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    async def complete(self, plan: Plan) -> dict[str, Any]:
        """Non-streaming answer; returns the client body and records the turn."""
        await self._await_summaries(plan)
        plan.view = own_view(self.profile, self.identity, plan.messages, plan.history, plan.route)
        try:
            body = await self.client.chat(self.answer_payload(plan), "answer")
        except (EngineHTTPError, EngineUnavailable) as exc:
            self.counters.inc("engine_errors_total")
            raise from_engine(exc, self.engine_names, self.public) from None
        shaped = shaping.shape_completion(body, self.public, shaping.new_id())
        self.record(plan, shaped["choices"][0]["message"])
        return shaped

    async def stream(self, plan: Plan) -> AsyncIterator[dict[str, Any]]:
        """Streaming answer: yields client chunks (role first, live deltas, final, usage)."""
        await self._await_summaries(plan)
        plan.view = own_view(self.profile, self.identity, plan.messages, plan.history, plan.route)
        rid, created = shaping.new_id(), int(time.time())
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        usage = None
        upstream = self.client.chat_stream(self.answer_payload(plan), "answer")
        try:
            first = True
            async for event in upstream:
                if first:
                    yield shaping.chunk(rid, self.public, created, {"role": "assistant", "content": ""})
                    first = False
                if event.get("usage"):
                    usage = shaping.shape_usage(event["usage"])
                for choice in event.get("choices") or []:
                    delta = shaping.shape_delta(choice.get("delta") or {})
                    if isinstance(delta.get("content"), str):
                        content.append(delta["content"])
                    for call in delta.get("tool_calls", ()):
                        acc = calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                        acc["id"] = call.get("id") or acc["id"]
                        fn = call.get("function") or {}
                        acc["name"] += fn.get("name") or ""
                        acc["arguments"] += fn.get("arguments") or ""
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    if delta:
                        yield shaping.chunk(rid, self.public, created, delta, logprobs=choice.get("logprobs"))
            if first:
                yield shaping.chunk(rid, self.public, created, {"role": "assistant", "content": ""})
        except (EngineHTTPError, EngineUnavailable) as exc:
            self.counters.inc("engine_errors_total")
            raise from_engine(exc, self.engine_names, self.public) from None
        finally:
            await upstream.aclose()
        if calls and finish not in ("length", "content_filter"):
            finish = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for _, c in sorted(calls.items())]
        self.record(plan, message)  # before the final frames: the client's next turn may follow at once
        yield shaping.chunk(rid, self.public, created, {}, finish if finish in shaping.FINISH_REASONS else "stop")
        if plan.include_usage and usage:
            yield shaping.usage_chunk(rid, self.public, created, usage)

    # ---------------------------------------------------------------- state + summary
    def record(self, plan: Plan, message: dict[str, Any]) -> None:
        """Remember the turn. A tool-call answer binds its calls; a final answer gets a summary
        hop, to be started with `start_summary` once the client has the whole response."""
        plan.answer = message
        calls = tool_calls_of(message)
        if calls:
            for call in calls:
                fn = call.get("function") or {}
                self.store.put_call(plan.tenant, str(call.get("id")),
                                    CallBinding(plan.route, canonical_arguments(fn.get("arguments")), str(fn.get("name"))))
            return
        record = TurnRecord(plan.route)
        self.store.put_turn(extend_key(plan.tenant, plan.messages, message), record)
        plan.record = record

    def start_summary(self, plan: Plan) -> None:
        """Called once the client has the complete response (body sent, or after [DONE])."""
        if plan.record is None:
            return
        task = asyncio.get_running_loop().create_task(self._summarise(plan, plan.record))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _summarise(self, plan: Plan, record: TurnRecord) -> None:
        answer = {"role": "assistant", "content": text_of(plan.answer.get("content"))}
        payload: dict[str, Any] = {
            "model": self.adapter_models[plan.route],
            "messages": summary_messages(plan.view, answer, self.summary_instruction),
            "max_tokens": self.profile.proxy.summary_max_tokens,
            "temperature": 0,
            "stream": False,
        }
        if self.profile.proxy.reasoning != "none":
            payload["chat_template_kwargs"] = {"enable_thinking": False}
        async with self._summary_slots:
            for attempt in range(2):
                try:
                    body = await self.client.chat(payload, "summary", timeout=self.summary_timeout_s)
                    msg = ((body.get("choices") or [{}])[0]).get("message") or {}
                    text = (msg.get("content") or "").strip() or (msg.get("reasoning_content") or msg.get("reasoning") or "").strip()[:160]
                    self.counters.inc("summaries_total")
                    record.set_summary(text)
                    return
                except (EngineHTTPError, EngineUnavailable) as exc:
                    log.warning("summary hop failed (attempt %d): %s", attempt + 1, exc)
                    if attempt == 0:
                        self.counters.inc("summary_retries_total")
            self.counters.inc("summary_failures_total")
            record.set_summary(None)
