"""`molctl top`: its numbers from a scraped exposition (the proxy's own ProxyMetrics, written by
prometheus-client), `--once` and `--json` against a stack `molctl up` started (the fake engine
behind the real proxy), the live view in a real terminal (tmux: read the screen, quit with q, or
Ctrl-C), and nothing running (exit 3, one line)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid

import openai
import pytest

from molctl.errors import ExitStatus
from molctl.proxy.metrics import ProxyMetrics
from molctl.top import numbers, parse, quantile
from tests.helpers import ROOT, free_port, wait_for

TMUX = "/usr/bin/tmux"


def exposition(m: ProxyMetrics) -> str:
    return m.exposition().decode()


def test_quantiles_interpolate_within_buckets_as_promql_does():
    # 10 observations: 4 up to 0.1, 4 more up to 0.5, 2 more up to 1.0
    buckets = {0.1: 4.0, 0.5: 8.0, 1.0: 10.0, float("inf"): 10.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (1 / 4))  # rank 5: 1 of the 4 in (0.1, 0.5]
    assert quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (1.5 / 2))
    assert quantile(0.2, buckets) == pytest.approx(0.05)  # the lowest bucket starts at 0
    assert quantile(0.99, {1.0: 0.0, float("inf"): 3.0}) == 1.0  # in +Inf: the highest finite bound
    assert quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None


def test_numbers_come_from_two_scrapes_of_the_proxys_exposition():
    m = ProxyMetrics(lambda: {"num_requests_running": {(): 2}, "num_requests_waiting": {(): 1}})
    old = parse(exposition(m), at=100.0)
    for adapter, n in (("L1", 3), ("L2", 1)):
        for _ in range(n):
            m.inc("requests_total", api="chat", status="200", stream="true")
            m.inc("route_decisions_total", adapter=adapter)
            m.observe("hop_seconds", 0.05, hop="route", adapter="L0")
            m.observe("hop_seconds", 0.7, hop="answer", adapter=adapter)
            m.observe("ttft_seconds", 0.3, api="chat", adapter=adapter)
            m.usage(
                "answer",
                adapter,
                {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 75}},
            )
    m.usage("answer", "L2", {"prompt_tokens": 100, "completion_tokens": 5})  # no cached_tokens reported
    m.inc("admission_rejections_total", reason="queue_full")
    m.inc("summaries_total", 2)
    n = numbers(parse(exposition(m), at=102.0), old)
    assert n["window_s"] == 2.0 and n["since_start"] is False
    assert n["requests_per_s"] == 2.0
    assert n["admission"] == {"running": 2, "waiting": 1, "rejected_per_s": 0.5}
    assert n["summaries"]["done_per_s"] == 1.0
    assert n["adapter_mix"] == {"L0": 0.0, "L1": 0.75, "L2": 0.25, "L3": 0.0}
    assert n["cache_hit_ratio"] == {"L0": None, "L1": 0.75, "L2": 75 / 200, "L3": None}
    assert n["hops"]["answer"]["count"] == 4 and 0.5 < n["hops"]["answer"]["p50_s"] <= 1.0
    assert n["hops"]["route"]["count"] == 4 and 0.025 < n["hops"]["route"]["p95_s"] <= 0.05
    assert n["hops"]["summary"] == {"count": 0, "p50_s": None, "p95_s": None}
    assert n["ttft"]["count"] == 4 and 0.25 < n["ttft"]["p50_s"] <= 0.5
    assert "speculative_hit_ratio" not in n  # the proxy exports no speculative hop
    # since the proxy started: one scrape, over process_start_time_seconds
    since = numbers(parse(exposition(m), at=102.0))
    assert since["since_start"] is True and since["hops"]["answer"]["count"] == 4


def test_the_speculative_hit_ratio_shows_when_the_proxy_exports_it():
    text = exposition(ProxyMetrics()) + (
        "# TYPE molctl_proxy_speculative counter\n"
        'molctl_proxy_speculative_total{outcome="hit",reason=""} 3.0\n'
        'molctl_proxy_speculative_total{outcome="miss",reason=""} 1.0\n'
        'molctl_proxy_speculative_total{outcome="skipped",reason="first_turn"} 5.0\n'
    )
    assert numbers(parse(text, at=10.0))["speculative_hit_ratio"] == 0.75
    # only skips (speculation off): nothing to show
    skipped = exposition(ProxyMetrics()) + 'molctl_proxy_speculative_total{outcome="skipped",reason="disabled"} 9.0\n'
    assert "speculative_hit_ratio" not in numbers(parse(skipped, at=10.0))


def test_nothing_running_is_one_line_and_exit_3(molctl):
    r = molctl("top")
    assert r.exit_code == ExitStatus.CHECK_FAILED
    assert r.stderr.strip() == "molctl: error: nothing is running (molctl up PROFILE starts a stack)"
    r = molctl("top", "tiny", "--json")
    assert r.exit_code == ExitStatus.CHECK_FAILED and r.stdout == ""
    assert r.stderr.strip().startswith("molctl: error: nothing is running for tiny")


@pytest.fixture
def running_stack(host):
    """tiny up on the fake engine, its proxy's metrics on a free port, a few answers through it."""
    metrics_port = free_port()
    r = host.up("--set", f"proxy.metrics_port={metrics_port}")
    assert r.exit_code == ExitStatus.OK, r.stderr
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.proxy_port}/v1", api_key="none", max_retries=0)
    for adapter in ("L1", "L2", "L2"):
        for _ in client.chat.completions.create(
            model="Macaron-Tiny-Demo", messages=[{"role": "user", "content": f"[route:{adapter}] hi"}], stream=True
        ):
            pass
    return host


