"""The proxy's metrics listener, request ids and per-request log lines, through the real proxy
process (openai SDK and httpx as clients) against the fake engine."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time

import httpx
import openai
import pytest

from molctl.lifecycle.status import proxy_metrics
from tests.helpers import free_port, free_ports, wait_for
from tests.procs import fake_engine_argv, proxy_argv, running
from tests.proxy_stack import PUBLIC

KEY = "sk-metrics-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)")


class Stack:
    def __init__(self, engine_url, proxy_url, metrics_url, log, proxy_pid=None):
        self.proxy_pid = proxy_pid
        self.engine_url, self.proxy_url, self.metrics_url, self.log_path = engine_url, proxy_url, metrics_url, log
        self.client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def config(self, **cfg):
        httpx.post(self.engine_url + "/_reset").raise_for_status()
        httpx.post(self.engine_url + "/_config", json=cfg).raise_for_status()

    def engine_log(self):
        return httpx.get(self.engine_url + "/_log").json()

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        r = httpx.get(self.metrics_url)  # no key
        assert r.status_code == 200, r.text
        out = []
        for line in r.text.splitlines():
            m = SAMPLE.fullmatch(line)
            if m and not line.startswith("#"):
                out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))))
        return out

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples() if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def request_lines(self) -> list[dict]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
        return lines


@pytest.fixture(scope="module")
def s(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    keyfile = tmp / "keys"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    engine_port, proxy_port, metrics_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    log = tmp / "proxy.log"
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv(
                "tiny",
                engine_url,
                proxy_port,
                "--api-key-file",
                str(keyfile),
                "--store",
                "memory",
                "--metrics-port",
                str(metrics_port),
                "--set",
                "proxy.route_timeout_s=2",
            ),
            proxy_url + "/health",
            log=log,
        ) as proxy,
    ):
        yield Stack(engine_url, proxy_url, f"http://127.0.0.1:{metrics_port}/metrics", log, proxy.pid)


def test_metrics_listener_counts_requests_hops_and_states(s):
    s.config()
    before = s.value("molctl_proxy_requests_total", api="chat", status="200", stream="false")
    s.client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] hello"}])
    for _ in s.client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "[route:L3] hi"}], stream=True
    ):
        pass
    s.client.responses.create(model=PUBLIC, input="[route:L1] there")
    assert s.value("molctl_proxy_requests_total", api="chat", status="200", stream="false") == before + 1
    assert s.value("molctl_proxy_requests_total", api="chat", status="200", stream="true") >= 1
    assert s.value("molctl_proxy_requests_total", api="responses", status="200", stream="false") >= 1
    assert s.value("molctl_proxy_route_decisions_total", adapter="L3") >= 1
    assert s.value("molctl_proxy_hop_seconds_count", hop="route", adapter="L0") >= 3
    assert s.value("molctl_proxy_hop_seconds_count", hop="answer", adapter="L2") >= 1
    assert wait_for(lambda: s.value("molctl_proxy_hop_seconds_count", hop="summary") >= 1)
    assert s.value("molctl_proxy_time_to_first_token_seconds_count") >= 1
    assert s.value("molctl_proxy_queue_wait_seconds_count") >= 3
    assert s.value("molctl_proxy_inflight_hops", hop="answer") == 0
    assert s.value("molctl_proxy_queue_depth", hop="answer") == 0
    assert s.value("molctl_proxy_store", store="responses", field="responses") >= 1
    assert s.value("molctl_proxy_draining") == 0


def test_failures_are_counted_by_reason_and_status(s):
    s.config(route_label="no such label")
    fallbacks = s.value("molctl_proxy_route_fallbacks_total", reason="bad_label")
    s.client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "x"}])
    assert s.value("molctl_proxy_route_fallbacks_total", reason="bad_label") == fallbacks + 1
    s.config(answer_error={"status": 500, "body": {"error": {"message": "boom", "code": 500}}})
    errors = s.value("molctl_proxy_engine_errors_total", status="500")
    with pytest.raises(openai.APIStatusError) as exc:
        s.client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 502
    assert s.value("molctl_proxy_engine_errors_total", status="500") == errors + 1
    assert s.value("molctl_proxy_requests_total", api="chat", status="502", stream="false") >= 1


def test_label_values_are_bounded_and_the_public_port_has_no_metrics(s):
    s.config()
    s.client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] secret-words-here"}]
    )
    allowed = {
        "hop": {"route", "answer", "summary"},
        "adapter": {"L0", "L1", "L2", "L3", "none"},
        "api": {"chat", "responses", "models", "other"},
        "stream": {"true", "false"},
        "reason": {"timeout", "engine_error", "no_slot", "bad_label", "queue_full", "deadline", ""}
        | {"first_turn", "tool_turn", "admission", "summary_pending", "disabled"},
        "outcome": {"hit", "miss", "skipped"},
        "source": {"classified", "sticky", "fallback"},
        "kind": {"prompt", "generated"},
        "store": {"conversations", "responses"},
    }
    for name, labels, _ in s.samples():
        for k, v in labels.items():
            if k == "status":
                assert re.fullmatch(r"\d{3}|unreachable", v), (name, labels)
            elif k in allowed:
                assert v in allowed[k], (name, labels)
            else:
                assert k in ("le", "field"), (name, labels)
    text = httpx.get(s.metrics_url).text
    assert "secret-words-here" not in text and KEY not in text
    assert httpx.get(s.proxy_url + "/metrics", headers=AUTH).status_code == 404
    assert httpx.get(s.metrics_url.replace("/metrics", "/v1/models")).status_code == 404


def test_idle_connections_to_the_metrics_port_are_bounded(s):
    """Clients that open connections and send nothing hold at most MetricsListener.MAX_CONNECTIONS
    of the proxy's file descriptors; scrapes work again as soon as they go."""
    from molctl.proxy.metrics import MetricsListener

    port = int(s.metrics_url.split(":")[2].split("/")[0])
    fds = lambda: len(os.listdir(f"/proc/{s.proxy_pid}/fd"))  # noqa: E731
    before = fds()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        time.sleep(0.5)
        assert fds() - before <= MetricsListener.MAX_CONNECTIONS + 4
    finally:
        for sock in idle:
            sock.close()

    def scrape_ok() -> bool:
        try:
            return httpx.get(s.metrics_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_for(scrape_ok, timeout=5)


def test_request_id_is_passed_on_and_each_request_logs_one_json_line(s):
    s.config()
    r = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "client-id.42"},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] trace me"}]},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id.42"
    # each hop carries the request's id and its own name (header, and the body field vLLM logs)
    hops = [e for e in s.engine_log() if (e.get("request_id") or "").startswith("client-id.42-")]
    assert {(e["hop"], e["request_id"]) for e in hops} >= {
        ("route", "client-id.42-route"),
        ("answer", "client-id.42-answer"),
    }
    assert all(e["payload"]["request_id"] == e["request_id"] for e in hops)
    assert wait_for(
        lambda: any(e["hop"] == "summary" and e.get("request_id") == "client-id.42-summary" for e in s.engine_log())
    )
    # an invalid incoming id is replaced, never echoed
    bad = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "x" * 200},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L1] again"}], "stream": True},
    )
    assert bad.status_code == 200 and re.fullmatch(r"req-[0-9a-f]{16}", bad.headers["x-request-id"])
    unauth = httpx.get(s.proxy_url + "/v1/models", headers={"X-Request-Id": "anon-1"})
    assert unauth.status_code == 401 and unauth.headers["x-request-id"] == "anon-1"

    def line(rid):
        return next((entry for entry in s.request_lines() if entry["request_id"] == rid), None)

    # each line is written once its response is sent: wait for all three, not only the last one sent
    ids = ("client-id.42", bad.headers["x-request-id"], "anon-1")
    assert wait_for(lambda: all(line(rid) is not None for rid in ids))
    first = line("client-id.42")
    assert first["tenant"] == hashlib.sha256(KEY.encode()).hexdigest()[:16]
    assert first["api"] == "chat" and first["stream"] is False and first["status"] == 200 and first["route"] == "L2"
    assert first["fallback"] is None and first["sticky"] is False and first["client_disconnect"] is False
    assert first["tokens_in"] == 10 and first["tokens_out"] == 3 and first["tokens_cached"] == 4
    assert first["route_s"] >= 0 and first["answer_s"] >= 0 and first["total_s"] >= first["answer_s"]
    streamed = line(bad.headers["x-request-id"])
    assert streamed["stream"] is True and streamed["ttft_s"] is not None and streamed["route"] == "L1"
    assert line("anon-1")["status"] == 401 and line("anon-1")["tenant"] is None
    assert KEY not in s.log_path.read_text() and "trace me" not in s.log_path.read_text()
    assert [entry["request_id"] for entry in s.request_lines()].count("client-id.42") == 1


