"""The summary hop continues the answer hop's tokens (issue 30): the answer hop asks the engine for
its prompt and output token ids, and the summary is a token-prompt completion on the same adapter:
those ids, then the suffix the engine's own template puts after an answer (found with a /tokenize
probe). Without the ids, the chat summary of before (counted); a continuation that would not fit
the window is skipped (counted). Against the strict fake vLLM in its `token_ids` mode, which
answers `return_token_ids`, /tokenize and a token-prompt /v1/completions as vLLM 0.32 does
(tests/fake_engine.py, citing vLLM's source); the real vLLM runs it in tests/e2e/test_e2e.py and
bench/bench_summary_cache.py."""

from __future__ import annotations

import time

import pytest

from molctl.engines.base import AnswerTokens, continuation_ids
from molctl.proxy.pipeline.views import suffix_after
from tests.fake_engine import IM_END, IM_START, ROLE_IDS, render, words
from tests.helpers import wait_for
from tests.proxy_stack import TINY


def continuation(s) -> dict:
    assert wait_for(lambda: [e for e in s.log("summary") if e.get("endpoint") == "completions"], 10)
    return next(e for e in s.log("summary") if e.get("endpoint") == "completions")


def expected_suffix(s) -> list[int]:
    """What the fake template puts after an answer: <|im_end|>, the instruction's user turn, the
    generation prompt (the probe runs once per adapter per proxy: the instruction is the profile's)."""
    instruction = TINY.substitute(TINY.prompts.summary).strip()
    return [IM_END, IM_START, ROLE_IDS["user"], *words(instruction), IM_END, IM_START, ROLE_IDS["assistant"]]


def wait_metric(s, name: str, above: float) -> float:
    deadline = time.monotonic() + 10
    while s.metrics()[name] <= above and time.monotonic() < deadline:
        time.sleep(0.05)
    return s.metrics()[name]


@pytest.mark.parametrize("stream", [False, True])
def test_the_summary_is_the_answers_prompt_ids_answer_ids_and_the_suffix(s, stream):
    s.config(token_ids=True)
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}]
    if stream:
        content, _, _ = s.chat([{"role": "user", "content": "[route:L2] fix the build"}], stream=True, tools=tools)
    else:
        r = s.chat([{"role": "user", "content": "[route:L2] fix the build"}], tools=tools)
        content = r.choices[0].message.content
        dumped = r.model_dump()
        # the client never sees token ids (shaping keeps standard fields only)
        assert "prompt_token_ids" not in dumped and "token_ids" not in dumped["choices"][0]
    answer = s.log("answer")[0]
    assert answer["payload"]["return_token_ids"] is True
    summary = continuation(s)
    assert summary["model"] == "L2" == answer["model"]
    # the answer ended on the EOS (<|im_end|>), which the suffix starts with: not repeated
    assert summary["payload"]["prompt"] == render(answer["messages"]) + words(content) + expected_suffix(s)
    assert summary["payload"]["temperature"] == 0 and summary["payload"]["max_tokens"] == 32
    assert not [e for e in s.log("summary") if e.get("endpoint") is None]  # no chat summary
    probes = [e for e in s.log("summary") if e.get("endpoint") == "tokenize"]
    if probes:  # the first summary on L2 in this proxy: the probe pair, open and closed
        assert [p["payload"]["continue_final_message"] for p in probes] == [True, False]
        assert probes[1]["payload"]["messages"][-1]["content"] == TINY.substitute(TINY.prompts.summary).strip()


def test_the_continuation_is_served_from_the_answers_cache_and_folds(s):
    s.config(token_ids=True)
    before = s.metrics()
    first = [{"role": "user", "content": "[route:L2] " + "explain the parser " * 50}]
    r = s.chat(first)
    continuation(s)
    prompt = wait_metric(
        s, "molctl_proxy_summary_prompt_tokens_total", before["molctl_proxy_summary_prompt_tokens_total"]
    )
    cached = (
        s.metrics()["molctl_proxy_summary_cached_tokens_total"] - before["molctl_proxy_summary_cached_tokens_total"]
    )
    prompt -= before["molctl_proxy_summary_prompt_tokens_total"]
    suffix = len(expected_suffix(s)) - 1
    assert cached == prompt - suffix - 1  # all but the suffix and the answer's last token (the fake's cache)
    assert (
        s.metrics()["molctl_proxy_summary_continuations_total"]
        == before["molctl_proxy_summary_continuations_total"] + 1
    )
    # the next turn on another adapter folds this one with the continuation's summary
    s.chat(
        [
            *first,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "[route:L1] plan my trip"},
        ]
    )
    folded = s.log("answer")[-1]["messages"]
    assert any(f"summary of {r.choices[0].message.content}" in str(m.get("content")) for m in folded)


