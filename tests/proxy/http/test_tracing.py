"""OpenTelemetry traces (issue 29): the proxy, with the real OpenTelemetry SDK, exports a server span
per request and a client span per hop to an OTLP/HTTP receiver started here (tests/otlp_receiver.py,
protobuf decoded), and every hop carries a W3C traceparent to the engine (tests/fake_engine.py logs
it as vLLM reads it). The proxy is driven by the official openai SDK against the fake engine."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import httpx
import openai
import pytest

from molctl.proxy import tracing
from tests.helpers import free_ports
from tests.otlp_receiver import OtlpReceiver
from tests.procs import ROOT, fake_engine_argv, proxy_argv, running
from tests.proxy_stack import PUBLIC, TINY, TOOLS, Stack

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
OFF = {v: "" for v in (*tracing.ENDPOINT_VARIABLES, tracing.CAPTURE_VARIABLE)}


@pytest.fixture(scope="module")
def traced(keyfile, tmp_path_factory):
    """A fake engine, a proxy exporting to the receiver, and a second proxy with traces off."""
    logs = tmp_path_factory.mktemp("logs")
    engine_port, on_port, off_port, otlp_port = free_ports(4)
    engine_url = f"http://127.0.0.1:{engine_port}"
    with OtlpReceiver(otlp_port) as receiver:
        env = {**OFF, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        with (
            running(fake_engine_argv(engine_port), engine_url + "/health", log=logs / "engine.log"),
            running(
                proxy_argv("tiny", engine_url, on_port, "--api-key-file", str(keyfile)),
                f"http://127.0.0.1:{on_port}/health",
                env=env,
                log=logs / "on.log",
            ),
            running(
                proxy_argv("tiny", engine_url, off_port, "--api-key-file", str(keyfile)),
                f"http://127.0.0.1:{off_port}/health",
                env=OFF,
                log=logs / "off.log",
            ),
        ):
            yield (
                receiver,
                Stack(engine_url, f"http://127.0.0.1:{on_port}"),
                Stack(engine_url, f"http://127.0.0.1:{off_port}"),
            )


def of_request(spans: list[dict], request_id: str) -> list[dict]:
    """The server span of `request_id` and the hop spans under it."""
    server = [s for s in spans if s["kind"] == "SERVER" and s["attributes"].get("mol.request.id") == request_id]
    ids = {s["span_id"] for s in server}
    return server + [s for s in spans if s["parent_id"] in ids and s["kind"] == "CLIENT"]


def hops_done(request_id: str, *hops: str):
    def done(spans: list[dict]) -> bool:
        found = of_request(spans, request_id)
        return any(s["kind"] == "SERVER" for s in found) and {s["attributes"]["mol.hop"] for s in found[1:]} >= set(
            hops
        )

    return done


def by_hop(spans: list[dict]) -> dict[str, dict]:
    return {s["attributes"]["mol.hop"]: s for s in spans if s["kind"] == "CLIENT"}


def parent_of(traceparent: str) -> tuple[str, str]:
    """A sampled W3C traceparent's (trace id, parent span id); its flags may also carry the random bit (0x02)."""
    version, trace_id, parent, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent
    return trace_id, parent


def engine_entries(stack: Stack, request_id: str) -> dict[str, dict]:
    """The engine's log entries of a request's hops, by hop."""
    return {e["hop"]: e for e in stack.log() if (e.get("request_id") or "").startswith(request_id + "-")}