def test_a_failed_request_logs_its_error_code_and_the_engines_reason(s):
    """A stream that failed after its 200 (the engine died mid-answer) was logged as status 200 with
    nothing else, and an answer hop's engine failure had no log line saying why (the SRE review)."""
    s.config(answer_words=6, stream_error_after=3)
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "cut-1"},
        json={"model": PUBLIC, "stream": True, "messages": [{"role": "user", "content": "[route:L2] cut"}]},
    ) as r:
        body = "".join(r.iter_text())
    assert r.status_code == 200 and '"error"' in body
    s.config(answer_error={"status": 500, "body": {"error": {"message": "EngineCore died", "code": 500}}})
    r = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "down-1"},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] x"}]},
    )
    assert r.status_code == 502
    s.config()
    ok = httpx.post(
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "fine-1"},
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] y"}]},
    )
    assert ok.status_code == 200

    def line(rid):
        return next((e for e in s.request_lines() if e["request_id"] == rid), None)

    assert wait_for(lambda: all(line(rid) is not None for rid in ("cut-1", "down-1", "fine-1")))
    assert line("cut-1")["status"] == 200 and line("cut-1")["error"] == "engine_error"
    assert line("down-1")["status"] == 502 and line("down-1")["error"] == "engine_error"
    assert line("fine-1")["error"] is None
    text = s.log_path.read_text()
    assert "request down-1: answer hop on L2 failed: HTTP 500: EngineCore died" in text
    assert "request cut-1: answer hop on L2 failed" in text


