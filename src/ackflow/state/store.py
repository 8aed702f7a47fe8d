"""The windows' state store: partial aggregates, watermarks and applied row keys.

One SQLite file (``windows.db`` beside the flow's other durable state, or in
``state_dir``), in WAL mode with ``synchronous=FULL``: a commit is on disk when it
returns. Tables:

* ``windows``: one row per open window (operator, key values, start), its end, its row
  count and its accumulators (pickled: this file is ackflow's own, never outside
  bytes); ``dirty`` marks windows changed since they were last written (``update``).
* ``marks``: per operator the watermark, the largest event time seen, when data last
  came (wall clock, for the idle advance), late rows, and windows written.
* ``dedupe``: a dedupe operator's claims, one per first of a key value (:mod:`.dedupe`).
* ``applied``: the row keys whose contribution is committed, with when; a redelivered
  row whose key is here adds nothing again. Kept for the operator's ``remember``
  (default one hour), then forgotten: a row delivered again after that, into a window
  still open, is counted again; into a closed one, it is late.

A batch's contribution (every task's partials, the new watermark, the applied keys)
is one transaction (:meth:`WindowStore.apply`); the message is acked only after it.
Tasks read the watermark and the applied keys through a read-only connection
(:func:`read_view`), so a Spark cluster needs executors that see the file (or
another store).
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ackflow import faults
from ackflow.state import runs
from ackflow.state.partials import Partials, gk_text
from ackflow.state.spec import WindowSpec
from ackflow.windows import Count, Session

STORE_FILE = "windows.db"
CHUNK = 900  # SQLite's bound on host parameters, with room

SCHEMA = """
CREATE TABLE IF NOT EXISTS windows (
    op TEXT NOT NULL, gk TEXT NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    nrows INTEGER NOT NULL, filled INTEGER NOT NULL DEFAULT 0, dirty INTEGER NOT NULL DEFAULT 1,
    state BLOB NOT NULL, error TEXT, PRIMARY KEY (op, gk, start));
