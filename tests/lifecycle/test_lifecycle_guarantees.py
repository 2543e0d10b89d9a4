"""What lifecycle commands guarantee about processes and records: never signal a stranger (pid
reuse, orphans, a recycled group), never call a healthy stack dead, never kill a running engine for
another configuration; records and claims that stay true through corrupt, unwritable or deleted
state, a full disk, an `up` killed between spawn and record. Fake engines run through engine.python
as in test_lifecycle.py; every process a test starts is stopped."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from molctl import procid
from molctl.errors import ExitStatus
from molctl.lifecycle.progress import SilentProgress
from molctl.profiles import builtin_profiles_dir
from tests.helpers import ROOT, Molctl, exit_status, free_port, url, wait_for, wait_status
from tests.lifecycle_host import EARLY_PROXY, Host, add_tiny_b, answers, gone
from tests.procs import alive, stop


class Ctx:
    def __init__(self, host: Host):
        self.state_dir = host.state
        self._host = host

    def dirs(self):
        from molctl.profiles import profile_dirs

        return profile_dirs([self._host.profiles])


# ------------------------------------------------------------------------------------- 1. pid reuse


def test_stranger_in_a_dead_leaders_group_is_never_signalled(host):
    """A record names a leader that died; a stranger lives on in its process group (a recycled
    pgid, e.g. after a reboot). Neither `down` nor `up` may signal it."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 120 & echo $!"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    stranger = int(leader.stdout.readline())
    leader.wait(5)
    try:
        assert (
            os.getpgid(stranger) == leader.pid
            and not psutil.pid_exists(leader.pid)
            or psutil.Process(leader.pid).status() == psutil.STATUS_ZOMBIE
        )
        record = {
            "component": "engine",
            "pid": leader.pid,
            "pgid": leader.pid,
            "create_time": psutil.Process(stranger).create_time() - 3600,
            "argv": ["vllm"],
            "port": host.engine_port,
            "log": "/nonexistent",
            "started_at": time.time() - 3600,
        }
        (host.state / "tiny").mkdir(mode=0o700, parents=True)
        host.state.chmod(0o700)
        (host.state / "tiny" / "engine.json").write_text(json.dumps(record))
        d = host.molctl("down")
        assert d.exit_code == ExitStatus.OK, d.stderr
        assert alive(stranger)
        (host.state / "tiny" / "engine.json").write_text(json.dumps(record))
        r = host.up()
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert alive(stranger)
        assert host.molctl("down").exit_code == ExitStatus.OK
        assert alive(stranger)
    finally:
        os.kill(stranger, signal.SIGKILL)


def test_a_marked_orphan_is_found_without_its_leader(host):
    """The other side of item 1: workers left behind by a SIGKILLed leader carry the marker and are
    stopped, also when they left the group."""
    assert host.up(env={"FAKE_CHILD": "1"}).exit_code == ExitStatus.OK
    record = host.records()["engine"]
    (child,) = psutil.Process(record.pid).children()
    assert procid.environ_of(child.pid)[procid.MARKER_ID] == record.record_id
    os.kill(record.pid, signal.SIGKILL)
    assert gone([record.pid])
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone([child.pid]) and host.records() == {}


def test_a_retitled_orphan_is_found_by_its_working_directory(host):
    """vLLM's EngineCore renames itself with setproctitle, which wipes what /proc/PID/environ
    shows: the environment marker is gone, the run-dir marker (its working directory) is not."""
    assert host.up(env={"FAKE_CHILD": "retitle"}).exit_code == ExitStatus.OK
    record = host.records()["engine"]
    (child,) = psutil.Process(record.pid).children()
    assert wait_for(lambda: "VLLM::EngineCore" in " ".join(child.cmdline()))
    assert procid.MARKER_ID not in (procid.environ_of(child.pid) or {})
    assert child.cwd() == str(procid.run_dir(os.path.realpath(host.state / "tiny" / "engine.json"), record.record_id))
    os.kill(record.pid, signal.SIGKILL)
    assert gone([record.pid])
    assert host.molctl("status", "--json").json()["stacks"][0]["state"] != "failed"
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone([child.pid]) and host.records() == {}
    assert not (host.state / "tiny" / "engine.run").exists()


