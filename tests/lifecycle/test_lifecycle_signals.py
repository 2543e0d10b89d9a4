"""`up` and `switch` stopped by what stops commands besides Ctrl-C (SIGTERM: `timeout`, systemd, a
cancelled CI job; SIGHUP: a closed terminal or ssh session), and a `switch` that must stop nothing
when it cannot succeed. Real molctl processes against fake engines (tests/lifecycle/test_lifecycle.py's host)."""

from __future__ import annotations

import re
import shlex
import signal
import socket

import pytest

from molctl.errors import ExitStatus
from molctl.lifecycle.stacks import component_url
from molctl.state import lock_holder
from tests.helpers import Molctl, exit_status, free_port, wait_for
from tests.lifecycle_host import EARLY_PROXY, add_tiny_b, answers, gone
from tests.procs import alive


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_during_up_stops_what_it_started(host, sig):
    """They used to end `up` silently (exit 143 or 129) with the engine left loading, the proxy
    running and nobody waiting for them."""
    proc = host.start("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "60"}))
    assert wait_for(lambda: "proxy" in host.records())
    assert wait_for(lambda: answers(component_url(host.records()["proxy"]) + "/health"), timeout=30)
    pids = host.stack_pids()
    assert len(pids) >= 2
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert exit_status(proc.returncode) == ExitStatus.INTERRUPTED, err
    assert f"interrupted by {sig.name}; everything this command started was stopped" in err, err
    assert gone(pids) and host.records() == {} and lock_holder(host.state) is None
    assert host.up().exit_code == ExitStatus.OK  # and the next `up` works


def test_a_switch_to_ports_a_stranger_holds_stops_nothing(host):
    """The switch's preflight skipped the port checks (the old stack holds the ports): a port held
    by a stranger was found only after the running stack had been stopped."""
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    old = host.stack_pids()
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", free_port()))
        stranger.listen()
        port = stranger.getsockname()[1]
        r = host.molctl("switch", "tiny-b", *host.args(engine_port=port))
    assert r.exit_code == ExitStatus.CONFLICT, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "the running stack was left alone" in r.stderr
    assert "was stopped" not in r.stderr
    assert host.stack_pids() == old and all(map(alive, old))
    # the ports the running stack holds are its own: the same switch on them goes through
    assert host.molctl("switch", "tiny-b", *host.args()).exit_code == ExitStatus.OK


def test_an_interrupted_switch_says_what_of_the_old_stack_still_runs(host):
    """A Ctrl-C while the switch stopped the old stack printed only "interrupted", with the public
    proxy already gone and the engine still running."""
    add_tiny_b(host)
    assert host.up(env={"FAKE_IGNORE_TERM": "1"}).exit_code == ExitStatus.OK  # the engine's stop takes its time
    records = host.records()
    proc = host.start("switch", "tiny-b", *host.args("--stop-timeout", "60"))
    assert wait_for(lambda: not alive(records["proxy"].pid), timeout=30)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert exit_status(proc.returncode) == ExitStatus.INTERRUPTED, err
    engine = records["engine"]
    m = re.search(
        r"interrupted while stopping the old stack: the old stack tiny is partly stopped \(still running: "
        rf"engine \(pid {engine.pid}\)\): bring it back with `([^`]+)` or finish stopping it with `([^`]+)`",
        err,
    )
    assert m, err
    up, down = shlex.split(m.group(1)), shlex.split(m.group(2))
    assert up[0] == "molctl" and up[up.index("up") :][:2] == ["up", "tiny"], err
    assert down == ["molctl", "--state-dir", str(host.state.absolute()), "down", "tiny"], err
    assert alive(engine.pid)
    finish = Molctl(None)(*down[1:], "--stop-timeout", "1")  # the printed command, verbatim
    assert finish.exit_code == ExitStatus.OK, finish.stderr
    assert gone([engine.pid]) and host.records() == {}


def test_a_closed_terminal_stops_up_and_its_clean_up_finishes(host):
    """The ssh session of an `up` ends: the kernel hangs up its terminal (SIGHUP to the session) and
    every later write to it fails with EIO. The clean-up must not die on its own progress lines."""
    import fcntl
    import os
    import pty
    import subprocess
    import sys
    import termios
    import threading

    from tests.helpers import ROOT, wait_status

    master, slave = pty.openpty()

    def controlling_terminal():  # a login shell's session: the pty is its controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "molctl",
            *host.cli.argv("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "60"})),
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        preexec_fn=controlling_terminal,
    )
    os.close(slave)
    host.procs.append(proc)
    seen = bytearray()

    def drain():  # the terminal's reader, until it is gone
        try:
            while chunk := os.read(master, 4096):
                seen.extend(chunk)
        except OSError:
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert wait_for(lambda: "proxy" in host.records())
    assert wait_for(lambda: answers(component_url(host.records()["proxy"]) + "/health"), timeout=30)
    pids = host.stack_pids()
    os.close(master)  # the session ends
    assert wait_status(proc, 60) == ExitStatus.INTERRUPTED, bytes(seen).decode(errors="replace")[-2000:]
    assert gone(pids) and host.records() == {}


def test_an_up_started_ignoring_sighup_keeps_ignoring_it(host):
    """`nohup molctl up venti &`, then the ssh session ends: the SIGHUP nohup exists to absorb must
    not stop the engine load (the review of the SIGTERM/SIGHUP change found it did)."""
    import os
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT, wait_status

    def like_nohup():
        os.setsid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "molctl",
            *host.cli.argv("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "4"})),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=like_nohup,
    )
    host.procs.append(proc)
    assert wait_for(lambda: "proxy" in host.records())
    pids = host.stack_pids()
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert proc.poll() is None and all(map(alive, pids))
    assert wait_status(proc, 60) == ExitStatus.OK, proc.stderr.read()
    assert set(host.records()) == {"engine", "proxy"}
