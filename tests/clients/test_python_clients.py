"""Python clients, unchanged, against the proxy: the official `openai` SDK (chat, Responses and
its `responses.stream` helper), LiteLLM (`completion`, `responses`), LangChain's `ChatOpenAI`
(with and without `use_responses_api`) and pydantic-ai's OpenAI chat and Responses models. Each
runs a plain answer, a streamed answer, a multi-turn conversation and a full tool loop; the
Responses clients also a `previous_response_id` chain and a `store: false` round trip."""

from __future__ import annotations

import pytest

from tests.clients.cases import BASIC, RESPONSES, check
from tests.clients.drivers import python_client_argv

CLIENTS = {
    "openai-chat": BASIC,
    "openai-responses": RESPONSES,
    "litellm-completion": BASIC,
    "litellm-responses": RESPONSES,
    "langchain-chat": BASIC,
    "langchain-responses": RESPONSES,
    "pydantic-ai-chat": BASIC,
    "pydantic-ai-responses": RESPONSES,
}


@pytest.mark.parametrize("client,case", [(c, k) for c, cases in CLIENTS.items() for k in cases])
def test_python_client(runs, client, case):
    results, log = runs(python_client_argv(client))
    assert set(results) == set(CLIENTS[client]), results.keys()
    check(case, results[case], log)
