"""Route hops first in a full engine: when the profile starts the engine with priority scheduling
(vLLM `--scheduling-policy priority`, as the shipped vLLM profiles do; SGLang
`--enable-priority-scheduling`), the proxy's route hops carry a priority that puts them before
waiting answers and summaries; answers and summaries keep the engine's default. Without it no
priority is sent (vLLM versions that check it answer 400). Driven by the official `openai` SDK
against the fake engine, which refuses a priority the way those vLLM versions do; the real
vLLM 0.32 runs the tiny profile's route hops with it in tests/test_e2e.py."""

from __future__ import annotations

import httpx
import pytest

from molctl.engines import get_engine
from molctl.profiles import load_profile, profile_dirs
from tests.test_proxy import keyfile, own_stack, s, stack  # noqa: F401 - fixtures


def hops(s) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"route": [], "answer": [], "summary": []}
    for entry in s.log():
        if entry.get("hop") in out:
            out[entry["hop"]].append(entry)
    return out


def wait_summary(s) -> None:
    from tests.helpers import wait_for

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
def fcfs_stack(keyfile, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """The tiny profile with vLLM's default policy, on an engine started the same way."""
    with own_stack(keyfile, tmp_path_factory.mktemp("fcfs-logs"), "--set", "engine.args.scheduling-policy=fcfs",
                   scheduling_policy="fcfs") as st:
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
    r = httpx.post(fcfs_stack.engine_url + "/v1/chat/completions",
                   json={"model": "L0", "priority": -1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Got priority -1 but Priority scheduling is not enabled."


@pytest.mark.parametrize("profile, sets, expected", [
    ("tiny", [], -1), ("tall", [], -1), ("venti", [], -1),
    ("tiny", [("engine.args.scheduling-policy", "fcfs")], None),
    ("venti-sglang", [], None),  # SGLang: opt-in, see the README
    ("venti-sglang", [("engine.args.enable-priority-scheduling", True)], 1),  # higher runs first
    ("venti-sglang", [("engine.args.enable-priority-scheduling", True),
                      ("engine.args.schedule-low-priority-values-first", True)], -1),
])
def test_the_route_priority_follows_the_engines_own_flags(profile, sets, expected):
    p = load_profile(profile, profile_dirs(), sets)
    assert get_engine(p.engine.kind).route_priority(p) == expected


def test_a_proxy_in_front_of_an_engine_without_priority_scheduling_drops_the_priority_once(keyfile, tmp_path):  # noqa: F811
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
    assert log.read_text().count("the engine refuses request priorities") == 1
