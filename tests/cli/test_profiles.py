"""Profiles: the shipped ones, strict validation with file:line, overrides, user folders."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from molctl.engines import get_engine
from molctl.errors import ExitStatus, ProfileError
from molctl.profiles import builtin_profiles_dir, load_profile, load_profile_file, profile_dirs, route_instruction

BUILTIN = builtin_profiles_dir()


def argv(name: str) -> list[str]:
    p = load_profile(name, profile_dirs())
    return get_engine(p.engine.kind).launch_argv(p)


def test_venti_carries_the_upstream_flags():
    a = " ".join(argv("venti"))
    for expected in (
        "-m vllm.entrypoints.openai.api_server",
        "--model /root/glm52_local/base",
        "--served-model-name glm52-fp8-official",
        "--host 127.0.0.1",
        "--port 8000",
        "--attention-backend FLASHMLA_SPARSE",
        "--tensor-parallel-size 8",
        "--pipeline-parallel-size 1",
        "--gpu-memory-utilization 0.915",
        "--max-num-seqs 8",
        "--max-cudagraph-capture-size 8",
        "--enable-lora",
        "--max-lora-rank 16",
        "--max-loras 4",
        "--max-cpu-loras 4",
        "--enable-prefix-caching",
        "--max-model-len 262144",
        "--no-async-scheduling",
        "--reasoning-parser glm45",
        "--tool-call-parser glm47",
        "--enable-auto-tool-choice",
        "--enable-prompt-tokens-details",
        "--lora-modules L0=/root/glm52_local/loras/L0 L1=/root/glm52_local/loras/L1 "
        "L2=/root/glm52_local/loras/L2 L3=/root/glm52_local/loras/L3",
    ):
        assert expected in a
    p = load_profile("venti", profile_dirs())
    assert p.engine.env["VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER"] == "0"
    assert {"PYTHONPATH", "MOL_PATCH_WORKER", "VLLM_SCHEDULER_STEP_TRACE_MAX_STEPS"} <= set(p.engine.unset_env)
    assert (p.engine.start_timeout_s, p.engine.gpus, p.proxy.port) == (3600, 8, 8200)
    assert (p.model.shards, p.adapters.rank_max) == (141, 16)


def test_tall_carries_the_upstream_flags():
    a = " ".join(argv("tall"))
    for expected in (
        "--served-model-name macaron-tall-engine",
        "--max-lora-rank 64",
        "--enable-prompt-tokens-details",
        "--reasoning-parser qwen3",
        "--tool-call-parser qwen3_coder",
        "--enable-auto-tool-choice",
    ):
        assert expected in a
    assert "--attention-backend" not in a
    p = load_profile("tall", profile_dirs())
    assert "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER" not in p.engine.env
    assert (p.model.model_type, p.model.shards, p.adapters.rank_equals) == ("qwen3_5_moe", 26, 64)


def test_sglang_profile_and_adapter_naming():
    a = " ".join(argv("venti-sglang"))
    for expected in (
        "-m sglang.launch_server",
        "--model-path /root/glm52_local/base",
        "--tp 8",
        "--context-length 262144",
        "--mem-fraction-static 0.93",
        "--max-loras-per-batch 2",
        "--lora-use-virtual-experts",
        "--disable-overlap-schedule",
        "--disable-cuda-graph",
        "--enable-cache-report",
        "--lora-paths L0=/root/glm52_local/loras/L0",
    ):
        assert expected in a
    p = load_profile("venti-sglang", profile_dirs())
    # the harness's start_glm52_sglang_tp8_4lora.sh unsets its patch hooks before SGLang starts
    assert {"PYTHONPATH", "MOL_PATCH_WORKER", "MOL_MINI_PATCH"} <= set(p.engine.unset_env)
    assert get_engine("sglang").adapter_model(p, "L2") == "glm52-fp8-official:L2"
    assert get_engine("vllm").adapter_model(p, "L2") == "L2"


def test_route_instruction_built_from_descriptions():
    p = load_profile("tall", profile_dirs())
    text = route_instruction(p)
    assert "{{" not in text
    assert "L0 L1 L2 L3" in text and "\nL3 = UI generation" in text and "Macaron-V1-Tall" in text


def write_user_profile(folder: Path, text: str, name: str = "mine") -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def tiny_text() -> str:
    return (BUILTIN / "tiny.yaml").read_text().replace("name: tiny", "name: mine")


def test_unknown_key_names_file_line_and_field(tmp_path):
    text = tiny_text().replace("  port: 8100\n", "  port: 8100\n  prot: 9\n")
    path = write_user_profile(tmp_path, text)
    line = text.splitlines().index("  prot: 9") + 1
    with pytest.raises(ProfileError) as err:
        load_profile_file(path)
    assert str(err.value).startswith(f"{path}:{line}: field 'engine.prot': unknown key")


def test_bad_indentation_is_invalid_yaml_with_line(tmp_path):
    text = tiny_text().replace("  port: 8100\n", "  port: 8100\n   gpus: 0\n", 1)
    path = write_user_profile(tmp_path, text)
    with pytest.raises(ProfileError) as err:
        load_profile_file(path)
    line = text.splitlines().index("   gpus: 0") + 1
    assert str(err.value).startswith(f"{path}:{line}: invalid YAML")


def test_wrong_type(tmp_path):
    path = write_user_profile(tmp_path, tiny_text().replace("port: 8100", "port: eight-thousand"))
    with pytest.raises(ProfileError, match=r"field 'engine.port': expected an integer, got 'eight-thousand'"):
        load_profile_file(path)


def test_bad_name(tmp_path):
    path = write_user_profile(tmp_path, tiny_text().replace("name: mine", "name: My_Profile"), name="My_Profile")
    with pytest.raises(ProfileError, match=r"bad name 'My_Profile'"):
        load_profile_file(path)


def test_missing_required_field(tmp_path):
    path = write_user_profile(tmp_path, tiny_text().replace("served_model_name: Macaron-Tiny-Demo\n", ""))
    with pytest.raises(ProfileError, match=r"field 'served_model_name': missing"):
        load_profile_file(path)


def test_set_overrides_are_validated(tmp_path):
    p = load_profile("tiny", profile_dirs(), [("engine.port", 9100), ("engine.args.max-model-len", 4096)])
    assert p.engine.port == 9100 and p.engine.args["max-model-len"] == 4096
    with pytest.raises(ProfileError, match=r"\(--set engine.port\): field 'engine.port': expected an integer"):
        load_profile("tiny", profile_dirs(), [("engine.port", "x")])
    with pytest.raises(ProfileError, match=r"field 'engine.colour': unknown key"):
        load_profile("tiny", profile_dirs(), [("engine.colour", "red")])


def test_user_profiles_from_env_and_option(molctl, tmp_path):
    user = tmp_path / "user"
    write_user_profile(user, tiny_text())
    result = molctl("profiles", "--json")
    assert "mine" not in {p["name"] for p in result.json()["profiles"]}
    result = molctl("profiles", "--json", env={"MOLCTL_PROFILES_DIR": str(user)})
    assert result.exit_code == ExitStatus.OK
    rows = {p["name"]: p for p in result.json()["profiles"]}
    assert {"venti", "venti-sglang", "tall", "tiny", "mine"} <= set(rows)
    assert rows["mine"]["source"] == str(user / "mine.yaml")
    result = molctl("--profiles-dir", str(user), "profiles", "--json")
    assert "mine" in {p["name"] for p in result.json()["profiles"]}


def test_user_profile_replaces_builtin(molctl, tmp_path):
    user = tmp_path / "user"
    write_user_profile(user, (BUILTIN / "tiny.yaml").read_text().replace("port: 8300", "port: 8399"), name="tiny")
    result = molctl("--profiles-dir", str(user), "profiles", "--json")
    rows = {p["name"]: p for p in result.json()["profiles"]}
    assert rows["tiny"]["proxy_port"] == 8399


def test_profiles_lists_fields_and_reports_broken_files(molctl, tmp_path):
    result = molctl("profiles", "--json")
    assert result.exit_code == ExitStatus.OK
    venti = {p["name"]: p for p in result.json()["profiles"]}["venti"]
    assert venti == {
        **venti,
        "engine": "vllm",
        "served_model_name": "Macaron-V1-Venti",
        "gpus": 8,
        "engine_port": 8000,
        "proxy_port": 8200,
    }
    user = tmp_path / "user"
    write_user_profile(user, "name: broken\nengine: [\n", name="broken")
    result = molctl("--profiles-dir", str(user), "profiles")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert "broken.yaml" in result.stderr and "invalid YAML" in result.stderr
    assert "venti" in result.stdout


def test_check_with_bad_profile_exits_3_with_one_line(molctl, tmp_path):
    user = tmp_path / "user"
    write_user_profile(user, tiny_text().replace("  gpus: 0\n", "  gpus: 0\n  colour: red\n"))
    result = molctl("--profiles-dir", str(user), "check", "mine", "--json")
    assert result.exit_code == ExitStatus.CHECK_FAILED
    (check,) = result.json()["checks"]
    assert check["id"] == "profile.valid" and "field 'engine.colour': unknown key" in check["detail"]


def test_shipped_profiles_copy_is_loadable(tmp_path):
    # a user can copy a shipped profile into their own folder, rename it, and it validates
    shutil.copy(BUILTIN / "venti.yaml", tmp_path / "venti-b.yaml")
    text = (tmp_path / "venti-b.yaml").read_text().replace("name: venti\n", "name: venti-b\n")
    (tmp_path / "venti-b.yaml").write_text(text)
    assert load_profile_file(tmp_path / "venti-b.yaml").name == "venti-b"


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("max_inflight", 0, "must be > 0"),
        ("max_queue", -1, "must be > 0"),
        ("queue_timeout_s", 0, "must be > 0"),
        ("route_inflight", 0, "must be > 0"),
        ("summary_inflight", 0, "must be > 0"),
        ("max_queue", "lots", "proxy.max_queue"),
        ("metrics_port", 70000, "is not a TCP port"),
        ("metrics_port", 8300, "is also proxy.port"),
        ("metrics_port", 8301, "is also engine.port"),
        # YAML's .inf / .nan: an infinite queue deadline made every refusal a 500 (Retry-After overflow)
        ("queue_timeout_s", float("inf"), "must be a finite number > 0"),
        ("queue_timeout_s", float("nan"), "finite"),
        ("route_timeout_s", float("inf"), "finite"),
        ("queue_timeout_s", 10**400, "too large"),
        ("store_max_bytes", 2**60, "too large"),
        ("state_commit_ms", -1, "milliseconds from 0 to 1000"),
        ("state_commit_ms", 5000, "from 0 to 1000"),
        ("state_commit_ms", float("nan"), "from 0 to 1000"),
        ("state_commit_ms", "soon", "proxy.state_commit_ms"),
        ("state_commit_ms", True, "proxy.state_commit_ms"),
        # an integer too large for a float (`--set proxy.state_commit_ms=1000...0`): one line, not an OverflowError
        pytest.param("state_commit_ms", 10**400, "from 0 to 1000", id="state_commit_ms-10**400"),
    ],
)
def test_admission_and_metrics_fields_are_validated(field, value, expected):
    """One line naming the field; the metrics port differs from both other ports."""
    from molctl.profiles import load_profile, profile_dirs

    overrides = [("proxy.port", 8300), ("engine.port", 8301), (f"proxy.{field}", value)]
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), overrides)
    message = str(err.value)
    assert f"proxy.{field}" in message and expected in message and "\n" not in message
    ok = load_profile("tiny", profile_dirs(), [("proxy.metrics_port", 9464), ("proxy.max_inflight", 4)])
    assert ok.proxy.metrics_port == 9464 and ok.proxy.metrics_host == "127.0.0.1" and ok.proxy.max_inflight == 4


@pytest.mark.parametrize(
    "key, value, expected",
    [
        # YAML .nan/.inf and integers past a float: `render systemd` raised (ceil), `check` raised or
        # spent minutes building range(gpus), `up` without --timeout would have waited forever
        ("engine.start_timeout_s", float("nan"), "finite number > 0"),
        ("engine.start_timeout_s", float("inf"), "finite number > 0"),
        ("engine.start_timeout_s", 10**400, "10000000000000000000...: too large"),
        ("engine.gpus", 10**30, "expected a GPU count from 0 to 1024"),
        ("engine.gpus", 100_000_000, "expected a GPU count from 0 to 1024"),
        # `--set served_model_name=$UNSET`: a stack serving the model '' (YAML reads an empty value as '')
        ("served_model_name", "", "must not be empty"),
        ("base_model", " ", "must not be empty"),
        ("engine.served_name", "", "must not be empty"),
        ("engine.host", "", "must not be empty"),
        ("proxy.host", "", "must not be empty"),
        ("model_root", "", "must not be empty"),
        # accepted before: what the proxy or the model check made of them was untested
        ("proxy.summary_wait_s", float("nan"), "expected seconds from 0 to 3600"),
        ("proxy.summary_wait_s", -1, "expected seconds from 0 to 3600"),
        ("proxy.summary_wait_s", 10**30, "expected seconds from 0 to 3600"),
        ("model.shards", -2, "expected a shard count"),
        ("model.shards", 0, "expected a shard count"),
        ("adapters.rank_equals", 0, "expected a LoRA rank"),
        ("adapters.rank_equals", -8, "expected a LoRA rank"),
    ],
)
def test_numbers_and_names_out_of_range_are_one_line(key, value, expected):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), [(key, value)])
    message = str(err.value)
    assert f"(--set {key}): field '{key}'" in message and expected in message and "\n" not in message


def test_render_and_check_refuse_an_infinite_start_timeout(molctl):
    for args in (["render", "systemd", "tiny", "--allow-unauthenticated"], ["check", "tiny", "--skip", "engine"]):
        r = molctl(*args, "--set", "engine.start_timeout_s=.inf")
        assert r.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in r.stderr + r.stdout, r.stderr
        assert "engine.start_timeout_s" in r.stderr + r.stdout


def test_a_profile_file_that_is_not_utf8_is_one_warning(molctl, tmp_path):
    """A Latin-1 or binary NAME.yaml in a profiles folder was a UnicodeDecodeError traceback (exit 1)
    from `profiles`, and from `check`/`up` of any name; now one line naming the file."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "latin.yaml").write_bytes("name: latin\ndescription: caf\xe9\n".encode("latin-1"))
    listed = molctl("--profiles-dir", str(user), "profiles")
    assert listed.exit_code == ExitStatus.CHECK_FAILED and "tiny" in listed.stdout, listed.stderr
    assert f"molctl: warning: {user / 'latin.yaml'}: cannot read profile: not UTF-8 text" in listed.stderr
    check = molctl("--profiles-dir", str(user), "check", "latin", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED and "not UTF-8" in check.json()["checks"][0]["detail"]


def test_a_yaml_alias_bomb_is_one_line_not_a_hang(molctl, tmp_path):
    """Aliases of aliases ("billion laughs") in a profiles folder held `molctl profiles` past 60 s,
    using CPU and memory: construction stops at MAX_VALUES values with one line naming the file."""
    user = tmp_path / "user"
    user.mkdir()
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (user / "bomb.yaml").write_text("name: bomb\n" + "\n".join(levels) + "\n")
    listed = molctl("--profiles-dir", str(user), "profiles", timeout=60)
    assert listed.exit_code == ExitStatus.CHECK_FAILED and "tiny" in listed.stdout, listed.stderr
    assert f"{user / 'bomb.yaml'}: more than 100000 values" in listed.stderr, listed.stderr


def test_a_duplicate_key_names_its_line(tmp_path):
    """A duplicate key was reported without a line number."""
    from molctl.profileyaml import load_yaml_with_lines

    path = tmp_path / "dup.yaml"
    path.write_text("name: dup\nengine:\n  port: 1\n  port: 2\n")
    with pytest.raises(ProfileError) as err:
        load_yaml_with_lines(path)
    assert str(err.value) == f"{path}: line 4: duplicate key 'engine.port'"


def _user_profile(tmp_path: Path, old: str, new: str, name: str = "bad") -> tuple[Path, Path, int]:
    """A copy of tiny named NAME in its own folder with `old` replaced: (folder, file, the new text's line)."""
    text = re.sub(r"(?m)^name: tiny$", f"name: {name}", (BUILTIN / "tiny.yaml").read_text())
    assert old in text
    text = text.replace(old, new, 1)
    path = write_user_profile(tmp_path / "user", text, name=name)
    return path.parent, path, text[: text.index(new)].count("\n") + 1


@pytest.mark.parametrize(
    "value, expected",
    [
        ("9" * 5000, "'99999999999999999999...' (5000 digits): not a valid integer: more than 4300 digits"),
        # hexadecimal is read without the limit, but then no message could print the number
        ("0x" + "f" * 20000, "not a valid integer: more than 4300 digits"),
        ("9" * 4000, "99999999999999999999... is not a TCP port (1-65535)"),
    ],
)
def test_an_integer_past_the_int_string_limit_is_one_line(molctl, tmp_path, value, expected):
    """Python refuses int('9' * 5000) (4300 digits at most): PyYAML's constructor raised it, a
    67-line traceback (exit 1) from check/up, and `profiles` listed nothing (lifecycle review D1).
    A 4000-digit port was one line echoing all 4000 digits."""
    user, path, line = _user_profile(tmp_path, "  port: 8100\n", f"  port: {value}\n")
    check = molctl("--profiles-dir", str(user), "check", "bad", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in check.stderr, check.stderr
    detail = check.json()["checks"][0]["detail"]
    assert detail.startswith(f"{path}:{line}: field 'engine.port': ") and expected in detail, detail
    assert len(detail) < 300
    listed = molctl("--profiles-dir", str(user), "profiles")
    assert listed.exit_code == ExitStatus.CHECK_FAILED and "tiny" in listed.stdout
    (warning,) = listed.stderr.splitlines()
    assert warning.startswith(f"molctl: warning: {path}:{line}: field 'engine.port': ") and expected in warning
    assert len(warning) < 300


@pytest.mark.parametrize(
    "value, expected",
    [
        ("9" * 5000, "'99999999999999999999...' (5000 digits): not a valid integer: more than 4300 digits"),
        ("0x" + "f" * 20000, "not a valid integer: more than 4300 digits"),
        ("[1, " + "9" * 5000 + "]", "not a valid integer: more than 4300 digits"),
    ],
)
def test_a_set_integer_past_the_int_string_limit_is_one_line(molctl, value, expected):
    """`--set engine.port=999...9` was the same traceback; now one line naming the --set key."""
    check = molctl("check", "tiny", "--set", f"engine.port={value}", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in check.stderr, check.stderr
    detail = check.json()["checks"][0]["detail"]
    assert "tiny.yaml (--set engine.port): field 'engine.port': " in detail and expected in detail, detail
    assert len(detail) < 300


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2001-02-30", "'2001-02-30': not a valid timestamp: day is out of range for month"),
        ("!!timestamp soon", "'soon': not a valid timestamp"),
        ("!!int abc", "'abc': not a valid integer"),
        ("!!float abc", "'abc': not a valid number"),
        ("!!foo x", "'x': could not determine a constructor for the tag"),
    ],
)
def test_a_scalar_yaml_cannot_construct_is_one_line(molctl, tmp_path, value, expected):
    """The same family as the long integers (lifecycle review D1): other values PyYAML's constructor
    raises on (an impossible date, an explicit tag that does not fit) were tracebacks too."""
    user, path, line = _user_profile(tmp_path, "description: ", f"description: {value}\n#")
    check = molctl("--profiles-dir", str(user), "check", "bad", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED and "Traceback" not in check.stderr, check.stderr
    assert check.json()["checks"][0]["detail"].startswith(f"{path}:{line}: field 'description': {expected}")


SECRET_ENV = '    HF_TOKEN: "hf_SUPERSECRETTOKEN"\n'


@pytest.mark.parametrize(
    "old, new, field, expected",
    [
        (
            '    HF_HUB_OFFLINE: "1"\n',
            SECRET_ENV + "    HF_HUB_OFFLINE: [1]\n",
            "engine.env.HF_HUB_OFFLINE",
            "expected a string or an integer or a number or true/false, got [1]",
        ),
        (
            '    HF_HUB_OFFLINE: "1"\n',
            SECRET_ENV + "    HF_HUB_OFFLINE: {a: 1}\n",
            "engine.env.HF_HUB_OFFLINE",
            "got a mapping",
        ),
        ("    max-model-len: 2048\n", "    max-model-len: {a: 1}\n", "engine.args.max-model-len", "got a mapping"),
        ("    max-model-len: 2048\n", "    max-model-len: null\n", "engine.args.max-model-len", "got None"),
        # a list item: the item is named, not the list
        (
            "    max-model-len: 2048\n",
            "    max-model-len: [1, [2]]\n",
            "engine.args.max-model-len[1]",
            "expected a string or an integer or a number, got [2]",
        ),
    ],
)
def test_a_bad_entry_of_a_mapping_field_names_its_key_and_only_its_value(molctl, tmp_path, old, new, field, expected):
    """A wrong-typed entry of engine.env or engine.args named only the parent field, at the parent's
    line, and printed the whole mapping, HF_TOKEN's value included, in check, profiles, render and
    up (lifecycle review D2): the entry is named with its own line and value, nothing else."""
    user, path, line = _user_profile(tmp_path, old, new)
    line += new.count("\n") - 1  # the entry is the last line written
    want = f"{path}:{line}: field '{field}': "
    check = molctl("--profiles-dir", str(user), "check", "bad", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED
    detail = check.json()["checks"][0]["detail"]
    assert detail.startswith(want) and detail.endswith(expected), detail
    listed = molctl("--profiles-dir", str(user), "profiles")
    rendered = molctl("--profiles-dir", str(user), "render", "systemd", "bad", "--allow-unauthenticated")
    started = molctl("--profiles-dir", str(user), "up", "bad", "--allow-unauthenticated")
    for result in (listed, rendered, started):
        assert result.exit_code == ExitStatus.CHECK_FAILED and detail in result.stderr, result.stderr
    for result in (check, listed, rendered, started):
        assert (
            "SUPERSECRET" not in result.stdout + result.stderr
            and "TRANSFORMERS_OFFLINE" not in result.stdout + result.stderr
        )


@pytest.mark.parametrize(
    "key, value, expected",
    [
        (
            "engine.env.HF_HUB_OFFLINE",
            "[1]",
            "field 'engine.env.HF_HUB_OFFLINE': expected a string or an integer or a number or true/false, got [1]",
        ),
        (
            "proxy.sampling_defaults.top_p",
            "[0.9]",
            "field 'proxy.sampling_defaults.top_p': expected a string or an integer",
        ),
        ("prompts.adapters.L1", "7", "field 'prompts.adapters.L1': expected a string, got 7"),
        ("engine.unset_env", "[PYTHONPATH, 7]", "field 'engine.unset_env[1]': expected a string, got 7"),
    ],
)
def test_a_bad_set_entry_of_a_mapping_or_list_field_names_its_key(key, value, expected):
    """The same through --set, and for every mapping or list field: the entry, not the parent."""
    from molctl.profileyaml import parse_set_option

    with pytest.raises(ProfileError) as err:
        load_profile(
            "tiny", profile_dirs(), [("engine.env.HF_TOKEN", "hf_SUPERSECRETTOKEN"), parse_set_option(f"{key}={value}")]
        )
    message = str(err.value)
    assert f"tiny.yaml (--set {key}" in message and expected in message and "SUPERSECRET" not in message, message


@pytest.mark.parametrize(
    "old, new, field, expected",
    [
        (
            '    HF_HUB_OFFLINE: "1"\n',
            '    HF_HUB_OFFLINE: "1"\n    "A=B": "1"\n',
            "engine.env.A=B",
            "'A=B': an environment variable name cannot contain '='",
        ),
        (
            '    HF_HUB_OFFLINE: "1"\n',
            '    HF_HUB_OFFLINE: "1"\n    "": "1"\n',
            "engine.env.",
            "an environment variable name must not be empty",
        ),
        (
            '    HF_HUB_OFFLINE: "1"\n',
            '    HF_HUB_OFFLINE: "1"\n    "A\\0B": "1"\n',
            "engine.env.A\\x00B",
            "contains a NUL byte",
        ),
        (
            '    HF_HUB_OFFLINE: "1"\n',
            '    HF_HUB_OFFLINE: "1\\0x"\n',
            "engine.env.HF_HUB_OFFLINE",
            "contains a NUL byte",
        ),
        ("    dtype: bfloat16\n", '    dtype: "bfloat16\\0"\n', "engine.args.dtype", "contains a NUL byte"),
        ("    dtype: bfloat16\n", '    dtype: [a, "b\\0"]\n', "engine.args.dtype[1]", "contains a NUL byte"),
        (
            "    - PYTHONPATH\n",
            "    - PYTHONPATH=x\n",
            "engine.unset_env[0]",
            "an environment variable name cannot contain '='",
        ),
        ("    - PYTHONPATH\n", '    - "PYTHON\\0PATH"\n', "engine.unset_env[0]", "contains a NUL byte"),
        ("  served_name: tiny-mol-base\n", '  served_name: "tiny\\0"\n', "engine.served_name", "contains a NUL byte"),
        ("  host: 127.0.0.1\n", '  host: "127.0.0.1\\0"\n', "engine.host", "contains a NUL byte"),
    ],
)
def test_what_exec_refuses_fails_the_profile_not_the_start(molctl, tmp_path, old, new, field, expected):
    """An env name with '=' or a NUL byte in an env or args value passed `check`; `up` then crashed
    in subprocess with a traceback (exit 1), and `switch` had already stopped the running stack
    (lifecycle review D3). The validator refuses them: one line, exit 3, nothing started or stopped."""
    user, path, line = _user_profile(tmp_path, old, new)
    line += new.count("\n") - 1
    check = molctl("--profiles-dir", str(user), "check", "bad", "--json")
    assert check.exit_code == ExitStatus.CHECK_FAILED
    detail = check.json()["checks"][0]["detail"]
    assert detail.startswith(f"{path}:{line}: field '{field}': ") and expected in detail and "\0" not in detail, detail
    started = molctl("--profiles-dir", str(user), "up", "bad", "--allow-unauthenticated")
    assert (
        started.exit_code == ExitStatus.CHECK_FAILED and detail in started.stderr and "Traceback" not in started.stderr
    )


@pytest.mark.parametrize(
    "key, value, expected",
    [
        # one argv or environment string is at most 128 KiB on Linux (MAX_ARG_STRLEN): exec fails E2BIG
        ("engine.args.chat-template", "x" * 200_000, "200000 bytes: one command-line argument or environment"),
        ("engine.env.BIG", "x" * 200_000, "200004 bytes"),
        # not encodable for exec (a lone surrogate, from code or a record)
        ("engine.env.A", "\ud800", "not encodable"),
        ("engine.python", "/usr/bin/py\0", "contains a NUL byte"),
        ("model_root", "/models\0", "contains a NUL byte"),
        ("proxy.host", "127.0.0.1\0", "contains a NUL byte"),
    ],
)
def test_what_exec_refuses_through_set_is_one_line(key, value, expected):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), [(key, value)])
    message = str(err.value)
    assert f"(--set {key}): field '{key}': " in message and expected in message and len(message) < 400, message


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("logs.backups", 10**12, "1000000000000: expected a part count from 0 to 1000"),
        ("logs.backups", 1001, "1001: expected a part count from 0 to 1000"),
        ("logs.backups", -1, "-1: expected a part count from 0 to 1000"),
        ("logs.keep", 10**30, "10000000000000000000...: expected a file count from 1 to 1000"),
        ("logs.keep", 0, "0: expected a file count from 1 to 1000"),
    ],
)
def test_log_retention_counts_are_bounded(key, value, expected):
    """`logs.backups=1000000000000` made the proxy's rotation thread loop over that many part
    names at 100% CPU, the log never rotated (lifecycle review D7): both counts are bounded."""
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), [(key, value)])
    assert f"(--set {key}): field '{key}': {expected}" in str(err.value)
    assert getattr(load_profile("tiny", profile_dirs(), [(key, 1000)]).logs, key.split(".")[1]) == 1000


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.symlink_to(p.parent / "gone" / "bad.yaml"), "is a dangling symbolic link"),
        (lambda p: p.symlink_to(p), "Too many levels of symbolic links"),
        (lambda p: os.mkfifo(p), "is not a regular file"),
    ],
)
def test_a_profile_entry_that_is_not_a_readable_file_is_named(molctl, tmp_path, make, expected):
    """A bad.yaml in a profile folder that is a directory or a dangling symlink was skipped: `up bad`
    said "no profile named 'bad'" and `profiles` warned about nothing (lifecycle review D9). It is
    named like a file that does not load; a FIFO is refused without being opened (a read would block)."""
    user = tmp_path / "user"
    user.mkdir()
    make(user / "bad.yaml")
    os.symlink(user / "gone.yaml", user / ".#bad.yaml")  # an editor's lock link: not a profile name, ignored
    for args in (["check", "bad", "--json"], ["up", "bad", "--allow-unauthenticated"]):
        result = molctl("--profiles-dir", str(user), *args)
        assert result.exit_code == ExitStatus.CHECK_FAILED
        out = result.json()["checks"][0]["detail"] if "--json" in args else result.stderr
        assert f"{user / 'bad.yaml'}: cannot read profile: {expected}" in out and "no profile named" not in out, out
    listed = molctl("--profiles-dir", str(user), "profiles")
    assert listed.exit_code == ExitStatus.CHECK_FAILED and "tiny" in listed.stdout
    (warning,) = listed.stderr.splitlines()
    assert warning.startswith(f"molctl: warning: {user / 'bad.yaml'}: cannot read profile: {expected}"), warning


def test_set_values_yaml_cannot_make_are_the_text_itself(molctl):
    """`--set engine.env.PASS=!secret` (a YAML tag to the parser) was always the text; reading --set
    values like files made it an error (the review of that change)."""
    for value in ("!secret", "!x y", "<<", "{a: 1, a: 2}"):
        r = molctl("render", "systemd", "tiny", "--allow-unauthenticated", "--set", f"engine.env.X={value}")
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert f'Environment="X={value}"' in r.stdout or f"Environment=X={value}" in r.stdout, r.stdout
