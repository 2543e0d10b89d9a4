"""Background mode of /v1/responses (issue 42) on the durable stores, with real proxy processes in front
of the scripted engine: `background: true` answers `queued` at once and the answer runs in the proxy
(GET polls it to `completed`, the full record then stored), POST /cancel stops it (the engine request
aborted: the fake engine logs the client gone), `stream=true&starting_after=N` replays the stored
events after N, `proxy.background_max_per_tenant` bounds a key's jobs (429), a killed replica's job is
failed with a reason by the replica that follows it (never left in_progress), and of two replicas on
Redis a live one's job is left alone while a cancel through the other stops it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from molctl.proxy.apis.responses.protocol import parse_request
from molctl.proxy.errors import ProxyError
from tests.helpers import free_ports
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import KEY, PUBLIC
from tests.redis_helpers import PATIENT_STORE
from tests.response_schemas import check

AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": PUBLIC, "input": "[route:L2] plan a trip", "background": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with running(fake_engine_argv(port), url + "/health", log=tmp_path_factory.mktemp("engine") / "engine.log"):
        yield url


@pytest.fixture
def fresh(engine):
    httpx.post(engine + "/_reset").raise_for_status()
    yield engine
    httpx.post(engine + "/_config", json={"answer_delay": 0.0}).raise_for_status()


@pytest.fixture(params=["sqlite", "redis"])
def store_args(request, tmp_path):
    """The proxy's store: SQLite in the test's state dir, or a real redis-server."""
    if request.param == "sqlite":
        yield ["--state-dir", str(tmp_path / "state")]
        return
    from tests.redis_server import redis_server

    with redis_server() as server:
        yield ["--set", f"proxy.store={server.url}", *PATIENT_STORE]


@contextlib.contextmanager
def proxy(tmp_path, keyfile, engine, store_args, *extra, name="proxy"):
    """A proxy process on `store_args` (`--state-dir` is molctl's own option, before `proxy`); no traceback in its log."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    base = proxy_argv("tiny", engine, port, "--api-key-file", str(keyfile), *extra)
    state_dir = store_args[0] == "--state-dir"
    argv = [*base[:3], *(store_args if state_dir else ()), *base[3:], *(() if state_dir else store_args)]
    log = tmp_path / f"{name}.log"
    with running(argv, url + "/health", log=log) as proc:
        yield url, proc
    assert "Traceback" not in log.read_text()


def post(url, body, **kw):
    return httpx.post(url + "/v1/responses", json=body, headers=AUTH, timeout=30, **kw)


def get(url, rid, **params):
    return httpx.get(f"{url}/v1/responses/{rid}", params=params, headers=AUTH, timeout=30)


def wait_status(url, rid, statuses, deadline_s=60.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        r = get(url, rid)
        assert r.status_code == 200, r.text
        if r.json()["status"] in statuses or time.monotonic() > deadline:
            return r.json()
        time.sleep(0.05)


def engine_log(engine) -> list[dict]:
    return httpx.get(engine + "/_log").json()


def wait_for(predicate, deadline_s=30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_background_response_is_queued_then_polled_to_completion(tmp_path, keyfile, fresh, store_args):
    with proxy(tmp_path, keyfile, fresh, store_args) as (url, _):
        r = post(url, BODY)
        assert r.status_code == 200, r.text
        queued = r.json()
        assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
        done = wait_status(url, queued["id"], ("completed", "failed", "cancelled"))
        assert done["status"] == "completed" and done["background"] is True, done
        assert done["output"][0]["content"][0]["text"].startswith("answer-")
        check("Response", queued)  # both shapes as OpenAI's and Open Responses' schemas have them
        check("Response", done)
        assert [e["hop"] for e in engine_log(fresh) if e.get("hop") in ("route", "answer")] == ["route", "answer"]
        # the full record is stored: its input items, and a continuation of it
        assert httpx.get(f"{url}/v1/responses/{queued['id']}/input_items", headers=AUTH).status_code == 200
        follow = post(url, {"model": PUBLIC, "input": "[route:L2] and then?", "previous_response_id": queued["id"]})
        assert follow.status_code == 200 and follow.json()["status"] == "completed", follow.text


def test_cancel_stops_it_and_aborts_the_engine_request(tmp_path, keyfile, fresh, store_args):
    httpx.post(fresh + "/_config", json={"answer_delay": 30.0}).raise_for_status()
    with proxy(tmp_path, keyfile, fresh, store_args) as (url, _):
        rid = post(url, BODY).json()["id"]
        assert wait_for(lambda: any(e.get("hop") == "answer" for e in engine_log(fresh)))  # at the engine now
        assert get(url, rid).json()["status"] == "in_progress"
        r = httpx.post(f"{url}/v1/responses/{rid}/cancel", headers=AUTH)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        check("Response", r.json())
        assert wait_for(lambda: any(e.get("event") == "client_gone" for e in engine_log(fresh)))  # aborted
        assert get(url, rid).json()["status"] == "cancelled"
        again = httpx.post(f"{url}/v1/responses/{rid}/cancel", headers=AUTH)  # idempotent
        assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_a_stream_resumes_after_a_sequence_number_from_the_stored_events(tmp_path, keyfile, fresh, store_args):
    httpx.post(fresh + "/_config", json={"answer_words": 20}).raise_for_status()
    with proxy(tmp_path, keyfile, fresh, store_args) as (url, _):
        live = post(url, {**BODY, "stream": True})  # a background create that streams: the job's events
        assert live.status_code == 200
        events = sse(live.text)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            check("ResponseStreamEvent", event)
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["background"] is True
        rid = events[-1]["response"]["id"]
        whole = sse(get(url, rid, stream="true").text)
        assert whole == events
        tail = sse(get(url, rid, stream="true", starting_after=5).text)
        assert tail == events[6:]
        assert get(url, rid, stream="true", starting_after="x").status_code == 400
    httpx.post(fresh + "/_config", json={"answer_words": 0}).raise_for_status()


def test_a_tenant_past_its_limit_gets_a_429(tmp_path, keyfile, fresh, store_args):
    httpx.post(fresh + "/_config", json={"answer_delay": 30.0}).raise_for_status()
    limit = ["--set", "proxy.background_max_per_tenant=1"]
    with proxy(tmp_path, keyfile, fresh, store_args, *limit) as (url, _):
        first = post(url, BODY).json()["id"]
        refused = post(url, BODY)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "background_max_per_tenant" in refused.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/responses/{first}/cancel", headers=AUTH).status_code == 200
        assert post(url, BODY).status_code == 200  # a cancelled one no longer counts


def test_a_killed_replica_s_response_is_failed_with_a_reason_not_left_in_progress(tmp_path, keyfile, fresh):
    """SQLite: the proxy killed (SIGKILL, no drain) while its background response runs; the proxy
    started after it on the same file finds the acknowledged response and fails it, naming why, once
    the dead one's lease lapsed."""
    httpx.post(fresh + "/_config", json={"answer_delay": 60.0}).raise_for_status()
    store = ["--state-dir", str(tmp_path / "state")]
    with proxy(tmp_path, keyfile, fresh, store, name="first") as (url, proc):
        rid = post(url, BODY).json()["id"]
        assert wait_for(lambda: get(url, rid).json()["status"] == "in_progress")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    with proxy(tmp_path, keyfile, fresh, store, name="second") as (url, _):
        assert get(url, rid).json()["status"] == "in_progress"  # acknowledged: not lost
        failed = wait_status(url, rid, ("failed",))
        assert failed["status"] == "failed", failed
        assert "stopped before it finished" in failed["error"]["message"]
        check("Response", failed)
        replay = sse(get(url, rid, stream="true").text)  # a follower learns it too
        assert replay[-1]["type"] == "response.failed" and replay[-1]["response"]["error"] == failed["error"]


def test_a_replica_that_stops_cleanly_fails_its_running_response_at_once(tmp_path, keyfile, fresh):
    """SIGTERM with a short drain: the response still running at its end is failed by the stopping
    replica itself, naming why (the next one need not wait for a lease to lapse)."""
    httpx.post(fresh + "/_config", json={"answer_delay": 60.0}).raise_for_status()
    store = ["--state-dir", str(tmp_path / "state")]
    with proxy(tmp_path, keyfile, fresh, store, "--drain-timeout", "1", name="first") as (url, proc):
        rid = post(url, BODY).json()["id"]
        assert wait_for(lambda: get(url, rid).json()["status"] == "in_progress")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    with proxy(tmp_path, keyfile, fresh, store, name="second") as (url, _):
        failed = get(url, rid).json()
        assert failed["status"] == "failed" and "replica running it stopped" in failed["error"]["message"], failed


def test_two_replicas_on_redis_leave_a_live_owner_alone_and_cancel_across(tmp_path, keyfile, fresh):
    """Replica B sweeps lapsed jobs every beat: A's job, whose lease A renews, is never failed by B;
    a cancel sent to B stops the answer running on A (A sees it at its next beat: the engine request aborted)."""
    from tests.redis_server import redis_server

    httpx.post(fresh + "/_config", json={"answer_delay": 60.0}).raise_for_status()
    with redis_server() as server:
        store = ["--set", f"proxy.store={server.url}", *PATIENT_STORE]
        with (
            proxy(tmp_path, keyfile, fresh, store, "--replica-id", "A", name="a") as (url_a, _),
            proxy(tmp_path, keyfile, fresh, store, "--replica-id", "B", name="b") as (url_b, _),
        ):
            rid = post(url_a, BODY).json()["id"]
            assert wait_for(lambda: any(e.get("hop") == "answer" for e in engine_log(fresh)))
            time.sleep(12)  # past a lease (10 s): B has swept several times; A renewed its lease meanwhile
            assert get(url_b, rid).json()["status"] == "in_progress"
            r = httpx.post(f"{url_b}/v1/responses/{rid}/cancel", headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            assert wait_for(lambda: any(e.get("event") == "client_gone" for e in engine_log(fresh)))
            assert get(url_a, rid).json()["status"] == "cancelled"


@pytest.mark.parametrize(
    "body, param",
    [({"background": "yes"}, "background"), ({"background": True, "store": False}, "store")],
    ids=str,
)
def test_a_malformed_background_request_is_a_400(body, param):
    with pytest.raises(ProxyError) as err:
        parse_request({"model": PUBLIC, "input": "hi", **body}, PUBLIC)
    assert err.value.status == 400 and err.value.param == param


def test_a_foreground_response_is_neither_cancelled_nor_streamed_again(tmp_path, keyfile, fresh):
    with proxy(tmp_path, keyfile, fresh, ["--state-dir", str(tmp_path / "state")]) as (url, _):
        rid = post(url, {"model": PUBLIC, "input": "[route:L2] hi"}).json()["id"]
        r = httpx.post(f"{url}/v1/responses/{rid}/cancel", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
        r = get(url, rid, stream="true")
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        assert httpx.post(f"{url}/v1/responses/resp_0123/cancel", headers=AUTH).status_code == 404
        assert get(url, "resp_0123", stream="true").status_code == 404