def test_an_orphan_whose_environment_was_only_partly_overwritten_is_found(host):
    """vLLM 0.32's EngineCore, renamed with setproctitle, showed 14 leftover environment entries
    (not none) and no marker in test_e2e's SIGKILL test: taken for an operator's process in the run
    dir and left running, holding its memory, by `up` and `down`. Its process group and session
    (the component's) say it is ours."""
    assert host.up(env={"FAKE_CHILD": "retitle-partial"}).exit_code == ExitStatus.OK
    record = host.records()["engine"]
    (child,) = psutil.Process(record.pid).children()
    assert procid.environ_of(child.pid) == {"LEFTOVER": "tail"}
    os.kill(record.pid, signal.SIGKILL)
    assert gone([record.pid])
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone([child.pid]) and host.records() == {}


# ------------------------------------------------------------------------------------ 2. clock steps


def test_a_wall_clock_step_does_not_make_a_healthy_stack_look_dead(host, monkeypatch):
    from molctl.lifecycle.status import status
    from molctl.lifecycle.stop import down
    from molctl.state import is_same_process

    assert host.up().exit_code == ExitStatus.OK
    records = host.records()
    pids = host.stack_pids()
    # the wall clock jumps one hour ahead: psutil's create_time (boot time + ticks) moves with it
    real_create, real_boot = psutil.Process.create_time, psutil.boot_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real_create(self) + 3600)
    monkeypatch.setattr(psutil, "boot_time", lambda: real_boot() + 3600)
    assert psutil.Process(records["engine"].pid).create_time() != records["engine"].create_time
    assert all(is_same_process(r) for r in records.values())
    (stack,) = status(Ctx(host), None, gpu_probe=_NoGpu())["stacks"]
    assert stack["state"] == "ready", stack
    result = down(Ctx(host), "tiny", 10, False, SilentProgress(), engine_timeout_s=10, gpu_probe=_NoGpu())
    assert result["stopped"][0]["components"] == {"proxy": "stopped", "engine": "stopped"}
    assert gone(pids) and host.records() == {}


class _NoGpu:
    def inventory(self):
        from molctl.probes import GpuUnavailable

        raise GpuUnavailable("no NVML in tests")


def test_a_record_is_kept_while_its_process_cannot_be_verified(host):
    """A record of an older molctl (no start ticks) whose pid runs with another create time may be
    a clock step: it is neither signalled nor dropped without --force."""
    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        (host.state / "tiny").mkdir(mode=0o700, parents=True)
        host.state.chmod(0o700)
        (host.state / "tiny" / "engine.json").write_text(
            json.dumps(
                {
                    "component": "engine",
                    "pid": sleeper.pid,
                    "pgid": sleeper.pid,
                    "create_time": 1000.0,
                    "argv": ["vllm"],
                    "port": host.engine_port,
                    "log": "/nonexistent",
                    "started_at": 1000.0,
                }
            )
        )
        d = host.molctl("down")
        assert d.exit_code == ExitStatus.OK and "cannot be verified" in d.stderr
        assert sleeper.poll() is None and "engine" in host.records()
        assert host.molctl("down", "--force").exit_code == ExitStatus.OK
        assert sleeper.poll() is None and host.records() == {}
    finally:
        stop(sleeper)


# ---------------------------------------------------------------------- 3. records describe the stack


def test_up_with_another_configuration_refuses_instead_of_killing_the_engine(host):
    assert host.up().exit_code == ExitStatus.OK
    engine_pid = host.records()["engine"].pid
    other = host.molctl("up", "tiny", *host.args("--timeout", "5"), "--set", "proxy.max_output_tokens=100")
    assert other.exit_code == ExitStatus.CONFLICT, other.stderr
    assert "different configuration" in other.stderr and "proxy.max_output_tokens 256 -> 100" in other.stderr
    assert "--restart" in other.stderr and "molctl down tiny" in other.stderr
    moved = host.molctl("up", "tiny", *host.args("--timeout", "5", engine_port=_other_port(host)))
    assert moved.exit_code == ExitStatus.CONFLICT, moved.stderr
    assert host.records()["engine"].pid == engine_pid and alive(engine_pid)
    # the same configuration is a no-op
    same = host.up("--json")
    assert same.exit_code == ExitStatus.OK and json.loads(same.stdout)["already_running"] is True
    # --restart applies the new one
    r = host.molctl(
        "up", "tiny", *host.args("--restart", "--stop-timeout", "5"), "--set", "proxy.max_output_tokens=100"
    )
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert not alive(engine_pid) and host.records()["engine"].pid != engine_pid
    assert host.records()["engine"].config["data"]["proxy"]["max_output_tokens"] == 100


def _other_port(host: Host) -> int:
    port = free_port()
    while port in (host.engine_port, host.proxy_port):
        port = free_port()
    return port


