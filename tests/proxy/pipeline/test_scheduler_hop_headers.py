"""With llm-d's scheduler in front (`proxy.scheduler_objectives`, set by `render k8s --scheduler
llm-d`), every hop carries what the Endpoint Picker reads: the conversation's `x-session-id` (the
same on every turn, so the turns meet their prefix cache), the hop's InferenceObjective in
`x-llm-d-inference-objective` (route, answer, summary) and the tenant's
`x-llm-d-inference-fairness-id` (a digest, never the key), beside the `traceparent` tracing sends.
Without the field none is sent. Driven by the official `openai` SDK against the scripted engine,
which records each hop's headers."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from molctl.proxy import tracing
from molctl.proxy.scheduler_hints import FAIRNESS_HEADER, OBJECTIVE_HEADER, SESSION_HEADER
from tests.helpers import free_ports, wait_for
from tests.otlp_receiver import OtlpReceiver
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import KEY, KEY2, PUBLIC, Stack

PREFIX = "molctl-tiny"
HEX32 = re.compile(r"^[0-9a-f]{32}$")
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")  # W3C trace context


@pytest.fixture(scope="module")
def llmd(keyfile, tmp_path_factory):
    """A fake engine and a tiny proxy with the field set and traces on (to tests/otlp_receiver.py)."""
    logs = tmp_path_factory.mktemp("llmd")
    engine_port, proxy_port, otlp_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    off = {v: "" for v in (*tracing.ENDPOINT_VARIABLES, tracing.CAPTURE_VARIABLE)}
    with OtlpReceiver(otlp_port) as receiver:
        env = {**off, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        argv = proxy_argv(
            "tiny",
            engine_url,
            proxy_port,
            "--api-key-file",
            str(keyfile),
            "--set",
            f"proxy.scheduler_objectives={PREFIX}",
        )
        with (
            running(fake_engine_argv(engine_port), engine_url + "/health", log=logs / "engine.log"),
            running(argv, proxy_url + "/health", env=env, log=logs / "proxy.log"),
        ):
            yield Stack(engine_url, proxy_url)


@pytest.fixture
def sched(llmd):
    llmd.reset()
    return llmd


def _turn(s, key: str, messages: list[dict]) -> list[dict]:
    """One chat turn with `key`; the engine's log entries of its hops (summary included)."""
    client = openai.OpenAI(base_url=s.proxy_url + "/v1", api_key=key, max_retries=0, timeout=30)
    before = len(s.log())
    reply = client.chat.completions.create(model=PUBLIC, messages=messages)
    assert wait_for(lambda: any(e["hop"] == "summary" for e in s.log()[before:]), 15)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return [e for e in s.log()[before:] if "event" not in e]


def test_each_hop_carries_its_objective_the_session_and_the_tenant(sched):
    convo = [{"role": "user", "content": "[route:L2] write a parser"}]
    first = _turn(sched, KEY, convo)
    convo.append({"role": "user", "content": "[route:L1] now test it"})
    second = _turn(sched, KEY, convo)
    for entries in (first, second):
        hops = {e["hop"] for e in entries}
        assert {"route", "answer", "summary"} <= hops, hops
        for entry in entries:
            headers = entry["scheduler"]
            objective = {"route": "route", "summary": "summary"}.get(entry["hop"], "answer")
            assert headers[OBJECTIVE_HEADER] == f"{PREFIX}-{objective}", entry["hop"]
            assert HEX32.match(headers[SESSION_HEADER]) and HEX32.match(headers[FAIRNESS_HEADER])
            assert KEY not in str(headers)
            assert TRACEPARENT.match(entry["traceparent"] or ""), entry["hop"]  # tracing on: beside them
    sessions = {e["scheduler"][SESSION_HEADER] for e in first + second}
    tenants = {e["scheduler"][FAIRNESS_HEADER] for e in first + second}
    assert len(sessions) == 1 and len(tenants) == 1  # a conversation's turns meet on one pod's cache

    other_convo = _turn(sched, KEY, [{"role": "user", "content": "[route:L2] something else"}])
    other_tenant = _turn(sched, KEY2, [{"role": "user", "content": "[route:L2] write a parser"}])
    assert {e["scheduler"][SESSION_HEADER] for e in other_convo}.isdisjoint(sessions)
    assert {e["scheduler"][FAIRNESS_HEADER] for e in other_convo} == tenants
    assert {e["scheduler"][FAIRNESS_HEADER] for e in other_tenant}.isdisjoint(tenants)
    assert {e["scheduler"][SESSION_HEADER] for e in other_tenant}.isdisjoint(sessions)  # per tenant


def test_the_responses_api_carries_them_too(sched):
    client = openai.OpenAI(base_url=sched.proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    first = client.responses.create(model=PUBLIC, input="[route:L2] write a parser")
    client.responses.create(model=PUBLIC, input="[route:L1] now test it", previous_response_id=first.id)
    entries = [e for e in sched.log() if e["hop"] in ("route", "answer")]
    assert len(entries) >= 4
    assert len({e["scheduler"][SESSION_HEADER] for e in entries}) == 1
    assert {e["scheduler"][OBJECTIVE_HEADER] for e in entries} == {f"{PREFIX}-route", f"{PREFIX}-answer"}


def test_without_the_field_no_scheduler_header_is_sent(s):
    s.chat([{"role": "user", "content": "[route:L2] write a parser"}])
    assert wait_for(lambda: s.log("summary"), 15)
    assert all(set(e["scheduler"].values()) == {None} for e in s.log())


def test_with_a_scheduler_the_shared_store_is_not_asked_for_an_engine():
    """The replicas' affinity redirect is off: the hops go to the own upstream (the router)."""
    from molctl.engines import get_engine
    from molctl.profiles import load_profile, profile_dirs
    from molctl.proxy.engine_client import EngineClient
    from molctl.proxy.pipeline.run import Orchestrator
    from molctl.proxy.store.memory import MemoryStore

    profile = load_profile("tiny", profile_dirs(), [("proxy.scheduler_objectives", PREFIX)])

    class SharedStore(MemoryStore):
        shared = True

        async def load(self, *args, **kwargs):
            return False

        async def choose_engine(self, owner, scope=None):
            raise AssertionError("the affinity redirect is off with a scheduler")

    client = EngineClient("http://router.example:8081")
    orch = Orchestrator(profile, get_engine("vllm"), client, SharedStore())
    plan = orch.prepare({"model": PUBLIC, "messages": [{"role": "user", "content": "hi"}]}, "tenant-a")
    asyncio.run(orch.load(plan))
    assert client.target_url(plan.engine) == "http://router.example:8081"
    assert plan.engine.scheduler.headers("summary")[OBJECTIVE_HEADER] == f"{PREFIX}-summary"


@pytest.mark.parametrize("value", ["Molctl_Tiny", "-tiny", "tiny-", "a" * 239])
def test_a_bad_prefix_is_a_profile_error_naming_the_field(value):
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    with pytest.raises(ProfileError, match=r"proxy\.scheduler_objectives.*expected an object name prefix"):
        load_profile("tiny", profile_dirs(), [("proxy.scheduler_objectives", value)])
