"""Route hops first in a full engine: when the profile starts the engine with priority scheduling
(vLLM `--scheduling-policy priority`, as the shipped vLLM profiles do; SGLang
`--enable-priority-scheduling`, opt-in), the proxy's hops carry priorities that put route hops
before waiting answers and summaries, which rank equal. Without it no priority is sent, and an
engine that refuses one (vLLM versions that check it answer 400) gets the route hop again without
it. Driven by the official `openai` SDK against the fake engines (the fake vLLM refuses a
priority the way those vLLM versions do); the real vLLM 0.32 runs the tiny profile's route hops
with it in tests/e2e/test_e2e.py, and bench/bench_route_priority.py measures what it buys."""

from __future__ import annotations

import httpx
import pytest

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs
from tests.helpers import wait_for
from tests.proxy_stack import KEY, TOOLS, own_stack
from tests.sglang_stack import PUBLIC as PUBLIC_SGL
from tests.sglang_stack import sglang_stack


def hops(s) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"route": [], "answer": [], "summary": []}
    for entry in s.log():
        if entry.get("hop") in out:
            out[entry["hop"]].append(entry)
    return out


def wait_summary(s) -> None:
    assert wait_for(lambda: s.log("summary"), 10)


def test_route_hops_carry_the_urgent_priority_and_the_other_hops_none(s):
    r = s.chat([{"role": "user", "content": "[route:L2] write a parser"}])
    assert r.choices[0].message.content
    wait_summary(s)
    seen = hops(s)
    assert [e["payload"].get("priority") for e in seen["route"]] == [-1]
    assert all("priority" not in e["payload"] for e in seen["answer"] + seen["summary"])
    assert not any("rejected" in e for e in s.log())
    assert seen["answer"][0]["model"] == "L2"  # the route hop was answered, not fallen back


@pytest.fixture(scope="module")
def fcfs_stack(keyfile, tmp_path_factory):
    """The tiny profile with vLLM's default policy, on an engine started the same way."""
    with own_stack(
        keyfile,
        tmp_path_factory.mktemp("fcfs-logs"),
        "--set",
        "engine.args.scheduling-policy=fcfs",
        scheduling_policy="fcfs",
    ) as st:
        yield st


def test_without_priority_scheduling_no_hop_carries_a_priority(fcfs_stack):
    fcfs_stack.reset()
    r = fcfs_stack.chat([{"role": "user", "content": "[route:L1] plan my trip"}])
    assert r.choices[0].message.content
    wait_summary(fcfs_stack)
    assert all("priority" not in e["payload"] for e in fcfs_stack.log())
    assert not any("rejected" in e for e in fcfs_stack.log())
    assert hops(fcfs_stack)["answer"][0]["model"] == "L1"


