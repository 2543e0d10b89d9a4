"""A damaged SQLite store is noticed: `PRAGMA quick_check` when the store is opened (bounded in time
for a large file), by the proxy (exit 1, one line saying what to do) and by `molctl state stats`;
a record that cannot be read is a clear error (StoreError, cause "damaged"; to a client a JSON 500
`store_damaged` naming the request id), never a traceback; once damage is seen the store takes no
more writes. The reproduction: 64 KiB of random bytes in the middle of a store of 300 responses:
the proxy started, 77 of them then answered 500 with a traceback and new records went on into
the damaged file."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from molctl.errors import ExitStatus
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.store.base import StoreError
from molctl.proxy.store.sqlite import admin as sqlite_admin
from molctl.proxy.store.sqlite.schema import store_path
from molctl.proxy.store.sqlite.store import SqliteResponseStore
from tests.helpers import ROOT, free_port, free_ports
from tests.procs import fake_engine_argv, running
from tests.response_records import record

N = 300


def _fill(path: Path, n: int = N) -> None:
    store = SqliteResponseStore(path)
    for i in range(n):
        store.put_response(record(f"resp_{i}", text=f"question {i} " + "x" * 3000))
    store.close()
    con = sqlite3.connect(path)  # everything into the main file (no -wal left), as after a clean stop
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def _damage(path: Path) -> None:
    """64 KiB of random bytes (fixed seed) in the middle of the file, on a page boundary."""
    data = bytearray(path.read_bytes())
    middle = (len(data) // 2) // 4096 * 4096
    data[middle : middle + 65536] = random.Random(32).randbytes(65536)
    path.write_bytes(bytes(data))


def test_a_store_with_damaged_pages_is_refused_when_opened_with_what_to_do(tmp_path):
    path = tmp_path / "store.sqlite3"
    _fill(path)
    assert SqliteResponseStore(path).integrity == "ok"
    _damage(path)
    for reads_only in (False, True):
        with pytest.raises(StoreError) as err:
            SqliteResponseStore(path, reads_only=reads_only)
        message = str(err.value)
        assert err.value.cause == "damaged"
        assert "\n" not in message and message.startswith(f"response store {path}: damaged"), message
        assert "move the file aside" in message and ".recover" in message, message


def test_the_check_is_bounded_in_time_and_says_when_it_did_not_finish(tmp_path):
    path = tmp_path / "store.sqlite3"
    _fill(path)
    store = SqliteResponseStore(path, integrity_check_s=1e-9)
    try:
        assert store.integrity.startswith("not finished in 1e-09 s (a "), store.integrity
        assert sqlite_admin.describe(store)["integrity"] == store.integrity
        assert store.get_response("tenant-a", "resp_7")["id"] == "resp_7"  # the store is usable
    finally:
        store.close()


def test_every_read_of_a_damaged_store_is_a_record_or_one_clear_error(tmp_path):
    """With the check skipped (0; as for the part of a large file it did not reach), reads find the damage: each is a record or a
    StoreError with cause "damaged" (one line), never another exception; the first one seen stops
    the store's writes."""
    path = tmp_path / "store.sqlite3"
    _fill(path)
    _damage(path)
    store = SqliteResponseStore(path, integrity_check_s=0)
    try:
        failed = 0
        for i in range(N):
            try:
                got = store.get_response("tenant-a", f"resp_{i}")
            except StoreError as exc:
                assert exc.cause == "damaged" and "\n" not in str(exc) and "xxxx" not in str(exc), exc
                failed += 1
            else:
                assert got is None or got["id"] == f"resp_{i}"
        assert failed > 0
        assert store.damaged is not None
        with pytest.raises(StoreError) as err:
            store.put_response(record("resp_new"))
        assert err.value.cause == "damaged" and "not written" in str(err.value)
    finally:
        store.close()


def test_a_record_whose_json_is_damaged_is_a_clear_error(tmp_path):
    path = tmp_path / "store.sqlite3"
    store = SqliteResponseStore(path)
    try:
        store.put_response(record("resp_ok"))
        store.put_response(record("resp_bad"))
        con = sqlite3.connect(path, isolation_level=None)
        con.execute("UPDATE responses SET response = '{\"id\": \"resp_b' WHERE id = 'resp_bad'")
        con.close()
        with pytest.raises(StoreError) as err:
            store.get_response("tenant-a", "resp_bad")
        assert err.value.cause == "damaged" and "resp_bad" in str(err.value), err.value
        assert store.get_response("tenant-a", "resp_ok")["id"] == "resp_ok"
    finally:
        store.close()


def _proxy_argv(state: Path, port: int, upstream: str = "http://127.0.0.1:9") -> list[str]:
    return [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--allow-unauthenticated",
    ]


def _state(tmp_path: Path) -> tuple[Path, Path]:
    state = tmp_path / "state"
    path = store_path(state, "tiny")
    path.parent.mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    return state, path


def test_the_proxy_refuses_a_damaged_store_with_one_line_and_exit_1(tmp_path):
    state, path = _state(tmp_path)
    _fill(path)
    _damage(path)
    proc = subprocess.run(_proxy_argv(state, free_port()), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == ExitStatus.ERROR, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("molctl: error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "damaged" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_state_stats_of_a_damaged_store_exits_1_with_one_line(molctl, state_dir):
    path = store_path(state_dir, "tiny")
    path.parent.mkdir(mode=0o700)
    _fill(path)
    data = molctl("state", "stats", "tiny", "--json").json()
    assert data["integrity"] == "ok"
    _damage(path)
    result = molctl("state", "stats", "tiny", "--json")
    assert result.exit_code == ExitStatus.ERROR
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr and "damaged" in result.stderr
    assert molctl("state", "prune", "tiny").exit_code == ExitStatus.ERROR  # nothing written into it


def test_a_damaged_record_is_a_json_500_naming_the_request_id_not_a_traceback(tmp_path):
    state, path = _state(tmp_path)
    store = SqliteResponseStore(path)
    store.put_response(record("resp_bad", tenant="anon"))
    store.close()
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("UPDATE responses SET response = 'not json' WHERE id = 'resp_bad'")
    con.close()
    engine_port, port = free_ports(2)
    engine, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    with (
        running(fake_engine_argv(engine_port), engine + "/health"),
        running(_proxy_argv(state, port, engine), url + "/health", log=log),
    ):
        r = httpx.get(url + "/v1/responses/resp_bad", timeout=10)
        ready = httpx.get(url + "/readyz", timeout=10)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "store_damaged" and error["type"] == "server_error", error
    assert r.headers["x-request-id"] in error["message"]
    assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
    assert "damaged" in ready.json()["detail"]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert load_profile("tiny", profile_dirs()).served_model_name not in error["message"]


def test_state_stats_never_writes_a_schema_into_an_empty_store_file(molctl, state_dir):
    """`state stats` is a reader: a 0-byte store file (created, never written: a proxy killed at
    once, a `touch`) stays 0 bytes; it is shown as a store without a schema, holding nothing."""
    path = store_path(state_dir, "tiny")
    path.parent.mkdir(mode=0o700)
    path.touch(mode=0o600)
    result = molctl("state", "stats", "tiny", "--json")
    assert result.exit_code == ExitStatus.OK, result.stderr
    data = result.json()
    assert (data["exists"], data["schema_version"], data["responses"]) == (True, None, 0), data
    assert path.stat().st_size == 0
    assert not Path(str(path) + "-wal").exists()
