"""A long prompt's token ids go from the engine's answer to the summary hop as the JSON text they
came in (issue 40): parsed, 256k ids were 19 ms of int objects, checked one by one (25 ms) and
joined and encoded again for the summary: a non-streamed answer with ids cost the proxy about 2x
the same answer without. `fastjson.loads_lifting` keeps a long top-level integer array as
`RawIds`; the summary's continuation joins it with the answer's ids and the suffix."""

from __future__ import annotations

import json

import orjson
import pytest

from molctl.engines.base import AnswerTokens, RawIds, continuation_ids
from molctl.proxy import fastjson
from molctl.proxy.pipeline.summary import continuation_json
from tests.fake_engine import IM_END, IM_START, ROLE_IDS, render, words
from tests.helpers import free_port, wait_for
from tests.proxy_stack import TINY, own_stack

IDS = list(range(100_000, 130_000))


def answer_body(**extra) -> bytes:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": 'say "prompt_token_ids":[1,2]'},
        "token_ids": [7, 2],
    }
    return orjson.dumps({"id": "c", "choices": [choice], **extra, "usage": {"prompt_tokens": len(IDS)}})


def test_a_long_top_level_id_array_is_kept_as_its_text_and_the_rest_parsed():
    """Guards the lifting: the ids are RawIds of the same values; everything else as orjson reads it."""
    raw = answer_body(prompt_token_ids=IDS)
    body = fastjson.loads_lifting(raw)
    ids = body.pop("prompt_token_ids")
    assert isinstance(ids, RawIds) and len(ids) == len(IDS) and list(ids) == IDS
    expected = orjson.loads(raw)
    del expected["prompt_token_ids"]
    assert body == expected


@pytest.mark.parametrize(
    "raw",
    [
        answer_body(nested={"prompt_token_ids": IDS}),
        answer_body(prompt_token_ids=[*IDS[:-1], -1]),
        json.dumps({"prompt_token_ids": [*IDS, 1.5]}).encode(),
        answer_body(prompt_token_ids=IDS[:10]),
    ],
    ids=["nested", "negative", "float", "short"],
)
def test_anything_else_is_parsed_as_loads_parses_it(raw):
    """Guards the lifting's edges: a nested, non-integer or short array is parsed whole."""
    assert fastjson.loads_lifting(raw) == fastjson.loads(raw)


@pytest.mark.parametrize("stop_token, suffix", [(True, [2, 4, 5]), (True, [9, 4]), (False, [9]), (True, [])])
def test_the_continuation_of_kept_ids_is_the_continuation_of_the_parsed_ones(stop_token, suffix):
    """Guards the join: the same ids as `continuation_ids` over lists, stop-token rule included."""
    raw = RawIds(orjson.dumps(IDS), len(IDS))
    text, count = continuation_json(AnswerTokens(raw, [7, 2], stop_token), suffix)
    expected = continuation_ids(AnswerTokens(IDS, [7, 2], stop_token), suffix)
    assert json.loads(text) == expected and count == len(expected)


@pytest.fixture(scope="module")
def long_window(keyfile, tmp_path_factory):
    logs = tmp_path_factory.mktemp("long-window")
    with own_stack(keyfile, logs, "--set", "engine.args.max-model-len=65536", "--metrics-port", str(free_port())) as st:
        yield st


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_conversations_summary_continues_the_answers_exact_ids(long_window, stream):
    """Guards the end to end: the summary's token prompt is the answer's prompt, its ids, the suffix."""
    s = long_window
    s.reset()
    s.config(token_ids=True)
    question = [{"role": "user", "content": "[route:L2] " + " ".join(f"w{i}" for i in range(20_000))}]
    if stream:
        content = s.chat(question, stream=True)[0]
    else:
        content = s.chat(question).choices[0].message.content
    assert wait_for(lambda: [e for e in s.log("summary") if e.get("endpoint") == "completions"], 20)
    summary = next(e for e in s.log("summary") if e.get("endpoint") == "completions")
    answer = s.log("answer")[0]
    instruction = TINY.substitute(TINY.prompts.summary).strip()
    suffix = [IM_END, IM_START, ROLE_IDS["user"], *words(instruction), IM_END, IM_START, ROLE_IDS["assistant"]]
    assert summary["payload"]["prompt"] == render(answer["messages"]) + words(content) + suffix
