"""A Responses body is checked once, at its own edge (protocol.parse_request), and not again as a
chat request: so every body the edge accepts must translate into a chat body the chat edge
(chat_validation.check_request) accepts too, or the engine would get what chat refuses."""

from __future__ import annotations

import pytest

from molctl.engines import get_engine
from molctl.proxy.apis.chat_validation import check_request
from molctl.proxy.apis.request_fields import FieldPolicy
from molctl.proxy.apis.responses.protocol import parse_request
from tests.proxy_stack import PUBLIC, TINY

FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
ACCEPTED = {
    "text": {"input": "hi"},
    "every sampling field": {
        "input": "hi",
        "temperature": 0.2,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "max_output_tokens": 64,
        "top_logprobs": 3,
        "include": ["message.output_text.logprobs"],
    },
    "tools and a forced choice": {"input": "weather?", "tools": [FN], "tool_choice": "required"},
    "a named tool": {"input": "weather?", "tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"}},
    "a tool loop": {
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "tools": [FN],
    },
    "a JSON schema format": {
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
    },
    "instructions and reasoning": {"input": "hi", "instructions": "Be brief.", "reasoning": {"effort": "low"}},
    "an image": {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is it?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
                ],
            }
        ]
    },
    "stream with usage": {"input": "hi", "stream": True},
}


@pytest.mark.parametrize("name", ACCEPTED)
def test_an_accepted_responses_body_is_a_valid_chat_body(name):
    fields = FieldPolicy.of(TINY, get_engine("vllm"))
    req = parse_request({"model": PUBLIC, **ACCEPTED[name]}, PUBLIC, (), fields)
    check_request(req.chat_body(), PUBLIC, (), fields)  # raises a ProxyError (a 400) if chat refuses it
