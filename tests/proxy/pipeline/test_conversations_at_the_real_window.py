"""A 256k-token conversation (Venti's and Tall's 262,144-token window) completes through the proxy,
streamed and not, its follow-up a speculative hit, with the engine reporting token ids (issue 40):
non-streamed answers over 1 MiB never finished, and the ids' cost grew with the square of the
answer. Against the scripted engine in its token-ids mode (one word, one token), whose window and
the profile's are set to the real one; the speed of it is bench/bench_long_context.py's."""

from __future__ import annotations

import pytest

from tests.fake_engine import render
from tests.helpers import wait_for
from tests.proxy_stack import own_stack

WINDOW = 262_144
TOKENS = 256 * 1024 - 8192  # the conversation, with room for the answers and the summary


@pytest.fixture(scope="module")
def real_window(keyfile, tmp_path_factory):
    logs = tmp_path_factory.mktemp("real-window")
    with own_stack(keyfile, logs, "--set", f"engine.args.max-model-len={WINDOW}") as st:
        st.client = st.client.with_options(timeout=300)
        yield st


def conversation() -> list[dict]:
    per = TOKENS // 9
    text = lambda k: " ".join(f"t{k}w{i % 500}" for i in range(per))  # noqa: E731
    messages = [{"role": "system", "content": text(0)}]
    for t in range(4):
        messages += [{"role": "user", "content": text(2 * t + 1)}, {"role": "assistant", "content": text(2 * t + 2)}]
    return messages


@pytest.mark.parametrize("stream", [False, True])
def test_a_256k_token_conversation_and_its_speculative_follow_up_complete(real_window, stream):
    """Guards the 1 MiB hang and the window: both turns answer whole, the follow-up held and handed on."""
    s = real_window
    s.reset()
    s.config(token_ids=True, answer_words=2000)

    def ask(messages):
        if stream:
            return s.chat(messages, stream=True)[0]
        return s.chat(messages).choices[0].message.content

    first = [*conversation(), {"role": "user", "content": "[route:L2] the first question"}]
    answer = ask(first)
    assert answer.startswith("answer-") and len(answer.split()) == 2001
    answer_hop = s.log("answer")[0]
    assert len(render(answer_hop["messages"])) > 256_000 - 8192
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "[route:L2] and then?"}]
    again = ask(follow)
    assert again.startswith("answer-") and len(again.split()) == 2001
    hops = [e["hop"] for e in s.log() if e["hop"] in ("answer", "speculative")]
    assert hops == ["answer", "speculative"]  # the hit's answer is the held one: no second answer hop
    # both turns' summaries continue their answers' ids
    assert wait_for(lambda: len([e for e in s.log("summary") if e.get("endpoint") == "completions"]) == 2, 60)
