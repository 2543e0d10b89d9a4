"""Proxy replicas on one shared Redis store, each with its own fake engine (issue 13): turns that
alternate between the replicas keep their folds and summaries and all their engine hops land on
one engine (conversation affinity); a Responses chain created on one replica continues on the
other; a replica killed mid-conversation is taken over by the other. Driven by the openai SDK."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from tests.helpers import free_port, free_ports
from tests.procs import fake_engine_argv, proxy_argv, running, stop
from tests.proxy_stack import IDENTITY, KEY, PUBLIC, STRICT, answers_of, fold
from tests.redis_helpers import PATIENT_STORE
from tests.redis_server import redis_server


class Replica:
    def __init__(self, name: str, engine_url: str, proxy_url: str, metrics_url: str):
        self.name, self.engine_url, self.proxy_url, self.metrics_url = name, engine_url, proxy_url, metrics_url
        self.client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def log(self, hop: str | None = None) -> list[dict]:
        return [e for e in httpx.get(self.engine_url + "/_log").json() if hop is None or e["hop"] == hop]

    def answers(self) -> list[dict]:
        return answers_of(self.log())

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.metrics_url + "/metrics").text  # the metrics listener: no key
        return {
            line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
        }

    def reset(self) -> None:
        httpx.post(self.engine_url + "/_reset").raise_for_status()

    def chat(self, messages: list[dict], stream: bool = False) -> str:
        if not stream:
            return self.client.chat.completions.create(model=PUBLIC, messages=messages).choices[0].message.content
        return "".join(
            c.choices[0].delta.content or ""
            for c in self.client.chat.completions.create(model=PUBLIC, messages=messages, stream=True)
            if c.choices
        )


def start_replica(stack, name: str, redis_url: str, keyfile, logs, *extra: str) -> tuple[Replica, object, object]:
    engine_port, proxy_port, metrics_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    engine = stack.enter_context(
        running(fake_engine_argv(engine_port, STRICT), engine_url + "/health", log=logs / f"engine-{name}.log")
    )
    proxy = stack.enter_context(
        running(
            proxy_argv(
                "tiny",
                engine_url,
                proxy_port,
                "--api-key-file",
                str(keyfile),
                "--set",
                f"proxy.store={redis_url}",
                *PATIENT_STORE,
                "--replica-id",
                name,
                "--metrics-port",
                str(metrics_port),
                *extra,
            ),
            proxy_url + "/readyz",
            log=logs / f"proxy-{name}.log",
        )
    )
    return Replica(name, engine_url, proxy_url, f"http://127.0.0.1:{metrics_port}"), engine, proxy


@pytest.fixture(scope="module")
def cluster(keyfile, tmp_path_factory):
    import contextlib

    logs = tmp_path_factory.mktemp("replica-logs")
    with redis_server() as redis, contextlib.ExitStack() as stack:
        a, _, _ = start_replica(stack, "A", redis.url, keyfile, logs)
        b, _, _ = start_replica(stack, "B", redis.url, keyfile, logs)
        yield redis, a, b, logs


@pytest.fixture
def ab(cluster):
    redis, a, b, _ = cluster
    a.reset()
    b.reset()
    return a, b


def system_only() -> dict:
    return {"role": "system", "content": IDENTITY["content"]}


@pytest.mark.parametrize("stream", [False, True])
def test_turns_alternating_between_replicas_keep_folds_and_land_on_one_engine(ab, stream):
    a, b = ab
    u = [
        {"role": "user", "content": f"[route:{r}] step {i} ({stream})"} for i, r in enumerate(["L2", "L1", "L2", "L3"])
    ]
    history: list[dict] = []
    answers = []
    for i, replica in enumerate([a, b, a, b]):
        history.append(u[i])
        answers.append(replica.chat(list(history), stream=stream))
        history.append({"role": "assistant", "content": answers[-1]})
    assert all(x.startswith("answer-") for x in answers)
    assert b.log() == []  # no hop of this conversation reached B's engine
    hops = a.log()
    assert [e["model"] for e in hops if e["hop"] == "answer"] == ["L2", "L1", "L2", "L3"]
    assert len([e for e in hops if e["hop"] == "route"]) == 4
    answer_views = [e["messages"] for e in hops if e["hop"] == "answer"]
    A = [{"role": "assistant", "content": x} for x in answers]
    sys_msg = system_only()
    # folds with the summaries made on the engine, whichever replica made them
    assert answer_views[1] == [sys_msg, u[0], fold(f"summary of {answers[0]}"), u[1]]
    assert answer_views[2] == [sys_msg, u[0], A[0], u[1], fold(f"summary of {answers[1]}"), u[2]]
    assert answer_views[3] == [
        sys_msg,
        u[0],
        fold(f"summary of {answers[0]}"),
        u[1],
        fold(f"summary of {answers[1]}"),
        u[2],
        fold(f"summary of {answers[2]}"),
        u[3],
    ]
    # and each replica saw the other's records: B served turns 2 and 4 through A's engine
    assert [e["model"] for e in hops if e["hop"] == "summary"][:3] == ["L2", "L1", "L2"]


def test_tool_call_continues_on_the_adapter_and_engine_that_issued_it(ab):
    a, b = ab
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    u1 = {"role": "user", "content": "[route:L3] [tool:get_weather] weather?"}
    first = a.client.chat.completions.create(model=PUBLIC, messages=[u1], tools=tools).choices[0].message
    [call] = first.tool_calls
    follow = [
        u1,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    reply = b.client.chat.completions.create(model=PUBLIC, messages=follow, tools=tools).choices[0].message.content
    assert "sunny" in reply
    assert b.log() == []
    assert [e["model"] for e in a.answers()] == ["L3", "L3"]  # sticky: no route hop for the tool result
    assert len(a.log("route")) == 1


def test_responses_chain_created_on_one_replica_continues_on_the_other(ab):
    a, b = ab
    first = a.client.responses.create(model=PUBLIC, input="[route:L1] remember the number 7")
    second = b.client.responses.create(model=PUBLIC, input="[route:L1] which number?", previous_response_id=first.id)
    assert second.status == "completed" and second.previous_response_id == first.id
    assert b.client.responses.retrieve(first.id).output_text == first.output_text
    third = a.client.responses.create(model=PUBLIC, input="[route:L1] and again", previous_response_id=second.id)
    assert third.status == "completed"
    assert b.log() == []
    views = [e["messages"] for e in a.answers()]
    assert views[1][1:] == [
        {"role": "user", "content": "[route:L1] remember the number 7"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "[route:L1] which number?"},
    ]


def test_a_replica_killed_mid_conversation_is_taken_over(cluster, keyfile):
    import contextlib

    redis, _, b, logs = cluster
    b.reset()
    with contextlib.ExitStack() as stack:
        c, c_engine, c_proxy = start_replica(stack, "C", redis.url, keyfile, logs)
        u = [{"role": "user", "content": f"[route:{r}] part {i}"} for i, r in enumerate(["L1", "L2", "L1", "L2"])]
        history: list[dict] = []
        answers = []

        def turn(replica: Replica, i: int) -> None:
            history.append(u[i])
            answers.append(replica.chat(list(history)))
            history.append({"role": "assistant", "content": answers[-1]})

        turn(c, 0)
        turn(b, 1)  # C is alive: B's hops go to C's engine
        assert b.log() == [] and [e["model"] for e in c.answers()] == ["L1", "L2"]
        os.killpg(c_proxy.pid, signal.SIGKILL)  # the whole replica dies: its proxy (its heartbeat still fresh)...
        c_proxy.wait(10)
        stop(c_engine)  # ...and its engine: B's hops find it refusing connections and B takes over at once
        turn(b, 2)
        turn(b, 3)
    views = [e["messages"] for e in b.answers()]
    assert [e["model"] for e in b.answers()] == ["L1", "L2"]
    assert len(b.log("route")) == 2 and len(b.log("summary")) == 2
    # B took the conversation over with its folds: turn 1 (L2, made on C) is folded with C's summary
    assert views[0] == [
        system_only(),
        u[0],
        {"role": "assistant", "content": answers[0]},
        u[1],
        fold(f"summary of {answers[1]}"),
        u[2],
    ]


def test_a_replica_stopped_cleanly_is_taken_over_even_though_its_engine_still_runs(cluster, keyfile):
    """A stopped proxy unregisters its heartbeat: its engine (still up, e.g. being drained) gets no
    more hops; the other replica takes the conversation over at once, on its own engine."""
    import contextlib

    redis, _, b, logs = cluster
    b.reset()
    before = b.metrics()["molctl_proxy_state_affinity_takeovers_total"]
    with contextlib.ExitStack() as stack:
        d, _, d_proxy = start_replica(stack, "D", redis.url, keyfile, logs)
        u1 = {"role": "user", "content": "[route:L3] first"}
        a1 = d.chat([u1])
        stop(d_proxy)  # SIGTERM: drained, unregistered; D's engine keeps running
        u2 = {"role": "user", "content": "[route:L3] second"}
        b.chat([u1, {"role": "assistant", "content": a1}, u2])
        assert [e["model"] for e in d.answers()] == ["L3"]  # nothing more reached D's engine
    assert [e["model"] for e in b.answers()] == ["L3"]
    assert b.answers()[0]["messages"][1:] == [u1, {"role": "assistant", "content": a1}, u2]
    assert b.metrics()["molctl_proxy_state_affinity_takeovers_total"] == before + 1


def test_a_peer_engine_that_never_accepts_the_connection_is_taken_over(cluster, keyfile):
    """C advertises an engine address whose connections time out (a firewall that drops packets,
    a host gone off the network) while C's own heartbeat stays fresh: B gives C's engine up after
    the connect timeout and answers on its own engine, as for a refused connection (not a 502)."""
    import contextlib
    import socket

    redis, _, b, logs = cluster
    b.reset()
    with contextlib.ExitStack() as stack:
        blackhole = stack.enter_context(socket.socket())
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(0)
        filler = stack.enter_context(socket.create_connection(blackhole.getsockname()))  # the backlog is full:
        assert filler  # further connections are never accepted (their SYNs are dropped)
        c, _, _ = start_replica(
            stack,
            "C2",
            redis.url,
            keyfile,
            logs,
            "--advertise-upstream",
            f"http://127.0.0.1:{blackhole.getsockname()[1]}",
        )
        u1 = {"role": "user", "content": "[route:L2] first"}
        a1 = c.chat([u1])
        u2 = {"role": "user", "content": "[route:L2] second"}
        a2 = b.chat([u1, {"role": "assistant", "content": a1}, u2])
        assert a2.startswith("answer-")
    assert [e["model"] for e in b.answers()] == ["L2"]
    assert b.answers()[0]["messages"][1:] == [u1, {"role": "assistant", "content": a1}, u2]


def test_a_peer_advertising_an_unusable_url_is_taken_over(cluster, keyfile):
    """A heartbeat whose upstream is no http URL (written by hand, an older replica's typo): the
    peers give that engine up for the request and answer on their own, never a 502."""
    import contextlib
    import json

    redis, _, b, logs = cluster
    b.reset()
    with contextlib.ExitStack() as stack:
        e, _, e_proxy = start_replica(stack, "E", redis.url, keyfile, logs)
        u1 = {"role": "user", "content": "[route:L1] first"}
        a1 = e.chat([u1])
        stop(e_proxy)  # unregistered; now a heartbeat with a bad address takes its place
        client = redis.client()
        client.set("molctl:{tiny}:replica:E", json.dumps({"upstream": "10.0.0.5:8100", "at": 0}), px=60_000)
        client.close()
        u2 = {"role": "user", "content": "[route:L1] second"}
        assert b.chat([u1, {"role": "assistant", "content": a1}, u2]).startswith("answer-")
    assert [e["model"] for e in b.answers()] == ["L1"]


@pytest.mark.parametrize("bad", ["10.0.0.5:8100", "ftp://10.0.0.5:8100", "http://"])
def test_a_bad_advertise_upstream_stops_the_proxy_with_one_line(cluster, keyfile, bad):
    import subprocess

    from molctl.errors import ExitStatus
    from tests.helpers import ROOT

    redis, _, _, _ = cluster
    out = subprocess.run(
        proxy_argv(
            "tiny",
            "http://127.0.0.1:9",
            free_port(),
            "--api-key-file",
            str(keyfile),
            "--set",
            f"proxy.store={redis.url}",
            "--advertise-upstream",
            bad,
        ),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == ExitStatus.USAGE and len(lines) == 1, out.stderr
    assert f"--advertise-upstream {bad!r}: expected http://HOST:PORT" in lines[0]
