"""The contract's "Request fields" table against the code: every request field of OpenAI's API
reference for both endpoints, and every engine extension and refused field, is classified by the
proxy and named in the table, so a field the code learns or refuses cannot go undocumented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from molctl.engines import get_engine
from molctl.proxy.apis import chat_validation as validation
from molctl.proxy.apis.request_fields import REFUSED
from molctl.proxy.apis.responses import protocol as responses

ROOT = Path(__file__).resolve().parents[3]

# The request properties of CreateChatCompletionRequest and CreateResponse in openai/openai-openapi
# (openapi.json, December 2026), allOf parts included.
OPENAI_CHAT = (
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "messages",
    "metadata",
    "modalities",
    "model",
    "moderation",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
)
OPENAI_RESPONSES = (
    "background",
    "context_management",
    "conversation",
    "include",
    "input",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "metadata",
    "model",
    "moderation",
    "parallel_tool_calls",
    "previous_response_id",
    "prompt",
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
)


def table_section() -> str:
    text = (ROOT / "docs" / "contract.md").read_text()
    start = text.index("### Request fields")
    return text[start : text.index("\n### ", start + 1)]


def named(section: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", section))


def part(section: str, heading: str, end: str) -> str:
    return section[section.index(heading) : section.index(end)]


@pytest.mark.parametrize("field", OPENAI_CHAT)
def test_every_chat_field_of_the_reference_is_known_and_in_the_table(field):
    assert field in validation.KNOWN, f"chat field {field!r} is not classified by chat_validation.py"
    assert field in named(part(table_section(), "Chat Completions:", "Responses (")), field


@pytest.mark.parametrize("field", OPENAI_RESPONSES)
def test_every_responses_field_of_the_reference_is_known_and_in_the_table(field):
    assert field in responses.KNOWN, f"responses field {field!r} is not classified by apis/responses/protocol.py"
    assert field in named(part(table_section(), "Responses (", "Engine extensions")), field


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_every_engine_extension_and_refusal_is_in_the_table(kind):
    engine = get_engine(kind)
    section = table_section()
    missing = [
        f
        for f in (*engine.request_extensions, *engine.refused_extensions, *REFUSED)
        if f not in named(section) and not (f.startswith("guided_") and "guided_json" in section)
    ]
    assert not missing, f"{kind}: not in docs/contract.md's Request fields: {missing}"
