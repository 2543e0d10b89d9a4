"""Issue 42: the Conversations API (/v1/conversations) and `conversation` on POST /v1/responses,
against the scripted fake engine (strict mode), driven by the official `openai` SDK: create with
items and metadata, get, update, delete, items list / add / get / delete, per tenant; a
conversation's earlier turns reach the hops as a chain's do (the other adapter's turn folded
with its summary); every bad field a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.proxy_stack import IDENTITY, KEY, KEY2, PUBLIC, fold

AUTH = {"Authorization": f"Bearer {KEY}"}


def system() -> dict:
    return {"role": "system", "content": IDENTITY["content"]}


def post(s, path: str, body, key: str = KEY) -> httpx.Response:
    return httpx.post(s.proxy_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def get(s, path: str, key: str = KEY) -> httpx.Response:
    return httpx.get(s.proxy_url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_create_get_update_delete(s):
    conv = s.client.conversations.create(
        metadata={"topic": "demo"},
        items=[{"type": "message", "role": "user", "content": "hello"}],
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "demo"}
    assert isinstance(conv.created_at, int)
    got = s.client.conversations.retrieve(conv.id)
    assert got.model_dump() == conv.model_dump()
    updated = s.client.conversations.update(conv.id, metadata={"topic": "changed"})
    assert updated.metadata == {"topic": "changed"} and updated.created_at == conv.created_at
    assert s.client.conversations.retrieve(conv.id).metadata == {"topic": "changed"}
    deleted = s.client.conversations.delete(conv.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (conv.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError):
        s.client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        s.client.conversations.delete(conv.id)
    empty = post(s, "/v1/conversations", None)  # no body at all: an empty conversation
    assert empty.status_code == 200 and empty.json()["metadata"] == {}


def test_items_list_add_get_delete(s):
    conv = s.client.conversations.create(
        items=[
            {"type": "message", "role": "user", "content": "one", "id": "msg_one"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "two"}]},
        ]
    )
    added = s.client.conversations.items.create(
        conv.id,
        items=[
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        ],
    )
    assert [i.type for i in added.data] == ["function_call", "function_call_output"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[1].id
    desc = get(s, f"/v1/conversations/{conv.id}/items").json()
    assert [i["type"] for i in desc["data"]] == ["function_call_output", "function_call", "message", "message"]
    assert desc["object"] == "list" and desc["has_more"] is False
    asc = get(s, f"/v1/conversations/{conv.id}/items?order=asc&limit=2").json()
    assert asc["data"][0]["id"] == "msg_one" and asc["data"][0]["content"] == [{"type": "input_text", "text": "one"}]
    assert asc["has_more"] is True and len(asc["data"]) == 2
    rest = get(s, f"/v1/conversations/{conv.id}/items?order=asc&after={asc['last_id']}").json()
    assert [i["type"] for i in rest["data"]] == ["function_call", "function_call_output"]
    sdk = [i.id for i in s.client.conversations.items.list(conv.id, order="asc", limit=1)]  # the SDK pages on
    assert sdk == [i["id"] for i in asc["data"] + rest["data"]]
    item = s.client.conversations.items.retrieve("msg_one", conversation_id=conv.id)
    assert item.id == "msg_one" and item.role == "user"
    after_delete = s.client.conversations.items.delete("msg_one", conversation_id=conv.id)
    assert after_delete.id == conv.id and after_delete.object == "conversation"
    with pytest.raises(openai.NotFoundError):
        s.client.conversations.items.retrieve("msg_one", conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        s.client.conversations.items.delete("msg_one", conversation_id=conv.id)
    dup = post(
        s, f"/v1/conversations/{conv.id}/items", {"items": [{"role": "user", "content": "x", "id": added.first_id}]}
    )
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "items[0].id"


def test_another_tenants_conversation_is_a_404(s):
    conv = s.client.conversations.create(items=[{"role": "user", "content": "secret"}])
    other = openai.OpenAI(base_url=s.proxy_url + "/v1", api_key=KEY2, max_retries=0)
    for call in (
        lambda: other.conversations.retrieve(conv.id),
        lambda: other.conversations.update(conv.id, metadata={}),
        lambda: other.conversations.delete(conv.id),
        lambda: other.conversations.items.list(conv.id),
        lambda: other.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
        lambda: other.responses.create(model=PUBLIC, input="[route:L1] hi", conversation=conv.id),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert conv.id in err.value.message
    assert len(s.client.conversations.items.list(conv.id).data) == 1  # untouched
    r = get(s, f"/v1/responses/{conv.id}")  # a conversation id is no response id
    assert r.status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
        ("/v1/conversations", {"metadata": "x"}, "metadata"),
        ("/v1/conversations", {"items": {"role": "user"}}, "items"),
        ("/v1/conversations", {"items": [{"type": [1, 2], "role": "user", "content": "hi"}]}, "items[0].type"),
        ("/v1/conversations", {"items": [{"type": "message", "role": "robot", "content": "hi"}]}, "items[0].role"),
        ("/v1/conversations", {"items": [{"role": "user", "content": "hi", "id": ["a"]}]}, "items[0].id"),
        ("/v1/conversations", {"items": [{"type": "item_reference", "id": "msg_x"}]}, "items[0].type"),
        ("/v1/conversations", {"items": [{"role": "user", "content": "hi", "status": ["done"]}]}, "items[0].status"),
        ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ("/v1/conversations", {"title": "x"}, "title"),
        ("/v1/conversations", [1], None),
    ],
)
def test_bad_create_fields_are_400s_naming_them(s, path, body, param):
    r = post(s, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_update_items_and_query_fields_are_400s(s):
    conv = s.client.conversations.create()
    for path, body, param in [
        (f"/v1/conversations/{conv.id}", {}, "metadata"),
        (f"/v1/conversations/{conv.id}", {"metadata": {"k": "v" * 513}}, "metadata"),
        (f"/v1/conversations/{conv.id}/items", {}, "items"),
        (f"/v1/conversations/{conv.id}/items", {"items": []}, "items"),
        (
            f"/v1/conversations/{conv.id}/items",
            {"items": [{"type": "function_call", "call_id": 1}]},
            "items[0].call_id",
        ),
    ]:
        r = post(s, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), (path, body, r.text)
    for query, param in [
        ("limit=0", "limit"),
        ("limit=x", "limit"),
        ("order=up", "order"),
        ("page=2", "page"),
        ("include=x", "include"),
    ]:
        r = get(s, f"/v1/conversations/{conv.id}/items?{query}")
        assert (r.status_code, r.json()["error"]["param"]) == (400, param)
    ok = get(
        s,
        f"/v1/conversations/{conv.id}/items?include[]=message.output_text.logprobs&include=reasoning.encrypted_content",
    )
    assert ok.status_code == 200, ok.text
    assert get(s, "/v1/conversations/conv_nope").status_code == 404
    assert get(s, "/v1/conversations/" + "a" * 5000).status_code == 404


@pytest.mark.parametrize(
    ("conversation", "extra", "param"),
    [
        (["conv_x"], {}, "conversation"),
        ({"id": ["conv_x"]}, {}, "conversation.id"),
        ({"id": "conv_x", "x": 1}, {}, "conversation.x"),
        ("CONV", {"previous_response_id": "resp_1"}, "conversation"),
    ],
)
def test_bad_conversation_on_responses_is_a_400(s, conversation, extra, param):
    r = post(s, "/v1/responses", {"model": PUBLIC, "input": "hi", "conversation": conversation, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if "previous_response_id" in extra:
        assert r.json()["error"]["code"] == "mutually_exclusive_parameters"
    assert s.log() == []  # refused before any engine work


def test_unknown_conversation_on_responses_is_a_404(s):
    r = post(s, "/v1/responses", {"model": PUBLIC, "input": "hi", "conversation": "conv_" + "0" * 48})
    assert r.status_code == 404 and r.json()["error"]["param"] == "conversation"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_in_a_conversation_fold_earlier_turns_as_a_chain(s, stream):
    conv = s.client.conversations.create(metadata={"stream": str(stream)})

    def ask(text: str):
        if stream:
            events = list(s.client.responses.create(model=PUBLIC, input=text, conversation=conv.id, stream=True))
            final = events[-1].response
        else:
            final = s.client.responses.create(model=PUBLIC, input=text, conversation={"id": conv.id})
        assert final.status == "completed" and final.conversation.id == conv.id
        return final

    u1 = {"role": "user", "content": f"[route:L2] write a parser {stream}"}
    u2 = {"role": "user", "content": "[route:L1] now plan my trip"}
    u3 = {"role": "user", "content": "[route:L2] fix the parser bug"}
    r1 = ask(u1["content"])
    r2 = ask(u2["content"])
    r3 = ask(u3["content"])
    assert s.client.responses.retrieve(r3.id).conversation.id == conv.id
    a1, a2 = r1.output_text, r2.output_text
    answers = s.log("answer")
    assert [e["model"] for e in answers] == ["L2", "L1", "L2"]
    assert answers[1]["messages"] == [system(), u1, fold(f"summary of {a1}"), u2]
    assert answers[2]["messages"] == [
        system(),
        u1,
        {"role": "assistant", "content": a1},
        u2,
        fold(f"summary of {a2}"),
        u3,
    ]
    items = s.client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant")] * 3
    assert [i.id for i in items[1::2]] == [r1.output[0].id, r2.output[0].id, r3.output[0].id]
    assert s.client.conversations.retrieve(conv.id).metadata == {"stream": str(stream)}
    resent = post(s, "/v1/responses", {"model": PUBLIC, "conversation": conv.id, "input": [items[0].model_dump()]})
    assert resent.status_code == 400 and "Duplicate item" in resent.json()["error"]["message"]


def test_a_tool_call_in_a_conversation_must_be_answered_and_stays_on_its_adapter(s):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    conv = s.client.conversations.create()
    first = s.client.responses.create(
        model=PUBLIC, input="[route:L3] [tool:get_weather] weather?", tools=tools, conversation=conv.id
    )
    [call] = [i for i in first.output if i.type == "function_call"]
    unanswered = post(s, "/v1/responses", {"model": PUBLIC, "input": "and?", "tools": tools, "conversation": conv.id})
    assert unanswered.status_code == 400 and unanswered.json()["error"]["param"] == "input"
    second = s.client.responses.create(
        model=PUBLIC,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
        conversation=conv.id,
    )
    assert "sunny" in second.output_text
    assert [e["model"] for e in s.answers()] == ["L3", "L3"] and len(s.log("route")) == 1  # sticky
    kinds = [i.type for i in s.client.conversations.items.list(conv.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output", "message"]
