"""Traces across the hops into a real vLLM (issue 29): `molctl up tiny` with the proxy's traces on
(`proxy.otlp_endpoint`) and vLLM's own (`engine.otlp_traces_endpoint`: vLLM --otlp-traces-endpoint,
OTLP/HTTP), both exporting to the receiver started here (tests/otlp_receiver.py). vLLM's
`llm_request` span of each hop (vllm/v1/engine/output_processor.py) is a child of the proxy's hop
span: the traceparent every hop sends is the one vLLM continues (vllm/tracing/otel.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import openai

from molctl.errors import ExitStatus
from tests.helpers import free_ports
from tests.otlp_receiver import OtlpReceiver
from tests.procs import ROOT

KEY = "sk-e2e-tracing"


def molctl(state, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "molctl", "--state-dir", str(state), *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def test_vllms_own_spans_are_children_of_the_proxys_hop_spans(tmp_path):
    state, model, key = tmp_path / "state", tmp_path / "tiny", tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    engine_port, proxy_port, otlp_port = free_ports(3)
    with OtlpReceiver(otlp_port) as receiver:
        r = molctl(state, "demo", "init", str(model))
        assert r.returncode == ExitStatus.OK, r.stderr
        try:
            r = molctl(
                state,
                "up",
                "tiny",
                "--model-root",
                str(model),
                "--api-key-file",
                str(key),
                "--json",
                "--set",
                f"engine.port={engine_port}",
                "--set",
                f"proxy.port={proxy_port}",
                "--set",
                f"engine.otlp_traces_endpoint={receiver.url}/v1/traces",
                "--set",
                "engine.env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf",
                "--set",
                "engine.env.OTEL_BSP_SCHEDULE_DELAY=100",
                "--set",
                f"proxy.otlp_endpoint={receiver.url}",
            )
            assert r.returncode == ExitStatus.OK, r.stdout + r.stderr
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{proxy_port}/v1", api_key=KEY, max_retries=0, timeout=120
            )
            rid = "req-e2e-trace"
            resp = client.chat.completions.create(
                model=json.loads(r.stdout)["model"],
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                extra_headers={"x-request-id": rid},
            )
            assert resp.choices[0].message.content is not None

            def joined(spans: list[dict]) -> bool:
                server = [s for s in spans if s["attributes"].get("mol.request.id") == rid]
                if not server:
                    return False
                hops = {s["span_id"]: s for s in spans if s["parent_id"] == server[0]["span_id"]}
                engine = [s for s in spans if s["name"] == "llm_request" and s["parent_id"] in hops]
                return {hops[s["parent_id"]]["attributes"]["mol.hop"] for s in engine} >= {"route", "answer"}

            spans = receiver.wait_for(joined, timeout=60)
        finally:
            molctl(state, "down", "--stop-timeout", "20", "--drain-timeout", "20", "--force")
    server = next(s for s in spans if s["attributes"].get("mol.request.id") == rid)
    hops = {s["span_id"]: s for s in spans if s["parent_id"] == server["span_id"]}
    for span in (s for s in spans if s["name"] == "llm_request" and s["parent_id"] in hops):
        hop = hops[span["parent_id"]]
        assert span["trace_id"] == server["trace_id"] == hop["trace_id"]
        assert span["resource"]["service.name"] != server["resource"]["service.name"]  # vLLM's own
        assert f"{rid}-{hop['attributes']['mol.hop']}" in span["attributes"]["gen_ai.request.id"]
