"""The adapter efficacy canary (molctl.lifecycle.canary): `up`/`switch` prove each adapter changes the base
model's greedy output before the proxy starts; an adapter with no effect fails the start (exit 7)
and leaves no process; two identical adapters are a warning; the result is in `status` and the
engine log; `--skip adapter-effect` or `adapters.effect_canary: false` turns it off, recorded;
`check --live` and `bench` run the same canary. Against the fake vLLM and the fake SGLang
(their `no_effect` / `same_as` config, FAKE_NO_EFFECT / FAKE_SAME_AS in the engine's env)."""

from __future__ import annotations

import json

import pytest

from molctl.engines.base import Sample
from molctl.errors import ExitStatus
from molctl.lifecycle.canary import TOLERANCE, difference
from tests.lifecycle_host import Host, gone, port_free
from tests.sglang_host import SGL, SglHost


@pytest.fixture(params=["vllm", "sglang"])
def host(request, tmp_path):
    h = Host(tmp_path) if request.param == "vllm" else SglHost(tmp_path)
    h.name = "tiny" if request.param == "vllm" else SGL
    yield h
    h.cleanup()


@pytest.fixture
def vhost(tmp_path):
    h = Host(tmp_path)
    yield h
    h.cleanup()


def engine_log(host, name) -> str:
    return host.molctl("logs", name, "--component", "engine", "-n", "400").stdout


