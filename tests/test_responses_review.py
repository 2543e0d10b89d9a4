"""An adversarial review of the Responses API (`/v1/responses`) as a client on the official `openai`
SDK sees it, against the real proxy and the scripted fake engine (tests/fake_engine.py, strict).
Each test names the defect it pins, how it was found, and the OpenAI shape it was checked against."""

from __future__ import annotations

import json

import httpx

from molctl.proxy import responses
from tests.test_proxy import KEY, PUBLIC, keyfile, s, stack  # noqa: F401 - fixtures

AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def raw_events(s, **body) -> list[dict]:
    """POST /v1/responses with stream=true: the events as sent (each frame's JSON, in order)."""
    with httpx.stream("POST", s.proxy_url + "/v1/responses", headers=AUTH, timeout=30,
                      json={"model": PUBLIC, "stream": True, **body}) as r:
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
    req = responses.parse_request({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}, "m")
    tr = responses.StreamTranslator(req, "resp_1", 0)
    lp = {"content": [{"token": "4", "logprob": -0.1, "bytes": [52], "top_logprobs": []}]}
    events = tr.start()
    events += tr.feed({"choices": [{"delta": {"reasoning_content": "think"}}]})
    events += tr.feed({"choices": [{"delta": {"content": "4"}, "logprobs": lp}]})
    sent = [json.dumps(e) for e in events]  # as they would go out, one frame at a time
    events += tr.feed({"choices": [{"delta": {"content": "2"}, "logprobs": lp}]})
    events += tr.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    closing, final = tr.finish_events()
    assert [json.dumps(e) for e in events[:len(sent)]] == sent
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [a["item"]["content"] for a in added] == [[], []]
    parts = [e["part"] for e in events if e["type"] == "response.content_part.added"]
    assert parts == [{"type": "reasoning_text", "text": ""},
                     {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
    assert final["output"][1]["content"][0]["text"] == "42" and len(final["output"][1]["content"][0]["logprobs"]) == 2
