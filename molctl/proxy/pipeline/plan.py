"""The request plan: everything decided about one request, as fields.

`RequestState` is one HTTP request's state from its first byte to its log line (tenant, request
id, status, the streaming/disconnected/cut/error flags, its `Plan` once the body is parsed);
`Plan` is what the pipeline decides for a chat or Responses answer (history, route, the chosen
engine, the answer, its turn record, timings). Both travel as arguments, never in a ContextVar.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from molctl.engines.base import AnswerTokens
from molctl.proxy.affinity import EngineChoice
from molctl.proxy.conversations import ConversationKeys, TurnRecord
from molctl.proxy.pipeline.heldhop import HeldHop
from molctl.proxy.pipeline.views import History
from molctl.proxy.store.base import StoreScope


@dataclass
class RouteDecision:
    """How the route stage decided `Plan.route` (`routing.Router`)."""

    source: str | None = None  # classified, sticky or fallback
    fallback: str | None = None  # why the route hop's label was not used (timeout, engine_error, ...)
    sticky: bool = False  # tool results continued on the adapter that issued their calls


@dataclass
class AnswerSlot:
    """The request's answer slot (admission: `run.Orchestrator._admit`)."""

    held: bool = False  # holds one (taken before the route hop)
    queued: bool = False  # waiting for one now (a stream holds its 200 meanwhile)
    wait_s: float = 0.0  # waited for one, in all (a request that gave it back for a summary waits twice)


@dataclass
class SpeculationOutcome:
    """The speculative answer (`speculative`): the hop held while the route hop runs, the held hop
    that is the answer (a hit), and for the log line: hit, miss, skipped (with its reason) or
    cancelled (the request ended before the route decided), and a miss's wasted tokens."""

    pending: HeldHop | None = None
    answer: HeldHop | None = None
    outcome: str | None = None
    reason: str | None = None
    wasted: tuple[int, int] | None = None  # (prompt, generated) tokens


@dataclass
class ResponsesContext:
    """A Responses request: the stored response it continues and its new messages (the sticky
    tool-turn rule reads the record's calls, `routing.sticky_route`), and its conversation's id."""

    previous: dict[str, Any] | None = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    conversation_id: str | None = None  # a Responses chain's first response id (gen_ai.conversation.id)


@dataclass
class Plan:
    """Everything decided about one request; each stage's own decisions in its part."""

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
    # for the request's log line and metrics
    started: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)  # route_s, answer_s, ttft_s
    usage: dict[str, Any] | None = None
    request_id: str | None = None  # sent to the engine as X-Request-Id
    tokens: AnswerTokens | None = None  # the answer hop's prompt and output token ids, as the engine reported them
    # the engine of this request's hops (conversation affinity, `run.Orchestrator.load`); None: the own upstream
    engine: EngineChoice | None = None
    scope: StoreScope | None = None  # the request's state in the store (`open_scope`)
    repaired: list[int] = field(default_factory=list)  # messages whose tool-call arguments became {} (`tool_arguments`)
    # what each stage owns
    decision: RouteDecision = field(default_factory=RouteDecision)
    slot: AnswerSlot = field(default_factory=AnswerSlot)
    speculation: SpeculationOutcome = field(default_factory=SpeculationOutcome)
    responses: ResponsesContext = field(default_factory=ResponsesContext)


@dataclass
class RequestState:
    """One HTTP request, from its head to its log line (`http.app`)."""

    request_id: str
    t0: float = field(default_factory=time.monotonic)
    tenant: str | None = None
    started: bool = False  # the response head went out
    status: int = 499  # the status sent (499: none, the client left first)
    plan: Plan | None = None
    streaming: bool = False  # a stream: the drain deadline ends it in its own loop, not by a cancel
    cut: bool = False  # cancelled by the drain deadline (answered `draining`)
    disconnected: bool = False
    error: str | None = None  # the error code the client got (a status or an error frame)