def test_without_token_ids_the_summary_is_the_chat_request_counted(s):
    before = s.metrics()["molctl_proxy_summary_chat_fallbacks_total"]
    s.chat([{"role": "user", "content": "[route:L2] hello"}])
    assert wait_for(lambda: [e for e in s.log("summary") if e.get("endpoint") is None], 10)
    chat = next(e for e in s.log("summary") if e.get("endpoint") is None)
    assert chat["messages"][-1]["role"] == "user" and chat["messages"][-2]["role"] == "assistant"
    assert wait_metric(s, "molctl_proxy_summary_chat_fallbacks_total", before) == before + 1
    assert not [e for e in s.log() if e.get("endpoint") == "completions"]


def test_a_continuation_past_the_window_is_skipped_counted(s):
    s.config(token_ids=True)
    before = s.metrics()["molctl_proxy_summary_window_skips_total"]
    # the answer's prompt fits the 2048 window; prompt + answer + suffix + 32 summary tokens do not
    s.chat([{"role": "user", "content": "[route:L2] " + "word " * 1960}], max_tokens=12)
    assert wait_metric(s, "molctl_proxy_summary_window_skips_total", before) == before + 1
    assert not [e for e in s.log() if e.get("endpoint") == "completions"]
    assert not [e for e in s.log("summary") if e.get("endpoint") is None]


def test_continuation_ids_and_the_suffix_rules():
    # Qwen: the suffix starts with the EOS the answer stopped on: not repeated
    assert continuation_ids(AnswerTokens([1, 2], [7, 8, 99], True), [99, 5, 6]) == [1, 2, 7, 8, 99, 5, 6]
    # an EOS the template does not print (e.g. <|endoftext|>): dropped
    assert continuation_ids(AnswerTokens([1, 2], [7, 8, 42], True), [99, 5]) == [1, 2, 7, 8, 99, 5]
    # cut by max_tokens or a stop string: the ids as generated
    assert continuation_ids(AnswerTokens([1], [7, 99], False), [99, 5]) == [1, 7, 99, 99, 5]
    # the suffix: after the sentinel answer's last tokens, found once in the closed rendering,
    # although what precedes them differs (a think block before the last user query)
    left_open = [10, 11, 50, 51, 52, 53, 60, 61]
    closed = [10, 11, 50, 51, 60, 61, 99, 12, 70, 71, 99, 13]
    assert suffix_after(left_open, closed) == [99, 12, 70, 71, 99, 13]
    assert suffix_after([5, 6], [1, 2, 3]) is None


def test_sglang_reads_its_own_shapes():
    """SGLang 0.5.13's shapes (molctl/engines/sglang.py): an answer asks for no token ids (its
    chat answers carry no generated ids without logprobs, so its summaries are chat ones); an
    answer with logprobs would carry them in meta_info; the continuation a /generate with
    input_ids and lora_path."""
    from molctl.engines import get_engine

    sgl = get_engine("sglang")
    assert sgl.answer_token_fields(stream=True) == {}
    assert sgl.answer_token_fields(stream=False) == {}
    body = {
        "choices": [
            {
                "message": {"content": "hi"},
                "prompt_token_ids": [1, 2],
                "meta_info": {
                    "output_token_logprobs": [[-0.1, 7, "h"], [-0.2, 9, "<eos>"]],
                    "finish_reason": {"type": "stop", "matched": 9},
                },
            }
        ]
    }
    assert sgl.answer_tokens(body) == AnswerTokens([1, 2], [7, 9], True)
    assert not sgl.answer_tokens({"choices": [{"prompt_token_ids": [1], "meta_info": {}}]}).complete()
    assert sgl.continuation_request("base:L2", "L2", [1, 2], 32) == {
        "input_ids": [1, 2],
        "lora_path": "L2",
        "stream": False,
        "sampling_params": {"max_new_tokens": 32, "temperature": 0},
    }
    text, usage = sgl.continuation_result({"text": " done", "meta_info": {"prompt_tokens": 10, "cached_tokens": 8}})
    assert text == " done" and usage == {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}
