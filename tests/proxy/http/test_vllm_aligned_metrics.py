"""The proxy's vLLM-shaped metrics (issue 29): time to first token and end-to-end latency with
vLLM's bucket boundaries, requests running and waiting in admission, and the per-hop, per-adapter
prompt, cached and generated token counters, read from the real proxy's metrics listener after
traffic from the official openai SDK against the fake engine (its usage: 10 prompt tokens, 4 of
them cached, 3 generated, as vLLM reports `prompt_tokens_details.cached_tokens`)."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from molctl.proxy.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.helpers import free_port, wait_for
from tests.proxy_stack import PUBLIC, own_stack


def samples(s) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(s.metrics_url + "/metrics").text
    return [(x.name, x.labels, x.value) for family in text_string_to_metric_families(text) for x in family.samples]


def value(s, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples(s) if n == name and all(lab.get(k) == x for k, x in labels.items()))


def buckets(s, name: str, **labels: str) -> list[float]:
    return [
        float(lab["le"])
        for n, lab, _ in samples(s)
        if n == name + "_bucket" and all(lab.get(k) == x for k, x in labels.items()) and lab["le"] != "+Inf"
    ]


def test_each_hop_counts_prompt_cached_and_generated_tokens_by_adapter(s):
    s.config()
    before = {
        (k, hop, a): value(s, f"molctl_proxy_{k}_total", hop=hop, adapter=a)
        for k in ("prompt_tokens", "cached_tokens", "generation_tokens")
        for hop, a in (("route", "L0"), ("answer", "L2"))
    }
    summaries = value(s, "molctl_proxy_summaries_total")
    s.chat([{"role": "user", "content": "[route:L2] hello"}])
    for hop, adapter in (("route", "L0"), ("answer", "L2")):
        assert (
            value(s, "molctl_proxy_prompt_tokens_total", hop=hop, adapter=adapter)
            == before[("prompt_tokens", hop, adapter)] + 10
        )
        assert (
            value(s, "molctl_proxy_cached_tokens_total", hop=hop, adapter=adapter)
            == before[("cached_tokens", hop, adapter)] + 4
        )
        assert (
            value(s, "molctl_proxy_generation_tokens_total", hop=hop, adapter=adapter)
            == before[("generation_tokens", hop, adapter)] + 3
        )
    # the summary hop, in the background, on the answer's adapter
    assert wait_for(lambda: value(s, "molctl_proxy_summaries_total") == summaries + 1)
    assert value(s, "molctl_proxy_prompt_tokens_total", hop="summary", adapter="L2") > 0
    assert value(s, "molctl_proxy_generation_tokens_total", hop="summary", adapter="L2") > 0
    assert value(s, "molctl_proxy_cached_tokens_total", hop="summary", adapter="L2") >= 0
    # the older summary-only counter agrees with the sum over adapters
    assert value(s, "molctl_proxy_cached_tokens_total", hop="summary") == value(
        s, "molctl_proxy_summary_cached_tokens_total"
    )
    # every labelled token series names a hop and an adapter from the fixed sets
    for name, labels, _ in samples(s):
        if name in ("molctl_proxy_prompt_tokens_total", "molctl_proxy_cached_tokens_total"):
            assert labels["hop"] in ("route", "answer", "summary") and labels["adapter"] in ("L0", "L1", "L2", "L3")


def test_latency_histograms_use_vllms_buckets_by_api_and_adapter(s):
    s.config()
    e2e_chat = value(s, "molctl_proxy_e2e_request_latency_seconds_count", api="chat", adapter="L3")
    ttft_chat = value(s, "molctl_proxy_time_to_first_token_seconds_count", api="chat", adapter="L3")
    ttft_resp = value(s, "molctl_proxy_time_to_first_token_seconds_count", api="responses", adapter="L1")
    e2e_resp = value(s, "molctl_proxy_e2e_request_latency_seconds_count", api="responses", adapter="L1")
    s.chat([{"role": "user", "content": "[route:L3] streamed"}], stream=True)
    with s.client.responses.stream(model=PUBLIC, input="[route:L1] streamed too") as events:
        for _ in events:
            pass
    s.client.responses.create(model=PUBLIC, input="[route:L1] whole")  # e2e only: not a stream
    assert wait_for(
        lambda: (
            value(s, "molctl_proxy_e2e_request_latency_seconds_count", api="responses", adapter="L1") == e2e_resp + 2
        )
    )
    assert wait_for(
        lambda: value(s, "molctl_proxy_e2e_request_latency_seconds_count", api="chat", adapter="L3") == e2e_chat + 1
    )
    assert value(s, "molctl_proxy_time_to_first_token_seconds_count", api="chat", adapter="L3") == ttft_chat + 1
    assert value(s, "molctl_proxy_time_to_first_token_seconds_count", api="responses", adapter="L1") == ttft_resp + 1
    assert buckets(s, "molctl_proxy_time_to_first_token_seconds", api="chat", adapter="L3") == list(TTFT_BUCKETS)
    assert buckets(s, "molctl_proxy_e2e_request_latency_seconds", api="chat", adapter="L3") == list(
        REQUEST_LATENCY_BUCKETS
    )


def test_the_bucket_boundaries_are_those_of_the_installed_vllm():
    # vLLM 0.32 keeps its defaults in vllm/v1/metrics/buckets.py (earlier: inline in loggers.py)
    from vllm.v1.metrics.buckets import REQUEST_LATENCY_BUCKETS as VLLM_E2E
    from vllm.v1.metrics.buckets import TIME_TO_FIRST_TOKEN_BUCKETS as VLLM_TTFT

    assert tuple(TTFT_BUCKETS) == tuple(VLLM_TTFT)
    assert tuple(REQUEST_LATENCY_BUCKETS) == tuple(VLLM_E2E)


def test_requests_running_and_waiting_follow_admission(keyfile, tmp_path):
    metrics_port = free_port()
    with own_stack(keyfile, tmp_path, "--set", "proxy.max_inflight=1", "--metrics-port", str(metrics_port)) as own:
        own.metrics_url = f"http://127.0.0.1:{metrics_port}"
        own.config(answer_delay=1.5)
        assert value(own, "molctl_proxy_num_requests_running") == 0
        assert value(own, "molctl_proxy_num_requests_waiting") == 0
        threads = [
            threading.Thread(target=own.chat, args=([{"role": "user", "content": f"[route:L1] slow {i}"}],))
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        try:
            # one answer slot: one request runs, the other waits for it in admission
            assert wait_for(
                lambda: (
                    (value(own, "molctl_proxy_num_requests_running"), value(own, "molctl_proxy_num_requests_waiting"))
                    == (1, 1)
                )
            )
        finally:
            for thread in threads:
                thread.join(30)
        assert wait_for(lambda: value(own, "molctl_proxy_num_requests_running") == 0)
        assert value(own, "molctl_proxy_num_requests_waiting") == 0
