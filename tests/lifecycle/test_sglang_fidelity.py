"""SGLang stand-ins held to what SGLang does: tests/fake_sglang.py, tests/fake_sglang_pkg and
molctl/engines/sglang.py checked against sgl-project/sglang (its argument parser, flag aliases,
context-window rule and errors, metric names)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from molctl.engines.sglang import ENGINE
from molctl.profiles import load_profile, profile_dirs
from tests.helpers import free_port, free_ports
from tests.procs import (
    FAKE_SGLANG_PKG,
    ROOT,
    fake_engine_python,
    fake_sglang_argv,
    proxy_argv,
    running,
    sglang_health_request_timeout,
)

sys.path.insert(0, str(FAKE_SGLANG_PKG))
from sglang.srt.server_args import prepare_server_args  # noqa: E402  (the fake package's parser)

VENTI = load_profile("venti-sglang", profile_dirs())


def probe(python: Path) -> frozenset[str]:
    install = ENGINE.probe_install(str(python))
    assert install.found and not install.error, install
    return install.flags


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> Path:
    return fake_engine_python(tmp_path_factory.mktemp("py") / "python")


def test_the_fake_launcher_refuses_an_unknown_flag():
    """launch_server.py: prepare_server_args(sys.argv[1:]) -> parser.parse_args (server_args.py):
    SGLang has no vLLM-style --max-model-len; the launch ends at once, exit 2."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fake_sglang.py"), "--model-path", "/m", "--max-model-len", "2048"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "unrecognized arguments: --max-model-len 2048" in proc.stderr


def test_venti_sglang_argv_parses_with_sglangs_parser():
    argv = ENGINE.launch_argv(VENTI)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = prepare_server_args(argv[3:])
    assert args.tensor_parallel_size == 8 and args.lora_paths[0].startswith("L0=")


def test_the_flag_probe_takes_aliases_and_abbreviations(fake_python):
    """server_args.py declares `--tensor-parallel-size`, `--tp-size` (and `--model-path`,
    `--model`) in one add_argument call; `--tp` is no option of its own but argparse's
    abbreviation of --tp-size (SGLang's docs use `--tp 2`). The probe read only the first string
    of each call, so venti-sglang's `tp` failed engine.flags against a real install."""
    flags = probe(fake_python)
    assert {"tp", "tp-size", "tensor-parallel-size", "model", "model-path"} <= flags
    assert "max-model-len" not in flags and "lora" not in flags  # unknown; ambiguous (--lora-paths, --lora-use-...)
    assert set(ENGINE.profile_flags(VENTI)) <= flags


def test_the_flag_probe_reads_the_source_where_sglang_does_not_import(fake_python, tmp_path):
    """On a host without CUDA `sglang.srt.server_args` does not import: the probe reads the source,
    the add_argument form (0.5.13) and the dataclass form of PR #28814/#28919 (June 2026: field
    `tp_size: A[int, Arg(aliases=["--tensor-parallel-size"])]`, also in srt/arg_groups/)."""
    pkg = tmp_path / "sglang"
    shutil.copytree(FAKE_SGLANG_PKG / "sglang", pkg)
    shutil.copytree(FAKE_SGLANG_PKG / "sglang-0.5.13.post1.dist-info", tmp_path / "sglang-0.5.13.post1.dist-info")
    src = pkg / "srt" / "server_args.py"
    src.write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n" + src.read_text())
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    assert probe(python) == probe(fake_python)

    src.write_text(
        textwrap.dedent("""\
        raise ImportError("no CUDA")
        class ServerArgs:
            model_path: A[
                str,
                Arg(help="The path.", aliases=["--model"]),
            ]
            host: A[str, "The host of the HTTP server."] = "127.0.0.1"
            enable_dsa_prefill_context_parallel: A[bool, Arg(help="x", no_cli=True)] = False

            @staticmethod
            def add_cli_args(parser):
                add_cli_args_from_dataclass(parser, ServerArgs)
                parser.add_argument(
                    "--reasoning-parser",
                    type=str,
                )
        """)
    )
    (pkg / "srt" / "arg_groups" / "fields").mkdir(parents=True)
    (pkg / "srt" / "arg_groups" / "fields" / "parallel.py").write_text(
        textwrap.dedent("""\
        class ParallelFields:
            tp_size: A[
                int,
                Arg(
                    help="The tensor parallelism size.",
                    aliases=["--tensor-parallel-size"],
                ),
            ] = 1
        """)
    )
    flags = probe(python)
    assert {"model-path", "model", "host", "reasoning-parser", "tp-size", "tp", "tensor-parallel-size"} <= flags
    assert not any(f.startswith("enable-dsa") for f in flags)


@pytest.fixture(scope="module")
def strict_sglang(tmp_path_factory):
    """The fake SGLang in strict mode with a 100-token window (--context-length 100), and the
    venti-sglang proxy in front of it."""
    logs = tmp_path_factory.mktemp("logs")
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    keys = logs / "keys"
    keys.write_text("sk-review")
    keys.chmod(0o600)
    argv = fake_sglang_argv(
        engine_port, VENTI.engine.served_name, "/models/loras", {"strict": True}, True, "--context-length", "100"
    )
    with (
        running(
            argv, engine_url + "/health", log=logs / "engine.log", ready_request_timeout=sglang_health_request_timeout()
        ),
        running(
            proxy_argv("venti-sglang", engine_url, proxy_port, "--api-key-file", str(keys)),
            proxy_url + "/health",
            log=logs / "proxy.log",
        ),
    ):
        yield engine_url, proxy_url


