"""`molctl status` when a stack is unwell or its state cannot be read: an unreadable state dir is an
error (for `logs` too), an unreadable record is one problem naming its processes, a hung engine is
reported quickly with the proxy's answer, and a live component that is not healthy says why. Real
`molctl up tiny` stacks against the fake engine (the `host` fixture of tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from molctl.errors import ExitStatus
from tests.helpers import Molctl, wait_for


@pytest.fixture
def unreadable_state_dir(state_dir, monkeypatch):
    """The state dir of another user (mode 0700, `--state-dir /var/lib/molctl` read by an
    operator who is not its owner): it cannot be listed (root reads it anyway, hence the patch;
    reproduced for real with `setpriv --reuid=65534` against a running stack)."""
    (state_dir / "tiny" / "logs").mkdir(parents=True)
    (state_dir / "tiny" / "engine.json").write_text("{}")
    (state_dir / "tiny" / "logs" / "engine-20260101-000000.log").write_text("hello\n")
    denied = os.path.realpath(state_dir)
    real_listdir, real_iterdir = os.listdir, Path.iterdir

    def listdir(path="."):
        if os.path.realpath(path) == denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real_listdir(path)

    def iterdir(self):
        if os.path.realpath(self) == denied:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    return state_dir


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("logs",)])
def test_an_unreadable_state_dir_is_an_error_not_nothing_running(molctl, unreadable_state_dir, args):
    """`molctl status` said "no stack is recorded" (exit 0) about a running, ready stack whose state
    dir the caller could not read, and `status tiny` said `failed`; `logs` said "no logs"."""
    r = molctl(*args)
    assert r.exit_code == ExitStatus.ERROR, (r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert f"cannot read state dir {unreadable_state_dir}: Permission denied (owner " in r.stderr, r.stderr


def test_an_unreadable_record_is_one_problem_naming_its_processes(host):
    """A corrupted engine record gave two problems for the same engine: "unreadable; 1 process(es)
    carry its marker" and "1 process(es) carry the engine's marker but no record names them (an
    interrupted `up`?)": a wrong guess, with the pids only in the second."""
    assert host.up().exit_code == ExitStatus.OK
    engine_pid = host.records()["engine"].pid
    record = host.state / "tiny" / "engine.json"
    good = record.read_bytes()
    record.write_bytes(good[:40])  # truncated (a full disk during a write by hand, a bad copy)
    try:
        r = host.molctl("status", "--json")
        assert r.exit_code == ExitStatus.OK, r.stderr
        (stack,) = r.json()["stacks"]
        assert stack["state"] == "degraded"
        (problem,) = stack["problems"]
        assert problem.startswith(f"engine record {record} is unreadable (corrupt (JSONDecodeError"), problem
        assert f"1 process(es) carry its marker (pid {engine_pid})" in problem, problem
    finally:
        record.write_bytes(good)


def test_status_of_a_hung_engine_is_quick_and_reads_the_proxys_answer(host):
    """With the engine hung (SIGSTOP), `status` took 3.4 s (the engine's 1 s probe, then the
    proxy's 2 s one) and, about one time in six, showed the healthy proxy as not answering: its
    /readyz probe gave up after 2 s, exactly when the proxy's own probe of the engine did."""
    assert host.up().exit_code == ExitStatus.OK
    engine_pid = host.records()["engine"].pid
    os.kill(engine_pid, signal.SIGSTOP)
    time.sleep(1.2)  # the proxy reuses a ready answer for 1 s
    # timed in-process: a `python -m molctl` subprocess would add its interpreter start and imports
    # (0.2-0.5 s idle, more on a loaded CI runner) to what is measured
    inproc = Molctl(host.state, [host.profiles], in_process=True)
    import molctl.cli  # noqa: F401 - imported before the clock starts

    took = []
    try:
        for _ in range(3):
            t0 = time.monotonic()
            r = inproc("status", "--json")
            elapsed = time.monotonic() - t0
            assert r.exit_code == ExitStatus.OK, r.stderr
            (stack,) = r.json()["stacks"]
            comps = {c["name"]: c for c in stack["components"]}
            assert comps["engine"]["alive"] and comps["engine"]["health"] is None
            assert comps["proxy"]["health"] == 503, comps["proxy"]
            # the floor is the proxy's own 2 s probe of the hung engine (READYZ_ENGINE_PROBE_MIN_S);
            # probing one after the other (the engine's 1 s timeout, then the proxy's 2 s) takes 3 s or more
            assert stack["state"] == "degraded"
            took.append(elapsed)
        # the best of three: one run slowed by a loaded host does not decide it
        assert min(took) < 2.9, took
    finally:
        os.kill(engine_pid, signal.SIGCONT)


def test_status_says_why_a_live_component_is_not_healthy(host):
    """A SIGSTOPped engine and the proxy in front of it were `health: null` and `503`, nothing
    more: hung, stopped, draining or missing adapters all looked the same at 3 a.m."""
    assert host.up().exit_code == ExitStatus.OK
    engine_pid = host.records()["engine"].pid
    os.kill(engine_pid, signal.SIGSTOP)
    time.sleep(1.2)  # the proxy reuses a ready answer for 1 s
    try:
        (stack,) = host.molctl("status", "--json").json()["stacks"]
        text = host.molctl("status").stdout
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    comps = {c["name"]: c for c in stack["components"]}
    assert comps["engine"]["detail"] == f"stopped by a signal (SIGSTOP or Ctrl-Z): `kill -CONT {engine_pid}` resumes it"
    assert comps["proxy"]["detail"] in ("engine unreachable", "engine /health answered None"), comps["proxy"]
    assert f"tiny: engine (pid {engine_pid}) not healthy: stopped by a signal" in text, text
    assert wait_for(lambda: host.molctl("status", "--json").json()["stacks"][0]["state"] == "ready")
    assert all("detail" not in c for c in host.molctl("status", "--json").json()["stacks"][0]["components"])
