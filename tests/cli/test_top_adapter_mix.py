"""`molctl top`'s adapter mix and the dashboard's adapter-mix panel count every answer hop by adapter,
sticky tool turns included (they run no route hop, so `route_decisions_total` never counts them)."""

from __future__ import annotations

import json

from molctl.proxy.metrics import ProxyMetrics
from molctl.top import numbers, parse
from tests.helpers import ROOT


def test_sticky_tool_turns_count_in_the_adapter_mix():
    """Guards a found bug: the mix was the share of route_decisions_total, so sticky turns were missing."""
    m = ProxyMetrics()
    old = parse(m.exposition().decode(), at=100.0)
    # one routed answer on L1, then three tool results continued on L2 (as pipeline.routing's _stick:
    # sticky_tool_turns_total and the answer hop, no route decision)
    m.inc("route_decisions_total", adapter="L1")
    m.observe("hop_seconds", 0.2, hop="answer", adapter="L1")
    for _ in range(3):
        m.inc("sticky_tool_turns_total")
        m.observe("hop_seconds", 0.2, hop="answer", adapter="L2")
    n = numbers(parse(m.exposition().decode(), at=101.0), old)
    assert n["adapter_mix"] == {"L0": 0.0, "L1": 0.25, "L2": 0.75, "L3": 0.0}


def test_the_dashboards_adapter_mix_panel_counts_answer_hops():
    dashboard = json.loads((ROOT / "docs" / "grafana" / "molctl-proxy.json").read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    (mix,) = [p for p in panels if p.get("title", "").startswith("Adapter mix")]
    assert [t["expr"] for t in mix["targets"]] == [
        'sum by (adapter) (rate(molctl_proxy_hop_seconds_count{hop="answer"}[$__rate_interval]))'
    ]
