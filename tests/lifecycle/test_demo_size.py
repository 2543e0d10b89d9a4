"""`molctl demo init --size-mb N` (issue 44): a base of about N MB for load benchmarks, whose
headers, config and index still pass the tiny profile's model checks; the default is unchanged."""

from __future__ import annotations

import json

from molctl.checks import model
from molctl.checks.result import Probes
from molctl.demo import INTERMEDIATE, init_tiny, intermediate_for
from molctl.profiles import load_profile, profile_dirs


def test_a_sized_demo_model_is_about_that_large_and_still_checks(tmp_path):
    out = init_tiny(tmp_path / "m", size_mb=40)
    assert 0.9 * 40e6 <= out["base_bytes"] <= 1.1 * 40e6
    config = json.loads((tmp_path / "m" / "base" / "config.json").read_text())
    assert config["intermediate_size"] == intermediate_for(40) > INTERMEDIATE
    profile = load_profile("tiny", profile_dirs(), [("model_root", str(tmp_path / "m"))])
    failed = [r for r in model.run_model(profile, Probes()) if r.status == "fail"]
    assert failed == []
    assert intermediate_for(None) == INTERMEDIATE
