"""Streamed token ids accumulate in linear time (issue 40): `VllmEngine.stream_tokens` rebuilt
the whole list on every event (twice per event on a speculative hit), 15.5 s of proxy CPU for an
80k-token answer; each event's ids are now appended to one list."""

from __future__ import annotations

from molctl.engines.base import AnswerTokens
from molctl.engines.vllm import ENGINE


def events(n: int):
    yield {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    for i in range(n):
        yield {"choices": [{"index": 0, "delta": {"content": "w"}, "token_ids": [100 + i]}]}
    yield {"choices": [{"index": 0, "delta": {}, "token_ids": [7], "finish_reason": "stop", "stop_reason": None}]}


def test_the_output_ids_grow_in_one_list_without_a_copy_per_event():
    """Guards the quadratic accumulation: the list the first ids went into is the one that ends."""
    tokens = AnswerTokens()
    seen = []
    for event in events(500):
        ENGINE.stream_tokens(event, tokens)
        if tokens.output is not None:
            seen.append(id(tokens.output))
    assert len(set(seen)) == 1
    assert tokens.prompt == [1, 2, 3] and tokens.output == [*range(100, 600), 7] and tokens.stop_token


def test_the_events_own_ids_are_left_as_they_came():
    """Guards appending in place: the first event's list is copied, never extended."""
    first = {"choices": [{"index": 0, "token_ids": [5]}]}
    tokens = AnswerTokens()
    ENGINE.stream_tokens(first, tokens)
    ENGINE.stream_tokens({"choices": [{"index": 0, "token_ids": [6]}]}, tokens)
    assert first["choices"][0]["token_ids"] == [5] and tokens.output == [5, 6]
