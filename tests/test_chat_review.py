"""Review of the Chat Completions surface as real clients use it (the official `openai` SDK and raw
httpx): request parameters checked or forwarded as vLLM reads them, stream chunk shapes. The proxy
runs against the fake engine in strict mode (tests/test_proxy.py's stack)."""

from __future__ import annotations

import httpx

from tests.test_proxy import KEY, PUBLIC, keyfile, s, stack  # noqa: F401 - fixtures

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
    r = s.client.chat.completions.create(model=PUBLIC, messages=USER, prompt_cache_key="k", prompt_cache_retention="24h",
                                         extra_body={"prompt_cache_options": {"ttl": "1h"}})
    assert r.choices[0].message.content.startswith("answer-")
    payload = s.log("answer")[-1]["payload"]
    assert not {"prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"} & set(payload)
