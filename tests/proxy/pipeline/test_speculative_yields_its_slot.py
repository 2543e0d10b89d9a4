"""A held speculative hop gives way to a real request: when another request takes the answer slot
the held hop counted on, the held hop's engine request is closed and its own request's answer is
sent as without speculation. Driven by the official `openai` SDK against the fake engine."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers import free_ports, wait_for
from tests.proxy_stack import PUBLIC, own_stack


@pytest.fixture(scope="module")
def two_slots(keyfile, tmp_path_factory):
    (metrics_port,) = free_ports(1)
    logs = tmp_path_factory.mktemp("two-slots")
    with own_stack(keyfile, logs, "--set", "proxy.max_inflight=2", "--metrics-port", str(metrics_port)) as st:
        st.metrics_url = f"http://127.0.0.1:{metrics_port}"
        st.proxy_log = logs / "proxy.log"
        yield st


def sent(s, hop: str) -> list[dict]:
    return [e for e in s.log(hop) if "event" not in e]


def test_a_request_taking_the_last_slot_closes_the_held_hop_it_counted_on(two_slots):
    """Guards a found bug: a held hop kept an engine sequence beyond proxy.max_inflight once a later request took the slot."""
    s = two_slots
    s.reset()
    u1 = {"role": "user", "content": "[route:L2] write a parser"}
    convo = [u1, {"role": "assistant", "content": s.chat([u1]).choices[0].message.content}]
    assert wait_for(lambda: s.log("summary"), 10)
    s.reset()
    # the follow-up's held hop on L2 is still before its first token when the first turn arrives
    s.config(route_delay=1.0, model_delay={"L2": 2.0})
    answers: dict[str, str] = {}

    def follow_up():
        r = s.client.chat.completions.create(
            model=PUBLIC, messages=[*convo, {"role": "user", "content": "[route:L2] more"}]
        )
        answers["follow_up"] = r.choices[0].message.content

    thread = threading.Thread(target=follow_up)
    thread.start()
    assert wait_for(lambda: sent(s, "speculative"), 5)  # held: one slot taken, one free
    answers["other"] = s.chat([{"role": "user", "content": "[route:L3] a new conversation"}]).choices[0].message.content
    thread.join(30)
    assert answers["follow_up"] and answers["other"]
    assert [e for e in s.log("speculative") if e.get("event") == "client_gone"]  # the engine aborts it
    assert sorted(e["model"] for e in sent(s, "answer")) == ["L2", "L3"]  # the follow-up's answer, sent afresh
    assert s.metrics()["molctl_proxy_speculative_total"] >= 1
    skipped = 'molctl_proxy_speculative_total{outcome="skipped",reason="admission"} 1.0'
    assert skipped in httpx.get(s.metrics_url + "/metrics").text
    lines = [json.loads(ln) for ln in s.proxy_log.read_text().splitlines() if ln.startswith('{"ts"')]
    assert [(ln["speculative"], ln["route"]) for ln in lines if ln.get("speculative_reason") == "admission"] == [
        ("skipped", "L2")
    ]
