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
from tests.helpers import wait_for
from tests.test_proxy import KEY, PUBLIC, keyfile, own_stack, s, stack  # noqa: F401 - fixtures

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "[route:L2] hello"}]


def post(s, path: str = "/v1/chat/completions", **body) -> httpx.Response:
    return httpx.post(s.proxy_url + path, headers=AUTH, json={"model": PUBLIC, **body}, timeout=30)


def test_vllm_bench_serve_requests_are_answered_and_ignore_eos_reaches_the_answer_hop_only(s):
    """`vllm bench serve --backend openai-chat --dataset-name random` forces ignore_eos: true
    (vllm/benchmarks/lib/endpoint_request_func.py); the proxy answered 400 for it, 40 of 40."""
    body = {"messages": USER, "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", s.proxy_url + "/v1/chat/completions", headers=AUTH, json={"model": PUBLIC, **body},
                      timeout=30) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    assert "data: [DONE]" in text
    answer = s.log("answer")[-1]["payload"]
    assert answer["ignore_eos"] is True and answer["max_tokens"] == 16
    assert wait_for(lambda: s.log("summary"), 10)
    for hop in ("route", "summary"):
        assert all("ignore_eos" not in e["payload"] for e in s.log(hop)), hop


EXTENSIONS = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "length_penalty": 1.0, "min_tokens": 2,
              "stop_token_ids": [7, 8], "include_stop_str_in_output": True, "skip_special_tokens": False,
              "spaces_between_special_tokens": False, "bad_words": ["bad"], "allowed_token_ids": [1, 2, 3],
              "prompt_logprobs": 1, "structured_outputs": {"choice": ["a", "b"]}, "include_reasoning": False,
              "cache_salt": "salt", "ignore_eos": True}


def test_every_vllm_extension_is_passed_to_the_answer_hop_as_sent(s):
    assert set(EXTENSIONS) == set(get_engine("vllm").request_extensions)  # the test covers the whole table
    s.chat(USER, extra_body=EXTENSIONS)
    answer = s.log("answer")[-1]["payload"]
    assert {k: answer.get(k) for k in EXTENSIONS} == EXTENSIONS
    route = s.log("route")[-1]["payload"]  # its own structured_outputs (the labels), none of the client's
    assert all(route.get(k) != v for k, v in EXTENSIONS.items())


@pytest.mark.parametrize("field,value", [("ignore_eos", "yes"), ("min_tokens", 1.5), ("stop_token_ids", ["7"]),
                                         ("bad_words", "bad"), ("min_p", "Infinity"), ("top_k", True),
                                         ("structured_outputs", "json")])
def test_an_extension_of_the_wrong_kind_is_a_400_naming_it(s, field, value):
    before = len(s.log())
    raw = json.dumps({"model": PUBLIC, "messages": USER, field: value})
    if value == "Infinity":  # a JSON number Python's reader takes
        raw = raw.replace('"Infinity"', "Infinity")
    r = httpx.post(s.proxy_url + "/v1/chat/completions", headers={**AUTH, "Content-Type": "application/json"},
                   content=raw, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert field in r.json()["error"]["message"]
    assert len(s.log()) == before  # refused before any hop


@pytest.mark.parametrize("field,value", [
    ("echo", True), ("add_generation_prompt", False), ("continue_final_message", True),
    ("chat_template", "{{ messages }}"), ("priority", 5), ("lora_request", {"lora_name": "L3"}),
    ("guided_json", {"type": "object"}), ("use_beam_search", True), ("truncate_prompt_tokens", 10),
    ("chat_template_kwargs", {"tools": []}), ("documents", [{"title": "t", "text": "x"}]),
])
def test_fields_that_would_break_the_contract_are_a_400_naming_them_and_why(s, field, value):
    before = len(s.log())
    with pytest.raises(openai.BadRequestError) as err:
        s.chat(USER, extra_body={field: value})
    assert (err.value.param or "").startswith(field), err.value.param
    assert "not" in err.value.message  # says why: "is not supported: ..." / "is not a template variable ..."
    assert len(s.log()) == before


def test_refused_fields_at_what_the_proxy_does_anyway_are_accepted(s):
    s.chat(USER, extra_body={"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                             "priority": 0, "chat_template_kwargs": {"enable_thinking": False}})
    answer = s.log("answer")[-1]["payload"]
    assert answer["chat_template_kwargs"] == {"enable_thinking": False}
    assert "echo" not in answer and "add_generation_prompt" not in answer


def test_unknown_fields_are_accepted_ignored_and_counted(s):
    """A client's `client_metadata` (and any field the proxy does not know) was a 400."""
    before = s.metrics()["molctl_proxy_ignored_request_fields_total"]
    s.chat(USER, extra_body={"client_metadata": {"a": "b"}, "frobnicate": 1})
    answer = s.log("answer")[-1]["payload"]
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