def test_an_incoming_traceparent_is_continued_through_every_hop_to_the_engine(traced):
    receiver, on, _ = traced
    on.reset()
    rid = "req-trace-continued"
    resp = on.client.chat.completions.create(
        model=PUBLIC,
        messages=[{"role": "user", "content": "[route:L2] hello there"}],
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": rid},
    )
    assert resp.choices[0].finish_reason == "stop"
    spans = of_request(receiver.wait_for(hops_done(rid, "route", "answer", "summary")), rid)
    server = spans[0]
    assert server["trace_id"] == TRACE_ID and server["parent_id"] == CLIENT_SPAN
    assert server["name"] == f"chat {PUBLIC}"
    assert server["resource"]["service.name"] == tracing.DEFAULT_SERVICE
    attrs = server["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == PUBLIC
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert attrs["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
    assert not any(k.startswith("mol.hop") or k == "mol.adapter" or k == "mol.route.source" for k in attrs)
    hops = by_hop(spans)
    for hop in ("route", "answer", "summary"):
        span = hops[hop]
        assert span["trace_id"] == TRACE_ID and span["parent_id"] == server["span_id"]
        assert span["attributes"]["gen_ai.provider.name"] == "vllm"
    assert hops["route"]["attributes"]["mol.adapter"] == "L0"
    answer = hops["answer"]["attributes"]
    assert answer["mol.adapter"] == "L2" and answer["mol.route.source"] == "classified"
    assert hops["answer"]["name"] == f"chat {answer['gen_ai.request.model']}"
    assert answer["gen_ai.response.finish_reasons"] == ["stop"]
    assert answer["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
    assert hops["summary"]["attributes"]["mol.adapter"] == "L2"
    entries = engine_entries(on, rid)
    for hop in ("route", "answer", "summary"):
        assert parent_of(entries[hop]["traceparent"]) == (TRACE_ID, hops[hop]["span_id"]), hop
    # no message content unless the operator opts in
    assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for s in spans for k in s["attributes"])


def test_a_stream_gets_a_new_trace_whose_answer_span_ends_with_the_stream(traced):
    receiver, on, _ = traced
    on.reset()
    rid = "req-trace-stream"
    stream = on.client.chat.completions.create(
        model=PUBLIC,
        messages=[{"role": "user", "content": "[route:L1] stream it"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": rid},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    spans = of_request(receiver.wait_for(hops_done(rid, "route", "answer")), rid)
    server = spans[0]
    assert server["parent_id"] is None and server["trace_id"] != TRACE_ID
    answer = by_hop(spans)["answer"]
    assert answer["attributes"]["mol.adapter"] == "L1"
    assert answer["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert answer["attributes"]["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert server["attributes"]["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert parent_of(engine_entries(on, rid)["answer"]["traceparent"]) == (server["trace_id"], answer["span_id"])


def test_a_responses_chain_shares_its_conversation_id(traced):
    receiver, on, _ = traced
    first = on.client.responses.create(
        model=PUBLIC, input="[route:L3] first turn", extra_headers={"x-request-id": "req-trace-resp-1"}
    )
    second = on.client.responses.create(
        model=PUBLIC,
        input="[route:L3] second turn",
        previous_response_id=first.id,
        stream=True,
        extra_headers={"x-request-id": "req-trace-resp-2"},
    )
    assert [e.type for e in second][-1] == "response.completed"
    # the follow-up keeps its adapter: its answer is the speculative hop the route hop agreed with
    for rid, hop in (("req-trace-resp-1", "answer"), ("req-trace-resp-2", "speculative")):
        spans = of_request(receiver.wait_for(hops_done(rid, "route", hop)), rid)
        assert spans[0]["attributes"]["gen_ai.conversation.id"] == first.id, rid
        assert spans[0]["name"] == f"chat {PUBLIC}"
        assert spans[0]["attributes"]["gen_ai.response.finish_reasons"] == ["stop"], rid
        assert by_hop(spans)[hop]["attributes"]["mol.adapter"] == "L3"
        assert by_hop(spans)[hop]["parent_id"] == spans[0]["span_id"]
    assert "answer" not in by_hop(of_request(list(receiver.spans), "req-trace-resp-2"))
    on.client.responses.retrieve(first.id, extra_headers={"x-request-id": "req-trace-get"})
    get = receiver.wait_for(lambda spans: of_request(spans, "req-trace-get"))
    server = of_request(get, "req-trace-get")[0]
    assert server["name"] == "GET /v1/responses/{id}" and server["attributes"]["http.route"] == "/v1/responses/{id}"
    assert server["attributes"]["url.path"] == f"/v1/responses/{first.id}"
    assert "gen_ai.request.model" not in server["attributes"]


def answer_source(receiver: OtlpReceiver, rid: str) -> tuple[str, bool]:
    """The answer hop span's mol.route.source, and whether the request made a route hop."""
    spans = of_request(receiver.wait_for(hops_done(rid, "answer")), rid)
    return by_hop(spans)["answer"]["attributes"]["mol.route.source"], "route" in by_hop(spans)


def test_the_answer_span_says_how_its_adapter_was_chosen(traced):
    receiver, on, _ = traced
    on.reset()
    ask = {"role": "user", "content": "[route:L3] [tool:get_weather] weather in Oslo?"}
    first = on.client.chat.completions.create(
        model=PUBLIC, messages=[ask], tools=TOOLS, extra_headers={"x-request-id": "req-trace-tool"}
    )
    call = first.choices[0].message.tool_calls[0].model_dump()
    turn = [ask, {"role": "assistant", "content": None, "tool_calls": [call]}]
    turn.append({"role": "tool", "tool_call_id": call["id"], "content": "18C sunny"})
    on.client.chat.completions.create(
        model=PUBLIC, messages=turn, tools=TOOLS, extra_headers={"x-request-id": "req-trace-sticky"}
    )
    on.config(route_label="no label here")
    try:
        on.client.chat.completions.create(
            model=PUBLIC,
            messages=[{"role": "user", "content": "which adapter?"}],
            extra_headers={"x-request-id": "req-trace-fallback"},
        )
    finally:
        on.config(route_label=None)
    assert answer_source(receiver, "req-trace-tool") == ("classified", True)
    assert answer_source(receiver, "req-trace-sticky") == ("sticky", False)  # a tool result: no route hop
    assert answer_source(receiver, "req-trace-fallback") == ("fallback", True)


def test_an_engine_failure_marks_the_hop_span_and_a_5xx_the_server_span(traced):
    receiver, on, _ = traced
    on.reset()
    # vLLM's error body (vllm/entrypoints/openai/engine/protocol.py ErrorResponse)
    error = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    on.config(answer_error={"status": 500, "body": error})
    rid = "req-trace-engine-error"
    try:
        with pytest.raises(openai.InternalServerError):
            on.client.chat.completions.create(
                model=PUBLIC,
                messages=[{"role": "user", "content": "[route:L2] fail please"}],
                extra_headers={"x-request-id": rid},
            )
    finally:
        on.config(answer_error=None)
    spans = of_request(receiver.wait_for(hops_done(rid, "route", "answer")), rid)
    answer = by_hop(spans)["answer"]
    assert answer["status"] == 2 and answer["attributes"]["error.type"] == "500"
    assert by_hop(spans)["route"]["status"] == 0
    server = spans[0]
    assert server["status"] == 2 and server["attributes"]["http.response.status_code"] >= 500
    assert server["attributes"]["error.type"]


def test_tracing_off_exports_nothing_and_sends_no_traceparent(traced):
    receiver, on, off = traced
    off.reset()
    rid = "req-trace-off"
    off.client.chat.completions.create(
        model=PUBLIC,
        messages=[{"role": "user", "content": "[route:L2] untraced"}],
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "x-request-id": rid},
    )
    # a traced request after it: once its spans are in, the untraced one would have been too
    marker = "req-trace-after-off"
    on.client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "marker"}], extra_headers={"x-request-id": marker}
    )
    spans = receiver.wait_for(hops_done(marker, "answer"))
    assert of_request(spans, rid) == []
    entries = engine_entries(off, rid)
    assert entries["answer"]["traceparent"] is None and entries["route"]["traceparent"] is None


def test_probes_get_no_span(traced):
    receiver, on, _ = traced
    assert httpx.get(on.proxy_url + "/health").status_code == 200
    marker = "req-trace-after-probe"
    on.client.chat.completions.create(
        model=PUBLIC, messages=[{"role": "user", "content": "marker"}], extra_headers={"x-request-id": marker}
    )
    spans = receiver.wait_for(hops_done(marker, "answer"))
    assert not [s for s in spans if s["attributes"].get("url.path") in ("/health", "/readyz")]


def test_message_content_is_on_the_hop_spans_when_the_operator_opts_in(keyfile, tmp_path):
    engine_port, proxy_port, otlp_port = free_ports(3)
    engine_url = f"http://127.0.0.1:{engine_port}"
    with OtlpReceiver(otlp_port) as receiver:
        env = {
            **OFF,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "edge-proxy",
            tracing.CAPTURE_VARIABLE: "true",
        }
        with (
            running(fake_engine_argv(engine_port), engine_url + "/health", log=tmp_path / "engine.log"),
            running(
                proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keyfile)),
                f"http://127.0.0.1:{proxy_port}/health",
                env=env,
                log=tmp_path / "proxy.log",
            ),
        ):
            stack = Stack(engine_url, f"http://127.0.0.1:{proxy_port}")
            resp = stack.client.chat.completions.create(
                model=PUBLIC,
                messages=[{"role": "user", "content": "[route:L2] the secret word"}],
                extra_headers={"x-request-id": "req-trace-content"},
            )
            spans = of_request(receiver.wait_for(hops_done("req-trace-content", "answer")), "req-trace-content")
    assert spans[0]["resource"]["service.name"] == "edge-proxy"
    answer = by_hop(spans)["answer"]["attributes"]
    assert "the secret word" in answer["gen_ai.input.messages"]
    assert resp.choices[0].message.content in answer["gen_ai.output.messages"]
    assert not any(k.startswith(("gen_ai.input", "gen_ai.output")) for k in spans[0]["attributes"])


def test_an_unknown_otlp_protocol_is_one_line_and_exit_3(keyfile):
    port, engine_port = free_ports(2)
    env = {
        **os.environ,
        **OFF,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
    }
    argv = proxy_argv("tiny", f"http://127.0.0.1:{engine_port}", port, "--api-key-file", str(keyfile))
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stderr.strip().splitlines()[-1] == (
        "molctl: error: OTEL_EXPORTER_OTLP_PROTOCOL='http/json': expected one of http/protobuf, grpc"
    )


def test_a_missing_sdk_names_the_extra(monkeypatch):
    from molctl.engines import get_engine
    from molctl.errors import ExitStatus, MolctlError

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if the SDK were not installed
    with pytest.raises(MolctlError) as err:
        tracing.start(TINY, get_engine("vllm"), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert err.value.exit_status == ExitStatus.CHECK_FAILED
    assert "opentelemetry.sdk.trace is missing: pip install 'molctl[otel]'" in str(err.value)


def test_tracing_is_off_without_an_endpoint_and_never_imports_the_sdk():
    code = (
        "import sys; from molctl.proxy import tracing; from molctl.engines import get_engine;"
        "from tests.proxy_stack import TINY;"
        "assert tracing.start(TINY, get_engine('vllm'), {}) is None;"
        "import molctl.proxy.http.app, molctl.proxy.engine_client;"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **OFF}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("endpoint", ["collector:4318", "http://[::1", "http://c:port"])
def test_a_profile_endpoint_that_is_no_url_is_one_line_naming_the_field(endpoint):
    """An unclosed IPv6 host or a port that is no number passed the profile check, as the variable's did once."""
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), [("proxy.otlp_endpoint", endpoint)])
    assert str(err.value).endswith(
        f"field 'proxy.otlp_endpoint': {endpoint}: expected a collector URL such as http://HOST:4318"
    )


