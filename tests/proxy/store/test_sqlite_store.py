"""The SQLite response store (molctl.proxy.store.sqlite): records per tenant, durability across
reopen and proxy restarts, TTL and eviction with an injected clock, mode 0600, a corrupted /
locked / foreign-schema file refused with one line (by the store, `molctl proxy`, `molctl check`),
and `molctl state stats|prune`."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from molctl.errors import ExitStatus, ProfileError
from molctl.profiles import load_profile, profile_dirs
from molctl.proxy.store.base import StoreError
from molctl.proxy.store.factory import open_store, parse_store_spec
from molctl.proxy.store.memory import MemoryResponseStore
from molctl.proxy.store.sqlite import admin as sqlite_admin
from molctl.proxy.store.sqlite.schema import SCHEMA_VERSION, store_path
from molctl.proxy.store.sqlite.store import SqliteResponseStore
from tests.helpers import ROOT, free_port, free_ports
from tests.response_records import record

DAY = 24 * 3600


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def db(tmp_path) -> Path:
    return tmp_path / "store.sqlite3"


# ------------------------------------------------------------------------------ the store itself


def test_put_get_delete_per_tenant(db):
    store = SqliteResponseStore(db, clock=Clock())
    rec = record("resp_1", prev="resp_0", reasoning={"effort": "low"})
    store.put_response(rec)
    assert store.get_response("tenant-a", "resp_1") == rec  # every field back, extra keys included
    assert store.get_response("tenant-b", "resp_1") is None  # another tenant's id is unknown
    assert store.delete_response("tenant-b", "resp_1") is False
    assert store.get_response("tenant-a", "resp_1") == rec
    assert store.delete_response("tenant-a", "resp_1") is True
    assert store.get_response("tenant-a", "resp_1") is None
    assert store.delete_response("tenant-a", "resp_1") is False
    store.put_response(record("resp_2", tenant="tenant-b"))
    store.put_response(record("resp_2", tenant="tenant-b", text="again"))  # same id again: replaced, counted once
    assert store.get_response("tenant-b", "resp_2")["messages"][0]["content"] == "again"
    assert store.stats()["responses"] == 1
    store.close()


def test_durable_across_reopen(db):
    clock = Clock()
    first = SqliteResponseStore(db, clock=clock)
    first.put_response(record("resp_1", text="remember me"))
    first.close()
    second = SqliteResponseStore(db, clock=clock)  # a new process's store on the same file
    assert second.get_response("tenant-a", "resp_1")["messages"][0]["content"] == "remember me"
    assert second.stats()["responses"] == 1
    second.close()


def test_file_mode_0600_and_default_place(tmp_path):
    state = tmp_path / "state"
    store = open_store("sqlite", state, "tiny")
    path = store_path(state, "tiny")
    assert store.path == path == state / "tiny" / "proxy-store.sqlite3"
    store.put_response(record("resp_1"))
    for p in (path, Path(str(path) + "-wal")):
        assert p.stat().st_mode & 0o777 == 0o600, p
    assert state.stat().st_mode & 0o777 == 0o700
    assert (state / "tiny").stat().st_mode & 0o777 == 0o700
    store.close()
    assert isinstance(open_store("memory", state, "tiny"), MemoryResponseStore)


def test_ttl_expired_invisible_then_pruned(db):
    clock = Clock()
    store = SqliteResponseStore(db, ttl_s=10 * DAY, clock=clock)
    store.put_response(record("resp_old", created_at=clock.t))
    clock.t += 5 * DAY
    store.put_response(record("resp_new", created_at=clock.t))
    clock.t += 6 * DAY  # resp_old is 11 days old: expired, invisible at once; resp_new (6 days) lives
    assert store.get_response("tenant-a", "resp_old") is None
    assert store.get_response("tenant-a", "resp_new") is not None
    assert store.stats()["responses"] == 2  # still on disk until pruned
    assert sqlite_admin.prune(store) == {
        "expired": 1,
        "evicted": 0,
        "conversation_expired": 0,
        "conversation_evicted": 0,
    }
    stats = store.stats()
    assert (stats["responses"], stats["responses_expired"]) == (1, 1)
    clock.t += 5 * DAY  # resp_new expires too: the next put (past the prune interval) deletes it
    store.put_response(record("resp_newer", created_at=clock.t))
    assert store.stats()["responses"] == 1
    assert store.stats()["responses_expired"] == 2
    store.close()


def test_expiry_goes_on_after_the_clock_stepped_back(db):
    """After the clock stepped back (NTP, a VM restored) `now - last pass` stayed negative and the
    automatic expiry pass stopped until the clock caught up with the last pass (here 10 days)."""
    clock = Clock()
    store = SqliteResponseStore(db, ttl_s=DAY, clock=clock)
    store.put_response(record("resp_a", created_at=clock.t))
    clock.t -= 10 * DAY
    store.put_response(record("resp_b", created_at=clock.t))
    clock.t += 2 * DAY  # resp_b is 2 days old: expired; still 8 days before the first pass
    store.put_response(record("resp_c", created_at=clock.t))
    assert store.stats()["responses_expired"] == 1
    store.close()


def test_eviction_oldest_first_by_count_and_bytes(db):
    clock = Clock()
    store = SqliteResponseStore(db, max_entries=3, clock=clock)
    for i in range(5):
        clock.t += 1
        store.put_response(record(f"resp_{i}", created_at=clock.t))
    assert [store.get_response("tenant-a", f"resp_{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.stats()["responses_evicted"] == 2
    store.close()

    one = len(json.dumps(record("x", text="y" * 1000)))  # about one record's bytes
    store = SqliteResponseStore(db, max_entries=100, max_bytes=int(one * 2.5), clock=clock)
    for i in range(4):
        clock.t += 1
        store.put_response(record(f"big_{i}", created_at=clock.t, text="y" * 1000))
    stats = store.stats()
    assert stats["responses_bytes"] <= int(one * 2.5)
    assert store.get_response("tenant-a", "big_3") is not None and store.get_response("tenant-a", "big_0") is None
    assert stats["responses_evicted"] >= 2 + 2  # the 3 small ones of before went first, then the oldest big ones
    store.close()


def test_corrupted_file_is_one_clear_line(db):
    db.write_bytes(os.urandom(4096))
    with pytest.raises(StoreError) as err:
        SqliteResponseStore(db)
    message = str(err.value)
    assert "\n" not in message and str(db) in message and "not a database" in message


def test_a_file_shorter_than_a_header_is_not_taken_for_an_empty_store(db):
    """SQLite reads a 1-byte file as an empty database: the store wrote a new schema over it and
    `state prune` exited 0 (found by the CLI review); an empty file is still a new store."""
    for content in (b"x", b"\x00" * 99):
        db.write_bytes(content)
        with pytest.raises(StoreError) as err:
            SqliteResponseStore(db)
        assert "not a database" in str(err.value) and db.read_bytes() == content
    db.write_bytes(b"")
    SqliteResponseStore(db).close()
    assert db.stat().st_size > 0


def test_a_store_file_deleted_or_replaced_under_the_proxy_is_reported(db, caplog):
    """The proxy went on writing a store file deleted (or replaced) under it, silently: all of it
    lost at the next restart (found by the store review). `stats` (the metrics) says so, and the
    proxy logs it once."""
    store = SqliteResponseStore(db)
    store.put_response(record("resp_1"))
    assert store.stats()["file_replaced"] == 0
    db.rename(db.with_suffix(".moved"))
    with caplog.at_level("WARNING", logger="molctl.proxy"):
        assert store.stats()["file_replaced"] == 1
        db.write_bytes(b"")  # a new file at the path: still not the one being written
        assert store.stats()["file_replaced"] == 1
    assert [r.message for r in caplog.records].count(
        f"response store {db} was deleted or replaced while this proxy runs: what it stores from now on is lost "
        "when it restarts (restart it to use the file at that path)"
    ) == 1
    store.close()


def test_schema_version_mismatch_is_refused(db):
    SqliteResponseStore(db).close()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(StoreError, match=f"schema version 99, this molctl knows {SCHEMA_VERSION}"):
        SqliteResponseStore(db)


def test_locked_file_is_one_clear_line(db):
    SqliteResponseStore(db).close()
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError) as err:
            SqliteResponseStore(db, busy_timeout_s=0.2)
        assert "locked" in str(err.value) and str(db) in str(err.value) and "\n" not in str(err.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_store_spec_and_profile_field():
    assert parse_store_spec("sqlite") == ("sqlite", None)
    assert parse_store_spec("memory") == ("memory", None)
    assert parse_store_spec("sqlite:/var/lib/x.sqlite3") == ("sqlite", Path("/var/lib/x.sqlite3"))
    for bad in ("redis", "sqlite:", "sqlite:relative.db"):
        with pytest.raises(ValueError):
            parse_store_spec(bad)
    assert load_profile("tiny", profile_dirs()).proxy.store == "sqlite"
    assert load_profile("tiny", profile_dirs(), [("proxy.store", "memory")]).proxy.store == "memory"
    with pytest.raises(ProfileError, match="proxy.store"):
        load_profile("tiny", profile_dirs(), [("proxy.store", "redis")])
    with pytest.raises(ProfileError, match="proxy.store_max_bytes"):
        load_profile("tiny", profile_dirs(), [("proxy.store_max_bytes", 0)])


# ------------------------------------------------------------------------------ molctl proxy


def _proxy(state: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        "http://127.0.0.1:9",
        "--port",
        str(port),
        "--allow-unauthenticated",
        *extra,
    ]


def test_proxy_refuses_a_corrupted_store(tmp_path):
    state = tmp_path / "state"
    path = store_path(state, "tiny")
    path.parent.mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    path.write_bytes(b"this is not a database" * 100)
    proc = subprocess.run(_proxy(state, free_port()), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == ExitStatus.ERROR, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("molctl: error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "not a database" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_proxy_creates_its_store_in_the_state_dir(tmp_path):
    from tests.procs import running

    state, port = tmp_path / "state", free_port()
    with running(_proxy(state, port), f"http://127.0.0.1:{port}/health"):
        assert store_path(state, "tiny").stat().st_mode & 0o777 == 0o600
    memory_state = tmp_path / "memory-state"
    with running(_proxy(memory_state, port, "--store", "memory"), f"http://127.0.0.1:{port}/health"):
        assert not store_path(memory_state, "tiny").exists()


def test_previous_response_id_survives_a_proxy_restart(tmp_path):
    import openai

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine = f"http://127.0.0.1:{engine_port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
    ]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = load_profile("tiny", profile_dirs()).served_model_name
    with running(fake_engine_argv(engine_port), engine + "/health"):
        with running(argv, f"http://127.0.0.1:{port}/health"):
            first = client.responses.create(model=model, input="remember the word apple", max_output_tokens=16)
        with running(argv, f"http://127.0.0.1:{port}/health"):  # a new proxy process on the same state dir
            second = client.responses.create(
                model=model, input="which word?", previous_response_id=first.id, max_output_tokens=16
            )
            assert second.previous_response_id == first.id
            assert client.responses.retrieve(first.id).id == first.id


# ------------------------------------------------------------------------------ molctl state, molctl check


def _seed(state: Path, ages_days: list[float]) -> None:
    now = time.time()
    store = open_store("sqlite", state, "tiny", clock=lambda: now - 50 * DAY)  # written in the past: none expires yet
    for i, age in enumerate(ages_days):
        store.put_response(record(f"resp_{i}", created_at=now - age * DAY))
    store.close()


def test_state_stats_and_prune(molctl, state_dir):
    result = molctl("state", "stats", "tiny", "--json")
    assert result.exit_code == ExitStatus.OK, result.stderr
    data = result.json()
    assert (data["backend"], data["exists"], data["responses"]) == ("sqlite", False, 0)
    assert data["path"] == str(store_path(state_dir, "tiny"))
    assert not store_path(state_dir, "tiny").exists()  # stats never creates it

    _seed(state_dir, [40, 31, 2, 1])
    data = molctl("state", "stats", "tiny", "--json").json()
    assert (data["exists"], data["responses"], data["expired_pending"], data["schema_version"]) == (
        True,
        4,
        2,
        SCHEMA_VERSION,
    )
    assert data["bytes"] > 0 and data["file_bytes"] >= data["bytes"] and data["bounds"]["ttl_s"] == 30 * DAY
    assert abs(data["oldest_created_at"] - (time.time() - 40 * DAY)) < 60
    text = molctl("state", "stats", "tiny")
    assert (
        text.exit_code == ExitStatus.OK and "4 response(s)" in text.stdout and "2 expired not yet pruned" in text.stdout
    )

    result = molctl("state", "prune", "tiny", "--json")
    assert result.exit_code == ExitStatus.OK, result.stderr
    data = result.json()
    assert data["removed"] == {"expired": 2, "evicted": 0, "conversation_expired": 0, "conversation_evicted": 0}
    assert (data["responses"], data["expired"], data["expired_pending"]) == (2, 2, 0)
    assert "pruned: 0 expired" in molctl("state", "prune", "tiny").stdout

    assert molctl("state", "stats", "no-such-profile").exit_code == ExitStatus.CHECK_FAILED
    assert molctl("state", "prune", "no-such-profile", "--json").exit_code == ExitStatus.CHECK_FAILED


def test_state_stats_of_a_corrupted_store_fails_with_one_line(molctl, state_dir):
    path = store_path(state_dir, "tiny")
    path.parent.mkdir(mode=0o700)
    path.write_bytes(os.urandom(2048))
    result = molctl("state", "stats", "tiny")
    assert result.exit_code == ExitStatus.ERROR
    assert result.stderr.count("\n") == 1 and str(path) in result.stderr


SKIP_ALL_BUT_STATE = [
    a for c in ("engine", "gpu", "model", "adapter", "template", "port", "security") for a in ("--skip", c)
]


def _store_check(molctl) -> tuple[str, str]:
    result = molctl("check", "tiny", *SKIP_ALL_BUT_STATE, "--json")
    return next((c["status"], c["detail"]) for c in result.json()["checks"] if c["id"] == "state.store")


def test_check_state_store(molctl, state_dir):
    path = store_path(state_dir, "tiny")
    assert _store_check(molctl) == ("pass", f"{path} will be created (mode 0600)")
    _seed(state_dir, [1])
    status, detail = _store_check(molctl)
    assert status == "pass" and "schema version known, 1 stored response(s)" in detail
    path.chmod(0o644)
    assert _store_check(molctl)[0] == "fail"
    path.chmod(0o600)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    status, detail = _store_check(molctl)
    assert status == "fail" and "schema version 7" in detail
    path.write_bytes(os.urandom(4096))
    for sfx in ("-wal", "-shm"):
        Path(str(path) + sfx).unlink(missing_ok=True)
    status, detail = _store_check(molctl)
    assert status == "fail" and "not a database" in detail and str(path) in detail
    result = molctl("check", "tiny", *SKIP_ALL_BUT_STATE)
    assert result.exit_code == ExitStatus.CHECK_FAILED
    assert _store_check_memory(molctl)[0] == "pass"


def _store_check_memory(molctl) -> tuple[str, str]:
    result = molctl("check", "tiny", *SKIP_ALL_BUT_STATE, "--set", "proxy.store=memory", "--json")
    return next((c["status"], c["detail"]) for c in result.json()["checks"] if c["id"] == "state.store")


def test_previous_response_id_survives_down_and_up(tmp_path):
    """`molctl up` gives the proxy its state dir: a chain continues across `down` and `up`."""
    import openai

    from tests.lifecycle_host import Host

    host = Host(tmp_path)
    try:
        r = host.up("--json")
        assert r.exit_code == ExitStatus.OK, r.stderr
        endpoint = r.json()["endpoint"]
        client = openai.OpenAI(base_url=endpoint, api_key="none", max_retries=0)
        model = load_profile("tiny", profile_dirs()).served_model_name
        first = client.responses.create(model=model, input="[route:L2] remember apple", max_output_tokens=16)
        assert store_path(host.state, "tiny").is_file()
        assert host.molctl("down").exit_code == ExitStatus.OK
        assert host.up().exit_code == ExitStatus.OK
        second = client.responses.create(
            model=model, input="which word?", previous_response_id=first.id, max_output_tokens=16
        )
        assert second.previous_response_id == first.id
        stats = host.molctl("state", "stats", "tiny", "--json").json()
        assert stats["responses"] == 2
    finally:
        host.cleanup()


# ------------------------------------------------------------------------------ chat conversations (schema 2)


def _conv(db: Path, clock=None, **bounds):
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=clock or Clock(), **bounds)
    return store, SqliteConversationStore(store)


def test_turns_and_calls_survive_a_reopen(db):
    from molctl.proxy.conversations import CallBinding, TurnRecord

    clock = Clock()
    key, other = bytes(range(32)), bytes(32)
    first, conv = _conv(db, clock)
    record = TurnRecord("L2")
    conv.put_turn(key, record)
    conv.put_turn(other, TurnRecord("L1"))  # its summary never comes (the process stops first)
    conv.put_call("tenant-a", "call_1", CallBinding("L3", '{"city":"Paris"}', "get_weather"))
    assert conv.get_turn(key) is record and not record.done.is_set()  # the hot cache: the same live record
    record.set_summary("the user asked for a parser")  # persisted through on_change
    conv.put_turn(key, record)  # what the orchestrator does after a summary: a recount, no second write
    assert first.stats()["conversation_rows"] == 3
    first.close()

    second, conv = _conv(db, clock)  # a new process on the same file
    back = conv.get_turn(key)
    assert (back.route, back.summary, back.summary_failed, back.stale) == (
        "L2",
        "the user asked for a parser",
        False,
        False,
    )
    assert back.done.is_set()  # nobody waits for a summary recorded by another process
    pending = conv.get_turn(other)
    assert (pending.route, pending.summary, pending.summary_failed) == ("L1", None, True) and pending.done.is_set()
    assert conv.get_call("tenant-a", "call_1") == CallBinding("L3", '{"city":"Paris"}', "get_weather")
    assert conv.get_call("tenant-b", "call_1") is None  # per tenant
    assert conv.get_turn(bytes([1] * 32)) is None
    assert conv.get_turn(key) is back  # cached after the first read
    stats = conv.stats()
    assert (stats["durable_rows"], stats["write_errors"]) == (3, 0) and stats["entries"] == 3
    second.close()


def test_get_turns_reads_the_cache_misses_in_one_query(db):
    """A client that resends 600 earlier turns this proxy never recorded (or a proxy restarted
    with a cold cache) paid one SELECT per turn on every request (~8 us each: 100 turns ~1 ms);
    get_turns gives what get_turn gives, key by key, with one SELECT per 500 misses."""
    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    clock = Clock()
    store, conv = _conv(db, clock, ttl_s=10 * DAY)
    stored = [bytes([i]) * 32 for i in range(1, 4)]
    for i, key in enumerate(stored):
        conv.put_turn(key, TurnRecord(f"L{i}", summary=f"s{i}"))
    conv.write_queued()
    clock.t += 11 * DAY
    conv.put_turn(bytes([9]) * 32, TurnRecord("L3", summary="fresh"))  # written after the first three expired
    conv.write_queued()
    queued = bytes([8]) * 32
    conv.put_turn(queued, TurnRecord("L1", summary="queued"))  # not written yet
    store2 = SqliteResponseStore(db, clock=clock, ttl_s=10 * DAY)
    cold = SqliteConversationStore(store2)
    cold.put_turn(bytes([7]) * 32, TurnRecord("L2"))  # in the cold store's own cache and queue
    absent = [bytes([100 + i % 100, i // 100]) * 16 for i in range(600)]
    keys = [stored[0], bytes([9]) * 32, queued, bytes([7]) * 32, *absent, stored[2]]
    statements = []
    store2._conn.set_trace_callback(statements.append)
    many = cold.get_turns(keys)
    selects = [q for q in statements if q.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 2  # 601 misses (the queued row of another store is not visible): 2 chunks of <= 500
    store2._conn.set_trace_callback(None)
    cold2 = SqliteConversationStore(SqliteResponseStore(db, clock=clock, ttl_s=10 * DAY))
    cold2.put_turn(bytes([7]) * 32, TurnRecord("L2"))
    one = [cold2.get_turn(k) for k in keys]
    shape = [None if r is None else (r.route, r.summary, r.summary_failed, r.stale) for r in many]
    assert shape == [None if r is None else (r.route, r.summary, r.summary_failed, r.stale) for r in one]
    assert shape[0] is None and shape[1] == ("L3", "fresh", False, False)  # expired / stored
    assert shape[3] == ("L2", None, False, False) and shape[4:-1] == [None] * 600
    assert cold.get_turns([bytes([9]) * 32])[0] is many[1]  # cached after the read, as get_turn does
    store.close()
    store2.close()


def test_a_request_looks_its_earlier_turns_up_in_one_query(db):
    """The orchestrator's prepare() uses get_turns when the store has it (SQLite)."""
    from molctl.engines import get_engine
    from molctl.profiles import load_profile, profile_dirs
    from molctl.proxy.pipeline.run import Orchestrator

    store, conv = _conv(db)
    profile = load_profile("tiny", profile_dirs())
    orch = Orchestrator(profile, get_engine("vllm"), None, conv)
    messages = [
        m for i in range(50) for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})
    ]
    statements = []
    store._conn.set_trace_callback(statements.append)
    plan = orch.prepare(
        {"model": profile.served_model_name, "messages": [*messages, {"role": "user", "content": "next"}]}, "t"
    )
    store._conn.set_trace_callback(None)
    assert len(plan.history.segments) == 50 and all(seg.record is None for seg in plan.history.segments)
    assert len([q for q in statements if q.lstrip().upper().startswith("SELECT")]) == 1  # was 50
    store.close()


