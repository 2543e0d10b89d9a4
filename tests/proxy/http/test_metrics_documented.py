"""Every counter and histogram the proxy exports has a row in docs/contract.md's Metrics table that
names its labels, and a labelled counter has the same label names from the first scrape on."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from molctl.proxy.metrics import HELP, LABELLED, PREFIX, ProxyMetrics
from tests.helpers import ROOT


def metrics_table() -> dict[str, str]:
    """Each name in the Metrics table's first column -> its row."""
    text = (ROOT / "docs" / "contract.md").read_text()
    section = text.split("\n### Metrics\n", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split(" | ", 1)[0]
            for name in re.findall(r"`(\w+)`", first):
                rows[name] = line
    return rows


def exported(m: ProxyMetrics) -> dict[str, set[str]]:
    """Family name (without the prefix, counters with their _total) -> label names, from a scrape."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        if not family.name.startswith(PREFIX) or family.name.endswith("_created"):
            continue  # prometheus-client's process_* series (a list there) and histograms' _created
        name = family.name.removeprefix(PREFIX) + ("_total" if family.type == "counter" else "")
        labels = out.setdefault(name, set())
        for sample in family.samples:
            labels.update(k for k in sample.labels if k != "le")
    return out


def test_every_counter_and_histogram_has_a_row_naming_its_labels():
    """Guards a found bug: ten counters (summary tokens and modes, ignored fields, the Redis store's) had no row."""
    m = ProxyMetrics(external=lambda: {n: 0 for n in HELP if n.startswith("state_")})
    for name, labels in LABELLED.items():  # one sample each, so its labels show in the scrape
        m.inc(name, **{k: "x" for k in labels})
    for name, hist in m.histograms.items():
        m.observe(name, 0.1, **{k: "x" for k in hist._labelnames})
    rows = metrics_table()
    for name, labels in exported(m).items():
        assert name in rows, f"{name}: no row in docs/contract.md's Metrics table"
        for label in labels:
            assert f"`{label}`" in rows[name], f"{name}: its label {label} is not in its row"


def test_ignored_request_fields_is_labelled_by_api_from_the_first_scrape():
    """Guards a found bug: its series was unlabelled until the first ignored field, then {api} only."""
    m = ProxyMetrics()
    assert exported(m)["ignored_request_fields_total"] == set()
    text = m.exposition().decode()
    assert "molctl_proxy_ignored_request_fields_total 0.0" not in text
    assert "# HELP molctl_proxy_ignored_request_fields_total Request fields" in text
    m.inc("ignored_request_fields_total", api="chat")
    assert exported(m)["ignored_request_fields_total"] == {"api"}
