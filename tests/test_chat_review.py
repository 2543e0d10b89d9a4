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