def test_stale_and_failed_summaries_persisted(db):
    from molctl.proxy.conversations import TurnRecord

    clock = Clock()
    store, conv = _conv(db, clock)
    stale, failed = TurnRecord("L1"), TurnRecord("L3")
    conv.put_turn(b"s" * 32, stale)
    conv.put_turn(b"f" * 32, failed)
    stale.mark_stale()
    stale.set_summary(None)
    failed.set_summary(None)
    store.close()
    store, conv = _conv(db, clock)
    s, f = conv.get_turn(b"s" * 32), conv.get_turn(b"f" * 32)
    assert (s.stale, s.summary, s.summary_failed) == (True, None, True)
    assert (f.stale, f.summary, f.summary_failed) == (False, None, True)
    store.close()


def test_conversation_rows_ttl_caps_and_stats(db):
    from molctl.proxy.conversations import CallBinding, TurnRecord

    clock = Clock()
    store, conv = _conv(db, clock, ttl_s=10 * DAY, max_entries=3)
    conv.put_turn(b"a" * 32, TurnRecord("L1", summary="x"))
    clock.t += 11 * DAY
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    cold = SqliteConversationStore(store)  # no cache: what a restarted proxy sees
    assert cold.get_turn(b"a" * 32) is None  # expired: invisible at once
    for i in range(4):
        clock.t += 1
        conv.put_call("t", f"call_{i}", CallBinding("L2", "{}", "f"))  # the first put past the interval expires "a"
    stats = store.stats()
    assert (stats["conversation_rows"], stats["conversation_expired"], stats["conversation_evicted"]) == (3, 1, 1)
    cold = SqliteConversationStore(store)
    assert [cold.get_call("t", f"call_{i}") is not None for i in range(4)] == [False, True, True, True]  # oldest first
    assert stats["responses"] == 0  # counted apart from the responses
    described = sqlite_admin.describe(store)
    assert (described["turns"], described["calls"], described["conversation_expired_pending"]) == (0, 3, 0)
    store.close()


