"""Issue 9: the Responses API (`/v1/responses`) against the scripted fake engine (strict mode),
driven by the official `openai` SDK: create, stream, retrieve, delete, input_items, chains across
adapters, branches, tool loops over `previous_response_id`, tenants, and no adapter name anywhere."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from molctl.proxy.apis.responses import events as resp_events
from molctl.proxy.apis.responses import protocol
from tests.proxy_stack import IDENTITY, KEY, KEY2, LEAK, PUBLIC, RESPONSES_TOOLS, fold

AUTH = {"Authorization": f"Bearer {KEY}"}


def system(extra: str | None = None) -> dict:
    return {"role": "system", "content": IDENTITY["content"] + (f"\n\n{extra}" if extra else "")}


def create(s, **kw):
    return s.client.responses.create(model=PUBLIC, **kw)


def stream_create(s, **kw):
    """create(stream=True): the raw events, in order."""
    return list(s.client.responses.create(model=PUBLIC, stream=True, **kw))


# ------------------------------------------------------------------------ create / retrieve / delete


def test_create_with_a_string_input(s):
    r = create(s, input="[route:L2] write a parser", instructions="Be terse.", metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == PUBLIC and r.instructions == "Be terse." and r.metadata == {"k": "v"}
    assert r.output_text.startswith("answer-")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    assert r.usage.input_tokens == 10 and r.usage.output_tokens == 3 and r.usage.total_tokens == 13
    assert r.usage.input_tokens_details.cached_tokens == 4 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.previous_response_id is None and r.error is None and r.incomplete_details is None
    [answer] = s.log("answer")
    assert answer["model"] == "L2"
    assert answer["messages"] == [system("Be terse."), {"role": "user", "content": "[route:L2] write a parser"}]


def test_create_with_items_input(s):
    r = create(
        s,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "[route:L1] bonjour"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "salut"}]},
            {"role": "user", "content": "[route:L1] encore"},
        ],
        temperature=0.2,
        top_p=0.9,
        max_output_tokens=50,
    )
    assert r.status == "completed" and r.temperature == 0.2 and r.max_output_tokens == 50
    [answer] = s.log("answer")
    assert answer["messages"] == [
        system("Answer in French."),
        {"role": "user", "content": "[route:L1] bonjour"},
        {"role": "assistant", "content": "salut"},
        {"role": "user", "content": "[route:L1] encore"},
    ]
    assert answer["payload"]["temperature"] == 0.2 and answer["payload"]["max_tokens"] == 50


def test_retrieve_delete_then_404(s):
    r = create(s, input="[route:L3] hello")
    got = s.client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    deleted = httpx.delete(f"{s.proxy_url}/v1/responses/{r.id}", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        s.client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(s, input="again", previous_response_id=r.id)
    assert err.value.body == {
        "message": f"Previous response with id '{r.id}' not found (deleted, created with "
        "store=false, or expired or evicted from the proxy's store).",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert httpx.delete(f"{s.proxy_url}/v1/responses/{r.id}", headers=AUTH).status_code == 404


def test_input_items_paginated(s):
    r = create(s, input=[{"role": "user", "content": f"[route:L2] m{i}"} for i in range(5)])
    page = s.client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["[route:L2] m0", "[route:L2] m1"] and page.has_more
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    every = [i.content[0].text for i in s.client.responses.input_items.list(r.id, order="asc")]  # the SDK pages on
    assert every == [f"[route:L2] m{i}" for i in range(5)]
    desc = s.client.responses.input_items.list(r.id, limit=10)
    assert [i.content[0].text for i in desc.data] == [
        f"[route:L2] m{i}" for i in reversed(range(5))
    ] and not desc.has_more
    raw = httpx.get(
        f"{s.proxy_url}/v1/responses/{r.id}/input_items?limit=2&after={page.last_id}&order=asc", headers=AUTH
    ).json()
    assert [i["content"][0]["text"] for i in raw["data"]] == ["[route:L2] m2", "[route:L2] m3"]
    assert httpx.get(f"{s.proxy_url}/v1/responses/{r.id}/input_items?limit=0", headers=AUTH).status_code == 400


def test_input_items_with_the_sdks_include(s):
    """input_items.list(id, include=[...]) was a 400 "Unrecognized query parameter: include[]": the
    SDK sends arrays as `include[]=…`, the proxy knew only `include`. Found driving it with the SDK."""
    r = create(s, input="[route:L2] hi", include=["message.output_text.logprobs"])
    page = s.client.responses.input_items.list(r.id, include=["message.output_text.logprobs"])
    assert [i.content[0].text for i in page.data] == ["[route:L2] hi"]


def test_retrieve_with_stream_is_a_400_not_an_empty_stream(s):
    """responses.retrieve(id, stream=True) got the stored JSON object with a 200, which the SDK read
    as an event stream with no event: the caller saw an empty, successful stream. Found with the SDK."""
    r = create(s, input="[route:L2] hi")
    with pytest.raises(openai.BadRequestError) as err:
        s.client.responses.retrieve(r.id, stream=True)
    assert err.value.body["param"] == "stream"
    assert s.client.responses.retrieve(r.id).id == r.id


def test_retrieve_with_stream_false_in_any_spelling_and_cancel_as_openai_answers_it(s):
    """`?stream=False` / `?stream=0` are a plain retrieve (only `false` was); `responses.cancel`
    was a 404 "Unknown endpoint" (the SDK's NotFoundError: as if the response did not exist);
    OpenAI cancels only background responses and answers a 400 for the others."""
    r = create(s, input="[route:L2] hi")
    for value in ("False", "0", "false"):
        got = httpx.get(f"{s.proxy_url}/v1/responses/{r.id}?stream={value}", headers=AUTH)
        assert got.status_code == 200 and got.json()["id"] == r.id, (value, got.text)
    assert httpx.get(f"{s.proxy_url}/v1/responses/{r.id}?stream=True", headers=AUTH).status_code == 400
    with pytest.raises(openai.BadRequestError) as err:
        s.client.responses.cancel(r.id)
    assert "background" in err.value.message
    with pytest.raises(openai.NotFoundError):
        s.client.responses.cancel("resp_unknown")
    assert s.client.responses.retrieve(r.id).status == "completed"  # untouched


def test_a_context_overflow_names_input_not_messages(s):
    """The engine's window error names the chat request's `messages`, a parameter a Responses
    client never sent: OpenAI names `input`. Stream (before the first token) and not."""
    s.config(
        answer_error={
            "status": 400,
            "body": {
                "error": {
                    "message": "This model's maximum context length is 2048 tokens. However, your prompt contains 3000 input tokens.",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
        }
    )
    for stream in (False, True):
        r = httpx.post(
            s.proxy_url + "/v1/responses",
            headers=AUTH,
            json={"model": PUBLIC, "input": "[route:L2] long", "stream": stream},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "input"


def test_an_engine_400_on_the_response_format_names_text_format(s):
    s.config(
        answer_error={
            "status": 400,
            "body": {
                "error": {
                    "message": "Invalid JSON schema.",
                    "type": "BadRequestError",
                    "param": "response_format",
                    "code": 400,
                }
            },
        }
    )
    r = httpx.post(
        s.proxy_url + "/v1/responses",
        headers=AUTH,
        json={"model": PUBLIC, "input": "[route:L2] x", "text": {"format": {"type": "json_object"}}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_engine_params_read_as_the_responses_request_writes_them():
    """Chat nests a function tool's fields and a named tool_choice under `function`; a Responses
    request has them flat, so an engine 400 naming `tools[0].function.parameters` is shown as
    `tools[0].parameters` (the regression review)."""
    assert protocol.public_param("tools[0].function.parameters") == "tools[0].parameters"
    assert protocol.public_param("tools[12].function") == "tools[12]"
    assert protocol.public_param("tool_choice.function.name") == "tool_choice.name"
    assert protocol.public_param("messages[3].content") == "input"
    assert protocol.public_param("response_format.json_schema") == "text.format"
    assert protocol.public_param("temperature") == "temperature" and protocol.public_param(None) is None


def test_a_nan_temperature_is_a_400_naming_it(s):
    body = b'{"model": "%s", "input": "[route:L2] x", "temperature": NaN}' % PUBLIC.encode()
    r = httpx.post(s.proxy_url + "/v1/responses", headers={**AUTH, "Content-Type": "application/json"}, content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_include_encrypted_reasoning_is_accepted_as_codex_sends_it(s):
    """Codex CLI sends include=["reasoning.encrypted_content"] with store=false on every turn; a 400
    made the proxy unusable with it. There is no encrypted reasoning: the answer is as without it."""
    r = create(s, input="[route:L2] hi", store=False, include=["reasoning.encrypted_content"])
    assert r.status == "completed" and r.output_text.startswith("answer-")
    assert all(getattr(item, "encrypted_content", None) is None for item in r.output)


def test_background_at_its_default_is_accepted_and_long_ids_are_cut(s):
    """`background: false` (the default, sent by clients that send every field) was a 400 as an
    unknown parameter; a non-boolean is a 400 (true runs it in the background:
    test_responses_background_mode.py). A 10-100 KB id was quoted whole in the 404."""
    assert create(s, input="[route:L2] hi", extra_body={"background": False}).status == "completed"
    with pytest.raises(openai.BadRequestError) as err:
        create(s, input="[route:L2] hi", extra_body={"background": 1})
    assert err.value.body["param"] == "background"
    for call in (
        lambda: s.client.responses.retrieve("resp_" + "9" * 10_000),
        lambda: create(s, input="x", previous_response_id="resp_" + "9" * 100_000),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert len(err.value.body["message"]) < 300


def test_an_input_item_id_must_be_a_string(s):
    """A non-string item id (5) was stored and echoed as it was by input_items."""
    with pytest.raises(openai.BadRequestError) as err:
        create(s, input=[{"type": "message", "role": "user", "content": "hi", "id": 5}])
    assert err.value.body["param"] == "input[0].id"
    r = create(s, input=[{"type": "message", "role": "user", "content": "[route:L2] hi", "id": "msg_mine"}])
    assert [i.id for i in s.client.responses.input_items.list(r.id).data] == ["msg_mine"]


# ------------------------------------------------------------------------ stream


def test_stream_event_sequence(s):
    events = stream_create(s, input="[route:L2] stream me")
    types = [e.type for e in events]
    assert types[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(d.delta for d in deltas)
    assert text.startswith("answer-") and all(d.logprobs == [] and d.item_id == deltas[0].item_id for d in deltas)
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.usage.total_tokens == 13
    assert final.id == events[0].response.id and s.client.responses.retrieve(final.id).output_text == text


def test_stream_context_manager(s):
    with s.client.responses.stream(model=PUBLIC, input="[route:L1] plan a trip") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and final.status == "completed"
    assert s.log("answer")[0]["model"] == "L1"


def test_stream_error_before_first_token_keeps_its_status(s):
    s.config(
        answer_error={
            "status": 503,
            "body": {"error": {"message": "busy", "code": 503}},
            "headers": {"Retry-After": "7"},
        }
    )
    r = httpx.post(
        s.proxy_url + "/v1/responses", headers=AUTH, json={"model": PUBLIC, "input": "[route:L2] x", "stream": True}
    )
    assert (
        r.status_code == 503 and r.headers["retry-after"] == "7" and r.json()["error"]["code"] == "engine_unavailable"
    )


def test_stream_failure_after_first_token_is_response_failed(s):
    s.config(stream_error_after=1, answer_words=5)
    events = stream_create(s, input="[route:L2] will break")
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "server_error"
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        s.client.responses.retrieve(events[-1].response.id)


# ------------------------------------------------------------------------ chains


@pytest.mark.parametrize("stream", [False, True])
def test_chain_across_two_adapters_and_a_branch(s, stream):
    def ask(text, previous=None, **kw):
        if stream:
            final = stream_create(s, input=text, previous_response_id=previous, **kw)[-1].response
        else:
            final = create(s, input=text, previous_response_id=previous, **kw)
        assert final.status == "completed"
        return final

    u1 = {"role": "user", "content": f"[route:L2] write a parser {stream}"}
    u2 = {"role": "user", "content": "[route:L1] now plan my trip"}
    u3 = {"role": "user", "content": "[route:L2] fix the parser bug"}
    r1 = ask(u1["content"], instructions="Be terse.")
    r2 = ask(u2["content"], r1.id)
    r3 = ask(u3["content"], r2.id, instructions="Be kind.")
    assert r2.previous_response_id == r1.id and r3.previous_response_id == r2.id
    a1, a2 = r1.output_text, r2.output_text
    answers = s.log("answer")
    assert [e["model"] for e in answers] == ["L2", "L1", "L2"]
    # instructions are this request's only; the other adapter's turn is folded with its summary
    assert answers[0]["messages"] == [system("Be terse."), u1]
    assert answers[1]["messages"] == [system(), u1, fold(f"summary of {a1}"), u2]
    assert answers[2]["messages"] == [
        system("Be kind."),
        u1,
        {"role": "assistant", "content": a1},
        u2,
        fold(f"summary of {a2}"),
        u3,
    ]
    # a branch from the first response sees r1's conversation only
    u4 = {"role": "user", "content": "[route:L2] add tests instead"}
    r4 = ask(u4["content"], r1.id)
    assert r4.previous_response_id == r1.id
    assert s.answers()[3]["messages"] == [system(), u1, {"role": "assistant", "content": a1}, u4]
    assert [i.content[0].text for i in s.client.responses.input_items.list(r3.id).data] == [u3["content"]]


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_loop_stays_on_the_adapter(s, stream):
    first = f"[route:L3] [tool:get_weather] weather in Paris? {stream}"
    if stream:
        events = stream_create(s, input=first, tools=RESPONSES_TOOLS)
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
        r1 = events[-1].response
    else:
        r1 = create(s, input=first, tools=RESPONSES_TOOLS)
    [call] = r1.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}  # built from the tool's schema
    assert r1.tools[0].name == "get_weather"
    routes = len(s.log("route"))
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "18C sunny"}]
    if stream:
        with s.client.responses.stream(
            model=PUBLIC, input=follow, previous_response_id=r1.id, tools=RESPONSES_TOOLS
        ) as st:
            r2 = st.get_final_response()
    else:
        r2 = create(s, input=follow, previous_response_id=r1.id, tools=RESPONSES_TOOLS)
    assert "18C sunny" in r2.output_text
    assert len(s.log("route")) == routes  # no route hop
    answers = s.log("answer")
    assert [a["model"] for a in answers] == ["L3", "L3"]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
        ],
    }
    assert answers[1]["messages"] == [
        system(),
        {"role": "user", "content": first},
        assistant,
        {"role": "tool", "tool_call_id": call.call_id, "content": "18C sunny"},
    ]
    chat_tool = {k: RESPONSES_TOOLS[0][k] for k in ("name", "description", "parameters")}
    assert answers[1]["payload"]["tools"] == [{"type": "function", "function": chat_tool}]


def test_function_call_items_in_the_input(s):
    r = create(
        s,
        input=[
            {"role": "user", "content": "[route:L1] weather?"},
            {"type": "function_call", "call_id": "call-x", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call-x", "output": "2C snow"},
        ],
        tools=RESPONSES_TOOLS,
    )
    assert "2C snow" in r.output_text
    assert s.log("answer")[-1]["messages"][2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-x",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-x", "content": "2C snow"},
    ]


def test_store_false_keeps_nothing(s):
    r = create(s, input="[route:L2] ephemeral", store=False)
    assert r.status == "completed" and r.store is False
    with pytest.raises(openai.NotFoundError):
        s.client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        create(s, input="next", previous_response_id=r.id)


def test_another_tenants_id_is_404(s):
    r = create(s, input="[route:L2] mine")
    other = openai.OpenAI(base_url=s.proxy_url + "/v1", api_key=KEY2, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=PUBLIC, input="x", previous_response_id=r.id)
    assert (
        httpx.delete(f"{s.proxy_url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY2}"}).status_code
        == 404
    )
    assert s.client.responses.retrieve(r.id).id == r.id  # still there for its owner


# ------------------------------------------------------------------------ parameters


def test_parameters_mapped_and_rejected(s):
    r = create(
        s,
        input="[route:L2] json please",
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        tool_choice="auto",
        parallel_tool_calls=False,
        truncation="auto",
        user="u1",
        safety_identifier="s1",
        prompt_cache_key="k1",
        include=["message.output_text.logprobs"],
    )
    assert r.text.format.type == "json_schema" and r.parallel_tool_calls is False and r.truncation == "auto"
    payload = s.log("answer")[-1]["payload"]
    assert payload["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert payload["parallel_tool_calls"] is False
    assert "reasoning_effort" not in payload  # mapped as chat's reasoning_effort: the tiny profile has no mapping
    assert (
        protocol.parse_request({"model": "m", "input": "x", "reasoning": {"effort": "low"}}, "m").chat[
            "reasoning_effort"
        ]
        == "low"
    )
    assert payload["logprobs"] is True and payload["user"] == "u1"
    for extra, param in (
        ({"background": "yes"}, "background"),
        ({"conversation": ["c1"]}, "conversation"),  # served (apis.conversations): a malformed one
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": [7]}, "include[0]"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"type": "compaction_summary", "text": "x"}, {"role": "user", "content": "q"}]}, "input[0].type"),
        ({"truncation": "middle"}, "truncation"),
        ({"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
    ):
        body = {"model": PUBLIC, "input": "x", **extra}
        resp = httpx.post(s.proxy_url + "/v1/responses", headers=AUTH, json=body)
        assert resp.status_code == 400, (extra, resp.text)
        assert resp.json()["error"]["param"] == param
    resp = httpx.post(s.proxy_url + "/v1/responses", headers=AUTH, json={"model": "L2", "input": "x"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_metadata_has_openais_limits(s):
    """metadata took keys and values of any length (a 10,000-character value was stored and echoed):
    OpenAI's limits are 16 pairs, keys up to 64 characters, values up to 512. Found comparing the
    accepted request shapes with the API's."""
    assert create(s, input="x", metadata={"k" * 64: "v" * 512}).metadata == {"k" * 64: "v" * 512}
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {str(i): "v" for i in range(17)}, {"k": 1}):
        with pytest.raises(openai.BadRequestError) as err:
            create(s, input="x", metadata=metadata)
        assert err.value.body["param"] == "metadata", metadata


