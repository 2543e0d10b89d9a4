"""A held speculative answer sent with a priority the engine refuses is not the answer: the route
hop beside it finds the refusal and goes on without one, and the answer hop is sent as it would be
without speculation. Driven by the official `openai` SDK against the fake SGLang
(tests/fake_sglang.py: `--abort-on-priority-when-disabled` without priority scheduling, a 503)."""

from __future__ import annotations

import pytest

from tests.helpers import wait_for
from tests.proxy_stack import KEY
from tests.sglang_stack import PUBLIC, sglang_stack


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_after_the_engine_dropped_priority_scheduling_is_answered(keyfile, tmp_path, stream):
    """Guards a found bug: a hit's held request still carried the refused priority, and the client got its 503."""
    engine, proxy, st = sglang_stack(keyfile, tmp_path, "--set", "engine.args.enable-priority-scheduling=true", key=KEY)
    with engine, proxy:
        u1 = {"role": "user", "content": "[route:L2] write a parser"}
        a1 = st.client.chat.completions.create(model=PUBLIC, messages=[u1]).choices[0].message.content
        assert wait_for(lambda: st.log("summary"), 10)
        st.reset()
        # the engine restarted without priority scheduling: the route hop's refusal comes after
        # the held hop (with the answer's priority 0, taken before) was sent
        st.config(abort_on_priority=True, abort_delay=0.3)
        messages = [u1, {"role": "assistant", "content": a1}, {"role": "user", "content": "[route:L2] more"}]
        r = st.client.chat.completions.create(model=PUBLIC, messages=messages, stream=stream)
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
        assert text.startswith("answer-")
        sent = [(e["hop"], e["payload"].get("priority"), e.get("rejected")) for e in st.log() if "payload" in e]
        assert ("speculative", 0, "priority") in sent  # the held hop was refused
        assert ("answer", None, None) in sent  # the answer went without a priority
