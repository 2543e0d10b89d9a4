"""`molctl profiles` with no profile anywhere (an install without its built-in profiles listed an
empty table and exited 0): one line naming every folder searched, exit 3."""

from __future__ import annotations

from pathlib import Path

from molctl import profiles as profiles_module
from molctl.errors import ExitStatus


def test_no_profile_found_is_one_line_naming_where_it_looked(molctl, tmp_path, monkeypatch):
    builtin, user = tmp_path / "builtin", tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("not a profile\n")
    monkeypatch.setattr(profiles_module, "builtin_profiles_dir", lambda: builtin)  # missing, as in a broken install
    for args in (("profiles",), ("profiles", "--json")):
        r = molctl("--profiles-dir", str(user), *args)
        assert r.exit_code == ExitStatus.CHECK_FAILED
        assert r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"molctl: error: no profile found (searched: {builtin}, {user});"), r.stderr


def test_the_built_in_folder_is_inside_the_package():
    """Found beside the module (a link to the repository's profiles/ in a checkout), not by a path
    that only a source tree has."""
    here = profiles_module.builtin_profiles_dir()
    assert {p.stem for p in here.glob("*.yaml")} >= {"venti", "tall", "tiny", "venti-sglang"}
    packaged = Path(profiles_module.__file__).parent / "profiles_builtin"
    assert here == packaged.resolve()