def _v1_file(db: Path) -> None:
    """A schema-1 file as the previous molctl wrote it (responses only), with one response."""
    from molctl.proxy.store.sqlite.schema import SCHEMA, _statements

    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    for statement in _statements(SCHEMA):
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    conn.execute(
        "INSERT INTO responses (tenant, id, created_at, previous_response_id, route, messages, input_items, "
        "response, extra, size) VALUES ('tenant-a', 'resp_v1', ?, NULL, 'L2', '[]', '[]', '{\"id\":\"resp_v1\"}', "
        "'{}', 20)",
        (1_800_000_000.0,),
    )
    conn.close()


def test_schema_1_file_is_migrated_in_place(db):
    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    _v1_file(db)
    store = SqliteResponseStore(db, clock=Clock())
    assert store.migrated_from == 1 and SCHEMA_VERSION == 3
    assert store.get_response("tenant-a", "resp_v1")["response"] == {"id": "resp_v1"}  # nothing wiped
    assert store.stats()["responses"] == 1
    SqliteConversationStore(store).put_turn(b"k" * 32, TurnRecord("L1", summary="s"))
    store.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("SELECT count(*) FROM turns").fetchone()[0] == 1
    conn.close()
    again = SqliteResponseStore(db, clock=Clock())  # already v2: opened as it is
    assert again.migrated_from is None and again.stats()["conversation_rows"] == 1
    again.close()


