"""The readiness wait of `up` (`molctl.readiness.wait_ready`) with an injected clock and sleep:
no process, no socket, no real time."""

from __future__ import annotations

import pytest

from molctl.readiness import POLL_S, Probe, base_url, wait_ready


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

    def __init__(self, *probes: Probe):
        self.probes, self.polls = list(probes), 0

    def poll(self) -> Probe:
        self.polls += 1
        return self.probes.pop(0) if len(self.probes) > 1 else self.probes[0]


def wait(script: Script, clock: Clock, timeout: float, check_alive=lambda: None):
    waited = []
    probe, elapsed = wait_ready(script, timeout, check_alive=check_alive,
                                on_wait=lambda e, p: waited.append((e, p.state)), clock=clock, sleep=clock.sleep)
    return probe, elapsed, waited


def test_ready_after_a_few_polls():
    clock = Clock()
    script = Script(Probe("down", "not listening yet"), Probe("starting", "/health answers 503"),
                    Probe("ready", "health, adapters and a 1-token completion per adapter"))
    probe, elapsed, waited = wait(script, clock, timeout=60)
    assert probe.state == "ready" and script.polls == 3
    assert clock.sleeps == [POLL_S, POLL_S] and elapsed == 2 * POLL_S
    assert waited == [(0.0, "down"), (POLL_S, "starting")]


def test_times_out_at_the_deadline_with_the_last_probe():
    clock = Clock()
    probe, elapsed, waited = wait(Script(Probe("starting", "/v1/models not answering")), clock, timeout=3.2)
    assert probe.state == "starting" and probe.detail == "/v1/models not answering"
    assert elapsed == pytest.approx(3.2)
    # polls every POLL_S, the last sleep shortened to end exactly at the deadline
    assert clock.sleeps[:-1] == [POLL_S] * 6 and clock.sleeps[-1] == pytest.approx(0.2)
    assert len(waited) == 7


def test_wrong_adapters_end_the_wait_at_once():
    clock = Clock()
    probe, elapsed, _ = wait(Script(Probe("down", "x"), Probe("adapters", "L3 missing")), clock, timeout=60)
    assert probe.state == "adapters" and elapsed == POLL_S


def test_an_exited_process_ends_the_wait_before_the_next_probe():
    clock = Clock()
    script = Script(Probe("down", "not listening yet"))
    calls = []

    def check_alive():
        calls.append(clock.now)
        if len(calls) == 3:
            raise RuntimeError("the engine exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait(script, clock, timeout=60, check_alive=check_alive)
    assert script.polls == 2 and len(calls) == 3


@pytest.mark.parametrize("host, port, url", [
    ("127.0.0.1", 8100, "http://127.0.0.1:8100"),
    ("0.0.0.0", 8100, "http://127.0.0.1:8100"),
    ("::", 8300, "http://127.0.0.1:8300"),
    ("::1", 8300, "http://[::1]:8300"),
    ("fd00::5", 9000, "http://[fd00::5]:9000"),
    ("gpu-host.internal", 9000, "http://gpu-host.internal:9000"),
])
def test_base_url_brackets_ipv6_and_reaches_wildcards_through_loopback(host, port, url):
    assert base_url(host, port) == url
