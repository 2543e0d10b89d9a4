"""Request fields beyond OpenAI's known set: the engine's own extensions pass to the answer hop
(so vLLM's `vllm bench serve` runs through the proxy), fields that would break the proxy's
contract are 400s naming them, and unknown fields are accepted, logged once and counted (a 400
with `proxy.request_fields: reject`). The proxy runs against the fake engine in strict mode."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from molctl.engines import get_engine
from molctl.proxy.apis.request_fields import FieldPolicy
from molctl.proxy.errors import ProxyError
from tests.helpers import wait_for
from tests.proxy_stack import KEY, PUBLIC, TINY, own_stack

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "[route:L2] hello"}]


def post(s, path: str = "/v1/chat/completions", **body) -> httpx.Response:
    return httpx.post(s.proxy_url + path, headers=AUTH, json={"model": PUBLIC, **body}, timeout=30)


def test_vllm_bench_serve_requests_are_answered_and_ignore_eos_reaches_the_answer_hop_only(s):
    """`vllm bench serve --backend openai-chat --dataset-name random` forces ignore_eos: true
    (vllm/benchmarks/lib/endpoint_request_func.py); the proxy answered 400 for it, 40 of 40."""
    body = {
        "messages": USER,
        "max_completion_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    with httpx.stream(
        "POST", s.proxy_url + "/v1/chat/completions", headers=AUTH, json={"model": PUBLIC, **body}, timeout=30
    ) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    assert "data: [DONE]" in text
    answer = s.answers()[-1]["payload"]
    assert answer["ignore_eos"] is True and answer["max_tokens"] == 16
    assert wait_for(lambda: s.log("summary"), 10)
    for hop in ("route", "summary"):
        assert all("ignore_eos" not in e["payload"] for e in s.log(hop)), hop


EXTENSIONS = {
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "length_penalty": 1.0,
    "min_tokens": 2,
    "stop_token_ids": [7, 8],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "bad_words": ["bad"],
    "allowed_token_ids": [1, 2, 3],
    "prompt_logprobs": 1,
    "structured_outputs": {"choice": ["a", "b"]},
    "include_reasoning": False,
    "cache_salt": "salt",
    "ignore_eos": True,
}


def test_every_vllm_extension_is_passed_to_the_answer_hop_as_sent(s):
    assert set(EXTENSIONS) == set(get_engine("vllm").request_extensions)  # the test covers the whole table
    s.chat(USER, extra_body=EXTENSIONS)
    answer = s.answers()[-1]["payload"]
    assert {k: answer.get(k) for k in EXTENSIONS} == EXTENSIONS
    route = s.log("route")[-1]["payload"]  # its own structured_outputs (the labels), none of the client's
    assert all(route.get(k) != v for k, v in EXTENSIONS.items())


@pytest.mark.parametrize(
    "field,value",
    [
        ("ignore_eos", "yes"),
        ("min_tokens", 1.5),
        ("stop_token_ids", ["7"]),
        ("bad_words", "bad"),
        ("min_p", "Infinity"),
        ("top_k", True),
        ("structured_outputs", "json"),
    ],
)
def test_an_extension_of_the_wrong_kind_is_a_400_naming_it(s, field, value):
    before = len(s.log())
    raw = json.dumps({"model": PUBLIC, "messages": USER, field: value})
    if value == "Infinity":  # a JSON number Python's reader takes
        raw = raw.replace('"Infinity"', "Infinity")
    r = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "Content-Type": "application/json"},
        content=raw,
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert field in r.json()["error"]["message"]
    assert len(s.log()) == before  # refused before any hop


@pytest.mark.parametrize(
    "field,value",
    [
        ("echo", True),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("priority", 5),
        ("lora_request", {"lora_name": "L3"}),
        ("guided_json", {"type": "object"}),
        ("use_beam_search", True),
        ("truncate_prompt_tokens", 10),
        ("chat_template_kwargs", {"tools": []}),
        ("documents", [{"title": "t", "text": "x"}]),
    ],
)
def test_fields_that_would_break_the_contract_are_a_400_naming_them_and_why(s, field, value):
    before = len(s.log())
    with pytest.raises(openai.BadRequestError) as err:
        s.chat(USER, extra_body={field: value})
    assert (err.value.param or "").startswith(field), err.value.param
    assert "not" in err.value.message  # says why: "is not supported: ..." / "is not a template variable ..."
    assert len(s.log()) == before


def test_refused_fields_at_what_the_proxy_does_anyway_are_accepted(s):
    s.chat(
        USER,
        extra_body={
            "echo": False,
            "add_generation_prompt": True,
            "continue_final_message": False,
            "priority": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    answer = s.answers()[-1]["payload"]
    assert answer["chat_template_kwargs"] == {"enable_thinking": False}
    assert "echo" not in answer and "add_generation_prompt" not in answer


def test_unknown_fields_are_accepted_ignored_and_counted(s):
    """A client's `client_metadata` (and any field the proxy does not know) was a 400."""
    before = s.metrics()["molctl_proxy_ignored_request_fields_total"]
    s.chat(USER, extra_body={"client_metadata": {"a": "b"}, "frobnicate": 1})
    answer = s.answers()[-1]["payload"]
    assert "client_metadata" not in answer and "frobnicate" not in answer
    assert s.metrics()["molctl_proxy_ignored_request_fields_total"] == before + 2