def test_state_stats_shows_conversations(molctl, state_dir):
    from molctl.proxy.conversations import CallBinding, TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = open_store("sqlite", state_dir, "tiny")
    conv = SqliteConversationStore(store)
    conv.put_turn(b"k" * 32, TurnRecord("L1", summary="s"))
    conv.put_call("anon", "call_1", CallBinding("L2", "{}", "f"))
    store.close()
    data = molctl("state", "stats", "tiny", "--json").json()
    assert (data["conversations"]["turns"], data["conversations"]["calls"], data["schema_version"]) == (
        1,
        1,
        SCHEMA_VERSION,
    )
    text = molctl("state", "stats", "tiny").stdout
    assert "1 turn(s), 1 tool call(s)" in text


def test_chat_continuity_survives_a_proxy_restart(tmp_path):
    """Two chat turns on one proxy process, a tool call; a new process on the same store: the third
    turn still folds turn 1 with its summary, and the tool result goes to the adapter that issued
    the call with no route hop."""
    import httpx
    import openai

    from tests.procs import fake_engine_argv, running

    profile = load_profile("tiny", profile_dirs())
    identity = {"role": "system", "content": profile.substitute(profile.prompts.identity).strip()}

    def fold(summary: str) -> dict:
        return {"role": "assistant", "content": profile.prompts.fold.replace("{summary}", summary)}

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine = f"http://127.0.0.1:{engine_port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
    ]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    model = profile.served_model_name
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]

    def log(hop: str) -> list[dict]:
        return [e for e in httpx.get(engine + "/_log").json() if e["hop"] == hop]

    def ask(messages, **kw):
        return client.chat.completions.create(model=model, messages=messages, **kw).choices[0].message

    u1 = {"role": "user", "content": "[route:L2] write a parser"}
    u2 = {"role": "user", "content": "[route:L1] now plan my trip"}
    u3 = {"role": "user", "content": "[route:L3] and what about the parser?"}
    ut = {"role": "user", "content": "[route:L3] [tool:get_weather] weather in Paris?"}
    with running(fake_engine_argv(engine_port), engine + "/health"):
        with running(argv, f"http://127.0.0.1:{port}/health"):
            a1 = ask([u1]).content
            A1 = {"role": "assistant", "content": a1}
            a2 = ask([u1, A1, u2]).content
            assert log("answer")[-1]["messages"] == [identity, u1, fold(f"summary of {a1}"), u2]
            call = ask([ut], tools=tools).tool_calls[0].model_dump()
            db = sqlite3.connect(store_path(state, "tiny"))
            deadline = time.monotonic() + 10
            while db.execute("SELECT count(*) FROM turns WHERE summary IS NOT NULL").fetchone()[0] < 2:
                assert time.monotonic() < deadline, "the summaries never reached the store"
                time.sleep(0.05)
            db.close()
        answers_before, routes_before = len(log("answer")), len(log("route"))
        with running(argv, f"http://127.0.0.1:{port}/health"):  # a new proxy process on the same state dir
            A2 = {"role": "assistant", "content": a2}
            assert ask([u1, A1, u2, A2, u3]).content
            answer = log("answer")[-1]
            assert answer["model"] == "L3"
            assert answer["messages"] == [identity, u1, fold(f"summary of {a1}"), u2, fold(f"summary of {a2}"), u3]
            routes_mid = len(log("route"))
            assert routes_mid == routes_before + 1
            assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
            result = {"role": "tool", "tool_call_id": call["id"], "content": "18C sunny"}
            assert "18C sunny" in ask([ut, assistant, result], tools=tools).content
            assert len(log("route")) == routes_mid  # sticky: no route hop after the restart
            answers = log("answer")
            assert len(answers) == answers_before + 2 and answers[-1]["model"] == "L3"


# ------------------------------------------------------------------------------ writes off the request's path


async def _loop_gaps(stop, gaps: list[float]) -> None:
    """Appends the event loop's gaps between 5 ms ticks until `stop` is set (a blocked loop: a long gap)."""
    import asyncio

    last = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.005)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


def _rows(db: Path) -> int:
    outside = sqlite3.connect(db)  # another connection: sees committed rows only
    try:
        return sum(outside.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("turns", "calls"))
    finally:
        outside.close()


def test_rows_of_one_loop_pass_are_one_transaction_written_after_the_pass(db):
    """On the event loop a put queues its row: readable at once (cache, then the queue), on disk
    after the pass, every row queued in the pass in one committed transaction."""
    import asyncio

    from molctl.proxy.conversations import CallBinding, TurnRecord
    from molctl.proxy.store.memory import MemoryStore
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    conv = SqliteConversationStore(store)
    first, second = TurnRecord("L1"), TurnRecord("L2")
    binding = CallBinding("L3", '{"city":"Paris"}', "get_weather")

    async def one_pass_then_the_next():
        conv.put_turn(b"a" * 32, first)
        conv.put_turn(b"b" * 32, second)
        conv.put_call("tenant-a", "call_1", binding)
        first.set_summary("about a parser")  # a later change of a queued row: still one row
        assert store.pending_rows() == 3 and _rows(db) == 0
        # readable at once, also by a reader that misses the cache (another cache on the same store)
        cold = SqliteConversationStore(store, MemoryStore())
        assert cold.get_turn(b"a" * 32).summary == "about a parser" and cold.get_call("tenant-a", "call_1") == binding
        await asyncio.sleep(0)  # the pass ends: the flush runs
        assert store.pending_rows() == 0 and _rows(db) == 3

    asyncio.run(one_pass_then_the_next())
    assert [s for s in statements if s == "COMMIT"] == ["COMMIT"]  # one transaction for the pass
    assert store.get_turn_row(b"a" * 32) == ("L1", "about a parser", False, False)
    assert conv.stats()["write_errors"] == 0
    store.close()


