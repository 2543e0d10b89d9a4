"""One chat request: validate -> (tool stickiness | route hop) -> answer hop -> record the turn ->
summary hop in the background. The HTTP layer (`app`) only parses, writes and watches the client;
request validation lives in `validation`.

Defaults and choices, where the issue leaves room:
- Output limit: a client `max_tokens` (or `max_completion_tokens`) is clamped to
  `proxy.max_output_tokens`. With no client limit the proxy does not know the prompt's exact
  token count, so it bounds it from above: the answer hop's messages and tools as ASCII-escaped
  JSON (every token of a byte-level tokenizer covers at least one byte, and the JSON framing
  of each message outweighs the template's markup) plus 64. When that bound plus
  `proxy.max_output_tokens` fits the engine window (`engine.args.max-model-len`, SGLang
  `context-length`), `max_output_tokens` is sent; otherwise no `max_tokens` at all, and the
  engine uses the room actually left (vLLM: max-model-len - prompt tokens, see
  vllm/entrypoints/serve/utils/api_utils.py get_max_tokens). So a request that fits the window
  never fails for the limit the proxy added, and no limit above the window is ever sent.
- No temperature or thinking default is imposed; a profile may set `proxy.sampling_defaults`.
- Reasoning controls per profile (`proxy.reasoning`): `glm`/`qwen` map `reasoning_effort`
  none|minimal to `chat_template_kwargs.enable_thinking=false` and any other effort to `true`;
  `glm` also sends GLM-5.2's own level (`GLM_EFFORT`); `none` drops `reasoning_effort`. Client
  `chat_template_kwargs` are passed through.
- Route hop: its own deadline `proxy.route_timeout_s`; on timeout, an engine error or an
  unparseable label the fallback is the previous turn's route, else `proxy.default_route`
  (counted in `route_fallbacks_total`, timeouts also in `route_timeouts_total`). It sees the
  last user message only, as text of at most `proxy.route_max_input_chars` (`views.route_input`),
  and may generate only as many tokens as the longest label has characters (guided decoding
  makes the label the whole output).
- Failed answers (an engine error, in a stream or not; finish reason `abort` or `error`) are
  neither recorded nor summarised; `abort`/`error` finish reasons reach the client as they are.
- Summaries run in the background, at most `proxy.summary_inflight` at once; at most
  `proxy.summary_queue_max` wait for a slot (more are dropped: `summaries_dropped_total`). A
  summary that can no longer help is dropped when its turn comes (`summaries_stale_total`): it
  waited longer than `proxy.summary_wait_s`, or a later turn already folded its turn without
  it (filling it in afterwards would only change that adapter's prompt prefix).
- Large requests (more than BIG_MESSAGES messages) do their per-message work (keys, views,
  payload encoding) in a worker thread, so one 8 MiB body does not stall other requests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from array import array
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from molctl.engines.base import AnswerTokens, Engine, continuation_ids
from molctl.profiles import ROUTES, Profile, route_instruction
from molctl.proxy import fastjson, shaping
from molctl.proxy.admission import Admission, Rejected
from molctl.proxy.conversations import (
    CallBinding,
    ConversationKeys,
    TurnRecord,
    canonical_arguments,
    text_of,
    tool_calls_of,
)
from molctl.proxy.engine_client import CHAT_PATH, ENGINE, EngineClient, checked_completion
from molctl.proxy.errors import EngineHTTPError, EngineUnavailable, from_engine, invalid, overloaded
from molctl.proxy.request_fields import FieldPolicy
from molctl.proxy.store.base import ConversationStore, StoreScope
from molctl.proxy.validation import PASSTHROUGH, check_request
from molctl.proxy.views import (
    PROBE_ANSWER,
    PROBE_USER,
    History,
    own_view,
    parse_label,
    route_input,
    route_messages,
    split_history,
    suffix_after,
    summary_messages,
)

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


@dataclass
class Counters:
    """Plain counters; `inc` with labels (a small fixed set of values each) also counts the
    labelled series. Exported by molctl.proxy.metrics (its ProxyMetrics adds the histograms
    `observe` feeds; here it is a no-op)."""

    values: dict[str, int] = field(
        default_factory=lambda: {
            "requests_total": 0,
            "route_hops_total": 0,
            "route_fallbacks_total": 0,
            "route_timeouts_total": 0,
            "route_priority_refusals_total": 0,
            "sticky_tool_turns_total": 0,
            "unplaced_tool_turns_total": 0,
            "summaries_total": 0,
            "summary_retries_total": 0,
            "summary_failures_total": 0,
            "summaries_dropped_total": 0,
            "summaries_stale_total": 0,
            "engine_errors_total": 0,
            "client_disconnects_total": 0,
            "stream_write_timeouts_total": 0,
            "internal_errors_total": 0,
            "ignored_request_fields_total": 0,
            "summary_continuations_total": 0,
            "summary_chat_fallbacks_total": 0,
            "summary_window_skips_total": 0,
            "summary_prompt_tokens_total": 0,
            "summary_cached_tokens_total": 0,
        }
    )

    labelled: dict[tuple[str, tuple[tuple[str, str], ...]], int] = field(default_factory=dict)

    def inc(self, name: str, n: int = 1, **labels: str) -> None:
        self.values[name] = self.values.get(name, 0) + n
        if labels:
            key = (name, tuple(sorted(labels.items())))
            self.labelled[key] = self.labelled.get(key, 0) + n

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """A latency sample (hop_seconds, ttft_seconds, queue_wait_seconds); see ProxyMetrics."""


@dataclass
class Plan:
    """Everything decided about one request."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tenant: str
    stream: bool
    include_usage: bool
    keys: ConversationKeys
    history: History
    big: bool = False
    route: str | None = None
    view: list[dict[str, Any]] = field(default_factory=list)
    answer: dict[str, Any] | None = None
    record: TurnRecord | None = None  # set for a final answer; its summary hop is still to run
    record_key: bytes | None = None
    queue_wait_s: float = 0.0  # waited for an answer slot (admission)
    queued: bool = False  # waiting for an answer slot now (a stream holds its 200 meanwhile)
    answer_slot: bool = False  # holds an answer slot (taken before the route hop, see `route`)
    # for the request's log line and metrics
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)  # route_s, answer_s, ttft_s
    fallback: str | None = None  # why the route hop's label was not used
    sticky: bool = False
    usage: dict[str, Any] | None = None
    request_id: str | None = None  # sent to the engine as X-Request-Id
    tokens: AnswerTokens | None = None  # the answer hop's prompt and output token ids, as the engine reported them
    scope: StoreScope | None = None  # the request's state in the store (open_scope)


