"""The lifecycle cases that depend on the engine, against the scripted fake SGLang
(tests/fake_sglang.py, run as `engine.python -m sglang.launch_server ...` through a fake `sglang`
distribution), on free ports: up, ready (warm-up, adapters, version, 1-token smoke per adapter),
adapters missing, wrong parent, crash while loading, timeouts, down with the scheduler and
detokenizer children, the orphaned scheduler after SIGKILL of the launcher, and switching
between an SGLang stack (venti-sglang-like) and a vLLM one (tall-like, the fake vLLM).

The profile `tiny-sglang` is venti-sglang's engine section (same flags, TP 1 and a 2048 window)
on tiny's model layout and proxy, so the model checks pass on the generated layout."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest

from molctl.errors import ExitStatus
from tests.helpers import url
from tests.lifecycle_host import PUBLIC, gone, port_free
from tests.sglang_host import SGL, SglHost

SERVED = "glm52-fp8-official"


@pytest.fixture
def host(tmp_path):
    h = SglHost(tmp_path)
    yield h
    h.cleanup()


def engine_log(host: SglHost) -> str:
    return host.molctl("logs", SGL, "--component", "engine", "-n", "400").stdout


def test_up_ready_status_and_down_with_children(host):
    r = host.up("--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = json.loads(r.stdout)
    assert result["state"] == "ready" and result["endpoint"] == url(host.proxy_port) + "/v1"
    # the launch argv is SGLang's: --model-path, --lora-paths NAME=PATH, the venti-sglang flags
    argv = host.records()["engine"].argv
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--model-path" in argv
    assert [a for a in argv if a.startswith("L") and "=" in a] == [f"L{i}={host.model}/loras/L{i}" for i in range(4)]
    assert "--enable-cache-report" in argv and "--reasoning-parser" in argv
    # ready means warmed up: the fake's warm-up ran before the readiness smoke
    log = engine_log(host)
    assert log.index("The server is fired up and ready to roll!") >= 0
    # the public endpoint works with the openai SDK; the engine saw base:adapter names
    client = openai.OpenAI(base_url=result["endpoint"], api_key="none", max_retries=0)
    answer = client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] hi"}])
    assert answer.model == PUBLIC and answer.usage.prompt_tokens_details.cached_tokens == 4
    status = json.loads(host.molctl("status", "--json").stdout)["stacks"][0]
    assert status["state"] == "ready" and status["adapters"] == "ok"
    # the scheduler and detokenizer renamed themselves, yet belong to the stack (run-dir marker)
    children = host.sglang_children()
    assert sorted(" ".join(p.cmdline()).strip() for p in children) == ["sglang::detokenizer", "sglang::scheduler"]
    pids = host.stack_pids()
    assert {p.pid for p in children} <= pids
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone(pids) and host.sglang_children() == []
    assert port_free(host.engine_port) and port_free(host.proxy_port) and host.records() == {}
    assert "SIGTERM received" in engine_log(host)  # the launcher drained on SIGTERM


def test_readiness_waits_for_the_warm_up(host):
    """/health is 503 until the warm-up request succeeded; the wait shows it as warming up."""
    # 8 s for the fake launcher (a new interpreter, aiohttp, two children) to reach its 60 s warm-up
    # on a loaded runner: with 3 s the phase shown could still be "loading model" or "KV cache"
    r = host.up("--timeout", "8", env={"FAKE_WARMUP_DELAY": "60"})
    assert r.exit_code == ExitStatus.TIMEOUT, r.stderr
    assert "not ready within 8 s" in r.stderr and "SGLang: warming up" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_adapter_missing(host):
    r = host.up(env={"FAKE_ADAPTERS": "L0,L1,L2"})
    assert r.exit_code == ExitStatus.ADAPTERS, r.stderr
    assert "adapter L3 is missing" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_adapter_with_wrong_parent(host):
    r = host.up(env={"FAKE_PARENT": "some-other-base"})
    assert r.exit_code == ExitStatus.ADAPTERS, r.stderr
    assert f"parent 'some-other-base', expected '{SERVED}'" in r.stderr
    assert host.records() == {} and host.sglang_children() == []


def test_running_version_is_checked_against_the_pin(host):
    r = host.up(env={"FAKE_SGLANG_VERSION": "0.5.3"})
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert "reports version 0.5.3, which does not match engine.version ==0.5.13.post1" in r.stderr
    assert host.records() == {} and host.sglang_children() == []


DEPRECATED = "Endpoint '/get_server_info' is deprecated"


def test_readiness_reads_the_version_from_server_info_without_a_deprecation_warning(host):
    """SGLang 0.5.13 logs a deprecation warning on every /get_server_info call (http_server.py):
    readiness asks /server_info, so the engine log holds none."""
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert DEPRECATED not in engine_log(host)
    assert host.molctl("down").exit_code == ExitStatus.OK


def test_an_sglang_without_server_info_is_read_at_get_server_info(host):
    """A release from before /server_info (FAKE_NO_SERVER_INFO): its 404 sends readiness to the old
    path, whose version is still checked against the pin."""
    r = host.up(env={"FAKE_NO_SERVER_INFO": "1", "FAKE_SGLANG_VERSION": "0.5.3"})
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert "reports version 0.5.3, which does not match engine.version ==0.5.13.post1" in r.stderr
    assert DEPRECATED in engine_log(host)


def test_crash_while_loading(host):
    r = host.up(env={"FAKE_EXIT": "3", "FAKE_STARTUP_DELAY": "0.5"})
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "exited with code 3" in r.stderr and "CUDA out of memory (simulated)" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_failed_warm_up_kills_the_tree(host):
    r = host.up(env={"FAKE_WARMUP_FAIL": "1"})
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "Initialization failed. warmup error" in r.stderr
    assert host.records() == {} and host.sglang_children() == []


def test_loading_never_ends_times_out(host):
    r = host.up("--timeout", "2", env={"FAKE_STARTUP_DELAY": "60"})
    assert r.exit_code == ExitStatus.TIMEOUT, r.stderr
    assert "not ready within 2 s" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_launcher_ignoring_sigterm_is_killed_with_its_children(host):
    assert host.up(env={"FAKE_IGNORE_TERM": "1"}).exit_code == ExitStatus.OK
    pids = host.stack_pids()
    d = host.molctl("down", "--stop-timeout", "1")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "engine: still running; sending SIGKILL" in d.stdout
    assert gone(pids) and host.sglang_children() == [] and host.records() == {}


def test_orphaned_scheduler_after_sigkill_of_the_launcher(host):
    """FAKE_ORPHAN: the children do not arm PDEATHSIG (SGLang versions that disable
    kill_itself_when_parent_died), so SIGKILL of the launcher leaves them running."""
    assert host.up(env={"FAKE_ORPHAN": "1"}).exit_code == ExitStatus.OK
    record = host.records()["engine"]
    children = [p.pid for p in host.sglang_children()]
    assert len(children) == 2
    os.kill(record.pid, signal.SIGKILL)
    time.sleep(0.3)
    assert all(psutil.pid_exists(c) for c in children)
    assert json.loads(host.molctl("status", "--json").stdout)["stacks"][0]["state"] == "degraded"
    r = host.up(env={"FAKE_ORPHAN": "1"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "leftover" in r.stdout
    assert gone(children)
    assert host.molctl("down").exit_code == ExitStatus.OK
    assert host.sglang_children() == []


def test_children_with_pdeathsig_die_with_the_launcher(host):
    """SGLang's default: the scheduler/detokenizer arm PR_SET_PDEATHSIG, so they go with a
    SIGKILLed launcher; the stale records are cleaned by the next up."""
    assert host.up().exit_code == ExitStatus.OK
    children = [p.pid for p in host.sglang_children()]
    os.kill(host.records()["engine"].pid, signal.SIGKILL)
    assert gone(children)
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert host.molctl("down").exit_code == ExitStatus.OK
    assert host.sglang_children() == []


def test_switch_between_sglang_and_vllm(host):
    assert host.up().exit_code == ExitStatus.OK
    sgl_pids = host.stack_pids()
    r = host.molctl("switch", "tiny", *host.args("--json"))  # the fake vLLM (tall-like)
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = json.loads(r.stdout)
    assert result["profile"] == "tiny" and result["stopped"] == [SGL]
    assert gone(sgl_pids) and host.sglang_children() == [] and host.records(SGL) == {}
    client = openai.OpenAI(base_url=result["endpoint"], api_key="none", max_retries=0)
    assert client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L1] x"}]).choices
    vllm_pids = host.stack_pids("tiny")
    r = host.molctl("switch", SGL, *host.args("--json"))
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert json.loads(r.stdout)["stopped"] == ["tiny"] and gone(vllm_pids) and host.records("tiny") == {}
    assert len(host.sglang_children()) == 2
    assert client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L3] y"}]).choices
    assert host.molctl("down").exit_code == ExitStatus.OK
    assert host.sglang_children() == []


def test_engine_checks_read_the_installed_sglang(host):
    """The preflight's engine checks against the fake sglang distribution: version from its
    metadata, flags from its srt/server_args.py add_argument lines (SGLang is never imported)."""
    base = [
        "check",
        SGL,
        "--set",
        f"engine.python={host.python}",
        "--model-root",
        str(host.model),
        "--skip",
        "gpu",
        "--json",
    ]
    r = host.molctl(*base)
    assert r.exit_code == ExitStatus.OK, r.stderr
    checks = {c["id"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["engine.version"]["status"] == "pass" and "0.5.13.post1" in checks["engine.version"]["detail"]
    assert checks["engine.flags"]["status"] == "pass"
    r = host.molctl(*base, "--set", "engine.args.no-such-sglang-flag=true")
    assert r.exit_code == ExitStatus.CHECK_FAILED
    flags = {c["id"]: c for c in json.loads(r.stdout)["checks"]}["engine.flags"]
    assert flags["status"] == "fail" and "no-such-sglang-flag" in flags["detail"]
    r = host.molctl(*base, "--set", "engine.args.enable-priority-scheduling=true")  # the README's opt-in
    assert r.exit_code == ExitStatus.OK, r.stdout


def test_progress_phases_from_the_sglang_log():
    """The phase shown on the progress line, read from the lines SGLang (and the fake) logs."""
    from molctl.engines import get_engine

    engine = get_engine("sglang")
    lines = ["server_args=ServerArgs(model_path='/m', tp_size=8)", "Load weight begin. avail mem=139.50 GB"]
    assert engine.phase(lines) == "loading weights"
    lines.append("Loading safetensors checkpoint shards:  50% Completed | 71/141 [01:02<01:00]")
    assert engine.phase(lines) == "loading weights: 50% (71/141 shards)"
    lines += ["Load weight end. type=GlmMoeDsaForCausalLM", "KV Cache is allocated. #tokens: 1000000"]
    assert engine.phase(lines) == "KV cache"
    lines.append("Application startup complete.")
    assert engine.phase(lines) == "API server: warming up"
    lines.append("The server is fired up and ready to roll!")
    assert engine.phase(lines) == "API server: serving"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_scheduler_killed_while_serving_takes_the_engine_down(host):
    """SGLang's SubprocessWatchdog (PR #18582): a scheduler that dies (OOM killer, SIGKILL) makes
    the launcher kill its whole tree, itself included, within about a second. status then shows
    the engine dead (degraded: the proxy still runs), and `up` starts a fresh engine."""
    assert host.up().exit_code == ExitStatus.OK
    launcher = host.records()["engine"].pid
    (scheduler,) = [p for p in host.sglang_children() if "scheduler" in " ".join(p.cmdline())]
    scheduler.kill()
    assert wait_gone(launcher), "the launcher outlived its scheduler"
    assert host.sglang_children() == []
    log = engine_log(host)
    assert f"Subprocess scheduler_0 (pid={scheduler.pid}) crashed with exit code -9" in log
    assert "It usually means one child failed" in log
    stack = json.loads(host.molctl("status", "--json").stdout)["stacks"][0]
    assert stack["state"] == "degraded"
    assert {c["name"]: c["alive"] for c in stack["components"]} == {"engine": False, "proxy": True}
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert json.loads(host.molctl("status", "--json").stdout)["stacks"][0]["state"] == "ready"
    assert len(host.sglang_children()) == 2
    assert host.molctl("down").exit_code == ExitStatus.OK
    assert host.sglang_children() == []


def test_scheduler_exception_while_loading(host):
    """SGLang's own crash path: the scheduler raises, SIGQUITs the launcher, which kills its tree
    and itself with SIGKILL (exit -9), so `up` sees a SIGKILLed engine; the log says why."""
    r = host.up(env={"FAKE_SCHEDULER_FAIL": "1", "FAKE_STARTUP_DELAY": "0.5"})
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "exited with code -9" in r.stderr
    assert "Scheduler hit an exception" in r.stderr and "Received sigquit from a child process" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_down_with_sglang_timings_needs_no_sigkill(host):
    """With SGLang's own 5 s sigterm-watchdog poll: `down` SIGTERMs the launcher and its children;
    a child gone with -15 trips the SubprocessWatchdog (a 1 s poll), which takes the tree down, well
    inside the stop timeout: no escalation to SIGKILL by molctl. When the sigterm watchdog's own
    poll falls first (its 5 s cycle is not aligned with the SIGTERM; a loaded machine delays the
    1 s thread), the launcher's graceful exit ends the tree instead: either is SGLang's own."""
    assert host.up(env={"FAKE_TERM_POLL": "5"}).exit_code == ExitStatus.OK
    pids = host.stack_pids()
    started = time.monotonic()
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "sending SIGKILL" not in d.stdout and time.monotonic() - started < 20
    log = engine_log(host)  # a watchdog of SGLang's, not molctl, ended the tree
    assert "crashed with exit code -15" in log or "Gracefully exiting... Remaining number of requests 0." in log
    assert gone(pids) and host.sglang_children() == [] and host.records() == {}


def test_lora_pool_smaller_than_the_batch_fails_at_start(host):
    """server_args.py check_lora_server_args: --max-loaded-loras below --max-loras-per-batch is an
    assertion before any child starts."""
    r = host.up("--set", "engine.args.max-loras-per-batch=8")
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "max_loaded_loras should be greater than or equal to max_loras_per_batch" in r.stderr
    assert host.records() == {} and host.sglang_children() == [] and port_free(host.engine_port)


def test_status_with_sglang_generating_health(host):
    """SGLang's default /health generates a token and answers after >= 1 s (http_server.py
    health_generate): status probes it with the engine's own timeout, so a ready stack is ready."""
    assert host.up(env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1"}).exit_code == ExitStatus.OK
    try:
        stack = json.loads(host.molctl("status", "--json").stdout)["stacks"][0]
        assert stack["state"] == "ready", stack
    finally:
        assert host.molctl("down").exit_code == ExitStatus.OK


def test_served_name_with_a_colon_is_refused_before_start(host):
    """SGLang splits `model` at the first ':' (serving_base.py _parse_model_parameter, issue
    #12745): such a served name is refused by the engine check, before anything starts."""
    r = host.up("--timeout", "8", "--set", "engine.served_name=glm52:fp8")
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert "':'" in r.stderr


def test_engine_metrics_have_the_names_bench_reads(host):
    """--enable-metrics (venti-sglang passes it): /metrics carries every counter molctl bench
    reports for SGLang (metrics/collector.py names; cached tokens summed over cache_source)."""
    from molctl.bench.measure import parse_metrics
    from molctl.engines import get_engine

    assert host.up().exit_code == ExitStatus.OK
    engine = url(host.engine_port)
    client = openai.OpenAI(base_url=engine + "/v1", api_key="none", max_retries=0)
    client.chat.completions.create(model=f"{SERVED}:L1", messages=[{"role": "user", "content": "hi"}])
    values = parse_metrics(httpx.get(engine + "/metrics").text)
    assert set(get_engine("sglang").bench_metrics.values()) <= set(values)
    assert values["sglang:cached_tokens_total"] >= 4 and values["sglang:num_requests_total"] >= 1
    assert host.molctl("down").exit_code == ExitStatus.OK
