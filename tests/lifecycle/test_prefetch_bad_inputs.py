"""`molctl prefetch` and the warm `switch` against what an operator's model root may really hold
(issue 44): a FIFO or a link to /dev/zero among the shards is skipped with the reason instead of
blocking or reading for ever; a dangling link does not turn a switch into an error; a model root
without the base's shards is exit 3 naming it; Ctrl-C stops the readers and starts no other file."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from molctl.errors import ExitStatus
from molctl.prefetch import GIB, Prefetcher
from tests.lifecycle_host import add_tiny_b


def test_a_fifo_a_device_and_a_directory_among_the_shards_are_skipped_with_the_reason(host):
    base = host.model / "base"
    os.mkfifo(base / "zz-fifo.safetensors")  # open() would wait for a writer for ever
    (base / "zz-zero.safetensors").symlink_to("/dev/zero")  # a read that never ends
    (base / "zz-dir.safetensors").mkdir()
    r = host.molctl("prefetch", "tiny", "--model-root", str(host.model), "--json", timeout=60)
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    reasons = {os.path.basename(s["file"]): s["reason"] for s in out["skipped"]}
    assert reasons["zz-fifo.safetensors"] == "a FIFO, not a regular file"
    assert reasons["zz-zero.safetensors"] == "a device, not a regular file"
    assert reasons["zz-dir.safetensors"] == "a directory, not a regular file"
    assert out["files"] == 9 and out["files_read"] + len(out["skipped"]) == 9


def test_a_model_root_without_the_base_shards_is_exit_3_naming_it(host, tmp_path):
    missing = tmp_path / "no-such-root"
    r = host.molctl("prefetch", "tiny", "--model-root", str(missing))
    assert r.exit_code == ExitStatus.CHECK_FAILED and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"{missing}/base is not a directory" in r.stderr
    assert "--model-root" in r.stderr and "Traceback" not in r.stderr
    (missing / "base").mkdir(parents=True)
    r = host.molctl("prefetch", "tiny", "--model-root", str(missing))
    assert r.exit_code == ExitStatus.CHECK_FAILED and "holds no *.safetensors shard" in r.stderr


def test_a_dangling_link_among_the_shards_is_the_prefetchs_skip_not_the_switchs_error(host):
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    (host.model / "base" / "zz-gone.safetensors").symlink_to(host.tmp / "gone")
    # --skip model: the shards' own check would fail the switch before it stops anything
    r = host.molctl("switch", "tiny-b", *host.args("--json", "--skip", "model"))
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    assert out["stopped"] == ["tiny"]
    [gone] = [s for s in out["prefetch"]["skipped"] if s["file"].endswith("zz-gone.safetensors")]
    assert gone["reason"].startswith("cannot stat: No such file")


def test_ctrl_c_stops_the_readers_and_starts_no_other_file(tmp_path):
    files = []
    for i in range(4):
        files.append(tmp_path / f"model-{i}.safetensors")
        files[-1].write_bytes(b"\0" * 100)
    started, calls = threading.Event(), []

    def reader(path, block, keep_going):
        """A read of a huge shard: one block after another while keep_going()."""
        calls.append(path)
        started.set()
        deadline = time.monotonic() + 60
        while keep_going() and time.monotonic() < deadline:
            time.sleep(0.01)
        return 0

    main = threading.main_thread().ident

    def ctrl_c():
        if started.wait(60):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    pre = Prefetcher(files, threads=1, margin_bytes=0, available=lambda: 10 * GIB, reader=reader)
    with pytest.raises(KeyboardInterrupt):
        pre.run()
    assert len(calls) == 1  # the other files were never started
    # no reader left: a Ctrl-C inside the pool's Thread.start() leaves that thread unjoined, but
    # it ends by itself at the stop (a generous deadline, never met by a reader still reading)
    deadline = time.monotonic() + 30
    while [t for t in threading.enumerate() if t.name.startswith("molctl-prefetch")]:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.05)


def test_the_main_thread_never_waits_untimed_on_the_readers(tmp_path, monkeypatch):
    """Guards a Ctrl-C handled only once the file being read ended: a SIGINT that landed just before
    an untimed wait blocked (the Ctrl-C test above ran into its reader's 60 s deadline and saw a
    second file started). The main thread waits on the readers at most WAKE_S at a time."""
    import molctl.prefetch as prefetch

    timeouts, real_wait = [], prefetch.wait

    def spy(fs, timeout=None, return_when="ALL_COMPLETED"):
        timeouts.append(timeout)
        return real_wait(fs, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(prefetch, "wait", spy)
    files = [tmp_path / "model-0.safetensors", tmp_path / "model-1.safetensors"]
    for f in files:
        f.write_bytes(b"\0" * 100)

    def reader(path, block, keep_going):
        time.sleep(0.5)
        return path.stat().st_size

    result = Prefetcher(files, threads=1, margin_bytes=0, available=lambda: 10 * GIB, reader=reader).run()
    assert len(result.read) == 2 and not result.stopped
    assert len(timeouts) >= 4 and all(t is not None and t <= prefetch.WAKE_S for t in timeouts), timeouts
