"""Each profile's persistent engine cache dir (issue 44): the default below the state dir, a
relative `engine.cache_dir` below STATE/PROFILE, an absolute or ~ one as given; the variables
each engine reads; a wrong type is the one-line profile error naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from molctl.enginecache import cache_dir, prepare, set_by
from molctl.engines import get_engine
from molctl.errors import ProfileError
from molctl.lifecycle.launch import engine_env
from molctl.profiles import load_profile, profile_dirs


def test_the_cache_dir_defaults_below_the_state_dir_and_follows_the_profile(tmp_path):
    state = tmp_path / "state"
    tiny = load_profile("tiny", profile_dirs())
    assert cache_dir(tiny, state) == state / "tiny" / "engine-cache"
    rel = load_profile("tiny", profile_dirs(), [("engine.cache_dir", "cache/vllm")])
    assert cache_dir(rel, state) == state / "tiny" / "cache" / "vllm"
    absolute = load_profile("tiny", profile_dirs(), [("engine.cache_dir", str(tmp_path / "shared"))])
    assert cache_dir(absolute, state) == tmp_path / "shared"
    home = load_profile("tiny", profile_dirs(), [("engine.cache_dir", "~/vllm-cache")])
    assert cache_dir(home, state) == Path.home() / "vllm-cache"


def test_prepare_says_whether_an_earlier_start_left_it_warm(tmp_path):
    tiny = load_profile("tiny", profile_dirs())
    first = prepare(tiny, tmp_path)
    assert first["warm"] is False and (Path(first["dir"]).stat().st_mode & 0o777) == 0o700
    (Path(first["dir"]) / "torch_compile_cache").mkdir()
    assert prepare(tiny, tmp_path) == {"dir": first["dir"], "warm": True}


def test_the_engine_reads_it_from_its_own_variables_and_engine_env_wins(tmp_path):
    tiny = load_profile("tiny", profile_dirs())
    assert engine_env(tiny, base={}, cache_dir=tmp_path)["VLLM_CACHE_ROOT"] == str(tmp_path)
    mine = load_profile("tiny", profile_dirs(), [("engine.env.VLLM_CACHE_ROOT", "/mine")])
    assert engine_env(mine, base={}, cache_dir=tmp_path)["VLLM_CACHE_ROOT"] == "/mine"
    assert get_engine("sglang").cache_env(tmp_path) == {
        "TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/inductor",
        "TRITON_CACHE_DIR": f"{tmp_path}/triton",
    }


def test_a_cache_dir_that_is_not_a_string_names_the_field():
    with pytest.raises(ProfileError, match="engine.cache_dir"):
        load_profile("tiny", profile_dirs(), [("engine.cache_dir", 5)])


def test_a_cache_variable_set_in_engine_env_is_the_dir_reported(tmp_path):
    """engine.env.VLLM_CACHE_ROOT wins at the engine, so `up` and `status` report that directory
    (and where it came from), not molctl's own, which is not created."""
    mine = tmp_path / "mine"
    (mine / "torch_compile_cache").mkdir(parents=True)
    profile = load_profile("tiny", profile_dirs(), [("engine.env.VLLM_CACHE_ROOT", str(mine))])
    state = tmp_path / "state"
    assert prepare(profile, state) == {"dir": str(mine), "warm": True, "set_by": "engine.env.VLLM_CACHE_ROOT"}
    assert cache_dir(profile, state) == mine and set_by(profile) == "engine.env.VLLM_CACHE_ROOT"
    assert not (state / "tiny" / "engine-cache").exists()
    assert prepare(load_profile("tiny", profile_dirs()), state)["dir"] == str(state / "tiny" / "engine-cache")


def test_the_engine_env_cache_root_is_the_one_dir_everywhere(tmp_path):
    """`check` probes, and `render` mounts and points the engine at, the directory engine.env's
    VLLM_CACHE_ROOT names, the one the engine uses; an SGLang variable (no cache root: each is a
    folder below molctl's dir) moves only itself."""
    from molctl.checks.cachedir import run
    from molctl.checks.result import Probes
    from molctl.render import RenderOptions, load_stack

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    profile = load_profile("tiny", profile_dirs(), [("engine.env.VLLM_CACHE_ROOT", str(a_file))])
    [result] = run(profile, Probes(state_dir=tmp_path / "state"))
    assert (result.status, result.detail) == (
        "fail",
        f"engine.env.VLLM_CACHE_ROOT {a_file} is not a directory "
        "(expected a directory the engine can write, or a path molctl can create)",
    )
    elsewhere = load_profile("tiny", profile_dirs(), [("engine.env.VLLM_CACHE_ROOT", str(tmp_path / "new"))])
    [result] = run(elsewhere, Probes(state_dir=tmp_path / "state"))
    assert result.status == "pass" and "by the engine (engine.env.VLLM_CACHE_ROOT)" in result.detail
    overrides = [("engine.env.VLLM_CACHE_ROOT", str(tmp_path / "new"))]
    stack = load_stack(
        "tiny",
        profile_dirs(),
        overrides,
        RenderOptions(),
        key_args=[],
        python="python3",
        state_dir=tmp_path / "state",
        proxy_profiles_dirs=[],
    )
    assert stack.cache_dir == tmp_path / "new" and stack.engine_env["VLLM_CACHE_ROOT"] == str(tmp_path / "new")
    sglang = load_profile(
        "tiny", profile_dirs(), [("engine.kind", "sglang"), ("engine.env.TRITON_CACHE_DIR", str(tmp_path / "t"))]
    )
    assert set_by(sglang) == "engine.cache_dir" and cache_dir(sglang, tmp_path) == tmp_path / "tiny" / "engine-cache"
