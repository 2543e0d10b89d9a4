"""The MoL proxy against a scripted fake engine (a real HTTP server in a subprocess), driven by
the official `openai` SDK, non-stream and stream."""

from __future__ import annotations

import json
import math
import signal
import threading
import time

import httpx
import openai
import pytest

from molctl.errors import ExitStatus
from tests.helpers import free_ports, wait_for
from tests.procs import fake_engine_argv, proxy_argv, running, wait_http
from tests.proxy_stack import IDENTITY, KEY, KEY2, LEAK, PUBLIC, TINY, TOOLS, fold, parse_prometheus

# ------------------------------------------------------------------------ conversation views


@pytest.mark.parametrize("stream", [False, True])
def test_three_turns_across_two_adapters(s, stream):
    sys_msg = {"role": "system", "content": f"You are terse. ({stream})"}
    u1 = {"role": "user", "content": "[route:L2] write a parser"}
    u2 = {"role": "user", "content": "[route:L1] now plan my trip"}
    u3 = {"role": "user", "content": "[route:L2] fix the parser bug"}

    def ask(messages):
        if stream:
            return s.chat(messages, stream=True)[0]
        return s.chat(messages).choices[0].message.content

    a1 = ask([sys_msg, u1])
    a2 = ask([sys_msg, u1, {"role": "assistant", "content": a1}, u2])
    a3 = ask([sys_msg, u1, {"role": "assistant", "content": a1}, u2, {"role": "assistant", "content": a2}, u3])
    assert a1 and a2 and a3
    answers = s.log("answer")
    assert [e["model"] for e in answers] == ["L2", "L1", "L2"]
    A1 = {"role": "assistant", "content": a1}
    system = {"role": "system", "content": IDENTITY["content"] + "\n\n" + sys_msg["content"]}  # one system message
    assert answers[0]["messages"] == [system, u1]
    assert answers[1]["messages"] == [system, u1, fold(f"summary of {a1}"), u2]
    assert answers[2]["messages"] == [system, u1, A1, u2, fold(f"summary of {a2}"), u3]
    # the router saw the previous route and the request as quoted data in its own message
    routes = s.log("route")
    assert len(routes) == 3 and all(r["model"] == "L0" for r in routes)
    assert routes[0]["payload"]["structured_outputs"] == {"choice": ["L0", "L1", "L2", "L3"]}
    assert "Previous specialist: L2" in routes[1]["messages"][1]["content"]
    assert "now plan my trip" in routes[1]["messages"][1]["content"]
    assert "now plan my trip" not in routes[1]["messages"][0]["content"]
    # summaries ran on the adapter that answered
    summaries = s.log("summary")
    assert [e["model"] for e in summaries[:3]] == ["L2", "L1", "L2"]
    assert summaries[0]["messages"][:2] == answers[0]["messages"]


def test_own_view_is_a_prefix_turn_after_turn(s):
    u1 = {"role": "user", "content": "[route:L3] draw a form"}
    a1 = s.chat([u1]).choices[0].message.content
    u2 = {"role": "user", "content": "[route:L3] add a button"}
    s.chat([u1, {"role": "assistant", "content": a1}, u2])
    first, second = s.answers()  # the second: the held speculative hop (a hit)
    assert second["messages"][: len(first["messages"])] == first["messages"]


def test_summary_delay_does_not_delay_the_response(s):
    """Each answer comes back while its summary (6 s at the engine) is still running: counted by
    the proxy's finished summaries when the answer arrives, not by a wall-clock bound that a
    loaded runner can outrun."""
    s.config(summary_delay=6.0)
    done = s.metrics()["molctl_proxy_summaries_total"]
    r = s.chat([{"role": "user", "content": "[route:L1] book a table"}])
    assert r.choices[0].message.content
    assert s.metrics()["molctl_proxy_summaries_total"] == done  # its summary had not finished
    content, _, _ = s.chat([{"role": "user", "content": "[route:L1] book a cab"}], stream=True)
    assert content
    # had the stream waited for its own summary, the first one (started earlier) would be done too
    assert s.metrics()["molctl_proxy_summaries_total"] < done + 2
    # both summaries done (6 s, side by side): left running, they would hold both summary slots
    # (summary_inflight 2) into the next test, whose summary would queue behind them
    deadline = time.monotonic() + 12
    while s.metrics()["molctl_proxy_summaries_total"] < done + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.metrics()["molctl_proxy_summaries_total"] == done + 2
    assert len(s.log("summary")) == 2


