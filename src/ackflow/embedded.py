"""The embedded queue: a durable message queue in one SQLite file (WAL), no server.

It is ackflow's default source and also a sink, so pipelines can be chained. It
keeps, per named queue:

* messages with a lease (visibility timeout): a leased message is invisible until
  it is acked, failed, released, or its lease expires (the consumer died);
* a delivery count, incremented at every lease;
* delayed retry: a failed message becomes visible again after a backoff;
* a dead-letter table that keeps body, headers, the failing step, the error, the
  delivery count and the timestamps.

Any number of processes may publish concurrently; one consumer per queue is
enforced with a lock file (:meth:`EmbeddedQueue.claim_consumer`). Acks and
failures name the delivery they settle (row id *and* delivery count), so a
settlement from a stale lease never touches a message that was leased again.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ackflow import faults
from ackflow.core.durable import WriteTx, try_lock
from ackflow.core.errors import ConfigError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    queue        TEXT    NOT NULL,
    msg_id       TEXT,
    body         BLOB    NOT NULL,
    headers      TEXT,
    deliveries   INTEGER NOT NULL DEFAULT 0,
    visible_at   REAL    NOT NULL,
    leased       INTEGER NOT NULL DEFAULT 0,
    published_at REAL    NOT NULL,
    last_error   TEXT
);
CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue, visible_at, id);
CREATE UNIQUE INDEX IF NOT EXISTS messages_msg_id ON messages (queue, msg_id)
    WHERE msg_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS dead_letters (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    queue        TEXT    NOT NULL,
    msg_id       TEXT,
    body         BLOB    NOT NULL,
    headers      TEXT,
    step         TEXT    NOT NULL,
    error        TEXT    NOT NULL,
    deliveries   INTEGER NOT NULL,
    published_at REAL    NOT NULL,
    dead_at      REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_queue ON dead_letters (queue, id);
CREATE TABLE IF NOT EXISTS published_ids (
    queue        TEXT NOT NULL,
    msg_id       TEXT NOT NULL,
    at           REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (queue, msg_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    queue           TEXT PRIMARY KEY,
    published_total INTEGER NOT NULL DEFAULT 0,
    delivered_total INTEGER NOT NULL DEFAULT 0,
    acked_total     INTEGER NOT NULL DEFAULT 0
);
"""

_OWN_TABLES = frozenset({"messages", "dead_letters", "published_ids", "counters"})


@dataclass(frozen=True)
class Leased:
    """One leased message. ``(row_id, deliveries)`` names this delivery exactly."""

    row_id: int
    msg_id: str | None
    body: bytes
    headers: dict[str, str]
    deliveries: int
    published_at: float

    @property
    def key(self) -> str:
        return message_key(self.row_id, self.msg_id)


def message_key(row_id: int, msg_id: str | None) -> str:
    """A message's identity in its queue file: its publisher's ``msg_id``, else ``#``
    and its row id (never reused in the file). A ``msg_id`` that itself starts with
    ``#`` gets one more (``#7`` is keyed ``##7``), so that no publisher's id names the
    key of a message published without one (keyed sinks would take them for one).

    >>> message_key(7, None), message_key(7, "#7"), message_key(7, "order-1")
    ('#7', '##7', 'order-1')
    """
    if msg_id is None:
        return f"#{row_id}"
    return "#" + msg_id if msg_id.startswith("#") else msg_id


def stored_headers(text: str | None) -> dict[str, str]:
    """A message's headers as the queue file keeps them (JSON text, or nothing)."""
    return json.loads(text) if text else {}


@dataclass(frozen=True)
class Replayed:
    """What a replay did: the dead-letter ids moved back to the queue, and the ones
    kept as dead letters with the reason."""

    moved: list[int]
    kept: dict[int, str]


@dataclass(frozen=True)
class DeadLetter:
    row_id: int
    msg_id: str | None
    body: bytes
    headers: dict[str, str]
    step: str
    error: str
    deliveries: int
    published_at: float
    dead_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.row_id,
            "msg_id": self.msg_id,
            "body": self.body.decode("utf-8", "replace"),
            "headers": self.headers,
            "step": self.step,
            "error": self.error,
            "deliveries": self.deliveries,
            "published_at": self.published_at,
            "dead_at": self.dead_at,
        }


