"""Issue 42's edge checks on /v1/responses, at the parser: tools echoed in OpenAI's shapes (function
tools strict by default, unknown keys dropped, a hosted tool missing a key its schema requires a
400), `max_output_tokens` below OpenAI's floor of 16 a 400 with OpenAI's code, `tools[].strict`
and `text.format.strict` type-checked, `tool_choice: "required"` without a function tool a 400.
The same shapes through the proxy: test_responses_shapes_match_openai_schema.py."""

from __future__ import annotations

import pytest

from molctl.proxy.apis.responses.protocol import parse_request
from molctl.proxy.errors import ProxyError
from tests.proxy_stack import PUBLIC

FN = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def refused(**body) -> ProxyError:
    with pytest.raises(ProxyError) as err:
        parse_request({"model": PUBLIC, "input": "hi", **body}, PUBLIC)
    assert err.value.status == 400
    return err.value


def test_a_function_tool_is_echoed_strict_by_default_without_unknown_keys():
    req = parse_request({"model": PUBLIC, "input": "hi", "tools": [{**FN, "colour": "red"}]}, PUBLIC)
    assert req.tools == [{**FN, "description": None, "strict": True}]
    assert "strict" not in req.chat["tools"][0]["function"]  # the engine gets strict only when sent
    req = parse_request({"model": PUBLIC, "input": "hi", "tools": [{**FN, "strict": False}]}, PUBLIC)
    assert req.tools[0]["strict"] is False and req.chat["tools"][0]["function"]["strict"] is False


def test_a_hosted_tool_keeps_its_schema_keys_and_an_unpublished_type_is_echoed_as_sent():
    tools = [{"type": "mcp", "server_label": "x", "extra": 1}, {"type": "future_tool", "knob": 2}]
    req = parse_request({"model": PUBLIC, "input": "hi", "tools": tools}, PUBLIC)
    assert req.tools == [{"type": "mcp", "server_label": "x"}, {"type": "future_tool", "knob": 2}]


@pytest.mark.parametrize(
    "tool, param",
    [
        ({"type": "file_search"}, "tools[0].vector_store_ids"),
        ({"type": "mcp", "server_url": "https://x"}, "tools[0].server_label"),
        ({"type": "custom"}, "tools[0].name"),
        ({"type": "code_interpreter"}, "tools[0].container"),
    ],
    ids=str,
)
def test_a_hosted_tool_without_a_required_key_is_a_400_naming_it(tool, param):
    err = refused(tools=[tool])
    assert (err.param, err.code) == (
        param,
        "missing_required_parameter",
    ) and "Missing required parameter" in err.message


@pytest.mark.parametrize("limit", [0, 1, 12, 15])
def test_max_output_tokens_below_16_is_openai_s_400(limit):
    err = refused(max_output_tokens=limit)
    assert (err.param, err.code) == ("max_output_tokens", "integer_below_min_value")
    assert f"got {limit}" in err.message


def test_max_output_tokens_of_16_is_taken():
    assert parse_request({"model": PUBLIC, "input": "hi", "max_output_tokens": 16}, PUBLIC).chat["max_tokens"] == 16


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{**FN, "strict": "yes"}]}, "tools[0].strict"),
        ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": 1}}}, "text.format.strict"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "web_search"}]}, "tool_choice"),
        ({"max_output_tokens": "20"}, "max_output_tokens"),
    ],
    ids=str,
)
def test_wrong_typed_or_unservable_fields_are_400s_naming_them(body, param):
    assert refused(**body).param == param