def test_a_commit_delay_groups_the_rows_of_its_window_into_one_transaction(db):
    """`commit_delay_s` (the proxy's proxy.state_commit_ms): rows queued in several passes of one
    window (a turn, then its summary a pass later) share ONE transaction, written when the window
    ends; readable from the queue meanwhile; a close inside the window writes them."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), commit_delay_s=1.0)  # long: a stalled host cannot end it early
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    conv = SqliteConversationStore(store)
    turn = TurnRecord("L2")

    async def turn_then_summary():
        conv.put_turn(b"t" * 32, turn)
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # passes end: nothing written yet
        turn.set_summary("about a parser")
        conv.put_turn(b"u" * 32, TurnRecord("L1"))
        await asyncio.sleep(0.01)
        assert store.pending_rows() == 2 and _rows(db) == 0
        assert store.get_turn_row(b"t" * 32) == ("L2", "about a parser", False, False)
        for _ in range(400):  # the window ends (after ~1 s)
            if store.pending_rows() == 0:
                break
            await asyncio.sleep(0.025)
        assert store.pending_rows() == 0 and _rows(db) == 2
        conv.put_turn(b"v" * 32, TurnRecord("L3"))  # a new window
        store.close()  # inside it: written by the close

    asyncio.run(turn_then_summary())
    assert statements.count("COMMIT") == 2  # the first window's rows in one transaction, the close's
    again = SqliteResponseStore(db, clock=Clock())
    assert again.get_turn_row(b"t" * 32) == ("L2", "about a parser", False, False)
    assert again.get_turn_row(b"v" * 32) == ("L3", None, False, False)
    again.close()


def test_the_proxy_opens_its_store_with_the_profiles_commit_window(tmp_path):
    from molctl.profiles import load_profile, profile_dirs
    from molctl.proxy.store.factory import build_response_store

    default = build_response_store(load_profile("tiny", profile_dirs()), tmp_path)
    assert default.commit_delay_s == 0.01
    default.close()
    each_pass = build_response_store(load_profile("tiny", profile_dirs(), [("proxy.state_commit_ms", 0)]), tmp_path)
    assert each_pass.commit_delay_s == 0
    each_pass.close()


def test_close_writes_what_is_queued(db):
    """A drain or shutdown (the app closes the store) loses none of the queued rows."""
    import asyncio

    from molctl.proxy.conversations import CallBinding, TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    conv = SqliteConversationStore(store)

    async def queue_then_close():
        conv.put_turn(b"a" * 32, TurnRecord("L2"))
        conv.put_call("tenant-a", "call_1", CallBinding("L3", "{}", "f"))
        assert store.pending_rows() == 2
        store.close()  # before the pass ends

    asyncio.run(queue_then_close())
    assert _rows(db) == 2
    again = SqliteResponseStore(db, clock=Clock())
    assert again.get_turn_row(b"a" * 32) == ("L2", None, False, False)
    again.close()


def test_a_failed_flush_is_logged_and_counted_never_raised(db, caplog):
    """The file stays locked by another process (past busy_timeout_s: the loop's flush tries again
    until then): the pass's rows are lost for the disk (counted per row, one warning), the chat goes
    on from the cache."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), busy_timeout_s=0.1)
    conv = SqliteConversationStore(store)
    record = TurnRecord("L2")
    holder = sqlite3.connect(db, isolation_level=None)

    async def queue_while_locked():
        conv.put_turn(b"a" * 32, record)
        conv.put_turn(b"b" * 32, TurnRecord("L1"))
        holder.execute("BEGIN EXCLUSIVE")
        deadline = time.monotonic() + 10
        while store.conv_write_errors < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        asyncio.run(queue_while_locked())
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert conv.stats()["write_errors"] == 2
    assert any("not persisted (2 rows)" in r.getMessage() and "locked" in r.getMessage() for r in caplog.records)
    assert conv.get_turn(b"a" * 32) is record  # this process still has it
    assert _rows(db) == 0
    store.close()


@pytest.mark.parametrize("commit_ms", [0, 10])
def test_a_turn_survives_a_crash_once_the_client_has_its_answer(tmp_path, commit_ms):
    """The proxy killed (SIGKILL, no drain) after the client got its answer and a later request
    was answered (state_commit_ms 0), or the window's timer wrote it with no later request (10,
    the default; waited for by reading the file, not by a sleep that a busy host may outlast): the
    turn is on disk (a crash loses at most the pass that was running, or the window's rows)."""
    import signal

    import openai

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine = f"http://127.0.0.1:{engine_port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
        "--set",
        f"proxy.state_commit_ms={commit_ms}",
    ]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    model = load_profile("tiny", profile_dirs()).served_model_name
    with running(fake_engine_argv(engine_port), engine + "/health"):
        with running(argv, f"http://127.0.0.1:{port}/health") as proxy:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "[route:L2] write a parser"}]
            )
            client.models.list()  # answered on a later pass than the one that sent the chat answer
            if commit_ms:  # the window's timer writes it, no later request needed (a busy host: it may run late)
                deadline = time.monotonic() + 20
                while not _committed_turns(store_path(state, "tiny")) and time.monotonic() < deadline:
                    time.sleep(0.01)
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(10)
    store = SqliteResponseStore(store_path(state, "tiny"))
    try:
        assert store.stats()["conversation_rows"] >= 1
        routes = [r[0] for r in store._conn.execute("SELECT route FROM turns")]
        assert "L2" in routes
    finally:
        store.close()


def _committed_turns(path: Path) -> int:
    """Turn rows committed to the file, read by another (read-only) connection; 0 while it has no table yet."""
    try:
        outside = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return 0
    try:
        return outside.execute("SELECT count(*) FROM turns").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        outside.close()


def test_a_drain_waits_for_the_summaries_of_the_turns_it_answered(tmp_path):
    """SIGTERM right after an answer whose summary hop is still at the engine: the drain waits for
    that summary (within its deadline) and the turn is on disk with it; before, the summary task
    was cancelled at shutdown and the turn came back after a restart as a failed summary."""
    import signal

    import openai

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine = f"http://127.0.0.1:{engine_port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
    ]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    model = load_profile("tiny", profile_dirs()).served_model_name
    with running(fake_engine_argv(engine_port, {"summary_delay": 1.0}), engine + "/health"):
        with running(argv, f"http://127.0.0.1:{port}/health") as proxy:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "[route:L2] write a parser"}]
            )
            proxy.send_signal(signal.SIGTERM)  # the summary hop is in flight for another second
            assert proxy.wait(30) == 0
    store = SqliteResponseStore(store_path(state, "tiny"))
    try:
        rows = list(store._conn.execute("SELECT route, summary, summary_failed FROM turns"))
        assert len(rows) == 1 and rows[0][0] == "L2" and rows[0][1] and rows[0][2] == 0, rows
    finally:
        store.close()


def test_a_drain_does_not_wait_past_its_deadline_for_a_hung_summary(tmp_path):
    """The summary hop hangs at the engine: the drain gives up on it at its deadline (here 1 s),
    exits 0, and the turn is on disk without a summary (as after a failed one)."""
    import signal

    import openai

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine = f"http://127.0.0.1:{engine_port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
        "--drain-timeout",
        "1",
    ]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
    model = load_profile("tiny", profile_dirs()).served_model_name
    with running(fake_engine_argv(engine_port, {"summary_delay": 120.0}), engine + "/health") as fake:
        with running(argv, f"http://127.0.0.1:{port}/health") as proxy:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "[route:L2] write a parser"}]
            )
            proxy.send_signal(signal.SIGTERM)
            assert proxy.wait(20) == 0  # the drain's 1 s, not the 30 s summary bound nor the hop's 120 s
        os.killpg(fake.pid, signal.SIGKILL)  # its handler sleeps on: no graceful stop to wait for
    store = SqliteResponseStore(store_path(state, "tiny"))
    try:
        rows = list(store._conn.execute("SELECT route, summary FROM turns"))
        assert rows == [("L2", None)], rows
    finally:
        store.close()


def test_a_put_from_a_worker_thread_or_after_close_is_not_left_queued(db):
    """No event loop in the calling thread: written at once. After close: counted as lost."""
    import threading

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    conv = SqliteConversationStore(store)
    worker = threading.Thread(target=conv.put_turn, args=(b"t" * 32, TurnRecord("L1")))
    worker.start()
    worker.join()
    assert store.pending_rows() == 0 and _rows(db) == 1
    store.close()
    conv.put_turn(b"u" * 32, TurnRecord("L2"))
    assert store.pending_rows() == 0 and conv.stats()["write_errors"] == 1