def test_grpc_is_used_when_its_exporter_is_installed_and_named_when_not(monkeypatch):
    from molctl.engines import get_engine
    from molctl.errors import MolctlError

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    traces = tracing.start(TINY, get_engine("vllm"), env)  # the venv has opentelemetry-exporter-otlp-proto-grpc
    assert traces is not None
    traces.close()
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(MolctlError) as err:
        tracing.start(TINY, get_engine("vllm"), env)
    assert str(err.value) == (
        "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc: "
        "pip install opentelemetry-exporter-otlp-proto-grpc (or use http/protobuf)"
    )


@pytest.mark.parametrize(
    ("variables", "line"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"}, "OTEL_EXPORTER_OTLP_ENDPOINT='not a url'"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT='ftp://collector:4318'"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://[::1'"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:port"},
            "OTEL_EXPORTER_OTLP_ENDPOINT='http://collector:port'",
        ),
        (  # the traces variable is the one the exporter reads
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4318", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='collector:4318'",
        ),
    ],
)
def test_an_endpoint_variable_that_is_no_url_is_one_line_and_exit_3(variables, line):
    """Guards a found bug: the proxy served, logging an export error per batch, and no span ever left."""
    from molctl.engines import get_engine
    from molctl.errors import ExitStatus, MolctlError

    with pytest.raises(MolctlError) as err:
        tracing.start(TINY, get_engine("vllm"), variables)
    assert err.value.exit_status == ExitStatus.CHECK_FAILED
    assert str(err.value) == f"{line}: expected a collector URL such as http://HOST:4318"


