"""The operator's read-side commands (`status`, `logs`, `state stats|prune`) reviewed as an SRE
at 3 a.m.: each test reproduces a defect found by an experiment against real processes (fake
engine stacks on free ports, their own state dir)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from molctl.errors import ExitStatus
from molctl.output import Output
from tests.helpers import ROOT, Molctl, wait_for


class Ctx:
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir

    def dirs(self) -> list[Path]:
        return []


def _logs_dir(tmp_path: Path) -> Path:
    logs = tmp_path / "state" / "tiny" / "logs"
    logs.mkdir(parents=True)
    return logs


def _follow(state: Path, component: str, lines: int, stop_after_s: float) -> tuple[threading.Thread, io.StringIO]:
    from molctl.logs import show_logs

    buf = io.StringIO()
    t = threading.Thread(target=show_logs, args=(Ctx(state), "tiny", component, True, lines, Output(stdout=buf)),
                         kwargs={"poll_s": 0.05, "stop_after_s": stop_after_s}, daemon=True)
    t.start()
    return t, buf


# ------------------------------------------------------------------------------------------ logs


def test_logs_n_larger_than_a_big_log_is_fast(tmp_path):
    """`logs -n 1000000` on a 20 MB log took 23 s: the tail grew its buffer 8 KiB at a time,
    copying (and recounting) everything read so far at each step."""
    from molctl.logs import show_logs

    log = _logs_dir(tmp_path) / "engine-20260101-000000.log"
    with open(log, "wb") as fh:
        fh.write((b"x" * 99 + b"\n") * 200_000)
    buf = io.StringIO()
    t0 = time.monotonic()
    show_logs(Ctx(tmp_path / "state"), "tiny", "engine", False, 1_000_000, Output(stdout=buf))
    assert time.monotonic() - t0 < 5
    assert buf.getvalue().count("\n") == 200_000
    buf = io.StringIO()
    show_logs(Ctx(tmp_path / "state"), "tiny", "engine", False, 3, Output(stdout=buf))
    assert buf.getvalue() == "[engine] " + "x" * 99 + "\n" + ("[engine] " + "x" * 99 + "\n") * 2


def test_logs_n_keeps_the_end_of_a_huge_line_and_shows_a_last_line_without_end(tmp_path):
    from molctl.logs import show_logs
    from molctl.processes import TAIL_LINE_MAX

    log = _logs_dir(tmp_path) / "engine-20260101-000000.log"
    log.write_bytes(b"first\n" + b"y" * (TAIL_LINE_MAX * 3) + b"END\n\xff\xfe bad utf-8\nno end")
    buf = io.StringIO()
    show_logs(Ctx(tmp_path / "state"), "tiny", "engine", False, 3, Output(stdout=buf))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("[engine] ...") and lines[0].endswith("yEND") and len(lines[0]) < TAIL_LINE_MAX + 20
    assert lines[1] == "[engine] \ufffd\ufffd bad utf-8" and lines[2] == "[engine] no end"


def test_logs_follow_keeps_the_last_lines_of_the_old_log_at_a_restart(tmp_path):
    """`logs -f` switched to a restart's new log without reading what the old component wrote
    after the last poll: its last words (a traceback) were never shown."""
    logs = _logs_dir(tmp_path)
    old = logs / "engine-20260101-000000.log"
    old.write_text("old-1\n")
    t, buf = _follow(tmp_path / "state", "engine", 5, 3)
    assert wait_for(lambda: "old-1" in buf.getvalue())
    with open(old, "a") as fh:
        fh.write("Traceback: the old engine's last words\n")
    (logs / "engine-20260101-000001.log").write_text("new-1\n")  # in the same poll interval
    assert wait_for(lambda: "new-1" in buf.getvalue())
    t.join()
    text = buf.getvalue()
    assert "last words" in text and text.index("last words") < text.index("==> new log") < text.index("new-1"), text


def test_logs_follow_never_goes_back_to_an_older_log_when_the_newest_is_deleted(tmp_path):
    """Deleting the newest log (freeing disk) made `logs -f` announce the previous log as a
    "new log" and print it again from its first line."""
    logs = _logs_dir(tmp_path)
    older = logs / "engine-20260101-000000.log"
    older.write_text("older-1\nolder-2\n")
    os.utime(older, (time.time() - 100, time.time() - 100))
    newest = logs / "engine-20260101-000001.log"
    newest.write_text("newest-1\n")
    t, buf = _follow(tmp_path / "state", "engine", 5, 2)
    assert wait_for(lambda: "newest-1" in buf.getvalue())
    with open(newest, "a") as fh:  # a writer keeps the deleted file open: its lines are still shown
        newest.unlink()
        fh.write("written after the delete\n")
        fh.flush()
        t.join()
    text = buf.getvalue()
    assert "older-1" not in text and "new log" not in text, text
    assert "was deleted" in text and "written after the delete" in text, text


def test_logs_follow_says_truncated_and_reads_from_the_start(tmp_path):
    log = _logs_dir(tmp_path) / "proxy-20260101-000000.log"
    log.write_text("a long line before the truncation\n")
    t, buf = _follow(tmp_path / "state", "proxy", 5, 2)
    assert wait_for(lambda: "before the truncation" in buf.getvalue())
    with open(log, "r+") as fh:  # logrotate's copytruncate
        fh.truncate(0)
    time.sleep(0.3)
    with open(log, "a") as fh:
        fh.write("short\n")
    t.join()
    assert "was truncated" in buf.getvalue() and "[proxy] short" in buf.getvalue(), buf.getvalue()


def _big_log(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    log = _logs_dir(tmp_path) / "engine-20260101-000000.log"
    log.write_text("a log line of some length, as an engine writes them\n" * 20_000)
    os.chmod(state, 0o700)
    return state


def test_logs_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`molctl logs | head -1` printed `molctl: error: Broken pipe` and exited 1."""
    state = _big_log(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "molctl", "--state-dir", str(state), "logs", "tiny", "-n", "20000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(30) == ExitStatus.OK and err == "", err


def test_logs_follow_into_a_pipe_ends_when_the_reader_is_gone(tmp_path):
    """`molctl logs -f | grep -m1 ready` never ended once grep had its line: nothing new was
    written, so the closed pipe was never noticed."""
    state = _big_log(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "molctl", "--state-dir", str(state), "logs", "tiny", "-f", "-n", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(10) == ExitStatus.OK and proc.stderr.read() == b""
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------ status


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
            assert stack["state"] == "degraded" and elapsed < 2.9, elapsed
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


def test_up_failure_tail_marks_a_line_cut_by_the_byte_bound(tmp_path):
    """From the regression review: processes.tail (up's failure output) returned the end of a long
    last line without the '...' marker when the byte bound fell inside it (the old code marked it)."""
    from molctl.processes import TAIL_LINE_MAX, tail

    log = tmp_path / "engine.log"
    log.write_bytes(b"x\n" + b"y" * (3 * TAIL_LINE_MAX) + b"\n")
    (line,) = tail(log, 1)
    assert line.startswith("...y") and len(line) <= TAIL_LINE_MAX + 3
    log.write_bytes(b"a\nb\nc")
    assert tail(log, 2) == ["b", "c"] and tail(log, 9) == ["a", "b", "c"] and tail(log, 0) == []
