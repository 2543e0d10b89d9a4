"""`switch` to the profile that already runs, ready, with the same configuration does what `up`
does: nothing (exit 0, already_running), never an hour's reload; with another configuration it
replaces the stack. Guards a `switch venti` typed while venti ran, which drained and reloaded it."""

from __future__ import annotations

import json

from molctl.errors import ExitStatus
from tests.lifecycle_host import gone


def test_a_switch_to_the_running_profile_stops_nothing(host):
    assert host.up().exit_code == ExitStatus.OK
    pids = host.stack_pids()
    r = host.molctl("switch", "tiny", *host.args("--json"))
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    assert out["already_running"] is True and out["stopped"] == [] and "prefetch" not in out
    assert host.stack_pids() == pids
    r = host.molctl("switch", "tiny", *host.args())
    assert r.exit_code == ExitStatus.OK and "already running" in r.stdout + r.stderr, r.stderr
    assert host.stack_pids() == pids


def test_a_switch_to_the_running_profile_with_another_configuration_replaces_it(host):
    assert host.up().exit_code == ExitStatus.OK
    pids = host.stack_pids()
    r = host.molctl("switch", "tiny", *host.args("--json", env={"FAKE_MARK": "other"}))
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    assert out["already_running"] is False and out["stopped"] == ["tiny"]
    assert gone(pids) and host.stack_pids() and not (host.stack_pids() & pids)
