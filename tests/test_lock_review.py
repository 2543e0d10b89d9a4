"""Adversarial review of `molctl lock`, `check --verify` and `molctl bench`: each test reproduces
a defect found by running the commands on real layouts (`molctl demo init`, tests/layouts.py)
and fails without its fix."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import types
from pathlib import Path

import pytest

from molctl import manifest as mf
from molctl.errors import ExitStatus
from molctl.hashing import HashCache, hash_files
from molctl.profiles import load_profile
from tests.test_lock import cli, engine_python, failures, layout  # noqa: F401 - fixtures

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


# ------------------------------------------------------------------------ two `lock` runs at once
def test_two_locks_in_the_same_second_keep_both_manifests(tmp_path, monkeypatch):
    """Found running two `molctl lock tiny` at once (different --set): both printed the same
    `lock-STAMP.json` and one manifest silently replaced the other (3 files for 6 runs)."""
    state = tmp_path / "state"
    profile = load_profile("tiny", [PROFILES], [("model_root", str(tmp_path / "m"))])
    # the same second for both runs: both pick the same free name before either writes
    monkeypatch.setattr(mf, "time", types.SimpleNamespace(monotonic=time.monotonic, strftime=time.strftime,
                                                          gmtime=lambda now=None: time.gmtime(1796130000)))
    both_built = threading.Barrier(2, timeout=10)

    def build(profile, state_dir, jobs=None, progress=None, hasher=None, environ=None):
        both_built.wait()  # both have chosen their path (prepare_output) before either writes
        return {"profile": profile.name, "run": threading.current_thread().name,
                "summary": {}, "engine": {"kind": "vllm", "version": "0"}}

    monkeypatch.setattr(mf, "build", build)
    results = {}
    runs = [threading.Thread(target=lambda: results.setdefault(threading.current_thread().name,
                                                                 mf.lock(profile, state)), name=f"run{i}")
            for i in (1, 2)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(15)
    paths = {name: r.path for name, r in results.items()}
    assert len(set(paths.values())) == 2, paths
    for name, path in paths.items():
        assert json.loads(path.read_text())["run"] == name
    names = sorted(p.name for p in mf.manifest_dir(state, "tiny").iterdir())
    assert names == ["lock-20261201-130000-2.json", "lock-20261201-130000.json"], names


def test_an_explicit_output_is_still_replaced(cli, tmp_path):
    out = tmp_path / "pinned.json"
    out.write_text("old\n")
    assert cli.lock("--output", str(out)).exit_code == ExitStatus.OK
    assert json.loads(out.read_text())["kind"] == "molctl.lock"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# ------------------------------------------------------------------------------ symlink loops
@pytest.mark.parametrize("where", ["base", "adapter", "shard"])
def test_a_symlink_loop_in_a_folder_is_one_line_exit_3(cli, layout, where):  # noqa: F811
    """Found with `ln -s b base/a; ln -s a base/b`: lock was exit 1 with a bare 'Too many levels
    of symbolic links' (DirEntry.is_dir raised); in an adapter folder it was called a dangling
    symlink, as a shard 'cannot read'."""
    folder = layout.adapter("L2") if where == "adapter" else layout.base
    name, target = (layout.shards[0].name, layout.shards[0].name) if where == "shard" else ("loop-a", "loop-b")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)  # a shard: to itself
    if target != name:
        (folder / target).symlink_to(name)
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED, result.stderr
    assert result.stderr.strip() == f"molctl: error: {folder / name} is a symlink loop (to {target}), not a regular file"


def test_verify_with_a_symlink_loop_in_base_reports_it(cli, layout):  # noqa: F811
    """check --verify exited 1 with no report when base/ held a symlink loop added after lock."""
    assert cli.lock().exit_code == ExitStatus.OK
    (layout.base / "loop-a").symlink_to("loop-b")
    (layout.base / "loop-b").symlink_to("loop-a")
    code, checks = cli.verify()
    assert code == ExitStatus.CHECK_FAILED
    bad = failures(checks)
    assert set(bad) == {"lock.base.loop-a", "lock.base.loop-b"}, bad
    assert "is not pinned by the manifest" in bad["lock.base.loop-a"]


# --------------------------------------------------------------- unreadable folder in an adapter
def test_an_unreadable_folder_in_an_adapter_is_refused(cli, layout, monkeypatch):  # noqa: F811
    """Found as another user with `chmod 000 loras/L3/sub`: lock exited 0 and the files under it
    were silently left out of the manifest (os.walk drops the errors it meets)."""
    sub = layout.adapter("L3") / "sub"
    sub.mkdir()
    (sub / "extra.bin").write_bytes(b"x")
    real_scandir = os.scandir

    def scandir(path="."):  # what a folder with mode 000 does to a non-root user
        if os.fspath(path) == str(sub):
            raise PermissionError(13, "Permission denied", str(sub))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED, result.stdout
    assert result.stderr.strip() == f"molctl: error: {sub} cannot be read: Permission denied (every file under " \
                                    f"{layout.adapter('L3')} is pinned)"


# ----------------------------------------------------------------- a manifest of another version
@pytest.mark.parametrize("text, problem", [
    ('{"kind": "molctl.lock", "format": 2, "molctl_version": "9.0"}',
     "is a molctl lock manifest of format 2 (written by molctl 9.0); this molctl reads format 1"),
    ('{"kind": "molctl.bench", "format": 1}', "field 'kind' is 'molctl.bench', expected 'molctl.lock'"),
    ("[1, 2]", "is not a molctl lock manifest: an array in JSON, expected an object"),
    ('"lock"', "is not a molctl lock manifest: a string in JSON, expected an object"),
])
def test_a_manifest_of_another_format_or_kind_names_what_it_is(cli, tmp_path, text, problem):
    """Found feeding `check --verify --manifest` a manifest from a newer molctl: 'is not a molctl
    lock manifest (format 1)' named neither the format found nor what was expected of which field."""
    bad = tmp_path / "other.json"
    bad.write_text(text)
    code, checks = cli.verify("--manifest", str(bad))
    assert code == ExitStatus.CHECK_FAILED
    status, detail = checks["lock.manifest"]
    assert status == "fail" and detail.startswith(str(bad)) and problem in detail, detail


