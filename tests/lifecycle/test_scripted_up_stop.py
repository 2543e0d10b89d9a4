"""An `up` started in the background of a script (`molctl up ... &` in a non-interactive shell,
which starts it with SIGINT ignored) is stopped by the signal the state lock's message names: it
stops what it started, releases the lock and leaves nothing running. Real molctl processes against
the fake engine (tests/lifecycle/test_lifecycle.py's host)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

from molctl.errors import ExitStatus
from molctl.state import lock_holder
from tests.helpers import ROOT, wait_for
from tests.lifecycle_host import EARLY_PROXY, gone
from tests.procs import alive


def _background_up(host) -> tuple[subprocess.Popen, int]:
    """`bash -c 'molctl up tiny ... & echo $!; wait $!; echo rc=$?'`: the shell prints the job's
    pid, waits for it and prints its exit status."""
    argv = [
        sys.executable,
        "-m",
        "molctl",
        *host.cli.argv("up", "tiny", *host.args(*EARLY_PROXY, env={"FAKE_STARTUP_DELAY": "60"})),
    ]
    script = f"{shlex.join(argv)} & echo $!; wait $!; echo rc=$?"
    shell = subprocess.Popen(
        ["bash", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    host.procs.append(shell)
    return shell, int(shell.stdout.readline())


def test_a_scripted_background_up_stops_on_the_signal_the_lock_message_names(host):
    """The lock message said `kill -INT PID`, which a background job of a script ignores."""
    shell, pid = _background_up(host)
    try:
        assert wait_for(lambda: "proxy" in host.records() and "engine" in host.records(), timeout=30)
        pids = host.stack_pids()
        assert pids and lock_holder(host.state).pid == pid
        second = host.up()
        assert second.exit_code == ExitStatus.CONFLICT, second.stderr
        hint = re.search(rf"`(kill [^`]*\b{pid})`", second.stderr)
        assert hint, second.stderr
        subprocess.run(["bash", "-c", hint.group(1)], check=True, timeout=10)
        out, err = shell.communicate(timeout=60)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert out.strip().endswith(f"rc={int(ExitStatus.INTERRUPTED)}"), (out, err)
    assert "everything this command started was stopped" in err, err
    assert gone(pids) and not alive(pid)
    assert host.records() == {} and lock_holder(host.state) is None
    assert host.up().exit_code == ExitStatus.OK  # and the next `up` works
