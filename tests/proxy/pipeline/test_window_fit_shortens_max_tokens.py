"""Every hop's max_tokens fits the engine's window on every vLLM version (`pipeline.window`): the
cheap prompt bound decides alone when it leaves room; otherwise the prompt is measured with the
engine's /tokenize and max_tokens cut to the room left, counted by hop. vLLM 0.24.0 refuses
prompt + max_tokens over max-model-len (vllm/renderers/params.py, _token_len_check), 0.32.0 cuts
(vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens): `shortens_max_tokens` says which."""

from __future__ import annotations

import asyncio

from molctl.engines.vllm import ENGINE as VLLM
from molctl.proxy.errors import EngineHTTPError
from molctl.proxy.metrics import Counters
from molctl.proxy.pipeline.window import WindowFit, prompt_token_bound


class Measurer:
    """The engine client's `chat` for the measurement hop: answers /tokenize's `count` (or fails)."""

    def __init__(self, count: int | None):
        self.count, self.sent = count, []

    async def chat(self, payload, hop, **kw):
        self.sent.append((payload, hop, kw))
        if self.count is None:
            raise EngineHTTPError(404, '{"detail": "Not Found"}')
        return {"count": self.count, "max_model_len": 2048, "tokens": [1] * self.count}


def payload(words: int, max_tokens: int | None, **extra) -> dict:
    body = {"model": "L1", "messages": [{"role": "user", "content": "word " * words}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def fit(count: int | None, body: dict, hop: str = "answer") -> tuple[dict, Measurer, Counters]:
    client, counters = Measurer(count), Counters()
    asyncio.run(WindowFit(VLLM, client, 2048, counters).fit(body, hop))
    return body, client, counters


def test_a_limit_the_bound_fits_is_sent_unmeasured():
    body, client, counters = fit(1, payload(10, 200))
    assert body["max_tokens"] == 200 and client.sent == [] and not counters.labelled


def test_a_limit_over_the_room_left_is_cut_to_it_and_counted_by_hop():
    body, client, counters = fit(1850, payload(1000, 200), hop="summary")
    assert body["max_tokens"] == 2048 - 1850
    ((sent, hop, kw),) = client.sent
    assert hop == "length" and kw["path"] == "/tokenize"
    assert sent == {"model": "L1", "messages": body["messages"], "add_generation_prompt": True}
    assert counters.labelled == {("max_tokens_shortened_total", (("hop", "summary"),)): 1}


def test_a_measured_prompt_that_leaves_room_keeps_the_limit():
    body, client, counters = fit(100, payload(1000, 200))
    assert body["max_tokens"] == 200 and len(client.sent) == 1 and not counters.labelled


def test_a_prompt_that_fills_the_window_alone_is_sent_as_is_for_the_engine_to_refuse():
    body, _, counters = fit(2048, payload(1000, 200))
    assert body["max_tokens"] == 200 and not counters.labelled


def test_a_failed_measurement_sends_the_limit_as_is():
    body, client, _ = fit(None, payload(1000, 200))
    assert body["max_tokens"] == 200 and len(client.sent) == 1


def test_no_max_tokens_is_left_to_the_engine():
    body, client, _ = fit(1850, payload(1000, None))
    assert "max_tokens" not in body and client.sent == []


def test_the_measurement_renders_tools_and_reasoning_as_the_chat_request_does():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = payload(1000, 200, tools=tools, reasoning_effort="high", chat_template_kwargs={"x": 1})
    sent = VLLM.length_request(body)
    assert sent["tools"] == tools
    assert sent["chat_template_kwargs"] == {"x": 1, "reasoning_effort": "high", "enable_thinking": True}


def test_the_bound_counts_tools():
    messages = [{"role": "user", "content": "hi"}]
    assert prompt_token_bound(messages, [{"a": "b" * 100}]) > prompt_token_bound(messages, None) + 100


def test_vllm_versions_from_0_32_cut_max_tokens_and_earlier_ones_refuse():
    assert not VLLM.shortens_max_tokens("0.24.0")
    assert not VLLM.shortens_max_tokens("0.24.0+cpu")
    assert VLLM.shortens_max_tokens("0.32.0") and VLLM.shortens_max_tokens("0.33.1")
    assert not VLLM.shortens_max_tokens(None) and not VLLM.shortens_max_tokens("not-a-version")


def test_a_conversation_of_many_messages_is_bounded_off_the_event_loop_and_cut_alike():
    body = {"model": "L1", "messages": [{"role": "user", "content": "w"}] * 3000, "max_tokens": 200}
    body, client, _ = fit(1900, body)
    assert body["max_tokens"] == 2048 - 1900 and len(client.sent) == 1
