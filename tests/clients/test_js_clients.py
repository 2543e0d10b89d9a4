"""JavaScript clients, unchanged, against the proxy (the versions tests/clients/js/package-lock.json
pins): the Vercel AI SDK's OpenAI provider, Responses (`provider.responses`) and chat
(`provider.chat`), with `generateText`, `streamText` and a tool loop of `stopWhen: stepCountIs(n)`,
and the official `openai` npm package (chat.completions, and responses with its `responses.stream`
helper). Each runs a plain answer, a streamed answer, a multi-turn conversation and a full tool
loop; the Responses clients also a `previous_response_id` chain and a `store: false` round trip."""

from __future__ import annotations

import pytest

from tests.clients.cases import BASIC, RESPONSES, check
from tests.clients.drivers import js_client_argv

CLIENTS = {"ai-sdk-responses": RESPONSES, "ai-sdk-chat": BASIC, "openai-chat": BASIC, "openai-responses": RESPONSES}


@pytest.mark.parametrize("client,case", [(c, k) for c, cases in CLIENTS.items() for k in cases])
def test_js_client(runs, client, case):
    results, log = runs(js_client_argv(client))
    assert set(results) == set(CLIENTS[client]), results.keys()
    check(case, results[case], log)
