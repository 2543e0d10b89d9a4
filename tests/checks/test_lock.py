"""`molctl lock`, `check --verify` and `up --verify` (issue 11, seed 002) on generated layouts with
real files, against a fake vLLM installed in a throwaway interpreter environment; and the warn-level
capacity and MoE checks of the adapter category; and the manifest, hash-cache and bench-run files
these commands read (`molctl bench --compare`, `--series`), each bad one a one-line error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from molctl import hashing as hashing_mod
from molctl import manifest as mf
from molctl import manifestfile as mff
from molctl.errors import ExitStatus
from molctl.hashing import HashCache, hash_files
from molctl.profiles import load_profile
from tests.fake_vllm import fake_vllm, profile_flags
from tests.helpers import Molctl
from tests.layouts import make_layout, tall_layout


def make_venv(root: Path, version: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    fake_vllm(site, version, profile_flags("tall"))
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def engine_python(tmp_path_factory) -> Path:
    """A fake vLLM 0.24.0 accepting every flag of the tall profile (shared: never modified)."""
    return make_venv(tmp_path_factory.mktemp("venv") / "vllm", "0.24.0")


@pytest.fixture
def layout(tmp_path):
    return tall_layout(tmp_path / "m")


@pytest.fixture
def cli(molctl, layout, engine_python, free_ports):
    """`lock` and `check --verify` of the tall profile on `layout` with the fake engine."""
    engine_port, proxy_port = free_ports
    common = [
        "--model-root",
        str(layout.root),
        "--set",
        f"engine.python={engine_python}",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
    ]

    class Cli:
        python = engine_python
        args = common

        def lock(self, *extra: str, env: dict | None = None):
            return molctl("lock", "tall", *common, "--json", *extra, env=env)

        def verify(self, *extra: str, env: dict | None = None):
            result = molctl(
                "check", "tall", *common, "--skip", "gpu", "--skip", "port", "--verify", "--json", *extra, env=env
            )
            report = result.json()
            assert report["ok"] is (result.exit_code == ExitStatus.OK)
            return result.exit_code, {c["id"]: (c["status"], c["detail"]) for c in report["checks"]}

    return Cli()


def failures(checks: dict) -> dict:
    return {k: d for k, (s, d) in checks.items() if s == "fail"}


def flip_last_byte(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns if keep_mtime else st.st_mtime_ns + 1_000_000_000))


# ----------------------------------------------------------------------------------- lock + verify
def test_lock_then_verify_passes(cli, layout, molctl):
    env = {"HF_TOKEN": "hf_very_secret", "VLLM_LOGGING_LEVEL": "DEBUG"}
    result = cli.lock(env=env)
    assert result.exit_code == ExitStatus.OK, result.stderr
    summary = result.json()
    path = Path(summary["manifest"])
    assert path.parent == molctl.state_dir / "tall" / "manifests" and path.name.startswith("lock-")
    assert summary["files"] == 26 + 2 + 4 * 2 and summary["hashed_files"] == summary["files"]
    assert summary["engine"] == {"kind": "vllm", "version": "0.24.0"}

    text = path.read_text()
    assert "hf_very_secret" not in text
    m = json.loads(text)
    assert m["env"]["HF_TOKEN"] == "<redacted>" and m["env"]["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert m["engine"]["fingerprint"] and m["engine"]["version"] == "0.24.0"
    assert m["argv"][0] == str(cli.python) and "--max-lora-rank" in m["argv"]
    assert m["config"]["model_type"] == "qwen3_5_moe"
    assert m["capacity"] == {"max-loras": 4, "max-lora-rank": 64, "max-cpu-loras": 4, "gpu-memory-utilization": 0.915}
    assert m["template"] is None
    shard = m["shards"][0]
    assert shard["sha256"] == hashlib.sha256(layout.shards[0].read_bytes()).hexdigest()
    assert shard["size"] == layout.shards[0].stat().st_size
    l2 = m["adapters"]["L2"]
    assert (l2["r"], l2["lora_alpha"], l2["target_modules"]) == (64, 128, ["q_proj", "v_proj"])
    assert l2["base_model_name_or_path"] == "Qwen/Qwen3.6-35B-A3B"
    assert [f["name"] for f in l2["files"]] == ["adapter_config.json", "adapter_model.safetensors"]
    assert l2["moe"] is None

    code, checks = cli.verify()  # another environment than the lock's
    assert code == ExitStatus.CHECK_FAILED
    assert set(failures(checks)) == {"lock.env"}
    assert "VLLM_LOGGING_LEVEL: pinned 'DEBUG', found unset" in checks["lock.env"][1]
    assert "HF_TOKEN: pinned '<redacted>', found unset" in checks["lock.env"][1]
    code, checks = cli.verify(env=env)
    assert code == ExitStatus.OK, failures(checks)
    for cid in (
        "lock.manifest",
        "lock.engine.kind",
        "lock.engine.version",
        "lock.engine.fingerprint",
        "lock.argv",
        "lock.env",
        "lock.config",
        "lock.template",
        "lock.shards",
        "lock.base",
        "lock.adapter.L0",
        "lock.adapter.L3",
    ):
        assert checks[cid][0] == "pass", (cid, checks.get(cid))
    assert "26 shards as pinned" in checks["lock.shards"][1]
    code, checks = cli.verify("--full-hash", env=env)
    assert code == ExitStatus.OK, failures(checks)
    assert "sha256 read and matched" in checks["lock.shards"][1]


def test_no_manifest_fails_naming_lock(cli):
    code, checks = cli.verify()
    assert code == ExitStatus.CHECK_FAILED
    assert checks["lock.manifest"][0] == "fail" and "`molctl lock tall`" in checks["lock.manifest"][1]


def test_manifest_option_and_output(cli, tmp_path):
    out = tmp_path / "pins" / "tall.json"
    assert cli.lock("--output", str(out)).json()["manifest"] == str(out)
    code, checks = cli.verify("--manifest", str(out))
    assert code == ExitStatus.OK, failures(checks)
    assert str(out) in checks["lock.manifest"][1]
    code, checks = cli.verify("--manifest", str(tmp_path / "nope.json"))
    assert code == ExitStatus.CHECK_FAILED and "does not exist" in checks["lock.manifest"][1]


def test_flipped_byte_in_adapter_fails_under_full_hash(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    weights = layout.adapter("L2") / "adapter_model.safetensors"
    flip_last_byte(weights, keep_mtime=True)
    code, checks = cli.verify()  # size and mtime as pinned: not read without --full-hash
    assert code == ExitStatus.OK
    code, checks = cli.verify("--full-hash")
    assert code == ExitStatus.CHECK_FAILED
    assert set(failures(checks)) == {"lock.adapter.L2.adapter_model.safetensors"}
    detail = checks["lock.adapter.L2.adapter_model.safetensors"][1]
    assert str(weights) in detail and "sha256 pinned" in detail and "found" in detail
    assert checks["lock.adapter.L2"] == ("pass", checks["lock.adapter.L2"][1])  # the other file still passes


def test_flipped_byte_fails_without_full_hash_when_mtime_changed(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    weights = layout.adapter("L1") / "adapter_model.safetensors"
    flip_last_byte(weights, keep_mtime=False)
    code, checks = cli.verify()
    assert code == ExitStatus.CHECK_FAILED
    assert set(failures(checks)) == {"lock.adapter.L1.adapter_model.safetensors"}
    assert "mtime changed" in checks["lock.adapter.L1.adapter_model.safetensors"][1]


def test_touched_file_with_the_same_content_warns(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    st = layout.shards[3].stat()
    os.utime(layout.shards[3], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    code, checks = cli.verify()
    assert code == ExitStatus.OK
    status, detail = checks[f"lock.shard.{layout.shards[3].name}"]
    assert status == "warn" and "content as pinned" in detail


def test_replaced_shard_of_equal_size_and_mtime_fails_under_full_hash(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    shard = layout.shards[5]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    other = shard.with_name("replacement.tmp")
    other.write_bytes(bytes(data))
    os.replace(other, shard)  # a different file (inode) of the same size...
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...with the pinned mtime
    code, checks = cli.verify()
    assert code == ExitStatus.OK  # size and mtime cannot see it
    code, checks = cli.verify("--full-hash")
    assert code == ExitStatus.CHECK_FAILED
    cid = f"lock.shard.{shard.name}"
    assert set(failures(checks)) == {cid}
    assert "replaced in place" in checks[cid][1]


def test_missing_and_added_adapter_files_fail(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    (layout.adapter("L3") / "adapter_model.bin").write_bytes(b"pickle!")
    (layout.adapter("L0") / "adapter_config.json").unlink()
    code, checks = cli.verify()
    assert code == ExitStatus.CHECK_FAILED
    fails = failures(checks)
    assert "not pinned" in fails["lock.adapter.L3.adapter_model.bin"]
    assert "missing" in fails["lock.adapter.L0.adapter_config.json"]


def test_swapped_adapter_config_names_what_changed(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    config = layout.adapter_config("L2")
    config["lora_alpha"] = 16
    layout.write_adapter_config("L2", config)
    code, checks = cli.verify()
    detail = failures(checks)["lock.adapter.L2.adapter_config.json"]
    assert "lora_alpha 128 -> 16" in detail


def test_changed_flags_fail(cli):
    assert cli.lock().exit_code == ExitStatus.OK
    code, checks = cli.verify("--set", "engine.args.max-model-len=4096")
    assert code == ExitStatus.CHECK_FAILED
    assert set(failures(checks)) == {"lock.argv"}
    assert "--max-model-len" in checks["lock.argv"][1] and "4096" in checks["lock.argv"][1]
    code, checks = cli.verify("--set", "engine.args.max-loras=8")
    assert set(failures(checks)) == {"lock.argv", "lock.capacity.max-loras"}
    assert checks["lock.capacity.max-loras"][1] == "--max-loras: pinned 4, found 8"


def test_changed_engine_env_fails(cli, molctl):
    assert cli.lock().exit_code == ExitStatus.OK
    code, checks = cli.verify("--set", "engine.env.VLLM_USE_V2=1")
    assert code == ExitStatus.CHECK_FAILED
    assert "VLLM_USE_V2: pinned unset, found '1'" in failures(checks)["lock.env"]


def test_changed_engine_version_fails(molctl, layout, tmp_path):
    python = make_venv(tmp_path / "venv", "0.24.0")
    sets = ["--model-root", str(layout.root), "--set", f"engine.python={python}"]
    assert molctl("lock", "tall", *sets).exit_code == ExitStatus.OK
    init = next((tmp_path / "venv" / "lib").glob("python3*/site-packages")) / "vllm" / "__init__.py"
    init.write_text("__version__ = '0.24.1'\n")
    st = init.stat()
    os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    result = molctl("check", "tall", *sets, "--skip", "gpu", "--skip", "port", "--verify", "--json")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    checks = {c["id"]: (c["status"], c["detail"]) for c in result.json()["checks"]}
    assert checks["lock.engine.version"] == ("fail", f"vllm version: pinned 0.24.0, found 0.24.1 under {python}")
    assert checks["lock.engine.fingerprint"][0] == "fail"
    assert checks["lock.engine.kind"][0] == "pass"


def test_changed_template_fails(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    (layout.base / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    code, checks = cli.verify()
    assert code == ExitStatus.CHECK_FAILED
    fails = failures(checks)
    assert "lock.template" in fails and "pinned no template" in fails["lock.template"]
    assert "lock.base.chat_template.jinja" in fails  # a file of base/ the manifest does not pin


def test_changed_config_fails(cli, layout):
    assert cli.lock().exit_code == ExitStatus.OK
    cfg = json.loads((layout.base / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    (layout.base / "config.json").write_text(json.dumps(cfg))
    code, checks = cli.verify()
    fails = failures(checks)
    assert "dtype: pinned None, found 'float16'" in fails["lock.config"]
    assert "lock.base.config.json" in fails


# ------------------------------------------------------------------------- cache, resume, Ctrl-C
REAL_SHA256 = hashing_mod.sha256_file


class CountingHasher:
    """Wraps the real hasher; counts files; raises KeyboardInterrupt from call number `interrupt_at` on."""

    def __init__(self, interrupt_at: int | None = None):
        self.calls: list[str] = []
        self.completed: list[str] = []
        self.interrupt_at = interrupt_at

    def __call__(self, path, on_bytes=None, stop=None):
        self.calls.append(path)
        if self.interrupt_at is not None and len(self.calls) >= self.interrupt_at:
            raise KeyboardInterrupt  # and so does every later call the worker may still pick up
        digest = REAL_SHA256(path, on_bytes, stop)
        self.completed.append(path)
        return digest


def test_hash_cache_skips_unchanged_files(cli, layout, monkeypatch):
    hasher = CountingHasher()
    monkeypatch.setattr(hashing_mod, "sha256_file", hasher)
    first = cli.lock().json()
    assert len(hasher.calls) == first["files"] == first["hashed_files"]
    hasher.calls.clear()
    second = cli.lock().json()
    assert hasher.calls == [] and second["hashed_files"] == 0 and second["cached_files"] == second["files"]
    assert Path(first["manifest"]).exists() and Path(second["manifest"]).exists()
    assert (
        json.loads(Path(first["manifest"]).read_text())["shards"]
        == json.loads(Path(second["manifest"]).read_text())["shards"]
    )
    st = layout.shards[0].stat()
    os.utime(layout.shards[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third = cli.lock().json()
    assert hasher.calls == [str(layout.shards[0].resolve())] and third["hashed_files"] == 1


def test_interrupted_lock_resumes_and_leaves_no_manifest(cli, molctl, monkeypatch, tmp_path):
    total = 26 + 2 + 8
    first = CountingHasher(interrupt_at=6)
    monkeypatch.setattr(hashing_mod, "sha256_file", first)
    out = tmp_path / "chosen.json"
    result = cli.lock("--jobs", "1", "--output", str(out))
    assert result.exit_code == ExitStatus.INTERRUPTED
    assert not out.exists() and list(tmp_path.glob("*chosen*")) == []  # no manifest, no temp file
    assert len(first.completed) == 5

    second = CountingHasher(interrupt_at=6)
    monkeypatch.setattr(hashing_mod, "sha256_file", second)
    result = cli.lock("--jobs", "1")
    assert result.exit_code == ExitStatus.INTERRUPTED
    assert len(second.completed) == 5
    assert not set(second.calls) & set(first.completed)  # resumed: what the first run finished is not read again
    manifests = molctl.state_dir / "tall" / "manifests"
    assert not manifests.exists() or list(manifests.iterdir()) == []

    resumed = CountingHasher()
    monkeypatch.setattr(hashing_mod, "sha256_file", resumed)
    summary = cli.lock("--jobs", "1").json()
    done_before = set(first.completed) | set(second.completed)
    assert summary["hashed_files"] == len(resumed.calls) == total - 10
    assert summary["cached_files"] == len(done_before) == 10
    assert not set(resumed.calls) & done_before
    assert Path(summary["manifest"]).parent == manifests


def test_write_atomic_interrupted_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "m" / "lock.json"

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mff.json, "dump", boom)
    with pytest.raises(KeyboardInterrupt):
        mff.write_atomic(target, {"kind": mff.KIND})
    assert list((tmp_path / "m").iterdir()) == []


def test_hash_files_parallel_matches_hashlib(tmp_path):
    files = []
    for i in range(12):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(1000 * i + 7) * (3 if i % 2 else 1))
        files.append(p)
    cache = HashCache(tmp_path / "cache" / "hashes.json")
    run = hash_files(files, cache, jobs=4)
    assert run.sha256 == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    again = hash_files(files, HashCache(tmp_path / "cache" / "hashes.json"), jobs=4)
    assert again.hashed_files == 0 and again.sha256 == run.sha256
    full = hash_files(files, HashCache(tmp_path / "cache" / "hashes.json"), jobs=4, use_cache=False)
    assert full.hashed_files == 12
    files[0].unlink()  # a deleted file's entry is forgotten at the next save
    hash_files(files[1:], HashCache(tmp_path / "cache" / "hashes.json"), jobs=4)
    assert str(files[0].resolve()) not in HashCache(tmp_path / "cache" / "hashes.json").files
    assert str(files[1].resolve()) in HashCache(tmp_path / "cache" / "hashes.json").files


# --------------------------------------------------------------------------------- up --verify
def test_up_verify_refuses_a_swapped_adapter(molctl, layout, engine_python, free_ports):
    engine_port, proxy_port = free_ports
    args = [
        "--model-root",
        str(layout.root),
        "--set",
        f"engine.python={engine_python}",
        "--set",
        f"engine.port={engine_port}",
        "--set",
        f"proxy.port={proxy_port}",
    ]
    up = ["up", "tall", *args, "--skip", "gpu", "--allow-unauthenticated", "--verify", "--json"]
    result = molctl(*up)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert "lock.manifest" in result.json()["error"] and "nothing was started" in result.json()["error"]
    assert molctl("lock", "tall", *args).exit_code == ExitStatus.OK
    # the same name, other weights: seed 002's trust boundary
    weights = layout.adapter("L2") / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x5A
    weights.write_bytes(bytes(data))
    result = molctl(*up)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    failed = [c["id"] for c in result.json()["checks"] if c["status"] == "fail"]
    assert failed == ["lock.adapter.L2.adapter_model.safetensors"]
    assert not (molctl.state_dir / "tall" / "engine.json").exists()


# ------------------------------------------------------------------------- warn-level checks
@pytest.fixture
def check(molctl, free_ports):
    def run(root, *extra: str) -> dict:
        engine_port, proxy_port = free_ports
        result = molctl(
            "check",
            "tall",
            "--model-root",
            str(root),
            "--skip",
            "gpu",
            "--skip",
            "engine",
            "--set",
            f"engine.port={engine_port}",
            "--set",
            f"proxy.port={proxy_port}",
            "--json",
            *extra,
        )
        return {c["id"]: (c["status"], c["detail"]) for c in result.json()["checks"]}

    return run


def test_capacity_checks_pass_on_tall(check, layout):
    checks = check(layout.root)
    assert checks["adapter.max-lora-rank"][0] == "pass"
    assert checks["adapter.max-loras"][0] == "pass"
    assert not any(k.endswith(".moe") for k in checks)
    assert not any(k.startswith("lock.") for k in checks)  # only with --verify


def test_max_lora_rank_above_the_real_ranks_warns(check, layout):
    checks = check(layout.root, "--set", "engine.args.max-lora-rank=256")
    status, detail = checks["adapter.max-lora-rank"]
    assert status == "warn" and "--max-lora-rank 256" in detail and "largest adapter rank 64" in detail


def test_max_loras_below_four_warns(check, layout):
    status, detail = check(layout.root, "--set", "engine.args.max-loras=2")["adapter.max-loras"]
    assert status == "warn" and "--max-loras 2" in detail and "4 adapters" in detail
    status, detail = check(layout.root, "--set", "engine.args.max-loras=false")["adapter.max-loras"]
    assert status == "warn" and "default 1" in detail


def test_moe_expert_targets_warn(check, tmp_path):
    root = tmp_path / "moe"
    make_layout(
        root,
        model_type="qwen3_5_moe",
        shards=26,
        rank=64,
        base_name="Qwen/Qwen3.6-35B-A3B",
        experts=2,
        targets=("q_proj", "down_proj"),
    )
    checks = check(root)
    for route in ("L0", "L1", "L2", "L3"):
        status, detail = checks[f"adapter.{route}.moe"]
        assert status == "warn" and "down_proj" in detail and "does not validate MoE LoRA" in detail
    assert all(s != "fail" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "fail"}


def test_moe_experts_in_adapter_weights_warn(check, layout):
    from molctl.safetensors import write_file

    d = layout.adapter("L3")
    config = layout.adapter_config("L3")
    config["target_modules"] = ["q_proj", "v_proj", "experts"]
    layout.write_adapter_config("L3", config)
    tensors = {
        f"base_model.model.model.layers.0.self_attn.{t}.lora_{ab}.weight": ("BF16", (64, 16) if ab == "A" else (16, 64))
        for t in ("q_proj", "v_proj")
        for ab in "AB"
    }
    tensors["base_model.model.model.layers.0.mlp.experts.lora_A.weight"] = ("BF16", (2, 64, 16))
    write_file(d / "adapter_model.safetensors", tensors)
    status, detail = check(layout.root)["adapter.L3.moe"]
    assert status == "warn" and "under .experts. (3D)" in detail and "target_modules experts" in detail
    assert mf.adapter_moe_layout(d) == {"expert_tensors": 1, "dims": [3]}  # what `molctl lock` pins


def test_lock_refusals(molctl, layout, engine_python, tmp_path):
    root = ["--model-root", str(layout.root)]
    result = molctl("lock", "tall", *root, "--set", f"engine.python={tmp_path / 'nope' / 'python'}")
    assert result.exit_code == ExitStatus.CHECK_FAILED and "cannot fingerprint vllm" in result.stderr
    assert molctl("lock", "tall", *root, "--jobs", "0").exit_code == ExitStatus.USAGE
    layout.shards[2].unlink()
    result = molctl("lock", "tall", *root, "--set", f"engine.python={engine_python}")
    assert result.exit_code == ExitStatus.CHECK_FAILED and layout.shards[2].name in result.stderr


def test_default_jobs_follows_cores_and_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert hashing_mod.default_jobs() == 8
    dev = os.stat(tmp_path).st_dev
    queue = tmp_path / "sys" / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}" / "queue"
    queue.mkdir(parents=True)
    (queue / "rotational").write_text("0\n")
    assert hashing_mod.default_jobs(tmp_path, sysfs=str(tmp_path / "sys")) == 8
    (queue / "rotational").write_text("1\n")
    assert hashing_mod.default_jobs(tmp_path, sysfs=str(tmp_path / "sys")) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert hashing_mod.default_jobs(tmp_path, sysfs=str(tmp_path / "sys")) == 1


# ------------------------------------------------------------------- what an operator runs into
def test_non_regular_files_are_refused_without_hanging(cli, layout, molctl, tmp_path):
    """A FIFO would block the read forever and /dev/zero never ends: lock and verify name the
    file in one line instead (run as a subprocess with a timeout: a hang fails the test)."""
    sub = Molctl(molctl.state_dir)
    assert cli.lock().exit_code == ExitStatus.OK
    shard = layout.shards[2]
    shard.unlink()
    os.mkfifo(shard)
    result = sub("lock", "tall", *cli.args, timeout=60)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert result.stderr.strip() == f"molctl: error: {shard} is a FIFO, not a regular file"
    verify = sub(
        "check", "tall", *cli.args, "--skip", "gpu", "--skip", "port", "--verify", "--full-hash", "--json", timeout=60
    )
    assert verify.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in verify.stderr
    checks = {c["id"]: c for c in verify.json()["checks"]}
    assert checks[f"lock.shard.{shard.name}"]["status"] == "fail"
    assert "is a FIFO, not a regular file" in checks[f"lock.shard.{shard.name}"]["detail"]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    result = sub("lock", "tall", *cli.args, timeout=60)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert "is a character device, not a regular file (through a symlink to /dev/zero)" in result.stderr
    shard.unlink()
    shard.symlink_to(tmp_path / "nowhere")
    result = sub("lock", "tall", *cli.args, timeout=60)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert result.stderr.strip() == f"molctl: error: {shard} is a dangling symlink (to {tmp_path / 'nowhere'})"


@pytest.mark.parametrize("where", ["adapter", "base"])
def test_dangling_symlink_or_fifo_in_a_folder_is_one_line_exit_3(cli, layout, where):
    folder = layout.adapter("L1") if where == "adapter" else layout.base
    (folder / "extra.bin").symlink_to(folder / "nowhere")
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert (
        result.stderr.strip()
        == f"molctl: error: {folder / 'extra.bin'} is a dangling symlink (to {folder / 'nowhere'})"
    )
    (folder / "extra.bin").unlink()
    os.mkfifo(folder / "extra.bin")
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED and "extra.bin is a FIFO, not a regular file" in result.stderr


def test_output_is_checked_before_anything_is_hashed(cli, tmp_path, monkeypatch):
    hasher = CountingHasher()
    monkeypatch.setattr(hashing_mod, "sha256_file", hasher)
    result = cli.lock("--output", str(tmp_path))
    assert result.exit_code == ExitStatus.USAGE and "is a directory" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = cli.lock("--output", str(blocker / "lock.json"))
    assert result.exit_code == ExitStatus.ERROR
    assert result.stderr.strip().startswith(f"molctl: error: cannot write the manifest {blocker / 'lock.json'}: ")
    assert hasher.calls == [] and sorted(p.name for p in tmp_path.iterdir()) == ["file", "m", "state"]
    out = tmp_path / "new" / "dir" / "lock.json"  # missing folders are created
    assert cli.lock("--output", str(out)).exit_code == ExitStatus.OK
    assert [p.name for p in out.parent.iterdir()] == ["lock.json"]


def test_a_file_written_to_while_hashed_is_neither_pinned_nor_cached(cli, layout, molctl, monkeypatch):
    victim = str(layout.shards[1].resolve())

    def writer(path, on_bytes=None, stop=None):
        digest = REAL_SHA256(path, on_bytes, stop)
        if path == victim:
            with open(path, "ab") as fh:
                fh.write(b"more")
        return digest

    monkeypatch.setattr(hashing_mod, "sha256_file", writer)
    result = cli.lock("--jobs", "1")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert f"{layout.shards[1]} changed while it was being hashed" in result.stderr
    assert not (molctl.state_dir / "tall" / "manifests").exists() or not any(
        (molctl.state_dir / "tall" / "manifests").iterdir()
    )
    assert victim not in HashCache.in_state_dir(molctl.state_dir).files
    monkeypatch.setattr(hashing_mod, "sha256_file", REAL_SHA256)
    summary = cli.lock().json()
    m = json.loads(Path(summary["manifest"]).read_text())
    entry = next(e for e in m["shards"] if e["name"] == layout.shards[1].name)
    assert entry["sha256"] == hashlib.sha256(layout.shards[1].read_bytes()).hexdigest()
    assert entry["size"] == layout.shards[1].stat().st_size


def test_a_symlinked_file_is_pinned_with_its_target(cli, layout, tmp_path):
    moved = tmp_path / "elsewhere.safetensors"
    weights = layout.adapter("L2") / "adapter_model.safetensors"
    moved.write_bytes(weights.read_bytes())
    weights.unlink()
    weights.symlink_to(moved)
    m = json.loads(Path(cli.lock().json()["manifest"]).read_text())
    entry = next(e for e in m["adapters"]["L2"]["files"] if e["name"] == "adapter_model.safetensors")
    assert entry["real_path"] == str(moved) and entry["path"] == str(weights)
    assert all("real_path" not in e for e in m["shards"])
    other = tmp_path / "other.safetensors"
    other.write_bytes(moved.read_bytes()[:-1] + b"\x01")
    st = moved.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    weights.unlink()
    weights.symlink_to(other)  # retargeted: same size, same mtime, other bytes
    code, checks = cli.verify()
    status, detail = checks["lock.adapter.L2.adapter_model.safetensors"]
    assert status == "fail" and f"now a symlink to {other} (pinned: {moved})" in detail


@pytest.mark.parametrize(
    "text, problem",
    [
        ("garbage", "cannot be read"),
        ("[]", "is not a molctl lock manifest"),
        ('{"kind": "molctl.lock", "format": 1}', "field 'profile' is missing or not a str"),
        (
            '{"kind": "molctl.lock", "format": 1, "profile": "tall", "engine": "x", "argv": [], "env": {}, "config": {}, '
            '"capacity": {}, "shards": [], "base_files": [], "adapters": {}}',
            "field 'engine' is missing or not a dict",
        ),
        (
            '{"kind": "molctl.lock", "format": 1, "profile": "tall", "engine": {}, "argv": [], "env": {}, "config": {}, '
            '"capacity": {}, "shards": [{"name": 1}], "base_files": [3], "adapters": {}}',
            "field 'shards[0].name'",
        ),
        (
            '{"kind": "molctl.lock", "format": 1, "profile": "tall", "engine": {}, "argv": [], "env": {}, "config": {}, '
            '"capacity": {}, "shards": [], "base_files": [], "adapters": {"L0": {"files": [{"name": "a"}]}}}',
            "field 'adapters.L0.files[0].size'",
        ),
        (
            '{"kind": "molctl.lock", "format": 1, "profile": "tall", "engine": {}, "argv": [], "env": {}, "config": {}, '
            '"capacity": {}, "shards": [{"name": "../../../etc/shadow", "size": 1, "mtime_ns": 1, "sha256": "x"}], '
            '"base_files": [], "adapters": {}}',
            "field 'shards[0].name' '../../../etc/shadow' is not a path inside its folder",
        ),
        # were tracebacks: RecursionError from the JSON loader, ValueError (embedded null byte) from os.stat
        ('{"kind": "molctl.lock", "format": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "cannot be read"),
        (
            '{"kind": "molctl.lock", "format": 1, "profile": "tall", "engine": {}, "argv": [], "env": {}, "config": {}, '
            '"capacity": {}, "shards": [{"name": "a\\u0000b", "size": 1, "mtime_ns": 1, "sha256": "x"}], '
            '"base_files": [], "adapters": {}}',
            "field 'shards[0].name' 'a\\x00b' is not a path inside its folder",
        ),
    ],
)
def test_a_damaged_manifest_is_one_failing_check_not_a_traceback(cli, tmp_path, text, problem):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    code, checks = cli.verify("--manifest", str(bad))
    assert code == ExitStatus.CHECK_FAILED
    status, detail = checks["lock.manifest"]
    assert status == "fail" and str(bad) in detail and problem in detail, detail
    assert not any(k.startswith("lock.") and k != "lock.manifest" for k in checks)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../loras/L0/adapter_model.safetensors", "", 7, ["x"]])
def test_an_index_naming_a_shard_outside_base_is_refused(cli, layout, shard):
    index = layout.index()
    index["weight_map"][next(iter(index["weight_map"]))] = shard
    layout.write_index(index)
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert result.stderr.strip().startswith(
        f"molctl: error: {layout.base / mf.INDEX} names the shard {shard!r}, not a file inside {layout.base}"
    )


@pytest.mark.parametrize("name", ["config.json", mf.INDEX])
def test_lock_with_json_nested_too_deep_is_one_line(cli, layout, name):
    """Was a traceback: RecursionError escaped the JSON reader of `lock`."""
    (layout.base / name).write_text("[" * 100_000)
    result = cli.lock()
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert result.stderr.startswith(f"molctl: error: {layout.base / name}: maximum recursion depth exceeded")
    assert result.stderr.count("\n") == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_hanging_engine_python_is_one_line_and_leaves_no_process(molctl, layout, tmp_path, monkeypatch):
    """A wrapper script as engine.python that never answers (and started a child): after the
    timeout both are gone, and the error is one line (not the fingerprint script)."""
    pidfile = tmp_path / "child.pid"
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nsh -c 'echo $$ > {pidfile}; exec sleep 60' &\nwait\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(mf, "FINGERPRINT_TIMEOUT_S", 1)
    result = molctl("lock", "tall", "--model-root", str(layout.root), "--set", f"engine.python={wrapper}")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert (
        result.stderr == f"molctl: error: cannot fingerprint vllm under engine.python {wrapper}: no answer within 1 s\n"
    )
    assert not _alive(int(pidfile.read_text()))
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'no such module' >&2\nexit 4\n")
    broken.chmod(0o755)
    result = molctl("lock", "tall", "--model-root", str(layout.root), "--set", f"engine.python={broken}")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert result.stderr.endswith("it printed no fingerprint (exit 4: no such module)\n")


@pytest.mark.parametrize("damage", ["garbage{", "[]", '{"format": 1, "files": []}', "entries"])
def test_a_damaged_hash_cache_is_rebuilt_never_trusted(tmp_path, damage):
    files = [tmp_path / f"f{i}" for i in range(3)]
    for i, p in enumerate(files):
        p.write_bytes(os.urandom(100 + i))
    cache_path = tmp_path / "cache" / "hashes.json"
    cache_path.parent.mkdir()
    if damage == "entries":  # the right stat keys, values that are no digest
        entries = {}
        for p, bad in zip(files, ["nothex", 5, "0" * 63], strict=True):
            st = hashing_mod.stat_file(p)
            entries[st.real] = {**st.key(), "sha256": bad}
        cache_path.write_text(json.dumps({"format": 1, "files": entries}))
    else:
        cache_path.write_text(damage)
    run = hash_files(files, HashCache(cache_path), jobs=2)
    assert run.hashed_files == 3
    assert run.sha256 == {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert hash_files(files, HashCache(cache_path), jobs=2).hashed_files == 0  # rewritten whole


def test_full_hash_with_one_unreadable_file_reads_every_other_file_once(cli, layout, monkeypatch):
    """One file that cannot be read fails alone: the others are not hashed a second time, one by one."""
    assert cli.lock().exit_code == ExitStatus.OK
    bad = str(layout.shards[3].resolve())
    calls: list[str] = []

    def hasher(path, on_bytes=None, stop=None):
        calls.append(path)
        if path == bad:
            raise PermissionError(13, "Permission denied", path)
        return REAL_SHA256(path, on_bytes, stop)

    monkeypatch.setattr(hashing_mod, "sha256_file", hasher)
    code, checks = cli.verify("--full-hash")
    assert code == ExitStatus.CHECK_FAILED
    assert set(failures(checks)) == {f"lock.shard.{layout.shards[3].name}"}
    assert (
        failures(checks)[f"lock.shard.{layout.shards[3].name}"]
        == f"{layout.shards[3]} cannot be read: Permission denied"
    )
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 26 + 2 + 8


def test_a_manifest_that_is_no_regular_file_is_refused_without_reading_it(cli, tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        code, checks = cli.verify("--manifest", str(path))
        assert code == ExitStatus.CHECK_FAILED
        assert checks["lock.manifest"] == ("fail", f"manifest {path} is {kind}, not a regular file")


def test_credentials_in_a_url_value_and_other_secret_names_are_redacted(cli):
    """Found by the lock review: only names matching KEY|TOKEN|SECRET|PASSWORD were redacted, so a
    mirror URL with credentials (HF_ENDPOINT=https://user:pass@host/) or a *_PASSWD /
    *_CREDENTIALS variable was pinned in clear in the manifest (a file operators copy around)."""
    env = {
        "HF_ENDPOINT": "https://bob:hunter2@mirror.internal/hf",
        "NCCL_SOCKET_IFNAME": "eth0",
        "VLLM_DB_PASSWD": "pw-in-clear",
        "HF_CREDENTIALS": "cred-in-clear",
    }
    result = cli.lock(env=env)
    assert result.exit_code == ExitStatus.OK, result.stderr
    text = Path(result.json()["manifest"]).read_text()
    for secret in ("hunter2", "bob:", "pw-in-clear", "cred-in-clear"):
        assert secret not in text
    m = json.loads(text)
    assert m["env"]["HF_ENDPOINT"] == "https://<redacted>@mirror.internal/hf"
    assert m["env"]["VLLM_DB_PASSWD"] == m["env"]["HF_CREDENTIALS"] == "<redacted>"
    assert m["env"]["NCCL_SOCKET_IFNAME"] == "eth0"


# ------------------------------------------------------------------------ found running the commands on real layouts
PROFILES = Path(__file__).resolve().parents[2] / "profiles"


# ------------------------------------------------------------------------ two `lock` runs at once
def test_two_locks_in_the_same_second_keep_both_manifests(tmp_path, monkeypatch):
    """Found running two `molctl lock tiny` at once (different --set): both printed the same
    `lock-STAMP.json` and one manifest silently replaced the other (3 files for 6 runs)."""
    state = tmp_path / "state"
    profile = load_profile("tiny", [PROFILES], [("model_root", str(tmp_path / "m"))])
    # the same second for both runs: both pick the same free name before either writes
    monkeypatch.setattr(
        mff,
        "time",
        types.SimpleNamespace(
            monotonic=time.monotonic, strftime=time.strftime, gmtime=lambda now=None: time.gmtime(1796130000)
        ),
    )
    both_built = threading.Barrier(2, timeout=10)

    def build(profile, state_dir, jobs=None, progress=None, hasher=None, environ=None):
        both_built.wait()  # both have chosen their path (prepare_output) before either writes
        return {
            "profile": profile.name,
            "run": threading.current_thread().name,
            "summary": {},
            "engine": {"kind": "vllm", "version": "0"},
        }

    monkeypatch.setattr(mf, "build", build)
    results = {}
    runs = [
        threading.Thread(
            target=lambda: results.setdefault(threading.current_thread().name, mf.lock(profile, state)), name=f"run{i}"
        )
        for i in (1, 2)
    ]
    for t in runs:
        t.start()
    for t in runs:
        t.join(15)
    paths = {name: r.path for name, r in results.items()}
    assert len(set(paths.values())) == 2, paths
    for name, path in paths.items():
        assert json.loads(path.read_text())["run"] == name
    names = sorted(p.name for p in mff.manifest_dir(state, "tiny").iterdir())
    assert names == ["lock-20261201-130000-2.json", "lock-20261201-130000.json"], names


def test_an_explicit_output_is_still_replaced(cli, tmp_path):
    out = tmp_path / "pinned.json"
    out.write_text("old\n")
    assert cli.lock("--output", str(out)).exit_code == ExitStatus.OK
    assert json.loads(out.read_text())["kind"] == "molctl.lock"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# ------------------------------------------------------------------------------ symlink loops
@pytest.mark.parametrize("where", ["base", "adapter", "shard"])
def test_a_symlink_loop_in_a_folder_is_one_line_exit_3(cli, layout, where):
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
    assert (
        result.stderr.strip() == f"molctl: error: {folder / name} is a symlink loop (to {target}), not a regular file"
    )


def test_verify_with_a_symlink_loop_in_base_reports_it(cli, layout):
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
def test_an_unreadable_folder_in_an_adapter_is_refused(cli, layout, monkeypatch):
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
    assert (
        result.stderr.strip() == f"molctl: error: {sub} cannot be read: Permission denied (every file under "
        f"{layout.adapter('L3')} is pinned)"
    )


# ----------------------------------------------------------------- a manifest of another version
@pytest.mark.parametrize(
    "text, problem",
    [
        (
            '{"kind": "molctl.lock", "format": 2, "molctl_version": "9.0"}',
            "is a molctl lock manifest of format 2 (written by molctl 9.0); this molctl reads format 1",
        ),
        ('{"kind": "molctl.bench", "format": 1}', "field 'kind' is 'molctl.bench', expected 'molctl.lock'"),
        ("[1, 2]", "is not a molctl lock manifest: an array in JSON, expected an object"),
        ('"lock"', "is not a molctl lock manifest: a string in JSON, expected an object"),
    ],
)
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
    (d / "summary.json").write_text(
        text
        if text is not None
        else json.dumps({"run_id": run_id, "run_dir": str(d), "profile": profile, "results": []})
    )
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
        "give PROFILE (molctl bench PROFILE --compare ...) or the run directory"
    )
    result = molctl("bench", "tiny", "--compare", "20260101-000000", "20260101-000001", "--json")
    assert result.exit_code == ExitStatus.OK, result.stderr
    assert result.json()["a"]["profile"] == "tiny"


# --------------------------------------------------------------------------------- bench --series
@pytest.mark.parametrize(
    "value, problem",
    [
        ("base,L0,L5,mix", "unknown 'L5'"),
        ("base,,L0", "an empty item"),
        ("base,", "an empty item"),
        ("Base", "unknown 'Base'"),
    ],
)
def test_a_bad_series_names_the_bad_item(molctl, value, problem):
    """Found with `--series base,L0,L5,mix`: the error repeated the whole list without saying which
    item was wrong, and `base,,L0` was accepted while `--concurrency 1,,2` is refused."""
    result = molctl("bench", "tiny", "--series", value)
    assert result.exit_code == ExitStatus.USAGE, result.stderr
    assert result.stderr.strip() == (
        f"molctl: error: --series {value!r}: {problem}; expected a comma list of base,L0,L1,L2,L3,mix,proxy,canary"
    )


# ------------------------------------------------------------------------------- one-line errors
def test_an_error_naming_a_path_with_a_newline_is_one_line(tmp_path, molctl, engine_python):
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
