"""The speculative answer (issue 28): a follow-up turn's answer hop starts on the conversation's
adapter alongside the route hop and is held until the route decides. Driven by the official
`openai` SDK against the fake engine (tests/fake_engine.py: a scripted route delay and label,
per-model answer text and delays, and the disconnects it sees, as vLLM aborts them)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.helpers import wait_for
from tests.proxy_stack import KEY, PUBLIC, TOOLS, Stack, own_stack

ROUTED, HELD = "the routed adapter's answer", "the held speculative answer"


@pytest.fixture(scope="module")
def spec_stack(keyfile, tmp_path_factory):
    """The tiny profile (speculation on by default), metrics on, a short route deadline."""
    from tests.helpers import free_ports

    (metrics_port,) = free_ports(1)
    logs = tmp_path_factory.mktemp("spec-logs")
    with own_stack(
        keyfile,
        logs,
        "--set",
        "proxy.route_timeout_s=1",
        "--set",
        "proxy.sse_keepalive_s=5",
        "--metrics-port",
        str(metrics_port),
    ) as st:
        st.metrics_url = f"http://127.0.0.1:{metrics_port}"
        st.proxy_log = logs / "proxy.log"
        yield st


def request_lines(s: Stack) -> list[dict]:
    """The proxy's JSON request log lines."""
    return [json.loads(ln) for ln in s.proxy_log.read_text().splitlines() if ln.startswith('{"ts"')]


@pytest.fixture
def sp(spec_stack) -> Stack:
    spec_stack.reset()
    return spec_stack


def first_turn(s: Stack, route: str = "L2", stream: bool = False) -> list[dict]:
    """A first turn answered on `route`; the conversation so far, ready for a follow-up."""
    u1 = {"role": "user", "content": f"[route:{route}] write a parser"}
    a1 = s.chat([u1]).choices[0].message.content
    wait_for(lambda: s.log("summary"), 10)  # its summary settled: no pending summary to wait for
    return [u1, {"role": "assistant", "content": a1}]


def ask(s: Stack, messages: list[dict], stream: bool) -> tuple[str, dict[str, str]]:
    """The answer's text and the response headers."""
    raw = s.client.chat.completions.with_raw_response.create(model=PUBLIC, messages=messages, stream=stream)
    if not stream:
        return raw.parse().choices[0].message.content, dict(raw.headers)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return text, dict(raw.headers)


def spec_count(s: Stack, outcome: str, reason: str = "") -> float:
    text = httpx.get(s.metrics_url + "/metrics").text
    line = f'molctl_proxy_speculative_total{{outcome="{outcome}",reason="{reason}"}}'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line))


def counter(s: Stack, sample: str) -> float:
    text = httpx.get(s.metrics_url + "/metrics").text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(sample + " "))


def sent(s: Stack, hop: str) -> list[dict]:
    """The requests of `hop` the engine got (not its disconnect events)."""
    return [e for e in s.log(hop) if "event" not in e]


