"""Values the engine would take silently or misread are 400s naming the field (issue 40): NaN in
`seed`, in a tool's parameter schema or a `response_format` / `text.format` schema (Python's JSON
reader takes NaN; the engine's guided decoding would get it), an unknown chat content part type,
`strict: "yes"`, were all forwarded to the engine."""

from __future__ import annotations

import httpx
import pytest

from tests.proxy_stack import KEY, PUBLIC

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
USER = b'[{"role": "user", "content": "[route:L2] x"}]'
TOOL = b'{"type": "function", "function": {"name": "f", "parameters": %s}}'


def chat(s, extra: bytes, messages: bytes = USER) -> httpx.Response:
    body = b'{"model": "%s", "messages": %s, %s}' % (PUBLIC.encode(), messages, extra)
    return httpx.post(s.proxy_url + "/v1/chat/completions", headers=HEADERS, content=body)


@pytest.mark.parametrize(
    "extra, param",
    [
        (b'"seed": NaN', "seed"),
        (b'"seed": "5"', "seed"),
        (b'"seed": 1.5', "seed"),
        (b'"seed": 18446744073709551616', "seed"),
        (b'"tools": [' + TOOL % b'{"type": "object", "maximum": NaN}' + b"]", "tools[0].function.parameters.maximum"),
        (
            b'"tools": [' + TOOL % b'{"type": "object", "properties": {"n": {"enum": [1, Infinity]}}}' + b"]",
            "tools[0].function.parameters.properties.n.enum[1]",
        ),
        (
            b'"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]',
            "tools[0].function.strict",
        ),
        (
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": -Infinity}}}',
            "response_format.json_schema.schema.minimum",
        ),
        (
            b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "strict": "yes"}}',
            "response_format.json_schema.strict",
        ),
    ],
)
def test_a_chat_value_the_engine_would_misread_is_a_400_naming_it(s, extra, param):
    """Guards forwarding: each reached the engine as sent."""
    r = chat(s, extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not s.log("answer")


def test_an_unknown_content_part_type_is_a_400_naming_it(s):
    """Guards forwarding: the engine's "Unknown part type" reached the client as its 400, unnamed."""
    messages = b'[{"role": "user", "content": [{"type": "text", "text": "[route:L2] x"}, {"type": "imagee_url"}]}]'
    r = chat(s, b'"stream": false', messages)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].type", r.text
    assert not s.log("answer")


def test_good_values_still_reach_the_engine(s):
    """Guards the checks' edges: an integer seed, finite schemas, strict true, known part types."""
    tool = TOOL % b'{"type": "object", "properties": {"n": {"type": "number", "maximum": 1e300}}}'
    extra = b'"seed": -3, "tools": [' + tool + b'], "response_format": {"type": "json_object"}'
    messages = b'[{"role": "user", "content": [{"type": "text", "text": "[route:L2] x"}, {"type": "input_text", "text": "y"}]}]'
    r = chat(s, extra, messages)
    assert r.status_code == 200, r.text
    assert s.answers()[-1]["payload"]["seed"] == -3


@pytest.mark.parametrize(
    "fmt, param",
    [
        (b'{"type": "json_schema", "name": "n", "schema": {"maximum": NaN}}', "text.format.schema.maximum"),
        (b'{"type": "json_schema", "name": "n", "schema": {}, "strict": "yes"}', "text.format.strict"),
    ],
)
def test_a_responses_schema_the_engine_would_misread_is_a_400_naming_it(s, fmt, param):
    """Guards forwarding in the Responses API: the same values in `text.format`."""
    body = b'{"model": "%s", "input": "[route:L2] x", "text": {"format": %s}}' % (PUBLIC.encode(), fmt)
    r = httpx.post(s.proxy_url + "/v1/responses", headers=HEADERS, content=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