def test_grpc_takes_host_and_port_and_the_profile_field_wins_over_a_bad_variable():
    from molctl.engines import get_engine
    from molctl.errors import MolctlError

    grpc = {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    tracing.start(TINY, get_engine("vllm"), grpc).close()
    with pytest.raises(MolctlError, match="expected a collector URL such as http://HOST:4317 or HOST:4317"):
        tracing.start(TINY, get_engine("vllm"), {**grpc, "OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"})
    profile = dataclasses.replace(TINY, proxy=dataclasses.replace(TINY.proxy, otlp_endpoint="http://127.0.0.1:9"))
    tracing.start(profile, get_engine("vllm"), {"OTEL_EXPORTER_OTLP_ENDPOINT": "not a url"}).close()


def test_a_malformed_tracestate_never_reaches_the_log(keyfile, tmp_path):
    """Guards a found bug: OpenTelemetry's warning quoted any client's tracestate (keyless too) in the log."""
    engine_port, port, otlp_port = free_ports(3)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    with (
        OtlpReceiver(otlp_port) as receiver,
        running(fake_engine_argv(engine_port), engine_url + "/health", log=tmp_path / "engine.log"),
        running(
            proxy_argv("tiny", engine_url, port, "--api-key-file", str(keyfile)),
            proxy_url + "/health",
            env={**OFF, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"},
            log=log,
        ),
    ):
        parent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        for state in ('FORGED {"request_id": "x"}', "a=b,FORGED member", "a=" + "FORGED" * 2000):
            r = httpx.get(proxy_url + "/v1/models", headers={"traceparent": parent, "tracestate": state})
            assert r.status_code == 401
        r = httpx.get(proxy_url + "/v1/models", headers={"traceparent": "00-" + "f" * 600, "x-request-id": "req-long"})
        assert r.status_code == 401
        spans = receiver.wait_for(lambda spans: len([s for s in spans if s["kind"] == "SERVER"]) == 4)
    assert len([s for s in spans if s["trace_id"] == TRACE_ID]) == 3  # the traceparent is still continued
    text = log.read_text()
    assert "FORGED" not in text and "fffffffff" not in text
    assert text.count('"status":401') == 4  # the request lines are still written


def test_a_collector_that_is_down_is_logged_once_a_minute_not_per_retry(monkeypatch, caplog):
    """Guards a found bug: the OTLP/HTTP exporter logged every retry of every batch (about one line a second)."""
    import logging
    import time

    from molctl.engines import get_engine

    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")  # the SDK reads os.environ
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with caplog.at_level(logging.WARNING):
        traces = tracing.start(TINY, get_engine("vllm"), os.environ)
        try:
            traces.tracer.start_span("chat L1").end()
            time.sleep(3.5)  # the exporter's retries: after about 1 s, then 2 s more (each logged before)
        finally:
            traces.close()
    exporter = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    said = [r.getMessage() for r in caplog.records if r.name == exporter]
    assert len(said) == 1 and said[0].startswith("Transient error"), said