def test_failed_summary_is_retried_once_and_counted(s):
    before = s.metrics()
    s.config(summary_fail=1)
    s.chat([{"role": "user", "content": "[route:L2] retry me"}])
    deadline = time.monotonic() + 5
    while (
        s.metrics()["molctl_proxy_summaries_total"] == before["molctl_proxy_summaries_total"]
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    after = s.metrics()
    assert after["molctl_proxy_summary_retries_total"] == before["molctl_proxy_summary_retries_total"] + 1
    assert len(s.log("summary")) == 2


def test_garbage_route_label_falls_back(s):
    before = s.metrics()["molctl_proxy_route_fallbacks_total"]
    s.config(route_label="banana")
    u1 = {"role": "user", "content": "hello there"}
    a1 = s.chat([u1]).choices[0].message.content
    assert s.log("answer")[-1]["model"] == TINY.proxy.default_route  # first turn: the profile default
    s.config(route_label=None)
    u2 = {"role": "user", "content": "[route:L3] show a card"}
    a2 = s.chat([u1, {"role": "assistant", "content": a1}, u2]).choices[0].message.content
    s.config(route_label="???")
    s.chat(
        [
            u1,
            {"role": "assistant", "content": a1},
            u2,
            {"role": "assistant", "content": a2},
            {"role": "user", "content": "continue"},
        ]
    )
    assert [e["model"] for e in s.answers()] == ["L2", "L3", "L3"]  # then the previous route
    assert s.metrics()["molctl_proxy_route_fallbacks_total"] == before + 2


def test_label_in_reasoning_field_is_accepted(s):
    s.config(route_in="reasoning_content")
    s.chat([{"role": "user", "content": "[route:L1] order sushi"}])
    assert s.log("answer")[-1]["model"] == "L1"


# ------------------------------------------------------------------------ tools


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reserialise", [False, True])
def test_tool_result_continues_on_the_same_adapter(s, stream, reserialise):
    u1 = {"role": "user", "content": f"[route:L3] [tool:get_weather] weather? {stream} {reserialise}"}
    if stream:
        _, calls, _ = s.chat([u1], stream=True, tools=TOOLS)
        call = calls[0]
        call_msg = {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]},
        }
    else:
        r = s.chat([u1], tools=TOOLS)
        assert r.choices[0].finish_reason == "tool_calls"
        call_msg = r.choices[0].message.tool_calls[0].model_dump()
    if reserialise:
        call_msg["function"]["arguments"] = json.dumps(
            json.loads(call_msg["function"]["arguments"]), indent=2, sort_keys=True
        )
    assistant = {"role": "assistant", "content": None, "tool_calls": [call_msg]}
    result = {"role": "tool", "tool_call_id": call_msg["id"], "content": "18C sunny"}
    routes_before = len(s.log("route"))
    if stream:
        content, _, _ = s.chat([u1, assistant, result], stream=True, tools=TOOLS)
    else:
        content = s.chat([u1, assistant, result], tools=TOOLS).choices[0].message.content
    assert "18C sunny" in content
    assert len(s.log("route")) == routes_before  # no route hop
    answers = s.log("answer")
    assert [a["model"] for a in answers] == ["L3", "L3"]
    assert answers[1]["messages"][-2:] == [assistant, result]


def test_unplaced_tool_turn_is_routed_not_refused(s):
    before = s.metrics()["molctl_proxy_unplaced_tool_turns_total"]
    u1 = {"role": "user", "content": "[route:L1] call my bank"}
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call-from-elsewhere", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call-from-elsewhere", "content": "ok"}
    r = s.chat([u1, assistant, result], tools=TOOLS)
    assert r.choices[0].message.content
    assert s.log("route") and s.log("answer")[-1]["model"] == "L1"
    assert s.metrics()["molctl_proxy_unplaced_tool_turns_total"] == before + 1