def gone(s: Stack, hop: str) -> list[dict]:
    return [e for e in s.log() if e.get("event") == "client_gone" and e["hop"] == hop]


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_on_the_same_adapter_is_the_held_answer(sp, stream):
    convo = first_turn(sp)
    sp.reset()
    sp.config(route_delay=0.3, model_text={"L2": HELD})
    hits = spec_count(sp, "hit")
    text, headers = ask(sp, [*convo, {"role": "user", "content": "[route:L2] add a test"}], stream)
    assert text == HELD
    held = sent(sp, "speculative")
    assert [e["model"] for e in held] == ["L2"] and not sent(sp, "answer")  # the held hop was the answer
    assert held[0]["request_id"].endswith("-speculative")
    assert held[0]["t"] < sp.log("route")[0]["t"] + 0.3  # sent while the route hop ran
    assert spec_count(sp, "hit") == hits + 1
    assert float(headers["x-mol-route-ms"]) >= 300 and float(headers["x-mol-overhead-ms"]) >= 0
    assert "L2" not in headers["x-mol-route-ms"] + headers["x-mol-overhead-ms"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_miss_closes_the_held_request_and_the_client_sees_only_the_routed_answer(sp, stream):
    convo = first_turn(sp)
    sp.reset()
    # the held hop on L2 is still before its first token when the route (L1) decides
    sp.config(route_delay=0.2, model_delay={"L2": 5.0}, model_text={"L2": HELD, "L1": ROUTED})
    misses = spec_count(sp, "miss")
    text, _ = ask(sp, [*convo, {"role": "user", "content": "[route:L1] now plan my trip"}], stream)
    assert text == ROUTED
    assert [e["model"] for e in sent(sp, "speculative")] == ["L2"]
    assert [e["model"] for e in sent(sp, "answer")] == ["L1"]
    assert wait_for(lambda: gone(sp, "speculative"), 5)  # the engine saw the disconnect: it aborts the request
    assert gone(sp, "speculative")[0]["t"] <= sent(sp, "answer")[0]["t"] + 0.05  # closed before the routed answer
    assert spec_count(sp, "miss") == misses + 1


def test_a_miss_counts_the_tokens_it_wasted(sp):
    convo = first_turn(sp)
    sp.reset()
    sp.config(route_delay=0.5, token_delay=0.05, answer_words=40, model_text={"L2": HELD, "L1": ROUTED})
    before = counter(sp, 'molctl_proxy_speculative_wasted_tokens_total{kind="generated"}')
    text, _ = ask(sp, [*convo, {"role": "user", "content": "[route:L1] now plan my trip"}], True)
    assert text.startswith(ROUTED)
    assert wait_for(lambda: gone(sp, "speculative"), 5)
    assert counter(sp, 'molctl_proxy_speculative_wasted_tokens_total{kind="generated"}') > before


@pytest.mark.parametrize("stream", [False, True])
def test_a_route_timeout_falls_back_to_the_held_answer_on_the_conversation_adapter(sp, stream):
    convo = first_turn(sp, "L3")
    sp.reset()
    sp.config(route_delay=2.0, model_text={"L3": HELD})  # past proxy.route_timeout_s=1
    fallbacks = counter(sp, 'molctl_proxy_route_sources_total{reason="timeout",source="fallback"}')
    text, _ = ask(sp, [*convo, {"role": "user", "content": "[route:L1] anything"}], stream)
    assert text == HELD  # the fallback (the previous turn's route) is the held hop's adapter
    assert [e["model"] for e in sent(sp, "speculative")] == ["L3"] and not sent(sp, "answer")
    assert counter(sp, 'molctl_proxy_route_sources_total{reason="timeout",source="fallback"}') == fallbacks + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_the_speculative_phase_leaves_nothing_running(sp, stream):
    convo = first_turn(sp)
    sp.reset()
    sp.config(route_delay=1.5, model_delay={"L2": 5.0})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            sp.proxy_url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": PUBLIC, "stream": stream, "messages": [*convo, {"role": "user", "content": "[route:L2] x"}]},
            timeout=0.5,
        )
    assert wait_for(lambda: gone(sp, "speculative"), 5)
    time.sleep(1.5)  # past the route hop's answer: no answer hop was started after the client left
    assert not sent(sp, "answer") and len(sent(sp, "speculative")) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_tool_result_turns_and_first_turns_are_not_speculated(sp, stream):
    first = spec_count(sp, "skipped", "first_turn")
    tools = spec_count(sp, "skipped", "tool_turn")
    u1 = {"role": "user", "content": "[route:L3] [tool:get_weather] weather?"}
    r = sp.chat([u1], tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    text = sp.chat([u1, assistant, result], stream=stream, tools=TOOLS)
    assert (text[0] if stream else text.choices[0].message.content).endswith("sunny")
    assert not sent(sp, "speculative")
    assert spec_count(sp, "skipped", "first_turn") == first + 1
    assert spec_count(sp, "skipped", "tool_turn") == tools + 1


def test_the_responses_api_speculates_on_the_previous_response_adapter(sp):
    client = sp.client
    first = client.responses.create(model=PUBLIC, input="[route:L1] plan a trip")
    sp.reset()
    sp.config(route_delay=0.3, model_text={"L1": HELD, "L2": ROUTED})
    hit = client.responses.create(model=PUBLIC, input="[route:L1] and the hotel", previous_response_id=first.id)
    assert hit.output_text == HELD
    assert [e["model"] for e in sent(sp, "speculative")] == ["L1"] and not sent(sp, "answer")
    sp.reset()
    sp.config(route_delay=0.2, model_delay={"L1": 5.0}, model_text={"L1": HELD, "L2": ROUTED})
    raw = client.responses.with_raw_response.create(
        model=PUBLIC, input="[route:L2] write code", previous_response_id=hit.id, stream=True
    )
    headers = dict(raw.headers)
    text = "".join(e.delta for e in raw.parse() if e.type == "response.output_text.delta")
    assert text == ROUTED
    assert [e["model"] for e in sent(sp, "answer")] == ["L2"]
    assert wait_for(lambda: gone(sp, "speculative"), 5)
    assert float(headers["x-mol-route-ms"]) >= 200 and "x-mol-overhead-ms" in headers


@pytest.fixture(scope="module")
def full_stack(keyfile, tmp_path_factory):
    """One answer slot: a held hop would need a second one."""
    with own_stack(keyfile, tmp_path_factory.mktemp("full-logs"), "--set", "proxy.max_inflight=1") as st:
        yield st


def test_no_speculation_without_a_free_answer_slot(full_stack):
    s = full_stack
    s.reset()
    convo = first_turn(s)
    s.reset()
    r = s.chat([*convo, {"role": "user", "content": "[route:L2] more"}])
    assert r.choices[0].message.content
    assert not sent(s, "speculative") and [e["model"] for e in sent(s, "answer")] == ["L2"]


@pytest.fixture(scope="module")
def off_stack(keyfile, tmp_path_factory):
    with own_stack(keyfile, tmp_path_factory.mktemp("off-logs"), "--set", "proxy.speculative_answer=false") as st:
        yield st


@pytest.mark.parametrize("stream", [False, True])
def test_the_held_request_is_the_one_a_non_speculative_answer_sends(sp, off_stack, stream):
    """Byte for byte the same request (same sampling): a hit's tokens are the non-speculative answer's."""
    payloads = {}
    for name, s in (("on", sp), ("off", off_stack)):
        s.reset()
        s.config(model_text={"L2": "fixed"})
        convo = first_turn(s)
        s.reset()
        s.config(model_text={"L2": "fixed"})
        s.chat([*convo, {"role": "user", "content": "[route:L2] again"}], stream=stream, temperature=0.3, seed=7)
        payloads[name] = (sent(s, "speculative") if name == "on" else sent(s, "answer"))[0]["payload"]
    # the hop's own id (vLLM's request_id field, as X-Request-Id) names the hop; nothing else differs
    on_id, off_id = payloads["on"].pop("request_id"), payloads["off"].pop("request_id")
    assert on_id.endswith("-speculative") and off_id.endswith("-answer")
    assert payloads["on"] == payloads["off"]
    assert not sent(off_stack, "speculative")  # the profile turned it off


def test_a_speculative_answer_value_not_a_boolean_is_refused():
    from molctl.profiles import ProfileError, load_profile, profile_dirs

    assert load_profile("tiny", profile_dirs()).proxy.speculative_answer is True  # the default
    with pytest.raises(ProfileError, match="speculative_answer"):
        load_profile("tiny", profile_dirs(), [("proxy.speculative_answer", "maybe")])


def test_the_sdk_sees_the_headers_on_an_error_free_first_turn(sp):
    raw = sp.client.chat.completions.with_raw_response.create(
        model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] hi"}]
    )
    assert float(raw.headers["x-mol-route-ms"]) >= 0 and float(raw.headers["x-mol-overhead-ms"]) >= 0
    assert isinstance(raw.parse(), openai.types.chat.ChatCompletion)


def test_the_request_log_says_the_route_source_and_the_speculative_outcome(sp):
    before = len(request_lines(sp))
    convo = first_turn(sp)
    sp.config(route_delay=0.2, token_delay=0.05, answer_words=20, model_text={"L1": ROUTED})
    sp.chat([*convo, {"role": "user", "content": "[route:L1] plan a trip"}], stream=True)
    sp.config(route_delay=0.0, token_delay=0.0, answer_words=0)
    sp.chat([*convo, {"role": "user", "content": "[route:L2] keep going"}])
    assert wait_for(lambda: len(request_lines(sp)) >= before + 3, 5)
    first, miss, hit = request_lines(sp)[before : before + 3]
    assert (first["speculative"], first["speculative_reason"], first["route_source"]) == (
        "skipped",
        "first_turn",
        "classified",
    )
    assert miss["speculative"] == "miss" and miss["route"] == "L1" and miss["speculative_reason"] is None
    assert miss["speculative_wasted_prompt"] is not None and miss["speculative_wasted_generated"] is not None
    assert hit["speculative"] == "hit" and hit["speculative_wasted_prompt"] is None
    assert all(line["overhead_s"] is not None and line["route_s"] is not None for line in (first, miss, hit))
