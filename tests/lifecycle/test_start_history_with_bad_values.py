"""A starts.json edited by hand, or by another tool, with values that are not seconds (strings,
lists, booleans, NaN, negative totals): the ETA ignores those values, and `up` and `status`
neither crash nor print a traceback (issue 44: the history is only an estimate). One that cannot
be written is a warning naming the file; the stack serves."""

from __future__ import annotations

import json
import math

from molctl.errors import ExitStatus
from molctl.lifecycle import starthistory


def _write(state, starts):
    path = starthistory.history_path(state, "tiny")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    state.chmod(0o700)  # what molctl expects of a state dir
    path.write_text(json.dumps({"version": 1, "starts": starts}))


def _bad_starts(host):
    good = {"host": host, "total_s": 20.0, "phases": {"config": 2.0, "weights": 18.0}}
    return [
        good,
        {"host": host, "total_s": 30.0, "phases": {"config": "slow", "weights": [1], "proxy": True}},
        {"host": host, "total_s": True, "phases": {}},
        {"host": host, "total_s": -5.0, "phases": {}},
        {"host": host, "total_s": 1e400, "phases": {}},  # json.dumps writes Infinity
        {"host": host, "total_s": 40.0, "phases": "weights"},
    ]


def test_values_that_are_not_seconds_are_ignored_by_the_estimate(tmp_path):
    _write(tmp_path, _bad_starts("a"))
    est = starthistory.estimate(tmp_path, "tiny", host="a")
    assert est.starts == 3 and est.total_s == 30.0  # 20, 30 and 40: the others carry no usable total
    assert est.phase_s == {"config": 2.0, "weights": 18.0}
    assert est.remaining(1.0, "config") == 29.0 and not math.isnan(est.remaining(1.0, "weights"))
    assert starthistory.eta_text(est, 0.0, "config").startswith("ETA 30 s")


def test_up_and_status_survive_a_history_with_values_that_are_not_seconds(host):
    import socket

    _write(host.state, _bad_starts(socket.gethostname()))
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "Traceback" not in r.stderr and "ETA " in r.stdout + r.stderr
    s = host.molctl("status", "tiny", "--json")
    assert s.exit_code == ExitStatus.OK and "Traceback" not in s.stderr, s.stderr


def test_a_history_that_cannot_be_written_is_a_warning_naming_the_file(host):
    path = starthistory.history_path(host.state, "tiny")
    path.mkdir(parents=True)  # starts.json is a directory: neither read nor replaced
    host.state.chmod(0o700)
    path.parent.chmod(0o700)
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert f"could not record this start's phases in {path}: Is a directory" in r.stdout + r.stderr
    assert sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")) == []  # no temp file left


def test_a_history_that_cannot_be_read_says_so_instead_of_first_start(tmp_path):
    """A corrupt starts.json is no ETA that names the file, not "first start" (it was one before)."""
    path = starthistory.history_path(tmp_path, "tiny")
    path.parent.mkdir(parents=True)
    for content, why in (("{not json", "is not valid JSON"), ('{"starts": 3}', "holds no list of starts")):
        path.write_text(content)
        est = starthistory.estimate(tmp_path, "tiny", host="a")
        assert est.total_s is None and est.unreadable == f"{path} {why}"
        assert starthistory.eta_text(est, 0.0, "config") == f"no ETA: {path} {why}"
        assert est.summary()["basis"].startswith(f"no usable history: {path} {why}")
    path.unlink()
    est = starthistory.estimate(tmp_path, "tiny", host="a")
    assert est.unreadable is None and starthistory.eta_text(est, 0.0, "config").startswith("no ETA yet: first start")
