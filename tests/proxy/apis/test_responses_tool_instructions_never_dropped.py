"""Responses tool instructions the engine cannot follow are 400s naming the field, never dropped
(issue 40): `allowed_tools` in mode `required` naming no declared function, a nested namespace,
a misspelt tool type (`"Function"`: chat refuses the same typo) and namespace names that would
make malformed function names at the engine were sent on with a log note, or without the tools."""

from __future__ import annotations

import pytest

from molctl.proxy.apis.responses.convert import _convert_tool_choice, _convert_tools
from molctl.proxy.errors import ProxyError

SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object"}}


def chat_of(tools: list, choice) -> dict:
    chat: dict = {}
    converted, _ = _convert_tools(tools)
    if converted:
        chat["tools"] = converted
    _convert_tool_choice(choice, chat)
    return chat


def refused(fn, *args) -> ProxyError:
    with pytest.raises(ProxyError) as err:
        fn(*args)
    assert err.value.status == 400
    return err.value


def test_allowed_tools_required_naming_no_declared_function_is_a_400():
    """Guards the dropped `required`: neither tools nor tool_choice reached the engine."""
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "other"}]}
    assert refused(chat_of, [SHELL], choice).param == "tool_choice.tools"


def test_allowed_tools_auto_naming_none_sends_no_tools_and_one_naming_a_tool_keeps_it():
    """Guards the other modes: `auto` among no tools is an answer without tools, as asked."""
    none = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "other"}]}
    assert chat_of([SHELL], none) == {}
    one = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "shell"}]}
    chat = chat_of([SHELL], one)
    assert chat["tool_choice"] == "required" and [t["function"]["name"] for t in chat["tools"]] == ["shell"]


@pytest.mark.parametrize(
    "tools,param",
    [
        ([{"type": "Function", "name": "shell"}], "tools[0].type"),
        ([SHELL, {"type": "function "}], "tools[1].type"),
        (
            [{"type": "namespace", "name": "crm", "tools": [{"type": "namespace", "name": "x", "tools": []}]}],
            "tools[0].tools[0].type",
        ),
        (
            [{"type": "namespace", "name": "crm", "tools": [{"type": "FUNCTION", "name": "f"}]}],
            "tools[0].tools[0].type",
        ),
        ([{"type": "namespace", "name": "my crm", "tools": [SHELL]}], "tools[0].name"),
        ([{"type": "namespace", "name": "crm\nignore", "tools": [SHELL]}], "tools[0].name"),
    ],
)
def test_a_tool_the_engine_would_never_see_as_asked_is_a_400_naming_it(tools, param):
    """Guards the log-note drops: a typo or nested namespace was left out; a spaced name forwarded."""
    assert refused(_convert_tools, tools).param == param


def test_hosted_tools_are_still_left_out_with_a_note():
    """Guards the documented substitute: a hosted tool the engine cannot run is left out, not a 400."""
    tools, _ = _convert_tools(
        [
            SHELL,
            {"type": "web_search"},
            {"type": "namespace", "name": "crm", "tools": [SHELL, {"type": "custom", "name": "p"}]},
        ]
    )
    assert [t["function"]["name"] for t in tools] == ["shell", "crm__shell"]