def test_length_finish_is_incomplete(s):
    s.config(answer_finish="length")
    r = create(s, input="[route:L2] long", max_output_tokens=16)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = stream_create(s, input="[route:L2] long too", max_output_tokens=16)
    assert events[-1].type == "response.incomplete"


def test_reasoning_is_a_reasoning_item():
    req = protocol.parse_request({"model": "m", "input": "x"}, "m")
    chat = {
        "choices": [
            {"message": {"role": "assistant", "content": "42", "reasoning_content": "think"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 7,
            "total_tokens": 12,
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    }
    r = resp_events.complete_response(req, "resp_1", 0, chat)
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    tr = resp_events.StreamTranslator(req, "resp_2", 0)
    events = tr.start()
    for delta in ({"reasoning_content": "thi"}, {"reasoning_content": "nk"}, {"content": "4"}, {"content": "2"}):
        events += tr.feed({"choices": [{"delta": delta}]})
    events += tr.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    closing, final = tr.finish_events()
    types = [e["type"] for e in events + closing]
    assert types.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in types
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "42" and final["output"][0]["content"][0]["text"] == "think"


# ------------------------------------------------------------------------ what clients see


def test_no_adapter_name_anywhere(s):
    seen: list[str] = []
    url = s.proxy_url + "/v1/responses"

    def record(resp: httpx.Response, body: str):
        seen.append(json.dumps(dict(resp.headers)))
        seen.append(body)

    ids = []
    for route in ("L0", "L1", "L2", "L3"):
        r = httpx.post(url, headers=AUTH, json={"model": PUBLIC, "input": f"[route:{route}] x"})
        assert r.status_code == 200
        record(r, r.text)
        ids.append(r.json()["id"])
        with httpx.stream(
            "POST",
            url,
            headers=AUTH,
            json={
                "model": PUBLIC,
                "stream": True,
                "tools": RESPONSES_TOOLS,
                "input": f"[route:{route}] [tool:get_weather] y",
            },
        ) as sr:
            record(sr, "".join(sr.iter_text()))
    for rid in ids:
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            r = httpx.get(s.proxy_url + path, headers=AUTH)
            record(r, re.sub(r"\[route:L\d\]", "", r.text))  # input items echo the client's own text
    for bad in (
        {"model": "L2", "input": "x"},
        {"model": PUBLIC, "input": "x", "previous_response_id": "resp_L2"},
        {"model": PUBLIC, "input": []},
    ):
        r = httpx.post(url, headers=AUTH, json=bad)
        assert r.status_code in (400, 404)
        record(r, r.text.replace("resp_L2", "resp_X"))  # the client's own id is echoed back
    s.config(
        answer_error={
            "status": 400,
            "body": {"error": {"message": "adapter L2 of tiny-mol-base rejected it", "code": 400}},
        }
    )
    r = httpx.post(url, headers=AUTH, json={"model": PUBLIC, "input": "[route:L2] z"})
    assert r.status_code == 400
    record(r, r.text)
    s.config(answer_error=None, stream_error_after=0)
    with httpx.stream("POST", url, headers=AUTH, json={"model": PUBLIC, "stream": True, "input": "[route:L2] z"}) as sr:
        record(sr, "".join(sr.iter_text()))
    leaks = [text for text in seen if LEAK.search(text)]
    assert not leaks, leaks[:2]


def test_memory_store_is_the_default_and_the_argument_is_used():
    from molctl.engines import get_engine
    from molctl.proxy.http.app import ProxyApp
    from molctl.proxy.store.memory import MemoryResponseStore
    from tests.proxy_stack import TINY

    store = MemoryResponseStore(max_entries=3)
    app = ProxyApp(TINY, get_engine(TINY.engine.kind), "http://127.0.0.1:9", ["k"], response_store=store)
    assert app.responses.store is store  # behind the proxy's async interface (LocalResponses)
    assert isinstance(
        ProxyApp(TINY, get_engine(TINY.engine.kind), "http://127.0.0.1:9", ["k"]).responses.store, MemoryResponseStore
    )


def test_tool_loop_continues_on_its_adapter_after_a_proxy_restart(s, keyfile, tmp_path):
    """The chat conversation state (tool-call bindings) is lost with the proxy; the durable
    response store keeps the route that issued the call, so the loop still skips the route hop."""
    from tests.helpers import free_port
    from tests.procs import proxy_argv, running

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = proxy_argv(
        "tiny", s.engine_url, port, "--api-key-file", str(keyfile), "--store", f"sqlite:{tmp_path / 'store.sqlite3'}"
    )
    env = {"MOLCTL_STATE_DIR": str(tmp_path / "state")}
    with running(argv, url + "/health", env=env, log=tmp_path / "p1.log"):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        r1 = client.responses.create(model=PUBLIC, input="[route:L1] [tool:get_weather] Oslo?", tools=RESPONSES_TOOLS)
        [call] = r1.output
    with running(argv, url + "/health", env=env, log=tmp_path / "p2.log"):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        routes = len(s.log("route"))
        r2 = client.responses.create(
            model=PUBLIC,
            previous_response_id=r1.id,
            tools=RESPONSES_TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "2C"}],
        )
        assert "2C" in r2.output_text
        assert len(s.log("route")) == routes
        assert [a["model"] for a in s.log("answer")] == ["L1", "L1"]


def test_a_large_body_is_prepared_off_the_loop(s):
    from molctl.proxy.http.body import BIG_BODY

    r = create(s, input=[{"role": "user", "content": "[route:L2] " + "x" * (BIG_BODY + 10_000)}])  # parsed in steps
    assert r.status == "completed"
    r2 = create(s, input="[route:L2] and then?", previous_response_id=r.id)
    assert r2.status == "completed" and s.log("answer")[-1]["messages"][1]["content"].endswith("x" * 100)


def test_an_in_process_store_behind_the_proxys_async_interface_writes_a_large_record_from_a_worker_thread():
    """LocalResponses (molctl/proxy/store/local.py): gets and small puts on the event loop's
    thread, a large record (text, message count, or a large request's hint) from a worker thread
    when the store's puts are slow (SQLite's); the memory store's always on the loop."""
    import asyncio
    import threading
    import time

    from molctl.proxy.store.local import BIG_RECORD, MANY_MESSAGES, LocalResponses, as_proxy_store
    from molctl.proxy.store.memory import MemoryResponseStore

    class Recording(MemoryResponseStore):
        slow_puts = True  # as SQLite's

        def __init__(self):
            super().__init__()
            self.threads: dict[str, str] = {}

        def put_response(self, record, wait=True):
            self.threads[record["id"]] = threading.current_thread().name
            super().put_response(record, wait)

    def record(rid: str, messages: list[dict]) -> dict:
        return {"id": rid, "tenant": "t", "created_at": time.time(), "messages": messages}

    async def main(store: Recording) -> tuple[str, object, bool, bool]:
        proxy_store = as_proxy_store(store)
        assert isinstance(proxy_store, LocalResponses) and as_proxy_store(proxy_store) is proxy_store
        await proxy_store.available()  # nothing to be unavailable
        await proxy_store.put_response(record("small", [{"role": "user", "content": "hi"}]))
        await proxy_store.put_response(record("long", [{"role": "user", "content": "x" * (BIG_RECORD + 1)}]))
        await proxy_store.put_response(record("many", [{"role": "user", "content": "m"}] * (MANY_MESSAGES + 1)))
        await proxy_store.put_response(record("hinted", [{"role": "user", "content": "hi"}]), big=True)
        got = await proxy_store.get_previous("t", "small")
        return (
            threading.current_thread().name,
            got,
            await proxy_store.delete_response("t", "small"),
            await proxy_store.delete_response("t", "small"),
        )

    store = Recording()
    loop_thread, got, deleted, again = asyncio.run(main(store))
    assert store.threads["small"] == loop_thread
    assert all(store.threads[k] != loop_thread for k in ("long", "many", "hinted"))
    assert got["id"] == "small" and deleted is True and again is False
    memory = Recording()
    memory.slow_puts = False  # the memory store's own value
    loop_thread, *_ = asyncio.run(main(memory))
    assert all(memory.threads[k] == loop_thread for k in ("small", "long", "many", "hinted"))
    from molctl.proxy.store.sqlite.store import SqliteResponseStore

    assert SqliteResponseStore.slow_puts and not MemoryResponseStore.slow_puts


def test_the_memory_store_is_safe_for_a_put_from_a_worker_thread_during_a_get_on_the_loop():
    """A large record's put runs in a worker thread (LocalResponses) while the loop reads: a get
    that finds an expired record and removes it must not fail when the thread's put evicts that
    same record in between (it raised KeyError: a 500 on GET /v1/responses/{id})."""
    import threading

    from molctl.proxy.store.memory import MemoryResponseStore

    def record(rid: str, created_at: float) -> dict:
        return {"id": rid, "tenant": "t", "created_at": created_at, "messages": []}

    writer: list[threading.Thread] = []

    def clock() -> float:  # read by the get between finding the record and removing it
        if not writer:
            writer.append(threading.Thread(target=store.put_response, args=(record("new", 100.0),)))
            writer[0].start()
            writer[0].join(0.5)  # the worker thread's put runs now, unless the store makes it wait
        return 100.0

    store = MemoryResponseStore(max_entries=1, ttl_s=10, clock=clock)
    store.put_response(record("old", 0.0))  # expired at the clock's 100
    assert store.get_response("t", "old") is None
    writer[0].join(10)
    assert store.get_response("t", "new")["id"] == "new" and store.stats()["responses"] == 1