def test_tool_call_deltas_stream_live(s):
    s.config(token_delay=0.3, tool_arg_chunks=4)
    _, calls, chunks = s.chat(
        [{"role": "user", "content": "[route:L2] [tool:get_weather] now"}], stream=True, tools=TOOLS
    )
    tool_chunks = [t for t, c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(tool_chunks) >= 4
    end = chunks[-1][0]
    assert tool_chunks[0] < end - 0.8  # the first call delta arrived well before the answer ended
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}  # built from get_weather's schema
    final = [c for _, c in chunks if c.choices and c.choices[0].finish_reason]
    assert final[-1].choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------------------------ what clients see


def test_stream_shape_role_once_usage_and_keepalive(s):
    s.config(route_delay=0.5)
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": PUBLIC,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "[route:L2] hi"}],
        },
    ) as r:
        raw = "".join(r.iter_text())
    assert raw.count(": keepalive") >= 2  # while the route hop ran
    frames = [f[6:] for f in raw.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 13
    assert len({c["id"] for c in chunks}) == 1 and all(c["model"] == PUBLIC for c in chunks)
    # without include_usage: no usage chunk
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "[route:L2] hi"}]},
    ) as r:
        raw = "".join(r.iter_text())
    assert '"usage"' not in raw


def test_no_adapter_name_anywhere(s):
    seen: list[str] = []
    h = {"Authorization": f"Bearer {KEY}"}
    url = s.proxy_url + "/v1/chat/completions"

    def record(resp: httpx.Response, body: str):
        seen.append(json.dumps(dict(resp.headers)))
        seen.append(body)

    for route in ("L0", "L1", "L2", "L3"):
        r = httpx.post(
            url, headers=h, json={"model": PUBLIC, "messages": [{"role": "user", "content": f"[route:{route}] x"}]}
        )
        assert r.status_code == 200
        record(r, r.text)
        body = r.json()
        assert body["model"] == PUBLIC and body["id"].startswith("chatcmpl-") and "engine" not in body["id"]
        assert set(body) <= {"id", "object", "created", "model", "choices", "usage"}
        assert set(body["choices"][0]) == {"index", "message", "finish_reason", "logprobs"}
        with httpx.stream(
            "POST",
            url,
            headers=h,
            json={
                "model": PUBLIC,
                "stream": True,
                "messages": [{"role": "user", "content": f"[route:{route}] [tool:get_weather] y"}],
                "tools": TOOLS,
            },
        ) as sr:
            record(sr, "".join(sr.iter_text()))
    for bad in (
        {"model": "L2", "messages": [{"role": "user", "content": "x"}]},
        {"model": PUBLIC, "n": 2, "messages": [{"role": "user", "content": "x"}]},
        {"model": PUBLIC, "messages": []},
    ):
        r = httpx.post(url, headers=h, json=bad)
        assert r.status_code in (400, 404)
        record(r, r.text)
    s.config(
        answer_error={"status": 404, "body": {"error": {"message": "The model `L2` does not exist.", "code": 404}}}
    )
    r = httpx.post(url, headers=h, json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] z"}]})
    record(r, r.text)
    s.config(
        answer_error={
            "status": 400,
            "body": {"error": {"message": "adapter L2 of tiny-mol-base rejected the request", "code": 400}},
        }
    )
    r = httpx.post(url, headers=h, json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] z"}]})
    assert r.status_code == 400
    record(r, r.text)
    with httpx.stream(
        "POST",
        url,
        headers=h,
        json={"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "[route:L2] z"}]},
    ) as sr:
        record(sr, "".join(sr.iter_text()))
    r = httpx.get(s.proxy_url + "/v1/models", headers=h)
    record(r, r.text)
    assert r.json()["data"] == [{"id": PUBLIC, "object": "model", "created": 0, "owned_by": "molctl"}]
    leaks = [text for text in seen if LEAK.search(text)]
    assert not leaks, leaks[:2]


def test_error_shapes_and_codes(s):
    with pytest.raises(openai.NotFoundError) as err:
        s.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        s.chat([{"role": "user", "content": "x"}], n=2)
    assert err.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        s.chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])
    with pytest.raises(openai.BadRequestError) as err:
        s.chat([{"role": "user", "content": "x"}], extra_body={"echo": True})
    assert err.value.param == "echo"
    s.config(
        answer_error={
            "status": 400,
            "body": {
                "error": {
                    "message": "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens.",
                    "code": 400,
                }
            },
        }
    )
    with pytest.raises(openai.BadRequestError) as err:
        s.chat([{"role": "user", "content": "[route:L2] long"}])
    assert err.value.code == "context_length_exceeded" and "2048 tokens" in err.value.message