def test_an_unknown_field_is_logged_once_and_a_400_in_strict_mode(keyfile, tmp_path):
    with own_stack(keyfile, tmp_path) as st:
        for _ in range(3):
            st.chat(USER, extra_body={"client_metadata": {"a": "b"}})
        assert wait_for(lambda: "client_metadata" in (tmp_path / "proxy.log").read_text(), 5)
        assert (tmp_path / "proxy.log").read_text().count("'client_metadata' ignored") == 1
    strict = tmp_path / "strict"
    strict.mkdir()
    with own_stack(keyfile, strict, "--set", "proxy.request_fields=reject") as st:
        with pytest.raises(openai.BadRequestError) as err:
            st.chat(USER, extra_body={"client_metadata": {"a": "b"}})
        assert err.value.param == "client_metadata" and "request_fields" in err.value.message
        st.chat(USER, extra_body={"ignore_eos": True})  # an engine extension is no unknown field


def test_forced_generation_keeps_the_operators_output_limit(s):
    """`ignore_eos`/`min_tokens` without max_tokens on a prompt too long for the proxy's own bound
    reached the engine with no limit: the answer filled the engine's window, past proxy.max_output_tokens."""
    long = [{"role": "user", "content": "[route:L2] " + "word " * 358}]
    s.chat(long)
    assert "max_tokens" not in s.answers()[-1]["payload"]  # unforced: the engine fills the room left
    s.chat(long, extra_body={"ignore_eos": True})
    assert s.answers()[-1]["payload"]["max_tokens"] == TINY.proxy.max_output_tokens
    s.chat(long, extra_body={"min_tokens": 8})
    assert s.answers()[-1]["payload"]["max_tokens"] == TINY.proxy.max_output_tokens
    with pytest.raises(openai.BadRequestError) as err:
        s.chat(USER, extra_body={"min_tokens": 2048})
    assert err.value.param == "min_tokens" and "proxy.max_output_tokens" in err.value.message


def test_null_is_not_given_for_an_unknown_field_also_in_strict_mode():
    """A null unknown field was a 400 with `proxy.request_fields: reject`, though a null is "not given"."""
    policy = FieldPolicy(get_engine("vllm").request_extensions, reject_unknown=True)
    policy.check_extra({"model": PUBLIC, "client_metadata": None}, {"model"}, "chat")
    with pytest.raises(ProxyError, match="client_metadata"):
        policy.check_extra({"model": PUBLIC, "client_metadata": {}}, {"model"}, "chat")


def test_a_nested_key_named_like_a_refused_field_is_an_unknown_key_not_a_refusal():
    """`reasoning: {"echo": true}` was refused as if it were the top-level `echo`."""
    policy = FieldPolicy(get_engine("vllm").request_extensions)
    policy.check_extra({"echo": True, "priority": 5}, ("effort", "summary"), "responses", "reasoning.")
    with pytest.raises(ProxyError, match="'echo' is not supported"):
        policy.check_extra({"echo": True}, {"model"}, "chat")


# ------------------------------------------------------------------------ the Responses API

