"""`molctl top` against a metrics listener that answers badly and a stack that is stopped
(issue 40): non-Prometheus text was a traceback, a trickling or huge answer held top past 60 s
(a per-read timeout, no total deadline), a SIGSTOPped engine showed as serving (its log's last
phase), and the live view read keys only between frames that each waited for the probes."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time

import psutil

from molctl import top as top_mod
from molctl.top import Target, Top, _Snapshots, unanswered_phase


def serve(body_writer) -> tuple[str, threading.Event]:
    """A one-connection-at-a-time HTTP server whose answer `body_writer(conn, stop)` writes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            sock.settimeout(0.2)
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                try:
                    body_writer(conn, stop)
                except OSError:  # the client gave up: what the test checks
                    pass
        sock.close()

    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}/metrics", stop


def scrape(url: str) -> tuple[object, str | None]:
    t = Top(None, Target("tiny", None, None, url))
    return t.scrape(), t.why


def test_an_answer_that_is_not_prometheus_text_is_no_metrics_with_the_reason():
    """Guards the traceback: the parser's ValueError escaped `scrape`."""
    body = b"<html>hello</html>"
    url, stop = serve(lambda c, _: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)))
    try:
        got, why = scrape(url)
    finally:
        stop.set()
    assert got is None and "not Prometheus text" in why


def test_a_trickling_answer_is_given_up_at_the_deadline(monkeypatch):
    """Guards the missing total deadline: a byte every 0.1 s never tripped the 1 s read timeout."""
    monkeypatch.setattr(top_mod, "METRICS_DEADLINE_S", 0.5)

    def trickle(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(300):  # 30 s at most
            if stop.is_set():
                return
            conn.sendall(b"1\r\n#\r\n")
            time.sleep(0.1)

    url, stop = serve(trickle)
    try:
        got, why = scrape(url)
    finally:
        stop.set()
    assert got is None and "took over 0.5 s" in why


def test_a_huge_answer_is_given_up_at_the_size_bound(monkeypatch):
    """Guards the missing size cap: a 300 MB answer was read whole and parsed."""
    monkeypatch.setattr(top_mod, "METRICS_MAX_BYTES", 1 << 20)

    def huge(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (8 << 20))
        line = b"# HELP x y\n" * 6000
        while not stop.is_set():
            conn.sendall(line)

    url, stop = serve(huge)
    try:
        got, why = scrape(url)
    finally:
        stop.set()
    assert got is None and f"passed {1 << 20} bytes" in why


def test_a_stopped_engine_is_not_serving():
    """Guards the log's phase: a SIGSTOPped engine whose log said serving showed as serving."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert unanswered_phase("serving", proc.pid) == "stopped (SIGSTOP)"
    finally:
        proc.kill()
        proc.wait()
    assert unanswered_phase("serving", None) == "not answering"
    assert unanswered_phase("API server: serving", None) == "not answering"
    assert unanswered_phase("loading weights: 100% (2/2 shards)", None) == "loading weights: 100% (2/2 shards)"


class SlowTop:
    """A Top whose second and later snapshots wait until released (a stopped proxy's probes)."""

    def __init__(self):
        self.release, self.calls, self.why = threading.Event(), 0, None

    def snapshot(self):
        self.calls += 1
        if self.calls > 1:
            self.release.wait()
        return {"state": "ready", "n": self.calls}


def test_the_live_view_draws_while_a_snapshot_is_still_being_taken(monkeypatch):
    """Guards frames waiting for the probes: each frame (and each key read) waited 6 s for them."""
    monkeypatch.setattr(top_mod, "REFRESH_S", 0.01)
    slow = SlowTop()
    snaps = _Snapshots(slow)
    try:
        while slow.calls < 2:
            time.sleep(0.01)
        frames = [snaps.latest()[0] for _ in range(3)]  # the second snapshot is still being taken
    finally:
        slow.release.set()
    assert [f["n"] for f in frames] == [1, 1, 1]
