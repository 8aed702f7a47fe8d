"""The windows' state store: partial aggregates, watermarks and applied row keys.

One SQLite file (``windows.db`` beside the flow's other durable state, or in
``state_dir``), in WAL mode with ``synchronous=FULL``: a commit is on disk when it
returns. Tables:

* ``windows``: one row per open window (operator, key values, start), its end, its row
  count and its accumulators (pickled: this file is ackflow's own, never outside
  bytes); ``dirty`` marks windows changed since they were last written (``update``).
* ``window_log``: tumbling and hopping windows written once change by a row per batch
  here, folded into ``windows`` now and then (:mod:`.winlog`).
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
from typing import Any

from ackflow import faults
from ackflow.state import runs, winlog
from ackflow.state.columns import Columns
from ackflow.state.held import PUT_WINDOW, Due, DueTable, Held, HeldWindows, Slot
from ackflow.state.partials import Partials, gk_text
from ackflow.state.spec import WindowSpec
from ackflow.windows import Count, Session, merger

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
CREATE TABLE IF NOT EXISTS window_log (op TEXT NOT NULL, seq INTEGER NOT NULL, changes BLOB NOT NULL,
    PRIMARY KEY (op, seq));
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


#: a tumbling or hopping window's row after a batch: its end never changes, nor is it
#: ever filled (leaving them out of the update saves a fifth of its time)
MERGE_WINDOW = (
    'INSERT INTO windows (op, gk, start, "end", nrows, filled, dirty, state) VALUES (?, ?, ?, ?, ?, ?, 1, ?) '
    "ON CONFLICT (op, gk, start) DO UPDATE SET nrows = excluded.nrows, dirty = 1, state = excluded.state, "
    "error = NULL"
)
OWN = object()  # apply(): the watermark follows the batch's own largest event time


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


class WindowStore(HeldWindows):
    """The driver's handle on the store (thread-safe: one lock around each transaction)."""

    def __init__(self, path: str, *, conn: Any = None, size: Any = None) -> None:
        """The SQLite file at ``path``; or ``conn``, a connection that takes the same
        statements (PostgreSQL: :mod:`ackflow.state.pg`), and ``size()`` its bytes."""
        self.path = path
        self.lock = threading.RLock()
        self._size = size
        # op -> its open windows, (gk, start) -> (end, rows, values, accs); None: too many
        self._open: dict[str, dict[Slot, Held] | Columns | None] = {}
        self._refused: dict[str, set[Slot]] = {}  # op -> held windows its output refused
        self._logged: dict[str, list[int]] = {}  # op -> rows and changes in its log since folded
        self._touched: dict[str, set[Slot]] = {}  # op -> held windows changed since folded
        self._tabled: dict[str, set[Slot]] = {}  # op -> held windows the table has a row of
        self._closed = False
        self._first_end: dict[str, int] = {}  # op -> at most the earliest end held (not refused)
        self._no_columns: dict[str, int] = {}  # op -> batches before holding it in columns again
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
        """The change logs folded in (the table alone is the state for the next reader),
        then the connections closed (again: nothing)."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            try:
                for op in sorted(set(self._logged) | set(self._open)):
                    self._folded(op)  # (if its log holds anything)
            finally:
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
        watermark may follow now (a :class:`~ackflow.state.gate.Gate` decides; None: it stays); by default
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
                staged: dict[Slot, Held] | Columns = {}  # held once committed
                logged = 0  # changes written to the change log
                if isinstance(spec.kind, Count):
                    self._merge_counts(spec, parts)
                elif isinstance(spec.kind, Session):
                    self._merge_sessions(spec, parts)
                else:
                    staged, logged = self._merge_fixed(spec, parts)
                self._applied(spec.name, keys, now, lite)
                self._move(spec, max_t, late, len(keys), now if keys else None)
                faults.point("state.before_commit")
                db.execute("COMMIT")
            except BaseException:
                self._forget_held(spec.name)  # (a commit that failed may still have been made)
                db.execute("ROLLBACK")
                raise
            self._in_step(spec.name, staged, (), logged)
        faults.point("state.after_commit")
        return len(keys)

    def _applied(self, op: str, keys: list[str], now: float, lite: bool) -> None:
        """Record ``keys`` applied; one already is: StateError (the batch is not applied).
        Most as runs (:mod:`.runs`); the keys kept whole, in SQLite, in one statement over
        a sorted JSON array (a key holding NUL, which SQLite's JSON would cut, goes row by
        row)."""
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

    def _merge_fixed(self, spec: WindowSpec, parts: list[Partials]) -> tuple[dict[Slot, Held] | Columns, int]:
        """Merge the partials into the stored windows; return what the handle holds of
        them once the transaction commits (nothing when it does not hold them), and the
        changes it wrote to the change log (0: none, the table was written). Each task's
        partial of a window merges into the window as it stands (held, or already merged
        with an earlier task's), in the tasks' order."""
        merge = merger(spec.aggs)
        if not any(p.has_slots() for p in parts):
            return {}, 0
        holds = self._held(spec.name)
        if holds is not None and self._logs(spec):
            cols = self._merge_columns(spec, holds, parts)
            if cols is not None and cols.changed is not None:  # (the log row: the windows changed)
                winlog.append(self.db, spec.name, cols.changed, ())
                return cols, cols.changed.num_rows
        held = self._as_dict(spec.name) if isinstance(holds, Columns) else holds
        staged: dict[Slot, Held] = {}
        source: dict[Slot, Held] = {} if held is None else held
        for p in parts:
            for values, start, end, rows, accs, gk in p.slots():
                if gk is None:  # (a NaN in the key: its own tuple, the same text)
                    gk = gk_text(values)
                slot = (gk, start)
                cur = staged.get(slot) or source.get(slot)
                if cur is not None:
                    accs = merge(cur[3], accs)
                    rows += cur[1]
                staged[slot] = (end, rows, values, accs)
        if not staged:
            return {}, 0
        if held is None:
            return self._merge_stored(spec, staged, merge), 0
        if self._logs(spec):
            changes = [
                (gk, start, end, rows, values, accs)
                for (gk, start), (end, rows, values, accs) in staged.items()
            ]
            winlog.append(self.db, spec.name, changes, ())
            return staged, len(changes)
        self.db.executemany(
            MERGE_WINDOW,
            [
                (spec.name, gk, start, end, rows, 0, pickle.dumps((values, accs)))
                for (gk, start), (end, rows, values, accs) in staged.items()
            ],
        )
        return staged, 0

    def _merge_stored(self, spec: WindowSpec, merged: dict[Slot, Held], merge: Any) -> dict[Slot, Held]:
        """:meth:`_merge_fixed` when the handle does not hold the windows (more than
        :data:`~.held.HOLD_MAX`): the stored windows of these keys read, one query per chunk."""
        self._fold(spec.name)
        starts = [start for _, start in merged]
        query = (
            "SELECT gk, start, nrows, state FROM windows "
            "WHERE op = ? AND start BETWEEN ? AND ? AND gk IN ({marks})"
        )
        args = [spec.name, min(starts), max(starts)]  # (not a key's other open windows)
        stored = {
            (gk, int(start)): (int(nrows), state)
            for gk, start, nrows, state in rows_in(self.db, query, args, sorted({g for g, _ in merged}))
        }
        out = []
        for (gk, start), (end, rows, values, accs) in merged.items():
            old = stored.get((gk, start))
            if old is not None:
                accs = merge(pickle.loads(old[1])[1], accs)
                rows += old[0]
            out.append((spec.name, gk, start, end, rows, 0, pickle.dumps((values, accs))))
        self.db.executemany(MERGE_WINDOW, out)
        return {}

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
            held = self._memory(spec.name)
            if isinstance(held, Columns):
                top = held.max_end()
            elif held is not None:
                top = max((w[0] for w in held.values()), default=None)
            else:
                self._folded(spec.name)
                top = self.db.execute('SELECT max("end") FROM windows WHERE op = ?', (spec.name,)).fetchone()[
                    0
                ]
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

    def due(self, spec: WindowSpec, bound: int | None, limit: int = 5000) -> Sequence[Due]:
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
            held = self._memory(spec.name) if self._logs(spec) else None
            if held is not None:
                return self._due_held(spec, held, bound, limit)
            self._folded(spec.name)
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
        if isinstance(written, DueTable):  # (all closing: no Due made per window)
            gone, clean = written.slots(), []
        else:
            gone = [(d.gk, d.start) for d in written if d.close]
            clean = [(d.gk, d.start) for d in written if not d.close]
        with self.lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                in_step = self._count_write(spec.name)[0]
                if not in_step:
                    self._forget_held(spec.name)
                logged = in_step and self._logs(spec) and self._open.get(spec.name) is not None
                if logged:  # (a window only in the log is deleted by its own row)
                    winlog.append(db, spec.name, (), gone)
                else:
                    self._fold(spec.name)
                    db.executemany(
                        "DELETE FROM windows WHERE op = ? AND gk = ? AND start = ?",
                        [(spec.name, gk, start) for gk, start in gone],
                    )
                db.executemany(
                    "UPDATE windows SET dirty = 0 WHERE op = ? AND gk = ? AND start = ?",
                    [(spec.name, gk, start) for gk, start in clean],
                )
                db.execute("UPDATE marks SET written = written + ? WHERE op = ?", (len(gone), spec.name))
                db.execute("COMMIT")
            except BaseException:
                self._forget_held(spec.name)
                db.execute("ROLLBACK")
                raise
            self._in_step(spec.name, {}, gone, len(gone) if logged else 0)

    def fail(self, spec: WindowSpec, due: Due, why: str) -> None:
        """The output refused ``due``'s row (or it could not be made): it stays in the
        store with the reason, shown by ``ackflow state show``, and is not tried again
        in this run (each start clears the reasons: :meth:`retry_failed`), so it never
        holds back the windows after it."""
        with self.lock:
            self._folded(spec.name)  # (the window may be only in the change log)
            self._write_counted(
                spec.name,
                lambda: self.db.execute(
                    "UPDATE windows SET error = ? WHERE op = ? AND gk = ? AND start = ?",
                    (why[:2000], spec.name, due.gk, due.start),
                ),
            )
            self._refused.setdefault(spec.name, set()).add((due.gk, due.start))

    def retry_failed(self, spec: WindowSpec) -> int:
        with self.lock:
            self._folded(spec.name)
            out = self._write_counted(
                spec.name,
                lambda: (
                    self.db.execute(
                        "UPDATE windows SET error = NULL WHERE op = ? AND error IS NOT NULL", (spec.name,)
                    ).rowcount
                ),
            )
            self._refused.pop(spec.name, None)
            self._first_end.pop(spec.name, None)  # (a window refused until now is due again)
            return int(out)

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
            held = self._memory(op)
            if held is not None:
                windows, refused = len(held), len(self._refused.get(op, ()))
            else:
                windows, refused = self._counted_windows(op)
        if self._size is not None:
            size = self._size()
        else:
            size = sum(os.path.getsize(p) for p in (self.path, self.path + "-wal") if os.path.exists(p))
        return {"open_windows": windows, "refused_windows": refused, "bytes": size}

    def _counted_windows(self, op: str) -> tuple[int, int]:
        with self.lock:
            self._folded(op)
            # (counted on the indexes: reading ``error`` row by row walks every state blob)
            windows, refused = self.db.execute(
                "SELECT (SELECT count(*) FROM windows WHERE op = ?), "
                "(SELECT count(*) FROM windows WHERE op = ? AND error IS NOT NULL)",
                (op, op),
            ).fetchone()
        return int(windows), int(refused)
