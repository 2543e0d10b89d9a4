"""The shipped Grafana dashboard (docs/grafana/molctl-proxy.json) against a real Prometheus server
(Debian's `prometheus` package, `make prometheus`): Prometheus scrapes a proxy (and the fake
engine's vLLM-named /metrics) driven with traffic by the official openai SDK, and every panel's
every query returns data."""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import ROOT, free_ports, wait_for
from tests.procs import running
from tests.proxy_stack import PUBLIC, own_stack

DASHBOARD = ROOT / "docs" / "grafana" / "molctl-proxy.json"
PROMETHEUS = Path(sys.prefix) / "bin" / "prometheus"
# what Grafana substitutes in the queries: a rate interval (5m: the whole test's traffic stays in the
# window on a slow machine), and the dashboard's own variables' defaults
VARIABLES = {"$__rate_interval": "5m", "$engine_job": "vllm"}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, query as Grafana sends it) for every target of every panel."""
    out = []
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert all("$" not in expr for _, expr in queries({"panels": [panel]})), panel["title"]
    titles = " ".join(p["title"] for p in panels(dashboard))
    for topic in ("Hop latency", "Time to first token", "Adapter mix", "Cache hit ratio by adapter", "Admission"):
        assert topic in titles
    assert "Summaries" in titles and "Engine" in titles and "Speculative answer hit ratio" in titles


def prometheus_config(path: Path, proxy_metrics: str, engine: str) -> Path:
    path.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "molctl-proxy", "static_configs": [{"targets": [proxy_metrics]}]},
                    {"job_name": "vllm", "static_configs": [{"targets": [engine]}]},
                ],
            }
        )
    )
    return path


def query(prometheus: str, expr: str) -> list[dict]:
    r = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, f"{expr}: {r.text}"
    return r.json()["data"]["result"]


def has_data(prometheus: str, expr: str) -> bool:
    """At least one series with a number (histogram_quantile of no observations, a 0/0 ratio: NaN)."""
    return any(math.isfinite(float(s["value"][1])) for s in query(prometheus, expr))


def scraped(prometheus: str, expr: str) -> float | None:
    result = query(prometheus, expr)
    return float(result[0]["value"][1]) if result else None


def traffic(stack) -> None:
    """Answers on every adapter (whole and streamed, chat and Responses: the summaries follow),
    follow-ups the speculative answer hits and misses, a route label the proxy cannot use (a
    fallback) and a burst past the two answer slots and one queue place (a 429)."""
    for adapter in ("L0", "L1", "L2", "L3"):
        stack.chat([{"role": "user", "content": f"[route:{adapter}] hello"}])
        stack.chat([{"role": "user", "content": f"[route:{adapter}] streamed"}], stream=True)
    with stack.client.responses.stream(model=PUBLIC, input="[route:L1] streamed") as events:
        for _ in events:
            pass
    # follow-ups: one that keeps its adapter (a speculative hit), one that changes it (a miss)
    ask = [{"role": "user", "content": "[route:L2] keep"}]
    said = stack.chat(ask).choices[0].message.content
    turns = [*ask, {"role": "assistant", "content": said}]
    kept = stack.chat([*turns, {"role": "user", "content": "[route:L2] again"}], stream=True)
    stack.chat([*turns, {"role": "assistant", "content": kept[0]}, {"role": "user", "content": "[route:L3] now"}])
    stack.config(route_label="not-a-route")
    stack.chat([{"role": "user", "content": "unroutable"}])
    stack.config(route_label=None, answer_delay=0.5)
    refused = []

    def ask(i: int) -> None:
        try:
            stack.chat([{"role": "user", "content": f"[route:L2] burst {i}"}])
        except openai.RateLimitError:
            refused.append(i)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    stack.config(answer_delay=0.0)
    assert refused, "the burst was not refused: no admission rejection to graph"


def test_every_panel_query_returns_data_from_a_real_prometheus(keyfile, tmp_path):
    if not PROMETHEUS.is_file():
        pytest.fail(f"no Prometheus server at {PROMETHEUS}: run `make prometheus` (Debian's package, no root needed)")
    dashboard = json.loads(DASHBOARD.read_text())
    metrics_port, prometheus_port = free_ports(2)
    limits = ("--set", "proxy.max_inflight=2", "--set", "proxy.max_queue=1")
    with own_stack(keyfile, tmp_path, *limits, "--metrics-port", str(metrics_port)) as stack:
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}"
        config = prometheus_config(
            tmp_path / "prometheus.yml", f"127.0.0.1:{metrics_port}", stack.engine_url.removeprefix("http://")
        )
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        argv = [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
            "--log.level=warn",
        ]
        with running(argv, prometheus + "/-/ready", log=tmp_path / "prometheus.log"):
            assert wait_for(lambda: len(query(prometheus, "up == 1")) == 2, timeout=30), query(prometheus, "up")
            # two rounds, scraped in between: a rate needs a counter that grew within its window
            traffic(stack)
            done = stack.metrics()["molctl_proxy_requests_total"]
            assert wait_for(lambda: scraped(prometheus, "sum(molctl_proxy_requests_total)") == done, timeout=30)
            traffic(stack)
            targets = queries(dashboard)
            wait_for(lambda: all(has_data(prometheus, expr) for _, expr in targets), timeout=60)
            missing = [f"{title}: {expr}" for title, expr in targets if not has_data(prometheus, expr)]
            assert not missing, "panel queries without data:\n" + "\n".join(missing)
