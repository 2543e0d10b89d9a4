"""An `engine.cache_dir` that names a file, or a path below one (issue 44's engine cache): the
preflight's `state.engine_cache` fails naming the field and the path, exit 3, before anything is
stopped, so a `switch` leaves the running stack alone; with the state checks skipped, `up` still
ends in the same one-line error, exit 3, instead of a bare "File exists" and exit 1."""

from __future__ import annotations

import json

from molctl.errors import ExitStatus
from tests.lifecycle_host import add_tiny_b


def test_a_switch_to_a_cache_dir_that_is_a_file_stops_nothing(host):
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    a_file = host.tmp / "a-file"
    a_file.write_text("")
    r = host.molctl("switch", "tiny-b", *host.args("--set", f"engine.cache_dir={a_file}"))
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert f"engine.cache_dir {a_file} is not a directory" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    status = json.loads(host.molctl("status", "--json").stdout)
    assert [(s["profile"], s["state"]) for s in status["stacks"]] == [("tiny", "ready")]


def _check_args(host, *extra):
    """`up`'s arguments without those `check` does not take (--allow-unauthenticated, --timeout)."""
    args = host.args()
    return [*args[: args.index("--allow-unauthenticated")], *extra]


def test_check_names_a_cache_dir_below_a_file(host):
    a_file = host.tmp / "a-file"
    a_file.write_text("")
    r = host.molctl("check", "tiny", *_check_args(host, "--set", f"engine.cache_dir={a_file}/sub", "--json"))
    [result] = [c for c in json.loads(r.stdout)["checks"] if c["id"] == "state.engine_cache"]
    assert result["status"] == "fail" and result["detail"].startswith(f"engine.cache_dir {a_file}/sub: {a_file}")
    ok = host.molctl("check", "tiny", *_check_args(host, "--json"))
    [result] = [c for c in json.loads(ok.stdout)["checks"] if c["id"] == "state.engine_cache"]
    assert result["status"] == "pass" and str(host.state / "tiny" / "engine-cache") in result["detail"]


def test_up_without_the_state_checks_still_names_the_field(host):
    a_file = host.tmp / "a-file"
    a_file.write_text("")
    r = host.up("--skip", "state", "--set", f"engine.cache_dir={a_file}")
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("molctl: error:")]
    assert line.startswith(f"molctl: error: engine.cache_dir {a_file}: File exists (expected a directory")
    assert host.stack_pids() == set()  # nothing started, nothing recorded


def test_a_relative_cache_dir_that_climbs_out_of_the_profiles_dir_is_refused(host):
    """A relative engine.cache_dir is below STATE/PROFILE: `..` in it is a profile error, exit 3."""
    r = host.molctl("check", "tiny", *_check_args(host, "--set", "engine.cache_dir=../../escape", "--skip", "gpu"))
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert "engine.cache_dir" in r.stdout and "no '..'" in r.stdout
    r = host.up("--set", "engine.cache_dir=../../escape")
    assert r.exit_code == ExitStatus.CHECK_FAILED and "no '..'" in r.stderr and "\n" not in r.stderr.strip()
    assert host.records() == {} and not (host.tmp / "escape").exists()