def test_request_parameters(s):
    s.chat(
        [{"role": "user", "content": "[route:L2] p"}],
        temperature=0.7,
        top_p=0.9,
        seed=3,
        max_tokens=10**6,
        stop=["\n\n"],
        reasoning_effort="low",
    )
    payload = s.log("answer")[-1]["payload"]
    assert (payload["temperature"], payload["top_p"], payload["seed"], payload["stop"]) == (0.7, 0.9, 3, ["\n\n"])
    assert payload["max_tokens"] == TINY.proxy.max_output_tokens  # clamped
    assert "reasoning_effort" not in payload  # the tiny profile has no reasoning mapping
    s.chat([{"role": "user", "content": "[route:L2] q"}])
    payload = s.log("answer")[-1]["payload"]
    assert "temperature" not in payload and "chat_template_kwargs" not in payload  # nothing imposed
    assert all(e["payload"]["model"] in ("L0", "L1", "L2", "L3") for e in s.log())


def test_every_engine_request_carries_the_hop_header(s):
    s.chat([{"role": "user", "content": "[route:L1] a"}])
    s.chat([{"role": "user", "content": "[route:L1] b"}], stream=True)
    s.settle()
    hops = [e["hop"] for e in s.log()]
    assert set(hops) == {"route", "answer", "summary"} and None not in hops


# ------------------------------------------------------------------------ auth, health, readiness


def test_auth(s):
    url = s.proxy_url + "/v1/chat/completions"
    body = {"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L0] hi"}]}
    bad = openai.OpenAI(base_url=s.proxy_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=PUBLIC, messages=body["messages"])
    r = httpx.post(url, json=body)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(s.proxy_url + "/v1/models").status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY2}"}).status_code == 200  # second key
    assert httpx.get(s.proxy_url + "/health").status_code == 200  # liveness needs no key


def test_readyz_follows_the_engine(s, monkeypatch):
    """Clock-free: the readiness cache reads the app's clock, which the test moves."""
    now = [0.0]
    monkeypatch.setattr(s.app, "clock", lambda: now[0])
    monkeypatch.setattr(s.app, "_ready", (-math.inf, False, "not probed"))
    assert httpx.get(s.proxy_url + "/readyz").status_code == 200
    s.config(adapters=["L0", "L1", "L2"])
    now[0] += s.app.ready_cache_s - 0.01
    assert httpx.get(s.proxy_url + "/readyz").status_code == 200  # a ready answer is reused for ready_cache_s
    now[0] += 0.02
    r = httpx.get(s.proxy_url + "/readyz")
    assert r.status_code == 503 and "missing" in r.json()["detail"]
    s.config(adapters=["L0", "L1", "L2", "L3"])
    now[0] += 0.21  # a not-ready answer is reused for 0.2 s at most
    assert httpx.get(s.proxy_url + "/readyz").status_code == 200
    s.config(health_status=503)
    now[0] += s.app.ready_cache_s + 0.01
    assert httpx.get(s.proxy_url + "/readyz").status_code == 503


def test_proxy_refuses_to_start_without_a_key(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "molctl", "proxy", "tiny", "--upstream", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        timeout=30,
    )
    assert r.returncode == ExitStatus.USAGE and "--allow-unauthenticated" in r.stderr


def test_engine_down(keyfile, tmp_path):
    dead, port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    with running(proxy_argv("tiny", f"http://127.0.0.1:{dead}", port, "--api-key-file", str(keyfile)), url + "/health"):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 502 and err.value.code == "engine_unavailable"
        with pytest.raises(openai.APIStatusError) as err:  # before the first token: the same status as non-stream
            client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "x"}], stream=True)
        assert err.value.status_code == 502 and err.value.code == "engine_unavailable"
        assert httpx.get(url + "/readyz").status_code == 503


def test_engine_503_is_503(s):
    s.config(answer_error={"status": 503, "body": {"error": {"message": "EngineDeadError"}}})
    r = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] x"}]},
    )
    assert r.status_code == 503 and r.headers.get("retry-after")