NAMESPACE = {
    "type": "namespace",
    "name": "crm",
    "description": "The customer database",
    "tools": [
        {
            "type": "function",
            "name": "lookup",
            "description": "Find a customer",
            "parameters": {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]},
        },
        {"type": "custom", "name": "sql"},
    ],
}
HOSTED = [
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "local_shell"},
    {"type": "mcp", "server_label": "x", "server_url": "https://mcp.example.com"},
    {"type": "custom", "name": "apply_patch"},
    {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
]
SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}


def respond(s, stream: bool, **kw):
    """A Response, created whole or through the SDK's `responses.stream` helper."""
    if not stream:
        return s.client.responses.create(**kw)
    with s.client.responses.stream(**kw) as events:
        return events.get_final_response()


def test_a_coding_agents_first_request_is_answered(s):
    """A coding agent's first Responses request was refused three times in a row: 400 for
    `client_metadata`, for a `namespace` tool, for a hosted `web_search` tool."""
    r = post(
        s,
        "/v1/responses",
        input=[
            {"type": "message", "role": "developer", "content": "be brief"},
            {"type": "message", "role": "user", "content": "[route:L2] hi"},
        ],
        client_metadata={"x": "y"},
        tools=[SHELL, NAMESPACE, *HOSTED],
        parallel_tool_calls=False,
        prompt_cache_key="k",
        text={"verbosity": "low"},
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "low", "summary": "auto"},
        service_tier="auto",
        truncation="auto",
        metadata={"a": "b"},
    )
    assert r.status_code == 200, r.text
    tools = s.answers()[-1]["payload"]["tools"]
    assert [t["function"]["name"] for t in tools] == ["shell", "crm__lookup"]  # hosted and custom tools left out
    assert "The customer database" in tools[1]["function"]["description"]
    assert r.json()["tools"][1]["type"] == "namespace"  # the request's tools echoed as sent


@pytest.mark.parametrize("stream", [False, True])
def test_a_namespaced_call_comes_back_named_as_the_client_named_it_and_the_loop_closes(s, stream):
    kw = {"model": PUBLIC, "tools": [SHELL, NAMESPACE], "store": False}
    first = respond(s, stream, input="[route:L2] [tool:crm__lookup] who?", **kw)
    call = next(i for i in first.output if i.type == "function_call")
    assert (call.name, call.namespace) == ("lookup", "crm")
    assert json.loads(call.arguments) == {"email": "Paris"}  # from the function's own schema
    second = s.client.responses.create(
        input=[
            {"type": "message", "role": "user", "content": "[route:L2] [tool:crm__lookup] who?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "lookup",
                "namespace": "crm",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Ada"},
        ],
        **kw,
    )
    assert second.output_text.endswith("using Ada")
    sent = s.answers()[-1]["payload"]["messages"]
    assert sent[-2]["tool_calls"][0]["function"]["name"] == "crm__lookup"


@pytest.mark.parametrize(
    "choice,expect_choice,expect_tools",
    [
        (
            {"type": "function", "name": "lookup", "namespace": "crm"},
            {"type": "function", "function": {"name": "crm__lookup"}},
            ["shell", "crm__lookup"],
        ),
        (
            {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "shell"}]},
            "required",
            ["shell"],
        ),
        ({"type": "web_search_preview"}, "auto", ["shell", "crm__lookup"]),
        ({"type": "custom", "name": "apply_patch"}, "auto", ["shell", "crm__lookup"]),
    ],
)
def test_tool_choice_forms(s, choice, expect_choice, expect_tools):
    r = post(s, "/v1/responses", input="[route:L2] go", tools=[SHELL, NAMESPACE, *HOSTED], tool_choice=choice)
    assert r.status_code == 200, r.text
    payload = s.answers()[-1]["payload"]
    assert payload["tool_choice"] == expect_choice
    assert [t["function"]["name"] for t in payload["tools"]] == expect_tools


def test_only_hosted_tools_and_required_is_a_400_naming_tool_choice(s):
    """Guards the dropped instruction (issue 40): 'required' with nothing to call was sent as a plain answer."""
    r = post(s, "/v1/responses", input="[route:L2] go", tools=[{"type": "web_search"}], tool_choice="required")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"


