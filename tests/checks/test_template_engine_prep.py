"""`molctl check`'s template category renders as vLLM 0.32 prepares a chat request
(entrypoints/openai/chat_completion/protocol.py build_chat_params and _normalize_messages_before;
renderers/chat_utils.py _parse_chat_message_content and _postprocess_messages): reasoning_effort
and template kwargs passed, an assistant's reasoning copied to reasoning_content, a tool message's
text parts joined with newlines, a non-object tool call refused."""

from __future__ import annotations

import pytest

from molctl.checks.template import EngineRefusal, Template, engine_messages, render, template_kwargs
from molctl.demo import template_text

USER = {"role": "user", "content": "hi"}
SYS = {"role": "system", "content": "Be brief."}


def draw(name, messages, **payload):
    return render(Template(name, {"default": template_text(name)}, {}), {"messages": messages, **payload})


def test_reasoning_effort_reaches_the_template():
    assert draw("glm5", [USER], reasoning_effort="high").startswith("[gMASK]<sop><|system|>Reasoning Effort: High")
    assert draw("glm5", [USER], reasoning_effort="max").startswith("[gMASK]<sop><|system|>Reasoning Effort: Max")


def test_reasoning_effort_sets_enable_thinking_unless_the_kwargs_do():
    assert template_kwargs({"reasoning_effort": "none"})["enable_thinking"] is False
    assert template_kwargs({"reasoning_effort": "low"})["enable_thinking"] is True
    assert template_kwargs({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})[
        "enable_thinking"
    ]
    assert "enable_thinking" not in template_kwargs({})
    assert draw("qwen3.6", [USER], reasoning_effort="none").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    kw = template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False, "clear_thinking": False}})
    assert kw["add_generation_prompt"] is True and kw["clear_thinking"] is False  # the request's own flags win


def test_an_assistants_reasoning_is_passed_as_reasoning_content():
    call = {
        "role": "assistant",
        "content": "",
        "reasoning": "look it up",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    turn = [SYS, USER, call, {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    assert "<think>\nlook it up\n</think>" in draw("qwen3.6", turn)
    assert "<|assistant|><think>look it up</think>" in draw("glm5", turn)
    legacy = engine_messages([{"role": "assistant", "content": "x", "reasoning_content": "r"}])[0]
    assert legacy["reasoning"] == legacy["reasoning_content"] == "r"


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_a_tool_messages_text_parts_are_joined(content_format):
    parts = [{"type": "text", "text": "18 C"}, {"type": "text", "text": "sunny"}]
    msgs = engine_messages([{"role": "tool", "tool_call_id": "c", "content": parts}], content_format)
    assert msgs[0]["content"] == "18 C\nsunny"
    turn = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": parts},
    ]
    assert "<tool_response>\n18 C\nsunny\n</tool_response>" in draw("qwen3.6", turn)
    assert "<tool_response>18 C\nsunny</tool_response>" in draw("glm5", turn)


def test_content_formats_as_vllm_passes_them():
    user = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert engine_messages([user])[0]["content"] == "a\nb"
    assert engine_messages([user], "openai")[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    assert engine_messages([USER], "openai")[0]["content"] == [{"type": "text", "text": "hi"}]
    assert engine_messages([{"role": "assistant", "content": None}])[0]["content"] == ""
    assert engine_messages([{"role": "assistant", "content": None}], "openai")[0]["content"] == []


def test_tool_calls_as_vllm_postprocesses_them():
    def args(value):
        msg = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": value}}],
        }
        return engine_messages([msg])[0]["tool_calls"][0]["function"]["arguments"]

    assert args('{"x": 1}') == {"x": 1} and args({"x": 2}) == {"x": 2}
    assert args("") == args(None) == args("not json") == args("[1]") == args("42") == {}  # vLLM 0.32 coerces, warning
    with pytest.raises(EngineRefusal, match="tool_calls entries must be objects"):
        engine_messages([{"role": "assistant", "content": None, "tool_calls": ['{"name": "f"}']}])
    with pytest.raises(EngineRefusal, match="of type 'function'"):
        engine_messages(
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "custom", "custom": {}}]}]
        )
    assert "tool_calls" not in engine_messages([{"role": "assistant", "content": "x", "tool_calls": []}])[0]


def test_matches_vllms_own_message_preparation():
    """The same messages through vLLM 0.32's parser (installed in the dev environment)."""
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    msgs = [
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"k": "v"}'}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "[1]"}},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "a",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
        },
    ]
    import copy

    theirs = copy.deepcopy(msgs)
    theirs[1] = {**theirs[1], "content": "r1\nr2"}  # what _parse_chat_message_content makes of it
    chat_utils._postprocess_messages(theirs)
    ours = engine_messages(msgs)
    assert [m["tool_calls"] for m in ours if "tool_calls" in m] == [
        m["tool_calls"] for m in theirs if "tool_calls" in m
    ]
    assert ours[1]["content"] == theirs[1]["content"]