CREATE INDEX IF NOT EXISTS windows_end ON windows (op, "end");
CREATE INDEX IF NOT EXISTS windows_refused ON windows (op) WHERE error IS NOT NULL;
CREATE TABLE IF NOT EXISTS marks (
    op TEXT PRIMARY KEY, watermark INTEGER, max_event INTEGER, data_at REAL,
    late INTEGER NOT NULL DEFAULT 0, written INTEGER NOT NULL DEFAULT 0,
    applied_rows INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS applied (op TEXT NOT NULL, key TEXT NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (op, key));
CREATE INDEX IF NOT EXISTS applied_at ON applied (op, at);
CREATE TABLE IF NOT EXISTS applied_runs (op TEXT NOT NULL, stem TEXT NOT NULL, lo INTEGER NOT NULL,
    hi INTEGER NOT NULL, at REAL NOT NULL, PRIMARY KEY (op, stem, lo));
CREATE INDEX IF NOT EXISTS applied_runs_at ON applied_runs (op, at);
CREATE TABLE IF NOT EXISTS writes (op TEXT PRIMARY KEY, n INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS upgrades (step TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS begun (op TEXT NOT NULL, batch TEXT NOT NULL, watermark INTEGER,
    PRIMARY KEY (op, batch));
CREATE TABLE IF NOT EXISTS count_next (op TEXT NOT NULL, gk TEXT NOT NULL, next INTEGER NOT NULL,
    PRIMARY KEY (op, gk));
CREATE TABLE IF NOT EXISTS dedupe (op TEXT NOT NULL, k TEXT NOT NULL, owner TEXT NOT NULL,
    job TEXT NOT NULL, t INTEGER NOT NULL, at REAL NOT NULL, done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (op, k, t));
CREATE INDEX IF NOT EXISTS dedupe_t ON dedupe (op, t);
CREATE INDEX IF NOT EXISTS dedupe_at ON dedupe (op, at);
"""


#: a window's row, new or changed: an upsert (a third cheaper than INSERT OR REPLACE's
#: delete and insert); a changed window is tried again if its sink had refused it
PUT_WINDOW = (
    'INSERT INTO windows (op, gk, start, "end", nrows, filled, dirty, state) VALUES (?, ?, ?, ?, ?, ?, 1, ?) '
    'ON CONFLICT (op, gk, start) DO UPDATE SET "end" = excluded."end", nrows = excluded.nrows, '
    "filled = excluded.filled, dirty = 1, state = excluded.state, error = NULL"
)
#: open tumbling and hopping windows the driver keeps in memory per operator (as
#: stored: rows and pickled state); an operator with more is read from the store per batch
HOLD_MAX = 100_000
#: a tumbling or hopping window's row after a batch: its end never changes, nor is it
#: ever filled (leaving them out of the update saves a fifth of its time)
MERGE_WINDOW = (
    'INSERT INTO windows (op, gk, start, "end", nrows, filled, dirty, state) VALUES (?, ?, ?, ?, ?, ?, 1, ?) '
    "ON CONFLICT (op, gk, start) DO UPDATE SET nrows = excluded.nrows, dirty = 1, state = excluded.state, "
    "error = NULL"
)
OWN = object()  # apply(): the watermark follows the batch's own largest event time


class Gate:
    """Which batches may move the watermark: a batch's largest event time counts once
    every batch that began before it has ended (committed or failed); until then it
    waits. Otherwise a younger batch that commits first moves the watermark past rows
    of an older one that then fails, or dies in a crash, and comes again: late for no
    fault of theirs. A crash forgets what waits: the watermark is then lower, never
    past a row still to come. The batch's own tasks judge lateness by the watermark it
    began with. Not thread-safe: the window sink calls it under the store's lock."""

    def __init__(self) -> None:
        self._seq = 0
        self.running: dict[str, tuple[int, int | None]] = {}  # batch -> (order, watermark)
        self._waiting: list[tuple[int, int]] = []  # (order, largest event time)

    def begin(self, batch: str, watermark: int | None) -> None:
        self._seq += 1
        self.running[batch] = (self._seq, watermark)

    def _split(self, batch: str, event_max: int | None) -> tuple[int | None, list[tuple[int, int]]]:
        seq = self.running.get(batch, (None, None))[0]
        waiting = list(self._waiting)
        if seq is not None and event_max is not None:
            waiting.append((seq, event_max))
        others = [s for b, (s, _) in self.running.items() if b != batch]
        oldest = min(others, default=None)
        ready = [t for s, t in waiting if oldest is None or s < oldest]
        keep = [(s, t) for s, t in waiting if not (oldest is None or s < oldest)]
        return max(ready, default=None), keep

    def ready(self, batch: str, event_max: int | None) -> int | None:
        """The event time the watermark may follow if ``batch`` ends now with ``event_max``."""
        return self._split(batch, event_max)[0]

    def end(self, batch: str, event_max: int | None) -> int | None:
        """``batch`` ended (``event_max``: None if it failed); what may count now."""
        out, self._waiting = self._split(batch, event_max)
        self.running.pop(batch, None)
        return out

    def rename(self, batch: str, to: str) -> None:
        """``batch``'s place (its order and watermark) goes on as ``to``."""
        if batch in self.running:
            self.running[to] = self.running.pop(batch)

    def bound(self, watermark: int | None) -> int | None:
        """The watermark windows may close by: held back by every running batch's."""
        for _, started in self.running.values():
            if watermark is None or started is None:
                return None
            watermark = min(watermark, started)
        return watermark


def rows_in(db: Any, query: str, args: Sequence[Any], values: Sequence[Any]) -> Iterator[Any]:
    """The rows of ``query`` (its ``IN ({marks})`` filled) for ``values``, a chunk of
    :data:`CHUNK` at a time (SQLite's bound on host parameters); ``args`` come first."""
    for i in range(0, len(values), CHUNK):
        part = list(values[i : i + CHUNK])
        yield from db.execute(query.format(marks=",".join("?" * len(part))), [*args, *part])


class StateError(RuntimeError):
    """The state store refused a batch (a contribution it already holds: a bug)."""


def connect(path: str, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True, timeout=30)
        db.execute("PRAGMA query_only=ON")
        return db
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(SCHEMA)
    return db


def read_view(
    path: str, op: str, keys: Sequence[str], batch: str | None = None
) -> tuple[int | None, set[str]]:
    """A task's view: the watermark its batch began with (rows below it are late) and
    which of ``keys`` are applied."""
    db = connect(path, readonly=True)
    try:
        return view_of(db, op, keys, batch, lite=True)
    finally:
        db.close()


def view_of(
    db: Any, op: str, keys: Sequence[str], batch: str | None, lite: bool
) -> tuple[int | None, set[str]]:
    """:func:`read_view` on an open connection: SQLite's, or (``lite`` False) a psycopg
    one (:func:`ackflow.state.pg.read_view`)."""
    mark = "?" if lite else "%s"
    row = db.execute(
        f"SELECT watermark FROM begun WHERE op = {mark} AND batch = {mark}", (op, batch)
    ).fetchone()
    if row is None:
        row = db.execute(f"SELECT watermark FROM marks WHERE op = {mark}", (op,)).fetchone()
    applied, whole = runs.applied_of(db, op, keys, lite=lite)
    if whole and lite:
        query = "SELECT key FROM applied WHERE op = ? AND key IN ({marks})"
        applied |= {r[0] for r in rows_in(db, query, [op], whole)}
    elif whole:
        applied |= {
            r[0] for r in db.execute("SELECT key FROM applied WHERE op = %s AND key = ANY(%s)", (op, whole))
        }
    return (row[0] if row else None), applied


@dataclass
class Due:
    """A window ready to be written: its row and what to do after."""

    gk: str
    start: int
    end: int
    values: tuple[Any, ...]
    accs: list[Any]
    close: bool  # delete after writing (final), else only clear ``dirty``


class WindowStore:
    """The driver's handle on the store (thread-safe: one lock around each transaction)."""

    def __init__(self, path: str, *, conn: Any = None, size: Any = None) -> None:
        """The SQLite file at ``path``; or ``conn``, a connection that takes the same
        statements (PostgreSQL: :mod:`ackflow.state.pg`), and ``size()`` its bytes."""
        self.path = path
        self.lock = threading.RLock()
        self._size = size
        # op -> its open windows as stored, (gk, start) -> (rows, state); None: too many
        self._open: dict[str, dict[tuple[str, int], tuple[int, bytes]] | None] = {}
        self._version: dict[str, int] = {}  # op -> the count of writes ``_open`` is in step with
        self._counted: str | None = None  # the op whose write the open transaction counted
        if conn is not None:
            self.db = self.scratch = conn
        else:
            self.db = connect(path)
            # a batch's starting watermark needs no fsync: a crash ends the batch with it
            self.scratch = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self.scratch.execute("PRAGMA synchronous=OFF")
        self._migrate()

    def _migrate(self) -> None:
        """Row keys an older version kept whole that now make runs move into runs (once
        per store: ``upgrades`` remembers it). Several processes may open one PostgreSQL
        store at once: the one that takes the schema's DDL lock first moves them, the
        others find ``upgrades`` done once it is theirs."""
        done = "SELECT 1 FROM upgrades WHERE step = 'runs'"
        with self.lock:
            db = self.db
            if db.execute(done).fetchone() is not None:
                return
            lite = isinstance(db, sqlite3.Connection)
            db.execute("BEGIN IMMEDIATE")
            try:
                if not lite:  # (the lock connect_store's DDL takes: pg.py)
                    db.execute("SELECT pg_advisory_xact_lock(hashtext('ackflow-ddl:' || current_schema()))")
                if db.execute(done).fetchone() is None:
                    runs.migrate(db, lite)
                    db.execute("INSERT INTO upgrades (step) VALUES ('runs') ON CONFLICT DO NOTHING")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self.lock:
            self.db.close()
            self.scratch.close()

    def begin(self, op: str, batch: str) -> int | None:
        """A batch begins: its tasks judge lateness by the watermark as of now (a later
        batch that commits first does not make this one's rows late)."""
        with self.lock:
            w = self.mark(op)["watermark"]
            self.scratch.execute(
                "INSERT OR REPLACE INTO begun (op, batch, watermark) VALUES (?, ?, ?)", (op, batch, w)
            )
        return w  # type: ignore[no-any-return]

    def end(self, op: str, batch: str | None = None) -> None:
        """A batch committed or failed (None: every batch, at start: left by a crash)."""
        with self.lock:
            if batch is None:
                self.scratch.execute("DELETE FROM begun WHERE op = ?", (op,))
            else:
                self.scratch.execute("DELETE FROM begun WHERE op = ? AND batch = ?", (op, batch))

    def mark(self, op: str) -> dict[str, Any]:
        with self.lock:
            row = self.db.execute(
                "SELECT watermark, max_event, data_at, late, written, applied_rows FROM marks WHERE op = ?",
                (op,),
            ).fetchone()
        names = ("watermark", "max_event", "data_at", "late", "written", "applied_rows")
        return dict(zip(names, row or (None, None, None, 0, 0, 0), strict=True))

    def apply(
        self, spec: WindowSpec, parts: Iterable[Partials], now: float | None = None, *, event_max: Any = OWN
    ) -> int:
        """Merge a batch's partials, record their row keys and move the watermark: one
        transaction. Returns the rows contributed. ``event_max``: the event time the
        watermark may follow now (a :class:`Gate` decides; None: it stays); by default
        the batch's own largest."""
        now = time.time() if now is None else now
        parts = list(parts)
        keys = [k for p in parts for k in p.keys]
        late = sum(p.late for p in parts)
        max_t = max((p.max_t for p in parts if p.max_t is not None), default=None)
        if event_max is not OWN:
            max_t = event_max
        with self.lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                lite = isinstance(db, sqlite3.Connection)
                staged: dict[tuple[str, int], tuple[int, bytes]] = {}  # held once committed
                if isinstance(spec.kind, Count):
                    self._merge_counts(spec, parts)
                elif isinstance(spec.kind, Session):
                    self._merge_sessions(spec, parts)
                else:
                    staged = self._merge_fixed(spec, parts)
                self._applied(spec.name, keys, now, lite)
                self._move(spec, max_t, late, len(keys), now if keys else None)
                faults.point("state.before_commit")
                db.execute("COMMIT")
            except BaseException:
                self._forget_held(spec.name)  # (a commit that failed may still have been made)
                db.execute("ROLLBACK")
                raise
            self._in_step(spec.name, staged, ())
        faults.point("state.after_commit")
        return len(keys)

    def _applied(self, op: str, keys: list[str], now: float, lite: bool) -> None:
        """Record ``keys`` applied; one already is: StateError (the batch is not applied).
        Most as runs (:mod:`.runs`); the keys kept whole, in SQLite, in one statement over
        a sorted JSON array (as :func:`insert_keys`; a key holding NUL, which SQLite's JSON
        would cut, goes row by row)."""
        spans, keys, twice = runs.make_runs(keys)
        if twice is not None:
            raise StateError(f"row key {twice!r} is in the batch twice; the batch is not applied")
        hit = runs.clash(self.db, op, spans, lite)
        if hit is not None:
            raise StateError(
                f"row key {hit!r} is applied already (two batches held one message's rows); "
                "the batch is not applied and its messages are not acked"
            )
        runs.put(self.db, op, spans, now, lite)
        if not lite:  # (SQLite: the applied table's key refuses a second below)
            self._check_fresh(op, keys)
        text = json.dumps(sorted(keys), ensure_ascii=False) if lite else ""
        try:
            if lite and "\\u0000" not in text:
                self.db.execute(
                    "INSERT INTO applied (key, op, at) SELECT value, ?, ? FROM json_each(?)", (op, now, text)
                )
            else:
                if lite:  # (row by row: checked first, so that the error names the right key)
                    self._check_fresh(op, keys)
                self.db.executemany(
                    "INSERT INTO applied (key, op, at) VALUES (?, ?, ?)", [(k, op, now) for k in keys]
                )
        except sqlite3.IntegrityError:  # the statement is undone, the transaction goes on
            self._check_fresh(op, keys)  # names the key (the caller rolls back)
            raise StateError("a row key is applied twice; the batch is not applied") from None

    def _held(self, op: str) -> dict[tuple[str, int], tuple[int, bytes]] | None:
        """Inside a transaction: the operator's open windows as stored, read once and
        then kept in step with each commit; read again whenever the store's count of
        writes to them is not the one this handle made (another process, a commit that
        failed); None if there are more than :data:`HOLD_MAX`."""
        in_step, version = self._count_write(op)
        if not in_step:  # (one read: one row past HOLD_MAX says there are too many)
            rows = self.db.execute(
                "SELECT gk, start, nrows, state FROM windows WHERE op = ? LIMIT ?", (op, HOLD_MAX + 1)
            ).fetchall()
            held = None if len(rows) > HOLD_MAX else {(g, int(s)): (int(r), bytes(b)) for g, s, r, b in rows}
            self._open[op], self._version[op] = held, version
        return self._open[op]

    def _count_write(self, op: str) -> tuple[bool, int]:
        """Inside a transaction that writes ``op``'s windows: count the write. Returns
        whether what this handle holds of them was in step before it, and the count."""
        row = self.db.execute("SELECT n FROM writes WHERE op = ?", (op,)).fetchone()
        version = int(row[0]) if row else 0
        self.db.execute(
            "INSERT INTO writes (op, n) VALUES (?, 1) ON CONFLICT (op) DO UPDATE SET n = writes.n + 1", (op,)
        )
        self._counted = op
        return op in self._open and self._version.get(op) == version, version

    def _in_step(self, op: str, put: dict[tuple[str, int], tuple[int, bytes]], gone: Any) -> None:
        """After a commit that wrote ``op``'s windows (and counted one write)."""
        held = self._open.get(op)
        counted, self._counted = self._counted, None
        if held is None or counted != op:
            return
        held.update(put)
        for slot in gone:
            held.pop(slot, None)
        self._version[op] += 1
        if len(held) > HOLD_MAX:
            self._open[op] = None

    def _forget_held(self, op: str) -> None:
        """What is held of ``op``'s windows may differ from the store: read it again."""
        self._open.pop(op, None)
        self._version.pop(op, None)
        self._counted = None

    def _check_fresh(self, op: str, keys: list[str]) -> None:
        query = "SELECT key FROM applied WHERE op = ? AND key IN ({marks}) LIMIT 1"
        hit = next(rows_in(self.db, query, [op], keys), None)
        if hit is not None:
            raise StateError(
                f"row key {hit[0]!r} is applied already (two batches held one message's rows); "
                "the batch is not applied and its messages are not acked"
            )

    def _put(
        self,
        op: str,
        values: tuple[Any, ...],
        start: int,
        end: int,
        rows: int,
        accs: list[Any],
        filled: int = 0,
    ) -> None:
        self.db.execute(
            PUT_WINDOW, (op, gk_text(values), start, end, rows, filled, pickle.dumps((values, accs)))
        )

    def _merge_fixed(
        self, spec: WindowSpec, parts: list[Partials]
    ) -> dict[tuple[str, int], tuple[int, bytes]]:
        """Merge the partials into the stored windows; return what the handle holds of
        them once the transaction commits (nothing when it does not hold them)."""
        merged: dict[tuple[str, int], tuple[tuple[Any, ...], int, int, list[Any]]] = {}
        for p in parts:
            for values, start, end, rows, accs, gk in p.slots():
                if gk is None:  # (a NaN in the key: its own tuple, the same text)
                    gk = gk_text(values)
                slot = (gk, start)
                other = merged.get(slot)
                if other is not None:
                    accs = [a.merge(x, y) for a, x, y in zip(spec.aggs, other[3], accs, strict=True)]
                    rows += other[2]
                merged[slot] = (values, end, rows, accs)
        if not merged:
            return {}
        held = self._held(spec.name)
        stored: dict[tuple[str, int], tuple[int, bytes]] = {}
        if held is not None:
            stored = {slot: held[slot] for slot in merged if slot in held}
        else:  # the stored windows of these keys: one query per chunk of keys
            starts = [start for _, start in merged]
            query = (
                "SELECT gk, start, nrows, state FROM windows "
                "WHERE op = ? AND start BETWEEN ? AND ? AND gk IN ({marks})"
            )
            args = [spec.name, min(starts), max(starts)]  # (not a key's other open windows)
            for gk, start, nrows, state in rows_in(self.db, query, args, sorted({g for g, _ in merged})):
                stored[(gk, int(start))] = (int(nrows), state)
        out = []
        for (gk, start), (values, end, rows, accs) in merged.items():
            old = stored.get((gk, start))
            if old is not None:
                accs = [
                    a.merge(x, y) for a, x, y in zip(spec.aggs, pickle.loads(old[1])[1], accs, strict=True)
                ]
                rows += old[0]
            out.append((spec.name, gk, start, end, rows, 0, pickle.dumps((values, accs))))
        self.db.executemany(MERGE_WINDOW, out)
        return {(r[1], r[2]): (r[4], r[6]) for r in out} if held is not None else {}

    def _merge_sessions(self, spec: WindowSpec, parts: list[Partials]) -> None:
        """A key's sessions: the stored ones and the new partials, overlapping ones merged
        (a partial may bridge two stored sessions: all three become one)."""
        per: dict[str, list[tuple[int, int, int, list[Any], tuple[Any, ...]]]] = {}
        for p in parts:
            for values, start, end, rows, accs, _ in p.slots():
                per.setdefault(gk_text(values), []).append((start, end, rows, accs, values))
        for gk, new in per.items():
            old = self.db.execute(
                'SELECT start, "end", nrows, state FROM windows WHERE op = ? AND gk = ?', (spec.name, gk)
            ).fetchall()
            items = [(s, e, r, pickle.loads(b)[1], pickle.loads(b)[0]) for s, e, r, b in old] + new
            items.sort(key=lambda x: (x[0], x[1]))
            out: list[tuple[int, int, int, list[Any], tuple[Any, ...]]] = []
            for s, e, r, accs, values in items:
                if out and s < out[-1][1]:
                    ps, pe, pr, pa_, pv = out[-1]
                    merged = [a.merge(x, y) for a, x, y in zip(spec.aggs, pa_, accs, strict=True)]
                    out[-1] = (ps, max(pe, e), pr + r, merged, pv)
                else:
                    out.append((s, e, r, accs, values))
            self.db.execute("DELETE FROM windows WHERE op = ? AND gk = ?", (spec.name, gk))
            for s, e, r, accs, values in out:
                self._put(spec.name, values, s, e, r, accs)

    def _merge_counts(self, spec: WindowSpec, parts: list[Partials]) -> None:
        """Count windows fill in arrival order: each batch's rows by (event time, row key)
        within a key; a window that reaches ``n`` rows is full (written, then deleted)
        and the key's next row opens the next one."""
        assert isinstance(spec.kind, Count)
        n = spec.kind.n
        per: dict[str, list[tuple[tuple[int, str], tuple[Any, ...], list[Any]]]] = {}
        for p in parts:
            for values, order, accs in p.rows:
                per.setdefault(gk_text(values), []).append((order, values, accs))
        for gk, rows in per.items():
            rows.sort(key=lambda x: x[0])
            cur = self.db.execute(
                "SELECT start, nrows, state FROM windows WHERE op = ? AND gk = ? AND filled = 0",
                (spec.name, gk),
            ).fetchone()
            last = self.db.execute(
                "SELECT max(start) FROM windows WHERE op = ? AND gk = ?", (spec.name, gk)
            ).fetchone()[0]
            if cur is not None:
                index, count, accs = cur[0], cur[1], pickle.loads(cur[2])[1]
            else:
                index = self._next_index(spec.name, gk, last)
                count, accs = 0, [a.init() for a in spec.aggs]
            for _, values, row_accs in rows:
                accs = [a.merge(x, y) for a, x, y in zip(spec.aggs, accs, row_accs, strict=True)]
                count += 1
                if count == n:
                    self._put(spec.name, values, index, index, count, accs, filled=1)
                    index, count, accs = index + 1, 0, [a.init() for a in spec.aggs]
            if count:
                self._put(spec.name, rows[-1][1], index, index, count, accs)
            self._set_next(spec.name, gk, index)

    def _next_index(self, op: str, gk: str, last: int | None) -> int:
        row = self.db.execute("SELECT next FROM count_next WHERE op = ? AND gk = ?", (op, gk)).fetchone()
        if row is not None:
            return int(row[0])
        return 0 if last is None else last + 1

    def _set_next(self, op: str, gk: str, index: int) -> None:
        """A count window's index per key survives its windows' deletion."""
        self.db.execute("INSERT OR REPLACE INTO count_next (op, gk, next) VALUES (?, ?, ?)", (op, gk, index))

    def _move(self, spec: WindowSpec, max_t: int | None, late: int, rows: int, data_at: float | None) -> None:
        m = self.db.execute("SELECT watermark, max_event FROM marks WHERE op = ?", (spec.name,)).fetchone()
        w, top = m if m is not None else (None, None)
        if max_t is not None:
            top = max_t if top is None else max(top, max_t)
            wanted = top - spec.lateness_us
            if w is None or wanted > w:
                w = wanted
                faults.point("state.watermark")
        self.db.execute(
            "INSERT INTO marks (op, watermark, max_event, data_at, late, applied_rows) "
            "VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (op) DO UPDATE SET watermark = excluded.watermark, max_event = excluded.max_event, "
            "data_at = coalesce(excluded.data_at, marks.data_at), late = marks.late + excluded.late, "
            "applied_rows = marks.applied_rows + excluded.applied_rows",
            (spec.name, w, top, data_at, late, rows),
        )

    def move(self, spec: WindowSpec, event_max: int | None) -> None:
        """Let the watermark follow ``event_max`` (a batch that ended let waiting ones count)."""
        if event_max is None:
            return
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self._move(spec, event_max, 0, 0, None)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def close_open(self, spec: WindowSpec) -> int | None:
        """The stream went quiet: move the watermark to the end of the last open window,
        so that every window holding data closes (a row that comes later for one of
        them is late). Returns the new watermark if it moved."""
        with self.lock:
            top = self.db.execute('SELECT max("end") FROM windows WHERE op = ?', (spec.name,)).fetchone()[0]
            w = self.mark(spec.name)["watermark"]
            if top is None or (w is not None and top <= w):
                return None
            self.db.execute(
                "INSERT INTO marks (op, watermark) VALUES (?, ?) "
                "ON CONFLICT (op) DO UPDATE SET watermark = excluded.watermark",
                (spec.name, top),
            )
        faults.point("state.watermark")
        return int(top)

    def due(self, spec: WindowSpec, bound: int | None, limit: int = 5000) -> list[Due]:
        """Windows to write now: closed ones (end <= ``bound``, or full count windows),
        and with ``output="update"`` every window changed since it was last written."""
        args: list[Any] = []
        if isinstance(spec.kind, Count):
            closed = "filled = 1"
        elif bound is None:
            closed = "FALSE"
        else:
            closed, args = '"end" <= ?', [bound]
        where = closed if spec.output == "final" else f"({closed}) OR dirty = 1"
        where = f"({where}) AND error IS NULL"  # a window its sink refused waits (see fail)
        with self.lock:
            rows = self.db.execute(
                f'SELECT gk, start, "end", state, ({closed}) FROM windows WHERE op = ? AND ({where}) '
                f'ORDER BY "end", gk LIMIT {int(limit)}',
                [*args, spec.name, *args],
            ).fetchall()
        out = []
        for gk, start, end, state, closing in rows:
            values, accs = pickle.loads(state)
            out.append(Due(gk, start, end, tuple(values), accs, bool(closing)))
        return out

    def done(self, spec: WindowSpec, written: Sequence[Due]) -> None:
        """``written`` are in the sink: closed ones deleted, the others made clean."""
        with self.lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "DELETE FROM windows WHERE op = ? AND gk = ? AND start = ?",
                    [(spec.name, d.gk, d.start) for d in written if d.close],
                )
                db.executemany(
                    "UPDATE windows SET dirty = 0 WHERE op = ? AND gk = ? AND start = ?",
                    [(spec.name, d.gk, d.start) for d in written if not d.close],
                )
                db.execute(
                    "UPDATE marks SET written = written + ? WHERE op = ?",
                    (sum(1 for d in written if d.close), spec.name),
                )
                if not self._count_write(spec.name)[0]:
                    self._forget_held(spec.name)
                db.execute("COMMIT")
            except BaseException:
                self._forget_held(spec.name)
                db.execute("ROLLBACK")
                raise
            self._in_step(spec.name, {}, [(d.gk, d.start) for d in written if d.close])

    def fail(self, spec: WindowSpec, due: Due, why: str) -> None:
        """The output refused ``due``'s row (or it could not be made): it stays in the
        store with the reason, shown by ``ackflow state show``, and is not tried again
        in this run (each start clears the reasons: :meth:`retry_failed`), so it never
        holds back the windows after it."""
        with self.lock:
            self.db.execute(
                "UPDATE windows SET error = ? WHERE op = ? AND gk = ? AND start = ?",
                (why[:2000], spec.name, due.gk, due.start),
            )

    def retry_failed(self, spec: WindowSpec) -> int:
        with self.lock:
            return self.db.execute(
                "UPDATE windows SET error = NULL WHERE op = ? AND error IS NOT NULL", (spec.name,)
            ).rowcount

    def forget(self, spec: WindowSpec, now: float | None = None) -> int:
        """Forget applied row keys older than the operator's ``remember``."""
        now = time.time() if now is None else now
        with self.lock:
            args = (spec.name, now - spec.remember_us / 1e6)
            cur = self.db.execute("DELETE FROM applied WHERE op = ? AND at < ?", args)
            gone = cur.rowcount
            return int(
                gone + self.db.execute("DELETE FROM applied_runs WHERE op = ? AND at < ?", args).rowcount
            )

    def stats(self, op: str) -> dict[str, Any]:
        """Open windows, those the output refused, and the file's size (bytes; with its
        write-ahead log)."""
        with self.lock:
            # (counted on the indexes: reading ``error`` row by row walks every state blob)
            windows, refused = self.db.execute(
                "SELECT (SELECT count(*) FROM windows WHERE op = ?), "
                "(SELECT count(*) FROM windows WHERE op = ? AND error IS NOT NULL)",
                (op, op),
            ).fetchone()
        if self._size is not None:
            size = self._size()
        else:
            size = sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))
        return {"open_windows": windows, "refused_windows": refused, "bytes": size}
