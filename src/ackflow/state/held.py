"""What the driver holds of a window operator's open windows, and their change log.

Tumbling and hopping windows are held in memory between batches (:class:`HeldWindows`,
a part of :class:`~ackflow.state.store.WindowStore`): a batch merges into them without
reading the store, and is kept in step with it by a count of writes (another handle's
write, or a commit that failed, makes it read the store again). With ``output="final"``
a batch's changes go to the store as one row of the change log (:mod:`.winlog`), folded
into the windows table now and then; the due windows are found in memory.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

import pyarrow as pa

from ackflow.state import columns, winlog
from ackflow.state.columns import Columns, rows_of, slots_of
from ackflow.state.spec import WindowSpec
from ackflow.windows import Hopping, Tumbling

#: a window's row, new or changed: an upsert (a third cheaper than INSERT OR REPLACE's
#: delete and insert); a changed window is tried again if its sink had refused it
PUT_WINDOW = (
    'INSERT INTO windows (op, gk, start, "end", nrows, filled, dirty, state) VALUES (?, ?, ?, ?, ?, ?, 1, ?) '
    'ON CONFLICT (op, gk, start) DO UPDATE SET "end" = excluded."end", nrows = excluded.nrows, '
    "filled = excluded.filled, dirty = 1, state = excluded.state, error = NULL"
)
#: open tumbling and hopping windows the driver keeps in memory per operator (their end,
#: rows, key values and accumulators); an operator with more is read from the store per batch
HOLD_MAX = 100_000
#: one more write of an operator's windows (a handle that counted fewer reads them again)
COUNT_WRITE = "INSERT INTO writes (op, n) VALUES (?, 1) ON CONFLICT (op) DO UPDATE SET n = writes.n + 1"
Slot = tuple[str, int]  # a window: (key text, start)
Held = tuple[int, int, tuple[Any, ...], list[Any]]  # an open window: (end, rows, values, accs)
#: batches to merge in Python before trying Arrow columns again (after a batch they could not take)
COLUMNS_AGAIN = 32


class Due(NamedTuple):
    """A window ready to be written: its row and what to do after (a tuple: a batch
    closes thousands of windows, and a tuple is made several times faster)."""

    gk: str
    start: int
    end: int
    values: tuple[Any, ...]
    accs: list[Any]
    close: bool  # delete after writing (final), else only clear ``dirty``


class DueTable(Sequence[Due]):
    """Due windows held in columns: their rows as an Arrow table (:attr:`table`, from
    which the output's rows are made without a Python value per cell), each a
    :class:`Due` (closing) only when asked for."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self._rows: list[Due] | None = None

    def __len__(self) -> int:
        return int(self.table.num_rows)

    @overload
    def __getitem__(self, i: int) -> Due: ...
    @overload
    def __getitem__(self, i: slice) -> list[Due]: ...
    def __getitem__(self, i: int | slice) -> Due | list[Due]:
        return self.rows()[i]

    def __iter__(self) -> Iterator[Due]:
        return iter(self.rows())

    def rows(self) -> list[Due]:
        if self._rows is None:
            self._rows = [Due(r[0], r[1], r[2], r[4], r[5], True) for r in rows_of(self.table)]
        return self._rows

    def slots(self) -> list[Slot]:
        return slots_of(self.table)


class HeldWindows:
    """The held windows' part of the store's handle (its connection ``db``, ``lock``)."""

    db: Any
    lock: Any
    _open: dict[str, dict[Slot, Held] | Columns | None]
    _no_columns: dict[str, int]  # op -> batches left before holding its windows in columns again
    _version: dict[str, int]
    _counted: str | None
    _refused: dict[str, set[Slot]]
    _logged: dict[str, list[int]]
    _touched: dict[str, set[Slot]]
    _tabled: dict[str, set[Slot]]
    _first_end: dict[str, int]  # op -> at most the earliest end of a held window not refused

    def _held(self, op: str) -> dict[Slot, Held] | Columns | None:
        """Inside a transaction: the operator's open windows, read once (the change log
        folded in first) and then kept in step with each commit; read again whenever the
        store's count of writes to them is not the one this handle made (another
        process, a commit that failed); None if there are more than :data:`HOLD_MAX`."""
        in_step, version = self._count_write(op)
        if not in_step:  # (one read: one row past HOLD_MAX says there are too many)
            self._forget_held(op)
            self._counted = op  # (forgetting cleared it: this transaction counted the write)
            if self._fold(op)[0]:  # (the fold counted a write of its own)
                version += 1
            rows = self.db.execute(
                'SELECT gk, start, "end", nrows, state, error IS NOT NULL FROM windows WHERE op = ? LIMIT ?',
                (op, HOLD_MAX + 1),
            ).fetchall()
            held: dict[Slot, Held] | None = None
            if len(rows) <= HOLD_MAX:
                held = {}
                for g, st, e, r, b, _ in rows:
                    values, accs = pickle.loads(bytes(b))
                    held[(g, int(st))] = (int(e), int(r), tuple(values), accs)
            self._refused[op] = {(g, int(st)) for g, st, _, _, _, bad in rows if bad}
            self._open[op], self._version[op] = held, version
            if held is not None:  # (what a fold from memory writes and deletes)
                self._touched[op], self._tabled[op] = set(), set(held)
        return self._open[op]

    def _fold(self, op: str) -> tuple[bool, bool]:
        """Inside a write transaction: the change log folded into the windows table:
        from memory when the handle holds the windows in step with the store (the ones
        changed since the last fold), else by replaying the log. A fold that changed
        anything counts a write: another handle that holds these windows must read them
        again (what it knows of the table's rows is stale). Returns whether it folded
        anything, and whether the handle was in step. The transaction that holds it
        forgets what the handle holds if it fails (what it knows of the table changed)."""
        held, touched, tabled = self._open.get(op), self._touched.get(op), self._tabled.get(op)
        row = self.db.execute("SELECT n FROM writes WHERE op = ?", (op,)).fetchone()
        in_step = (int(row[0]) if row else 0) == self._version.get(op)
        if isinstance(held, Columns) and in_step:  # (its flags say what changed)
            winlog.write(self.db, op, PUT_WINDOW, held.dirty(), held.gone_now())
            held.folded()
            self.db.execute(COUNT_WRITE, (op,))
            return True, in_step
        if isinstance(held, dict) and touched is not None and tabled is not None and in_step:
            puts = [(gk, st, *held[(gk, st)]) for gk, st in touched if (gk, st) in held]
            gone = [slot for slot in touched if slot not in held and slot in tabled]
            winlog.write(self.db, op, PUT_WINDOW, puts, gone)
            self._touched[op] = set()
        else:
            net = winlog.compact(self.db, op, PUT_WINDOW)
            if not net:
                return False, in_step
            puts = [c for c in net.values() if c is not None]
            gone = [slot for slot, c in net.items() if c is None]
            self._touched.pop(op, None)  # (not in step: it reads them again before folding from memory)
            self._tabled.pop(op, None)
        if tabled is not None:
            tabled.difference_update(gone)
            tabled.update((c[0], c[1]) for c in puts)
        self.db.execute(COUNT_WRITE, (op,))
        return True, in_step

    def _fold_now(self, op: str) -> None:
        """Outside a transaction: the log folded in, in a transaction of its own."""
        with self.lock:
            try:
                folded, in_step = self._write(lambda: self._fold(op))
            except BaseException:
                self._forget_held(op)  # (what it knows of the table may be wrong now)
                raise
            self._logged[op] = [0, 0]
            if folded and in_step and op in self._version:
                self._version[op] += 1  # (its own write)

    def _write_counted(self, op: str, work: Any) -> Any:
        """``work()`` in one write transaction that counts a write of ``op``'s windows
        (another handle that holds them reads them again); this handle stays in step if
        it was, and forgets what it holds if the transaction fails."""
        with self.lock:
            in_step = self._memory(op) is not None

            def counted() -> Any:
                out = work()
                self.db.execute(COUNT_WRITE, (op,))
                return out

            try:
                out = self._write(counted)
            except BaseException:
                self._forget_held(op)
                raise
            if in_step:
                self._version[op] += 1
            return out

    def _folded(self, op: str) -> None:
        """Outside a transaction: the log folded in, if it holds anything (before a
        statement that reads or changes the windows table itself)."""
        with self.lock:
            if self.db.execute("SELECT 1 FROM window_log WHERE op = ? LIMIT 1", (op,)).fetchone() is None:
                return
            self._fold_now(op)

    def _write(self, work: Any) -> Any:
        """``work()`` in one write transaction."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                out = work()
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return out

    def settle(self, spec: WindowSpec) -> bool:
        """Fold the operator's change log into the windows table once it holds
        :data:`~.winlog.COMPACT_EVERY` rows or :data:`~.winlog.COMPACT_CHANGES` changes
        (the window sink calls it after writing results). Returns whether it did."""
        rows, changes = self._logged.get(spec.name, (0, 0))
        if rows < winlog.COMPACT_EVERY and changes < winlog.COMPACT_CHANGES:
            return False
        self._fold_now(spec.name)
        return True

    def _memory(self, op: str) -> dict[Slot, Held] | Columns | None:
        """The operator's open windows as this handle holds them, if they are in step
        with the store (its count of writes); else None (read the store)."""
        held = self._open.get(op)
        if held is None:
            return None
        row = self.db.execute("SELECT n FROM writes WHERE op = ?", (op,)).fetchone()
        if (int(row[0]) if row else 0) != self._version.get(op):
            self._forget_held(op)
            return None
        return held

    @staticmethod
    def _logs(spec: WindowSpec) -> bool:
        """Whether the operator's changes go into the change log (:mod:`.winlog`)."""
        return isinstance(spec.kind, (Tumbling, Hopping)) and spec.output == "final"

    def _count_write(self, op: str) -> tuple[bool, int]:
        """Inside a transaction that writes ``op``'s windows: count the write. Returns
        whether what this handle holds of them was in step before it, and the count."""
        row = self.db.execute("SELECT n FROM writes WHERE op = ?", (op,)).fetchone()
        version = int(row[0]) if row else 0
        self.db.execute(COUNT_WRITE, (op,))
        self._counted = op
        return op in self._open and self._version.get(op) == version, version

    def _in_step(self, op: str, put: dict[Slot, Held] | Columns, gone: Any, logged: int = 0) -> None:
        """After a commit that wrote ``op``'s windows (and counted one write); ``logged``:
        the changes it wrote to the change log (in one row), if any."""
        held = self._open.get(op)
        counted, self._counted = self._counted, None
        if logged:
            tally = self._logged.setdefault(op, [0, 0])
            tally[0] += 1
            tally[1] += logged
        if held is None or counted != op:
            return
        if isinstance(held, Columns) or isinstance(put, Columns):
            self._in_step_columns(op, held, put, gone)
            return
        assert isinstance(put, dict)
        touched = self._touched.get(op)
        if touched is not None and logged:
            touched.update(put)
            touched.update(gone)
        held.update(put)
        if put and op in self._first_end:
            self._first_end[op] = min(self._first_end[op], min(w[0] for w in put.values()))
        refused = self._refused.setdefault(op, set())
        refused.difference_update(put)  # (a window changed is tried again, as in the table)
        for slot in gone:
            held.pop(slot, None)
            refused.discard(slot)
        self._version[op] += 1
        if len(held) > HOLD_MAX:
            self._open[op] = None

    def _in_step_columns(
        self, op: str, held: dict[Slot, Held] | Columns, put: dict[Slot, Held] | Columns, gone: Any
    ) -> None:
        """:meth:`_in_step` for windows held in columns: a merge's new columns replace
        them; written windows are dropped."""
        refused = self._refused.setdefault(op, set())
        if isinstance(put, Columns):
            changed, put.changed = put.changed, None
            if refused and changed is not None:
                refused.difference_update(slots_of(changed))
            self._open[op] = held = put
            self._touched.pop(op, None)  # (its flags hold them now)
            self._tabled.pop(op, None)
        else:
            assert isinstance(held, Columns)
            assert not put, "a dict merged into windows held in columns"
            held.drop(list(gone))
            refused.difference_update(gone)
        self._version[op] += 1
        if len(held) > HOLD_MAX:
            self._open[op] = None

    def _merge_columns(
        self, spec: WindowSpec, held: dict[Slot, Held] | Columns, parts: list[Any]
    ) -> Columns | None:
        """The batch's partials merged into the held windows in Arrow columns (the
        result is held once the batch commits; :mod:`.columns`); None: merge in Python
        (a task folded row by row, types that differ, ...), the windows held as a dict."""
        op = spec.name
        tables = [p.table for p in parts if p.table is not None]
        wait = self._no_columns.get(op, 0)
        if not columns.ENABLED or not tables or len(tables) < sum(1 for p in parts if p.has_slots()):
            return None
        if isinstance(held, dict):
            if wait > 0:
                self._no_columns[op] = wait - 1
                return None
            touched, tabled = self._touched.get(op), self._tabled.get(op)
            made = None
            if touched is not None and tabled is not None:
                made = Columns.from_dict(held, tables[0].schema, touched, tabled)
            if made is None:
                self._no_columns[op] = COLUMNS_AGAIN
                return None
            held = made
        return held.merge(tables, [a.fn for a in spec.aggs])

    def _as_dict(self, op: str) -> dict[Slot, Held] | None:
        """The operator's held windows as a dict (from columns, if they were: its
        touched and tabled windows from their flags)."""
        held = self._open.get(op)
        if not isinstance(held, Columns):
            return held
        self._touched[op] = held.slots("__d") | set(held.gone)
        self._tabled[op] = held.slots("__t") | set(held.gone)
        self._first_end.pop(op, None)
        self._no_columns[op] = COLUMNS_AGAIN
        self._open[op] = out = held.to_dict()
        return out

    def _forget_held(self, op: str) -> None:
        """What is held of ``op``'s windows may differ from the store: read it again."""
        self._open.pop(op, None)
        self._version.pop(op, None)
        self._refused.pop(op, None)
        self._touched.pop(op, None)
        self._tabled.pop(op, None)
        self._first_end.pop(op, None)
        self._no_columns.pop(op, None)
        self._counted = None

    def _due_columns(self, spec: WindowSpec, held: Columns, bound: int | None, limit: int) -> Sequence[Due]:
        """:meth:`_due_held` from windows held in columns: their ends filtered in Arrow."""
        if bound is None:
            return []
        return DueTable(held.ready(bound, limit, self._refused.get(spec.name, set())))

    def _due_held(
        self, spec: WindowSpec, held: dict[Slot, Held] | Columns, bound: int | None, limit: int
    ) -> Sequence[Due]:
        """:meth:`due` from the windows the handle holds (tumbling and hopping, final)."""
        if isinstance(held, Columns):
            return self._due_columns(spec, held, bound, limit)
        first = self._first_end.get(spec.name)
        if bound is None or (first is not None and bound < first):
            return []  # (most calls: nothing closed since the last; no walk over every window)
        refused = self._refused.get(spec.name, set())
        ready, earliest = [], None
        for (gk, start), (end, _, _, _) in held.items():
            if (gk, start) in refused:
                continue
            if end <= bound:
                ready.append((end, gk, start))
            if earliest is None or end < earliest:
                earliest = end
        if earliest is not None:
            self._first_end[spec.name] = earliest
        ready = sorted(ready)[:limit]
        return [
            Due(gk, start, end, held[(gk, start)][2], held[(gk, start)][3], True) for end, gk, start in ready
        ]
