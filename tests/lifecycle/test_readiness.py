"""The readiness wait of `up` (`molctl.lifecycle.readiness.wait_ready`) with an injected clock and sleep:
no process, no socket, no real time."""

from __future__ import annotations

import pytest

from molctl.lifecycle.readiness import POLL_S, Poll, base_url, wait_ready


class Clock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Script:
    """Answers the probes in order, then repeats the last one."""

    def __init__(self, *probes: Poll):
        self.probes, self.polls = list(probes), 0

    def poll(self) -> Poll:
        self.polls += 1
        return self.probes.pop(0) if len(self.probes) > 1 else self.probes[0]


def wait(script: Script, clock: Clock, timeout: float, check_alive=lambda: None):
    waited = []
    probe, elapsed = wait_ready(
        script,
        timeout,
        check_alive=check_alive,
        on_wait=lambda e, p: waited.append((e, p.state)),
        clock=clock,
        sleep=clock.sleep,
    )
    return probe, elapsed, waited


def test_ready_after_a_few_polls():
    clock = Clock()
    script = Script(
        Poll("down", "not listening yet"),
        Poll("starting", "/health answers 503"),
        Poll("ready", "health, adapters and a 1-token completion per adapter"),
    )
    probe, elapsed, waited = wait(script, clock, timeout=60)
    assert probe.state == "ready" and script.polls == 3
    assert clock.sleeps == [POLL_S, POLL_S] and elapsed == 2 * POLL_S
    assert waited == [(0.0, "down"), (POLL_S, "starting")]


def test_times_out_at_the_deadline_with_the_last_probe():
    clock = Clock()
    probe, elapsed, waited = wait(Script(Poll("starting", "/v1/models not answering")), clock, timeout=3.2)
    assert probe.state == "starting" and probe.detail == "/v1/models not answering"
    assert elapsed == pytest.approx(3.2)
    # polls every POLL_S, the last sleep shortened to end exactly at the deadline
    assert clock.sleeps[:-1] == [POLL_S] * 6 and clock.sleeps[-1] == pytest.approx(0.2)
    assert len(waited) == 7


def test_wrong_adapters_end_the_wait_at_once():
    clock = Clock()
    probe, elapsed, _ = wait(Script(Poll("down", "x"), Poll("adapters", "L3 missing")), clock, timeout=60)
    assert probe.state == "adapters" and elapsed == POLL_S


def test_an_exited_process_ends_the_wait_before_the_next_probe():
    clock = Clock()
    script = Script(Poll("down", "not listening yet"))
    calls = []

    def check_alive():
        calls.append(clock.now)
        if len(calls) == 3:
            raise RuntimeError("the engine exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait(script, clock, timeout=60, check_alive=check_alive)
    assert script.polls == 2 and len(calls) == 3


@pytest.mark.parametrize(
    "host, port, url",
    [
        ("127.0.0.1", 8100, "http://127.0.0.1:8100"),
        ("0.0.0.0", 8100, "http://127.0.0.1:8100"),
        ("::", 8300, "http://127.0.0.1:8300"),
        ("::1", 8300, "http://[::1]:8300"),
        ("fd00::5", 9000, "http://[fd00::5]:9000"),
        ("gpu-host.internal", 9000, "http://gpu-host.internal:9000"),
    ],
)
def test_base_url_brackets_ipv6_and_reaches_wildcards_through_loopback(host, port, url):
    assert base_url(host, port) == url


def _engine_transport(smoke_status: int):
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(
                200,
                json={
                    "object": "list",
                    "data": [{"id": "tiny-mol-base", "parent": None}]
                    + [{"id": f"L{i}", "parent": "tiny-mol-base"} for i in range(4)],
                },
            )
        if smoke_status != 200:
            return httpx.Response(smoke_status, json={"error": {"message": "The model `L0` does not exist."}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}]})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("status, state", [(400, "adapters"), (404, "adapters"), (503, "starting"), (200, "ready")])
def test_a_refused_readiness_smoke_is_final_not_starting(status, state):
    """A 1-token completion the engine refuses (400/404/422) will not pass by waiting: the wait ends
    at once (up exits 7 naming the answer) instead of running into the start timeout; a 503 is
    still 'starting'."""
    import httpx

    from molctl.engines import get_engine
    from molctl.lifecycle.readiness import EngineReadiness
    from molctl.profiles import load_profile, profile_dirs

    profile = load_profile("tiny", profile_dirs())
    probe = EngineReadiness(
        profile, get_engine("vllm"), httpx.Client(transport=_engine_transport(status)), url="http://engine"
    ).poll()
    assert probe.state == state, probe
    if state == "adapters":
        assert f"answered {status}: The model `L0` does not exist." in probe.detail
