"""The state lock's holder is structured data (`LockHolder`), written and read as JSON fields."""

from __future__ import annotations

import os

import pytest

from molctl.errors import ConflictError, ExitStatus
from molctl.state import LockHolder, StateLock, lock_holder


def test_the_holder_is_read_back_as_fields(state_dir):
    assert lock_holder(state_dir) is None
    with StateLock(state_dir, "switch", "tiny-b"):
        holder = lock_holder(state_dir)
        assert (holder.pid, holder.action, holder.profile) == (os.getpid(), "switch", "tiny-b")
        assert holder.user and holder.since
        with pytest.raises(ConflictError) as err, StateLock(state_dir, "up", "tiny"):
            pass
        assert err.value.exit_status == ExitStatus.CONFLICT
        assert f"pid {os.getpid()} (molctl switch tiny-b, user {holder.user}" in str(err.value)
        assert f"stop it with `kill {os.getpid()}` (SIGTERM: it stops what it started)" in str(err.value)
    assert lock_holder(state_dir) is None


def test_a_down_of_every_stack_has_no_profile(state_dir):
    with StateLock(state_dir, "down"):
        holder = lock_holder(state_dir)
        assert (holder.action, holder.profile, holder.command) == ("down", None, "down")


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"pid": "12", "action": 3}'])
def test_unreadable_content_gives_an_unnamed_holder(raw):
    holder = LockHolder.parse(raw)
    assert holder.pid is None and holder.action is None
    assert holder.describe().startswith("pid ? (molctl ?") and holder.stop_hint() == "wait for it"


def test_the_lock_holder_decides_starting_and_stopping_per_stack():
    """Only the stack a command acts on changes state: a `down tiny` leaves tiny-b `ready`; a
    `switch tiny-b` is starting tiny-b and stopping whatever else runs; an `up` in its preflight
    (no record yet) is already `starting`."""
    from molctl.lifecycle.status import _state_of

    records = {"engine": object(), "proxy": object()}
    healthy = [{"alive": True, "health": 200}, {"alive": True, "health": 200}]

    def state(name, action, profile, recs=records):
        holder = LockHolder(pid=1, action=action, profile=profile) if action else None
        return _state_of(name, recs, healthy if recs else [], holder)

    assert state("tiny", None, None) == "ready"
    assert state("tiny", "down", "tiny") == "stopping"
    assert state("tiny-b", "down", "tiny") == "ready"
    assert state("tiny-b", "down", None) == "stopping"
    assert state("tiny", "switch", "tiny-b") == "stopping"
    assert state("tiny-b", "switch", "tiny-b", {}) == "starting"
    assert state("tiny", "up", "tiny", {}) == "starting"
    assert state("tiny", "up", "tiny-b", {}) == "stopped"


def test_status_lists_a_stack_whose_up_is_in_its_preflight(state_dir):
    from types import SimpleNamespace

    from molctl.lifecycle.status import status

    ctx = SimpleNamespace(state_dir=state_dir, dirs=lambda: [])
    assert status(ctx, None) == {"stacks": []}
    with StateLock(state_dir, "up", "tiny"):
        stacks = status(ctx, None)["stacks"]
    assert [(s["profile"], s["state"]) for s in stacks] == [("tiny", "starting")]


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_state_dir_option_is_usage_not_the_current_directory(tmp_path, monkeypatch, value):
    """`--state-dir "$STATE"` with STATE unset was the current directory: check wrote cache/ there,
    up its lock, records and logs. Now exit 2 and nothing written; an empty MOLCTL_STATE_DIR is unset."""
    from tests.helpers import Molctl

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOLCTL_STATE_DIR", raising=False)
    r = Molctl(None, in_process=True)("--state-dir", value, "check", "tiny", "--skip", "engine", "--skip", "gpu")
    assert r.exit_code == ExitStatus.USAGE and "--state-dir '': expected a directory path" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_state_dir_that_is_a_file_is_an_error_not_nothing_running(tmp_path):
    """`status` and `down` said "nothing running" (exit 0) about a state dir that is a file."""
    from tests.helpers import Molctl

    state = tmp_path / "state"
    state.write_text("not a folder")
    for args in (["status"], ["down"]):
        r = Molctl(state, in_process=True)(*args)
        last = r.stderr.strip().splitlines()[-1]  # `down` warns first that it cannot take the state lock
        assert r.exit_code == ExitStatus.ERROR and f"state dir {state} is not a directory" in last, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_a_profiles_dir_that_does_not_exist_is_usage(tmp_path):
    """A misspelt --profiles-dir was ignored: the profile it holds was then an unknown name."""
    from tests.helpers import Molctl

    r = Molctl(tmp_path / "state", [tmp_path / "nope"], in_process=True)("profiles")
    assert r.exit_code == ExitStatus.USAGE and f"--profiles-dir {tmp_path / 'nope'}: not a directory" in r.stderr


def test_the_stop_hint_names_a_signal_a_scripted_background_job_does_not_ignore():
    """`kill -INT PID` cannot stop an `up` started with `&` from a script (SIGINT ignored)."""
    for action in ("up", "switch", "down"):
        hint = LockHolder(pid=42, action=action, profile="tiny").stop_hint()
        assert "-INT" not in hint and "`kill 42`" in hint
        assert ("SIGTERM: it stops what it started" in hint) == (action != "down")
