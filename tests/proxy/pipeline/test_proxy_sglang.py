"""The proxy's contract against the scripted fake SGLang (tests/fake_sglang.py) with the built-in
venti-sglang profile, driven by the official `openai` SDK: adapters named `base:adapter`, the
route hop constrained by SGLang's `regex`, thinking off on the route hop, streaming, usage with
SGLang's cached tokens (--enable-cache-report), no adapter name reaching a client, /readyz
following the engine's adapter list."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.sglang_stack import KEY, PUBLIC, SERVED, sglang_stack

LEAK = re.compile(r"(?<![A-Za-z0-9])L[0-3](?![0-9])|glm52-fp8-official")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(KEY)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def stack(keyfile, tmp_path_factory):
    engine, proxy, st = sglang_stack(keyfile, tmp_path_factory.mktemp("logs"))
    with engine, proxy:
        yield st


@pytest.fixture
def s(stack):
    stack.reset()
    return stack


@pytest.mark.parametrize("stream", [False, True])
def test_adapter_naming_and_route_constraint(s, stream):
    messages = [{"role": "user", "content": "[route:L2] write a parser"}]
    if stream:
        chunks = list(s.client.chat.completions.create(model=PUBLIC, messages=messages, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("answer-")
        assert all(c.model == PUBLIC for c in chunks)
    else:
        r = s.client.chat.completions.create(model=PUBLIC, messages=messages)
        assert r.model == PUBLIC and r.choices[0].message.content.startswith("answer-")
    (route,) = s.log("route")
    assert route["model"] == f"{SERVED}:L0"
    assert route["payload"]["regex"] == "(L0|L1|L2|L3)"  # SGLang's constraint, not vLLM's structured_outputs
    assert "structured_outputs" not in route["payload"]
    assert route["payload"]["chat_template_kwargs"] == {"enable_thinking": False}
    (answer,) = s.log("answer")
    assert answer["model"] == f"{SERVED}:L2" and "lora_path" not in answer["payload"]
    assert all(e["model"] == f"{SERVED}:L2" for e in s.log("summary"))


def test_usage_reports_cached_tokens(s):
    r = s.client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L1] hi"}])
    assert r.usage.total_tokens == 13 and r.usage.prompt_tokens_details.cached_tokens == 4
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": PUBLIC,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "[route:L3] hi"}],
        },
    ) as resp:
        raw = "".join(resp.iter_text())
    frames = [f[6:] for f in raw.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    usage = json.loads(frames[-2])["usage"]
    assert usage["total_tokens"] == 13 and usage["prompt_tokens_details"] == {"cached_tokens": 4}


def test_tool_call_stream(s):
    chunks = list(
        s.client.chat.completions.create(
            model=PUBLIC,
            stream=True,
            tools=TOOLS,
            messages=[{"role": "user", "content": "[route:L2] [tool:get_weather] now"}],
        )
    )
    args = "".join(
        tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
    )
    assert json.loads(args)["city"] == "Paris"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_unloaded_adapter_error_names_no_adapter(s, stream):
    # SGLang answers 400 {"object": "error", "type": "BadRequestError", "message": "The following requested
    # LoRA adapters are not loaded: L2\nLoaded adapters: dict_keys(['L0', 'L1', 'L3'])."}: every loaded name
    s.config(adapters=["L0", "L1", "L3"])
    body = {"model": PUBLIC, "stream": stream, "messages": [{"role": "user", "content": "[route:L2] x"}]}
    with httpx.stream(
        "POST", s.proxy_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body
    ) as r:
        text = "".join(r.iter_text())
    assert r.status_code >= 400 or '"error"' in text
    assert not LEAK.search(text), text
    (answer,) = [e for e in s.log("answer") if "rejected" in e]
    assert answer["model"] == f"{SERVED}:L2" and "Loaded adapters: dict_keys(['L0', 'L1', 'L3'])" in answer["rejected"]


def test_every_route_hop_carries_the_regex(s):
    """SGLang has no `choice`: a route hop without `regex` samples freely (the fake then answers
    prose). Every route request the proxy sends, whatever the client's request, is constrained."""
    history = [
        {"role": "user", "content": "[route:L2] write a parser"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "[route:L1] now plan my trip"},
    ]
    s.client.chat.completions.create(model=PUBLIC, messages=history)
    list(s.client.chat.completions.create(model=PUBLIC, stream=True, messages=history))
    s.client.chat.completions.create(
        model=PUBLIC,
        tools=TOOLS,
        tool_choice="auto",
        messages=[{"role": "user", "content": "[route:L3] [tool:get_weather] x"}],
    )
    s.client.chat.completions.create(
        model=PUBLIC,
        max_tokens=5,
        temperature=1.5,
        response_format={"type": "json_object"},
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "[route:L0] hi"}]},
        ],
    )
    routes = s.log("route")
    assert len(routes) == 4
    for entry in routes:
        assert "unconstrained" not in entry, entry["payload"]
        assert entry["payload"]["regex"] == "(L0|L1|L2|L3)" and entry["model"] == f"{SERVED}:L0"
        assert not {"response_format", "json_schema", "ebnf", "tools"} & set(entry["payload"]), entry["payload"]


