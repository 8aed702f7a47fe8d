"""The open windows' change log: a batch's changed windows as one row, not one per window.

Tumbling and hopping windows written once (``output="final"``) are held by the driver
between batches (:class:`~ackflow.state.store.WindowStore`). A batch's changes to them go
into ``window_log`` as one row (operator, sequence number, the changed windows pickled
together), in the batch's own transaction: the same durability as a row written per
window, at a fraction of the cost (a SQLite upsert costs 5-8 µs a window; the row, about
one). The results written out add a row of deletions. A window that opens and closes
between two compactions never touches the windows table.

The windows table plus the log, replayed in order, is the state. :func:`compact` folds
the log into the table and empties it, in the caller's transaction: every
:data:`COMPACT_EVERY` rows (or :data:`COMPACT_CHANGES` changed windows), when a handle
closes, and before anything reads or changes the table itself (a handle that is not in
step with the store, a result the output refused, the idle close of a handle that does
not hold the windows). ``ackflow state show`` replays the log over what it reads
(:func:`folded`): it never writes. A crash anywhere leaves either the whole row or none
(one transaction), and a compaction cut short is rolled back whole: the next one folds
the same rows again.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from ackflow import faults

#: fold the log into the windows table after this many rows ...
COMPACT_EVERY = 128
#: ... or once its rows hold this many changed windows
COMPACT_CHANGES = 400_000

#: a window's change: (key text, start, end, rows, key values, accumulators)
Change = tuple[str, int, int, int, tuple[Any, ...], list[Any]]
Slot = tuple[str, int]


def append(db: Any, op: str, puts: Sequence[Change] | Any, gone: Sequence[Slot]) -> None:
    """Inside a transaction: one row holding ``puts`` (windows as they are now: changes,
    or an Arrow table of them, :mod:`.columns`) and ``gone`` (windows written out and
    deleted)."""
    seq = db.execute("SELECT coalesce(max(seq), 0) + 1 FROM window_log WHERE op = ?", (op,)).fetchone()[0]
    changes: Any = list(puts) if not hasattr(puts, "num_rows") else {"arrow": _ipc(puts)}
    blob = pickle.dumps((changes, list(gone)), protocol=pickle.HIGHEST_PROTOCOL)
    db.execute("INSERT INTO window_log (op, seq, changes) VALUES (?, ?, ?)", (op, int(seq), blob))


def _ipc(table: Any) -> bytes:
    """A table as Arrow's IPC stream (a format that outlives a pyarrow version; a pickled
    table may not)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def replay(db: Any, op: str) -> dict[Slot, Change | None]:
    """The log's net changes, oldest row first: per window its last state, or None if it
    was deleted last. Empty when the log is."""
    net: dict[Slot, Change | None] = {}
    rows = db.execute("SELECT changes FROM window_log WHERE op = ? ORDER BY seq", (op,)).fetchall()
    for (blob,) in rows:
        puts, gone = pickle.loads(bytes(blob))
        if isinstance(puts, dict):  # the windows held in Arrow columns changed: a table
            import pyarrow as pa

            from ackflow.state.columns import rows_of

            puts = rows_of(pa.ipc.open_stream(puts["arrow"]).read_all())
        for change in puts:
            net[(change[0], change[1])] = tuple(change)  # type: ignore[assignment]
        for gk, start in gone:
            net[(gk, start)] = None
    return net


def compact(db: Any, op: str, put_sql: str) -> dict[Slot, Change | None]:
    """Inside a write transaction: fold ``op``'s log into the windows table (``put_sql``:
    the store's upsert of a window) and empty it. Returns the net changes folded."""
    net = replay(db, op)
    if net:
        write(
            db,
            op,
            put_sql,
            [c for c in net.values() if c is not None],
            [s for s, c in net.items() if c is None],
        )
    return net


def write(db: Any, op: str, put_sql: str, puts: Sequence[Change], gone: Sequence[Slot]) -> None:
    """Inside a write transaction: ``puts`` upserted, ``gone`` deleted, the log emptied.
    A driver that holds the windows in step with the store writes them from memory
    (the windows changed since the last fold), without reading the log back."""
    if puts:
        rows = [
            (op, gk, start, end, n, 0, pickle.dumps((tuple(values), accs)))
            for gk, start, end, n, values, accs in puts
        ]
        db.executemany(put_sql, rows)
    if gone:
        db.executemany("DELETE FROM windows WHERE op = ? AND gk = ? AND start = ?", [(op, *s) for s in gone])
    faults.point("state.compact")
    db.execute("DELETE FROM window_log WHERE op = ?", (op,))


def folded(db: Any, op: str) -> list[tuple[str, int, int, int, int, bytes, str | None]] | None:
    """``op``'s windows as the table holds them with the log replayed over them, each
    ``(gk, start, end, rows, dirty, state, error)``; None when the log is empty (the
    table alone is the state). Reads only."""
    try:
        net = replay(db, op)
    except Exception as e:  # (a store written before the log existed has no such table)
        if "window_log" in str(e):
            return None
        raise
    if not net:
        return None
    rows = {
        (gk, int(start)): (gk, int(start), int(end), int(n), int(dirty), bytes(state), error)
        for gk, start, end, n, dirty, state, error in db.execute(
            'SELECT gk, start, "end", nrows, dirty, state, error FROM windows WHERE op = ?', (op,)
        )
    }
    for slot, change in net.items():
        if change is None:
            rows.pop(slot, None)
        else:
            gk, start, end, n, values, accs = change
            rows[slot] = (gk, start, end, n, 1, pickle.dumps((tuple(values), accs)), None)
    return list(rows.values())
