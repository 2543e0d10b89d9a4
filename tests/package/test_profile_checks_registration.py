"""The profile checks owned by higher layers (molctl.profilechecks) are registered by every program
that loads a profile, in a fresh interpreter (no test fixture importing the owners first), and a
program that forgets one fails loudly instead of skipping the check."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOAD = (
    "from molctl.profiles import builtin_profiles_dir, load_profile_file\n"
    "profile = load_profile_file(builtin_profiles_dir() / 'tiny.yaml', [('proxy.store', 'bogus')])\n"
)


def run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("entry", ["molctl.cli", "molctl.proxy.http.server", "molctl.lifecycle.waitready"])
def test_each_program_runs_the_checks_of_every_owner(entry):
    done = run_fresh(f"import {entry}\n" + LOAD)
    # the store's own grammar ran: a bad proxy.store is a profile error naming the field
    assert done.returncode != 0
    assert "ProfileError" in done.stderr and "proxy.store" in done.stderr and "expected 'sqlite'" in done.stderr
    assert "RuntimeError" not in done.stderr


def test_loading_a_profile_without_the_owners_names_the_module_to_import():
    done = run_fresh(LOAD)
    assert done.returncode != 0
    assert "RuntimeError: the profile check 'engine' is not registered: import molctl.engines" in done.stderr