def test_a_stored_response_is_readable_by_another_process_as_soon_as_the_client_has_it(tmp_path):
    """Two proxy processes on one state dir: a response created on one is found at once on the
    other (retrieve and previous_response_id): its write is not deferred."""
    import openai

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port_a, port_b) = tmp_path / "state", free_ports(3)
    engine = f"http://127.0.0.1:{engine_port}"

    def argv(port):
        return [
            sys.executable,
            "-m",
            "molctl",
            "--state-dir",
            str(state),
            "proxy",
            "tiny",
            "--upstream",
            engine,
            "--port",
            str(port),
            "--allow-unauthenticated",
        ]

    def client(port):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)

    model = load_profile("tiny", profile_dirs()).served_model_name
    with (
        running(fake_engine_argv(engine_port), engine + "/health"),
        running(argv(port_a), f"http://127.0.0.1:{port_a}/health"),
        running(argv(port_b), f"http://127.0.0.1:{port_b}/health"),
    ):
        first = client(port_a).responses.create(model=model, input="remember the word apple", max_output_tokens=16)
        assert client(port_b).responses.retrieve(first.id).id == first.id
        second = client(port_b).responses.create(
            model=model, input="which word?", previous_response_id=first.id, max_output_tokens=16
        )
        assert second.previous_response_id == first.id


def test_a_response_put_commits_the_queued_chat_rows_with_it(db):
    """The Responses API's turn (queued) and its stored response: one commit, done when put_response returns."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    statements: list[str] = []
    store._conn.set_trace_callback(statements.append)
    conv = SqliteConversationStore(store)

    async def turn_then_response():
        conv.put_turn(b"r" * 32, TurnRecord("L3"))
        store.put_response(record("resp_1"))
        assert store.pending_rows() == 0 and _rows(db) == 1  # before the pass ends
        await asyncio.sleep(0)

    asyncio.run(turn_then_response())
    assert statements.count("COMMIT") == 1
    assert store.get_response("tenant-a", "resp_1")["route"] == "L2"
    store.close()


def test_a_loop_that_stops_before_its_flush_does_not_block_the_next_ones(db):
    """A loop closed with the flush still pending (its rows stay queued, readable): the next loop's
    first put schedules a flush again, which writes both."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    conv = SqliteConversationStore(store)
    loop = asyncio.new_event_loop()

    def put_and_stop():
        conv.put_turn(b"1" * 32, TurnRecord("L1"))
        loop.stop()  # this pass ends the loop: the flush scheduled in it never runs

    loop.call_soon(put_and_stop)
    loop.run_forever()
    loop.close()
    assert store.pending_rows() == 1 and store.get_turn_row(b"1" * 32) == ("L1", None, False, False)

    async def next_loop():
        conv.put_turn(b"2" * 32, TurnRecord("L2"))
        await asyncio.sleep(0)

    asyncio.run(next_loop())
    assert store.pending_rows() == 0 and _rows(db) == 2
    store.close()


def test_a_failure_that_ends_the_transaction_is_reported_with_its_own_cause(db, caplog):
    """SQLite rolls a transaction back by itself on some failures (a full disk or an I/O error while
    the WAL is written; here a trigger's RAISE(ROLLBACK)): the error names that cause, not the
    "no transaction is active" of the ROLLBACK that follows, and the store keeps working."""
    from molctl.proxy.conversations import TurnRecord

    store = SqliteResponseStore(db, clock=Clock())
    store._conn.execute(
        "CREATE TRIGGER fail_turn BEFORE INSERT ON turns WHEN NEW.route = 'L9' "
        "BEGIN SELECT RAISE(ROLLBACK, 'disk went away'); END"
    )
    store._conn.execute(
        "CREATE TRIGGER fail_response BEFORE INSERT ON responses WHEN NEW.route = 'L9' "
        "BEGIN SELECT RAISE(ROLLBACK, 'disk went away'); END"
    )
    store.put_turn_row(b"a" * 32, TurnRecord("L9"))  # no event loop here: written (and failed) at once
    assert store.conv_write_errors == 1
    assert [
        m.split("put failed: ")[1][:14] for m in (r.getMessage() for r in caplog.records) if "not persisted" in m
    ] == ["disk went away"]
    with pytest.raises(StoreError, match="put failed: disk went away"):
        store.put_response(record("resp_1", route="L9"))
    store.put_turn_row(b"b" * 32, TurnRecord("L1"))
    store.put_response(record("resp_2"))
    assert store.get_turn_row(b"b" * 32) == ("L1", None, False, False)
    assert store.get_response("tenant-a", "resp_2")["id"] == "resp_2"
    store.close()


def test_a_failed_response_put_keeps_the_chat_rows_it_took(db):
    """A Response put takes the queued chat rows into its transaction; when it fails (another
    process holds the write lock, a full disk), those rows go back to the queue and their own flush
    writes them: the failure loses this Response, not the window's conversation state."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), commit_delay_s=0.05)
    store._conn.execute(
        "CREATE TRIGGER fail_response BEFORE INSERT ON responses WHEN NEW.route = 'L9' "
        "BEGIN SELECT RAISE(ROLLBACK, 'disk went away'); END"
    )
    conv = SqliteConversationStore(store)

    async def turn_then_failing_response():
        conv.put_turn(b"k" * 32, TurnRecord("L2"))
        with pytest.raises(StoreError, match="disk went away"):
            store.put_response(record("resp_1", route="L9"))
        assert store.pending_rows() == 1 and store.get_turn_row(b"k" * 32) == ("L2", None, False, False)
        for _ in range(200):
            if store.pending_rows() == 0:
                break
            await asyncio.sleep(0.025)

    asyncio.run(turn_then_failing_response())
    assert _rows(db) == 1 and store.conv_write_errors == 0
    store.close()


def test_rows_queued_on_a_running_loop_after_close_are_all_counted_lost(db):
    """After close (a summary arriving during shutdown), each later pass's rows are counted as lost,
    none stays queued: the second pass used to find its flush "scheduled already"."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock())
    conv = SqliteConversationStore(store)

    async def after_close():
        store.close()
        for n in range(3):
            conv.put_turn(bytes([n]) * 32, TurnRecord("L1"))
            await asyncio.sleep(0)  # the pass ends, its flush runs
            await asyncio.sleep(0)

    asyncio.run(after_close())
    assert (store.pending_rows(), conv.stats()["write_errors"]) == (0, 3)


def test_close_waits_for_a_put_in_flight_in_a_worker_thread(db):
    """The proxy writes a large record from a worker thread (LocalResponses); a shutdown that
    closes the store meanwhile waits for that put's commit: the connection was closed under the
    thread's open transaction (the record lost, the put failing on a closed database)."""
    import threading

    in_put, release = threading.Event(), threading.Event()
    block_once = [True]

    def clock() -> float:
        if block_once[0] and threading.current_thread() is not threading.main_thread():
            block_once[0] = False
            in_put.set()  # inside the put's transaction, holding the store's lock
            release.wait(10)
        return 1_800_000_000.0

    store = SqliteResponseStore(db, clock=clock)
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put_response(record("resp_big", text="x" * 200_000))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    writer = threading.Thread(target=put)
    flush = store.flush

    def flush_then_put_starts() -> int:  # the put takes the lock right after close's own flush
        lost = flush()
        writer.start()
        assert in_put.wait(10)
        return lost

    store.flush = flush_then_put_starts  # type: ignore[method-assign]
    closer = threading.Thread(target=store.close)
    closer.start()
    assert in_put.wait(10)
    closer.join(0.2)  # close() waits for the lock (before the fix it closed the connection under the put)
    release.set()
    writer.join(10)
    closer.join(10)
    assert not writer.is_alive() and not closer.is_alive()
    assert errors == []
    reopened = SqliteResponseStore(db, clock=Clock())
    assert reopened.get_response("tenant-a", "resp_big")["messages"][0]["content"] == "x" * 200_000
    reopened.close()


