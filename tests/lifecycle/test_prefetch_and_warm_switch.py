"""`molctl prefetch` and the warm `switch` (issue 44): the target's shards go into the page cache
on bounded threads, only while the host's available memory stays above a margin; a file that
does not fit is skipped with the reason. The memory probe and the reader are injected here; the
last tests run real molctl processes (the CLI, and a switch between two stacks of the scripted
engine)."""

from __future__ import annotations

import json
import threading

from molctl.errors import ExitStatus
from molctl.prefetch import GIB, Prefetcher, read_blocks
from tests.lifecycle_host import add_tiny_b


def _files(tmp_path, sizes):
    out = []
    for i, size in enumerate(sizes):
        p = tmp_path / f"model-{i:05d}.safetensors"
        p.write_bytes(b"\0" * size)
        out.append(p)
    return out


def test_every_file_is_read_in_blocks_on_bounded_threads(tmp_path):
    files = _files(tmp_path, [5000, 3000, 7000, 1000, 2000])
    active, most = [0], [0]
    lock = threading.Lock()

    def reader(path, block, keep_going):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return read_blocks(path, block, keep_going)
        finally:
            with lock:
                active[0] -= 1

    result = Prefetcher(files, threads=2, margin_bytes=0, available=lambda: 10 * GIB, reader=reader, block=1024).run()
    assert result.bytes_read == result.bytes_total == 18000 and sorted(result.read) == sorted(map(str, files))
    assert result.skipped == [] and 1 <= most[0] <= 2


def test_a_file_that_would_eat_into_the_margin_is_skipped_with_the_reason(tmp_path):
    big, small = _files(tmp_path, [8000, 100])
    memory = {"available": 10_000}

    def reader(path, block, keep_going):
        n = read_blocks(path, block, keep_going)
        memory["available"] -= n  # the page cache it filled counts as used
        return n

    result = Prefetcher(
        [big, small], threads=1, margin_bytes=5_000, available=lambda: memory["available"], reader=reader, block=50
    ).run()
    assert result.read == [str(small)] and result.bytes_read == 100
    [skipped] = result.skipped
    assert skipped["file"] == str(big) and "below the margin" in skipped["reason"]
    assert "running stack keeps its memory" in skipped["reason"]


def test_a_read_stops_when_memory_runs_low_midway(tmp_path):
    [f] = _files(tmp_path, [10_000])
    memory = {"available": 20_000}

    def reader(path, block, keep_going):
        done = 0
        while done < 10_000 and keep_going():
            done += block
            memory["available"] -= block + 2_000  # the page cache, and the running stack allocating meanwhile
        return done

    out = Prefetcher([f], margin_bytes=5_000, available=lambda: memory["available"], reader=reader, block=1000).run()
    assert out.read == [] and out.bytes_read == 5_000  # the 6th block would have left less than the margin
    [skipped] = out.skipped
    assert skipped["reason"].startswith("stopped after 5000 bytes: available memory")


def test_the_prefetch_command_reads_the_profiles_files(host):
    r = host.molctl("prefetch", "tiny", "--model-root", str(host.model), "--json")
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    # 2 base shards + L0-L3; a host short of memory skips them and says why: never both, never neither
    assert out["files"] == 6 and out["files_read"] + len(out["skipped"]) == 6
    assert all("margin" in s["reason"] for s in out["skipped"])


def test_switch_prefetches_the_target_while_the_old_stack_drains(host):
    add_tiny_b(host)
    assert host.up().exit_code == ExitStatus.OK
    r = host.molctl("switch", "tiny-b", *host.args("--json", engine_port=host.engine_port))
    assert r.exit_code == ExitStatus.OK, r.stderr
    out = json.loads(r.stdout)
    assert out["stopped"] == ["tiny"] and out["prefetch"]["files"] == 6
    assert out["prefetch"]["files_read"] + len(out["prefetch"]["skipped"]) == 6
    r = host.molctl("switch", "tiny", *host.args("--json", "--no-prefetch"))
    assert r.exit_code == ExitStatus.OK, r.stderr
    assert "prefetch" not in json.loads(r.stdout)
