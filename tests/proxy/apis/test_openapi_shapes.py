"""The proxy's answers have the shapes OpenAI's OpenAPI spec (github.com/openai/openai-openapi)
gives them, and its requests accept what the spec accepts: a chat message's `refusal` (required,
nullable), the stream's first delta as OpenAI sends it, a Responses object's non-nullable echoes
(`parallel_tool_calls`, `tool_choice`) at their defaults when the request sent null, an empty
`input_items` page's string ids, and an explicit null for each optional or nullable request field
as "not set". The official openai SDK is the client, against a proxy in front of the fake engine
(strict mode)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.proxy_stack import KEY, PUBLIC, own_stack

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "[route:L2] hello"}]
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}

# CreateResponse's optional fields the proxy serves or accepts (every one is optional; all but
# `input`, `model`, `text`, `tool_choice`, `tools`, `top_logprobs`, `user` and
# `prompt_cache_options` are nullable too): null means "not set" for each
OPTIONAL_FIELDS = [
    "background",
    "context_management",
    "include",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "moderation",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "truncation",
    "user",
    "conversation",
    "prompt",
]
# nested optional fields, explicit null (EasyInputMessage.type, ItemReferenceParam.type, FunctionTool's,
# Reasoning's, ResponseTextParam's, the content parts' and items' own)
NESTED_NULLS = {
    "message type": {"input": [{"type": None, "role": "user", "content": "[route:L2] hello"}]},
    "message id, status, phase": {
        "input": [
            {
                "type": "message",
                "role": "user",
                "id": None,
                "status": None,
                "phase": None,
                "content": [{"type": "input_text", "text": "[route:L2] hi", "prompt_cache_breakpoint": None}],
            }
        ]
    },
    "function tool": {
        "tools": [{**TOOL, "description": None, "strict": None, "output_schema": None, "allowed_callers": None}]
    },
    "reasoning": {
        "reasoning": {"effort": None, "summary": None, "generate_summary": None, "context": None, "mode": None}
    },
    "text": {"text": {"format": None, "verbosity": None}},
    "json schema format": {
        "text": {
            "format": {
                "type": "json_schema",
                "name": "x",
                "schema": {"type": "object"},
                "strict": None,
                "description": None,
            }
        }
    },
    "function call and output": {
        "input": [
            {"role": "user", "content": "[route:L2] weather?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": "{}",
                "id": None,
                "status": None,
                "namespace": None,
                "caller": None,
            },
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": "sunny",
                "id": None,
                "status": None,
                "name": None,
                "namespace": None,
                "caller": None,
            },
        ],
        "tools": [TOOL],
    },
}


def post(s, path: str, **body) -> httpx.Response:
    return httpx.post(s.proxy_url + path, headers=AUTH, json={"model": PUBLIC, **body}, timeout=30)


# ------------------------------------------------------------------------ chat completions


def test_a_chat_completion_message_carries_a_null_refusal(s):
    """ChatCompletionResponseMessage requires `refusal` (nullable): the proxy left it out."""
    raw = s.client.chat.completions.with_raw_response.create(model=PUBLIC, messages=USER)
    message = json.loads(raw.text)["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert "refusal" in message and message["refusal"] is None
    # the SDK's message, sent back as the next turn's history (refusal: null in it), continues the conversation
    first = raw.parse().choices[0].message
    again = s.chat([*USER, first, {"role": "user", "content": "[route:L2] more"}])
    assert again.choices[0].message.content and again.choices[0].message.refusal is None


def test_a_tool_call_message_carries_a_null_refusal_too(s):
    raw = s.client.chat.completions.with_raw_response.create(
        model=PUBLIC,
        messages=[{"role": "user", "content": "[route:L2] [tool:get_weather] now"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
    )
    message = json.loads(raw.text)["choices"][0]["message"]
    assert message["tool_calls"] and message["content"] is None and message["refusal"] is None


def test_the_first_stream_delta_is_openais(s):
    """The first chunk's delta is OpenAI's {"role": "assistant", "content": "", "refusal": null};
    every delta holds only ChatCompletionStreamResponseDelta's fields (none required)."""
    chunks = list(s.client.chat.completions.create(model=PUBLIC, messages=USER, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_unset=True) for c in chunks if c.choices]
    assert deltas[0] == {"role": "assistant", "content": "", "refusal": None}
    spec = {"content", "function_call", "tool_calls", "role", "refusal", "reasoning_content", "reasoning"}
    assert all(set(d) <= spec for d in deltas), deltas
    assert sum("role" in d for d in deltas) == 1


