"""The request's log line (`molctl.proxy.requests`): one JSON object per request, fixed keys."""

from __future__ import annotations

import time

import orjson

from molctl.proxy.pipeline.plan import RequestState


def request_line(state: RequestState, api: str, total_s: float) -> str:
    """The request's log line: JSON with fixed keys (null where a field does not apply). The
    tenant is the key's short hash (never the key); no message content."""
    plan = state.plan
    usage = (plan.usage if plan is not None else None) or {}
    details = usage.get("prompt_tokens_details") or {}
    timings = plan.timings if plan is not None else {}
    wasted = plan.speculation.wasted if plan is not None else None
    return orjson.dumps(
        {  # orjson: the same JSON as json.dumps for these str/int/float/bool/None values, ~10x faster
            "ts": round(time.time(), 3),
            "request_id": state.request_id,
            "tenant": state.tenant,
            "api": api,
            "stream": plan.stream if plan is not None else None,
            "status": state.status,
            "route": plan.route if plan is not None else None,
            "fallback": plan.decision.fallback if plan is not None else None,
            "sticky": plan.decision.sticky if plan is not None else None,
            "route_source": plan.decision.source if plan is not None else None,
            "speculative": plan.speculation.outcome if plan is not None else None,
            "speculative_reason": plan.speculation.reason if plan is not None else None,
            "speculative_wasted_prompt": wasted[0] if wasted else None,
            "speculative_wasted_generated": wasted[1] if wasted else None,
            "queue_s": round(plan.slot.wait_s, 4) if plan is not None else None,
            "route_s": _round4(timings.get("route_s")),
            "answer_s": _round4(timings.get("answer_s")),
            "ttft_s": _round4(timings.get("ttft_s")),
            "overhead_s": _round4(timings.get("overhead_s")),
            "total_s": round(total_s, 4),
            "tokens_in": usage.get("prompt_tokens"),
            "tokens_out": usage.get("completion_tokens"),
            "tokens_cached": details.get("cached_tokens") if isinstance(details, dict) else None,
            "client_disconnect": state.disconnected,
            # the error code the client got (its status, or the error frame ending a 200 stream); null if none
            "error": state.error,
        }
    ).decode()


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
