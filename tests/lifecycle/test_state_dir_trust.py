"""molctl trusts only what is its own: another local user's state dir, forged process markers,
planted symlinks and hard links where molctl writes, forged lock holders, and engine env overrides
kept out of a world-readable argv."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from molctl import procid
from molctl import state as state_mod
from molctl.errors import ExitStatus, ProfileError
from molctl.state import StateDirError, ensure_state_dir
from tests.helpers import Molctl
from tests.procs import stop

NOBODY = 65534
# Two tests act as another user for real where they can (as root: chown, spawn as nobody); run
# as anyone else, they play that user by making molctl see another uid as its own (monkeypatch)
# (MOLCTL_TEST_AS_USER=1 runs the second way as root too)
AS_ROOT = os.geteuid() == 0 and not os.environ.get("MOLCTL_TEST_AS_USER")


def _sleeper(user: int | None = None, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        ["sleep", "600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd="/",
        user=user,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(env or {})},
    )


def _forged_record(pid: int) -> dict:
    ticks = procid.start_ticks(pid)
    return {
        "component": "engine",
        "pid": pid,
        "pgid": pid,
        "create_time": 0.0,
        "argv": ["x"],
        "port": 1,
        "log": "/nonexistent",
        "started_at": 0.0,
        "start_ticks": ticks,
        "boot_id": procid.boot_id(),
        "record_id": "",
        "host": "127.0.0.1",
        "config": {},
    }


def test_down_refuses_another_users_state_dir_whose_records_name_our_processes(tmp_path, monkeypatch):
    """Found by building, as user nobody, a state dir (mode 0700) under a shared parent with a
    record naming a root process (its pid, start ticks and boot id are public in /proc) and `lock`
    a symlink to a root-owned file: root's `molctl --state-dir D down tiny` killed the process and
    truncated the file. A state dir owned by another user is now refused before anything."""
    tmp_path.chmod(0o711)
    victim = _sleeper()
    precious = tmp_path / "precious"
    precious.write_text("precious\n")
    state = tmp_path / "state"
    try:
        (state / "tiny").mkdir(parents=True, mode=0o700)
        state.chmod(0o700)
        (state / "tiny" / "engine.json").write_text(json.dumps(_forged_record(victim.pid)))
        (state / "lock").symlink_to(precious)
        if AS_ROOT:
            for p in (state, state / "tiny", state / "tiny" / "engine.json"):
                os.lchown(p, NOBODY, NOBODY)
            os.lchown(state / "lock", NOBODY, NOBODY)
            cli, owner = Molctl(state), "owned by nobody"
        else:  # the dir is ours: molctl, in this process, believes it is someone else
            me = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: me + 1)
            cli, owner = Molctl(state, in_process=True), f"owned by {__import__('pwd').getpwuid(me).pw_name}"
        res = cli("down", "tiny", "--stop-timeout", "1", "--drain-timeout", "1", timeout=60)
        assert res.exit_code == ExitStatus.ERROR, res
        assert owner in res.stderr and "not by you" in res.stderr, res.stderr
        assert victim.poll() is None, "root's down killed the process a forged record named"
        assert precious.read_text() == "precious\n"
        for cmd in (("reload", "tiny"), ("bench", "tiny", "--requests", "1", "--series", "base")):
            res = cli(*cmd, timeout=60)
            assert res.exit_code == ExitStatus.ERROR and "not by you" in res.stderr, (cmd, res)
        assert victim.poll() is None
    finally:
        stop(victim)


def test_a_state_dir_of_another_uid_is_refused_by_the_writers_and_the_actors(tmp_path, monkeypatch):
    """The same, for any user: up, switch, lock and the proxy create files in the state dir through
    `ensure_state_dir`, which checked the mode only (0700 of someone else passed)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    ensure_state_dir(state)
    state_mod.check_own_state_dir(state)
    state_mod.check_own_state_dir(tmp_path / "missing")  # nothing to refuse yet
    other = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: other)
    with pytest.raises(ProfileError, match="not by you"):
        ensure_state_dir(state)
    with pytest.raises(StateDirError, match="not by you"):
        state_mod.check_own_state_dir(state)


def test_the_state_lock_does_not_follow_a_symlink(tmp_path):
    """`STATE/lock` was opened with O_CREAT and truncated through whatever symlink stood there."""
    from molctl.state import StateLock

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_text("keep me\n")
    (state / "lock").symlink_to(target)
    with pytest.raises(StateDirError, match="cannot take the state lock"):
        with StateLock(state, "down", "tiny"):
            pass
    assert target.read_text() == "keep me\n"


