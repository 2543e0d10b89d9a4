"""`molctl top` in a narrow terminal: the latency and adapter tables go one under the other instead
of being squeezed into ellipses; side by side where both fit."""

from __future__ import annotations

from rich.console import Console

from molctl.proxy.metrics import ProxyMetrics
from molctl.top import frame, numbers, parse


def rendered(width: int) -> list[str]:
    m = ProxyMetrics()
    m.observe("hop_seconds", 0.1, hop="answer", adapter="L1")
    snap = {
        "profile": "tiny",
        "state": "ready",
        "engine_phase": "serving",
        "metrics": numbers(parse(m.exposition().decode(), at=2e9)),
    }
    console = Console(width=width, record=True, force_terminal=False)
    console.print(frame(snap, "http://127.0.0.1:9464/metrics", live=True))
    return console.export_text().splitlines()


def test_a_40_column_terminal_shows_every_row_and_column_whole():
    """Guards a found bug: at 40 columns the hop names and headers were cut to '…'."""
    text = "\n".join(lines := rendered(40))
    assert "…" not in text
    for word in ("route", "answer", "summary", "ttft", "count", "p50", "p95", "mix", "cache hit", "L3"):
        assert word in text, word
    assert max(len(line.rstrip()) for line in lines) <= 40
    latency = next(i for i, line in enumerate(lines) if line.startswith("latency"))
    adapters = next(i for i, line in enumerate(lines) if line.startswith("adapters"))
    assert adapters > latency + 5  # under it


def test_a_wide_terminal_shows_the_tables_side_by_side():
    lines = rendered(120)
    assert any(line.startswith("latency") and "adapters" in line for line in lines)
