"""What llm-d's scheduler reads on each hop (`proxy.scheduler_objectives` set: the Endpoint
Picker of llm-d-router sits between the proxy and the engines, `render k8s --scheduler llm-d`).

Header names as llm-d-router v0.10.0 reads them:
- `x-session-id`: the session-affinity scorer's `session_id` strategy (pkg/epp/framework/plugins/
  scheduling/util/sessionaffinity/session_id.go, DefaultSessionIDHeader): the conversation's turns
  go to the pod that holds their prefix;
- `x-llm-d-inference-objective`: the InferenceObjective whose priority the hop gets
  (pkg/epp/metadata/consts.go, ObjectiveKey);
- `x-llm-d-inference-fairness-id`: flow control's fairness id (the same file, FlowFairnessIDKey;
  `x-gateway-inference-fairness-id` is its older name).

The session id is a digest of the tenant and the conversation's first non-instruction message:
the same for every turn of a conversation, in either API, and not the text. The fairness id is a
digest of the tenant (the API key's entry in the key file, never the key). Both travel with the
request's `EngineChoice` (its `scheduler`), so every hop of the request, the summary queued after
it included, carries them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from molctl.proxy.affinity import EngineChoice
from molctl.proxy.conversations import INSTRUCTION_ROLES, canonical_message

SESSION_HEADER = "x-session-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
# the engine client's hop names -> the objective (render k8s names them PREFIX-route, -answer, -summary)
HOP_OBJECTIVES = {
    "route": "route",
    "answer": "answer",
    "speculative": "answer",
    "length": "answer",
    "summary": "summary",
}


def _digest(kind: bytes, *parts: bytes) -> str:
    h = hashlib.sha256(b"molctl-" + kind)
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()[:32]


def session_id(tenant: str, messages: list[dict[str, Any]]) -> str:
    first = next((m for m in messages if m.get("role") not in INSTRUCTION_ROLES), None)
    return _digest(b"session", tenant.encode(), canonical_message(first) if first is not None else b"")


def fairness_id(tenant: str) -> str:
    return _digest(b"tenant", tenant.encode())


@dataclass(frozen=True)
class RequestHints:
    """One request's scheduler headers, less the objective (which is per hop)."""

    prefix: str
    session: str
    fairness: str

    def headers(self, hop: str) -> dict[str, str]:
        return {
            SESSION_HEADER: self.session,
            OBJECTIVE_HEADER: f"{self.prefix}-{HOP_OBJECTIVES.get(hop, 'answer')}",
            FAIRNESS_HEADER: self.fairness,
        }


class SchedulerHints:
    """`proxy.scheduler_objectives` of the profile: `choice` is the request's engine choice (the
    own upstream, the router; the replicas' affinity redirect is not used)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    @classmethod
    def of(cls, profile: Any) -> SchedulerHints | None:
        prefix = profile.proxy.scheduler_objectives
        return cls(prefix) if prefix else None

    def choice(self, tenant: str, messages: list[dict[str, Any]], upstream: str) -> EngineChoice:
        hints = RequestHints(self.prefix, session_id(tenant, messages), fairness_id(tenant))
        return EngineChoice("", upstream, scheduler=hints)


def hop_headers(hop: str, engine: EngineChoice | None) -> dict[str, str] | None:
    """The scheduler headers of a hop to `engine` (None: no scheduler in front)."""
    hints = engine.scheduler if engine is not None else None
    return hints.headers(hop) if hints is not None else None