@pytest.mark.parametrize("engine_says,client_gets", [("0", "1"), ("999999999", "300"), ("12", "12"), ("soon", "5")])
def test_engine_retry_after_reaches_the_client_bounded(s, engine_says, client_gets):
    """The engine's Retry-After is passed on between 1 s and 5 min: a 0 would make clients retry
    in a tight loop, a huge value would park them for years."""
    s.config(
        answer_error={"status": 503, "body": {"error": {"message": "busy"}}, "headers": {"Retry-After": engine_says}}
    )
    r = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] x"}]},
    )
    assert r.status_code == 503 and r.headers["retry-after"] == client_gets


# ------------------------------------------------------------------------ drain


def test_sigterm_during_stream_drains(keyfile, tmp_path):
    """The answer in flight at SIGTERM completes; meanwhile /readyz is 503 and new requests get 503
    `draining` (polled, not after a fixed sleep: a loaded host acts on the signal later)."""
    engine_port, port = free_ports(2)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    with (
        running(fake_engine_argv(engine_port, {"answer_delay": 4.0}), engine_url + "/health"),
        running(proxy_argv("tiny", engine_url, port, "--api-key-file", str(keyfile)), url + "/health") as proxy,
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=20)
        result = {}

        def consume():
            stream = client.chat.completions.create(
                model=PUBLIC, stream=True, messages=[{"role": "user", "content": "[route:L2] slow"}]
            )
            result["content"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 10
        while not httpx.get(engine_url + "/_log").json() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the answer hop is in flight
        proxy.send_signal(signal.SIGTERM)
        assert wait_for(lambda: httpx.get(url + "/readyz").status_code == 503, timeout=3)
        r = httpx.post(
            url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": PUBLIC, "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "draining"
        t.join(15)
        assert result.get("content", "").startswith("answer-")
        assert proxy.wait(10) == 0


def test_sigterm_while_a_request_body_is_still_arriving_drains_it(keyfile):
    """A request admitted before SIGTERM whose body was still arriving (a slow client, a large
    upload) is in flight: the drain waits for its answer (here 6 s, past uvicorn's 5 s shutdown
    grace). It was counted only once its answer started: the drain ended at once and uvicorn
    cancelled the request after 5 s, the client got a bare 500 (a traceback in the log)."""
    import socket

    engine_port, port, metrics_port = free_ports(3)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    body = json.dumps({"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] a slow upload"}]}).encode()
    with (
        running(fake_engine_argv(engine_port, {"answer_delay": 6.0}), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, port, "--api-key-file", str(keyfile), "--metrics-port", str(metrics_port)),
            url + "/health",
        ) as proxy,
    ):
        conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer "
                + KEY.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body[:10]
            )
            deadline = time.monotonic() + 10
            while parse_prometheus(httpx.get(metrics_url).text).get("molctl_proxy_admitted_requests") != 1:
                assert time.monotonic() < deadline, "the request was not admitted"
                time.sleep(0.02)
            proxy.send_signal(signal.SIGTERM)
            draining = False
            while not draining and time.monotonic() < deadline:
                try:
                    draining = httpx.get(url + "/health").json()["status"] == "draining"
                except httpx.HTTPError:  # before the fix: the listener was closed at once
                    draining = True
                time.sleep(0.02)
            conn.sendall(body[10:])
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    break
        finally:
            conn.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert b"answer-" in answer
        assert proxy.wait(15) == 0


def test_a_stalled_upload_gets_a_408_and_does_not_hold_a_drain(keyfile):
    """A client that sends its head and part of its body, then nothing: after
    proxy.stream_write_timeout_s without a byte it gets a 408 and its connection is closed, so an
    admitted request that stalls does not hold a drain (SIGTERM, `molctl down`) to its deadline."""
    import socket

    engine_port, port, metrics_port = free_ports(3)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv(
                "tiny",
                engine_url,
                port,
                "--api-key-file",
                str(keyfile),
                "--metrics-port",
                str(metrics_port),
                "--set",
                "proxy.stream_write_timeout_s=1",
            ),
            url + "/health",
        ) as proxy,
    ):
        conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer "
                + KEY.encode()
                + b'\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model"'
            )
            deadline = time.monotonic() + 10
            while parse_prometheus(httpx.get(metrics_url).text).get("molctl_proxy_admitted_requests") != 1:
                assert time.monotonic() < deadline, "the request was not admitted"
                time.sleep(0.02)
            started = time.monotonic()
            proxy.send_signal(signal.SIGTERM)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        finally:
            conn.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"request_timeout"' in answer
        assert proxy.wait(15) == 0
        assert time.monotonic() - started < 10  # the drain (600 s by default) was not held


