"""What each case of a client driver (py_clients.py, js/clients.mjs) must have produced, checked
against its result and the fake engine's log of the client's run."""

from __future__ import annotations

BASIC = ("plain", "stream", "multi_turn", "tool_loop")
RESPONSES = (*BASIC, "chain", "store_false")


def answers(log: list[dict]) -> list[dict]:
    """The answer hops, and the speculative ones (the same request: a follow-up's answer on a hit)."""
    return [e for e in log if e.get("hop") in ("answer", "speculative") and "payload" in e]


def saw(log: list[dict], text: str) -> bool:
    """Some answer hop carried `text` in an assistant message (the conversation came back)."""
    return any(
        m.get("role") == "assistant" and text in str(m.get("content"))
        for e in answers(log)
        for m in e["payload"]["messages"]
    )


def check(case: str, result: dict, log: list[dict]) -> None:
    assert "error" not in result, f"{case}: {result['error']}\n{result.get('trace', '')}"
    text = result["text"]
    if case == "plain":
        assert text.startswith("answer-"), result
    elif case == "stream":
        assert text.startswith("answer-") and result["chunks"] >= 1, result
    elif case in ("multi_turn", "chain", "store_false") and "first" in result:
        assert result["first"].startswith("answer-") and text.startswith("answer-"), result
        assert saw(log, result["first"]), f"{case}: the second request did not carry the first answer"
    elif case == "store_false":  # a tool loop resent whole with store: false
        assert text.endswith("using sunny in Paris"), result
    elif case == "tool_loop":
        assert result["called"] == "get_weather", result
        assert text.endswith("using sunny in Paris"), result  # the fake engine's answer to the tool result
    else:
        raise AssertionError(f"no check for case {case!r}")