def test_json_and_once_read_the_running_stack(running_stack):
    host = running_stack
    r = host.molctl("top", "tiny", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    data = json.loads(r.stdout)
    assert data["profile"] == "tiny" and data["state"] == "ready" and data["engine_phase"] == "serving"
    m = data["metrics"]
    assert m["since_start"] is True and m["requests_per_s"] > 0
    assert m["hops"]["answer"]["count"] == 3 and m["ttft"]["count"] == 3
    assert m["adapter_mix"]["L2"] == pytest.approx(2 / 3)
    assert m["cache_hit_ratio"]["L1"] == pytest.approx(0.4)  # the fake engine: 4 of 10 prompt tokens cached
    assert m["admission"] == {"running": 0, "waiting": 0, "rejected_per_s": 0.0}
    r = host.molctl("top", "tiny", "--once")
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "molctl top tiny" in r.stdout and "state ready" in r.stdout and "engine serving" in r.stdout
    assert "answer" in r.stdout and "ttft" in r.stdout and "67%" in r.stdout and "40%" in r.stdout
    assert "q quits" not in r.stdout


def tmux(socket: str, *args: str) -> str:
    return subprocess.run([TMUX, "-L", socket, *args], capture_output=True, text=True, check=True).stdout


def _live(host, key: str) -> tuple[str, str]:
    """`molctl top tiny` in a detached tmux window (100x30) on a tmux server of its own: the screen
    once it shows a frame, and the shell's line with the exit status after `key` was sent."""
    sock = "molctl-top-" + uuid.uuid4().hex[:8]
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "molctl", *host.cli.argv("top", "tiny")])
    shell = f"cd {shlex.quote(str(ROOT))} && {command}; echo EXIT=$?; sleep 60"
    tmux(sock, "new-session", "-d", "-s", "top", "-x", "100", "-y", "30", shell)
    try:
        assert wait_for(lambda: "answer" in tmux(sock, "capture-pane", "-p", "-t", "top"), timeout=30), tmux(
            sock, "capture-pane", "-p", "-t", "top"
        )
        screen = tmux(sock, "capture-pane", "-p", "-t", "top")
        tmux(sock, "send-keys", "-t", "top", key)
        assert wait_for(lambda: "EXIT=" in tmux(sock, "capture-pane", "-p", "-t", "top"), timeout=15)
        done = tmux(sock, "capture-pane", "-p", "-t", "top")
        return screen, next(line for line in done.splitlines() if line.startswith("EXIT="))
    finally:
        subprocess.run([TMUX, "-L", sock, "kill-server"], capture_output=True)


def test_the_live_view_in_a_terminal_quits_with_q_and_ctrl_c(running_stack):
    screen, status = _live(running_stack, "q")
    assert "molctl top tiny" in screen and "state ready" in screen and "(q quits)" in screen
    assert "ttft" in screen and "L2" in screen
    assert status == "EXIT=0"
    _, status = _live(running_stack, "C-c")
    assert status == "EXIT=130"


def test_a_starting_stack_shows_the_engines_load_phase(host, tmp_path):
    gate = tmp_path / "gate"
    up = host.start("up", "tiny", *host.args(env={"FAKE_STARTUP_GATE": str(gate)}))

    def frame() -> dict | None:
        r = host.molctl("top", "tiny", "--json")
        return json.loads(r.stdout) if r.exit_code == ExitStatus.OK else None

    try:
        # the fake engine logs vLLM's weights and compile lines, then waits for the gate: the phase `up` prints
        assert wait_for(lambda: (frame() or {}).get("engine_phase") == "torch.compile", timeout=30), frame()
        data = frame()
        assert data["state"] == "starting" and data["metrics"] is None  # tiny sets no proxy.metrics_port
        assert data["eta_s"] is None  # the first start of tiny on this host: no history, no ETA
        once = host.molctl("top", "tiny", "--once")
        assert "state starting" in once.stdout and "engine torch.compile" in once.stdout
        assert "no proxy metrics: no proxy.metrics_port in the profile" in once.stdout
    finally:
        gate.touch()
        up.wait(60)
    assert up.returncode == ExitStatus.OK
