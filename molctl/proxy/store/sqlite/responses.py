"""The Responses records on SQLite: put (with its chain's new segment), get (the chain's segments
joined), delete, and the bounds (expiry, per-tenant quotas, global caps, eviction).

`Responses` is that part of `SqliteResponseStore` (molctl.proxy.store.sqlite.store). How a
chain's shared history is stored once: CHAIN_SCHEMA (molctl.proxy.store.sqlite.schema) and
docs/design/store.md ("SQLite")."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from molctl.proxy.store.base import QuotaExceeded, ResponseRecord, StoreBusy, StoreError
from molctl.proxy.store.sqlite.schema import PRUNE_EVERY_S, _rollback

COLUMNS = ("tenant", "id", "created_at", "previous_response_id", "route")
JSON_COLUMNS = ("messages", "input_items", "response")


class Responses:
    """The Responses records (a mixin of SqliteResponseStore)."""

    # ------------------------------------------------------------------ protocol
    def put_response(self, record: ResponseRecord, wait: bool = True) -> None:
        """Committed before it returns (the proxy sends the response after it: readable at once,
        from any process), in one transaction with its chain's new segment and the evictions it
        causes. The chat rows queued so far go in the same transaction (one commit).
        `wait=False` (the proxy's puts): another process's write lock is not waited for; StoreBusy
        is raised at once, nothing written (LocalResponses tries again a little later).

        `record["messages"]` is the whole conversation; when `previous_response_id` names the
        newest response of a chain of this tenant, the record's messages start with that one's
        (as the proxy builds them: `make_record`) and only the rest is written."""
        self._refuse_if_damaged("response")
        head = _row({**record, "messages": []})
        messages = record.get("messages") or []
        turns: dict[bytes, tuple] = {}
        calls: dict[tuple[str, str], tuple] = {}
        try:
            with self._locked("put"):
                turns, calls = self._take_pending()
                conn = self._conn
                if wait:
                    conn.execute("BEGIN IMMEDIATE")
                elif not self._try_begin():
                    if turns or calls:
                        self._put_back(turns, calls)
                    raise StoreBusy(f"response store {self.path}: another process holds the write lock")
                try:
                    new = self._insert_response(head, messages)
                    now = self.clock()
                    if not 0 <= now - self._last_prune < PRUNE_EVERY_S:  # also after the clock stepped back
                        self._expire_group("responses", now)
                        self._last_prune = now
                    self._evict_responses(head[0], keep=new)
                    if turns or calls:
                        self._insert_rows(turns, calls, now)
                    conn.execute("COMMIT")
                    self.write_failure = None
                except BaseException:
                    _rollback(conn)
                    if turns or calls:  # back in the queue while the lock is held (see _put_back)
                        self._put_back(turns, calls)
                    raise
        except (StoreError, StoreBusy) as exc:
            self._write_failed(exc)
            if turns or calls:  # not this put's own rows: their own flush writes them (or counts them lost)
                self._schedule_flush()
            raise

    def _insert_response(self, head: tuple, messages: list) -> int:
        """Inside the put's transaction: the row (replacing one of the same id), its messages as a
        segment of its chain (see CHAIN_SCHEMA); its rowid. A record whose whole conversation is
        over a cap on its own is refused (StoreError) before anything is evicted."""
        conn = self._conn
        tenant, rid, previous = head[0], head[1], head[3]
        conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
        chain, base, inherited = None, 0, 0
        if previous is not None:
            tip = conn.execute(
                "SELECT r.chain, r.n_messages FROM responses r JOIN chains c ON c.id = r.chain "
                "WHERE r.tenant = ? AND r.id = ? AND c.length = r.n_messages",
                (tenant, previous),
            ).fetchone()
            if tip is not None and tip[1] <= len(messages):
                chain, base = tip
                inherited = conn.execute(
                    "SELECT coalesce(sum(size), 0) FROM segments WHERE chain = ?", (chain,)
                ).fetchone()[0]
        text = _json(messages[base:]) if len(messages) > base else None
        seg_size = len(text.encode()) if text is not None else 0
        whole = head[-1] + seg_size + inherited  # what this response holds: its row and its conversation
        for cap, name in (
            (self.max_bytes, "proxy.store_max_bytes"),
            (self.tenant_max_bytes, "proxy.store_tenant_max_bytes"),
        ):
            if whole > cap:  # evicting every other record could not make room: nothing is evicted
                raise QuotaExceeded(
                    f"response store {self.path}: a record of {whole} bytes (with its conversation) is over "
                    f"{name} ({cap}): not stored",
                    whole,
                    cap,
                    name,
                )
        if chain is None:
            chain = conn.execute("INSERT INTO chains (tenant, length, refs) VALUES (?, 0, 0)", (tenant,)).lastrowid
        if text is not None:
            conn.execute(
                "INSERT INTO segments (chain, start, stop, tenant, messages, size) VALUES (?, ?, ?, ?, ?, ?)",
                (chain, base, len(messages), tenant, text, seg_size),
            )
        conn.execute("UPDATE chains SET length = ? WHERE id = ?", (len(messages), chain))
        return conn.execute(
            "INSERT INTO responses (tenant, id, created_at, previous_response_id, route, messages, "
            "input_items, response, extra, size, chain, n_messages) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (*head, chain, len(messages)),
        ).lastrowid

    def _put_back(self, turns: dict[bytes, tuple], calls: dict[tuple[str, str], tuple]) -> None:
        """Rows taken for a transaction that failed, back in the queue (a row queued again since keeps
        its newer values): a failed Response put does not lose the window's chat rows; if their own
        write fails too, it counts them lost. Called under the connection's lock: a flush waiting for
        that lock (the loop's, while the put ran in a worker thread) then takes them with the newer
        values; put back after the lock was released, an older row could land after that flush had
        written a newer one (a summary overwritten by the turn's earlier state)."""
        with self._pending_lock:
            for key, value in turns.items():
                self._pending_turns.setdefault(key, value)
            for key, value in calls.items():
                self._pending_calls.setdefault(key, value)

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        with self._locked("get"):
            row = self._conn.execute(
                "SELECT tenant, id, created_at, previous_response_id, route, messages, input_items, response, extra, "
                "chain, n_messages FROM responses WHERE tenant = ? AND id = ? AND created_at >= ?",
                (tenant, response_id, self.clock() - self.ttl_s),
            ).fetchone()
            segments = None
            if row is not None and row[9] is not None:  # its conversation: the chain's segments up to it
                segments = self._conn.execute(
                    "SELECT start, stop, messages FROM segments WHERE chain = ? AND start < ? ORDER BY start",
                    (row[9], row[10]),
                ).fetchall()
        if row is None:
            return None
        try:
            record: ResponseRecord = json.loads(row[8])
            record.update(zip(COLUMNS, row[:5], strict=True))
            record.update((k, json.loads(v)) for k, v in zip(JSON_COLUMNS, row[5:8], strict=True))
            if segments is not None:
                record["messages"] = _conversation(segments, row[10])
        except (ValueError, TypeError, AttributeError) as exc:  # JSON that does not parse, or not an object
            why = (
                f"the conversation of {response_id[:80]} is incomplete ({exc})"
                if isinstance(exc, ChainGap)
                else f"the record of {response_id[:80]} does not parse ({type(exc).__name__})"
            )
            self._damage_seen(why)
            raise StoreError(f"response store {self.path}: {why}: damaged", cause="damaged") from None
        return record

    def delete_response(self, tenant: str, response_id: str, wait: bool = True) -> bool:
        """`wait=False`: as put_response's (StoreBusy at once when another process holds the write lock)."""
        self._refuse_if_damaged("delete")
        with self._locked("delete"):
            conn = self._conn
            if wait:
                conn.execute("BEGIN IMMEDIATE")
            elif not self._try_begin():
                raise StoreBusy(f"response store {self.path}: another process holds the write lock")
            try:
                cur = conn.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise
            return cur.rowcount > 0

    # Responses (column created_at) and chat state (turns and calls, column stamp) are bounded
    # alike, each group with its own counters in `meta` (prefix '' or 'conv_').
    _GROUPS = {
        "responses": ("", (("responses", "created_at"),)),
        "conversations": ("conv_", (("turns", "stamp"), ("calls", "stamp"))),
    }

    def _expire_group(self, group: str, now: float) -> int:
        prefix, tables = self._GROUPS[group]
        n = sum(
            self._conn.execute(f"DELETE FROM {t} WHERE {col} < ?", (now - self.ttl_s,)).rowcount for t, col in tables
        )
        if n:
            self._conn.execute("UPDATE meta SET value = value + ? WHERE key = ?", (n, prefix + "expired"))
        return n

    def _evict_responses(self, tenant: str | None, keep: int | None = None) -> int:
        """Inside a transaction: a tenant over its quota (`tenant_max_entries` responses or
        `tenant_max_bytes`, its responses and their chains' segments) evicts its OWN oldest responses
        (by created_at, then insertion order) until it is within it; then, as a last resort, while
        the store is over a global cap, the tenant holding the most (bytes or responses, whichever
        cap is exceeded) evicts its oldest. Never the response of rowid `keep` (the one being put:
        its id goes to the client; after the clock stepped back it is the "oldest"). `tenant` None
        (a prune): every tenant over its quota. Evicting a response never cuts another one's
        conversation: a chain's segments go with the last response that needs them (CHAIN_SCHEMA).
        Returns how many responses it evicted (counted in `meta`)."""
        conn = self._conn
        tenants = (
            [tenant]
            if tenant is not None
            else [
                r[0]
                for r in conn.execute(
                    "SELECT tenant FROM tenants WHERE rows > ? OR bytes > ?",
                    (self.tenant_max_entries, self.tenant_max_bytes),
                )
            ]
        )
        n = 0
        for who in tenants:
            n += self._evict_while(
                lambda who=who: conn.execute(
                    "SELECT rows > ? OR bytes > ? FROM tenants WHERE tenant = ?",
                    (self.tenant_max_entries, self.tenant_max_bytes, who),
                ).fetchone(),
                lambda who=who: who,
                keep,
            )

        def over() -> tuple | None:
            meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('rows', 'bytes')"))
            return (meta["rows"] > self.max_entries or meta["bytes"] > self.max_bytes,)

        def biggest() -> str | None:
            meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('rows', 'bytes')"))
            by = "bytes" if meta["bytes"] > self.max_bytes else "rows"
            # the biggest tenant with a response to evict (not only the one being put)
            row = conn.execute(
                "SELECT t.tenant FROM tenants t WHERE EXISTS (SELECT 1 FROM responses r WHERE "
                "r.tenant = t.tenant AND r.rowid IS NOT ?) ORDER BY t." + by + " DESC, t.tenant LIMIT 1",
                (keep,),
            ).fetchone()
            return None if row is None else row[0]

        n += self._evict_while(over, biggest, keep)
        if n:
            conn.execute("UPDATE meta SET value = value + ? WHERE key = 'evicted'", (n,))
        return n

    def _evict_while(self, over: Callable[[], tuple | None], tenant: Callable[[], str | None], keep: int | None) -> int:
        """Delete the oldest response of `tenant()` while `over()` holds (one at a time: a chain's
        segments may go with one, so the totals are read again after each); stops when nothing but
        `keep` is left to evict (the store then stays over by that one response's conversation)."""
        conn, n = self._conn, 0
        while True:
            state = over()
            if state is None or not state[0]:
                return n
            who = tenant()
            if who is None:
                return n
            victim = conn.execute(
                "SELECT rowid FROM responses WHERE tenant = ? AND rowid IS NOT ? ORDER BY created_at, rowid LIMIT 1",
                (who, keep),
            ).fetchone()
            if victim is None:  # nothing of this tenant's left to evict but the response being put
                return n
            conn.execute("DELETE FROM responses WHERE rowid = ?", victim)
            n += 1

    def _evict_group(self, group: str, keep: int | None = None) -> int:
        """Oldest first (time, then insertion order) across the group's tables until both caps hold;
        never the response of rowid `keep` (the one being put: its id goes to the client, and after
        the clock stepped back it is the "oldest")."""
        prefix, tables = self._GROUPS[group]
        meta = dict(
            self._conn.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (prefix + "rows", prefix + "bytes"))
        )
        over_rows = meta[prefix + "rows"] - self.max_entries
        over_bytes = meta[prefix + "bytes"] - self.max_bytes
        if over_rows <= 0 and over_bytes <= 0:
            return 0
        victims: dict[str, list[int]] = {t: [] for t, _ in tables}
        union = " UNION ALL ".join(f"SELECT '{t}', rowid, size, {col} FROM {t}" for t, col in tables)
        for table, rowid, size, _ in self._conn.execute(union + " ORDER BY 4, 2"):
            if over_rows <= 0 and over_bytes <= 0:
                break
            if rowid == keep and table == "responses":
                continue
            victims[table].append(rowid)
            over_rows -= 1
            over_bytes -= size
        for table, rowids in victims.items():
            for i in range(0, len(rowids), 500):
                chunk = rowids[i : i + 500]
                self._conn.execute(f"DELETE FROM {table} WHERE rowid IN ({','.join('?' * len(chunk))})", chunk)
        n = sum(len(r) for r in victims.values())
        self._conn.execute("UPDATE meta SET value = value + ? WHERE key = ?", (n, prefix + "evicted"))
        return n


class ChainGap(ValueError):
    """A chained response's segments do not cover its conversation (the file was edited or damaged:
    the store itself never removes a segment a live response needs)."""


def _conversation(segments: list[tuple[int, int, str]], n: int) -> list:
    """The conversation of a chained response: its chain's segments [start, stop) up to `n`
    messages, joined into one JSON text and parsed once. ChainGap when they leave a hole."""
    texts, at = [], 0
    for start, stop, text in segments:
        if start != at:
            raise ChainGap(f"messages {at}-{start - 1} missing")
        if text != "[]":
            texts.append(text[1:-1])
        at = stop
    if at < n:
        raise ChainGap(f"messages {at}-{n - 1} missing")
    messages = json.loads("[" + ",".join(texts) + "]")
    if len(messages) != at:
        raise ChainGap(f"{len(messages)} messages where its chain counts {at}")
    return messages[:n]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _row(record: ResponseRecord) -> tuple:
    extra = {k: v for k, v in record.items() if k not in COLUMNS and k not in JSON_COLUMNS}
    texts = [
        json.dumps(record.get(k, [] if k != "response" else {}), ensure_ascii=False, separators=(",", ":"))
        for k in JSON_COLUMNS
    ]
    extra_text = json.dumps(extra, ensure_ascii=False, separators=(",", ":"))
    size = sum(len(t.encode()) for t in texts) + len(extra_text.encode())
    return (
        record["tenant"],
        record["id"],
        float(record["created_at"]),
        record.get("previous_response_id"),
        record.get("route"),
        *texts,
        extra_text,
        size,
    )