# ------------------------------------------------------------------------ SGLang


def test_sglang_adapter_naming(keyfile):
    engine_port, port = free_ports(2)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    with (
        running(fake_engine_argv(engine_port, {"served_name": "glm52-fp8-official"}), engine_url + "/health"),
        running(proxy_argv("venti-sglang", engine_url, port, "--api-key-file", str(keyfile)), url + "/health"),
    ):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(
            model="Macaron-V1-Venti", messages=[{"role": "user", "content": "[route:L2] x"}]
        )
        assert r.model == "Macaron-V1-Venti"
        log = httpx.get(engine_url + "/_log").json()
        route, answer = log[0], log[1]
        assert route["model"] == "glm52-fp8-official:L0" and route["payload"]["regex"] == "(L0|L1|L2|L3)"
        assert route["payload"]["chat_template_kwargs"] == {"enable_thinking": False}
        assert answer["model"] == "glm52-fp8-official:L2"
        wait_http(url + "/readyz")


def test_client_disconnect_cancels_the_engine_request(s):
    s.config(token_delay=0.2, answer_words=30)
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "[route:L2] long"}]},
    ) as r:
        for line in r.iter_lines():
            if '"content": "answer-' in line or '"content":"answer-' in line:
                break  # got the first token: hang up
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(e.get("event") == "client_gone" for e in s.log()):
        time.sleep(0.05)
    gone = [e for e in s.log() if e.get("event") == "client_gone"]
    assert gone and gone[0]["hop"] == "answer"
    assert s.metrics()["molctl_proxy_client_disconnects_total"] >= 1
    assert not s.log("summary")  # an abandoned answer is not recorded or summarised


def test_conversation_store_is_bounded():
    from molctl.proxy.conversations import CallBinding, TurnRecord
    from molctl.proxy.store.memory import MemoryStore

    now = [0.0]
    store = MemoryStore(max_entries=3, max_bytes=10_000, ttl_s=10, clock=lambda: now[0])
    for i in range(5):
        store.put_turn(bytes([i]), TurnRecord("L1", summary="s" * 10))
    assert store.stats()["entries"] == 3 and store.get_turn(bytes([0])) is None and store.get_turn(bytes([4]))
    store.put_call("t", "big", CallBinding("L2", "x" * 9_000, "f"))  # the byte budget evicts the oldest
    assert store.stats()["bytes"] <= 10_000 and store.get_call("t", "big") is not None
    now[0] = 11.0
    assert store.get_call("t", "big") is None  # idle TTL


def test_the_conversation_cache_accounts_for_the_memory_it_holds():
    """Found by the fuzz review: each cached turn held ~1.4 KB (a dataclass with an eager
    asyncio.Event and its waiter deque, plus the LRU's bookkeeping) while the byte cap counted
    ~200 bytes, so the 256 MiB cap of proxy memory meant ~1.7 GiB. Records are now slotted with a
    lazy Event, and the cache counts its per-entry overhead: accounted bytes within 1.5x of the
    memory really allocated."""
    import hashlib
    import tracemalloc

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.memory import MemoryStore

    store = MemoryStore()
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(5000)]
    summaries = [f"summary of answer {i} about request {i}" for i in range(5000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key, summary in zip(keys, summaries, strict=True):
            record = TurnRecord("L2")
            record.set_summary(summary)
            store.put_turn(key, record)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    accounted = store.stats()["bytes"] - sum(len(s) for s in summaries)  # the summaries existed before
    assert 1 / 1.5 <= held / accounted <= 1.5, (held / 5000, accounted / 5000)
    record = store.get_turn(keys[0])
    assert record.finished and record.done.is_set()  # a settled record's Event, made late, is set
