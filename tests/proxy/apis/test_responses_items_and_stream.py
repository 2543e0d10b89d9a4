"""The Responses API (`/v1/responses`) as a client on the official `openai` SDK sees it: streamed
items and the SDK's live snapshot, stream translator events, echoed items with
`previous_response_id`, function calls and their outputs, empty answers. Against the real proxy and
the scripted fake engine (tests/fake_engine.py, strict); each test names the OpenAI shape it was
checked against."""

from __future__ import annotations

import json

import httpx

from molctl.proxy.apis.responses import events as resp_events
from molctl.proxy.apis.responses import protocol
from tests.proxy_stack import KEY, PUBLIC

AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def raw_events(s, **body) -> list[dict]:
    """POST /v1/responses with stream=true: the events as sent (each frame's JSON, in order)."""
    with httpx.stream(
        "POST", s.proxy_url + "/v1/responses", headers=AUTH, timeout=30, json={"model": PUBLIC, "stream": True, **body}
    ) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    return [json.loads(block.split("data: ", 1)[1]) for block in text.split("\n\n") if "data: " in block]


# ------------------------------------------------------------------------ stream events


def test_a_streamed_item_is_announced_empty_and_the_sdks_live_snapshot_is_the_text_so_far(s):
    """`response.output_item.added` carried the message item with its first delta already in its
    content (and `response.content_part.added`'s part, its logprobs): the event held a reference
    to the item the translator went on filling, and was serialised after. The SDK builds its live
    snapshot from `output_item.added` + `content_part.added` + each delta, so `event.snapshot`
    of the first delta read "answer-N answer-N " (the first delta twice). Found streaming with
    `client.responses.stream(...)` and printing each delta event's snapshot.

    OpenAI's stream (developers.openai.com/api/reference/resources/responses/streaming-events):
    `output_item.added` announces the item as generation begins (a message: status in_progress,
    `content: []`), `content_part.added` the empty part, then `output_text.delta` fills it; the
    SDK's accumulator (openai/lib/streaming/responses/_responses.py accumulate_event) relies on it."""
    s.config(answer_words=3)
    with s.client.responses.stream(model=PUBLIC, input="[route:L2] stream me") as stream:
        so_far = ""
        for event in stream:
            if event.type == "response.output_text.delta":
                so_far += event.delta
                assert event.snapshot == so_far
        final = stream.get_final_response()
    assert final.output_text == so_far and so_far.count("answer-") == 1
    events = raw_events(s, input="[route:L2] [tool:get_weather] and with reasoning?", tools=TOOLS)
    events += raw_events(s, input="[route:L2] plain")
    for event in events:
        if event["type"] == "response.output_item.added":
            item = event["item"]
            assert item["status"] == "in_progress"
            assert item.get("content", []) == [] and item.get("arguments", "") == "", item
        if event["type"] == "response.content_part.added":
            assert event["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_a_stream_translator_event_is_a_snapshot_of_its_moment():
    """The same defect in the translator alone, with logprobs (the fake engine sends none) and
    reasoning: an event made while a chunk is fed must not change when later deltas arrive."""
    req = protocol.parse_request({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}, "m")
    tr = resp_events.StreamTranslator(req, "resp_1", 0)
    lp = {"content": [{"token": "4", "logprob": -0.1, "bytes": [52], "top_logprobs": []}]}
    events = tr.start()
    events += tr.feed({"choices": [{"delta": {"reasoning_content": "think"}}]})
    events += tr.feed({"choices": [{"delta": {"content": "4"}, "logprobs": lp}]})
    sent = [json.dumps(e) for e in events]  # as they would go out, one frame at a time
    events += tr.feed({"choices": [{"delta": {"content": "2"}, "logprobs": lp}]})
    events += tr.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    closing, final = tr.finish_events()
    assert [json.dumps(e) for e in events[: len(sent)]] == sent
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [a["item"]["content"] for a in added] == [[], []]
    parts = [e["part"] for e in events if e["type"] == "response.content_part.added"]
    assert parts == [
        {"type": "reasoning_text", "text": ""},
        {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    ]
    assert final["output"][1]["content"][0]["text"] == "42" and len(final["output"][1]["content"][0]["logprobs"]) == 2


# ------------------------------------------------------------------------ previous_response_id + input


def post(s, **body) -> httpx.Response:
    return httpx.post(s.proxy_url + "/v1/responses", headers=AUTH, json={"model": PUBLIC, **body}, timeout=30)


def test_items_echoed_with_previous_response_id_are_refused_not_sent_twice(s):
    """A client that continues with `previous_response_id` and also resends the previous response's
    output (its `function_call` item, or its message) had those items sent to the engine twice:
    the stored chain holds them already, so the answer hop got the assistant's tool call twice in
    a row, and the tool turn lost its adapter (the input was no longer tool results only: a route
    hop). Found replaying a tool loop as some clients (Vercel AI SDK, avante.nvim) wrongly do.

    OpenAI refuses it: 400 `Duplicate item found with id fc_…. Remove duplicate items from your
    input and try again.`, `param: "input"` (vercel/ai#15492, continuedev/continue#10723,
    earendil-works/pi#5165); the same for two input items with one id. Echoed `reasoning` items
    stay ignored (the contract)."""
    r1 = s.client.responses.create(model=PUBLIC, input="[route:L3] [tool:get_weather] Oslo?", tools=TOOLS)
    [call] = r1.output
    answers = len(s.log("answer"))
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "2C"}
    r = post(s, previous_response_id=r1.id, tools=TOOLS, input=[call.model_dump(exclude_none=True), output])
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"Duplicate item found with id {call.id}. Remove duplicate items from your input and try again.",
        "type": "invalid_request_error",
        "param": "input",
        "code": "invalid_request_error",
    }
    r2 = s.client.responses.create(model=PUBLIC, previous_response_id=r1.id, tools=TOOLS, input=[output])
    assert "2C" in r2.output_text
    [message] = r2.output
    again = {"type": "message", "role": "user", "content": "[route:L3] and tomorrow?"}
    for items in (
        [message.model_dump(exclude_none=True), again],  # the previous response's output
        [{"id": i.id, **again} for i in s.client.responses.input_items.list(r2.id).data][:1],
    ):
        r = post(s, previous_response_id=r2.id, input=items)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    mine = {"id": "msg_mine", **again}
    r = post(s, input=[mine, mine])
    assert r.status_code == 400 and "msg_mine" in r.json()["error"]["message"]
    assert len(s.log("answer")) == answers + 1  # only r2 reached the engine
    # echoed reasoning items are ignored, as before; a message without an id is new
    r3 = post(s, previous_response_id=r2.id, input=[{"type": "reasoning", "id": "rs_1", "summary": []}, again, again])
    assert r3.status_code == 200, r3.text


