"""Every start shows its phase and, from this host's earlier starts of the profile, an ETA; the
engine's cache dir survives `down`/`up` and `status` says whether the last start found it warm
(issue 44). The phase clock and the history on their own, then real molctl processes against the
scripted engine (tests/fake_engine.py logs vLLM 0.32's start-up lines and uses VLLM_CACHE_ROOT as
vLLM's torch.compile cache does)."""

from __future__ import annotations

import json

from molctl.engines import get_engine
from molctl.errors import ExitStatus
from molctl.lifecycle import starthistory
from molctl.phases import PHASES, PhaseClock

# lines of the real vLLM 0.32 CPU start in BENCHMARKS.md ("Start phases"), shortened
VLLM_LOG = [
    "(APIServer pid=1) INFO 12-06 09:06:50 [api_utils.py:286] non-default args: {'lora_modules': []}",
    "(Worker pid=3) INFO 12-06 09:07:12 [cpu_model_runner.py:68] Starting to load model /m/base...",
    "Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]\r"
    "Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:00<00:00, 337.94it/s]",
    "(Worker pid=3) INFO 12-06 09:07:12 [default_loader.py:501] Loading weights took 0.01 seconds",
    "(EngineCore pid=2) INFO 12-06 09:07:13 [kv_cache_utils.py:2327] CPU KV cache size: 1,048,576 tokens",
    "(APIServer pid=1) INFO 12-06 09:07:15 [entry.py:140] Starting vLLM server on http://127.0.0.1:18100",
    "INFO:     Application startup complete.",
]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_phase_clock_follows_a_growing_log_and_never_moves_back(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("")
    clock = Clock()
    phases = PhaseClock(get_engine("vllm").phases, log, clock=clock)
    assert phases.current == "config" and phases.label() == "engine config"
    steps = [(VLLM_LOG[0], 2.0), (VLLM_LOG[1], 10.0), (VLLM_LOG[2], 0.5), (VLLM_LOG[3], 0.5)]
    with open(log, "a") as f:
        for line, dt in steps:
            clock.t += dt
            f.write(line + "\n")
            f.flush()
            phases.feed_log()
    assert phases.current == "weights" and phases.label() == "loading weights: 100%"
    with open(log, "a") as f:  # half a line: read once it is whole
        clock.t += 1.0
        f.write(VLLM_LOG[4][:30])
        f.flush()
        phases.feed_log()
        assert phases.current == "weights"
        f.write(VLLM_LOG[4][30:] + "\n" + VLLM_LOG[0] + "\n")  # a late config line: no move back
        f.flush()
        phases.feed_log()
    assert phases.current == "kv_cache"
    clock.t += 3.0
    with open(log, "a") as f:
        f.write("\n".join(VLLM_LOG[5:]) + "\n")
    phases.feed_log()
    assert phases.label() == "API server: serving"
    clock.t += 1.0
    phases.enter("canary")
    clock.t += 2.0
    phases.enter("proxy")
    clock.t += 0.5
    assert phases.durations() == {
        "config": 12.0,
        "weights": 2.0,
        "kv_cache": 3.0,
        "api_server": 1.0,
        "canary": 2.0,
        "proxy": 0.5,
    }
    assert list(phases.durations()) == [p for p in PHASES if p in phases.started]


def test_the_weights_percentage_and_the_compile_cache_come_from_the_log(tmp_path):
    phases = PhaseClock(get_engine("vllm").phases, None, clock=Clock())
    phases.feed_line("Loading safetensors checkpoint shards:  50% Completed | 71/141 [01:02<01:00]")
    assert phases.label() == "loading weights: 50% (71/141 shards)"
    phases.feed_line(
        "INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8) from the cache"
    )
    assert phases.current == "compile" and phases.compile_cache == "hit"
    phases.feed_line("INFO [backends.py:399] Compiling a graph for compile range (9, 16) takes 3.10 s")
    assert phases.compile_cache == "miss"  # one graph compiled again: not a full hit


def test_the_history_is_bounded_atomic_and_per_host(tmp_path):
    assert starthistory.estimate(tmp_path, "tiny").remaining(0.0, "config") is None
    assert starthistory.eta_text(starthistory.estimate(tmp_path, "tiny"), 0.0, "config").startswith("no ETA yet")
    for total in (10.0, 30.0, 20.0):
        starthistory.append(
            tmp_path, "tiny", starthistory.entry(total, {"config": 2.0, "weights": total - 2}, "vllm", None, host="a")
        )
    starthistory.append(tmp_path, "tiny", starthistory.entry(500.0, {"config": 500.0}, "vllm", None, host="b"))
    est = starthistory.estimate(tmp_path, "tiny", host="a")
    assert est.starts == 3 and est.total_s == 20.0 and est.phase_s == {"config": 2.0, "weights": 18.0}
    assert est.remaining(5.0, "weights") == 15.0
    assert est.remaining(25.0, "config") == 18.0  # late, but the weights still lie ahead
    for i in range(starthistory.KEEP + 5):
        starthistory.append(tmp_path, "tiny", starthistory.entry(float(i + 1), {}, "vllm", None, host="a"))
    assert len(starthistory.load(tmp_path, "tiny")) == starthistory.KEEP
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == ["starts.json"]  # no temp file left
    (tmp_path / "tiny" / "starts.json").write_text("{not json")
    assert starthistory.load(tmp_path, "tiny") == [] and starthistory.estimate(tmp_path, "tiny").starts == 0


def _up_json(host, delay: str):
    r = host.up("--json", env={"FAKE_STARTUP_DELAY": delay})
    assert r.exit_code == ExitStatus.OK, r.stderr
    return json.loads(r.stdout)


def test_a_second_up_shows_an_eta_close_to_its_real_time_and_finds_the_cache_warm(host):
    """`up` twice on one host: the first says it has no history, the second's ETA is within 30%
    of what the start really took; the engine's cache survives `down` and `status` says so. The
    fake engine's 10 s start dominates both starts, so the machine's load moves them alike."""
    first = _up_json(host, "10")
    assert first["eta"]["history_starts"] == 0 and first["eta"]["expected_total_s"] is None
    assert first["cache"]["warm"] is False and first["cache"]["dir"].startswith(str(host.state))
    phases = first["timings"]["phases"]
    assert list(phases)[:3] == ["config", "weights", "compile"] and "proxy" in phases
    # the fake's delay sits in its compile phase (its length as seen depends on when the poller
    # reads the log lines, so no fixed bound: the longest phase by far)
    assert phases["compile"] == max(phases.values())
    assert host.molctl("down").exit_code == ExitStatus.OK

    second = _up_json(host, "10")
    eta, actual = second["eta"]["expected_total_s"], second["timings"]["start_s"]
    assert second["eta"]["history_starts"] == 1
    assert abs(eta - actual) <= 0.3 * actual, (eta, actual)
    assert second["cache"] == {"dir": first["cache"]["dir"], "warm": True, "compile_cache": "hit"}
    status = json.loads(host.molctl("status", "tiny", "--json").stdout)
    stack = status["stacks"][0] if "stacks" in status else status
    assert stack["cache"]["warm"] is True and stack["cache"]["compile_cache"] == "hit"
    assert stack["last_start"]["total_s"] == actual
    assert len(starthistory.load(host.state, "tiny")) == 2


def test_up_shows_the_phase_and_the_eta_while_it_waits(host):
    _up_json(host, "0")
    assert host.molctl("down").exit_code == ExitStatus.OK
    r = host.up(env={"FAKE_STARTUP_DELAY": "3"})
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = r.stdout + r.stderr
    assert "waiting for the engine: torch.compile" in out and "ETA " in out and "median of 1 earlier start" in out
    assert "phases: engine config" in out
