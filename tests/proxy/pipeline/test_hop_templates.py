"""Every request shape the proxy sends (route, answer and summary hops of the sample conversations
in molctl/proxy/samples.py, run through the proxy's own code) renders with both strict demo
templates, and each one carries exactly one system message, first: what the real Qwen3.6 (Tall)
and GLM-5 (Venti) bases require. Client instructions are kept: leading system/developer text
and mid-conversation system/developer text all reach the answer hop's prompt."""

from __future__ import annotations

import pytest

from molctl.checks.template import Template, engine_messages, render
from molctl.demo import template_text
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.samples import collect

PROFILES = ("tiny", "tall", "venti", "venti-sglang")
TOKENS = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|im_end|>"}


@pytest.fixture(scope="module", params=PROFILES)
def requests(request):
    return request.param, collect(load_profile(request.param, profile_dirs()))


@pytest.fixture(scope="module", params=["qwen3.6", "glm5"])
def template(request):
    return Template(f"demo {request.param}", {"default": template_text(request.param)}, TOKENS)


def test_samples_cover_every_hop_and_shape(requests):
    _, reqs = requests
    assert {r.hop for r in reqs} == {"route", "answer", "summary"}
    shapes = {r.shape for r in reqs}
    assert {
        "first turn",
        "folded turn",
        "system and developer instructions",
        "developer instructions only",
        "mid-conversation system and developer",
        "tool call",
        "tool result",
        "folded tool turn",
    } <= shapes
    assert any("tools" in r.payload for r in reqs if r.hop == "answer")
    assert not any(r.hop == "route" for r in reqs if r.shape == "tool result")  # sticky tool turn


def test_one_leading_system_message_on_every_hop(requests):
    name, reqs = requests
    for r in reqs:
        roles = [m["role"] for m in r.payload["messages"]]
        assert roles[0] == "system" and roles.count("system") == 1 and "developer" not in roles, (
            name,
            r.hop,
            r.shape,
            roles,
        )


def test_every_hop_renders_with_the_demo_template(requests, template):
    name, reqs = requests
    for r in reqs:
        try:
            text = render(template, r.payload)
        except Exception as exc:  # pragma: no cover - the assertion message is the point
            pytest.fail(f"{template.source} on {name}: {r.hop} hop, shape '{r.shape}': {exc}")
        if "qwen" in template.source:
            assert text.startswith("<|im_start|>system\n") and text.count("<|im_start|>system") == 1
        else:
            assert text.startswith("[gMASK]<sop>")


def test_the_engine_sees_the_clients_instructions(requests, template):
    """Leading system/developer text and mid-conversation system/developer text are kept (folded or not)."""
    _, reqs = requests
    answers = {r.shape: render(template, r.payload) for r in reqs if r.hop == "answer"}
    for shape in ("system and developer instructions", "system and developer instructions, next turn"):
        assert "You are the assistant of Example Corp." in answers[shape]
        assert "Answer in plain text, no markdown." in answers[shape]
    assert "Answer in plain text, no markdown." in answers["developer instructions only"]
    for shape in ("mid-conversation system and developer", "folded turn with mid-conversation system and developer"):
        assert "From now on, answer in French." in answers[shape], shape
        assert "Keep answers under 50 words." in answers[shape], shape
    assert "Use the tools when they help." in answers["tool result"]


def test_tool_calls_and_results_render_in_the_family_format(requests, template):
    _, reqs = requests
    (tool_result,) = [r for r in reqs if r.hop == "answer" and r.shape == "tool result"]
    text = render(template, tool_result.payload)
    if "qwen" in template.source:
        assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
        assert "<tool_response>\nbooked: table 7 at 20:00\n</tool_response>" in text
        assert "<tools>" in text.split("<|im_end|>")[0]  # tools are listed in the one system turn
    else:
        assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" in text
        assert "<arg_key>people</arg_key><arg_value>2</arg_value>" in text
        assert "<|observation|><tool_response>" in text and text.count("<|observation|>") == 1


def test_engine_messages_parse_tool_arguments_like_vllm():
    msgs = engine_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                    {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                    {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                ],
            }
        ]
    )
    assert msgs[0]["content"] == ""
    assert [c["function"]["arguments"] for c in msgs[0]["tool_calls"]] == [{"x": 1}, {}, {}]


def test_streaming_clients_cause_the_same_hop_messages():
    """The samples' engine client streams like an engine too: a streaming client's hops carry the
    same messages (what the template renders) as a non-streaming one's."""
    import asyncio

    from molctl.profiles import load_profile, profile_dirs
    from molctl.proxy.samples import collect_async

    profile = load_profile("tiny", profile_dirs())
    plain = asyncio.run(collect_async(profile))
    streamed = asyncio.run(collect_async(profile, stream=True))
    assert [(h.hop, h.shape, h.payload["messages"]) for h in streamed] == [
        (h.hop, h.shape, h.payload["messages"]) for h in plain
    ]
    assert any(h.payload.get("stream") for h in streamed if h.hop == "answer")


def test_the_sample_run_shows_no_proxy_warning(capfd):
    """Guards `molctl check` (and so `make demo`) printing the proxy's "an answer hop came back
    without its token ids" while it built its sample requests: a warning about its own recorded
    answers, not the engine's. The proxy's logger is as it was afterwards."""
    import logging

    logger = logging.getLogger("molctl.proxy")
    level = logger.level
    handler = logging.StreamHandler()
    logger.addHandler(handler)
    try:
        assert collect(load_profile("tiny", profile_dirs()))
    finally:
        logger.removeHandler(handler)
    assert "token ids" not in capfd.readouterr().err
    assert logger.level == level
