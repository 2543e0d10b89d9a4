"""`molctl logs` and the log files behind it: `-n` on big logs and long or cut lines, `-f` across a
restart, a deletion, a truncation and a rotation, lines without an end and split characters, output
into a pipe closed early; the byte-bounded tail `up` prints on a failure; the proxy log's rotation,
pruning and the `logs.keep` profile field."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from molctl.errors import ExitStatus
from molctl.output import Output
from tests.helpers import ROOT, wait_for


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
    t = threading.Thread(
        target=show_logs,
        args=(Ctx(state), "tiny", component, True, lines, Output(stdout=buf)),
        kwargs={"poll_s": 0.05, "stop_after_s": stop_after_s},
        daemon=True,
    )
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
    t0 = time.process_time()  # CPU time (the quadratic tail took 23 s of it): a loaded machine's waits do not count
    show_logs(Ctx(tmp_path / "state"), "tiny", "engine", False, 1_000_000, Output(stdout=buf))
    assert time.process_time() - t0 < 5
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "molctl", "--state-dir", str(state), "logs", "tiny", "-n", "20000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(30) == ExitStatus.OK and err == "", err


def test_logs_follow_into_a_pipe_ends_when_the_reader_is_gone(tmp_path):
    """`molctl logs -f | grep -m1 ready` never ended once grep had its line: nothing new was
    written, so the closed pipe was never noticed."""
    state = _big_log(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "molctl", "--state-dir", str(state), "logs", "tiny", "-f", "-n", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(10) == ExitStatus.OK and proc.stderr.read() == b""
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the tail, rotation and retention


def test_up_failure_tail_marks_a_line_cut_by_the_byte_bound(tmp_path):
    """Guards a found bug: processes.tail (up's failure output) returned the end of a long
    last line without the '...' marker when the byte bound fell inside it (the old code marked it)."""
    from molctl.processes import TAIL_LINE_MAX, tail

    log = tmp_path / "engine.log"
    log.write_bytes(b"x\n" + b"y" * (3 * TAIL_LINE_MAX) + b"\n")
    (line,) = tail(log, 1)
    assert line.startswith("...y") and len(line) <= TAIL_LINE_MAX + 3
    log.write_bytes(b"a\nb\nc")
    assert tail(log, 2) == ["b", "c"] and tail(log, 9) == ["a", "b", "c"] and tail(log, 0) == []


def test_proxy_log_rotation_and_pruning(tmp_path):
    from molctl.state import prune_logs

    log = tmp_path / "proxy-1.log"
    # the writer ends once the last rotation is done (its file below the limit): a daemon thread
    # stopped by the interpreter's exit between two renames left .2 without .1 (a loaded CI run)
    script = (
        "import os, sys, time; from molctl.logfiles import rotate_stdio; rotate_stdio(2000, 2, 0.02)\n"
        "for i in range(400):\n    print('x' * 50, flush=True); time.sleep(0.002)\n"
        "deadline = time.monotonic() + 30\n"
        "while os.fstat(1).st_size >= 2000 and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
    )
    with open(log, "ab") as fh:
        subprocess.run(
            [sys.executable, "-c", script], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=60, check=True
        )
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == ["proxy-1.log", "proxy-1.log.1", "proxy-1.log.2"], parts
    assert all(p.stat().st_size < 2000 + 4000 for p in tmp_path.iterdir())
    # pruning keeps the N newest per component, with their rotated parts
    state = tmp_path / "state"
    logs = state / "tiny" / "logs"
    logs.mkdir(parents=True)
    for i in range(4):
        p = logs / f"proxy-2020-{i}.log"
        p.write_text("x")
        Path(f"{p}.1").write_text("x")
        os.utime(p, (1_600_000_000 + i,) * 2)
    prune_logs(state, "tiny", "proxy", 2)
    assert sorted(p.name for p in logs.iterdir()) == [
        "proxy-2020-2.log",
        "proxy-2020-2.log.1",
        "proxy-2020-3.log",
        "proxy-2020-3.log.1",
    ]


@pytest.mark.parametrize(
    ("last", "shown"),
    [
        (b"y" * 5000 + b"\n", "..." + "y" * 4095),  # the bound (4096 bytes back, the newline too) cuts it
        (b"y" * 5000, "..." + "y" * 4096),
        (b"y" * 4095 + b"\n", "y" * 4095),  # within the bound: whole, unmarked
    ],
    ids=["long-line", "long-line-without-end", "line-within-the-bound"],
)
def test_logs_n_marks_a_cut_last_line_once_as_the_tail_does(tmp_path, last, shown):
    """Found reading `molctl logs -n 1` of a log whose last line was over 4 KiB (a dumped JSON):
    it began with four dots. The byte bound (TAIL_LINE_MAX back) had cut the line and marked it
    `...`, and the marked line, 3 bytes longer than the bound, was cut again with another `...`
    (which kept one dot of the first and lost no byte of the line). Now it is shown as
    processes.tail shows it (`up`'s log tail): one `...` and the line's end."""
    from molctl.logs import show_logs
    from molctl.output import Output
    from molctl.processes import tail

    logs = tmp_path / "state" / "tiny" / "logs"
    logs.mkdir(parents=True)
    log = logs / "proxy-20250101-000000.log"
    log.write_bytes(b"first\n" + last)

    class C:
        state_dir = tmp_path / "state"

    out = io.StringIO()
    show_logs(C(), "tiny", "proxy", False, 1, Output(stdout=out))
    (line,) = out.getvalue().splitlines()
    assert line == "[proxy] " + shown, line[:20]
    assert tail(log, 1) == [shown]


def test_logs_follow_across_a_rotation(tmp_path):
    import threading

    from molctl.logs import show_logs
    from molctl.output import Output

    state = tmp_path / "state"
    logs = state / "tiny" / "logs"
    logs.mkdir(parents=True)
    log = logs / "proxy-20250101-000000.log"
    log.write_text("one\n" * 50)
    out_path = tmp_path / "out.txt"

    class C:
        state_dir = state

    def follow():
        with open(out_path, "w") as fh:
            show_logs(C(), "tiny", "proxy", True, 1, Output(stdout=fh), poll_s=0.02, stop_after_s=10)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    assert wait_for(lambda: out_path.exists() and "one" in out_path.read_text())
    os.replace(log, f"{log}.1")
    log.write_text("after rotation\n")
    assert wait_for(lambda: "after rotation" in out_path.read_text())
    assert "was rotated" in out_path.read_text()


def test_logs_follow_shows_a_line_without_end_in_pieces_and_keeps_split_characters(tmp_path):
    """`logs -f` held a line without a newline whole in memory (a component printing megabytes
    without one), and decoded each read apart (a UTF-8 character split across two reads came out
    as two replacement characters)."""
    import threading

    from molctl import logs as logs_module
    from molctl.output import Output

    state = tmp_path / "state"
    logs = state / "tiny" / "logs"
    logs.mkdir(parents=True)
    log = logs / "proxy-20250101-000000.log"
    log.write_text("start\n")
    out_path = tmp_path / "out.txt"

    class C:
        state_dir = state

    def follow():
        with open(out_path, "w") as fh:
            logs_module.show_logs(C(), "tiny", "proxy", True, 1, Output(stdout=fh), poll_s=0.02, stop_after_s=10)

    threading.Thread(target=follow, daemon=True).start()
    assert wait_for(lambda: out_path.exists() and "start" in out_path.read_text())
    with open(log, "ab") as fh:
        fh.write("é".encode()[:1])
        fh.flush()
        time.sleep(0.2)  # read apart: the character's first byte, then the rest
        fh.write("é".encode()[1:] + b" done\n")
    assert wait_for(lambda: "é done" in out_path.read_text()), out_path.read_text()[-200:]
    with open(log, "ab") as fh:
        fh.write(b"x" * (logs_module.FOLLOW_LINE_MAX + 10))
    assert wait_for(lambda: "x" * logs_module.FOLLOW_LINE_MAX in out_path.read_text())


def test_log_retention_is_a_validated_profile_field():
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    assert load_profile("tiny", profile_dirs(), [("logs.keep", 3)]).logs.keep == 3
    with pytest.raises(ProfileError, match="logs.keep"):
        load_profile("tiny", profile_dirs(), [("logs.keep", 0)])
