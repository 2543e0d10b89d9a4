"""A RUNNING stack when things go wrong underneath it, with real processes: `molctl up tiny` against
the fake engine (tests/fake_engine.py through a fake `engine.python`), then components SIGSTOPped,
SIGKILLed, left as zombies, logs deleted; and the engine client with its pool full. Every process a
test starts is stopped by it (`down --force`, process groups), even on failure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from molctl.errors import ExitStatus
from molctl.state import read_records
from tests.helpers import ROOT, Molctl, free_ports, wait_for
from tests.layouts import make_layout
from tests.procs import alive, fake_engine_python


class Host:
    """`molctl up tiny` with the fake engine, as tests/cli/test_bench.py's host."""

    def __init__(self, tmp: Path):
        self.state = tmp / "state"
        self.model = tmp / "model"
        make_layout(self.model, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
        self.python = fake_engine_python(tmp / "fake-python")
        self.engine_port, self.proxy_port = free_ports(2)
        # PYTHONPATH: the proxy `up` starts (in its own folder) imports this checkout's molctl
        self.env = {"MOLCTL_LOCK_DIR": str(tmp / "locks"), "MOLCTL_PROFILES_DIR": "", "PYTHONPATH": str(ROOT)}
        self.cli = Molctl(self.state)
        self.stopped: list[int] = []  # SIGSTOPped pids, continued at the end whatever happened

    def up(self, *extra: str):
        return self.cli(
            "up",
            "tiny",
            "--set",
            f"engine.python={self.python}",
            "--set",
            f"engine.port={self.engine_port}",
            "--set",
            f"proxy.port={self.proxy_port}",
            "--model-root",
            str(self.model),
            "--skip",
            "engine",
            "--skip",
            "gpu",
            "--allow-unauthenticated",
            "--timeout",
            "30",
            *extra,
            env=self.env,
        )

    def __call__(self, *args: str, timeout: float = 90):
        return self.cli(*args, env=self.env, timeout=timeout)

    def pid(self, component: str) -> int:
        return read_records(self.state, "tiny")[component].pid

    def sigstop(self, pid: int) -> None:
        self.stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)
        assert wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 5)

    def cleanup(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.state.exists():
            self("down", "--stop-timeout", "2", "--drain-timeout", "2", "--force", timeout=60)


@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path)
    yield h
    h.cleanup()


def gone(pid: int) -> bool:
    return not alive(pid)


def test_down_of_a_sigstopped_stack_continues_it_so_that_sigterm_works(host):
    """A SIGSTOPped process (Ctrl-Z, a debugger, a hang someone froze to inspect) keeps SIGTERM
    pending until SIGCONT: `down` waited the whole --drain-timeout (600 s by default) for the
    proxy and the whole --stop-timeout for the engine, then SIGKILLed both, with no drain and no
    clean shutdown. SIGCONT follows SIGTERM (as systemd sends it), so both stop in moments."""
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    engine, proxy = host.pid("engine"), host.pid("proxy")
    host.sigstop(proxy)
    host.sigstop(engine)
    t0 = time.monotonic()
    r = host("down", "--drain-timeout", "15", "--stop-timeout", "15", "--json")
    took = time.monotonic() - t0
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert r.json()["stopped"] == [{"profile": "tiny", "components": {"proxy": "stopped", "engine": "stopped"}}]
    assert took < 15, took  # under one --drain-timeout: no wait for a stopped process's SIGTERM
    assert gone(engine) and gone(proxy)
    assert read_records(host.state, "tiny") == {}