# ------------------------------------------------------------------------- a damaged hash cache
@pytest.mark.parametrize("damage", ["nested", "fifo"])
def test_a_hash_cache_nested_too_deep_or_no_regular_file_is_ignored(tmp_path, damage):
    """Found with a hashes.json of 100 000 nested arrays: every `lock` ended in a RecursionError
    traceback; a FIFO there (a typo'd `mkfifo`, a restore gone wrong) blocked `lock` forever."""
    cache_path = tmp_path / "cache" / "hashes.json"
    cache_path.parent.mkdir()
    if damage == "nested":
        cache_path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.mkfifo(cache_path)
    f = tmp_path / "f"
    f.write_bytes(b"data")
    result: dict = {}

    def run():
        try:
            result["run"] = hash_files([f], HashCache(cache_path), jobs=1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # release the blocked reader, then fail
        os.close(os.open(cache_path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("HashCache blocked on reading a FIFO")
    assert "error" not in result, result
    assert result["run"].sha256 == {str(f): hashlib.sha256(b"data").hexdigest()}


# ------------------------------------------------------------------------------- bench --compare
def _run(state: Path, profile: str, run_id: str, text: str | None = None) -> Path:
    d = state / profile / "bench" / run_id
    d.mkdir(parents=True)
    (d / "summary.json").write_text(text if text is not None else json.dumps(
        {"run_id": run_id, "run_dir": str(d), "profile": profile, "results": []}))
    return d


def test_compare_of_a_summary_nested_too_deep_is_one_line_exit_2(molctl, state_dir):
    """Found with a summary.json of 100 000 nested arrays: `bench --compare` ended in a
    RecursionError traceback, exit 1."""
    good = _run(state_dir, "tiny", "20260101-000000")
    bad = _run(state_dir, "tiny", "20260101-000001", '{"results": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = molctl("bench", "--compare", str(good), str(bad))
    assert result.exit_code == ExitStatus.USAGE, result.stderr
    assert result.stderr.startswith(f"molctl: error: {bad / 'summary.json'} cannot be read: ")
    assert len(result.stderr.strip().splitlines()) == 1


def test_compare_of_a_run_id_held_by_two_profiles_names_both(molctl, state_dir):
    """Found benching two profiles in the same second: `bench --compare RUN_ID ...` without
    PROFILE silently took the first profile's run (alphabetically), maybe not the one meant."""
    _run(state_dir, "tall", "20260101-000000")
    _run(state_dir, "tiny", "20260101-000000")
    _run(state_dir, "tiny", "20260101-000001")
    result = molctl("bench", "--compare", "20260101-000000", "20260101-000001")
    assert result.exit_code == ExitStatus.USAGE, result.stdout
    assert result.stderr.strip() == (
        "molctl: error: bench run '20260101-000000' is in more than one profile (tall, tiny): "
        "give PROFILE (molctl bench PROFILE --compare ...) or the run directory")
    result = molctl("bench", "tiny", "--compare", "20260101-000000", "20260101-000001", "--json")
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert result.json()["a"]["profile"] == "tiny"


# --------------------------------------------------------------------------------- bench --series
@pytest.mark.parametrize("value, problem", [
    ("base,L0,L5,mix", "unknown 'L5'"),
    ("base,,L0", "an empty item"),
    ("base,", "an empty item"),
    ("Base", "unknown 'Base'"),
])
def test_a_bad_series_names_the_bad_item(molctl, value, problem):
    """Found with `--series base,L0,L5,mix`: the error repeated the whole list without saying which
    item was wrong, and `base,,L0` was accepted while `--concurrency 1,,2` is refused."""
    result = molctl("bench", "tiny", "--series", value)
    assert result.exit_code == ExitStatus.USAGE, result.stderr
    assert result.stderr.strip() == (f"molctl: error: --series {value!r}: {problem}; expected a comma list of "
                                      "base,L0,L1,L2,L3,mix,proxy,canary")


# ------------------------------------------------------------------------------- one-line errors
def test_an_error_naming_a_path_with_a_newline_is_one_line(tmp_path, molctl, engine_python):  # noqa: F811
    """Found locking a demo layout under `$'/tmp/nl\\nroot'` with a shard missing: the error was
    two lines on stderr (the contract: every error is one line), and an escape sequence in a file
    name would reach the terminal as is."""
    from tests.layouts import tall_layout

    root = tmp_path / "a\nb\x1b[2Jc"
    lay = tall_layout(root)
    lay.shards[0].unlink()
    result = molctl("lock", "tall", "--model-root", str(root), "--set", f"engine.python={engine_python}")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    shown = str(lay.shards[0]).replace("\n", "\\n").replace("\x1b", "\\x1b")
    assert result.stderr == f"molctl: error: {shown} is missing (run `molctl check tall`)\n"