def test_a_function_call_must_be_answered_and_an_output_must_answer_a_call(s):
    """A turn after a response that called a function, with no `function_call_output` for it (a
    plain user message), reached the engine with the assistant's tool call left dangling; a
    `function_call_output` whose `call_id` matches no call reached it as a tool result of nothing.
    Neither failed: the model saw a broken conversation. Found continuing a tool-call response
    with a user message.

    OpenAI refuses both with a 400, `param: "input"`: `No tool output found for function call
    call_….` (openai/openai-agents-python#673, tjardoo/openai-client#124) and `No tool call found
    for function call output with call_id ….`"""
    r1 = s.client.responses.create(model=PUBLIC, input="[route:L3] [tool:get_weather] Oslo?", tools=TOOLS)
    [call] = r1.output
    answers = len(s.log("answer"))
    r = post(s, previous_response_id=r1.id, input="[route:L3] never mind")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"No tool output found for function call {call.call_id}."
    assert r.json()["error"]["param"] == "input"
    r = post(
        s, previous_response_id=r1.id, input=[{"type": "function_call_output", "call_id": "call-nope", "output": "x"}]
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "No tool call found for function call output with call_id call-nope."
    r = post(
        s,
        input=[
            {"role": "user", "content": "q"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"role": "user", "content": "q2"},
        ],
    )
    assert r.status_code == 400 and "c1" in r.json()["error"]["message"], r.text
    r = post(
        s, input=[{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "c2", "output": "x"}]
    )
    assert r.status_code == 400 and "c2" in r.json()["error"]["message"], r.text
    assert len(s.log("answer")) == answers
    # answered, the loop goes on as before (on its adapter, no route hop)
    r2 = s.client.responses.create(
        model=PUBLIC,
        previous_response_id=r1.id,
        tools=TOOLS,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "2C"},
            {"role": "user", "content": "thanks"},
        ],
    )
    assert r2.status == "completed"


def test_every_parallel_call_needs_its_output():
    """Two calls in the previous response, one output in the input: OpenAI's `No tool output
    found for function call …` for the other (the translation alone, with a stored record)."""
    calls = [{"id": f"call-{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in (1, 2)]
    prev = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}],
        "input_items": [],
        "response": {"output": []},
        "route": "L1",
    }
    req = protocol.parse_request(
        {"model": "m", "input": [{"type": "function_call_output", "call_id": "call-1", "output": "x"}]}, "m"
    )
    req.prev, req.history = prev, list(prev["messages"])
    try:
        req.chat_body()
    except protocol.ProxyError as exc:
        assert (
            exc.status == 400
            and exc.message == "No tool output found for function call call-2."
            and exc.param == "input"
        )
    else:
        raise AssertionError("accepted")
    both = protocol.parse_request(
        {
            "model": "m",
            "input": [{"type": "function_call_output", "call_id": f"call-{i}", "output": "x"} for i in (2, 1)],
        },
        "m",
    )
    both.prev, both.history = prev, list(prev["messages"])
    assert [m["role"] for m in both.chat_body()["messages"]] == ["user", "assistant", "tool", "tool"]


def test_an_empty_streamed_answer_still_has_its_message_item():
    """An answer with no text and no tool call (an empty answer, or reasoning only) was, streamed,
    a Response with no message item (`output: []`, or the reasoning item alone), while the same
    answer not streamed has one empty message item (`output_items`): the stored Response, what
    `retrieve` returns, depended on `stream`. Found comparing the two paths' output item by item
    (a model that answered with reasoning only).

    OpenAI's text answer is a `message` item with one `output_text` part, announced and closed by
    `output_item.added` / `content_part.added` / `output_text.done` / `content_part.done` /
    `output_item.done` (developers.openai.com/api/reference/resources/responses/streaming-events)."""
    for deltas in ([], [{"reasoning_content": "think"}]):
        req = protocol.parse_request({"model": "m", "input": "x"}, "m")
        tr = resp_events.StreamTranslator(req, "resp_1", 0)
        events = tr.start() + tr.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        for delta in deltas:
            events += tr.feed({"choices": [{"delta": delta}]})
        events += tr.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]})
        closing, final = tr.finish_events()
        message = {"role": "assistant", "content": "", **(deltas[0] if deltas else {})}
        plain = resp_events.complete_response(
            req, "resp_2", 0, {"choices": [{"message": message, "finish_reason": "stop"}]}
        )
        assert [i["type"] for i in final["output"]] == [i["type"] for i in plain["output"]]
        assert final["output"][-1]["content"] == [
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ]
        types = [e["type"] for e in events + closing]
        assert types[-6:] == [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert [e["sequence_number"] for e in events + closing] == list(range(len(types)))