@dataclass
class SummaryJob:
    """What a summary hop needs once it has a slot: today's chat request (the fallback) and, for
    the token continuation, the answer's token ids and the adapter."""

    chat: dict[str, Any]
    model: str
    route: str
    tokens: AnswerTokens | None
    extra: dict[str, Any]  # answer-hop fields the continuation must repeat to hit its cache (vLLM cache_salt)


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


def prompt_token_bound(messages: list[dict[str, Any]], tools: Any) -> int:
    """An upper bound of the prompt's tokens: the bytes of the messages as JSON (UTF-8 bytes, escapes
    included, >= the text's UTF-8 bytes >= tokens of a byte-level tokenizer; the per-message JSON
    framing outweighs the template's markup). orjson, 1000 messages per call (GIL-friendly steps
    in a worker thread); the standard library's ASCII-escaped text, 40x slower (0.6 ms for a
    260 KiB conversation), was only a looser bound."""
    size = sum(len(fastjson.dumps_bytes(messages[i : i + 1000])) for i in range(0, len(messages), 1000))
    return size + (len(fastjson.dumps_bytes(tools)) if tools else 0) + 64


# How long hops to an engine that refused a priority go without one before it is tried again (an
# engine restarted with the flag gets priorities back without a proxy restart)
PRIORITY_RETRY_S = 600.0


