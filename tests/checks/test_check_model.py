"""`molctl check` on generated layouts with real safetensors headers (no GPU, no engine)."""

from __future__ import annotations

import json
import os
import struct

import pytest

from molctl.errors import ExitStatus
from tests.layouts import tall_layout, venti_layout


@pytest.fixture
def check(molctl, free_ports):
    def run(profile: str, root, *extra: str):
        engine_port, proxy_port = free_ports
        result = molctl(
            "check",
            profile,
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
        report = result.json()
        assert report["ok"] is (result.exit_code == ExitStatus.OK)
        return result.exit_code, report

    return run


def failures(report):
    return {c["id"]: c["detail"] for c in report["checks"] if c["status"] == "fail"}


def test_valid_tall_layout_passes(check, tmp_path):
    tall_layout(tmp_path / "m")
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.OK, failures(report)
    ids = {c["id"]: c["status"] for c in report["checks"]}
    assert ids["model.headers"] == "pass"
    assert ids["adapter.L3.targets"] == "pass"
    assert ids["engine.skipped"] == "skip" and ids["gpu.skipped"] == "skip"
    assert set(report) == {"profile", "ok", "checks"}
    assert all(set(c) == {"id", "status", "detail"} for c in report["checks"])


def test_valid_venti_layout_passes(check, tmp_path):
    venti_layout(tmp_path / "m")
    code, report = check("venti", tmp_path / "m")
    assert code == ExitStatus.OK, failures(report)
    assert any(c["id"] == "model.index" and "141 shards" in c["detail"] for c in report["checks"])


def test_bytes_after_the_tensor_data_fail_the_headers_check(check, tmp_path):
    """Bytes appended after the last tensor (a bad copy, a concatenation) passed; the safetensors
    loader refuses such a file (the data must end the file)."""
    layout = tall_layout(tmp_path / "m")
    shard = layout.shards[3]
    with open(shard, "ab") as fh:
        fh.write(b"\0" * 16)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert shard.name in failures(report)["model.headers"]
    assert "16 bytes after the tensor data" in failures(report)["model.headers"]


def test_truncated_shard(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    shard = layout.shards[7]
    os.truncate(shard, shard.stat().st_size - 10)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert shard.name in failures(report)["model.headers"]
    assert "truncated" in failures(report)["model.headers"]


def test_symlinked_shard(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    shard = layout.shards[3]
    real = tmp_path / "elsewhere.safetensors"
    shard.rename(real)
    shard.symlink_to(real)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.shards"]
    assert shard.name in detail and "symlink" in detail


def test_missing_shard(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    layout.shards[25].unlink()
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.shards"]
    assert layout.shards[25].name in detail and "missing" in detail


def test_wrong_shard_count(check, tmp_path):
    tall_layout(tmp_path / "m", shards=25)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "25 shard files, expected exactly 26" in failures(report)["model.index"]


def test_index_names_tensor_missing_from_shard(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    index = layout.index()
    index["weight_map"]["model.layers.4.mlp.gate_proj.weight"] = layout.shards[4].name
    layout.write_index(index)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.headers"]
    assert layout.shards[4].name in detail and "model.layers.4.mlp.gate_proj.weight" in detail


def test_wrong_model_type(check, tmp_path):
    tall_layout(tmp_path / "m", model_type="qwen3_moe")
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.config"]
    assert "'qwen3_moe'" in detail and "'qwen3_5_moe'" in detail and "config.json" in detail


def test_rank_32_on_venti(check, tmp_path):
    venti_layout(tmp_path / "m", rank=32)
    code, report = check("venti", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["adapter.L0.rank"]
    assert "r is 32" in detail and "r <= 16" in detail and "L0/adapter_config.json" in detail


def test_rank_16_on_tall(check, tmp_path):
    tall_layout(tmp_path / "m", rank=16)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "r == 64" in failures(report)["adapter.L1.rank"]


def test_rank_above_engine_max(check, tmp_path):
    venti_layout(tmp_path / "m", rank=16)
    code, report = check("venti", tmp_path / "m", "--set", "engine.args.max-lora-rank=8")
    assert code == ExitStatus.CHECK_FAILED
    assert "--max-lora-rank 8" in failures(report)["adapter.L0.rank"]


def test_adapter_declares_another_base(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    cfg = layout.adapter_config("L2")
    cfg["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    layout.write_adapter_config("L2", cfg)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["adapter.L2.base"]
    assert "meta-llama/Llama-3.1-8B" in detail and "Qwen3.6-35B-A3B" in detail
    assert set(failures(report)) == {"adapter.L2.base"}


@pytest.mark.parametrize(
    "declared, ok",
    [
        ("zai-org/GLM-5.2-FP8", True),
        ("/root/glm52_local", True),
        ("zai-org/GLM-5.2", True),
        ("zai-org/GLM-5.1-FP8", False),  # same architecture, another checkpoint: loads and does the wrong thing
        ("zai-org/GLM-5-FP8", False),
        ("zai-org/GLM-5.20", False),
        ("glm521", False),
    ],
)
def test_a_venti_adapter_must_name_glm_5_2_not_a_sibling_release(check, tmp_path, declared, ok):
    """A base name matches where the declared text does not go on with more version digits: the
    old substring rule (and the bare "GLM-5" in venti's list) passed adapters trained on GLM-5 or
    GLM-5.1, which share GLM-5.2's tensor names and shapes, so vLLM loads them without a word."""
    layout = venti_layout(tmp_path / "m")
    cfg = layout.adapter_config("L1")
    cfg["base_model_name_or_path"] = declared
    layout.write_adapter_config("L1", cfg)
    code, report = check("venti", tmp_path / "m")
    if ok:
        assert "adapter.L1.base" not in failures(report), failures(report)
    else:
        assert code == ExitStatus.CHECK_FAILED
        assert set(failures(report)) == {"adapter.L1.base"}
        assert repr(declared) in failures(report)["adapter.L1.base"]


@pytest.mark.parametrize("name", ["", "   ", " GLM-5.2"])
def test_a_blank_or_padded_base_name_is_refused(name):
    """ "" is in every declared base: `adapters.base_names: [""]` passed every adapter."""
    from molctl.errors import ProfileError
    from molctl.profiles import load_profile, profile_dirs

    with pytest.raises(ProfileError) as err:
        load_profile("venti", profile_dirs(), [("adapters.base_names", ["GLM-5.2", name])])
    assert "adapters.base_names[1]" in str(err.value) and "\n" not in str(err.value)


def test_adapter_targets_absent_modules(check, tmp_path):
    tall_layout(tmp_path / "m", targets=("q_proj", "c_attn"))
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["adapter.L0.targets"]
    assert "c_attn" in detail and "q_proj" not in detail


def test_missing_adapter_dir(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    for f in layout.adapter("L3").iterdir():
        f.unlink()
    layout.adapter("L3").rmdir()
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert str(layout.adapter("L3")) in failures(report)["adapter.L3.dir"]


def test_malformed_adapter_config(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    (layout.adapter("L1") / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["adapter.L1.config"]
    assert "L1/adapter_config.json" in detail and "not valid JSON" in detail


def test_adapter_weights_inconsistent_with_rank(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    cfg = layout.adapter_config("L0")
    cfg["r"] = 64
    layout.write_adapter_config("L0", cfg)
    # rewrite the weights with rank 32 shapes while the config says 64
    from molctl.safetensors import write_file

    write_file(
        layout.adapter("L0") / "adapter_model.safetensors",
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("BF16", (32, 16)),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ("BF16", (16, 32)),
        },
    )
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "lora_A.weight [32, 16]" in failures(report)["adapter.L0.weights"]


def test_model_root_is_symlink(check, tmp_path):
    tall_layout(tmp_path / "m")
    (tmp_path / "link").symlink_to(tmp_path / "m")
    code, report = check("tall", tmp_path / "link")
    assert code == ExitStatus.CHECK_FAILED
    assert "symlink" in failures(report)["model.root"]


def test_human_output_has_table_and_verdict(molctl, tmp_path, free_ports):
    tall_layout(tmp_path / "m", model_type="llama")
    result = molctl(
        "check",
        "tall",
        "--model-root",
        str(tmp_path / "m"),
        "--skip",
        "gpu",
        "--skip",
        "engine",
        "--set",
        f"engine.port={free_ports[0]}",
        "--set",
        f"proxy.port={free_ports[1]}",
    )
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert "model.config" in result.stdout and "FAIL" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("FAILED: profile tall would not start")


def _entry(shape, offsets, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


HOSTILE_HEADERS = {  # header bytes -> what the model.headers detail says (data: 8 zero bytes after the header)
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    "5000-digit integer": (
        b'{"x": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',
        "not valid JSON",
    ),
    "UTF-16": ("{}".encode("utf-16"), "not valid JSON"),
    "overlapping tensors": (json.dumps({"a": _entry([2], [0, 8]), "b": _entry([2], [0, 8])}).encode(), "overlaps"),
    "a gap before the data": (json.dumps({"a": _entry([1], [4, 8])}).encode(), "gap"),
    "negative dimensions": (json.dumps({"a": _entry([-1, -2], [0, 8])}).encode(), "malformed entry"),
    "float dimension": (json.dumps({"a": _entry([2.0], [0, 8])}).encode(), "malformed entry"),
    "__metadata__ a list": (json.dumps({"__metadata__": [1], "a": _entry([2], [0, 8])}).encode(), "__metadata__"),
    "__metadata__ a string": (json.dumps({"__metadata__": "x", "a": _entry([2], [0, 8])}).encode(), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_shard_header_is_a_failing_headers_check(check, tmp_path, case):
    """Crafted headers: a nested or huge-number header was a traceback (RecursionError, ValueError),
    the others passed although the safetensors loader rejects them."""
    raw, expected = HOSTILE_HEADERS[case]
    layout = tall_layout(tmp_path / "m")
    shard = layout.shards[3]
    layout.write_index(
        {
            "weight_map": {k: v for k, v in layout.index()["weight_map"].items() if v != shard.name}
            | {"a": shard.name, "b": shard.name, "x": shard.name}
        }
    )
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.headers"]
    assert shard.name in detail and expected in detail and "\n" not in detail


@pytest.mark.parametrize("shard", [["a"], 5, "../../outside.safetensors", "/etc/hostname"])
def test_index_assigning_a_tensor_to_a_non_name_or_a_path_out_of_base_fails(check, tmp_path, shard):
    """A list or a number as a shard was a traceback (unhashable / unorderable); a path out of base/
    was opened and its header read (`/etc/hostname`)."""
    layout = tall_layout(tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "m" / "base" / layout.shards[0].name).read_bytes())
    index = layout.index()
    index["weight_map"]["extra.weight"] = shard
    layout.write_index(index)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    detail = failures(report)["model.index"]
    assert "extra.weight" in detail and repr(shard) in detail and "inside" in detail


def test_shard_reached_through_a_symlinked_folder_out_of_base_fails(check, tmp_path):
    layout = tall_layout(tmp_path / "m")
    (tmp_path / "elsewhere").mkdir()
    layout.shards[0].rename(tmp_path / "elsewhere" / layout.shards[0].name)
    (layout.base / "sub").symlink_to(tmp_path / "elsewhere")
    index = layout.index()
    index["weight_map"] = {k: (f"sub/{v}" if v == layout.shards[0].name else v) for k, v in index["weight_map"].items()}
    layout.write_index(index)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "outside" in failures(report)["model.shards"] and layout.shards[0].name in failures(report)["model.shards"]


@pytest.mark.parametrize(
    "where,check_id",
    [
        ("base/model.safetensors.index.json", "model.index"),
        ("base/config.json", "model.config"),
        ("loras/L2/adapter_config.json", "adapter.L2.config"),
    ],
)
@pytest.mark.parametrize("text", ["[" * 100_000, "9" * 5000])
def test_json_nested_too_deep_or_with_a_huge_number_fails_the_check(check, tmp_path, where, check_id, text):
    """Was a traceback: RecursionError / ValueError (int max str digits) escaped the JSON loader."""
    tall_layout(tmp_path / "m")
    (tmp_path / "m" / where).write_text(text)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert where in failures(report)[check_id] and "not valid JSON" in failures(report)[check_id]


@pytest.mark.parametrize("targets", [{"q_proj": 1}, 5, ["q_proj", 7]])
def test_adapter_target_modules_of_the_wrong_type_fails(check, tmp_path, targets):
    """A dict passed silently, a number was a traceback (iterating an int)."""
    layout = tall_layout(tmp_path / "m")
    cfg = layout.adapter_config("L1")
    cfg["target_modules"] = targets
    layout.write_adapter_config("L1", cfg)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "target_modules is" in failures(report)["adapter.L1.targets"]


def test_adapter_base_with_a_nul_byte_fails_as_another_base(check, tmp_path):
    """Was a traceback: Path.resolve() raises ValueError on an embedded NUL."""
    layout = tall_layout(tmp_path / "m")
    cfg = layout.adapter_config("L1")
    cfg["base_model_name_or_path"] = "a\0b"
    layout.write_adapter_config("L1", cfg)
    code, report = check("tall", tmp_path / "m")
    assert code == ExitStatus.CHECK_FAILED
    assert "base_model_name_or_path" in failures(report)["adapter.L1.base"]


def _shard(path, header: dict, data: bytes, extra: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data + extra)


F32 = {"dtype": "F32"}


@pytest.mark.parametrize(
    "header, data, extra",
    [
        (
            {"a": {**F32, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32, "shape": [1], "data_offsets": [8, 12]}},
            12,
            0,
        ),
        (
            {"a": {**F32, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32, "shape": [1], "data_offsets": [8, 12]}},
            12,
            16,
        ),
        (
            {"a": {**F32, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32, "shape": [1], "data_offsets": [12, 16]}},
            16,
            0,
        ),
        (
            {"a": {**F32, "shape": [2], "data_offsets": [0, 8]}, "b": {**F32, "shape": [1], "data_offsets": [4, 8]}},
            8,
            0,
        ),
        ({"a": {**F32, "shape": [3], "data_offsets": [0, 8]}}, 8, 0),
        ({"a": {**F32, "shape": [2], "data_offsets": [0, 8]}}, 4, 0),
    ],
    ids=["valid", "trailing-bytes", "gap", "overlap", "shape-mismatch", "truncated"],
)
def test_the_header_check_agrees_with_the_safetensors_library(tmp_path, header, data, extra):
    """molctl's header reader is a stand-in for the loader the engine uses: it must refuse exactly
    what the real `safetensors` library (installed with the engine) refuses, and accept what it loads."""
    import safetensors  # installed with the engine (vllm) by `make test`

    from molctl.safetensors import HeaderError, read_header

    path = tmp_path / "x.safetensors"
    _shard(path, header, b"\0" * data, b"\0" * extra)
    try:
        with safetensors.safe_open(str(path), "np") as f:
            list(f.keys())
        real_ok = True
    except Exception:  # noqa: BLE001 - SafetensorError, whatever its module
        real_ok = False
    try:
        read_header(path)
        ours_ok = True
    except HeaderError:
        ours_ok = False
    assert ours_ok == real_ok, (ours_ok, real_ok)
    assert real_ok == (data == 12 and extra == 0)  # the cases are what they say
