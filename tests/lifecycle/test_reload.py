"""Key reload: a real proxy process re-reads its key file on SIGHUP without dropping a stream in
flight (a bad file keeps the old keys, and its log says why); `molctl reload PROFILE` finds the
running stack's proxy through its record and signals only that process."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from molctl.errors import ExitStatus
from molctl.state import Record, read_records, write_record
from tests.helpers import ROOT, Molctl, free_port, free_ports, url, wait_for
from tests.layouts import make_layout
from tests.procs import fake_engine_argv, fake_engine_python, proxy_argv, running, stop
from tests.proxy_stack import PUBLIC

OLD, NEW = "sk-reload-old", "sk-reload-new"


def status_with(proxy_url: str, key: str) -> int:
    return httpx.get(proxy_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def write_keys(path, *keys: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in keys))
    tmp.chmod(0o600)
    os.replace(tmp, path)  # as an operator's editor or config management does: atomically


def test_sighup_rereads_the_key_file_without_dropping_a_stream(tmp_path):
    keyfile = tmp_path / "keys"
    write_keys(keyfile, OLD)
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    log = tmp_path / "proxy.log"
    with (
        running(fake_engine_argv(engine_port, {"token_delay": 0.1, "answer_words": 30}), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keyfile), "--store", "memory"),
            proxy_url + "/health",
            log=log,
        ) as proc,
    ):
        assert status_with(proxy_url, OLD) == 200 and status_with(proxy_url, NEW) == 401
        streamed: dict = {}

        def stream():  # about 3 s of tokens, begun with the old key
            client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=OLD, max_retries=0, timeout=30)
            text = ""
            for chunk in client.chat.completions.create(
                model=PUBLIC, messages=[{"role": "user", "content": "long"}], stream=True
            ):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                streamed["chunks"] = streamed.get("chunks", 0) + 1
            streamed["text"] = text

        t = threading.Thread(target=stream)
        t.start()
        assert wait_for(lambda: streamed.get("chunks", 0) >= 3)
        write_keys(keyfile, NEW)
        proc.send_signal(__import__("signal").SIGHUP)
        assert wait_for(lambda: status_with(proxy_url, NEW) == 200)
        assert status_with(proxy_url, OLD) == 401
        assert "text" not in streamed  # the stream was still running across the reload
        t.join(30)
        assert streamed["text"].startswith("answer-") and streamed["text"].count("word") == 30  # complete
        assert proc.poll() is None

        # a bad file keeps the keys in use, and the log says why
        write_keys(keyfile)  # empty
        proc.send_signal(__import__("signal").SIGHUP)
        assert wait_for(lambda: "holds no key; keeping the 1 old key(s)" in log.read_text())
        keyfile.unlink()
        proc.send_signal(__import__("signal").SIGHUP)
        assert wait_for(lambda: "not reloaded (No such file or directory); keeping the 1 old key(s)" in log.read_text())
        assert status_with(proxy_url, NEW) == 200 and status_with(proxy_url, OLD) == 401
        assert proc.poll() is None
        assert NEW not in log.read_text() and OLD not in log.read_text()


def test_a_key_file_being_rewritten_in_place_is_read_once_it_is_complete(tmp_path):
    """A SIGHUP that arrives while the key file is rewritten in place (truncated, then written line by
    line, as `cat > keys` or a script does) must not take the half-written file for the new key set:
    the last keys would be refused, or a key cut in two."""
    keyfile = tmp_path / "keys"
    write_keys(keyfile, OLD)
    keys = [f"sk-inplace-{i:03d}" for i in range(60)]
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(keyfile), "--store", "memory"),
            proxy_url + "/health",
            log=tmp_path / "proxy.log",
        ) as proc,
    ):
        with open(keyfile, "w") as fh:  # in place: truncated, then a line every 10 ms
            fh.write(keys[0][:6])
            fh.flush()
            proc.send_signal(signal.SIGHUP)
            fh.write(keys[0][6:] + "\n")
            for key in keys[1:]:
                time.sleep(0.01)
                fh.write(key + "\n")
                fh.flush()
        assert wait_for(lambda: status_with(proxy_url, keys[0]) == 200, timeout=10)
        assert all(status_with(proxy_url, k) == 200 for k in (keys[-1], keys[30]))
        assert status_with(proxy_url, OLD) == 401


def test_load_keys_settled_waits_for_a_file_that_keeps_changing(tmp_path):
    from molctl.keys import load_keys_settled

    path = tmp_path / "keys"
    path.write_text("sk-a\n")
    stop_writing = time.monotonic() + 0.4

    def writer():
        n = 0
        while time.monotonic() < stop_writing:
            n += 1
            with open(path, "a") as fh:
                fh.write(f"sk-{n}\n")
            time.sleep(0.01)

    t = threading.Thread(target=writer)
    t.start()
    try:
        got = load_keys_settled(path)
    finally:
        t.join()
    assert got == path.read_text().split()  # all of it, as it was once the writer stopped
    with pytest.raises(OSError, match="still changing after 0.2 s"):
        stop_writing = time.monotonic() + 1.0
        t = threading.Thread(target=writer)
        t.start()
        try:
            load_keys_settled(path, limit_s=0.2)
        finally:
            t.join()


class Host:
    """`molctl up tiny` with the fake engine (as tests/cli/test_bench.py), the key in a file."""

    def __init__(self, tmp):
        self.state = tmp / "state"
        self.state.mkdir(mode=0o700)
        self.model = tmp / "model"
        make_layout(self.model, model_type="llama", shards=2, rank=8, base_name="tiny-mol-llama")
        self.python = fake_engine_python(tmp / "fake-python")
        self.key = tmp / "key"
        write_keys(self.key, OLD)
        self.engine_port, self.proxy_port = free_ports(2)
        # PYTHONPATH: the proxy `up` starts imports this checkout's molctl (it runs in its own folder)
        self.env = {"MOLCTL_LOCK_DIR": str(tmp / "locks"), "MOLCTL_PROFILES_DIR": "", "PYTHONPATH": str(ROOT)}
        self.cli = Molctl(self.state)

    def up(self):
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
            "--api-key-file",
            str(self.key),
            "--timeout",
            "30",
            env=self.env,
        )


def test_molctl_reload_signals_the_recorded_proxy(tmp_path):
    host = Host(tmp_path)
    try:
        r = host.up()
        assert r.exit_code == ExitStatus.OK, r.stdout + r.stderr
        proxy_url = url(host.proxy_port)
        proxy_pid = read_records(host.state, "tiny")["proxy"].pid
        assert status_with(proxy_url, OLD) == 200
        write_keys(host.key, NEW)
        r = host.cli("reload", "tiny", "--json", env=host.env)
        assert r.exit_code == ExitStatus.OK, r.stderr
        assert r.json() == {"profile": "tiny", "pid": proxy_pid, "signal": "SIGHUP"}
        assert wait_for(lambda: status_with(proxy_url, NEW) == 200)
        assert status_with(proxy_url, OLD) == 401
        assert read_records(host.state, "tiny")["proxy"].pid == proxy_pid  # the same process, still serving
    finally:
        host.cli("down", "--stop-timeout", "2", "--drain-timeout", "2", "--force", env=host.env, timeout=60)
    r = host.cli("reload", "tiny", env=host.env)
    assert r.exit_code == ExitStatus.CHECK_FAILED and "no proxy of tiny is recorded" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("case", ["foreign", "unknown", "unreadable"])
def test_reload_never_signals_a_foreign_process(molctl, state_dir, case):
    from molctl.lifecycle.reload import reload

    if case == "unknown":
        r = molctl("reload", "no-such-profile")
        assert r.exit_code == ExitStatus.CHECK_FAILED and "no-such-profile" in r.stderr
        return
    if case == "unreadable":
        (state_dir / "tiny").mkdir(mode=0o700)
        (state_dir / "tiny" / "proxy.json").write_text("{not json")
        r = molctl("reload", "tiny")
        assert r.exit_code == ExitStatus.CONFLICT and "proxy record of tiny cannot be read" in r.stderr
        return
    # a record naming this very test process (alive, but not the process molctl recorded)
    write_record(
        state_dir,
        "tiny",
        Record(
            component="proxy",
            pid=os.getpid(),
            pgid=os.getpgid(0),
            create_time=1.0,
            argv=["molctl", "proxy"],
            port=free_port(),
            log="",
            started_at=1.0,
            start_ticks=1,
            record_id="not-this-process",
        ),
    )
    sent = []

    class Ctx:
        pass

    ctx = Ctx()
    ctx.state_dir = state_dir
    ctx.dirs = lambda: []
    with pytest.raises(Exception) as exc:
        reload(ctx, "tiny", kill=lambda pid, sig: sent.append((pid, sig)))
    assert sent == [] and "is not running; nothing signalled" in str(exc.value)
    r = molctl("reload", "tiny")
    assert r.exit_code == ExitStatus.CHECK_FAILED and "nothing signalled" in r.stderr


def test_a_key_file_with_a_bom_and_crlf_keeps_every_key(tmp_path):
    """A key file saved by a Windows editor (UTF-8 BOM, CRLF): every key is accepted, at the start
    and after a SIGHUP (the BOM once stuck to the first key, which was then refused)."""
    key_file = tmp_path / "keys"
    key_file.write_bytes(("\ufeff" + OLD + "\r\nsk-reload-second\r\n").encode())
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(key_file), "--store", "memory"),
            proxy_url + "/health",
            log=tmp_path / "proxy.log",
        ) as proc,
    ):
        assert status_with(proxy_url, OLD) == 200
        assert status_with(proxy_url, "sk-reload-second") == 200
        key_file.write_bytes(("\ufeff" + NEW + "\r\n").encode())
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: status_with(proxy_url, NEW) == 200)
        assert status_with(proxy_url, OLD) == 401


def test_a_key_file_that_is_not_text_is_one_line_and_exit_2(tmp_path):
    """A binary file given as --api-key-file (a wrong path) fails the start with one line naming
    it, not a traceback."""
    import subprocess
    import sys

    key_file = tmp_path / "keys"
    key_file.write_bytes(b"\xff\xfe\x00not a key file")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "molctl",
            "proxy",
            "tiny",
            "--upstream",
            "http://127.0.0.1:9",
            "--api-key-file",
            str(key_file),
            "--store",
            "memory",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == ExitStatus.USAGE, r.stderr
    assert r.stderr.count("\n") == 1 and str(key_file) in r.stderr and "UTF-8" in r.stderr


def test_a_sighup_before_the_proxy_serves_does_not_end_it(tmp_path):
    """`molctl reload` (or any SIGHUP) reaching a proxy that is still starting, before its reload
    handler exists, must not kill it (SIGHUP's default action ends a process). The key file is a
    FIFO here: the proxy is held at reading it while the signal comes, then starts and serves."""
    import subprocess

    key_file = tmp_path / "keys"
    os.mkfifo(key_file, 0o600)
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    with running(fake_engine_argv(engine_port), engine_url + "/health"):
        proc = subprocess.Popen(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(key_file), "--store", "memory"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=ROOT,
        )
        try:
            with open(key_file, "w") as writer:  # returns once the proxy opened the file to read it
                proc.send_signal(signal.SIGHUP)
                time.sleep(0.2)
                with contextlib.suppress(BrokenPipeError):  # a dead proxy: reported below
                    writer.write(OLD + "\n")
                    writer.flush()
            assert wait_for(lambda: proc.poll() is not None or _answers(proxy_url)), proc.returncode
            assert proc.poll() is None, f"the proxy exited with {proc.returncode}"
            assert status_with(proxy_url, OLD) == 200
        finally:
            stop(proc)


def _answers(proxy_url: str) -> bool:
    try:
        return httpx.get(proxy_url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_comment_line_in_the_key_file_is_not_a_key(tmp_path):
    """Config management writes a header such as `# Ansible managed`: it is a comment, not a key
    anyone who guesses the header could send (it was accepted as one)."""
    key_file = tmp_path / "keys"
    key_file.write_text("# Ansible managed\n  # rotated 2026-11\n" + OLD + "\n")
    key_file.chmod(0o600)
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(key_file), "--store", "memory"),
            proxy_url + "/health",
            log=tmp_path / "proxy.log",
        ),
    ):
        assert status_with(proxy_url, "# Ansible managed") == 401
        assert status_with(proxy_url, "# rotated 2026-11") == 401
        assert status_with(proxy_url, OLD) == 200


def _huge_key_file(path) -> None:
    """NEW, then zeros (a sparse file) past the key file bound (keys.MAX_KEY_FILE_BYTES, 64 MiB)."""
    from molctl.keys import MAX_KEY_FILE_BYTES

    path.write_text(NEW + "\n")
    os.truncate(path, MAX_KEY_FILE_BYTES + 4096)
    path.chmod(0o600)


def test_a_key_file_over_the_bound_fails_the_start_with_one_line(tmp_path):
    """A huge key file (or /dev/zero) was read whole into memory at start: it is a usage error
    (exit 2) naming the file and the bound, read no further than the bound."""
    from molctl.errors import UsageError
    from molctl.keys import resolve_api_keys

    key_file = tmp_path / "keys"
    _huge_key_file(key_file)
    for path in (key_file, "/dev/zero"):
        with pytest.raises(UsageError, match=f"larger than {64 << 20} bytes"):
            resolve_api_keys(path, allow_unauthenticated=False)


def _fifo_key_file(path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize(
    "swap, logged",
    [
        # reading a FIFO (nobody writing) would block the reload for ever
        (_fifo_key_file, "is not a regular file"),
        # found flooding SIGHUP with hostile key files: a 68 MB file (2 million keys) was re-read on the
        # event loop, which answered nothing for ~3 s, and its keys replaced the old ones (450 MB held)
        (_huge_key_file, f"not reloaded (larger than {64 << 20} bytes"),
    ],
    ids=["fifo", "over-the-bound"],
)
def test_a_sighup_with_a_key_file_it_cannot_take_keeps_the_old_keys(tmp_path, swap, logged):
    """A key file that is not a regular file, or is over the bound, is not reloaded: the old keys
    stay, the log says why, the proxy keeps serving."""
    key_file = tmp_path / "keys"
    write_keys(key_file, OLD)
    engine_port, proxy_port = free_ports(2)
    engine_url, proxy_url = url(engine_port), url(proxy_port)
    log = tmp_path / "proxy.log"
    with (
        running(fake_engine_argv(engine_port), engine_url + "/health"),
        running(
            proxy_argv("tiny", engine_url, proxy_port, "--api-key-file", str(key_file), "--store", "memory"),
            proxy_url + "/health",
            log=log,
        ) as proc,
    ):
        swap(key_file)
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: logged in log.read_text(), timeout=10), log.read_text()[-2000:]
        assert status_with(proxy_url, OLD) == 200 and status_with(proxy_url, NEW) == 401
        assert NEW not in log.read_text()


def test_a_reload_reads_the_key_file_off_the_event_loop_and_coalesces_a_burst(tmp_path, monkeypatch):
    """A large key file was read and hashed on the event loop (a 68 MB one: ~3 s in which the proxy
    answered nothing): the read and the digests are made in a worker thread, the table swapped on
    the loop; SIGHUPs during a reload make one more read, not one each."""
    import uvicorn

    from molctl import keys as keys_module
    from molctl.proxy.http.server import DrainingServer

    key_file = tmp_path / "keys"
    write_keys(key_file, NEW)
    reads = []
    real = keys_module.load_keys_settled

    def load_keys_settled(path):
        reads.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.2)  # a large file: the loop must run meanwhile
        return real(path)

    monkeypatch.setattr(keys_module, "load_keys_settled", load_keys_settled)

    class App:
        keys: dict = {}

    app = App()
    server = DrainingServer(uvicorn.Config(lambda *a: None), app, 1.0, key_file)

    async def go():
        ticks = 0
        server.reload_keys()
        while not reads:
            await asyncio.sleep(0.005)
        for _ in range(5):
            server.reload_keys()  # a burst during the first read
        while not server._reloading.done():
            ticks += 1
            await asyncio.sleep(0.01)
        return ticks

    ticks = asyncio.run(go())
    assert reads == [False, False], reads  # in a worker thread; the burst made one more read
    assert ticks >= 5  # the loop ran during the reads
    assert list(app.keys.values()) == [hashlib.sha256(NEW.encode()).hexdigest()[:16]]


def test_a_key_file_swapped_for_a_fifo_during_a_reload_does_not_block_it(tmp_path):
    """Guards a found bug (a key file swapped while it is read): the proxy checked that the file is
    regular (a FIFO would block the read) with a stat, then opened it by name for each of the reads
    that must agree. A FIFO renamed over it between the stat and an
    open blocked the worker thread for ever: every later SIGHUP was folded into that reload (no key
    change took effect again) and the process could not exit (its executor thread never ended).
    Now each read opens the file without blocking and checks the opened file itself."""
    from molctl.keys import load_keys_settled

    key_file = tmp_path / "keys"
    key_file.write_text(OLD + "\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    outcome: list = []

    def reload() -> None:
        try:
            outcome.append(load_keys_settled(key_file, pause_s=0.3))
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=reload, daemon=True)
    worker.start()
    time.sleep(0.1)  # the first read is done; the second comes after pause_s
    os.replace(fifo, key_file)
    worker.join(5)
    if worker.is_alive():  # unblock the stuck reader so the test process can end
        with open(key_file, "wb"):
            pass
        worker.join(5)
        pytest.fail("the reload blocked on a FIFO swapped in during its reads")
    (exc,) = outcome
    assert isinstance(exc, OSError) and "not a regular file" in str(exc), exc
