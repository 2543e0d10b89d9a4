"""A process whose main thread exited while another thread runs on (a zombie leader) still holds
its files, claims and GPU memory: it counts as alive, and `stop` waits for (or kills) its last
thread. Guards an `up` that found a stopped proxy's port claim still held (its leader a zombie,
a worker thread still exiting) and refused to start."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import psutil

from molctl import procid
from molctl.processes import is_alive, stop_processes

# takes a lock, ignores SIGTERM, starts a thread that sleeps on, and exits its main thread only
CHILD = """
import ctypes, fcntl, os, signal, sys, threading, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
threading.Thread(target=time.sleep, args=(120,)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def lock_is_free(path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def leader_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return raw[raw.rfind(")") + 2]


def test_a_zombie_leader_with_a_running_thread_is_alive_until_stopped(tmp_path):
    lock = tmp_path / "port-1.lock"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while leader_state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert leader_state(child.pid) == "Z"
        proc = psutil.Process(child.pid)
        assert proc.status() == psutil.STATUS_ZOMBIE and not lock_is_free(lock)
        assert is_alive(proc) and procid.threads_running(child.pid)
        assert procid.start_ticks(child.pid) is not None  # its record is still "alive"

        result = stop_processes(None, [proc], timeout_s=0.5)  # SIGTERM is ignored: SIGKILL at the deadline
        assert result.killed and result.survivors == []
        assert lock_is_free(lock) and not is_alive(proc) and not procid.threads_running(child.pid)
    finally:
        child.kill()
        child.wait(10)
