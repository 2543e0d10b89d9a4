"""Chat Completions request parameters as real clients send them (the official `openai` SDK and raw
httpx): checked or forwarded as vLLM reads them, and the stream chunk shapes. The proxy runs against
the fake engine in strict mode (tests/proxy/pipeline/test_proxy.py's stack)."""

from __future__ import annotations

import httpx

from tests.proxy_stack import KEY, PUBLIC, TOOLS

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "[route:L2] hello"}]


def post(s, **body) -> httpx.Response:
    return httpx.post(s.proxy_url + "/v1/chat/completions", headers=AUTH, json={"model": PUBLIC, **body}, timeout=30)


def bad_request(s, param: str, **body) -> dict:
    """A 400 naming `param`, answered before any hop reached the engine."""
    before = len(s.log())
    r = post(s, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert len(s.log()) == before
    return error


def test_max_completion_tokens_wins_over_max_tokens_as_vllm_reads_them(s):
    """vLLM (ChatCompletionRequest.build_tok_params) uses max_completion_tokens when both are set;
    the proxy sent the client's max_tokens instead."""
    s.client.chat.completions.create(model=PUBLIC, messages=USER, max_tokens=5, max_completion_tokens=7)
    assert s.log("answer")[-1]["payload"]["max_tokens"] == 7
    s.client.chat.completions.create(model=PUBLIC, messages=USER, max_tokens=5)
    assert s.log("answer")[-1]["payload"]["max_tokens"] == 5


def test_null_rejected_parameters_are_not_given_and_modalities_text_is_accepted(s):
    """Every rejected parameter is nullable in OpenAI's schema (null: not given); clients that
    serialise a full request model send them as null. `modalities: ["text"]` asks for text only,
    what every answer is. Both were 400s."""
    nulls = dict.fromkeys(("functions", "function_call", "audio", "modalities", "prediction", "web_search_options"))
    assert post(s, messages=USER, **nulls).status_code == 200
    r = s.client.chat.completions.create(model=PUBLIC, messages=USER, modalities=["text"])
    assert r.choices[0].message.content.startswith("answer-")
    assert "modalities" not in s.log("answer")[-1]["payload"]
    bad_request(s, "modalities", messages=USER, modalities=["text", "audio"])
    bad_request(s, "functions", messages=USER, functions=[{"name": "f", "parameters": {}}])
    bad_request(s, "audio", messages=USER, audio={"voice": "alloy", "format": "wav"})


def test_prompt_cache_hints_are_accepted_and_ignored_like_prompt_cache_key(s):
    """The SDK's prompt_cache_retention / prompt_cache_options are cache hints like
    prompt_cache_key (accepted and ignored); they were 400 'Unrecognized request argument'."""
    r = s.client.chat.completions.create(
        model=PUBLIC,
        messages=USER,
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        extra_body={"prompt_cache_options": {"ttl": "1h"}},
    )
    assert r.choices[0].message.content.startswith("answer-")
    payload = s.log("answer")[-1]["payload"]
    assert not {"prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"} & set(payload)


def test_tool_choice_is_checked_as_vllm_checks_it(s):
    """vLLM (protocol.py check_tool_usage) refuses a tool_choice without tools or naming no tool;
    forwarded, the client got the engine's 400 without `param`. `auto`/`none` without tools
    change nothing, so they are accepted and not forwarded."""
    bad_request(s, "tool_choice", messages=USER, tool_choice="required")
    bad_request(
        s, "tool_choice", messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
    )
    bad_request(s, "tool_choice", messages=USER, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    bad_request(s, "tool_choice", messages=USER, tools=TOOLS, tool_choice="any")
    bad_request(s, "tool_choice", messages=USER, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    for choice in ("auto", "none"):
        s.client.chat.completions.create(model=PUBLIC, messages=USER, tool_choice=choice)
        assert "tool_choice" not in s.log("answer")[-1]["payload"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = s.client.chat.completions.create(
        model=PUBLIC,
        tools=TOOLS,
        tool_choice=named,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "[route:L2] [tool:get_weather] x"}],
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    payload = s.log("answer")[-1]["payload"]
    assert payload["tool_choice"] == named and payload["tools"] == TOOLS and payload["parallel_tool_calls"] is False


def test_top_logprobs_needs_logprobs(s):
    """vLLM (protocol.py check_logprobs) and OpenAI refuse top_logprobs > 0 without logprobs: true."""
    bad_request(s, "top_logprobs", messages=USER, top_logprobs=3)
    bad_request(s, "top_logprobs", messages=USER, logprobs=True, top_logprobs=21)
    bad_request(s, "top_logprobs", messages=USER, logprobs=True, top_logprobs="3")
    assert post(s, messages=USER, top_logprobs=0).status_code == 200
    s.client.chat.completions.create(model=PUBLIC, messages=USER, logprobs=True, top_logprobs=3)
    payload = s.log("answer")[-1]["payload"]
    assert payload["logprobs"] is True and payload["top_logprobs"] == 3


def test_logprobs_of_a_last_chunk_with_an_empty_delta_reach_the_stream_client(s):
    """vLLM's last chunk for a token its parser swallowed has an empty delta, the finish_reason and
    that token's logprobs (chat_completion/serving.py: `DeltaMessage()` for the final output); the
    proxy dropped the chunk, and the logprobs with it."""
    s.config(answer_logprobs=True, answer_words=2)
    tokens, content = [], ""
    for chunk in s.client.chat.completions.create(model=PUBLIC, messages=USER, stream=True, logprobs=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else None) or []]
    assert "".join(tokens) == content + "<|im_end|>"
    r = s.client.chat.completions.create(model=PUBLIC, messages=USER, logprobs=True)
    assert "".join(t.token for t in r.choices[0].logprobs.content) == r.choices[0].message.content