#: a message leased this many times and never settled (each consumer that had it died)
#: is given back behind the backlog instead of in its place
CRASH_SUSPECT = 10


class EmbeddedQueue:
    """A handle on one queue file. Not thread-safe: use one handle per thread.

    >>> import tempfile, os
    >>> q = EmbeddedQueue(os.path.join(tempfile.mkdtemp(), "q.db"))
    >>> q.publish("orders", [b'{"n": 1}', b'{"n": 2}'])
    2
    >>> [m.body for m in q.lease("orders", 10, visibility_timeout=30)]
    [b'{"n": 1}', b'{"n": 2}']
    >>> q.stats("orders")["leased"]
    2
    """

    def __init__(
        self, path: str | os.PathLike[str], *, synchronous: str = "FULL", readonly: bool = False
    ) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise ConfigError(f"embedded queue: directory {parent!r} does not exist")
        if synchronous not in ("FULL", "NORMAL"):
            raise ConfigError("embedded queue: synchronous must be FULL or NORMAL")
        self._lock_fd: int | None = None
        if readonly:  # inspection: never writes, refuses a file that is not a queue
            self._db = self._open_readonly()
            return
        if not os.path.exists(self.path):  # message bodies are data: 0600 (WAL/SHM follow)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            self._db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            self._check_queue(self._db, allow_empty=True)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            with self._tx():  # checked again under the write lock: one schema, all or none
                self._check_queue(self._db, allow_empty=True)
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                        faults.point("embedded.schema")
                cols = {r[1] for r in self._db.execute("PRAGMA table_info(published_ids)")}
                if "at" not in cols:  # a file from before retention existed
                    self._db.execute("ALTER TABLE published_ids ADD COLUMN at REAL NOT NULL DEFAULT 0")
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"embedded queue: {self.path!r} is not a usable queue database: {e}") from None

    def _open_readonly(self) -> sqlite3.Connection:
        if not os.path.isfile(self.path):
            raise ConfigError(f"queue file {self.path!r} does not exist")
        try:
            db = sqlite3.connect(
                f"file:{os.path.abspath(self.path)}?mode=ro", uri=True, timeout=60, isolation_level=None
            )
            self._check_queue(db, allow_empty=False)
        except sqlite3.DatabaseError as e:
            raise ConfigError(f"{self.path!r} is not an ackflow queue database ({e})") from None
        return db

    def _check_queue(self, db: sqlite3.Connection, *, allow_empty: bool) -> None:
        """Refuse a SQLite file that holds something else than ackflow's queue (its tables
        are never added to a foreign database)."""
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        tables.discard("sqlite_sequence")
        if allow_empty and tables <= _OWN_TABLES:
            # nothing, or part of ackflow's own tables: a file whose creation was cut
            # short by an earlier version (which created them one by one) is completed
            return
        missing = {"messages", "dead_letters", "counters"} - tables
        if missing:
            raise ConfigError(
                f"{self.path!r} is not an ackflow queue database (no table "
                f"{', '.join(sorted(missing))}); ackflow will not change it"
            )

    # -- helpers ---------------------------------------------------------------------------

    def _tx(self) -> WriteTx:
        return WriteTx(self._db)

    def _changes(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> int:
        """``executemany`` inside the current transaction; return the rows it changed."""
        before = self._db.total_changes
        self._db.executemany(sql, rows)
        return self._db.total_changes - before

    def _bump(self, queue: str, column: str, n: int) -> None:
        self._db.execute("INSERT OR IGNORE INTO counters (queue) VALUES (?)", (queue,))
        self._db.execute(f"UPDATE counters SET {column} = {column} + ? WHERE queue = ?", (n, queue))

    # -- producers -------------------------------------------------------------------------

    def publish(
        self,
        queue: str,
        bodies: Iterable[bytes],
        *,
        msg_ids: Iterable[str | None] | None = None,
        headers: Iterable[dict[str, str] | None] | None = None,
        remember: bool = False,
    ) -> int:
        """Append messages in one transaction; return how many were new.

        A message whose ``msg_id`` is already queued is skipped (so a re-published
        message after a crash is not queued twice while the first is pending). With
        ``remember=True`` the message ids are also kept after their messages were
        consumed, and an id ever published with ``remember`` is never queued again
        (exactly-once publishing; the ids cost ~60 bytes each in the file).
        """
        now = time.time()
        bodies = list(bodies)
        ids = list(msg_ids) if msg_ids is not None else [None] * len(bodies)
        hdrs = list(headers) if headers is not None else [None] * len(bodies)
        if not (len(ids) == len(hdrs) == len(bodies)):
            raise ValueError("bodies, msg_ids and headers must have the same length")
        rows = [
            (queue, mid, sqlite3.Binary(b), json.dumps(h) if h else None, now, now)
            for b, mid, h in zip(bodies, ids, hdrs, strict=True)
        ]
        if remember and None in ids:
            raise ValueError("remember=True needs a msg_id for every message")
        with self._tx():
            if remember:
                fresh = []
                for r in rows:
                    if self._changes(
                        "INSERT OR IGNORE INTO published_ids (queue, msg_id, at) VALUES (?, ?, ?)",
                        [(queue, r[1], now)],
                    ):
                        fresh.append(r)
                rows = fresh
            added = self._changes(
                "INSERT OR IGNORE INTO messages (queue, msg_id, body, headers, visible_at,"
                " published_at) VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            self._bump(queue, "published_total", added)
        return added

    def forget_published(self, queue: str, older_than_s: float) -> int:
        """Forget remembered ids published more than ``older_than_s`` ago (retention):
        a message with such an id published again is queued again. Returns how many."""
        with self._tx():
            return self._db.execute(
                "DELETE FROM published_ids WHERE queue = ? AND at < ?", (queue, time.time() - older_than_s)
            ).rowcount

    # -- the consumer ----------------------------------------------------------------------

    def claim_consumer(self, queue: str) -> int:
        """Become the only consumer of ``queue``; give back leases of a dead consumer.

        Returns how many orphaned leases were made visible again (messages that were
        in flight when a previous consumer died: they will be delivered again).
        Raises :class:`ConfigError` when another live process consumes the queue.
        """
        lock_path = f"{self.path}.{queue}.consumer.lock"
        fd = try_lock(lock_path)
        if fd is None:
            raise ConfigError(
                f"embedded queue {queue!r} in {self.path!r} already has a live consumer; "
                "stop it first (one consumer per queue)"
            )
        self._lock_fd = fd
        # given back in their place (oldest first, before what was published after them),
        # as a broker requeues: a window would otherwise see them behind the backlog, late.
        # One leased CRASH_SUSPECT times without a settlement may be what kills the
        # consumer: it goes behind the backlog, so that the rest still flows.
        with self._tx():
            cur = self._db.execute(
                "UPDATE messages SET leased = 0, visible_at = CASE WHEN deliveries >= ? THEN ? "
                "ELSE published_at END WHERE queue = ? AND leased = 1",
                (CRASH_SUSPECT, time.time(), queue),
            )
        return cur.rowcount

    def lease(self, queue: str, n: int, *, visibility_timeout: float) -> list[Leased]:
        """Lease up to ``n`` visible messages, oldest first, for ``visibility_timeout`` s."""
        return [
            Leased(r[0], r[1], bytes(r[2]), stored_headers(r[3]), r[4], r[5])
            for r in self.lease_rows(queue, n, visibility_timeout=visibility_timeout)
        ]

    def lease_rows(self, queue: str, n: int, *, visibility_timeout: float) -> list[tuple[Any, ...]]:
        """:meth:`lease`, as the rows ``(row_id, msg_id, body, headers_json, deliveries,
        published_at)``, oldest first: no objects made for the caller to copy again."""
        if n <= 0:
            return []
        now = time.time()
        with self._tx():
            rows = self._db.execute(
                "UPDATE messages SET deliveries = deliveries + 1, leased = 1, visible_at = ?"
                " WHERE id IN (SELECT id FROM messages WHERE queue = ? AND visible_at <= ?"
                " ORDER BY visible_at, id LIMIT ?)"
                " RETURNING id, msg_id, body, headers, deliveries, published_at",
                (now + visibility_timeout, queue, now, n),
            ).fetchall()
            if rows:
                self._bump(queue, "delivered_total", len(rows))
        rows.sort(key=lambda r: r[0])
        return rows

    def ack(self, queue: str, deliveries: Sequence[tuple[int, int]]) -> int:
        """Delete the given ``(row_id, deliveries)``; return how many were still held.

        A pair whose lease was lost (expired and leased again) is not acked.
        """
        faults.point("embedded.before_ack")
        with self._tx():
            done = self._changes(
                "DELETE FROM messages WHERE id = ? AND deliveries = ? AND leased = 1",
                deliveries,
            )
            self._bump(queue, "acked_total", done)
        return done

    def ack_held(self, queue: str, deliveries: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Like :meth:`ack`, in one transaction, and return the pairs that were not held
        any more (their lease expired and the message was leased again, or settled)."""
        faults.point("embedded.before_ack")
        with self._tx():  # (ids as one JSON array: no Python per row in SQLite's calls)
            held = set(
                self._db.execute(
                    "SELECT id, deliveries FROM messages WHERE leased = 1"
                    " AND id IN (SELECT value FROM json_each(?))",
                    (json.dumps([int(rid) for rid, _ in deliveries]),),
                ).fetchall()
            )
            mine = [p for p in deliveries if tuple(p) in held]
            # held in this write transaction (its lock taken first): the ids are enough
            done = self._db.execute(
                "DELETE FROM messages WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps([int(rid) for rid, _ in mine]),),
            ).rowcount
            self._bump(queue, "acked_total", done)
        return [p for p in deliveries if tuple(p) not in held]

    def retry(self, failures: Sequence[tuple[int, int, float, str]]) -> int:
        """Make failed ``(row_id, deliveries, delay_s, error)`` visible again after their
        delay, in one transaction."""
        now = time.time()
        with self._tx():
            return self._changes(
                "UPDATE messages SET leased = 0, visible_at = ?, last_error = ?"
                " WHERE id = ? AND deliveries = ? AND leased = 1",
                [(now + delay, error, rid, n) for rid, n, delay, error in failures],
            )

    def release(self, deliveries: Sequence[tuple[int, int]]) -> int:
        """Give back unprocessed deliveries at once, without counting a delivery, in
        their place in the queue (before what was published after them)."""
        with self._tx():
            return self._changes(
                "UPDATE messages SET leased = 0, visible_at = published_at, deliveries = deliveries - 1"
                " WHERE id = ? AND deliveries = ? AND leased = 1",
                [(rid, n) for rid, n in deliveries],
            )

    def extend(self, deliveries: Sequence[tuple[int, int]], *, visibility_timeout: float) -> int:
        """Push the lease of still-held deliveries ``visibility_timeout`` s into the future."""
        at = time.time() + visibility_timeout
        with self._tx():
            return self._changes(
                "UPDATE messages SET visible_at = ? WHERE id = ? AND deliveries = ? AND leased = 1",
                [(at, rid, n) for rid, n in deliveries],
            )

    def dead_letter(self, queue: str, failures: Sequence[tuple[int, int, str, str]]) -> int:
        """Move ``(row_id, deliveries, step, error)`` to the dead-letter table, atomically."""
        return len(self.dead_letter_ids(queue, failures))

    def dead_letter_ids(
        self, queue: str, failures: Sequence[tuple[int, int, str, str]]
    ) -> dict[tuple[int, int], int]:
        """Like :meth:`dead_letter`; return the dead-letter id (what :meth:`replay` takes)
        of each ``(row_id, deliveries)`` that was still held and was moved."""
        now = time.time()
        moved: dict[tuple[int, int], int] = {}
        with self._tx():
            for rid, n, step, error in failures:
                row = self._db.execute(
                    "DELETE FROM messages WHERE id = ? AND deliveries = ? AND leased = 1"
                    " RETURNING msg_id, body, headers, published_at",
                    (rid, n),
                ).fetchone()
                if row is None:
                    continue
                cur = self._db.execute(
                    "INSERT INTO dead_letters (queue, msg_id, body, headers, step, error,"
                    " deliveries, published_at, dead_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (queue, row[0], row[1], row[2], step, error, n, row[3], now),
                )
                moved[(rid, n)] = int(cur.lastrowid or 0)
        return moved

    # -- inspection ------------------------------------------------------------------------

    def stats(self, queue: str) -> dict[str, int]:
        now = time.time()
        ready, leased, delayed = self._db.execute(
            "SELECT COALESCE(SUM(visible_at <= ?), 0),"
            " COALESCE(SUM(visible_at > ? AND leased = 1), 0),"
            " COALESCE(SUM(visible_at > ? AND leased = 0), 0)"
            " FROM messages WHERE queue = ?",
            (now, now, now, queue),
        ).fetchone()
        (dead,) = self._db.execute("SELECT COUNT(*) FROM dead_letters WHERE queue = ?", (queue,)).fetchone()
        counters = self._db.execute(
            "SELECT published_total, delivered_total, acked_total FROM counters WHERE queue = ?",
            (queue,),
        ).fetchone() or (0, 0, 0)
        return {
            "ready": int(ready),
            "leased": int(leased),
            "delayed": int(delayed),
            "dead_lettered": int(dead),
            "published_total": int(counters[0]),
            "delivered_total": int(counters[1]),
            "acked_total": int(counters[2]),
        }

    def queues(self) -> list[str]:
        rows = self._db.execute(
            "SELECT queue FROM counters UNION SELECT queue FROM dead_letters ORDER BY 1"
        ).fetchall()
        return [r[0] for r in rows]

    def peek(self, queue: str, n: int = 10) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, msg_id, body, headers, deliveries, visible_at, leased, last_error"
            " FROM messages WHERE queue = ? ORDER BY id LIMIT ?",
            (queue, n),
        ).fetchall()
        return [
            {
                "id": r[0],
                "msg_id": r[1],
                "body": bytes(r[2]).decode("utf-8", "replace"),
                "headers": stored_headers(r[3]),
                "deliveries": r[4],
                "visible_at": r[5],
                "leased": bool(r[6]),
                "last_error": r[7],
            }
            for r in rows
        ]

    def dead_letters(self, queue: str, n: int | None = None) -> list[DeadLetter]:
        rows = self._db.execute(
            "SELECT id, msg_id, body, headers, step, error, deliveries, published_at, dead_at"
            " FROM dead_letters WHERE queue = ? ORDER BY id LIMIT ?",
            (queue, -1 if n is None else n),
        ).fetchall()
        return [DeadLetter(r[0], r[1], bytes(r[2]), stored_headers(r[3]), *r[4:]) for r in rows]

    def replay(self, queue: str, ids: Sequence[int] | None = None) -> int:
        """Move dead letters (all, or those with the given ids) back to the queue; return
        how many moved. See :meth:`replay_each` for the ones that stay and why."""
        return len(self.replay_each(queue, ids).moved)

    def replay_each(self, queue: str, ids: Sequence[int] | None = None) -> Replayed:
        """Move dead letters (all, or those with the given ids) back to the queue, each
        in the same transaction as its removal from the dead-letter table.

        A dead letter is never destroyed: one whose ``msg_id`` is already queued (the
        producer published it again, or an earlier replay of another dead letter with
        that id) stays a dead letter, with the reason in :attr:`Replayed.kept`; replay
        it once that message has settled.
        """
        now = time.time()
        where, args = "queue = ?", [queue]
        if ids is not None:
            if not ids:
                return Replayed([], {})
            where += f" AND id IN ({','.join('?' * len(ids))})"
            args += [str(i) for i in ids]
        moved: list[int] = []
        kept: dict[int, str] = {}
        with self._tx():
            rows = self._db.execute(
                f"SELECT id, msg_id, body, headers, published_at FROM dead_letters WHERE {where} ORDER BY id",
                args,
            ).fetchall()
            for dl_id, msg_id, body, headers, published_at in rows:
                if not self._changes(
                    "INSERT OR IGNORE INTO messages (queue, msg_id, body, headers,"
                    " visible_at, published_at) VALUES (?, ?, ?, ?, ?, ?)",
                    [(queue, msg_id, body, headers, now, published_at)],
                ):
                    kept[dl_id] = (
                        f"kept: a message with msg_id {msg_id!r} is queued; "
                        "replay this dead letter after that one settles"
                    )
                    continue
                self._db.execute("DELETE FROM dead_letters WHERE id = ?", (dl_id,))
                moved.append(dl_id)
        return Replayed(moved, kept)

    def close(self) -> None:
        self._db.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
