from __future__ import annotations

import signal
from pathlib import Path

import pytest

# The suite is a program that loads profiles, as molctl's own entries are: it imports the owners
# of the profile checks (molctl.profilechecks); tests/package/test_profile_checks_registration.py
# checks each real entry without this.
import molctl.engines  # noqa: F401
import molctl.proxy.store.factory  # noqa: F401
import molctl.proxy.tracing  # noqa: F401
from tests import shared_ssl
from tests.helpers import Molctl
from tests.helpers import free_ports as _free_ports
from tests.lifecycle_host import Host
from tests.procs import fake_engine_argv, running
from tests.proxy_in_process import proxy_in_process
from tests.proxy_stack import KEY, KEY2, STRICT, Stack

# A run started in the background by a non-interactive shell (`pytest ... &` in a script, some CI
# runners) has SIGINT ignored, and an ignored signal stays ignored in every process it starts: each
# molctl a test runs would ignore the Ctrl-C the tests send it (Python installs its KeyboardInterrupt
# handler only where SIGINT is not ignored at start-up). A handler here is reset to the default in
# every child at exec, so the children start as from a terminal whatever started pytest.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

shared_ssl.install()  # one SSL context per process for httpx's default clients (tests/shared_ssl.py)


@pytest.fixture(autouse=True)
def signal_dispositions():
    """Each test ends with the signal dispositions it started with. A command run in-process sets
    the test process's own: `molctl proxy` ignores SIGHUP until its reload handler exists, and an
    ignored signal stays ignored in every process a later test starts (a SIGHUP sent to its `up`
    would do nothing)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) != handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(scope="session", autouse=True)
def private_default_state_dir(tmp_path_factory):
    """Nothing a test starts (a proxy without --state-dir, and its response store) writes to the
    real ~/.local/state/molctl: the default state dir is a private folder for the whole session,
    set before any module-scoped fixture starts a process."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MOLCTL_STATE_DIR", str(tmp_path_factory.mktemp("default-state")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def host_lock_dir(tmp_path_factory, monkeypatch) -> Path:
    """Host-wide port/GPU claims in a private folder per test (inherited by every molctl a test runs)."""
    d = tmp_path_factory.mktemp("locks")
    monkeypatch.setenv("MOLCTL_LOCK_DIR", str(d))
    return d


@pytest.fixture
def state_dir(tmp_path) -> Path:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def molctl(state_dir, monkeypatch) -> Molctl:
    """The CLI in-process, with a private state dir and no profile dirs from the environment."""
    monkeypatch.delenv("MOLCTL_PROFILES_DIR", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    return Molctl(state_dir, in_process=True)


@pytest.fixture
def free_ports() -> list[int]:
    """Two distinct free ports (engine, proxy)."""
    return _free_ports(2)


# a real Redis-compatible server per test module (tests/redis_server.py), and a client on it
# flushed before each test
@pytest.fixture(scope="module")
def redis():
    from tests.redis_server import redis_server

    with redis_server() as server:
        yield server


@pytest.fixture
def r(redis):
    client = redis.client()
    client.flushall()
    yield client
    client.close()


# The proxy test stack (tests/proxy_stack.py): one fake engine and proxy per test module that asks for it.
@pytest.fixture(scope="module")
def keyfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(f"{KEY}\n\n{KEY2}")  # blank line and no trailing newline are fine
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def stack(keyfile, tmp_path_factory):
    """The fake engine (a process) and the tiny profile's proxy, served in this process
    (tests/proxy_in_process.py); a test of what needs the proxy's own process starts one
    (tests/procs.py proxy_argv, tests/proxy_stack.py own_stack)."""
    logs = tmp_path_factory.mktemp("logs")
    engine_port, metrics_port = _free_ports(2)
    engine_url = f"http://127.0.0.1:{engine_port}"
    # strict: the fake engine rejects what vLLM and the Qwen3.5/3.6 templates reject (tiny's window: 2048)
    with (
        running(fake_engine_argv(engine_port, STRICT), engine_url + "/health", log=logs / "engine.log"),
        proxy_in_process(
            "tiny",
            engine_url,
            tmp_path_factory.mktemp("state"),
            key_file=keyfile,
            # the profile field (what `up` passes); test_proxy_admission uses --sse-keepalive
            sets=("proxy.sse_keepalive_s=0.2", "proxy.stream_write_timeout_s=2", "proxy.route_timeout_s=2"),
            metrics_port=metrics_port,
            log=logs / "proxy.log",
        ) as proxy,
    ):
        yield Stack(engine_url, proxy.url, f"http://127.0.0.1:{metrics_port}", proxy)


@pytest.fixture
def s(stack):
    stack.reset()
    return stack


# The lifecycle tests' host (tests/lifecycle_host.py), one per test.
@pytest.fixture
def host(tmp_path):
    h = Host(tmp_path)
    yield h
    h.cleanup()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (make test): modules on one worker each, each vLLM release's end-to-end
    tests on one worker (tests/xdist_stacks.py)."""
    if config.getvalue("dist") == "loadscope":
        from tests.xdist_stacks import StackScheduling

        return StackScheduling(config, log)
    return None
