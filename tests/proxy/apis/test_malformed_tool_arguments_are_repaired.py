"""A history tool call's arguments that are not a JSON object never fail a turn: the proxy sends
them as "{}" on every hop, as vLLM 0.32 reads them (vllm/renderers/chat_utils.py,
_postprocess_messages); vLLM 0.24.0 json.loads them and answers 400 (vllm/entrypoints/chat_utils.py).
Counted in tool_arguments_repaired_total and logged once per request with the message index."""

from __future__ import annotations

from molctl.checks.template import engine_messages
from molctl.proxy.tool_arguments import repair_history, repaired
from tests.proxy_stack import answers_of


def call(arguments, id_="c1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_text_that_is_not_a_json_object_becomes_an_empty_object():
    assert repaired('{"city": "Par') == "{}"
    assert repaired("[1, 2]") == "{}" and repaired("42") == "{}" and repaired("null") == "{}"
    assert repaired('{"city": "Paris"}') is None and repaired("") is None and repaired(None) is None


def test_only_the_changed_messages_are_new_and_the_clients_own_are_untouched():
    good = {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Rome"}')]}
    bad = {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Rome"}', "c0"), call("{oops", "c1")]}
    messages = [{"role": "user", "content": "hi"}, good, {"role": "tool", "tool_call_id": "c1", "content": "x"}, bad]
    out, changed = repair_history(messages)
    assert changed == [3]
    assert out[1] is good and out[3] is not bad
    assert [c["function"]["arguments"] for c in out[3]["tool_calls"]] == ['{"city": "Rome"}', "{}"]
    assert bad["tool_calls"][1]["function"]["arguments"] == "{oops"
    assert repair_history(messages[:2]) == (messages[:2], [])


def test_checks_template_render_goes_through_the_same_repair():
    (msg,) = engine_messages([{"role": "assistant", "content": "", "tool_calls": [call("{oops")]}])
    assert msg["tool_calls"][0]["function"]["arguments"] == {}


def test_a_turn_after_a_malformed_call_answers_and_the_engine_gets_an_empty_object(s):
    s.reset()
    before = s.metrics()["molctl_proxy_tool_arguments_repaired_total"]
    messages = [
        {"role": "user", "content": "[route:L1] weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Par', "call_bad")]},
        {"role": "tool", "tool_call_id": "call_bad", "content": "sunny"},
        {"role": "user", "content": "[route:L1] thanks"},
    ]
    assert s.chat(messages).choices[0].message.content
    (answer,) = answers_of(s.log())
    (sent,) = [m for m in answer["payload"]["messages"] if m.get("tool_calls")]
    assert sent["tool_calls"][0]["function"]["arguments"] == "{}"
    assert s.metrics()["molctl_proxy_tool_arguments_repaired_total"] == before + 1