def test_a_failed_put_in_a_worker_thread_never_writes_a_turns_older_state_over_a_newer_one(db):
    """A large Response put runs in a worker thread (LocalResponses) and takes the queued chat rows
    (turn k, no summary yet) into its transaction; meanwhile its summary arrives on the loop (k
    queued again, newer) and the window's flush waits for the store's lock. The put fails: its
    rows go back to the queue before that flush can take the lock (it takes the newer k): before
    the fix they were put back after the lock was released, the flush could write the summary
    first, and the older row (no summary) then overwrote it on disk."""
    import asyncio
    import threading

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    in_put, release, flushed = threading.Event(), threading.Event(), threading.Event()

    def clock() -> float:
        if threading.current_thread() is not threading.main_thread() and not in_put.is_set():
            in_put.set()  # inside the put's transaction, holding the store's lock, its rows taken
            release.wait(10)
            raise sqlite3.OperationalError("database or disk is full")  # the put fails
        return 1_800_000_000.0

    store = SqliteResponseStore(db, clock=clock, commit_delay_s=0.05)
    conv = SqliteConversationStore(store)
    key = b"k" * 32
    if hasattr(store, "_requeue"):  # the code before the fix: hold the put-back until the flush has run
        requeue = store._requeue

        def late_requeue(turns, calls):
            flushed.wait(10)
            requeue(turns, calls)

        store._requeue = late_requeue  # type: ignore[method-assign]

    async def scenario():
        record_ = TurnRecord("L2")
        conv.put_turn(key, record_)  # queued: the worker's put takes it
        put = asyncio.ensure_future(asyncio.to_thread(store.put_response, record("resp_1")))
        for _ in range(400):
            if in_put.is_set():
                break
            await asyncio.sleep(0.025)
        assert in_put.is_set()
        record_.set_summary("parses the input")  # newer state of the same turn, queued on the loop
        release.set()
        store.flush()  # the window's flush, on the loop: waits for the put's lock
        flushed.set()
        with pytest.raises(StoreError, match="disk is full"):
            await put
        for _ in range(400):  # the put-back's own flush, if any
            if store.pending_rows() == 0:
                break
            await asyncio.sleep(0.025)

    asyncio.run(scenario())
    store.close()
    outside = sqlite3.connect(db)
    try:
        rows = list(outside.execute("SELECT route, summary, summary_failed FROM turns"))
    finally:
        outside.close()
    assert rows == [("L2", "parses the input", 0)]