def described(exc: Exception) -> str:
    """An engine failure for the log: an HTTP error with what the engine said."""
    said = exc.one_line() if isinstance(exc, EngineHTTPError) else ""
    return f"{exc}: {said}" if said else str(exc)


def refuses_priority(exc: EngineHTTPError, engine: Engine) -> bool:
    """The engine refused the request for its priority (`Engine.priority_refusals`)."""
    if exc.status not in (400, 503):
        return False
    message = exc.message().lower()
    return any(m in message for m in engine.priority_refusals)


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
        self.store = store
        self.counters = counters or Counters()
        self.fields = FieldPolicy.of(profile, engine, self.counters)
        self.public = profile.served_model_name
        self.identity = profile.substitute(profile.prompts.identity).strip()
        self.route_instruction = route_instruction(profile)
        self.summary_instruction = profile.substitute(profile.prompts.summary).strip()
        self.adapter_models = {r: engine.adapter_model(profile, r) for r in ROUTES}
        self.priorities = engine.hop_priorities(profile)
        self._priority_refused: dict[str, float] = {}  # engine URL -> when it last refused a priority
        self._priority_taken: set[str] = set()  # engine URLs that ran a route hop with its priority
        self._priority_beyond_route = bool(self.priorities.keys() - {"route"})
        self.engine_names = [*self.adapter_models.values(), *ROUTES, profile.engine.served_name]
        self.window = context_window(profile, engine)
        self.route_tokens = min(profile.proxy.route_max_tokens, max(len(r) for r in ROUTES))
        self.admission = admission or Admission.from_profile(profile, engine)
        summary_concurrency = summary_concurrency or profile.proxy.summary_inflight
        self._summary_slots = asyncio.Semaphore(summary_concurrency)
        self._summary_concurrency = summary_concurrency
        self._summary_waiting = 0  # tasks created that do not hold a slot yet
        self._summary_running = 0
        self.summary_timeout_s = summary_timeout_s
        self.background: set[asyncio.Task] = set()
        self._suffixes: dict[str, list[int]] = {}  # adapter model -> the summary suffix (`summary_suffix`)
        self._suffix_failed: dict[str, float] = {}  # adapter model -> when its template probe last failed
        self._suffix_lock = asyncio.Lock()
        self._fallback_said: set[str] = set()

    # ---------------------------------------------------------------- validation
    def prepare(self, body: Any, tenant: str) -> Plan:
        """Validate (see `validation`) and find the conversation's earlier turns. Linear in the
        number of messages; thread-safe with the store, so `app` may run it off the loop."""
        check_request(body, self.public, self.profile.proxy.media_url_hosts, self.fields)
        messages = body["messages"]
        keys = ConversationKeys(tenant, messages)
        history = split_history(messages, keys.at, self.store.get_turn, self.store.get_turns)
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
        )

    async def load(self, plan: Plan) -> None:
        """A shared store (Redis: proxy replicas) is read here, once per request after `prepare`,
        and the engine of the request's hops is chosen (conversation affinity: the replica whose
        engine served the conversation last, when its heartbeat is fresh). Nothing for local stores."""
        if not self.store.shared:
            return
        calls = [(plan.tenant, str(c.get("id"))) for c in self._trailing_calls(plan.messages)]
        if await self.store.load(list(plan.keys.at.values()), calls, plan.scope):
            plan.history = await self._offload(
                plan,
                split_history,
                plan.messages,
                plan.keys.at,
                self.store.get_turn,
                self.store.get_turns,
            )
        owner = None
        bound = [self.store.get_call(t, c) for t, c in calls]
        if bound and bound[0] is not None:
            owner = bound[0].replica
        elif plan.history.last_record() is not None:
            owner = plan.history.last_record().replica
        ENGINE.set(await self.store.choose_engine(owner, plan.scope))

    async def persisted(self, plan: Plan) -> None:
        """A shared store's writes of this request are done (bounded): the next turn may reach another replica."""
        await self.store.flush(plan.scope)

    @staticmethod
    def _trailing_calls(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        i = len(msgs)
        while i > 0 and msgs[i - 1].get("role") == "tool":
            i -= 1
        if i == len(msgs) or i == 0 or msgs[i - 1].get("role") != "assistant":
            return []
        return tool_calls_of(msgs[i - 1])

    async def _offload(self, plan: Plan, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args) if plan.big else fn(*args)

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
            if (
                binding is None
                or binding.name != fn.get("name")
                or binding.arguments != canonical_arguments(fn.get("arguments"))
            ):
                return None
            routes.add(binding.route)
        return routes.pop() if len(routes) == 1 else None

    def route_payload(self, plan: Plan) -> dict[str, Any]:
        previous = plan.history.last_record()
        payload: dict[str, Any] = {
            "model": self.adapter_models["L0"],
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
        self._set_priority(payload, "route")
        return payload

    def _set_priority(self, payload: dict[str, Any], hop: str) -> None:
        """The hop's priority (`Engine.hop_priorities`) unless the engine the hop goes to refused
        one less than PRIORITY_RETRY_S ago. Answers and summaries (SGLang's explicit 0) only to an
        engine that ran a route hop with its priority: only the route hop is sent again without
        one when refused (a tool-result turn has no route hop, a summary no second chance)."""
        priority = self.priorities.get(hop)
        if priority is None:
            return
        if hop != "route" or self._priority_refused:
            url = self.client.target_url()
            if hop != "route" and url not in self._priority_taken:
                return
            refused = self._priority_refused.get(url)
            if refused is not None and time.monotonic() - refused < PRIORITY_RETRY_S:
                return
        payload["priority"] = priority

    async def route(self, plan: Plan) -> None:
        """Decide the adapter. The request's answer slot is taken first (`_admit`): the route hop
        then runs only when the engine has room for this request's answer, never queued inside the
        engine behind `max-num-seqs` running answers (which can last minutes: the hop would pass
        `route_timeout_s` and fall back to the wrong adapter). So the engine sees at most
        `proxy.max_inflight` route and answer hops together, plus `summary_inflight` summaries.
        The slot is released once the answer hop ends (`release_answer_slot`), and given back
        while the request waits for another adapter's summary (`_await_summaries`)."""
        await self._admit(plan)
        if plan.messages[-1]["role"] == "tool":
            sticky = self._sticky_route(plan)
            if sticky is not None:
                plan.route = sticky
                plan.sticky = True
                self.counters.inc("sticky_tool_turns_total")
                return
            self.counters.inc("unplaced_tool_turns_total")
        previous = plan.history.last_record()
        payload = self.route_payload(plan)
        self.counters.inc("route_hops_total")
        label = None
        reason = "bad_label"
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.profile.proxy.route_timeout_s):  # no task per call (wait_for makes one)
                body = await self._route_hop(plan, payload)
            label = parse_label(((body.get("choices") or [{}])[0]).get("message") or {})
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
            plan.fallback = reason
            self.counters.inc("route_fallbacks_total", reason=reason)
            label = previous.route if previous is not None else self.profile.proxy.default_route
        self.counters.inc("route_decisions_total", adapter=label)
        plan.route = label

    async def _route_hop(self, plan: Plan, payload: dict[str, Any]) -> dict[str, Any]:
        async with self.admission.routes.slot(plan.tenant):
            try:
                body = await self.client.chat(payload, "route", request_id=plan.request_id)
                if "priority" in payload and self._priority_beyond_route:
                    self._priority_taken.add(self.client.target_url())
                return checked_completion(body)
            except EngineHTTPError as exc:
                if "priority" not in payload or not refuses_priority(exc, self.engine):
                    raise
                self._priority_refusal(exc)
                payload = {k: v for k, v in payload.items() if k != "priority"}
                return checked_completion(await self.client.chat(payload, "route", request_id=plan.request_id))

    def _priority_refusal(self, exc: EngineHTTPError) -> None:
        """An engine started without the profile's priority scheduling (`molctl proxy PROFILE
        --upstream` in front of another start script, a peer replica's engine) refused a route
        hop's priority: its hops go without one for PRIORITY_RETRY_S, said once per engine."""
        url = self.client.target_url()
        self._priority_taken.discard(url)
        self.counters.inc("route_priority_refusals_total")
        if url not in self._priority_refused:
            flag = self.engine.priority_flag
            log.warning(
                "the engine at %s refuses request priorities (%s): its hops are sent without one, tried "
                "again every %.0f s; start it with the profile's %s, or take %s out of the profile",
                url,
                exc.one_line(),
                PRIORITY_RETRY_S,
                flag,
                flag,
            )
        self._priority_refused[url] = time.monotonic()

    # ---------------------------------------------------------------- answer
    async def _admit(self, plan: Plan) -> None:
        """Take the request's answer slot unless it holds it (`release_answer_slot` frees it; the
        app's request wrapper does too, whatever happened); a refusal is the client's 429. The wait
        is kept on the plan (its log line) also when refused or abandoned while queued."""
        if plan.answer_slot:
            return
        queued_at = time.monotonic()
        plan.queued = True
        try:
            waited = await self.admission.answers.acquire(plan.tenant)
            plan.answer_slot = True
        except Rejected as exc:
            plan.queue_wait_s += time.monotonic() - queued_at
            self.counters.inc("admission_rejections_total", reason=exc.reason)
            raise overloaded(exc) from None
        except asyncio.CancelledError:  # the client went away while queued
            plan.queue_wait_s += time.monotonic() - queued_at
            raise
        finally:
            plan.queued = False
        plan.queue_wait_s += waited  # a request that gave its slot back for a summary waits twice
        self.counters.observe("queue_wait_seconds", waited)

    def release_answer_slot(self, plan: Plan) -> None:
        """Free the request's answer slot if it holds one (idempotent)."""
        if plan.answer_slot:
            plan.answer_slot = False
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
            if plan.answer_slot:
                self.release_answer_slot(plan)
                plan.queued = True
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
        self._set_priority(payload, "answer")
        if plan.stream:
            payload["stream_options"] = {"include_usage": True}
        return payload

    def _build_answer(self, plan: Plan) -> dict[str, Any]:
        plan.view = own_view(self.profile, self.identity, plan.messages, plan.history, plan.route)
        return self.answer_payload(plan)

    async def complete(self, plan: Plan, persist: bool = True) -> dict[str, Any]:
        """Non-streaming answer; returns the client body and records the turn. `persist=False`:
        the caller awaits `persisted()` itself (after its own writes: one round trip for both)."""
        await self._await_summaries(plan)
        payload = await self._offload(plan, self._build_answer, plan)
        await self._admit(plan)
        start = time.monotonic()
        try:
            body = checked_completion(
                await self.client.chat(payload, "answer", big=plan.big, request_id=plan.request_id)
            )
        except (EngineHTTPError, EngineUnavailable) as exc:
            self._engine_error(exc, plan)
            raise from_engine(
                exc, self.engine_names, self.public, sent_params(plan.body, self.fields.extensions)
            ) from None
        finally:
            self.release_answer_slot(plan)
            self._answered(plan, start)
        plan.usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
        plan.tokens = self.engine.answer_tokens(body)
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
        `persisted()` with its own writes (one round trip for all)."""
        await self._await_summaries(plan)
        payload = await self._offload(plan, self._build_answer, plan)
        rid, created = shaping.new_id(), int(time.time())
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        usage = None
        tokens = plan.tokens = AnswerTokens()
        await self._admit(plan)
        start = time.monotonic()
        upstream = self.client.chat_stream(payload, "answer", big=plan.big, request_id=plan.request_id)
        try:
            first = True
            async for event in upstream:
                if first:
                    plan.timings["ttft_s"] = ttft = time.monotonic() - plan.started
                    self.counters.observe("ttft_seconds", ttft)
                    yield shaping.chunk(rid, self.public, created, shaping.role_delta())
                    first = False
                if event.get("usage"):
                    usage = shaping.shape_usage(event["usage"])
                self.engine.stream_tokens(event, tokens)
                for choice in event.get("choices") or []:
                    if choice.get("index", 0) != 0:  # the proxy asks for one choice: another is not this answer
                        continue
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
                    # an empty delta may still carry logprobs: vLLM's last chunk for a token its
                    # parser swallowed (an end token) has them with the finish_reason
                    if delta or choice.get("logprobs"):
                        yield shaping.chunk(rid, self.public, created, delta, logprobs=choice.get("logprobs"))
            if first:
                yield shaping.chunk(rid, self.public, created, shaping.role_delta())
            if finish is None:  # vLLM and SGLang always end a choice with one: the answer may be cut short
                raise EngineHTTPError(502, "the engine's stream ended without a finish_reason", in_stream=True)
        except (EngineHTTPError, EngineUnavailable) as exc:
            self._engine_error(exc, plan)
            raise from_engine(
                exc, self.engine_names, self.public, sent_params(plan.body, self.fields.extensions)
            ) from None
        finally:
            self.release_answer_slot(plan)
            self._answered(plan, start)
            plan.usage = usage
            await upstream.aclose()
        finish = shaping.finish_reason(finish, bool(calls))
        if finish not in FAILED_FINISH:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
            if calls:
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for _, c in sorted(calls.items())
                ]
            if persist:
                self.record(plan, message)  # before the final frames: the client's next turn may follow at once
                await self.persisted(plan)
            else:
                plan.answer = message
        yield shaping.chunk(rid, self.public, created, {}, finish)
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

    def summary_payload(self, plan: Plan) -> dict[str, Any]:
        """The chat summary: the fallback of the token continuation (`summary_request`)."""
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
        self._set_priority(payload, "summary")
        return payload

    def abandon(self, plan: Plan) -> None:
        """The client did not get the whole answer: no summary for it (and nobody waits for one)."""
        if plan.record is not None:
            plan.record.set_summary(None)
            plan.record = None

    def start_summary(self, plan: Plan) -> None:
        """Called once the client has the complete response (body sent, or after [DONE])."""
        record, key = plan.record, plan.record_key
        if record is None or key is None:
            return
        free = self._summary_concurrency - self._summary_running
        if self._summary_waiting >= self.profile.proxy.summary_queue_max + free:
            self.counters.inc("summaries_dropped_total")
            record.set_summary(None)
            return
        self._summary_waiting += 1
        # the task keeps the summary request only, not the client's request
        salt = plan.body.get("cache_salt")
        tokens = plan.tokens
        if (
            tokens is not None and tokens.complete()
        ):  # 8 bytes a token while queued, not a Python int and its pointer (36)
            tokens = AnswerTokens(array("l", tokens.prompt), array("l", tokens.output), tokens.stop_token)  # type: ignore[arg-type]
        job = SummaryJob(
            self.summary_payload(plan),
            self.adapter_models[plan.route],
            plan.route,
            tokens,
            {"cache_salt": salt} if isinstance(salt, str) and "cache_salt" in self.fields.extensions else {},
        )
        task = asyncio.get_running_loop().create_task(
            self._summarise(job, record, key, time.monotonic(), plan.big, plan.request_id)
        )
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _stale(self, record: TurnRecord, queued: float) -> bool:
        return record.stale or time.monotonic() - queued > self.profile.proxy.summary_wait_s

    async def summary_suffix(self, model: str) -> list[int] | None:
        """The tokens that follow an answer's own tokens in the summary hop: the end of the
        assistant turn, a user turn with the summary instruction, the generation prompt with
        thinking off (`enable_thinking: false` unless `proxy.reasoning` is none).

        Derived from the engine itself, not written per family: the engine's template probe
        (`Engine.probe_path`: vLLM's /tokenize) renders a probe conversation (a user message, a
        sentinel answer) twice with the served template and tokenizer: once left open after the
        answer's text (`continue_final_message`), once followed by the instruction and the
        generation prompt. The suffix is what comes after the sentinel's last tokens
        (`views.suffix_after`). So it is right for any template (Qwen's `<|im_end|>\n<|im_start|>
        user`, GLM's `<|user|>`, the tiny demo's look-alikes) and tokenizer, and needs no template
        copy in the proxy. The probe's tokens before the sentinel are not used: they render the
        probe's own assistant turn, which both families render differently once a later user
        query exists (Qwen's last_query_index, GLM's last_user_index), which is why the whole
        summary prompt is not rendered this way. One probe pair per adapter model per proxy (an
        adapter may carry its own tokenizer); a failed probe is tried again after
        PRIORITY_RETRY_S, the summaries meanwhile fall back to the chat summary."""
        if model in self._suffixes:
            return self._suffixes[model]
        failed = self._suffix_failed.get(model)
        if failed is not None and time.monotonic() - failed < PRIORITY_RETRY_S:
            return None
        async with self._suffix_lock:
            if model in self._suffixes:
                return self._suffixes[model]
            path = self.engine.probe_path
            if path is None:
                return None
            kwargs = {"enable_thinking": False} if self.profile.proxy.reasoning != "none" else None
            convo = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
            suffix = None
            try:
                left_open = self.engine.probe_ids(
                    await self.client.chat(
                        self.engine.probe_request(model, convo, False, kwargs), "summary", timeout=30, path=path
                    )
                )
                closed = self.engine.probe_ids(
                    await self.client.chat(
                        self.engine.probe_request(
                            model, [*convo, {"role": "user", "content": self.summary_instruction}], True, kwargs
                        ),
                        "summary",
                        timeout=30,
                        path=path,
                    )
                )
                if left_open and closed:
                    suffix = suffix_after(left_open, closed)
                why = "its tokens did not show where the answer ends"
            except (EngineHTTPError, EngineUnavailable) as exc:
                why = described(exc)
            if suffix is None:
                self._suffix_failed[model] = time.monotonic()
                log.warning(
                    "the template probe for summaries on %s failed (%s): summaries are sent as chat requests, "
                    "not as continuations of the answer's tokens",
                    model,
                    why,
                )
            else:
                self._suffixes[model] = suffix
                self._suffix_failed.pop(model, None)
            return suffix

    async def summary_request(self, job: SummaryJob) -> tuple[str, dict[str, Any]] | None:
        """(path, body) of the summary hop, or None: it would not fit the engine's window.

        The continuation (issue 30): the answer hop's prompt token ids + its generated ids + the
        suffix (`summary_suffix`, `engines.base.continuation_ids`), as a completion with a token
        prompt on the same adapter (`Engine.continuation_request`): every token before the
        suffix is one the engine computed for the answer, so the engine's prefix cache serves
        all of it but the last, partial KV block. Its prompt plus `proxy.summary_max_tokens`
        must fit the window (`context_window`), else the summary is skipped
        (`summary_window_skips_total`): the chat summary would not fit either. Without the
        answer's token ids (an engine that reports none, a stream that hid them, SGLang streams)
        or a suffix, today's chat summary (`summary_payload`), counted in
        `summary_chat_fallbacks_total` and logged once per cause."""
        tokens = job.tokens
        suffix = None
        if tokens is not None and tokens.complete() and self.engine.continuation_path is not None:
            suffix = await self.summary_suffix(job.model)
            cause = "probe"
        else:
            cause = "tokens"
        if suffix is None or tokens is None:
            self.counters.inc("summary_chat_fallbacks_total")
            if cause not in self._fallback_said:
                self._fallback_said.add(cause)
                if cause == "tokens":
                    log.warning(
                        "an answer hop came back without its token ids: its summary is sent as a chat request "
                        "(counted in summary_chat_fallbacks_total; said once)"
                    )
            return CHAT_PATH, job.chat
        ids = continuation_ids(tokens, suffix)
        limit = self.profile.proxy.summary_max_tokens
        if self.window is not None and len(ids) + limit > self.window:
            self.counters.inc("summary_window_skips_total")
            return None
        payload = self.engine.continuation_request(job.model, job.route, ids, limit)
        payload.update(job.extra)
        self._set_priority(payload, "summary")
        return self.engine.continuation_path, payload

    def _summary_text(self, path: str, body: dict[str, Any]) -> str:
        if path != CHAT_PATH:
            text, usage = self.engine.continuation_result(body)
            self.counters.inc("summary_continuations_total")
            if usage is not None:
                self._count_usage(usage)
            return text.strip()
        body = checked_completion(body)
        if isinstance(body.get("usage"), dict):
            self._count_usage(body["usage"])
        msg = ((body.get("choices") or [{}])[0]).get("message") or {}
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        return (msg.get("content") or "").strip() or reasoning.strip()[:160]

    def _count_usage(self, usage: dict[str, Any]) -> None:
        """The summary hops' prompt and cached tokens as the engine reports them (the cache share
        of issue 30: summary_cached_tokens_total / summary_prompt_tokens_total)."""
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int) and isinstance(cached, int):
            self.counters.inc("summary_prompt_tokens_total", prompt)
            self.counters.inc("summary_cached_tokens_total", cached)

    async def _summarise(
        self, job: SummaryJob, record: TurnRecord, key: bytes, queued: float, big: bool, request_id: str | None = None
    ) -> None:
        waiting = True
        try:
            async with self._summary_slots:
                self._summary_waiting -= 1
                self._summary_running += 1
                waiting = False
                if self._stale(record, queued):
                    self.counters.inc("summaries_stale_total")
                    record.set_summary(None)
                    return
                hop = await self.summary_request(job)
                if hop is None:
                    record.set_summary(None)
                    return
                path, payload = hop
                for attempt in range(2):
                    try:
                        start = time.monotonic()
                        body = await self.client.chat(
                            payload,
                            "summary",
                            timeout=self.summary_timeout_s,
                            big=big,
                            request_id=request_id,
                            **({"path": path} if path != CHAT_PATH else {}),
                        )
                        self.counters.observe(
                            "hop_seconds", time.monotonic() - start, hop="summary", adapter=record.route
                        )
                        try:
                            text = self._summary_text(path, body)
                        except (ValueError, TypeError, AttributeError) as exc:
                            raise EngineHTTPError(502, f"the engine's summary answer is unusable: {exc}") from None
                        if record.stale:  # a later turn folded this one without it: keep it that way
                            self.counters.inc("summaries_stale_total")
                            record.set_summary(None)
                            return
                        self.counters.inc("summaries_total")
                        record.set_summary(text)
                        self.store.put_turn(key, record)  # recount its size with the summary
                        return
                    except (EngineHTTPError, EngineUnavailable) as exc:
                        log.warning("summary hop failed (attempt %d): %s", attempt + 1, described(exc))
                        if attempt == 0:
                            self.counters.inc("summary_retries_total")
                self.counters.inc("summary_failures_total")
                record.set_summary(None)
        finally:
            if waiting:
                self._summary_waiting -= 1
            else:
                self._summary_running -= 1
