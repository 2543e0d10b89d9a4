"""Lifecycle command options and small lifecycle edges: non-finite or invalid timeouts and proxy
options are usage errors, the way back repeats the options a stack needed, a fresh claim names its
holder, a state dir that is a file, `logs` of an unknown profile."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import threading

import pytest

from molctl.claims import Claim, HostClaims, holder_info
from molctl.errors import ExitStatus
from tests.helpers import Molctl


def test_a_claim_just_taken_names_its_holder(tmp_path):
    """Two `up`s racing: the loser read the winner's lock file between its creation (empty) and
    the holder's name being written, and said "the lock file names no holder"."""
    locks = HostClaims(tmp_path)
    path = locks.path("port", 4711)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, not named yet
        claim = Claim("port", 4711, path, fd)
        later = threading.Timer(0.2, claim.set_holder, [holder_info("tiny", "engine", tmp_path / "state")])
        later.start()
        holder = locks.holder("port", 4711)
        later.join()
        assert holder is not None and holder.profile == "tiny" and holder.component == "engine"
        # renaming the holder (molctl -> the component's pid) never leaves the file empty or unparsable
        claim.set_holder({**holder_info("tiny", "engine", tmp_path / "state"), "command": "x" * 300})
        claim.set_holder(holder_info("tiny", "proxy", tmp_path / "state", pid=1))
        raw = path.read_bytes()
        assert json.loads(raw)["component"] == "proxy" and raw.endswith(b"}\n")
    finally:
        os.close(fd)


def test_a_state_dir_that_is_a_file_holds_no_records(tmp_path, monkeypatch):
    """`down tiny` said the records were unreadable (exit 4, "--force") and `status tiny` said
    failed, for a state dir that is a plain file and so holds nothing."""
    monkeypatch.setenv("COLUMNS", "200")
    state = tmp_path / "state"
    state.write_text("not a directory\n")
    cli = Molctl(state, in_process=True)
    s = cli("status", "tiny", "--json")
    assert s.exit_code == ExitStatus.OK
    assert s.json()["stacks"][0]["state"] == "stopped"
    d = cli("down", "tiny", "--json")
    assert d.exit_code == ExitStatus.OK and d.json()["message"] == "nothing is running"


def test_logs_of_an_unknown_profile_is_exit_3(tmp_path):
    cli = Molctl(tmp_path / "state", in_process=True)
    r = cli("logs", "tinny")
    assert r.exit_code == ExitStatus.CHECK_FAILED and "no profile named 'tinny'" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("down", "--drain-timeout", "nan"),
        ("down", "--stop-timeout", "nan"),
        ("down", "--stop-timeout", "inf"),
        ("up", "tiny", "--timeout", "inf", "--allow-unauthenticated"),
        ("switch", "tiny", "--drain-timeout", "nan", "--allow-unauthenticated"),
    ],
)
def test_non_finite_timeouts_are_usage_errors(tmp_path, args):
    """`--drain-timeout nan` passed `< 0` and made every deadline expire at once: the proxy was
    SIGKILLed without draining."""
    r = Molctl(tmp_path / "state", in_process=True)(*args)
    assert r.exit_code == ExitStatus.USAGE


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_the_proxys_own_drain_timeout_is_checked_like_downs(tmp_path, value):
    """`molctl proxy --drain-timeout nan` was accepted: the proxy served, and on SIGTERM its drain
    never ended (a NaN deadline; only SIGKILL stopped it). Now a usage error before it serves,
    one line (a subprocess with a timeout: before the fix this started a server)."""
    from tests.helpers import free_port

    cli = Molctl(tmp_path / "state", in_process=False)
    r = cli(
        "proxy",
        "tiny",
        "--upstream",
        "http://127.0.0.1:9",
        "--port",
        str(free_port()),
        "--allow-unauthenticated",
        "--drain-timeout",
        value,
        timeout=30,
    )
    assert r.exit_code == ExitStatus.USAGE, r.stderr
    assert "--drain-timeout" in r.stderr and "expected a number of seconds >= 0" in r.stderr


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_the_proxys_sse_keepalive_must_be_a_positive_number(tmp_path, value):
    """`molctl proxy --sse-keepalive 0` (or -1) was accepted: every stream waiting for its engine
    wrote keep-alive comments in a tight loop (57,000 frames, 750 KB in 1 s, a core busy); nan made
    every stream a 500. Now a usage error before it serves (a subprocess: before the fix it served)."""
    from tests.helpers import free_port

    cli = Molctl(tmp_path / "state", in_process=False)
    r = cli(
        "proxy",
        "tiny",
        "--upstream",
        "http://127.0.0.1:9",
        "--port",
        str(free_port()),
        "--allow-unauthenticated",
        "--sse-keepalive",
        value,
        timeout=30,
    )
    assert r.exit_code == ExitStatus.USAGE, r.stderr
    assert "--sse-keepalive" in r.stderr and "expected a number of seconds > 0" in r.stderr


def test_the_way_back_repeats_the_options_the_stack_needed_to_start(tmp_path):
    """The command a failed switch printed dropped `--skip` and `--timeout`: a stack that needed
    them to start failed its preflight (or its deadline) when brought back."""
    from molctl import stackconfig
    from molctl.lifecycle.launch import UpOptions
    from molctl.lifecycle.start import _start_options

    opts = UpOptions(skip=["engine", "gpu"], timeout_s=7200.0, drain_timeout_s=30.0)
    cmd = stackconfig.up_command(
        "venti", [("engine.port", 9000)], ["--allow-unauthenticated"], None, [], _start_options(opts)
    )
    argv = shlex.split(cmd)
    assert argv[:3] == ["molctl", "up", "venti"]
    for option in (
        ["--skip", "engine"],
        ["--skip", "gpu"],
        ["--timeout", "7200"],
        ["--drain-timeout", "30"],
        ["--set", "engine.port=9000"],
    ):
        assert any(argv[i : i + 2] == option for i in range(len(argv))), (option, argv)
    assert _start_options(UpOptions()) == []
