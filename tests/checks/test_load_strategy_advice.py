"""`model.load-strategy` (issue 44): the advice for vLLM's --safetensors-load-strategy by the
storage the model root is on (a /proc/mounts text injected here) and the memory free for it."""

from __future__ import annotations

from molctl.checks.loadstrategy import mount_of, run
from molctl.checks.result import Probes
from molctl.profiles import load_profile, profile_dirs
from tests.layouts import make_layout

GIB = 1 << 30


def _profile(tmp_path, *extra):
    root = tmp_path / "models" / "tiny"
    make_layout(root, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
    return load_profile("tiny", profile_dirs(), [("model_root", str(root)), *extra])


def _advice(profile, fstype: str, available: int):
    mounts = f"/dev/sda1 / ext4 rw 0 0\nserver:/export {profile.model_root.parent} {fstype} rw 0 0\n"
    [result] = run(profile, Probes(mounts=lambda: mounts, available_memory=lambda: available))
    assert result.id == "model.load-strategy"
    return result


def test_the_longest_mount_point_holding_the_path_names_its_filesystem():
    mounts = "/dev/sda1 / ext4 rw 0 0\nsrv:/x /data nfs4 rw 0 0\n/dev/nvme0n1 /data/local ext4 rw 0 0\n"
    assert mount_of("/data/local/m", mounts) == ("/data/local", "ext4")
    assert mount_of("/data/m", mounts) == ("/data", "nfs4")
    assert mount_of("/database", mounts) == ("/", "ext4")


def test_local_storage_is_advised_lazy_and_a_network_filesystem_prefetch(tmp_path):
    profile = _profile(tmp_path)
    local = _advice(profile, "ext4", 64 * GIB)
    assert local.status == "pass" and "local storage" in local.detail and "strategy lazy" in local.detail
    nfs = _advice(profile, "nfs4", 64 * GIB)
    assert nfs.status == "pass" and "network filesystem" in nfs.detail and "strategy prefetch" in nfs.detail
    tight = _advice(profile, "lustre", 0)  # no memory to prefetch into: read in place, or copy it local
    assert "strategy lazy" in tight.detail and "local NVMe" in tight.detail


def test_a_profile_strategy_against_this_host_is_a_warning(tmp_path):
    profile = _profile(tmp_path, ("engine.args.safetensors-load-strategy", "eager"))
    result = _advice(profile, "ext4", 64 * GIB)
    assert result.status == "warn" and "safetensors-load-strategy is eager" in result.detail