def test_a_forged_marker_in_another_users_process_is_not_ours(tmp_path, monkeypatch):
    """Found by starting, as user nobody, a process with MOLCTL_RECORD pointing into root's state
    dir and any MOLCTL_RECORD_ID: root's `status` called the stack degraded ("carry the engine's
    marker but no record names them") and root's `down` (and `up`, cleaning leftovers) killed it.
    Only processes whose real uid is ours carry our markers."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    marker = {procid.MARKER_PATH: str(state / "tiny" / "engine.json"), procid.MARKER_ID: "0123456789abcdef" * 2}
    forged = _sleeper(user=NOBODY if AS_ROOT else None, env=marker)
    ours = _sleeper(env=marker)
    try:
        deadline = time.monotonic() + 5
        while procid.environ_of(forged.pid) in (None, {}) and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = {pid for pid, _path, _rid in procid.marked_processes()}
        assert ours.pid in pids
        cli = Molctl(state)
        if not AS_ROOT:  # forged is ours in truth: molctl, in this process, takes another uid for its own
            assert forged.pid in pids
            me = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: me + 1)
            pids = {pid for pid, _path, _rid in procid.marked_processes()}
            cli = Molctl(state, in_process=True)
        assert forged.pid not in pids
        stop(ours)
        res = cli("status", "tiny", "--json")
        assert json.loads(res.stdout)["stacks"][0]["state"] == "stopped", res
        res = cli("down", "tiny", "--stop-timeout", "1")
        assert res.exit_code == ExitStatus.OK and forged.poll() is None, res
    finally:
        stop(forged)
        stop(ours)


def test_lock_output_probe_never_follows_a_planted_symlink(tmp_path):
    """Found by reading `prepare_output`: `lock --output DIR/m.json` proved DIR writable by
    opening `DIR/.m.json.<pid>.tmp` with open(..., "w"): in a shared DIR (group-writable, or /tmp
    without fs.protected_symlinks, as on this host) another user plants that name, pids are
    guessable, as a symlink to a file of the operator's, which was truncated."""
    from molctl.manifestfile import prepare_output

    victim = tmp_path / "victim"
    victim.write_text("do not truncate\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / f".m.json.{os.getpid()}.tmp").symlink_to(victim)
    assert prepare_output(shared / "m.json") == shared / "m.json"
    assert victim.read_text() == "do not truncate\n"
    assert [p.name for p in shared.iterdir()] == [f".m.json.{os.getpid()}.tmp"]  # the probe is gone


def test_a_host_lock_file_hard_linked_to_another_file_is_refused(tmp_path):
    """Found by reading `_open_lock_file`: a lock file that exists is opened O_RDWR (O_NOFOLLOW
    stops symlinks, not hard links) and the holder's JSON written over it. In the 1777 lock dir,
    on a host without fs.protected_hardlinks, another user hard-links `port-N.lock` to a file of
    the operator's (root: /etc/shadow), whose content `up` then replaced."""
    from molctl.claims import HostClaims, holder_info
    from molctl.errors import MolctlError

    locks = tmp_path / "locks"
    locks.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("secret content that must stay\n")
    os.link(victim, locks / "port-8100.lock")
    with pytest.raises(MolctlError, match="hard link"):
        HostClaims(locks).acquire("port", 8100, holder_info("tiny", "engine", tmp_path))
    assert victim.read_text() == "secret content that must stay\n"
    claim = HostClaims(locks).acquire("port", 8101, holder_info("tiny", "engine", tmp_path))  # a plain one works
    claim.release()


@pytest.fixture
def host(tmp_path):
    from tests.lifecycle_host import Host

    h = Host(tmp_path)
    yield h
    h.cleanup()


def test_an_engine_env_override_never_reaches_a_world_readable_argv(host):
    """Found by `ps` on a stack started with `up --set engine.env.HF_TOKEN=...`: the proxy's argv
    (readable by every local user: /proc/PID/cmdline) carried the token in `--set-json`, though the
    proxy never reads the engine's environment. The engine still gets it, in its environment."""
    res = host.up(env={"HF_TOKEN": "hf_not_on_argv_123"})
    assert res.exit_code == ExitStatus.OK, res
    records = host.records()
    for component, record in records.items():
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes()
        assert b"hf_not_on_argv_123" not in cmdline, (component, cmdline)
    engine_env = procid.environ_of(records["engine"].pid) or {}
    assert engine_env.get("HF_TOKEN") == "hf_not_on_argv_123"
    assert json.loads(host.molctl("status", "tiny", "--json").stdout)["stacks"][0]["state"] == "ready"


def test_a_forged_lock_holder_cannot_put_a_command_in_the_stop_hint():
    """Guards a found bug: host lock files are world-writable, and the
    holder they name is printed as "stop it with `molctl --state-dir X down P`", a command an
    operator copies. A state dir with shell syntax is now quoted, a profile that is no profile
    name gives no command, and fields of another type are ignored."""
    import shlex

    from molctl.claims import Holder

    evil = Holder.parse(json.dumps({"pid": 1, "profile": "tiny", "state_dir": "/x; rm -rf ~ #"}).encode())
    hint = evil.stop_hint()
    command = hint.split("`")[1]
    assert shlex.split(command) == ["molctl", "--state-dir", "/x; rm -rf ~ #", "down", "tiny"]
    assert (
        Holder.parse(json.dumps({"profile": "tiny; reboot", "state_dir": "/s"}).encode()).stop_hint()
        == "stop that process first"
    )
    odd = Holder.parse(json.dumps({"pid": True, "user": ["root"], "profile": 7, "state_dir": {"a": 1}}).encode())
    assert (odd.pid, odd.user, odd.profile, odd.state_dir) == (None, None, None, None)
    fine = Holder.parse(json.dumps({"pid": 5, "profile": "venti", "state_dir": "/var/lib/molctl"}).encode())
    assert fine.stop_hint().startswith("stop it with `molctl --state-dir /var/lib/molctl down venti`")


def test_state_prune_refuses_another_users_state_dir(tmp_path, monkeypatch):
    """Guards a found bug: check_own_state_dir's docstring names `state prune`, which did
    not call it, so root could still delete from a user's store (whose records choose the profile)."""
    from molctl import storeadmin

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    other = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: other)

    class Ctx:
        state_dir = state

        @staticmethod
        def dirs():
            raise AssertionError("the profile must not be loaded before the state dir is checked")

    with pytest.raises(StateDirError, match="not by you"):
        storeadmin.store_prune("tiny", Ctx())