def test_readyz_follows_the_adapter_list(s):
    ready = s.proxy_url + "/readyz"
    assert httpx.get(ready).status_code == 200
    s.config(adapters=["L0", "L1", "L2"])
    deadline = time.monotonic() + 5
    while httpx.get(ready).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = httpx.get(ready)
    assert r.status_code == 503 and not LEAK.search(r.text)
    s.reset()
    deadline = time.monotonic() + 5
    while httpx.get(ready).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(ready).status_code == 200


def test_without_cache_report_no_cached_tokens(keyfile, tmp_path):
    engine, proxy, st = sglang_stack(keyfile, tmp_path, cache_report=False)
    with engine, proxy:
        r = st.client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L1] hi"}])
        assert r.usage.total_tokens == 13 and r.usage.prompt_tokens_details is None


def _stream(s, content="hello"):
    return httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        json={"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": content}]},
    )


def test_an_sglang_abort_before_the_first_token_is_a_real_http_error(s):
    """SGLang sends a scheduler abort that has a status code (queue full: 503; a request refused
    by the scheduler: 400) as a wrapped error frame under the 200 it already committed, as the
    first event (serving_chat.py _generate_chat_stream, PR #19357; serving_base.py
    create_streaming_error_response). Nothing reached the client yet: it gets the HTTP status."""
    s.config(stream_abort={"status": 503, "message": "The request queue is full.", "after": 0})
    r = _stream(s)
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    s.config(stream_abort={"status": 400, "message": f"Input {SERVED}:L0 was refused by the scheduler.", "after": 0})
    r = _stream(s)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert not LEAK.search(r.text), r.text


def test_an_sglang_abort_mid_stream_ends_it_with_an_error_frame(s):
    s.config(stream_abort={"status": 500, "message": "Internal error in the scheduler.", "after": 1}, answer_words=5)
    r = _stream(s)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    frames = [json.loads(e) for e in events[:-1]]
    text = "".join((c.get("delta") or {}).get("content") or "" for f in frames for c in f.get("choices") or [])
    assert text.startswith("answer-") and "word" not in text  # the piece before the abort, then nothing
    assert (
        frames[-1]["error"]["code"] == "engine_error"
        and "Internal error in the scheduler" in frames[-1]["error"]["message"]
    )
    assert not any(c.get("finish_reason") for f in frames for c in f.get("choices") or [])


def test_each_hop_carries_a_unique_rid_even_when_the_client_repeats_its_request_id(s):
    """SGLang takes the request id from the body's `rid` (not X-Request-Id) and refuses a second
    request in flight with one rid (PR #19035; a crash or hang before it). Two concurrent requests
    with the same client X-Request-Id must both be answered, each hop with its own rid that starts
    with the hop id (engine log lines still join the proxy's by prefix)."""
    import concurrent.futures

    s.config(answer_delay=0.5)

    def ask(text):
        return httpx.post(
            s.proxy_url + "/v1/chat/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "same-id"},
            json={"model": PUBLIC, "messages": [{"role": "user", "content": f"[route:L2] {text}"}]},
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, ["one", "two"]))
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    rids = [e["payload"]["rid"] for e in s.log("answer")]
    assert len(rids) == 2 and len(set(rids)) == 2 and all(r.startswith("same-id-answer-") for r in rids)
    assert all(e["payload"]["rid"].startswith("same-id-route-") for e in s.log("route"))