def test_status_reads_a_missing_listener_as_unavailable():
    port = free_port()
    assert proxy_metrics(f"http://127.0.0.1:{port}/metrics") == {
        "available": False,
        "url": f"http://127.0.0.1:{port}/metrics",
    }


def test_a_busy_metrics_port_is_one_line_and_exit_4(tmp_path):
    import socket
    import subprocess
    import sys

    from tests.helpers import ROOT

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "molctl",
                "proxy",
                "tiny",
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                str(free_port()),
                "--allow-unauthenticated",
                "--store",
                "memory",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert p.returncode == 4, p.stderr
    assert p.stderr.strip() == f"molctl: error: proxy.metrics_port 127.0.0.1:{port}: Address already in use"


def test_each_app_has_its_own_registry():
    """Two ProxyMetrics in one process (as two apps in a test) do not share series."""
    from molctl.proxy.metrics import ProxyMetrics

    one, two = ProxyMetrics(lambda: {"queue_depth": {(("hop", "answer"),): 3}}), ProxyMetrics()
    one.inc("admission_rejections_total", reason="queue_full")
    one.observe("hop_seconds", 0.2, hop="answer", adapter="L1")
    text_one, text_two = one.exposition().decode(), two.exposition().decode()
    assert 'molctl_proxy_admission_rejections_total{reason="queue_full"} 1.0' in text_one
    assert 'molctl_proxy_hop_seconds_count{adapter="L1",hop="answer"} 1.0' in text_one
    assert 'molctl_proxy_queue_depth{hop="answer"} 3.0' in text_one
    assert "# HELP molctl_proxy_admission_rejections_total Requests refused with 429" in text_one
    assert "# TYPE molctl_proxy_admission_rejections_total counter" in text_two  # declared, no series yet
    assert "molctl_proxy_admission_rejections_total{" not in text_two and 'hop="answer"' not in text_two
    assert "molctl_proxy_route_hops_total 0.0" in text_two