def test_items_of_tools_this_server_never_runs_are_left_out_and_unknown_items_are_400s(s):
    r = post(
        s,
        "/v1/responses",
        input=[
            {"type": "message", "role": "user", "content": "search"},
            {
                "type": "web_search_call",
                "id": "ws_1",
                "status": "completed",
                "action": {"type": "search", "query": "q"},
            },
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "***"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
            {"type": "message", "role": "user", "content": "[route:L2] and now?"},
        ],
    )
    assert r.status_code == 200, r.text
    sent = s.answers()[-1]["payload"]["messages"]
    assert [m["role"] for m in sent[1:]] == ["user", "user"]  # after the identity system message
    r = post(
        s,
        "/v1/responses",
        input=[{"type": "hologram", "content": "x"}, {"type": "message", "role": "user", "content": "q"}],
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].type", r.text
    # a compaction item is served (POST /v1/responses/compact), but only one this proxy made
    r = post(
        s,
        "/v1/responses",
        input=[{"type": "compaction", "encrypted_content": "x"}, {"type": "message", "role": "user", "content": "q"}],
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content", r.text


def test_item_references_name_stored_output_items(s):
    """The AI SDK's Responses provider (store: true, its default) sends an earlier answer back as
    {"type": "item_reference", "id"}; the proxy answered 400 for the item type."""
    first = s.client.responses.create(model=PUBLIC, input="[route:L2] hi")
    msg = next(i for i in first.output if i.type == "message")
    r = post(
        s,
        "/v1/responses",
        input=[
            {"type": "message", "role": "user", "content": "[route:L2] hi"},
            {"type": "item_reference", "id": msg.id},
            {"type": "message", "role": "user", "content": "[route:L2] and?"},
        ],
    )
    assert r.status_code == 200, r.text
    sent = s.answers()[-1]["payload"]["messages"]
    assert sent[-2] == {"role": "assistant", "content": first.output_text}
    unstored = s.client.responses.create(model=PUBLIC, input="[route:L2] hi", store=False)
    for item_id in (next(i for i in unstored.output if i.type == "message").id, "msg_nosuch"):
        r = post(
            s,
            "/v1/responses",
            input=[{"type": "item_reference", "id": item_id}, {"type": "message", "role": "user", "content": "q"}],
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert item_id in r.json()["error"]["message"]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_round_trips_with_store_false(s, field, stream):
    """The reasoning items the proxy returned come back in a later input with store: false; the
    answer hop gets that reasoning on the assistant message that made the call, in both the field
    vLLM reads (`reasoning`) and the one SGLang reads (`reasoning_content`)."""
    s.config(answer_reasoning="let me think it through", reasoning_field=field)
    kw = {"model": PUBLIC, "tools": [SHELL], "store": False, "include": ["reasoning.encrypted_content"]}
    first = respond(s, stream, input="[route:L2] [tool:shell] ls", **kw)
    rs = next(i for i in first.output if i.type == "reasoning")
    assert rs.content[0].text == "let me think it through" and rs.encrypted_content
    call = next(i for i in first.output if i.type == "function_call")
    # as a store:false client resends it: only the opaque blob, the text stripped
    back = {"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content}
    s.client.responses.create(
        input=[
            {"type": "message", "role": "user", "content": "[route:L2] [tool:shell] ls"},
            back,
            {"type": "function_call", "call_id": call.call_id, "name": "shell", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"},
        ],
        **kw,
    )
    assistant = s.answers()[-1]["payload"]["messages"][-2]
    assert assistant["reasoning"] == assistant["reasoning_content"] == "let me think it through"
    assert assistant["tool_calls"][0]["id"] == call.call_id


def test_foreign_encrypted_reasoning_is_left_out(s):
    r = post(
        s,
        "/v1/responses",
        input=[
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB-openai-blob"},
            {"type": "message", "role": "assistant", "content": "hello"},
            {"type": "message", "role": "user", "content": "[route:L2] again"},
        ],
    )
    assert r.status_code == 200, r.text
    assistant = s.answers()[-1]["payload"]["messages"][-2]
    assert assistant["role"] == "assistant" and "reasoning" not in assistant


def test_vllm_extensions_pass_on_the_responses_api_too(s):
    r = post(s, "/v1/responses", input="[route:L2] hi", ignore_eos=True, min_tokens=3)
    assert r.status_code == 200, r.text
    payload = s.answers()[-1]["payload"]
    assert payload["ignore_eos"] is True and payload["min_tokens"] == 3
    r = post(s, "/v1/responses", input="[route:L2] hi", chat_template="{{ x }}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
