"""At the drain deadline the proxy answers what is still running itself, then exits: a request
without an answer yet gets a JSON 503 `draining` naming its request id, with Retry-After (not
uvicorn's plain-text 500 five seconds later, or an empty reply when `down` killed it first); a
stream already started gets an error frame `draining` and its end. The process then exits 0 on
its own, and `molctl down` waits for that (the drain deadline plus a grace) before any SIGKILL."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from molctl.lifecycle import stop
from tests.helpers import free_ports, wait_for
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import PUBLIC


def test_at_the_drain_deadline_what_is_left_is_answered_503_draining_then_the_proxy_exits(tmp_path):
    engine_port, port = free_ports(2)
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    argv = proxy_argv(
        "tiny",
        engine_url,
        port,
        "--allow-unauthenticated",
        "--store",
        "memory",
        "--drain-timeout",
        "2",
        "--sse-keepalive",
        "0.5",
    )
    with (
        running(fake_engine_argv(engine_port, {"answer_delay": 120}), engine_url + "/health"),
        running(argv, url + "/health", log=log) as proxy,
    ):
        got: dict[str, object] = {}
        stream_started = threading.Event()

        def plain() -> None:
            got["plain"] = httpx.post(
                url + "/v1/chat/completions",
                timeout=60,
                json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] slow"}]},
            )

        def streamed() -> None:
            body = {"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "[route:L1] slow"}]}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                got["stream_status"], got["stream_headers"] = r.status_code, r.headers
                text = ""
                for piece in r.iter_text():
                    text += piece
                    if ": keepalive" in text:
                        stream_started.set()
                got["stream"] = text

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert stream_started.wait(20), "the stream's 200 never came"
        assert wait_for(
            lambda: len([e for e in httpx.get(engine_url + "/_log").json() if "slow" in json.dumps(e)]) >= 2, 10
        ), "both answer hops at the engine"
        proxy.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proxy.wait(30) == 0
    r = got["plain"]
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "5"
    error = r.json()["error"]
    assert error["code"] == "draining" and error["type"] == "server_error", error
    assert r.headers["x-request-id"] in error["message"]
    assert got["stream_status"] == 200
    frames = [f[len("data: ") :] for f in got["stream"].split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]", got["stream"]
    frame = json.loads(frames[-2])["error"]
    assert frame["code"] == "draining" and got["stream_headers"]["x-request-id"] in frame["message"], frame
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
    lines = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert sorted((ln["status"], ln["error"]) for ln in lines) == [(200, "draining"), (503, "draining")], lines


def test_down_gives_a_proxy_its_drain_deadline_and_a_grace_to_answer_and_exit():
    assert stop.PROXY_EXIT_GRACE_S >= 5  # uvicorn's own graceful-shutdown timer, then the final store writes
    assert stop.proxy_stop_timeout(30) == 30 + stop.PROXY_EXIT_GRACE_S
    assert stop.proxy_stop_timeout(0) == stop.PROXY_EXIT_GRACE_S
