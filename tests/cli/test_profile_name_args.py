"""A PROFILE argument is a profile name (`[a-z0-9][a-z0-9-]*`, as a profile's own `name`) for every
command that takes one: a path such as `..` or `tiny/../tiny` is exit 3 naming the value and what
was expected, never joined onto the state dir or a profiles folder. A valid name that no profile
has and nothing records keeps its documented answer (exit 3 listing the known ones)."""

from __future__ import annotations

import json

import pytest

from molctl.errors import ExitStatus

BAD = ["..", ".", "tiny/../tiny", "../tiny", "tiny/", "/tmp", "Tiny", "tiny\n", " tiny", "ti ny", "tiny.yaml"]

# (the words before PROFILE, the words after it)
COMMANDS = [
    (("down",), ()),
    (("status",), ()),
    (("logs",), ()),
    (("reload",), ()),
    (("top",), ()),
    (("up",), ("--allow-unauthenticated",)),
    (("switch",), ("--allow-unauthenticated",)),
    (("check",), ()),
    (("lock",), ()),
    (("state", "stats"), ()),
    (("state", "prune"), ()),
    (("bench",), ()),
    (("bench",), ("--compare", "a", "b")),
    (("render", "systemd"), ("--allow-unauthenticated",)),
    (("render", "k8s"), ("--image", "img")),
    (("proxy",), ("--upstream", "http://127.0.0.1:9", "--allow-unauthenticated")),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[0] + c[1]))
@pytest.mark.parametrize("name", BAD, ids=repr)
def test_a_profile_argument_that_is_no_profile_name_is_refused(molctl, state_dir, command, name):
    """`down ..` exited 0 ("nothing is running") and `status ..` showed a stack named `..`: the
    name was joined onto the state dir unchecked."""
    (state_dir / "tiny").mkdir()  # `tiny/../tiny` and `..` resolve to folders that exist
    r = molctl(*command[0], name, *command[1], *(["--json"] if command[0] == ("check",) else []))
    assert r.exit_code == ExitStatus.CHECK_FAILED, (r.stdout, r.stderr)
    if command[0] == ("check",):  # check reports a profile that does not load as its failed profile.valid
        (failed,) = [c for c in json.loads(r.stdout)["checks"] if c["status"] == "fail"]
        assert failed["id"] == "profile.valid"
        lines = [failed["detail"]]
    else:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert f"bad profile name {name!r}: expected [a-z0-9][a-z0-9-]*" in lines[0], lines


@pytest.mark.parametrize("command", [("down",), ("status",), ("logs",), ("reload",)], ids=" ".join)
def test_a_valid_unknown_name_still_lists_the_known_profiles(molctl, command):
    """The name check does not replace the typo answer of a well-formed name."""
    r = molctl(*command, "tinny")
    assert r.exit_code == ExitStatus.CHECK_FAILED, r.stderr
    assert "no profile named 'tinny' (known: " in r.stderr and "tiny" in r.stderr.split("known:")[1]