def _chat(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_the_window_rule_is_sglangs(strict_sglang):
    """TokenizerManager._validate_one_request: input >= context_len, or input + max_new_tokens >=
    context_len, is a 400 with SGLang's messages and its top-level error body (serving_base.py
    create_error_response); vLLM's rule (`>`) and messages were scripted instead."""
    engine_url, _ = strict_sglang
    model = f"{VENTI.engine.served_name}:L1"
    words = " ".join(["w"] * 90)  # 90 words + 4 per message: 94 tokens by the fake's count
    r = _chat(engine_url, {"model": model, "max_tokens": 6, "messages": [{"role": "user", "content": words}]})
    assert r.status_code == 400
    body = r.json()
    assert body["object"] == "error" and body["type"] == "BadRequestError" and "error" not in body
    assert body["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 100 "
        "tokens. You requested a total of 100 tokens: 94 tokens"
    )
    assert (
        _chat(
            engine_url, {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": words}]}
        ).status_code
        == 200
    )
    long = " ".join(["w"] * 96)
    r = _chat(engine_url, {"model": model, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    assert r.json()["message"] == "The input (100 tokens) is longer than the model's context length (100 tokens)."


def test_sglangs_window_errors_reach_the_client_as_context_length_exceeded(strict_sglang):
    _, proxy_url = strict_sglang
    long = "[route:L1] " + " ".join(["w"] * 120)
    r = _chat(
        proxy_url, {"model": VENTI.served_model_name, "messages": [{"role": "user", "content": long}]}, key="sk-review"
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "context length" in err["message"]


@pytest.mark.parametrize(
    "name, flag, sends_limit", [("venti", "max-model-len", True), ("venti-sglang", "context-length", False)]
)
def test_the_answer_hop_never_asks_sglang_for_its_whole_window(name, flag, sends_limit):
    """vLLM takes prompt + max_tokens == max-model-len; SGLang refuses input + max_new_tokens >=
    context-length (TokenizerManager._validate_one_request; sglang test/srt/
    test_request_length_validation.py). With no client limit the answer hop sends
    proxy.max_output_tokens only where it fits: a prompt whose bound fills the rest of SGLang's
    window exactly must not get it (the engine then gives the room left)."""
    from molctl.engines import get_engine
    from molctl.profiles import load_profile, profile_dirs
    from molctl.proxy.pipeline.run import Orchestrator, prompt_token_bound
    from molctl.proxy.store.memory import MemoryStore

    def payload(window: int, limit: int) -> tuple[dict, int]:
        profile = load_profile(
            name, profile_dirs(), [(f"engine.args.{flag}", window), ("proxy.max_output_tokens", limit)]
        )
        orch = Orchestrator(profile, get_engine(profile.engine.kind), None, MemoryStore())
        plan = orch.prepare(
            {"model": profile.served_model_name, "messages": [{"role": "user", "content": "hello " * 50}]}, "t"
        )
        plan.route = "L2"
        built = orch._build_answer(plan)
        return built, prompt_token_bound(plan.view, None)

    _, bound = payload(100_000, 1000)
    built, _ = payload(bound + 1000, 1000)  # the bound plus the limit is the whole window
    assert (built.get("max_tokens") == 1000) is sends_limit, built.get("max_tokens")
    built, _ = payload(bound + 1001, 1000)  # one token more: both engines take it
    assert built.get("max_tokens") == 1000


def test_bench_counts_an_sglang_counter_born_during_the_run(tmp_path):
    """SGLang's counters are labelled (model_name): prometheus_client exposes none before its first
    `.labels(...).inc()`, and `sglang:cached_tokens_total` is only incremented `if cached_tokens > 0`
    (metrics/collector.py TokenizerMetricsCollector.observe_one_finished_request). On a fresh engine
    the warm-up request hit no cache, so the counter appears during the first bench series: its
    delta is its value, not "missing" (bench reported cached_tokens as missing)."""
    from molctl.bench.measure import _engine_delta, parse_metrics

    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    argv = fake_sglang_argv(port, VENTI.engine.served_name, "/models/loras", {}, True, "--enable-metrics")
    with running(
        argv, engine_url + "/health", log=tmp_path / "engine.log", ready_request_timeout=sglang_health_request_timeout()
    ):
        before = parse_metrics(httpx.get(engine_url + "/metrics").text)
        assert "sglang:num_requests_total" in before and "sglang:cached_tokens_total" not in before
        r = httpx.post(
            engine_url + "/v1/chat/completions",
            timeout=30,
            json={"model": f"{VENTI.engine.served_name}:L1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        after = parse_metrics(httpx.get(engine_url + "/metrics").text)
    delta = _engine_delta("sglang", before, after)
    assert (
        delta["missing"] == [] and delta["deltas"]["cached_tokens"] == 4 and delta["deltas"]["requests_finished"] == 1
    )
    # a counter that is gone afterwards (an engine restarted between the scrapes) stays missing
    assert "cached_tokens" in _engine_delta("sglang", after, before)["missing"]


@pytest.mark.parametrize("flag, value", [("--tool-call-parser", "glm5"), ("--reasoning-parser", "glm47")])
def test_the_fake_launcher_refuses_an_unknown_parser(flag, value):
    """server_args.py: `--reasoning-parser` takes `choices=list(ReasoningParser.DetectorMap.keys())`,
    `--tool-call-parser` `choices=list(FunctionCallParser.ToolCallParserEnum.keys())`: a parser
    SGLang does not have ends the launch (exit 2); the fake took any string. venti-sglang's
    (glm45 reasoning, glm47 tool calls, docs/basic_usage/glm45.md) parse."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fake_sglang.py"), "--model-path", "/m", flag, value],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and f"argument {flag}: invalid choice: '{value}'" in proc.stderr
    args = prepare_server_args(ENGINE.launch_argv(VENTI)[3:])
    assert (args.reasoning_parser, args.tool_call_parser) == ("glm45", "glm47")