def test_the_loops_flush_never_waits_on_the_event_loop_for_another_processs_write_lock(db):
    """Another process holds the file's write lock (a long `molctl state prune`, a sqlite3 shell in
    a transaction): the window's flush runs on the event loop and used to wait busy_timeout_s there
    (every request and /health stalled that long, each window) before losing its rows. Now it does
    not wait: the rows stay queued (readable), it tries again, writes them once the lock is free;
    held past busy_timeout_s, they are counted lost and nothing stays queued."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), commit_delay_s=0.01, busy_timeout_s=1.0)
    conv = SqliteConversationStore(store)
    other = sqlite3.connect(db, isolation_level=None)
    gaps: list[float] = []

    async def until(condition, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return condition()

    async def scenario():
        stop = asyncio.Event()
        beat = asyncio.ensure_future(_loop_gaps(stop, gaps))
        other.execute("BEGIN IMMEDIATE")
        conv.put_turn(b"a" * 32, TurnRecord("L1"))
        started = time.monotonic()
        while time.monotonic() - started < 0.3:  # a few windows while the lock is held
            await asyncio.sleep(0.01)
        assert store.pending_rows() == 1 and store.get_turn_row(b"a" * 32) == ("L1", None, False, False)
        assert conv.stats()["write_errors"] == 0  # a metrics scrape on the loop: no wait for the lock either
        other.execute("ROLLBACK")  # the lock is free: a retry writes the row
        assert await until(lambda: _rows(db) == 1 and store.pending_rows() == 0)
        assert store.conv_write_errors == 0
        other.execute("BEGIN IMMEDIATE")  # held past busy_timeout_s: counted lost, the queue empty
        conv.put_turn(b"b" * 32, TurnRecord("L2"))
        assert await until(lambda: store.conv_write_errors == 1 and store.pending_rows() == 0)
        other.execute("ROLLBACK")
        stop.set()
        await beat

    try:
        asyncio.run(scenario())
    finally:
        other.close()
    # the loop was never blocked for the lock: a wait for it lasts busy_timeout_s (1 s); below that,
    # a gap is the loaded machine's scheduling
    assert max(gaps) < 0.9, max(gaps)
    conv.put_turn(b"c" * 32, TurnRecord("L3"))  # no loop: written at once, the lock free again
    assert _rows(db) == 2
    store.close()


def test_a_responses_put_or_delete_never_waits_on_the_event_loop_for_another_processs_write_lock(db):
    """Another process holds the file's write lock (a `molctl state prune`, a sqlite3 shell in a
    transaction): a stored Response's put used to wait busy_timeout_s ON THE LOOP (every request and
    /health stalled with it), and waiting from a worker thread instead still held the store's own
    lock (the loop's next store call, a GET, stalled as long). Now no put or delete waits inside the
    store: each is tried again while the loop runs; the Response is committed once the lock is
    free, before the call returns. The queued chat rows go with the put."""
    import asyncio

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.local import LocalResponses
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), commit_delay_s=5.0, busy_timeout_s=3.0)
    store.put_response(record("old"))
    proxy_store = LocalResponses(store)
    conv = SqliteConversationStore(store)
    other = sqlite3.connect(db, isolation_level=None)
    gaps: list[float] = []
    HOLD_S = 0.9

    async def reader(stop: asyncio.Event) -> None:  # the loop's other store calls meanwhile (a GET)
        while not stop.is_set():
            assert await proxy_store.get_response("tenant-a", "old") is not None
            await asyncio.sleep(0.01)

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        beat = asyncio.ensure_future(_loop_gaps(stop, gaps))
        await asyncio.sleep(0.05)
        other.execute("BEGIN IMMEDIATE")
        asyncio.get_running_loop().call_later(HOLD_S, other.execute, "ROLLBACK")
        conv.put_turn(b"t" * 32, TurnRecord("L1"))  # queued (a 5 s window): the put takes it along
        reads = asyncio.ensure_future(reader(stop))
        t0 = time.monotonic()
        await proxy_store.put_response(record("new"))
        put_s = time.monotonic() - t0
        other.execute("BEGIN IMMEDIATE")  # a large record (written from a worker thread) the same way
        asyncio.get_running_loop().call_later(HOLD_S, other.execute, "ROLLBACK")
        t0 = time.monotonic()
        await proxy_store.put_response(record("big"), big=True)
        big_s = time.monotonic() - t0
        assert big_s >= HOLD_S * 0.9
        other.execute("BEGIN IMMEDIATE")
        asyncio.get_running_loop().call_later(HOLD_S, other.execute, "ROLLBACK")
        t0 = time.monotonic()
        assert await proxy_store.delete_response("tenant-a", "old") is True
        delete_s = time.monotonic() - t0
        stop.set()
        await beat
        await reads
        return put_s, delete_s

    try:
        put_s, delete_s = asyncio.run(scenario())
    finally:
        other.close()
    assert put_s >= HOLD_S * 0.9 and delete_s >= HOLD_S * 0.9  # each waited for the lock...
    assert max(gaps) < HOLD_S / 2, max(gaps)  # ...in a worker thread: the loop kept running
    outside = sqlite3.connect(db)
    try:
        assert sorted(r[0] for r in outside.execute("SELECT id FROM responses")) == ["big", "new"]
        assert outside.execute("SELECT route FROM turns").fetchall() == [("L1",)]  # committed with the put
    finally:
        outside.close()
    assert store.conv_write_errors == 0 and store.pending_rows() == 0
    store.close()


def test_a_flush_failing_every_window_warns_once_then_at_most_every_10_s(db, caplog, monkeypatch):
    """A disk that stays full fails every window's flush: each lost row is counted (the metric),
    but the log gets one warning at once, then at most one per LOSS_LOG_EVERY_S with the rows lost
    meanwhile (it was one line per window: ~100 a second under load), and the rest at close."""
    import asyncio
    import logging

    from molctl.proxy.conversations import TurnRecord
    from molctl.proxy.store.sqlite import conversations as sqlite_store
    from molctl.proxy.store.sqlite.conversations import SqliteConversationStore

    store = SqliteResponseStore(db, clock=Clock(), commit_delay_s=0)
    conv = SqliteConversationStore(store)

    def full(*_args):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store, "_insert_rows", full)

    async def windows(n: int):
        for i in range(n):
            conv.put_turn(i.to_bytes(32, "big"), TurnRecord("L2"))
            await asyncio.sleep(0)  # the pass ends: its flush runs (and fails)
            await asyncio.sleep(0)

    caplog.set_level(logging.WARNING, logger="molctl")
    asyncio.run(windows(50))
    lines = [r.getMessage() for r in caplog.records if "not persisted" in r.getMessage()]
    assert store.conv_write_errors == 50
    assert len(lines) == 1 and "not persisted (1 rows)" in lines[0] and "disk is full" in lines[0], lines
    monkeypatch.setattr(sqlite_store, "LOSS_LOG_EVERY_S", 0.0)  # the interval has passed
    asyncio.run(windows(1))
    lines = [r.getMessage() for r in caplog.records if "not persisted" in r.getMessage()]
    assert len(lines) == 2 and "(50 rows in the last" in lines[1], lines  # the 49 held back + this one
    monkeypatch.setattr(sqlite_store, "LOSS_LOG_EVERY_S", 3600.0)
    asyncio.run(windows(3))
    monkeypatch.undo()
    store.close()
    lines = [r.getMessage() for r in caplog.records if "not persisted" in r.getMessage()]
    assert len(lines) == 3 and "(3 rows since the last warning)" in lines[2], lines
    assert store.conv_write_errors == 54


def test_a_store_fault_during_a_request_is_a_500_and_one_log_line_not_a_traceback(tmp_path):
    """Another process holds the file's write lock past busy_timeout_s (a long `molctl state
    prune`; a full disk fails the same way): the contract's 500 naming the request id, streamed or
    not. It used to be logged as a bug (log.exception: a traceback per request) for an external
    fault the store had already put in one line. Found holding the lock beside a live proxy."""
    import httpx

    from tests.procs import fake_engine_argv, running

    state, (engine_port, port) = tmp_path / "state", free_ports(2)
    engine, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "molctl",
        "--state-dir",
        str(state),
        "proxy",
        "tiny",
        "--upstream",
        engine,
        "--port",
        str(port),
        "--allow-unauthenticated",
    ]
    model = load_profile("tiny", profile_dirs()).served_model_name
    log = tmp_path / "proxy.log"
    with running(fake_engine_argv(engine_port), engine + "/health"), running(argv, url + "/health", log=log):
        other = sqlite3.connect(store_path(state, "tiny"), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            plain = httpx.post(url + "/v1/responses", json={"model": model, "input": "hi"}, timeout=30)
            with httpx.stream(
                "POST", url + "/v1/responses", json={"model": model, "input": "hi", "stream": True}, timeout=30
            ) as streamed:
                events = "".join(streamed.iter_text())
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert httpx.get(url + "/v1/models", timeout=10).status_code in (200, 401)
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "proxy_error"
    assert plain.headers["x-request-id"] in plain.json()["error"]["message"]
    assert "proxy_error" in events and streamed.headers["x-request-id"] in events
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    faults = [ln for ln in text.splitlines() if "failed: response store" in ln and "write lock" in ln]
    assert len(faults) == 2 and all(str(store_path(state, "tiny")) in ln for ln in faults), faults


def test_a_put_never_evicts_its_own_record_nor_every_other_one_for_a_record_over_max_bytes(db):
    """Eviction is oldest created_at first. After the clock stepped back (NTP) the record being put
    was the "oldest": at the entry cap the put evicted it at once, and the client got an id that was
    already a 404. A record larger than max_bytes on its own evicted every other tenant's records and
    then itself (the whole store emptied by one request). Now the record being put is never its own
    put's victim, and one over max_bytes is refused (StoreError: a 500) with nothing evicted. Found
    putting records with an injected clock."""
    clock = Clock()
    store = SqliteResponseStore(db, max_entries=3, clock=clock)
    for i in range(3):
        clock.t += 1
        store.put_response(record(f"resp_{i}", created_at=clock.t))
    clock.t -= 3600
    store.put_response(record("after_the_step", created_at=clock.t))
    assert store.get_response("tenant-a", "after_the_step") is not None
    assert store.stats()["responses"] == 3 and store.get_response("tenant-a", "resp_0") is None
    store.close()

    db.unlink()
    one = len(json.dumps(record("x", text="y" * 1000)))
    store = SqliteResponseStore(db, max_bytes=one * 3, clock=clock)
    for i in range(2):
        store.put_response(record(f"other_{i}", tenant="tenant-b", created_at=clock.t, text="y" * 1000))
    with pytest.raises(StoreError, match="over proxy.store_max_bytes") as err:
        store.put_response(record("huge", created_at=clock.t, text="y" * (one * 4)))
    assert str(db) in str(err.value) and "\n" not in str(err.value)
    assert [store.get_response("tenant-b", f"other_{i}") is not None for i in range(2)] == [True, True]
    assert store.get_response("tenant-a", "huge") is None and store.stats()["responses_evicted"] == 0
    store.close()


def test_state_stats_reads_while_another_process_holds_the_write_lock(molctl, state_dir):
    """Found by the status review: `state stats` opened the store with a BEGIN IMMEDIATE probe, so
    while a writer held the write lock (a running proxy's commit, a long `state prune`, a sqlite3
    shell in a transaction) the read-only command failed 'database is locked' after the busy
    timeout. WAL readers never wait for a writer: stats reads at once."""
    import sqlite3

    _seed(state_dir, [2, 1])
    writer = sqlite3.connect(str(store_path(state_dir, "tiny")), isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        result = molctl("state", "stats", "tiny", "--json")
        assert result.exit_code == ExitStatus.OK, result.stderr
        assert result.json()["responses"] == 2
        prune = molctl("state", "prune", "tiny")  # a writer still waits for the lock, and says so
        assert prune.exit_code != ExitStatus.OK and "locked" in prune.stderr
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_state_stats_text_shows_the_ttl_as_seconds_and_days(molctl, state_dir):
    """Found by the new-user walkthrough: the text said `ttl 2.592e+06 s`."""
    _seed(state_dir, [1])
    text = molctl("state", "stats", "tiny").stdout
    assert "ttl 2592000 s (30 days)" in text and "e+06" not in text


def test_looking_at_an_older_store_never_migrates_it(molctl, state_dir):
    """`state stats` and `check` migrated a schema-2 file to 3 in place: "just looking" made it one
    the molctl still installed refuses, the rollback the contract advises (keep a copy) gone."""
    import shutil

    from molctl.checks.host import _state_store

    path = store_path(state_dir, "tiny")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).parents[2] / "data" / "store-v2.sqlite3", path)
    path.chmod(0o600)

    def version() -> int:
        conn = sqlite3.connect(path)
        try:
            return conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()

    data = molctl("state", "stats", "tiny", "--json").json()
    assert data["schema_version"] == 2 and data["responses"] > 0 and version() == 2
    check = _state_store(load_profile("tiny", profile_dirs()), state_dir)
    assert check.status == "pass" and "schema 2: migrated when the proxy starts" in check.detail and version() == 2
    assert molctl("state", "prune", "tiny", "--json").exit_code == ExitStatus.OK
    assert version() == SCHEMA_VERSION  # prune writes: it migrates, as the proxy does