def test_status_names_engine_processes_left_running_after_its_leader_died(host):
    """vLLM's API server SIGKILLed by the OOM killer leaves its EngineCore (holding the GPU
    memory) running. With the proxy gone too, `status` said `failed` ("no recorded process
    alive") and nothing about them, although `down` finds and stops them by their marker: now
    `degraded`, with a `problems` line naming them (as for an unreadable record's processes)."""
    r = host.up("--set", "engine.env.FAKE_CHILD=1")
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    engine, proxy = host.pid("engine"), host.pid("proxy")
    (child,) = psutil.Process(engine).children()
    os.kill(proxy, signal.SIGKILL)
    os.kill(engine, signal.SIGKILL)
    assert wait_for(lambda: gone(engine) and gone(proxy), 5)
    r = host("status", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    (stack,) = r.json()["stacks"]
    assert stack["state"] == "degraded", stack
    assert [c["alive"] for c in stack["components"]] == [False, False]
    (problem,) = stack["problems"]
    assert f"pid {engine}" in problem and str(child.pid) in problem and "molctl down tiny" in problem, problem
    r = host("status")  # the table says so too
    assert "degraded" in r.stdout and str(child.pid) in r.stdout + r.stderr, r.stdout
    r = host("down", "--stop-timeout", "5", "--drain-timeout", "5", "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert wait_for(lambda: gone(child.pid), 5)
    assert host("status", "--json").json()["stacks"] == []


def test_a_log_file_deleted_under_a_running_component_is_reported_and_still_read(host):
    """An operator deleting a running engine's log to free disk space frees nothing (the engine
    writes on to the unlinked file); `molctl logs` then said "no engine log" (exit 2) and `status`
    nothing. Now status names it and logs reads the open file through /proc/PID/fd/1."""
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    record = read_records(host.state, "tiny")["engine"]
    before = host("logs", "tiny", "--component", "engine", "-n", "3")
    assert before.exit_code == ExitStatus.OK and before.stdout.count("[engine]") == 3, before.stdout
    Path(record.log).unlink()
    r = host("status", "--json")
    (stack,) = r.json()["stacks"]
    assert stack["state"] == "ready" and any(record.log in p and "deleted" in p for p in stack.get("problems", [])), (
        stack
    )
    r = host("logs", "tiny", "--component", "engine", "-n", "3")
    assert r.exit_code == ExitStatus.OK, r.stderr
    lines = r.stdout.splitlines()
    assert "was deleted while pid" in lines[0] and f"/proc/{record.pid}/fd/1" in lines[0]
    assert lines[1:] == before.stdout.splitlines()[-3:] or len(lines) == 4, r.stdout  # the same file's tail
    r = host("down", "--stop-timeout", "5", "--drain-timeout", "5")
    assert r.exit_code == ExitStatus.OK, r.stderr


def test_a_dead_components_zombie_is_not_called_another_process(tmp_path):
    """A component that died and is not reaped yet (its parent, PID 1 of a container that does not
    reap quickly) is a zombie with the recorded pid: `up` said "stale proxy record: pid N now
    belongs to another process; not touching it", sending the operator after a stranger."""
    from molctl import procid
    from molctl.lifecycle.stop import clean_component
    from molctl.processes import record_for
    from molctl.state import write_record

    state = tmp_path / "state"
    (state / "tiny").mkdir(parents=True, mode=0o700)
    proc = subprocess.Popen(["sleep", "0.2"])
    try:
        record = record_for("proxy", proc, ["sleep"], 1, tmp_path / "log")
        assert record.start_ticks is not None
        write_record(state, "tiny", record)
        assert wait_for(lambda: procid.start_ticks(proc.pid) is None, 5)  # a zombie: not reaped
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE

        class Said:
            lines: list[str] = []

            def step(self, message):
                self.lines.append(message)

            warn = step

        said = Said()
        clean_component(state, "tiny", "proxy", record, said)
        assert not any("another process" in line for line in said.lines), said.lines
        assert read_records(state, "tiny") == {}
    finally:
        proc.kill()
        proc.wait()


async def _hanging_chat_server(started: asyncio.Event):
    """/health answers 200 at once; anything else is read and never answered."""

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /health "):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
                    continue
                await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    started.set()
    return server


def test_a_probe_is_not_queued_behind_a_full_connection_pool():
    """The proxy's /readyz probe (EngineClient.get) waited for a connection slot without any
    deadline: with as many answer hops in flight as the pool allows (long generations, or an
    engine that stopped answering), /readyz hung for as long as they did (30 minutes), holding
    the probe lock, so every /readyz hung, instead of answering within the probe's timeout."""
    from molctl.proxy.engine_client import EngineClient

    async def main():
        started = asyncio.Event()
        server = await _hanging_chat_server(started)
        port = server.sockets[0].getsockname()[1]
        client = EngineClient(f"http://127.0.0.1:{port}", max_connections=2)
        await client.start()
        hops = [asyncio.create_task(client.chat({"model": "m", "messages": []}, "answer")) for _ in range(2)]
        try:
            await asyncio.sleep(0.3)  # both slots taken, both hops waiting for the engine
            # answered within its own timeout (a queued probe hung until wait_for gave up); no wall-clock
            # bound beside it: a loaded host may take longer than a second
            status, _ = await asyncio.wait_for(client.get("/health", timeout=3.0), 10)
            assert status == 200
        finally:
            for t in hops:
                t.cancel()
            await asyncio.gather(*hops, return_exceptions=True)
            await client.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def test_status_json_is_one_document_while_the_engine_hangs(host):
    """The engine SIGSTOPped (a hang): `status` must not hang (its probes have timeouts) and says
    `degraded`, engine alive with no health, the proxy alive and not ready (503)."""
    r = host.up()
    assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
    host.sigstop(host.pid("engine"))
    t0 = time.monotonic()
    r = host("status", "--json", timeout=30)
    assert time.monotonic() - t0 < 15
    (stack,) = json.loads(r.stdout)["stacks"]
    comps = {c["name"]: c for c in stack["components"]}
    assert stack["state"] == "degraded"
    assert comps["engine"]["alive"] and comps["engine"]["health"] is None
    assert comps["proxy"]["alive"] and comps["proxy"]["health"] == 503
