"""`molctl demo init`: deterministic, in the upstream layout, and passing the model/adapter checks."""

from __future__ import annotations

import hashlib
import json

from molctl.demo import init_tiny


def digest(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_per_seed(tmp_path):
    init_tiny(tmp_path / "a", seed=0)
    init_tiny(tmp_path / "b", seed=0)
    init_tiny(tmp_path / "c", seed=1)
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert a == b
    assert a["base/model-00001-of-00002.safetensors"] != c["base/model-00001-of-00002.safetensors"]
    adapters = {a[f"loras/{r}/adapter_model.safetensors"] for r in ("L0", "L1", "L2", "L3")}
    assert len(adapters) == 4  # four different adapters


def test_layout_passes_the_model_and_adapter_checks(molctl, tmp_path):
    result = molctl("demo", "init", str(tmp_path / "tiny"), "--json")
    assert result.exit_code == 0 and result.json()["created"] is True
    report = molctl("check", "tiny", "--model-root", str(tmp_path / "tiny"), "--skip", "engine", "--skip", "port", "--json")
    assert report.exit_code == 0, [c for c in report.json()["checks"] if c["status"] != "pass"]
    config = json.loads((tmp_path / "tiny" / "base" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]


def test_refuses_to_overwrite_and_if_missing(molctl, tmp_path):
    assert molctl("demo", "init", str(tmp_path / "tiny")).exit_code == 0
    again = molctl("demo", "init", str(tmp_path / "tiny"))
    assert again.exit_code == 1 and "--force" in again.stderr
    kept = molctl("demo", "init", str(tmp_path / "tiny"), "--if-missing")
    assert kept.exit_code == 0 and "already present" in kept.stdout
    assert molctl("demo", "init", str(tmp_path / "tiny"), "--force").exit_code == 0
