"""Issue 42: POST /v1/responses/compact against the scripted fake engine, driven by the `openai`
SDK: a chain's turns whose summaries the summary hop wrote are folded into their user messages
and one compaction item each, with no model call; a turn without a summary stays verbatim; the
compacted items continue the session on /v1/responses; bad fields are 400s naming them."""

from __future__ import annotations

import time

import httpx
import pytest

from molctl.proxy.apis.responses.compaction_item import decode_compaction
from tests.proxy_stack import IDENTITY, KEY, PUBLIC, TINY

AUTH = {"Authorization": f"Bearer {KEY}"}


def fold_text(summary: str) -> str:
    return TINY.prompts.fold.replace("{summary}", summary)


def compact(s, **body) -> httpx.Response:
    return httpx.post(s.proxy_url + "/v1/responses/compact", json={"model": PUBLIC, **body}, headers=AUTH, timeout=30)


def compacted_until(s, want_compactions: int, **body) -> dict:
    """Compact until the summaries of the turns are written (the summary hop runs after each answer)."""
    deadline = time.monotonic() + 60
    while True:
        r = compact(s, **body)
        assert r.status_code == 200, r.text
        out = r.json()
        if sum(i["type"] == "compaction" for i in out["output"]) >= want_compactions or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def test_a_chain_is_folded_from_its_summaries_without_a_model_call(s):
    texts = ["[route:L2] write a parser", "[route:L1] plan a trip", "[route:L3] draw a page"]
    previous, answers = None, []
    for text in texts:
        r = s.client.responses.create(model=PUBLIC, input=text, previous_response_id=previous)
        previous = r.id
        answers.append(r.output_text)
    out = compacted_until(s, 3, previous_response_id=previous)
    hops = len(s.log())
    assert out["object"] == "response.compaction" and isinstance(out["created_at"], int)
    assert out["usage"]["total_tokens"] == 0
    kinds = [(i["type"], i.get("role")) for i in out["output"]]
    assert kinds == [("message", "user"), ("compaction", None)] * 3
    assert [i["content"][0]["text"] for i in out["output"][0::2]] == texts
    folds = [decode_compaction(i["encrypted_content"]) for i in out["output"][1::2]]
    assert folds == [fold_text(f"summary of {a}") for a in answers]
    # the SDK reads it too, and the compacted items continue the session
    again = s.client.responses.compact(model=PUBLIC, previous_response_id=previous)
    assert [i.type for i in again.output] == ["message", "compaction"] * 3
    assert len(s.log()) == hops  # no engine request for either compaction
    s.reset()
    nxt = s.client.responses.create(
        model=PUBLIC, input=[*out["output"], {"role": "user", "content": "[route:L1] and now?"}]
    )
    assert nxt.status == "completed"
    [answer] = s.log("answer")
    expected = [{"role": "system", "content": IDENTITY["content"]}]
    for text, a in zip(texts, answers, strict=True):
        expected += [{"role": "user", "content": text}, {"role": "assistant", "content": fold_text(f"summary of {a}")}]
    assert answer["messages"] == [*expected, {"role": "user", "content": "[route:L1] and now?"}]
    listed = s.client.responses.input_items.list(nxt.id, order="asc").data
    assert [i.type for i in listed][:2] == ["message", "compaction"]


def test_turns_without_a_summary_are_kept_verbatim(s):
    items = [
        {"role": "user", "content": "a question the proxy never answered"},
        {"role": "assistant", "content": "an answer from elsewhere"},
        {"role": "user", "content": "[route:L1] go on"},
    ]
    out = compact(s, input=items).json()
    assert [(i["type"], i["role"]) for i in out["output"]] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert out["output"][1]["content"][0]["text"] == "an answer from elsewhere"
    assert s.log() == []


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": None, "input": "x"}, 400, "model"),
        ({"input": 5}, 400, "input"),
        ({}, 400, "input"),
        ({"input": "x", "stream": True}, 400, "stream"),
        ({"input": [{"type": [1], "role": "user", "content": "x"}]}, 400, "input[0].type"),
        ({"previous_response_id": ["resp_1"]}, 400, "previous_response_id"),
        ({"previous_response_id": "resp_" + "0" * 24}, 404, "previous_response_id"),
    ],
)
def test_bad_compact_fields(s, body, status, param):
    r = compact(s, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_a_compaction_item_not_made_here_is_a_400(s):
    r = httpx.post(
        s.proxy_url + "/v1/responses",
        json={
            "model": PUBLIC,
            "input": [{"type": "compaction", "encrypted_content": "gAAAA-openai"}, {"role": "user", "content": "hi"}],
        },
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content"


def test_a_tool_loop_turn_folds_into_its_user_message_and_one_item(s):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    first = s.client.responses.create(model=PUBLIC, input="[route:L3] [tool:get_weather] weather?", tools=tools)
    [call] = [i for i in first.output if i.type == "function_call"]
    second = s.client.responses.create(
        model=PUBLIC,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
        previous_response_id=first.id,
    )
    verbatim = compact(s, previous_response_id=first.id).json()["output"]  # the turn is still in progress
    assert [i["type"] for i in verbatim] == ["message", "function_call"]
    assert verbatim[1]["call_id"] == call.call_id and verbatim[1]["name"] == "get_weather"
    out = compacted_until(s, 1, previous_response_id=second.id)["output"]
    assert [i["type"] for i in out] == ["message", "compaction"]
    assert decode_compaction(out[1]["encrypted_content"]) == fold_text(f"summary of {second.output_text}")


def test_a_long_context_is_compacted_off_the_event_loop_alike(s):
    """Past BIG_ITEMS messages the turns are looked up in a worker thread: the same answer."""
    from molctl.proxy.http.body import BIG_ITEMS

    items = []
    for i in range(BIG_ITEMS // 2 + 1):
        items += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    out = compact(s, input=items).json()["output"]
    assert len(out) == len(items)
    assert [i["content"][0]["text"] for i in out] == [i["content"] for i in items]
