"""`molctl top` across a restart of the proxy it watches: the figures start again from the new
process, never negative rates or counts from counters that began again at 0."""

from __future__ import annotations

from molctl.proxy.metrics import ProxyMetrics
from molctl.top import Target, Top, parse


def served(m: ProxyMetrics, requests: int, at: float, start: float | None = None):
    for _ in range(requests):
        m.inc("requests_total", api="chat", status="200", stream="false")
        m.observe("hop_seconds", 0.1, hop="answer", adapter="L1")
    text = m.exposition().decode()
    if start is not None:  # another process: prometheus-client's process_start_time_seconds, rewritten
        text = "\n".join(
            f"process_start_time_seconds {start}" if line.startswith("process_start_time_seconds ") else line
            for line in text.splitlines()
        )
    return parse(text, at=at)


def test_a_restarted_proxy_starts_the_window_again():
    """Guards a found bug: the older scrape's counters were subtracted from the new process's (negative rates)."""
    top = Top(None, Target("tiny", None, None, "http://127.0.0.1:1/metrics"))
    before = ProxyMetrics()
    top.older(served(before, 5, at=100.0))
    older = top.older(served(before, 5, at=101.0))
    assert older is not None and older.at == 100.0
    after = ProxyMetrics()  # the restarted proxy: its counters begin again from 0 (same /proc: a counter went down)
    assert top.older(served(after, 2, at=102.0)) is None  # since the new proxy started
    assert top.older(served(after, 2, at=103.0)).at == 102.0


def test_another_process_start_time_is_a_restart_too():
    top = Top(None, Target("tiny", None, None, "http://127.0.0.1:1/metrics"))
    m = ProxyMetrics()
    top.older(served(m, 1, at=100.0, start=50.0))
    assert top.older(served(m, 1, at=101.0, start=50.0)) is not None
    assert top.older(served(m, 1, at=102.0, start=101.5)) is None  # counters grew, but another process