def test_status_uses_the_recorded_configuration(host):
    r = host.molctl("up", "tiny", *host.args(), "--set", "engine.served_name=custom-base")
    assert r.exit_code == ExitStatus.OK, r.stderr
    (stack,) = json.loads(host.molctl("status", "--json").stdout)["stacks"]
    assert stack["state"] == "ready" and stack["adapters"] == "ok", stack
    # the profile file changes meanwhile: status still describes what runs
    (host.profiles / "tiny.yaml").write_text(
        (builtin_profiles_dir() / "tiny.yaml").read_text().replace("served_name: tiny-mol-base", "served_name: edited")
    )
    (stack,) = json.loads(host.molctl("status", "--json").stdout)["stacks"]
    assert stack["state"] == "ready" and stack["adapters"] == "ok", stack


def test_set_values_reach_the_proxy_as_typed_data_and_logs_are_pruned(host):
    logs = host.state / "tiny" / "logs"
    logs.mkdir(parents=True)
    host.state.chmod(0o700)
    (host.state / "tiny").chmod(0o700)
    for i in range(5):
        old = logs / f"engine-2020010{i}-000000.log"
        old.write_text("old\n")
        os.utime(old, (1_600_000_000 + i, 1_600_000_000 + i))
    r = host.molctl("up", "tiny", *host.args(), "--set", 'served_model_name="2024"', "--set", "logs.keep=2")
    assert r.exit_code == ExitStatus.OK, r.stderr
    models = httpx.get(url(host.proxy_port) + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["2024"]
    engine_logs = sorted(p.name for p in logs.glob("engine-*.log"))
    assert len(engine_logs) == 2 and "engine-20200104-000000.log" in engine_logs


# ------------------------------------------------------------------------------- 4. switch and its lock


def test_switch_holds_the_lock_throughout_and_a_failed_switch_says_how_to_go_back(host):
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    old = host.stack_pids()
    # tiny-b's engine loads until the test opens the gate: a fixed delay raced with the blocked `up`
    # below (a new interpreter, the CLI's imports, the profile), which on a loaded runner could reach
    # the lock after the switch had finished ("profile tiny-b is running", not "switch tiny-b")
    gate = host.tmp / "tiny-b-loaded"
    proc = host.start("switch", "tiny-b", *host.args("--stop-timeout", "5", env={"FAKE_STARTUP_GATE": str(gate)}))
    from molctl.state import lock_holder

    try:
        assert wait_for(lambda: "engine" in host.records("tiny-b"))
        holder = lock_holder(host.state)
        assert (holder.action, holder.profile) == ("switch", "tiny-b")  # not a second, separate `up tiny-b`
        blocked = host.up()
        assert blocked.exit_code == ExitStatus.CONFLICT and "switch tiny-b" in blocked.stderr
    finally:
        gate.touch()
    assert wait_status(proc, 60) == ExitStatus.OK, proc.stderr.read()
    assert gone(old)
    # logs without a profile: the running stack (tiny-b), not exit 2
    logs = host.molctl("logs", "-n", "3", "--component", "engine")
    assert logs.exit_code == ExitStatus.OK, logs.stderr
    assert "[engine]" in logs.stdout
    # a failing switch back: it says the old stack was stopped and how to bring it back
    bad = host.molctl("switch", "tiny", *host.args("--stop-timeout", "5", env={"FAKE_EXIT": "3"}))
    assert bad.exit_code == ExitStatus.START_FAILED, bad.stderr
    m = re.search(r"the old stack tiny-b was stopped: bring it back with `([^`]+)`", bad.stderr)
    assert m, bad.stderr
    argv = shlex.split(m.group(1))
    assert argv[0] == "molctl"
    back = Molctl(None)(*argv[1:])  # the printed command, verbatim
    assert back.exit_code == ExitStatus.OK, back.stderr
    assert json.loads(host.molctl("status", "tiny-b", "--json").stdout)["stacks"][0]["state"] == "ready"


# --------------------------------------------------------------------------- 5. host-wide port claims


def test_two_ups_from_two_state_dirs_race_for_the_same_ports(host, tmp_path):
    (tmp_path / "b").mkdir()
    other = Host(tmp_path / "b")
    other.engine_port, other.proxy_port = host.engine_port, host.proxy_port
    env = {"FAKE_STARTUP_DELAY": "1"}
    procs = [h.start("up", "tiny", *h.args(env=env)) for h in (host, other)]
    try:
        codes = [wait_status(p, 90) for p in procs]
        errs = [p.stderr.read() for p in procs]
        assert sorted(codes) == [ExitStatus.OK, ExitStatus.CONFLICT], (codes, errs)
        winner, loser = (host, other) if codes[0] == ExitStatus.OK else (other, host)
        err = errs[codes.index(ExitStatus.CONFLICT)]
        assert str(winner.state.absolute()) in err and "claimed by" in err, err
        assert f"--state-dir {winner.state.absolute()} down tiny" in err
        assert loser.records() == {}
        # check names the holder too
        args = loser.args()
        args = [a for a in args if a != "--allow-unauthenticated"]
        del args[args.index("--timeout") : args.index("--timeout") + 2]
        c = loser.molctl("check", "tiny", *args)
        assert (
            c.exit_code == ExitStatus.CHECK_FAILED
            and "claimed by" in c.stdout
            and str(winner.state.absolute()) in c.stdout
        )
    finally:
        for p in procs:
            stop(p)
        other.cleanup()


def test_claims_are_held_by_the_components_and_freed_on_exit(host, host_lock_dir):
    from molctl.claims import HostClaims

    assert host.up().exit_code == ExitStatus.OK
    locks = HostClaims(host_lock_dir)
    engine, proxy = host.records()["engine"], host.records()["proxy"]
    assert locks.holder("port", host.engine_port).pid == engine.pid
    assert locks.holder("port", host.proxy_port).pid == proxy.pid
    os.kill(proxy.pid, signal.SIGKILL)
    assert wait_for(lambda: locks.holder("port", host.proxy_port) is None)
    assert locks.holder("port", host.engine_port) is not None
    assert host.molctl("down").exit_code == ExitStatus.OK
    assert locks.holder("port", host.engine_port) is None


def test_gpu_claims_name_their_holder(tmp_path, host_lock_dir):
    from molctl.checks.host import run_gpu_claims
    from molctl.checks.result import Probes
    from molctl.claims import HostClaims, holder_info
    from molctl.profiles import load_profile, profile_dirs

    tall = load_profile("tall", profile_dirs())
    claim = HostClaims(host_lock_dir).acquire("gpu", 3, holder_info("venti", "engine", tmp_path / "other"))
    try:
        (result,) = run_gpu_claims(tall, Probes(state_dir=tmp_path / "mine", environ={}))
        assert result.status == "fail" and "GPU 3 is claimed by" in result.detail and "profile venti" in result.detail
        (result,) = run_gpu_claims(
            tall, Probes(state_dir=tmp_path / "other", environ={}, own_profiles=frozenset({"venti"}))
        )
        assert result.status == "pass"
    finally:
        claim.release()
    (result,) = run_gpu_claims(tall, Probes(state_dir=tmp_path / "mine", environ={}))
    assert result.status == "pass"


# ------------------------------------------------------------------------------------------ honesty


def test_a_corrupt_record_is_reported_and_refused_without_force(host):
    assert host.up().exit_code == ExitStatus.OK
    engine = host.records()["engine"]
    (host.state / "tiny" / "engine.json").write_text("{not json")
    (stack,) = json.loads(host.molctl("status", "--json").stdout)["stacks"]
    assert stack["state"] == "degraded" and "unreadable" in stack["problems"][0], stack
    d = host.molctl("down")
    assert d.exit_code == ExitStatus.CONFLICT and "unreadable" in d.stderr and f"pid {engine.pid}" in d.stderr, d.stderr
    assert alive(engine.pid)
    u = host.up()
    assert u.exit_code == ExitStatus.CONFLICT and "--force" in u.stderr
    f = host.molctl("down", "--force")
    assert f.exit_code == ExitStatus.OK, f.stderr
    assert gone([engine.pid]) and not (host.state / "tiny" / "engine.json").exists()


def test_a_record_of_garbage_bytes_or_wrong_types_is_unreadable_not_a_traceback(host):
    """Non-UTF-8 bytes made status, up and down raise UnicodeDecodeError (exit 1); `"port": "x"`
    made status and up raise httpx.InvalidURL; `"start_ticks": "x"` made up stop the live stack
    and start another. Each is an unreadable record: status says so, down and up refuse (exit 4)."""
    assert host.up().exit_code == ExitStatus.OK
    engine, proxy = host.records()["engine"], host.records()["proxy"]
    path = host.state / "tiny" / "engine.json"
    good = json.loads(path.read_text())
    for content in (b"\xff\xfe{", *(json.dumps({**good, key: "x"}).encode() for key in ("port", "start_ticks"))):
        path.write_bytes(content)
        (stack,) = json.loads(host.molctl("status", "--json").stdout)["stacks"]
        assert "unreadable" in stack["problems"][0], (content, stack)
        for r in (host.molctl("down"), host.up()):
            assert r.exit_code == ExitStatus.CONFLICT and "unreadable" in r.stderr and "Traceback" not in r.stderr, (
                r.stderr
            )
        assert alive(engine.pid) and alive(proxy.pid)
    f = host.molctl("down", "--force")
    assert f.exit_code == ExitStatus.OK, f.stderr
    assert gone([engine.pid, proxy.pid]) and not path.exists()


def _in_process(host: Host) -> Molctl:
    """The CLI in this process, so that a failure can be injected into it (monkeypatch)."""
    return Molctl(host.state, [host.profiles], in_process=True)


def test_a_record_that_cannot_be_written_stops_the_component(host, monkeypatch):
    """The disk is full (or the dir immutable) when the engine's record is written, right after
    the spawn: the engine is stopped at once, and the error is one line, exit 1."""
    import molctl.lifecycle.starter

    profile_dir = host.state / "tiny"
    (profile_dir / "logs").mkdir(parents=True)
    for d in (host.state, profile_dir):
        d.chmod(0o700)
    spawned = []
    real_spawn = molctl.lifecycle.starter.spawn

    def spawn(*args, **kwargs):
        spawned.append(real_spawn(*args, **kwargs))
        return spawned[-1]

    def write_record(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(molctl.lifecycle.starter, "spawn", spawn)
    monkeypatch.setattr(molctl.lifecycle.starter, "write_record", write_record)
    r = _in_process(host)("up", "tiny", *host.args())
    assert r.exit_code == ExitStatus.ERROR, r.stderr
    assert "could not write the engine record" in r.stderr and "No space left on device" in r.stderr
    assert "was stopped" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (engine,) = spawned  # the proxy was never started
    assert engine.poll() is not None and gone([engine.pid])
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if f"--port {host.engine_port}" in " ".join(p.info["cmdline"] or [])
    ]
    assert host.records() == {}


def test_a_read_only_state_dir_gives_one_line_and_down_still_stops(host, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad = host.molctl("--state-dir", str(blocker / "state"), "up", "tiny", *host.args())
    assert bad.exit_code == ExitStatus.ERROR and "Traceback" not in bad.stderr and "not usable" in bad.stderr, (
        bad.stderr
    )
    assert host.up().exit_code == ExitStatus.OK
    pids = host.stack_pids()
    # the profile's dir turns read-only (a remount, an immutable flag): its records cannot be removed
    records = (host.state / "tiny").resolve()
    real_unlink = Path.unlink

    def unlink(self, *args, **kwargs):
        if self.resolve().parent == records:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_unlink(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "unlink", unlink)
        d = _in_process(host)("down")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "Traceback" not in d.stderr and "could not remove" in d.stderr and "Read-only file system" in d.stderr
    assert gone(pids)


def test_a_proxy_that_dies_while_the_engine_loads_is_restarted(host):
    proc = host.start("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "3"}))
    assert wait_for(lambda: "proxy" in host.records())
    engine_pid, proxy_pid = host.records()["engine"].pid, host.records()["proxy"].pid
    os.kill(proxy_pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=90)
    assert exit_status(proc.returncode) == ExitStatus.OK, err
    assert "restarting it (1 of 3)" in out
    assert host.records()["engine"].pid == engine_pid and host.records()["proxy"].pid != proxy_pid


def test_unknown_profile_names_are_errors(host):
    for cmd in ("down", "status"):
        r = host.molctl(cmd, "tinny")
        assert (
            r.exit_code == ExitStatus.CHECK_FAILED
            and "no profile named 'tinny'" in r.stderr
            and "tiny" in r.stderr.split("known:")[1]
        )


def test_a_second_ctrl_c_during_clean_up_says_what_may_still_run(host):
    from molctl.lifecycle.stacks import component_url

    proc = host.start("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "60", "FAKE_IGNORE_TERM": "1"}))
    assert wait_for(lambda: "proxy" in host.records())
    proxy = host.records()["proxy"]
    # the proxy serving: `up` is past recording it (a Ctrl-C in that window has its own path: the
    # fresh process is stopped where it was spawned, which is not what this test is about)
    assert wait_for(lambda: answers(component_url(proxy) + "/health"), timeout=30)
    proc.send_signal(signal.SIGINT)
    if not wait_for(lambda: not alive(proxy.pid)):  # the clean-up stops the proxy first, then waits on the engine
        proc.kill()
        out, err = proc.communicate(timeout=30)
        pytest.fail(
            f"the proxy (pid {proxy.pid}) still runs 15 s after up's Ctrl-C; up's output:\n{out}\n{err}\n"
            f"the proxy's log:\n{Path(proxy.log).read_text()[-2000:]}"
        )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert exit_status(proc.returncode) == ExitStatus.INTERRUPTED, err
    assert "may keep its GPUs" in err and "molctl down tiny" in err and "engine (pid" in err, err


def test_option_checks_help_and_logs(host):
    for value in ("0", "-5"):
        r = host.molctl("up", "tiny", *host.args(), "--timeout", value)
        assert r.exit_code == ExitStatus.USAGE, r.stderr
    helptext = host.molctl("--help").stdout
    assert "Exit codes" in helptext and "130 interrupted" in helptext
    # a failed preflight shows only failures and warnings; --json carries every check
    r = host.molctl("up", "tiny", *host.args("--model-root", str(host.tmp / "nope")))
    assert r.exit_code == ExitStatus.CHECK_FAILED and "FAIL" in r.stdout and "PASS" not in r.stdout, r.stdout
    j = host.molctl("up", "tiny", *host.args("--model-root", str(host.tmp / "nope"), "--json"))
    data = json.loads(j.stdout)
    assert j.exit_code == ExitStatus.CHECK_FAILED and {c["status"] for c in data["checks"]} >= {"pass", "fail"}
    assert host.up().exit_code == ExitStatus.OK
    assert host.molctl("logs", "tiny", "-n", "0").stdout == ""
    # Ctrl-C ends `logs -f` quietly
    follow = host.start("logs", "-f", "-n", "1")
    assert follow.stdout.readline().startswith("[")
    follow.send_signal(signal.SIGINT)
    _, err = follow.communicate(timeout=10)
    assert exit_status(follow.returncode) == ExitStatus.INTERRUPTED and err == ""


def test_down_counts_down_to_sigkill(host):
    assert host.up(env={"FAKE_IGNORE_TERM": "1"}).exit_code == ExitStatus.OK
    d = host.molctl("down", "--stop-timeout", "3")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "SIGKILL in 2 s" in d.stdout or "SIGKILL in 1 s" in d.stdout, d.stdout
    assert "sending SIGKILL" in d.stdout


# ------------------------------------------------------------------- a molctl killed between spawn and record


def _up_killed_before_the_record_of(host: Host, component: str) -> list[int]:
    """`up`, SIGKILLed right after spawning `component` and before writing its record; the pids
    left running that carry that component's marker."""
    argv = [sys.executable, str(ROOT / "tests" / "kill_at.py"), *host.cli.argv("up", "tiny", *host.args())]
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=90,
        env={**os.environ, "KILL_AT": f"before_record:{component}"},
    )
    assert r.returncode == -signal.SIGKILL, r.stderr
    path = os.path.realpath(host.state / "tiny" / f"{component}.json")
    orphans = [pid for pid, p, _rid in procid.marked_processes() if p == path]
    assert orphans and component not in host.records()
    return orphans


@pytest.mark.parametrize("component", ["engine", "proxy"])
def test_down_profile_stops_what_an_up_killed_before_recording_it_spawned(host, component):
    """Found by SIGKILLing `up` after each spawn: `down tiny` said "nothing is running" (engine)
    or stopped only the recorded engine (proxy), leaving the unrecorded process running with its
    ports and claims (`up` then refused: port held); only `down` without a profile found it."""
    orphans = _up_killed_before_the_record_of(host, component)
    d = host.molctl("down", "tiny", "--stop-timeout", "2", "--drain-timeout", "2")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert "nothing is running" not in d.stdout
    assert gone(orphans) and host.records() == {}


@pytest.mark.parametrize("component", ["engine", "proxy"])
def test_up_stops_what_an_up_killed_before_recording_it_spawned(host, component):
    orphans = _up_killed_before_the_record_of(host, component)
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert gone(orphans)
    assert set(host.records()) == {"engine", "proxy"}


def test_a_huge_log_line_gives_a_bounded_log_tail(host):
    """Found with an engine that prints one 8 MB line and exits: `up` wrote all of it to stderr
    (its log tail read the whole line, on every readiness poll too). Now at most TAIL_LINE_MAX
    bytes of a line (its end) are kept, and the lines after it still show."""
    from molctl.processes import tail

    noisy = host.tmp / "noisy-python"
    noisy.write_text(
        "#!/bin/sh\nhead -c 8000000 /dev/zero | tr '\\0' x\necho\necho 'RuntimeError: the real cause'\nexit 3\n"
    )
    noisy.chmod(0o755)
    host.python = noisy
    r = host.up()
    assert r.exit_code == ExitStatus.START_FAILED, r.stderr[-500:]
    assert "RuntimeError: the real cause" in r.stderr and len(r.stderr) < 100_000
    assert host.records() == {}
    log = host.tmp / "one-line.log"
    log.write_bytes(b"y" * 3_000_000)
    (line,) = tail(log, 80)
    assert line.startswith("...") and line.endswith("yyy") and len(line) < 10_000


@pytest.mark.parametrize("component", ["engine", "proxy"])
def test_status_shows_what_an_up_killed_before_recording_it_spawned(host, component):
    """`status` said no stack was recorded (engine) or showed only the recorded engine (proxy)
    while the unrecorded process ran with its ports."""
    orphans = _up_killed_before_the_record_of(host, component)
    (stack,) = host.molctl("status", "--json").json()["stacks"]
    assert stack["profile"] == "tiny" and stack["state"] == "degraded"
    assert any(
        f"the {component}'s marker" in p and str(orphans[0]) in p and "molctl down tiny" in p for p in stack["problems"]
    ), stack
    assert host.molctl("status", "tiny", "--json").json()["stacks"][0]["state"] == "degraded"


def test_a_process_that_only_works_in_the_run_dir_is_never_signalled(host):
    """Found by starting a shell in the engine's run dir (an operator looking around) and running
    `down`: the shell was taken for a retitled engine child by its working directory and got
    SIGTERM. A process showing an environment without the marker is not ours."""
    assert host.up().exit_code == ExitStatus.OK
    record = host.records()["engine"]
    run = procid.run_dir(os.path.realpath(host.state / "tiny" / "engine.json"), record.record_id)
    shell = subprocess.Popen(
        ["sleep", "120"], cwd=run, start_new_session=True, env={"PATH": os.environ["PATH"], "HOME": str(host.tmp)}
    )
    try:
        assert wait_for(lambda: os.readlink(f"/proc/{shell.pid}/cwd") == str(run))
        assert shell.pid not in host.stack_pids()
        d = host.molctl("down", "--stop-timeout", "2", "--drain-timeout", "2")
        assert d.exit_code == ExitStatus.OK, d.stderr
        assert shell.poll() is None and host.records() == {}
    finally:
        stop(shell)


def test_down_on_a_full_disk_still_stops_the_stack(host, monkeypatch):
    """Found with the state dir on a full tmpfs: `down` failed with "No space left on device"
    (writing its name into the state lock file) and stopped nothing. The holder's name is
    best-effort: the lock is held all the same."""
    assert host.up().exit_code == ExitStatus.OK
    pids = host.stack_pids()
    import molctl.state

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(molctl.state.os, "pwrite", pwrite)
        d = _in_process(host)("down", "--stop-timeout", "2", "--drain-timeout", "2")
    assert d.exit_code == ExitStatus.OK, d.stderr
    assert gone(pids) and host.records() == {}


def test_a_record_write_that_fails_leaves_no_half_written_file(tmp_path, monkeypatch):
    """Found with the state dir on a full tmpfs: the failed write left `engine.json.tmp` behind."""
    import molctl.state
    from molctl.state import Record, write_record

    record = Record("engine", 1, 1, 0.0, [], 1, "log", 0.0)

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(molctl.state.os, "fsync", fsync)
    with pytest.raises(OSError):
        write_record(tmp_path, "tiny", record)
    assert list((tmp_path / "tiny").iterdir()) == []


def test_a_switch_failing_on_a_file_error_still_says_how_to_go_back(host):
    """Found making the new profile's log dir unusable (a file named `logs`): the old stack was
    stopped, and the error (`File exists`, exit 1) did not say so nor how to bring it back."""
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    (host.state / "tiny-b").mkdir(mode=0o700)
    (host.state / "tiny-b" / "logs").write_text("not a directory")
    bad = host.molctl("switch", "tiny-b", *host.args("--stop-timeout", "5"))
    assert bad.exit_code == ExitStatus.ERROR, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "logs" in bad.stderr
    assert "the old stack tiny was stopped: bring it back with `molctl" in bad.stderr, bad.stderr
    assert host.records("tiny-b") == {} and host.records("tiny") == {}


# ------------------------------------------------------------------ the state dir deleted under a stack


@pytest.fixture
def deleted_state_stack(host):
    """A running stack (its engine with a child, as vLLM's EngineCore) whose state dir is then
    deleted (`rm -rf $MOLCTL_STATE_DIR`: an operator "resetting" molctl). Yields the processes;
    whatever of them is still running at the end is SIGKILLed (the host's own cleanup runs `down`
    only where the state dir exists)."""
    procs = _up_and_delete_state(host, "tiny")
    try:
        yield procs
    finally:
        _kill_left(procs)


def _up_and_delete_state(host: Host, profile: str, *extra: str) -> list[psutil.Process]:
    import shutil

    r = host.molctl("up", profile, *host.args(*extra, env={"FAKE_CHILD": "1"}))
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    records = host.records(profile)
    procs = [psutil.Process(records["proxy"].pid), psutil.Process(records["engine"].pid)]
    procs += psutil.Process(records["engine"].pid).children(recursive=True)
    assert len(procs) == 3
    shutil.rmtree(host.state)
    return procs


def _kill_left(procs: list[psutil.Process]) -> None:
    for p in procs:  # psutil checks the process is still the same one (pid and create time)
        try:
            if p.is_running():
                p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


def _pids_in(text: str, procs: list[psutil.Process]) -> list[int]:
    return [p.pid for p in procs if not re.search(rf"\b{p.pid}\b", text)]


def test_status_names_the_processes_of_a_stack_whose_state_dir_was_deleted(host, deleted_state_stack):
    """Guards a found bug: with the state dir deleted while a stack runs, `status`
    said "no stack is recorded" and `status tiny --json` said `stopped`, while the engine, its child
    and the proxy ran on carrying markers pointing into the state dir. Now the stack is `degraded`
    with problems naming every process, and `status` does not create the state dir."""
    procs = deleted_state_stack
    for args in (("status", "--json"), ("status", "tiny", "--json")):
        r = host.molctl(*args)
        assert r.exit_code == ExitStatus.OK, r.stderr
        (stack,) = r.json()["stacks"]
        assert stack["profile"] == "tiny" and stack["state"] == "degraded", (args, stack)
        problems = "\n".join(stack["problems"])
        assert not _pids_in(problems, procs), problems
        assert "molctl down tiny" in problems, problems
    for args in (("status",), ("status", "tiny")):
        r = host.molctl(*args)
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert "degraded" in r.stdout and "no stack is recorded" not in r.stdout, r.stdout
        assert not _pids_in(r.stdout, procs), r.stdout
    assert not host.state.exists()
    assert all(p.is_running() for p in procs)


@pytest.mark.parametrize("named", [False, True], ids=["down", "down tiny"])
def test_down_stops_the_processes_of_a_stack_whose_state_dir_was_deleted(host, deleted_state_stack, named):
    """Guards a found bug: with the state dir deleted while a stack runs, `down`
    and `down tiny` said "nothing is running" (exit 0) and stopped nothing. Now both find the
    processes by the markers pointing into this state dir (as `up` does), stop them and say so."""
    procs = deleted_state_stack
    r = host.molctl("down", *(["tiny"] if named else []), "--stop-timeout", "5", "--drain-timeout", "5", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = r.json()
    assert result["message"] == "stopped tiny", result
    (entry,) = result["stopped"]
    assert entry["profile"] == "tiny" and set(entry["components"]) == {"engine", "proxy"}, entry
    assert gone([p.pid for p in procs])
    assert "proxy" in r.stderr and "engine" in r.stderr and "marker" in r.stderr, r.stderr
    assert host.molctl("status", "--json").json()["stacks"] == []
    again = host.molctl("down")
    assert again.exit_code == ExitStatus.OK and again.stdout.strip() == "nothing is running", again.stdout


def test_status_and_down_find_the_processes_when_the_profile_file_is_gone_too(host):
    """Guards a found bug, with a profile from a profiles folder: the state dir
    deleted and the profile file removed since, `status P` and `down P` refused the name as an
    unknown profile (exit 3: "known only when the state dir holds records of it"), while the
    processes carrying its markers ran on. Processes carrying its marker make the name known."""
    add_tiny_b(host)
    procs = _up_and_delete_state(host, "tiny-b")
    try:
        (host.profiles / "tiny-b.yaml").unlink()
        r = host.molctl("status", "tiny-b", "--json")
        assert r.exit_code == ExitStatus.OK, r.stderr
        (stack,) = r.json()["stacks"]
        assert stack["profile"] == "tiny-b" and stack["state"] == "degraded", stack
        r = host.molctl("down", "tiny-b", "--stop-timeout", "5", "--drain-timeout", "5")
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert r.stdout.strip() == "stopped tiny-b", r.stdout
        assert gone([p.pid for p in procs])
        assert host.molctl("status", "tiny-b").exit_code == ExitStatus.CHECK_FAILED  # unknown again
    finally:
        _kill_left(procs)