# ------------------------------------------------------------------------ the Responses API


def test_null_parallel_tool_calls_and_tool_choice_echo_their_defaults(s):
    """Response requires `parallel_tool_calls` (default true) and `tool_choice`, neither nullable:
    a request's null was echoed as null."""
    r = s.client.responses.create(
        model=PUBLIC, input="[route:L2] hi", parallel_tool_calls=None, tool_choice=None, truncation=None, tools=[TOOL]
    )
    assert r.parallel_tool_calls is True and r.tool_choice == "auto" and r.truncation == "disabled"
    raw = httpx.get(f"{s.proxy_url}/v1/responses/{r.id}", headers=AUTH).json()
    assert (raw["parallel_tool_calls"], raw["tool_choice"], raw["truncation"]) == (True, "auto", "disabled")
    # a value sent is echoed as sent
    r = s.client.responses.create(
        model=PUBLIC, input="[route:L2] hi", parallel_tool_calls=False, tool_choice="none", tools=[TOOL]
    )
    assert r.parallel_tool_calls is False and r.tool_choice == "none"


def test_a_streamed_response_echoes_the_defaults_too(s):
    events = list(
        s.client.responses.create(
            model=PUBLIC, input="[route:L2] hi", parallel_tool_calls=None, tool_choice=None, stream=True
        )
    )
    for event in (events[0], events[-1]):  # response.created, response.completed
        assert event.response.parallel_tool_calls is True and event.response.tool_choice == "auto", event.type


def test_an_empty_input_items_page_has_string_ids(s):
    """ResponseItemList requires `first_id` and `last_id` as strings (not nullable): an empty
    page had null ids, which a client typed from the spec cannot read."""
    r = s.client.responses.create(model=PUBLIC, input="[route:L2] hi")
    full = httpx.get(f"{s.proxy_url}/v1/responses/{r.id}/input_items", headers=AUTH).json()
    assert full["first_id"] == full["data"][0]["id"] and full["last_id"] == full["data"][-1]["id"]
    empty = httpx.get(f"{s.proxy_url}/v1/responses/{r.id}/input_items?after={full['last_id']}", headers=AUTH).json()
    assert empty == {"object": "list", "data": [], "first_id": "", "last_id": "", "has_more": False}
    page = s.client.responses.input_items.list(r.id, after=full["last_id"])
    assert page.data == [] and not page.has_next_page()


@pytest.mark.parametrize("field", OPTIONAL_FIELDS)
def test_an_explicit_null_of_an_optional_request_field_is_not_set(s, field):
    r = post(s, "/v1/responses", input="[route:L2] hi", **{field: None})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["parallel_tool_calls"] is True and body["tool_choice"] == "auto"
    assert body["tools"] == [] and body["metadata"] == {}
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}


@pytest.mark.parametrize("case", NESTED_NULLS, ids=str)
def test_an_explicit_null_of_a_nested_optional_field_is_not_set(s, case):
    """A null `type` on an input message was 'The input item type 'None' is not supported'."""
    body = {"input": "[route:L2] hi", **NESTED_NULLS[case]}
    r = post(s, "/v1/responses", **body)
    assert r.status_code == 200, r.text


def test_an_item_reference_with_a_null_type_is_a_reference(s):
    """ItemReferenceParam's `type` is optional and nullable: {"id": ...} alone names an item."""
    first = s.client.responses.create(model=PUBLIC, input="[route:L2] hi")
    ref = first.output[0].id
    for item in ({"type": None, "id": ref}, {"id": ref}):
        r = post(
            s,
            "/v1/responses",
            input=[{"role": "user", "content": "[route:L2] hi"}, item, {"role": "user", "content": "[route:L2] again"}],
        )
        assert r.status_code == 200, r.text
        answer = s.answers()[-1]
        assert {"role": "assistant", "content": first.output_text} in answer["messages"], answer["messages"]


def test_nulls_are_not_set_with_request_fields_reject_too(keyfile, tmp_path):
    """`proxy.request_fields: reject` refused a null `reasoning.generate_summary` (a field of
    OpenAI's Reasoning) as an unknown field."""
    with own_stack(keyfile, tmp_path, "--set", "proxy.request_fields=reject") as st:
        for case, extra in NESTED_NULLS.items():
            r = post(st, "/v1/responses", **{"input": "[route:L2] hi", **extra})
            assert r.status_code == 200, (case, r.text)
        r = post(st, "/v1/responses", input="[route:L2] hi", reasoning={"generate_summary": "auto"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.generate_summary"  # a value is no null