def test_a_client_that_leaves_mid_stream_is_logged_as_such(s):
    s.config(token_delay=0.2, answer_words=20)
    with httpx.stream(
        "POST",
        s.proxy_url + "/v1/chat/completions",
        headers={**AUTH, "X-Request-Id": "leaver-1"},
        timeout=30,
        json={"model": PUBLIC, "messages": [{"role": "user", "content": "[route:L2] go"}], "stream": True},
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first frame, then hang up
    assert wait_for(lambda: any(e["request_id"] == "leaver-1" for e in s.request_lines()))
    line = next(e for e in s.request_lines() if e["request_id"] == "leaver-1")
    assert line["client_disconnect"] is True and line["status"] == 200 and line["stream"] is True
    assert s.value("molctl_proxy_inflight_hops", hop="answer") == 0  # its answer slot was given back


def test_an_ipv6_metrics_host_is_served_and_a_bad_one_is_named(tmp_path):
    """proxy.metrics_host ::1 serves on IPv6 loopback (the bind once assumed IPv4: "Unknown error
    -9", exit 4); a name that does not resolve is one line with the resolver's reason."""
    import subprocess

    from tests.helpers import ROOT

    proxy_port, metrics_port = free_ports(2)
    argv = proxy_argv(
        "tiny",
        "http://127.0.0.1:9",
        proxy_port,
        "--allow-unauthenticated",
        "--store",
        "memory",
        "--metrics-port",
        str(metrics_port),
        "--set",
        "proxy.metrics_host=::1",
    )
    with running(argv, f"http://127.0.0.1:{proxy_port}/health", log=tmp_path / "proxy.log"):
        r = httpx.get(f"http://[::1]:{metrics_port}/metrics")
        assert r.status_code == 200 and "molctl_proxy_requests_total" in r.text
    proxy_port, metrics_port = free_ports(2)
    p = subprocess.run(
        proxy_argv(
            "tiny",
            "http://127.0.0.1:9",
            proxy_port,
            "--allow-unauthenticated",
            "--store",
            "memory",
            "--metrics-port",
            str(metrics_port),
            "--set",
            "proxy.metrics_host=no-such-host.invalid",
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 4, p.stderr
    assert p.stderr.count("\n") == 1 and "no-such-host.invalid" in p.stderr and "Unknown error" not in p.stderr, (
        p.stderr
    )


def test_probes_with_a_trailing_slash_are_neither_counted_nor_logged(s):
    """`/health/` and `/readyz/` are served as the probes (the path's trailing slash is ignored) but
    were counted in requests_total{api="other"} and logged per request: a probe configured with a
    slash flooded the request log. Found probing odd paths against the request log."""
    other = s.value("molctl_proxy_requests_total", api="other")
    for path in ("/health/", "/readyz/", "/health//"):
        r = httpx.get(s.proxy_url + path, headers={"X-Request-Id": "probe-slash"})
        assert r.status_code in (200, 503) and "status" in r.json()
    httpx.get(s.proxy_url + "/v1/models", headers={**AUTH, "X-Request-Id": "after-probes"})
    assert wait_for(lambda: any(e["request_id"] == "after-probes" for e in s.request_lines()))
    assert not [e for e in s.request_lines() if e["request_id"] == "probe-slash"]
    assert s.value("molctl_proxy_requests_total", api="other") == other


def test_the_proxy_process_series_are_exported(s):
    """Found by the operations review: no process_* series, so a descriptor leak or memory growth of
    a proxy running for weeks could not be alerted on. They describe the proxy process itself."""
    import psutil

    proc = psutil.Process(s.proxy_pid)
    assert s.value("process_open_fds") == pytest.approx(proc.num_fds(), abs=4)
    assert s.value("process_max_fds") > 0
    assert s.value("process_resident_memory_bytes") == pytest.approx(proc.memory_info().rss, rel=0.2)
    assert s.value("process_start_time_seconds") == pytest.approx(proc.create_time(), abs=2)
    assert s.value("process_cpu_seconds_total") > 0


def test_a_busy_public_port_is_one_line_and_exit_4_before_the_store_is_opened(tmp_path):
    """Found by the new-user walkthrough: `molctl proxy tiny --upstream ...` next to the running
    demo (its port 8300 taken) ended with uvicorn's log lines and '[Errno 98] error while attempting
    to bind', exit 3, after opening the running stack's SQLite store; the contract promises one
    line, and a busy metrics port was already exit 4. Now the public port is bound first."""
    import socket
    import subprocess
    import sys

    from tests.helpers import ROOT

    state = tmp_path / "state"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "molctl",
                "--state-dir",
                str(state),
                "proxy",
                "tiny",
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                str(port),
                "--allow-unauthenticated",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert p.returncode == 4, p.stderr
    assert p.stderr.strip() == f"molctl: error: --port 127.0.0.1:{port}: Address already in use"
    assert not list(state.glob("*/proxy-store.sqlite3"))  # nothing opened before the refusal


def test_the_public_sockets_cover_every_address_of_a_host_name():
    """Found by the regression review: binding the public port itself (for the one-line error)
    first took only IPv4 for a name, where uvicorn's own bind took every address (`localhost`:
    127.0.0.1 and ::1), and lost uvicorn's listen backlog of 2048."""
    import socket

    from molctl.proxy.metrics import bind_listeners

    port = free_port()
    socks = bind_listeners("localhost", port, "--host", "--port")
    try:
        wanted = {(i[0], i[4][0]) for i in socket.getaddrinfo("localhost", port, socket.AF_UNSPEC, socket.SOCK_STREAM)}
        assert {(s.family, s.getsockname()[0]) for s in socks} == wanted
        assert all(s.getsockname()[1] == port for s in socks)
        for family, addr in wanted:
            with socket.socket(family, socket.SOCK_STREAM) as client:
                client.settimeout(5)
                client.connect((addr, port))  # accepted into the backlog
    finally:
        for s in socks:
            s.close()
    (only,) = bind_listeners("127.0.0.1", port, "--host", "--port")
    only.close()