def test_the_fake_engine_refuses_a_priority_as_vllm_without_priority_scheduling(fcfs_stack):
    """The stand-in's rule the test above relies on (vLLM's add_request check)."""
    r = httpx.post(
        fcfs_stack.engine_url + "/v1/chat/completions",
        json={"model": "L0", "priority": -1, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Got priority -1 but Priority scheduling is not enabled."


@pytest.mark.parametrize(
    "profile, sets, expected",
    [
        ("tiny", [], {"route": -1}),
        ("tall", [], {"route": -1}),
        ("venti", [], {"route": -1}),
        ("tiny", [("engine.args.scheduling-policy", "fcfs")], {}),
        ("venti-sglang", [], {}),  # SGLang: opt-in, see the README
        # higher runs first; every hop names its priority (SGLang's default is the lowest value)
        ("venti-sglang", [("engine.args.enable-priority-scheduling", True)], {"route": 1, "answer": 0, "summary": 0}),
        (
            "venti-sglang",
            [
                ("engine.args.enable-priority-scheduling", True),
                ("engine.args.schedule-low-priority-values-first", True),
            ],
            {"route": -1, "answer": 0, "summary": 0},
        ),
    ],
)
def test_the_hop_priorities_follow_the_engines_own_flags(profile, sets, expected):
    p = load_profile(profile, profile_dirs(), sets)
    assert get_engine(p.engine.kind).hop_priorities(p) == expected


def test_on_sglang_every_hop_names_its_priority(keyfile, tmp_path):
    """SGLang with --enable-priority-scheduling gives a request without a priority the lowest
    value, and a waiting request preempts running ones more than 10 below it: the route hop's 1
    above answers and summaries at 0 orders it first without preempting them."""
    engine, proxy, st = sglang_stack(keyfile, tmp_path, "--set", "engine.args.enable-priority-scheduling=true", key=KEY)
    with engine, proxy:
        assert (
            st.client.chat.completions.create(
                model=PUBLIC_SGL, messages=[{"role": "user", "content": "[route:L2] write a parser"}]
            )
            .choices[0]
            .message.content
        )
        assert wait_for(lambda: st.log("summary"), 10)
        assert {e["hop"]: e["payload"].get("priority") for e in st.log()} == {"route": 1, "answer": 0, "summary": 0}


def test_a_proxy_in_front_of_an_engine_without_priority_scheduling_drops_the_priority_once(keyfile, tmp_path):
    """`molctl proxy tiny --upstream` in front of a vLLM started without the profile's
    `--scheduling-policy priority` (the harness's scripts, say): the first route hop's 400 is
    retried without the priority, said once in the proxy's log, and later route hops carry none;
    every request is routed, none falls back."""
    with own_stack(keyfile, tmp_path, scheduling_policy="fcfs") as st:
        for label in ("L1", "L3", "L2"):
            assert st.chat([{"role": "user", "content": f"[route:{label}] go"}]).choices[0].message.content
            assert [e["model"] for e in st.log("answer")][-1] == label
        routes = st.log("route")
        assert [e["payload"].get("priority") for e in routes] == [-1, None, None, None]
        assert [("rejected" in e) for e in routes] == [True, False, False, False]
    log = tmp_path / "proxy.log"
    text = log.read_text()
    assert text.count("refuses request priorities") == 1 and "--scheduling-policy priority" in text


def test_vllm_0_8s_refusal_is_recognised_too(keyfile, tmp_path):
    """vLLM 0.8-0.9.1's V1 processor refuses any priority with another text: every route hop fell
    back to the default adapter, the log saying only "HTTP 400"."""
    with own_stack(keyfile, tmp_path, scheduling_policy="fcfs") as st:
        st.config(priority_refusal="V1 does not support priority yet.")
        for label in ("L3", "L1"):
            assert st.chat([{"role": "user", "content": f"[route:{label}] go"}]).choices[0].message.content
            assert [e["model"] for e in st.log("answer")][-1] == label
        assert [e["payload"].get("priority") for e in st.log("route")] == [-1, None, None]
    assert "V1 does not support priority yet." in (tmp_path / "proxy.log").read_text()


def test_a_refusal_is_kept_per_engine_and_tried_again_later(monkeypatch):
    """One engine's refusal (a peer replica's, say) leaves priorities on the hops to the others,
    and the refusing engine gets them again after PRIORITY_RETRY_S (restarted with the flag,
    it needs no proxy restart)."""
    from molctl.proxy.affinity import EngineChoice
    from molctl.proxy.engine_client import EngineClient
    from molctl.proxy.errors import EngineHTTPError
    from molctl.proxy.pipeline import priority
    from molctl.proxy.pipeline.run import Orchestrator
    from molctl.proxy.store.memory import MemoryStore

    profile = load_profile("tiny", profile_dirs())
    orch = Orchestrator(profile, get_engine("vllm"), EngineClient("http://127.0.0.1:9"), MemoryStore())
    refusal = EngineHTTPError(400, {"error": {"message": "Got priority -1 but Priority scheduling is not enabled."}})

    def route_priority(engine: EngineChoice | None = None) -> int | None:
        payload: dict = {}
        orch.priority.mark(payload, "route", engine)
        return payload.get("priority")

    peer = EngineChoice("b", "http://10.0.0.2:8000/")
    orch.priority.refused(refusal, peer)  # the peer engine refused
    assert route_priority(peer) is None
    assert route_priority() == -1  # the own engine still gets it
    monkeypatch.setattr(priority, "PRIORITY_RETRY_S", 0.0)
    assert route_priority(EngineChoice("b", "http://10.0.0.2:8000")) == -1  # tried again
    assert orch.counters.values["route_priority_refusals_total"] == 1


def test_sglang_answers_and_summaries_name_a_priority_only_where_a_route_hop_took_one(monkeypatch):
    """SGLang's answers and summaries carry their explicit 0 only to an engine that ran a route hop
    with its priority: an engine started without the flag but with --abort-on-priority-when-disabled
    refuses any priority with a 503, and only the route hop is sent again (a tool-result turn has no
    route hop; a summary built after a refusal expired has no second chance)."""
    from molctl.proxy.engine_client import EngineClient
    from molctl.proxy.errors import EngineHTTPError
    from molctl.proxy.pipeline import priority as policy
    from molctl.proxy.pipeline.run import Orchestrator
    from molctl.proxy.store.memory import MemoryStore

    profile = load_profile("venti-sglang", profile_dirs(), [("engine.args.enable-priority-scheduling", True)])
    orch = Orchestrator(profile, get_engine("sglang"), EngineClient("http://127.0.0.1:9"), MemoryStore())

    def priority(hop: str) -> int | None:
        payload: dict = {}
        orch.priority.mark(payload, hop, None)
        return payload.get("priority")

    assert (priority("route"), priority("answer"), priority("summary")) == (1, None, None)  # no route hop yet
    orch.priority.taken.add("http://127.0.0.1:9")  # what a route hop that ran with its priority records
    assert (priority("route"), priority("answer"), priority("summary")) == (1, 0, 0)
    orch.priority.refused(
        EngineHTTPError(
            503,
            {
                "object": "error",
                "message": "Using priority is disabled for this server. Please send a new request without a priority.",
            },
        ),
        None,
    )
    assert (priority("route"), priority("answer"), priority("summary")) == (None, None, None)
    monkeypatch.setattr(policy, "PRIORITY_RETRY_S", 0.0)  # expired: the route hop tries again, the others wait
    assert (priority("route"), priority("answer"), priority("summary")) == (1, None, None)


def test_an_sglang_engine_that_aborts_priorities_loses_no_request(keyfile, tmp_path):
    """The proxy's profile opts in, its engine aborts any priority (503): the route hop is sent
    again without one, and the tool-result turn after it (no route hop) and the summary carry
    none, so every request is answered and no summary fails."""
    engine, proxy, st = sglang_stack(keyfile, tmp_path, "--set", "engine.args.enable-priority-scheduling=true", key=KEY)
    with engine, proxy:
        st.config(abort_on_priority=True)
        client = st.client
        convo = [{"role": "user", "content": "[route:L1] [tool:get_weather] weather in Paris?"}]
        first = client.chat.completions.create(model=PUBLIC_SGL, messages=convo, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        convo += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        second = client.chat.completions.create(model=PUBLIC_SGL, messages=convo, tools=TOOLS)
        assert second.choices[0].message.content
        assert wait_for(lambda: st.log("summary"), 10)
        entries = st.log()
        # the route hop refused once and sent again, the tool-result turn sticky (no route hop),
        # the summary of the answered turn (a turn of tool calls has none)
        assert [(e["hop"], "rejected" in e) for e in entries] == [
            ("route", True),
            ("route", False),
            ("answer", False),
            ("answer", False),
            ("summary", False),
        ]
        assert all("priority" not in e["payload"] for e in entries if "rejected" not in e)
