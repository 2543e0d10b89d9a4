"""`molctl up/switch/down/status/logs` against fake engines started as real subprocesses through
the profile's `engine.python` (a wrapper that runs tests/fake_engine.py), on free ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from molctl.errors import ExitStatus
from molctl.lifecycle.progress import SilentProgress
from molctl.profiles import builtin_profiles_dir
from tests.helpers import Molctl, url, wait_for, wait_status
from tests.lifecycle_host import PUBLIC, gone, port_free
from tests.procs import alive


def test_up_status_logs_down(host):
    r = host.up("--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = json.loads(r.stdout)
    assert result["ok"] and result["state"] == "ready" and result["endpoint"] == url(host.proxy_port) + "/v1"
    assert result["timings"]["total_s"] < 30
    # the public endpoint works with the openai SDK
    client = openai.OpenAI(base_url=result["endpoint"], api_key="none", max_retries=0)
    assert client.chat.completions.create(model=PUBLIC, messages=[{"role": "user", "content": "[route:L2] hi"}]).choices
    # status
    s = host.molctl("status", "--json")
    assert s.exit_code == ExitStatus.OK
    (stack,) = json.loads(s.stdout)["stacks"]
    assert stack["profile"] == "tiny" and stack["state"] == "ready" and stack["adapters"] == "ok"
    comps = {c["name"]: c for c in stack["components"]}
    assert set(comps) == {"engine", "proxy"}
    assert all(c["alive"] and c["health"] == 200 for c in comps.values())
    assert comps["engine"]["port"] == host.engine_port and Path(comps["engine"]["log"]).is_file()
    human = host.molctl("status")
    assert "ready" in human.stdout and "engine" in human.stdout
    # logs
    logs = host.molctl("logs", "tiny", "-n", "5")
    assert "[engine] " in logs.stdout and "[proxy] " in logs.stdout
    assert "Application startup complete" in host.molctl("logs", "--component", "engine", "-n", "200").stdout
    # down
    pids = host.stack_pids()
    assert len(pids) >= 2
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone(pids) and port_free(host.engine_port) and port_free(host.proxy_port)
    assert host.records() == {}
    assert json.loads(host.molctl("status", "tiny", "--json").stdout)["stacks"][0]["state"] == "stopped"
    again = host.molctl("down")
    assert again.exit_code == ExitStatus.OK and "nothing is running" in again.stdout


def test_up_is_idempotent(host):
    assert host.up().exit_code == ExitStatus.OK
    pids = host.stack_pids()
    r = host.up("--json")
    assert r.exit_code == ExitStatus.OK and json.loads(r.stdout)["already_running"] is True
    assert host.stack_pids() == pids


def test_engine_exits_during_startup(host):
    r = host.up(env={"FAKE_EXIT": "3", "FAKE_STARTUP_DELAY": "0.5"})
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "exited with code 3" in r.stderr and "CUDA out of memory (simulated)" in r.stderr
    assert host.records() == {} and port_free(host.engine_port)


def test_engine_never_healthy_times_out(host):
    r = host.up("--timeout", "2", env={"FAKE_STARTUP_DELAY": "60"})
    assert r.exit_code == ExitStatus.TIMEOUT, r.stderr
    assert "not ready within 2 s" in r.stderr
    assert host.records() == {}
    time.sleep(0.2)
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if str(host.engine_port) in " ".join(p.info["cmdline"] or [])
    ]


def test_an_engine_that_times_out_is_stopped_within_the_stop_timeout(host):
    """An engine that ignores SIGTERM after `up` gave up waiting was killed after a fixed 60 s,
    not after `--stop-timeout` (the lifecycle review)."""
    r = host.molctl(
        "up",
        "tiny",
        *host.args("--timeout", "2", "--stop-timeout", "1", env={"FAKE_STARTUP_DELAY": "60", "FAKE_IGNORE_TERM": "1"}),
        timeout=40,
    )
    assert r.exit_code == ExitStatus.TIMEOUT, r.stderr
    assert host.records() == {} and port_free(host.engine_port)


def test_models_missing_l3(host):
    r = host.up(env={"FAKE_ADAPTERS": "L0,L1,L2"})
    assert r.exit_code == ExitStatus.ADAPTERS, r.stderr
    assert "adapter L3 is missing" in r.stderr
    assert host.records() == {} and port_free(host.engine_port)


def test_adapter_with_wrong_parent(host):
    r = host.up(env={"FAKE_PARENT": "some-other-base"})
    assert r.exit_code == ExitStatus.ADAPTERS
    assert "parent 'some-other-base', expected 'tiny-mol-base'" in r.stderr


def test_proxy_fails_to_start(host):
    with socket.socket() as sock:  # hold the proxy port, and skip the port check so the proxy itself fails
        sock.bind(("127.0.0.1", host.proxy_port))
        sock.listen()
        r = host.up("--skip", "port")
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr
    assert "proxy exited" in r.stderr
    assert host.records() == {} and port_free(host.engine_port)


def test_port_held_by_foreign_listener(host):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", host.engine_port))
        sock.listen()
        r = host.up()
    assert r.exit_code == ExitStatus.CONFLICT, r.stderr
    assert f"pid {os.getpid()}" in r.stderr and str(host.engine_port) in r.stderr
    assert host.records() == {}


def test_record_with_reused_pid_is_never_signalled(host):
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        rec_dir = host.state / "tiny"
        host.state.mkdir(mode=0o700)
        rec_dir.mkdir(mode=0o700)
        from molctl import procid

        (rec_dir / "engine.json").write_text(
            json.dumps(
                {
                    "component": "engine",
                    "pid": stranger.pid,
                    "pgid": stranger.pid,
                    "create_time": 1000.0,
                    "argv": ["vllm"],
                    "port": host.engine_port,
                    "log": "/nonexistent",
                    "started_at": 1000.0,
                    "start_ticks": procid.start_ticks(stranger.pid) - 100,
                    "boot_id": procid.boot_id(),
                    "record_id": "r1",
                }
            )
        )
        s = json.loads(host.molctl("status", "--json").stdout)
        assert s["stacks"][0]["state"] == "failed"
        r = host.up()
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert stranger.poll() is None  # never signalled
        d = host.molctl("down")
        assert d.exit_code == ExitStatus.OK and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_two_concurrent_ups(host):
    # the engine loads until the test opens the gate: with a fixed delay the second `up` (a new
    # interpreter) could reach the lock after the first had finished, and exit 0 "already running"
    gate = host.tmp / "loaded"
    first = host.start("up", "tiny", *host.args(env={"FAKE_STARTUP_GATE": str(gate)}))
    try:
        assert wait_for(lambda: (host.state / "tiny" / "engine.json").exists(), 30)
        r = host.up()
        assert r.exit_code == ExitStatus.CONFLICT, r.stderr
        assert "state lock" in r.stderr and f"pid {first.pid}" in r.stderr and "up tiny" in r.stderr
        assert f"`kill {first.pid}` (SIGTERM: it stops what it started)" in r.stderr  # how to stop the holder
    finally:
        gate.touch()
    assert wait_status(first, 60) == ExitStatus.OK


def test_sigint_during_readiness_wait(host):
    proc = host.start("up", "tiny", *host.args(env={"FAKE_STARTUP_DELAY": "60"}))
    deadline = time.monotonic() + 10
    while not (host.state / "tiny" / "engine.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = host.stack_pids()
    assert pids
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert wait_status(proc, 30) == ExitStatus.INTERRUPTED
    assert gone(pids) and host.records() == {}


def test_engine_ignoring_sigterm_is_killed(host):
    assert host.up(env={"FAKE_IGNORE_TERM": "1"}).exit_code == ExitStatus.OK
    pids = host.stack_pids()
    t0 = time.monotonic()
    d = host.molctl("down", "--stop-timeout", "1")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "SIGKILL" in d.stdout
    assert time.monotonic() - t0 < 20
    assert gone(pids) and host.records() == {}


def test_down_waits_for_an_inflight_stream(host):
    assert host.up(env={"FAKE_ANSWER_DELAY": "2"}).exit_code == ExitStatus.OK
    client = openai.OpenAI(base_url=url(host.proxy_port) + "/v1", api_key="none", max_retries=0, timeout=30)
    result = {}

    def consume():
        stream = client.chat.completions.create(
            model=PUBLIC, stream=True, messages=[{"role": "user", "content": "[route:L1] go"}]
        )
        result["content"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.8)
    d = host.molctl("down", "--drain-timeout", "20")
    t.join(20)
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert result.get("content", "").startswith("answer-")


def test_leftover_children_after_the_leader_died(host):
    assert host.up(env={"FAKE_CHILD": "1"}).exit_code == ExitStatus.OK
    record = host.records()["engine"]
    children = [p.pid for p in psutil.Process(record.pid).children(recursive=True)]
    assert children
    os.kill(record.pid, signal.SIGKILL)  # the orphaned-workers case
    time.sleep(0.3)
    assert all(psutil.pid_exists(c) for c in children)
    status = json.loads(host.molctl("status", "--json").stdout)["stacks"][0]
    assert status["state"] == "degraded"
    r = host.up(env={"FAKE_CHILD": "1"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "leftover" in r.stdout
    assert gone(children)
    assert host.molctl("down").exit_code == ExitStatus.OK


def test_up_refuses_while_another_profile_runs_and_switch(host):
    other = (
        (builtin_profiles_dir() / "tiny.yaml")
        .read_text()
        .replace("name: tiny", "name: tiny-b")
        .replace("served_model_name: Macaron-Tiny-Demo", "served_model_name: Macaron-Tiny-B")
    )
    (host.profiles / "tiny-b.yaml").write_text(other)
    assert host.up().exit_code == ExitStatus.OK
    old = host.stack_pids()
    r = host.up(profile="tiny-b")
    assert r.exit_code == ExitStatus.CONFLICT and "molctl switch tiny-b" in r.stderr
    # a switch whose preflight fails stops nothing
    bad = host.molctl("switch", "tiny-b", *host.args("--model-root", str(host.tmp / "nope")))
    assert bad.exit_code == ExitStatus.CHECK_FAILED, bad.stderr
    assert host.stack_pids() == old
    r = host.molctl("switch", "tiny-b", *host.args("--json"))
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = json.loads(r.stdout)
    assert result["profile"] == "tiny-b" and result["stopped"] == ["tiny"] and "stop_s" in result["timings"]
    assert result["timings"]["total_s"] >= result["timings"]["stop_s"] + result["timings"]["engine_ready_s"]
    assert gone(old) and host.records("tiny") == {}
    client = openai.OpenAI(base_url=result["endpoint"], api_key="none", max_retries=0)
    assert client.models.list().data[0].id == "Macaron-Tiny-B"


def test_state_dir_with_bad_permissions(host):
    host.state.mkdir(mode=0o755)
    host.state.chmod(0o755)
    r = host.up()
    assert r.exit_code == ExitStatus.CHECK_FAILED
    assert "mode 0755" in r.stderr and "chmod 700" in r.stderr


def test_up_needs_a_key_decision(host):
    args = [a for a in host.args() if a != "--allow-unauthenticated"]
    r = host.molctl("up", "tiny", *args)
    assert r.exit_code == ExitStatus.USAGE and "--allow-unauthenticated" in r.stderr
    assert not host.state.exists() or host.records() == {}


def test_key_reaches_the_proxy_by_file_not_argv(host):
    key = host.tmp / "key"
    key.write_text("sk-secret-value\n")
    key.chmod(0o600)
    args = [a for a in host.args() if a != "--allow-unauthenticated"]
    r = host.molctl("up", "tiny", *args, "--api-key-file", str(key))
    assert r.exit_code == ExitStatus.OK, r.stderr
    proxy = host.records()["proxy"]
    assert "sk-secret-value" not in " ".join(psutil.Process(proxy.pid).cmdline())
    models = url(host.proxy_port) + "/v1/models"
    assert httpx.get(models).status_code == 401
    assert httpx.get(models, headers={"Authorization": "Bearer sk-secret-value"}).status_code == 200
    logs = "".join(Path(r.log).read_text() for r in host.records().values())
    assert "sk-secret-value" not in logs


def test_logs_follow_across_a_restart(host, tmp_path):
    from molctl.logs import show_logs
    from molctl.output import Output

    assert host.up().exit_code == ExitStatus.OK
    out_path = tmp_path / "followed.txt"

    class Ctx:
        state_dir = host.state

    def follow():
        with open(out_path, "w") as fh:
            # 60 s: the follower must outlast a `down` and an `up` (two subprocesses, a drain, an engine
            # and a proxy start), which on a loaded runner can pass 20 s; it is a daemon, and the
            # wait below ends the test as soon as the new log shows
            show_logs(Ctx(), "tiny", "engine", True, 2, Output(stdout=fh), poll_s=0.05, stop_after_s=60)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    # following the old log (its last 2 lines shown) before the stack stops (was a fixed 0.5 s)
    assert wait_for(lambda: out_path.exists() and out_path.read_text().strip() != "", 15)
    assert host.molctl("down").exit_code == ExitStatus.OK
    time.sleep(1.1)  # log names carry the second
    assert host.up().exit_code == ExitStatus.OK
    wait_for(lambda: "Application startup complete" in out_path.read_text().partition("==> new log")[2], 30)
    text = out_path.read_text()
    assert "==> new log" in text and "Application startup complete" in text


def test_down_keeps_the_record_while_nvml_shows_the_stack(host):
    """On GPU hosts `down` also asks NVML; a process of the stack still on a GPU keeps the record."""
    from molctl.lifecycle.stop import down
    from molctl.probes import GpuDevice, GpuInventory, GpuProcess

    assert host.up().exit_code == ExitStatus.OK
    engine_pid = host.records()["engine"].pid

    class StuckNvml:
        def inventory(self):
            return GpuInventory(
                "580", (GpuDevice(0, "H200", 141 << 30, 1 << 30, (GpuProcess(engine_pid, "VLLM::Worker", 70 << 30),)),)
            )

    class Ctx:
        state_dir = host.state

    with pytest.raises(Exception) as err:
        down(Ctx(), "tiny", 5, False, SilentProgress(), engine_timeout_s=5, gpu_probe=StuckNvml())
    assert f"GPU 0 pid {engine_pid}" in str(err.value)
    assert "engine" in host.records()  # kept: the GPU is not known to be free
    result = down(Ctx(), "tiny", 5, True, SilentProgress(), engine_timeout_s=5, gpu_probe=StuckNvml())
    assert result["stopped"][0]["profile"] == "tiny" and host.records() == {}


def test_up_waits_for_an_engine_an_earlier_killed_up_left_loading(host):
    # The engine must still be loading when the second `up` (a new interpreter) looks at it, or that
    # `up` finds the stack ready and never says "still running": 10 s of loading leaves room for the
    # kill and a slow start on a loaded runner. Both calls use the same value: another engine.env is
    # another configuration, which `up` refuses (CONFLICT).
    loading = {"FAKE_STARTUP_DELAY": "10"}
    first = host.start("up", "tiny", *host.args(env=loading))
    deadline = time.monotonic() + 10
    while "proxy" not in host.records() and time.monotonic() < deadline:
        time.sleep(0.05)
    engine_pid = host.records()["engine"].pid
    os.kill(first.pid, signal.SIGKILL)  # the terminal went away; the engine keeps loading
    first.wait(5)
    r = host.up(env=loading)
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "still running" in r.stdout
    assert host.records()["engine"].pid == engine_pid  # adopted, not restarted
    assert json.loads(host.molctl("status", "--json").stdout)["stacks"][0]["state"] == "ready"


def test_up_whose_preflight_fails_stops_nothing(host):
    """A live proxy whose engine died, and a stranger now listening on the engine port: `up` used to
    stop the proxy first and only then find the port taken ("nothing was started", with the proxy
    gone). The preflight now runs before anything recorded is stopped, as `switch`'s does: exit 4,
    the proxy left running, its own port counted as its own."""
    assert host.up().exit_code == ExitStatus.OK
    records = host.records()
    proxy_pid = records["proxy"].pid
    os.kill(records["engine"].pid, signal.SIGKILL)
    assert gone([records["engine"].pid])
    deadline = time.monotonic() + 5
    while not port_free(host.engine_port) and time.monotonic() < deadline:
        time.sleep(0.05)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the proxy's old connections in TIME_WAIT
        sock.bind(("127.0.0.1", host.engine_port))
        sock.listen()
        r = host.up()
    assert r.exit_code == ExitStatus.CONFLICT, r.stderr
    assert f"pid {os.getpid()}" in r.stderr and "nothing was started or stopped" in r.stderr
    assert alive(proxy_pid)
    assert host.records()["proxy"].pid == proxy_pid
    r = host.up()  # the port is free again: the stale stack is cleaned up and started afresh
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert gone([proxy_pid]) and host.records()["proxy"].pid != proxy_pid
    assert host.molctl("down").exit_code == ExitStatus.OK


def test_up_cleans_leftovers_whose_gpu_memory_nvml_does_not_attribute_then_checks_again(host, monkeypatch):
    """Found by the regression review of the preflight-first order: in a container without the
    host's pid namespace NVML lists host pids, so the VRAM of a stale stack's orphaned workers is
    not counted as the profile's own and gpu.memory failed ("nothing was started or stopped")
    where `up` used to clean the leftovers first. Now a preflight whose only failures are the GPU
    memory/process checks, with a stale stack recorded, cleans it and checks again."""
    from molctl import probes

    assert host.up("--set", "engine.gpus=1", env={"FAKE_CHILD": "1"}).exit_code == ExitStatus.OK  # --skip gpu
    record = host.records()["engine"]
    children = [p.pid for p in psutil.Process(record.pid).children(recursive=True)]
    assert children
    os.kill(record.pid, signal.SIGKILL)  # orphaned workers holding (in this story) the GPU
    assert gone([record.pid])
    gib = 1 << 30

    def inventory(self):  # NVML's view: a host pid, not one this molctl can see, while they run
        held = any(alive(c) for c in children)
        procs = (probes.GpuProcess(4_000_000, "python", 130 * gib),) if held else ()
        return probes.GpuInventory(
            "580.1", (probes.GpuDevice(0, "H200", 140 * gib, (10 if held else 140) * gib, procs),)
        )

    monkeypatch.setattr(probes.NvmlProbe, "inventory", inventory)
    args = host.args("--set", "engine.gpus=1", env={"FAKE_CHILD": "1"})
    i = args.index("gpu")
    del args[i - 1 : i + 1]  # this time the GPU checks run (on the NVML view above)
    inproc = Molctl(host.state, [host.profiles], in_process=True)
    r = inproc("up", "tiny", *args, "--set", "engine.gpus=1")
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    assert "cleaning them up, then checking again" in r.stdout
    assert gone(children)
    assert host.molctl("down").exit_code == ExitStatus.OK