def test_the_canary_passes_and_lands_in_status_and_the_engine_log(host):
    r = host.up("--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    result = json.loads(r.stdout)
    assert result["canary"]["status"] == "pass" and result["canary"]["no_effect"] == []
    assert set(result["canary"]["adapters"]) == {"L0", "L1", "L2", "L3"}
    assert all(a["effect"] for a in result["canary"]["adapters"].values())
    assert result["timings"]["canary_s"] >= 0 and result["timings"]["engine_ready_s"] <= result["timings"]["total_s"]
    s = host.molctl("status", host.name, "--json").json()["stacks"][0]
    assert s["state"] == "ready" and s["canary"]["status"] == "pass"
    assert set(s["canary"]["adapters"]) == {"L0", "L1", "L2", "L3"} and s["canary"]["seconds"] >= 0
    assert "adapter efficacy canary pass" in engine_log(host, host.name)
    human = host.molctl("status", host.name)
    assert "adapter efficacy canary pass" in human.stdout


def test_an_adapter_with_no_effect_fails_up_with_exit_7_and_leaves_nothing(host):
    r = host.up(env={"FAKE_NO_EFFECT": "L2"})
    assert r.exit_code == ExitStatus.ADAPTERS, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "adapter L2 has no effect" in line and "logprobs" in line and "it was stopped" in line, line
    assert "L1" not in line.replace("lora_B", "")
    assert host.records(host.name) == {}
    assert port_free(host.engine_port) and port_free(host.proxy_port)
    if isinstance(host, SglHost):
        assert host.sglang_children() == []


def test_the_proxy_starts_only_after_the_canary(vhost):
    """A start that fails the canary never spawned a proxy: no client could reach it."""
    r = vhost.up("--json", env={"FAKE_NO_EFFECT": "L0,L3"})
    assert r.exit_code == ExitStatus.ADAPTERS
    out = json.loads(r.stdout)
    assert "adapter L0 has no effect" in out["error"] and "adapter L3 has no effect" in out["error"]
    logs = list((vhost.state / "tiny" / "logs").glob("proxy-*"))
    assert logs == [], logs


def test_two_identical_adapters_are_a_warning_naming_both(host):
    r = host.up("--json", env={"FAKE_SAME_AS": "L3=L1"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    canary = json.loads(r.stdout)["canary"]
    assert canary["status"] == "warn" and canary["identical"] == [["L1", "L3"]]
    warning = next(line for line in r.stderr.splitlines() if "warning" in line)
    assert "adapters L1 and L3" in warning and "identically" in warning
    s = host.molctl("status", host.name, "--json").json()["stacks"][0]
    assert s["state"] == "ready" and s["canary"]["identical"] == [["L1", "L3"]]


def test_skip_adapter_effect_turns_it_off_and_is_recorded(vhost):
    r = vhost.up("--skip", "adapter-effect", "--json", env={"FAKE_NO_EFFECT": "L1"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert json.loads(r.stdout)["canary"] == {
        "status": "skipped",
        "reason": "--skip adapter-effect",
        "checked_at": json.loads(r.stdout)["canary"]["checked_at"],
    }
    record = vhost.records()["engine"]
    assert record.extra["canary"]["status"] == "skipped"
    assert "--skip adapter-effect" in record.config["up_command"]
    s = vhost.molctl("status", "tiny", "--json").json()["stacks"][0]
    assert s["canary"]["status"] == "skipped" and s["canary"]["reason"] == "--skip adapter-effect"
    assert "adapter efficacy canary skipped (--skip adapter-effect)" in vhost.molctl("status", "tiny").stdout


def test_the_profile_field_turns_it_off(vhost):
    r = vhost.up("--set", "adapters.effect_canary=false", "--json", env={"FAKE_NO_EFFECT": "L1"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert json.loads(r.stdout)["canary"]["reason"] == "adapters.effect_canary is false in the profile"


def test_check_live_runs_the_canary_against_the_running_stack(vhost):
    assert vhost.up(env={"FAKE_SAME_AS": "L2=L0"}).exit_code == ExitStatus.OK
    args = [
        "--set",
        f"engine.port={vhost.engine_port}",
        "--set",
        f"proxy.port={vhost.proxy_port}",
        "--model-root",
        str(vhost.model),
        "--skip",
        "engine",
        "--skip",
        "gpu",
        "--skip",
        "port",
        "--json",
    ]
    r = vhost.molctl("check", "tiny", "--live", *args)
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert r.exit_code == ExitStatus.OK, checks
    assert [checks[f"adapter-effect.{x}"]["status"] for x in ("running", "L0", "L1", "L2", "L3")] == ["pass"] * 5
    assert (
        checks["adapter-effect.distinct"]["status"] == "warn"
        and "L0 and L2" in checks["adapter-effect.distinct"]["detail"]
    )
    # the same engine, now serving L1 with no effect (its config changed behind molctl's back)
    import httpx

    httpx.post(f"http://127.0.0.1:{vhost.engine_port}/_config", json={"no_effect": ["L1"]}).raise_for_status()
    r = vhost.molctl("check", "tiny", "--live", *args)
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert r.exit_code == ExitStatus.CHECK_FAILED
    assert (
        checks["adapter-effect.L1"]["status"] == "fail"
        and "adapter L1 has no effect" in checks["adapter-effect.L1"]["detail"]
    )
    skipped = vhost.molctl("check", "tiny", "--live", "--skip", "adapter-effect", *args).json()["checks"]
    assert {c["id"]: c["status"] for c in skipped}["adapter-effect.skipped"] == "skip"


def test_check_live_without_a_running_stack_fails(vhost):
    r = vhost.molctl(
        "check", "tiny", "--live", "--model-root", str(vhost.model), "--skip", "engine", "--skip", "gpu", "--json"
    )
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert r.exit_code == ExitStatus.CHECK_FAILED and checks["adapter-effect.running"]["status"] == "fail"
    assert "molctl up tiny" in checks["adapter-effect.running"]["detail"]


def test_bench_reports_the_canary_as_a_series(vhost):
    assert vhost.up("--skip", "adapter-effect", env={"FAKE_NO_EFFECT": "L3"}).exit_code == ExitStatus.OK
    r = vhost.molctl("bench", "tiny", "--requests", "1", "--concurrency", "1,2", "--series", "base,canary", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    cells = [c for c in r.json()["results"] if c["series"] == "canary"]
    assert len(cells) == 1, cells  # once, not per concurrency
    (cell,) = cells
    assert cell["requests"] == 5 and cell["ok"] == 5 and cell["errors"] == {"no_effect": 1}
    assert cell["canary"]["no_effect"] == ["L3"] and cell["total_s"]["p50"] is not None


def test_an_unknown_skip_category_is_still_a_usage_error(vhost):
    r = vhost.up("--skip", "adapter-effects")
    assert r.exit_code == ExitStatus.USAGE and "adapter-effect" in r.stderr


def test_switch_runs_the_canary_too(vhost):
    assert vhost.up().exit_code == ExitStatus.OK
    pids = vhost.stack_pids()
    r = vhost.molctl("switch", "tiny", *vhost.args("--json", env={"FAKE_NO_EFFECT": "L1"}))
    assert r.exit_code == ExitStatus.ADAPTERS and "adapter L1 has no effect" in r.stderr
    assert gone(pids) and vhost.records() == {}


def sample(tokens, logprobs, top=None):
    return Sample(tokens=tokens, logprobs=logprobs, top=top or [{} for _ in tokens])


def test_difference_needs_tokens_and_logprobs_to_match():
    base = sample([1, 2], [-0.5, -1.0], [{"1": -0.5, "7": -2.0}, {"2": -1.0}])
    assert difference(base, base) == (True, 0.0)
    assert difference(sample([1, 3], [-0.5, -1.0]), base)[0] is False
    moved = sample([1, 2], [-0.5, -1.0 + 10 * TOLERANCE], [{"1": -0.5, "7": -2.0}, {"2": -1.0 + 10 * TOLERANCE}])
    match, diff = difference(moved, base)
    assert match and diff == pytest.approx(10 * TOLERANCE)
    other_top = sample([1, 2], [-0.5, -1.0], [{"1": -0.5, "9": -2.0}, {"2": -1.0}])
    assert difference(other_top, base)[0] is False
